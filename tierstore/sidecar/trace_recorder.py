"""TraceRecorder: log the row ids a sidecar serves, for `tierstore bench cache --trace`.

One call of `record(table, ids)` is one served plan (one step of one client);
per table the recorder keeps the ids in serving order and the length of each
call, and writes the layout `bench cache --trace` reads:

    <stem>.<table>.npy        int64 row ids, calls concatenated
    <stem>.<table>.steps.npy  int64 ids per call
    <stem>.<table>.json       {"sample", "recorded", "dropped", "n_ids"?}

A trace holds every row id served, so it is private: the directory must be a
real directory (not a symlink) of this user that group and others cannot write
to, checked at construction and again through its fd on every write; each file
is created 0600 under a fresh name (O_EXCL|O_NOFOLLOW) and renamed into place,
so a link planted at any name is replaced, its target never written.

Bounded: at most `max_ids` ids per table are kept (later calls are counted as
dropped, never buffered). Sampled: with `sample` < 1 only ids whose hash falls
below the rate are kept (spatial sampling, as SHARDS does: every access of a
kept id is logged, so its reuse pattern survives), and the bench scales its
cache sizes by the same rate. `record` is a few numpy ops on the call's ids.

    rec = TraceRecorder("/var/log/ts/trace.npy", max_ids=50_000_000, sample=0.1)
    rec.record("l1", ids)        # in the serving path, after the plan succeeded
    rec.close()                  # or periodically: rec.flush()
"""
from __future__ import annotations

import json
import os
import re
import secrets
import stat
import threading
import time
from pathlib import Path

import numpy as np

from tierstore.errors import InvalidArgument
from tierstore.jit import mix64

__all__ = ["TraceRecorder"]

_MIX = np.uint64(0x9E3779B97F4A7C15)


class _TableLog:
    def __init__(self):
        self.chunks: list[np.ndarray] = []
        self.lengths: list[int] = []
        self.kept = self.dropped = 0
        self.n_ids: int | None = None


class TraceRecorder:
    """Per-table access logs of at most `max_ids` ids each, spatially sampled at `sample`.

    path: `.npy` path whose stem names the files (`trace.npy` -> `trace.l1.npy`).
    max_ids: ids kept per table (8 bytes each in memory until written).
    sample: share of the id space logged, in (0, 1].
    flush_s: `record` rewrites the files when this many seconds passed since
        the last write (0: only on flush/close).
    Thread-safe: serving threads may call `record` concurrently.
    """

    def __init__(self, path: str | Path, max_ids: int = 16_000_000, sample: float = 1.0, flush_s: float = 0.0):
        p = Path(path)
        if not p.name.endswith(".npy") or len(p.name) <= 4:
            raise InvalidArgument(f"trace path {p} must end in .npy (e.g. trace.npy -> trace.<table>.npy)")
        os.close(_open_dir(p.parent))  # refuse an unsafe directory at start, not at the first flush
        if max_ids < 1 or not 0.0 < sample <= 1.0 or flush_s < 0:
            raise InvalidArgument(f"TraceRecorder needs max_ids >= 1, sample in (0, 1] and flush_s >= 0; "
                                  f"got {max_ids}, {sample}, {flush_s}")
        self.stem, self.max_ids, self.sample, self.flush_s = p.parent / p.name[:-4], int(max_ids), float(sample), flush_s
        self._cut = np.uint64(min(int(sample * 2.0**64), 2**64 - 1))
        self._logs: dict[str, _TableLog] = {}
        self._lock = threading.Lock()
        self._last_write = time.monotonic()

    def record(self, table: str, ids, n_ids: int | None = None) -> None:
        """Log one served call's ids (any integer array; copied)."""
        ids = np.asarray(ids).reshape(-1)
        if ids.dtype.kind not in "iu":
            raise InvalidArgument(f"TraceRecorder.record: ids must be integers, got {ids.dtype}")
        ids = ids.astype(np.int64)
        if self.sample < 1.0:
            ids = ids[_hash(ids) < self._cut]
        with self._lock:
            log = self._logs.setdefault(table, _TableLog())
            if n_ids is not None:
                log.n_ids = int(n_ids)
            room = self.max_ids - log.kept
            if ids.size > room:  # keep whole calls: a cut call would read as a short step
                log.dropped += ids.size
            elif ids.size:
                log.chunks.append(ids)
                log.lengths.append(ids.size)
                log.kept += ids.size
            due = self.flush_s and time.monotonic() - self._last_write >= self.flush_s
        if due:
            self.flush()

    def flush(self) -> list[Path]:
        """Write every table's log so far; returns the .npy paths written."""
        with self._lock:
            snap = {t: (np.concatenate(l.chunks) if l.chunks else np.zeros(0, np.int64),
                        np.asarray(l.lengths, dtype=np.int64), l.dropped, l.n_ids)
                    for t, l in self._logs.items()}
            for t, l in self._logs.items():  # one array per table from now on: flushes stay O(new)
                l.chunks = [snap[t][0]] if snap[t][0].size else []
            self._last_write = time.monotonic()
        written = []
        dir_fd = _open_dir(self.stem.parent)
        try:
            for table, (ids, lengths, dropped, n_ids) in snap.items():
                base = f"{self.stem.name}.{_safe(table)}"
                _save(dir_fd, base + ".npy", lambda f, a=ids: np.save(f, a))
                _save(dir_fd, base + ".steps.npy", lambda f, a=lengths: np.save(f, a))
                meta = {"table": table, "sample": self.sample, "recorded": int(ids.size), "dropped": int(dropped)}
                if n_ids is not None:
                    meta["n_ids"] = n_ids
                _save(dir_fd, base + ".json", lambda f, m=meta: f.write(json.dumps(m, indent=1).encode()))
                written.append(self.stem.parent / (base + ".npy"))
        finally:
            os.close(dir_fd)
        return written

    def close(self) -> list[Path]:
        return self.flush()

    def stats(self) -> dict:
        with self._lock:
            return {t: {"recorded": l.kept, "dropped": l.dropped} for t, l in self._logs.items()}


def _hash(ids: np.ndarray) -> np.ndarray:
    """splitmix64 of each id: a uniform uint64, so `< rate * 2^64` keeps a `rate` share of ids."""
    return mix64(ids.astype(np.uint64) + _MIX)


def _safe(table: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", table)


def _open_dir(d: Path) -> int:
    """An fd of directory `d`, refused unless it is ours and only we can write to it:
    anyone else who can write there could plant a link at a trace's name."""
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InvalidArgument(f"trace directory {d} does not exist; create it: mkdir -m 700 {d}") from None
    except OSError:  # ELOOP: the last component is a symlink; ENOTDIR: not a directory
        kind = "a symlink" if os.path.islink(d) else "not a directory"
        raise InvalidArgument(f"trace directory {d} is {kind}; record into a real directory of your own "
                              f"(mkdir -m 700 DIR)") from None
    st = os.fstat(fd)
    why = (f"is owned by uid {st.st_uid}, not this user (uid {os.getuid()}); record into a directory of your own"
           if st.st_uid != os.getuid() else
           f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); run chmod go-w {d} or record "
           f"into a private directory (mkdir -m 700 DIR)" if st.st_mode & 0o022 else None)
    if why:
        os.close(fd)
        raise InvalidArgument(f"trace directory {d} {why}")
    return fd


def _save(dir_fd: int, name: str, write) -> None:
    """write(file) into a new 0600 file of dir_fd, renamed to `name` when complete: a reader
    never sees half a file, and a link already at `name` is replaced, not followed."""
    tmp = f".{name}.{secrets.token_hex(6)}.tmp"  # unguessable: nothing can be planted there first
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        raise
