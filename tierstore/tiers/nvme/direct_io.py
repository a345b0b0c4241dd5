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

__all__ = ["DirectFiles", "RowReads", "pread_rows", "probe_alignment", "row_buffer", "start_rows", "thread_buffer",
           "thread_ring"]

_ALIGNS = (512, 4096)
# reads a thread's ring keeps in flight (its entries): one thread reads a step's tables through its
# one ring (Client.lookup_many), and the device's queue must outlast the CPU work between its
# waits (the next table's hits copied, a landed part placed). 512 against 256 in ab_misses
# blocks, both orders: prefill misses/s +0.8% / 0.0%, decode +2.6% / +0.8% (at 256 prefill lost
# 2-2.5% to the threaded reads it replaced); for the threaded reads 512 was the noise (session 19)
READ_DEPTH = 512


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
    full, or -1). start_rows(...).finish(out), at once."""
    return start_rows(fd, offsets, rb, a, buffer, ring).finish(out)


def start_rows(fd, offsets: np.ndarray, rb: int, a: int, buffer, ring: Ring | None = None,
               release=None) -> "RowReads":
    """pread_rows in two halves: the spans are worked out and, with a `ring`, submitted to it
    (the call returns while the device reads them); RowReads.finish(out) waits for them in
    the same thread, preads what is left and places the rows. The scratch buffer(n) gives
    must stay the call's until finish; `release(scratch)` is called once finish is done
    with it (the caller's pool takes it back)."""
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
    r_off = start[first]
    r_len = end[np.append(first[1:], offsets.size) - 1] - r_off
    r_fd = fds[first] if fds.size > 1 else fds
    r_pos = np.concatenate([[0], np.cumsum(r_len)[:-1]])
    flat = buffer(int(r_len.sum()))
    ticket = None
    if ring is not None and r_off.size > 1:
        ticket = ring.submit(r_fd, r_off, r_len, flat.ctypes.data + r_pos, min(READ_DEPTH, ring.entries), keep=flat)
    return RowReads(rb, off, new, first, r_fd, r_off, r_len, r_pos, flat, ring, ticket, release)


class RowReads:
    """A start_rows call's spans, in flight on its ring (or to be pread): finish(out) once."""

    def __init__(self, rb, off, new, first, r_fd, r_off, r_len, r_pos, flat, ring, ticket, release):
        self.rb, self.off, self.new, self.first = rb, off, new, first
        self.r_fd, self.r_off, self.r_len, self.r_pos, self.flat = r_fd, r_off, r_len, r_pos, flat
        self.ring, self.ticket, self.release = ring, ticket, release

    def finish(self, out: np.ndarray) -> tuple[int, int]:
        """Rows into out[:n]: (bytes read, index of the first row its file did not hold in full, or -1)."""
        try:
            return self._finish(out)
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Wait for the reads still in flight and give the scratch back (nothing placed)."""
        if self.ticket is not None:
            ticket, self.ticket = self.ticket, None
            self.ring.wait(ticket)
        if self.release is not None and self.flat is not None:
            self.release(self.flat)
        self.flat = None

    def _finish(self, out: np.ndarray) -> tuple[int, int]:
        rb, off, flat, r_fd, r_off, r_len, r_pos = (self.rb, self.off, self.flat, self.r_fd, self.r_off,
                                                   self.r_len, self.r_pos)
        buf = memoryview(flat)
        total, short, redo = 0, -1, range(r_off.size)
        if self.ticket is not None:
            ticket, self.ticket = self.ticket, None
            res = self.ring.wait(ticket)
            whole = res == r_len
            total, redo = int(r_len[whole].sum()), np.flatnonzero(~whole).tolist()  # short or failed: pread says why
        first = self.first
        last = np.append(first[1:], off.size) - 1
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
        window = np.lib.stride_tricks.as_strided(flat, shape=(flat.size - rb + 1, rb), strides=(1, 1),
                                                 writeable=False)
        run_of = np.cumsum(self.new) - 1
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
        _RINGS.ring = Ring.open(READ_DEPTH)
    return _RINGS.ring


class _Spares(threading.local):
    def __init__(self):
        self.bufs: list[np.ndarray] = []


_SPARES = _Spares()
SPARES_KEPT = 8  # scratch buffers a thread keeps for reads in flight at once (a step's tables and parts)


def spare_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned buffer of >= nbytes that is this call's alone until give_back (reads in
    flight at once each need their own): one of this thread's spares, or a new one."""
    for i, b in enumerate(_SPARES.bufs):
        if b.size >= nbytes:
            return _SPARES.bufs.pop(i)
    return _aligned(max(nbytes, 1 << 20))


def give_back(buf: np.ndarray) -> None:
    if len(_SPARES.bufs) < SPARES_KEPT:
        _SPARES.bufs.append(buf)


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

    def start_rows(self, seg, offsets: np.ndarray) -> RowReads:
        """read_rows in two halves (direct_io.start_rows) through this thread's ring: the
        reads are in flight when this returns; RowReads.finish(out) in this thread places
        them. Each call has a scratch of its own, so several may be in flight at once."""
        fd = self.fds[seg] if np.ndim(seg) == 0 else self._fd_array[seg]
        return start_rows(fd, offsets, self.row_bytes, self.align, spare_buffer, thread_ring(), give_back)

    def close(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            if fd is not None:
                os.close(fd)
