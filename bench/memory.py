"""What a benchmark's competitor holds in memory: page-cache eviction and residency
of files, memory cgroups that cap a process (v2 memory.max, else v1), and the
footprint a cache-mode sidecar's reads cause beyond its DRAM budget."""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

__all__ = ["drop_page_cache", "MemoryCgroup", "resident_bytes", "proc_memory", "footprint"]


def drop_page_cache(paths) -> str:
    """Evict `paths` from the page cache; returns how ('posix_fadvise(DONTNEED)')."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "posix_fadvise(POSIX_FADV_DONTNEED) on the segment files"


class MemoryCgroup:
    """A child memory cgroup capped at `limit` bytes, or `.error` saying why not."""

    _n = 0

    def __init__(self, limit: int):
        self.limit, self.path, self.kind, self.error = int(limit), None, None, None
        MemoryCgroup._n += 1
        name = f"tierstore-bench-{os.getpid()}-{MemoryCgroup._n}"
        tried = []
        for kind, base, limit_file in self._candidates():
            d = base / name
            try:
                d.mkdir()
                (d / limit_file).write_text(str(self.limit))
                self.path, self.kind = d, kind
                return
            except OSError as e:
                tried.append(f"{kind} at {base}: {e.strerror or e}")
                try:
                    d.rmdir()
                except OSError:
                    pass
        self.error = "no memory cgroup could be made (" + ("; ".join(tried) or "no cgroup filesystem found") + ")"

    @staticmethod
    def _candidates():
        root = Path("/sys/fs/cgroup")
        for v2 in (root, root / "unified"):
            try:
                if "memory" in (v2 / "cgroup.controllers").read_text().split():
                    own = _own_cgroup("")
                    yield "v2", v2 / own.lstrip("/") if own else v2, "memory.max"
            except OSError:
                pass
        own = _own_cgroup("memory")
        if (root / "memory").is_dir() and own is not None:
            yield "v1", root / "memory" / own.lstrip("/"), "memory.limit_in_bytes"

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def peak(self) -> int | None:
        for f in ("memory.peak", "memory.max_usage_in_bytes"):
            try:
                return int((self.path / f).read_text())
            except (OSError, ValueError):
                continue
        return None

    def close(self) -> None:
        if self.path is not None:
            for _ in range(50):  # processes leave the cgroup asynchronously after exit
                try:
                    self.path.rmdir()
                    return
                except OSError:
                    time.sleep(0.05)


def _own_cgroup(controller: str) -> str | None:
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, ctrls, path = line.split(":", 2)
            if (controller == "" and ctrls == "") or controller in ctrls.split(","):
                return path
    except OSError:
        pass
    return None


def resident_bytes(paths) -> int:
    """Bytes of `paths` now in the page cache (mincore over a fresh map; mapping
    a file faults nothing in)."""
    import ctypes
    import mmap as _mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    total = 0
    for p in paths:
        size = os.path.getsize(p)
        if size == 0:
            continue
        with open(p, "rb") as f, _mmap.mmap(f.fileno(), size, prot=_mmap.PROT_READ) as m:
            vec = np.zeros(-(-size // _mmap.PAGESIZE), dtype=np.uint8)
            view = np.frombuffer(m, np.uint8)
            rc = libc.mincore(ctypes.c_void_p(view.ctypes.data), size, vec.ctypes.data)
            del view  # the map cannot close while an array exports it
            if rc != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            total += int((vec & 1).sum()) * _mmap.PAGESIZE
    return total


def proc_memory(pid: int) -> dict:
    """RssAnon / RssFile / RssShmem of a process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("RssAnon", "RssFile", "RssShmem"):
            out[key] = int(line.split()[1]) * 1024
    return out


def footprint(pid: int, seg_paths, budget: int, start: dict, pinned: int = 0) -> dict:
    """What a cache-mode sidecar's reads cost in memory beyond its arena (= the
    budget, in /dev/shm): its heap growth since it started serving, and the
    segment pages it brought into the page cache (`pinned`: there before).
    The process's fixed size at start (interpreter, libraries, the id map and
    row checksums loaded at open) is reported beside it."""
    m = proc_memory(pid)
    cache = max(0, resident_bytes(seg_paths) - pinned)
    growth = m.get("RssAnon", 0) - start.get("RssAnon", 0)
    return {"rss_anon_at_start": start.get("RssAnon", 0), "rss_file_at_start": start.get("RssFile", 0),
            "rss_anon": m.get("RssAnon", 0), "rss_file": m.get("RssFile", 0), "heap_growth": growth,
            "segment_page_cache": cache, "dram_budget": budget, "over_budget": growth + cache}
