"""A version's segment files as a reader holds them open: one descriptor a segment (or why it
cannot be read), format 1's row-sum file, and with O_DIRECT a second set of descriptors.

Row i lives in segment i // segment_rows at record i % segment_rows (TableVersion): where
a batch of ids falls is cut here (`segment_of`), once, for the row reads, the sums read
beside them and the block path alike. A segment that is missing or not a regular file
is kept as its reason (`why`), so a read of its rows is a ChecksumError naming it
(`error`, the one place that error is made for a row), never a failed open at a miss.
Nothing is mapped: every read is a pread or an io_uring read at an offset.
"""
from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import numpy as np
import xxhash

from tierstore.errors import ChecksumError
from tierstore.store.version import TableVersion
from tierstore.tiers.nvme import rowsum
from tierstore.tiers.nvme.direct_io import DirectFiles, _Scratch, thread_buffer

log = logging.getLogger("tierstore.tiers.nvme.reader")

__all__ = ["SegmentFiles", "PAGE_CACHE_GAP", "SUM_BYTES"]

# through the page cache, records this close share a read (the bytes between read too): a read
# costs about what copying a few KiB does, so misses that fall near each other (a table the
# page cache holds, a prefill's many misses) take fewer reads. O_DIRECT: none (each sector is
# the device's work)
PAGE_CACHE_GAP = 2048
SUM_BYTES = 8  # a row sum: format 2's record ends with it, format 1's row-sum file is one a row
_HASHED = _Scratch()  # this thread's buffer for hashing the row-sum file at open


def _open_segment(path: Path) -> tuple[int | None, str | None]:
    """(fd, None) for a regular file, else (None, why). O_NONBLOCK: opening a
    FIFO put where a segment was must not wait for a writer; a regular file's
    reads may then block (io_uring queues a read of a page not in the page
    cache rather than answering EAGAIN). Advised random: a miss reads its own
    pages, no read-ahead around them (a block read asks for its whole range)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, "missing"
    mode = os.fstat(fd).st_mode
    if stat.S_ISREG(mode):
        os.set_blocking(fd, True)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return fd, None
    os.close(fd)
    kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "not a file"
    return None, f"not a regular file ({kind}); restore it or re-ingest the table"


def _xxh3_of(fd: int, nbytes: int) -> int | None:
    """xxh3-64 of the first `nbytes` of the file at fd, read in pieces; None when it is shorter."""
    h, got = xxhash.xxh3_64(), 0
    view = memoryview(thread_buffer(_HASHED, 1 << 20))
    while got < nbytes:
        n = os.preadv(fd, [view[:min(len(view), nbytes - got)]], got)
        if n == 0:
            return None
        h.update(view[:n])
        got += n
    return h.intdigest()


class SegmentFiles:
    """The open files of one version (data_dir: what its segment paths are relative to).

    `fds[s]`: segment s through the page cache, or None with `why[s]` saying why it is not
    there. `direct`: the O_DIRECT descriptors (direct_io.DirectFiles) when direct_io, else
    None; `row_fds`, `align` and `gap` are what row reads go through (O_DIRECT's
    descriptors and sector alignment, or the page cache's and each record's own bytes,
    -1 for a segment not there). Format 1: `sums_fd` is the row-sum file when it holds
    the manifest's sums (its xxh3 checked once here), else None with `row_sums_error`
    saying why. InvalidArgument when the filesystem refuses O_DIRECT (DirectFiles)."""

    def __init__(self, data_dir, version: TableVersion, key: rowsum.RowKey, direct_io: bool = False):
        self.data_dir, self.version = Path(data_dir), version
        self.fds: list[int | None] = []
        self.why: list[str | None] = []
        self.sums_fd, self.sums_path, self.row_sums_error = None, None, None
        self.direct = None
        for rel in version.segments:
            fd, why = _open_segment(self.data_dir / rel)
            self.fds.append(fd)
            self.why.append(why)
        try:
            self.sums_path, self.row_sums_error = self._open_row_sums(key)
            if direct_io:
                self.direct = DirectFiles([self.data_dir / rel if fd is not None else None
                                           for rel, fd in zip(version.segments, self.fds)])
        except BaseException:
            self.close()
            raise
        fds, self.align, self.gap = ((self.direct.fds, self.direct.align, 0) if self.direct is not None
                                     else (self.fds, 1, PAGE_CACHE_GAP))
        self.row_fds = np.array([-1 if fd is None else fd for fd in fds], dtype=np.int64)
        self.page_fds = np.array([-1 if fd is None else fd for fd in self.fds], dtype=np.int64)
        self.all_present = bool((self.row_fds >= 0).all())

    def _open_row_sums(self, key: rowsum.RowKey) -> tuple[Path | None, str | None]:
        """Format 1: open the row-sum file (sums_fd) if it holds the manifest's sums (its xxh3
        over the first 8 B x rows); (its path, why it is not usable or None)."""
        v = self.version
        meta = v.row_sums
        if not meta:
            return None, None
        where = f"table {v.table!r} version {v.number}"
        if meta.get("algo") != key.algo:
            known = "" if meta.get("algo") in rowsum.ALGOS else f"; this build knows {list(rowsum.ALGOS)}"
            return None, (f"{where}: row checksums use {meta.get('algo')!r}, yet its row_salt makes them "
                          f"{key.algo!r}{known}")
        path = self.data_dir / Path(v.segments[0]).parent / meta["file"]
        fd, why = _open_segment(path)
        if fd is None:
            err = f"{where}: row checksum file {path} is {why}"
        elif _xxh3_of(fd, v.rows * SUM_BYTES) != int(meta["xxh3"]):
            os.close(fd)
            err = f"{where}: row checksum file {path} is corrupt or truncated"
        else:
            self.sums_fd = fd
            return path, None
        log.warning("%s; rows are verified by their 4 KiB blocks instead (slower); re-ingest to restore", err)
        return path, err

    def segment_of(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the segment of each id, its record number in that segment): the one place ids
        are cut by segment."""
        sr = self.version.segment_rows
        seg = ids // sr
        return seg, ids - seg * sr

    def where(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where sorted `ids` are read as rows: (their segments' row descriptors, one a row, or
        the one for a table of one segment; each row's record number in its segment)."""
        if self.row_fds.size == 1:
            return self.row_fds, ids
        seg, at = self.segment_of(ids)
        return self.row_fds[seg], at

    def check_present(self, ids: np.ndarray) -> None:
        """ChecksumError naming the first of sorted `ids` whose segment is not there (missing,
        not a regular file)."""
        if self.all_present or ids.size == 0:
            return
        seg, _ = self.segment_of(ids)
        gone = np.flatnonzero(self.row_fds[seg] < 0)
        if gone.size:
            row = int(ids[gone[0]])
            raise self.error(row, self.gone(row))

    def gone(self, row: int) -> str:
        """Why `row`'s record could not be read whole: its segment is not there, or is truncated."""
        s = row // self.version.segment_rows
        return f"segment {self.version.segments[s]} is {self.why[s] or 'truncated'}"

    def error(self, row: int, why: str = "") -> ChecksumError:
        """The ChecksumError of `row` (its block named, err.row = row): `why`, or a row sum mismatch."""
        v = self.version
        return ChecksumError(v.table, v.number, row // v.block_rows, f"row {row}" + (f": {why}" if why else ""),
                             row=row)

    def close(self) -> None:
        fds, self.fds = self.fds, []
        sums_fd, self.sums_fd = self.sums_fd, None
        for fd in fds + [sums_fd]:
            if fd is not None:
                os.close(fd)
        if self.direct is not None:
            self.direct.close()
