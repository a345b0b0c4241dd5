"""O_DIRECT row reads: the sectors holding each row, read around the page cache.

With `--direct-io` the cold tier is not cached twice (page cache + arena): a
miss reads the aligned sectors that hold its row (512 B for a 256-B row on a
512-B-sector disk, where the block path reads its whole checksum block) into an aligned
scratch buffer; rows whose sectors touch are read with one read. With io_uring
(uring.py) a call's reads, over all the segments they fall in, go through one
ring in the calling thread, kept at its depth until the last; without it, one
pread at a time a thread, and the reader spreads a call over its pool so the
device sees a queue (preadv drops the GIL).

Alignment is the device's logical sector size: tried at 512 B, then 4 KiB.
A filesystem that refuses O_DIRECT (tmpfs) is an InvalidArgument naming the
file, raised when the reader opens.
"""
from __future__ import annotations

import errno
import mmap
import os
import stat
import threading

import numpy as np

from tierstore.errors import InvalidArgument
from tierstore.tiers.nvme import uring
from tierstore.tiers.nvme.uring import Ring

__all__ = ["DirectFiles", "pread_rows", "probe_alignment", "row_buffer", "thread_buffer", "thread_ring"]

_ALIGNS = (512, 4096)
# reads a ring keeps in flight for one call: the ring's entries. 128 (this disk's best probe
# depth, a shorter drain) read no faster in ab_misses --pair depth (+1%, the noise)
READ_DEPTH = 256


def probe_alignment(fd: int, path) -> int:
    """The smallest O_DIRECT alignment the file accepts (512 or 4096)."""
    buf = mmap.mmap(-1, max(_ALIGNS))  # page-aligned
    try:
        for a in _ALIGNS:
            try:
                os.preadv(fd, [memoryview(buf)[:a]], 0)
                return a
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
        raise InvalidArgument(f"--direct-io: reads of {path} fail at 512 B and 4 KiB alignment; "
                              f"serve without --direct-io")
    finally:
        buf.close()


def pread_rows(fd, offsets: np.ndarray, rb: int, a: int, out: np.ndarray, buffer,
               ring: Ring | None = None) -> tuple[int, int]:
    """pread rows `offsets` (row numbers of the file at fd, rows of rb bytes) into
    out[:len(offsets)], reading the `a`-aligned spans that hold them (a = 1: exactly
    the rows); rows whose spans touch share one pread. fd: one descriptor, or an int
    array giving each row its own (rows of several files read in one call); the
    offsets are sorted within each file and one file's rows are contiguous. buffer(n)
    gives an a-aligned scratch of >= n bytes. With a `ring` every span is read in
    flight together (one system call); a span it did not read in full is pread
    again. Returns (bytes read, index of the first row its file did not hold in
    full, or -1)."""
    fds = np.atleast_1d(np.asarray(fd, dtype=np.int64))
    off = offsets * rb
    start = off // a * a
    end = -(-(off + rb) // a) * a
    # rows whose spans touch (in one file) share one read; ends never decrease within a file
    new = np.ones(offsets.size, dtype=bool)
    new[1:] = start[1:] > end[:-1]
    if fds.size > 1:
        new[1:] |= fds[1:] != fds[:-1]
    first = np.flatnonzero(new)
    last = np.append(first[1:], offsets.size) - 1
    r_off, r_len = start[first], end[last] - start[first]
    r_fd = fds[first] if fds.size > 1 else fds
    r_pos = np.concatenate([[0], np.cumsum(r_len)[:-1]])
    run_of = np.cumsum(new) - 1
    flat = buffer(int(r_len.sum()))
    buf = memoryview(flat)
    total, short, redo = 0, -1, range(r_off.size)
    if ring is not None and r_off.size > 1:
        res = ring.read(r_fd, r_off, r_len, flat.ctypes.data + r_pos, min(READ_DEPTH, ring.entries))
        whole = res == r_len
        total, redo = int(r_len[whole].sum()), np.flatnonzero(~whole).tolist()  # short or failed: pread says why
    offs, poss, lens = r_off.tolist(), r_pos.tolist(), r_len.tolist()
    for j in redo:
        f, o, p, n = int(r_fd[j if r_fd.size > 1 else 0]), offs[j], poss[j], lens[j]
        got = os.preadv(f, [buf[p:p + n]], o)
        while 0 < got < n:  # a signal; or the file ends (its last sector is short)
            more = os.preadv(f, [buf[p + got:p + n]], o + got)
            if more == 0:
                break
            got += more
        total += got
        if got < n:
            need = off[first[j]:last[j] + 1] + rb - o  # bytes each row of the run needs
            bad = np.flatnonzero(need > got)
            if bad.size:
                short = int(first[j] + bad[0])
                break
    # every row as a window at its byte position in the scratch buffer: one gather
    window = np.lib.stride_tricks.as_strided(flat, shape=(flat.size - rb + 1, rb), strides=(1, 1), writeable=False)
    pos = r_pos[run_of] + (off - r_off[run_of])
    if short >= 0:
        pos = pos[:short]
    out[:pos.size] = window[pos]  # fancy indexing walks the strided view (np.take would copy it whole)
    return total, short


class _Scratch(threading.local):
    buf: np.ndarray | None = None


def _aligned(nbytes: int, align: int = 4096) -> np.ndarray:
    raw = np.empty(nbytes + align, dtype=np.uint8)
    skip = -raw.ctypes.data % align
    return raw[skip:skip + nbytes]


def thread_buffer(scratch: _Scratch, nbytes: int) -> np.ndarray:
    """`scratch`'s page-aligned buffer for this thread, grown to >= nbytes and reused."""
    if scratch.buf is None or scratch.buf.size < nbytes:
        scratch.buf = _aligned(max(nbytes, 1 << 20))
    return scratch.buf


_ROWS = _Scratch()


class _Rings(threading.local):
    ring: Ring | None = None
    tried: bool = False


_RINGS = _Rings()


def thread_ring() -> Ring | None:
    """This thread's io_uring (made on first use, closed with the thread), or None where there is none."""
    if not _RINGS.tried:
        _RINGS.tried = True
        _RINGS.ring = Ring.open()
    return _RINGS.ring


def row_buffer(n: int, row_bytes: int) -> np.ndarray:
    """This thread's reusable uint8 [n, row_bytes] buffer for one chunk of rows
    (its own: pread_rows's `buffer` scratch is another)."""
    return thread_buffer(_ROWS, n * row_bytes)[:n * row_bytes].reshape(n, row_bytes)


class DirectFiles:
    """O_DIRECT descriptors of one version's segments and sector-aligned row reads.

    paths: segment paths (None for a segment that is missing or not a regular file).
    Raises InvalidArgument when the filesystem refuses O_DIRECT.
    """

    def __init__(self, paths, row_bytes: int):
        self.row_bytes = row_bytes
        self.fds: list[int | None] = []
        self.align = max(_ALIGNS)
        self._scratch = _Scratch()
        try:
            for p in paths:
                if p is None:
                    self.fds.append(None)
                    continue
                try:
                    fd = os.open(p, os.O_RDONLY | os.O_DIRECT | os.O_NONBLOCK | os.O_CLOEXEC)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    raise InvalidArgument(f"--direct-io: the filesystem holding {p} refuses O_DIRECT "
                                          f"(tmpfs does); serve without --direct-io or keep the data "
                                          f"directory on a disk") from None
                if stat.S_ISREG(os.fstat(fd).st_mode):  # a file (not a FIFO swapped in): reads may block,
                    os.set_blocking(fd, True)           # which io_uring needs to queue them (no EAGAIN)
                self.fds.append(fd)
            self._fd_array = np.array([-1 if fd is None else fd for fd in self.fds], dtype=np.int64)
            first = next((i for i, fd in enumerate(self.fds) if fd is not None), None)
            if first is not None:
                self.align = probe_alignment(self.fds[first], paths[first])
            uring.warm()  # the read loop compiled at open, not on the first miss
        except BaseException:
            self.close()
            raise

    def _buffer(self, nbytes: int) -> np.ndarray:
        return thread_buffer(self._scratch, nbytes)

    def rows_per(self, nbytes: int) -> int:
        """Rows whose aligned spans surely fit in `nbytes` of scratch (at least 256)."""
        return max(256, nbytes // (-(-self.row_bytes // self.align) * self.align + self.align))

    def read_rows(self, seg, offsets: np.ndarray, out: np.ndarray, ring: Ring | None = None) -> tuple[int, int]:
        """Read rows `offsets` (sorted row numbers within segment `seg`; or, seg an int
        array, within each row's own segment, rows sorted by segment, then offset) into
        uint8 [len(offsets), row_bytes] `out`, through `ring` (default: this thread's).
        Returns (bytes read, index of the first row the file did not hold in full, or -1)."""
        fd = self.fds[seg] if np.ndim(seg) == 0 else self._fd_array[seg]
        return pread_rows(fd, offsets, self.row_bytes, self.align, out, self._buffer, ring or thread_ring())

    def close(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            if fd is not None:
                os.close(fd)
