"""Row reads: each row's bytes read into a scratch buffer, never touched through a map.

`Spans` are the reads of a set of rows at computed offsets of one file or several: rows
whose spans touch share one read, and each row's place in the scratch is kept, so the
rows are placed from where they land. A file that ends early (cut short while it is read
included) is a short read the caller names, never a signal. Spans are the rows' own bytes
through the page cache (alignment 1, the reader's default mode), or with `--direct-io`
the aligned sectors that hold each row, read around the page cache (512 B for a 256-B row
on a 512-B-sector disk, where the block path reads its whole checksum block), so the
cold tier is not cached twice (page cache + arena).

How a set of spans is read is the read pipeline's business (miss_batch.py: its submit
and finish stages, in SegmentReader): through the page cache, first here without waiting
(`read_cached`: what the page cache holds copied at once, one compiled loop); what is
left, and every O_DIRECT read, on the calling thread's io_uring (uring.py, `thread_ring`)
or, where there is none, `pread` one at a time a thread (the reader spreads a batch over
its pool so the device sees a queue; preadv drops the GIL). `settle` preads what came
back short and says which row its file did not hold whole.

`DirectFiles` opens a version's segments O_DIRECT. Alignment is the device's
logical sector size: tried at 512 B, then 4 KiB. A filesystem that refuses
O_DIRECT (tmpfs) is an InvalidArgument naming the file, raised when the reader opens.
"""
from __future__ import annotations

import errno
import math
import mmap
import os
import platform
import stat
import threading

import numpy as np

from tierstore.errors import InvalidArgument
from tierstore.jit import Kernel
from tierstore.tiers.nvme import uring
from tierstore.tiers.nvme.uring import Ring

__all__ = ["DirectFiles", "Spans", "read_now", "probe_alignment", "part_starts", "thread_buffer", "thread_ring", "warm"]

_ALIGNS = (512, 4096)
# reads a thread's ring keeps in flight (its entries): one thread reads a step's tables, and the
# next step's misses read ahead, through its one ring, and the device's queue must outlast the CPU
# work between its waits (docs/decisions.md, "The ring's depth")
READ_DEPTH = 1024


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


def part_starts(fd, offsets: np.ndarray, rb: int, a: int, gap: int, nbytes: int) -> np.ndarray:
    """Where to cut rows `offsets` (Spans' arguments) into parts whose scratch is each
    about `nbytes` at most (one row's span more): the index of each part's first row but
    the first's (int64, ascending; empty for one part)."""
    n = int(offsets.size)
    if n * (-(-rb // a) * a + a + gap) <= nbytes:
        return np.zeros(0, dtype=np.int64)
    fds = np.atleast_1d(np.asarray(fd, dtype=np.int64))
    spans, pos = np.empty((4, n), dtype=np.int64), np.empty(n, dtype=np.int64)
    k = _SPANS.compiled()
    (k or _spans_reference)(fds, offsets * rb, rb, a, gap, spans, pos)
    return np.flatnonzero(np.diff(pos // nbytes)) + 1


_RWF_NOWAIT = 8  # linux/fs.h: fail (EAGAIN) rather than wait for the device
_SYS_PREADV2 = 327  # x86-64: the compiled preads run there only (as uring.py's rings), os.preadv elsewhere
_X86_64_LINUX = platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")
_NOWAIT_OK = True  # RWF_NOWAIT refused (EOPNOTSUPP) once: not asked again in this process


def _spans_loop(fds, off, rb, a, gap, spans, pos):
    """The reads of rows at byte offsets `off` (sorted within each file, a file's rows
    together; fds: one descriptor, or one per row): each row's `a`-aligned span, and
    rows whose spans lie within `gap` bytes of each other (in one file) share a read.
    spans[:, r] = (descriptor, offset, length, position in the scratch) of read r;
    pos[i] = row i's position. Returns (reads, scratch bytes)."""
    n = off.shape[0]
    many = fds.shape[0] > 1
    r = -1
    total = 0
    end = 0
    for i in range(n):
        o = off[i]
        start = o // a * a
        f = fds[i] if many else fds[0]
        if r < 0 or start > end + gap or f != spans[0, r]:
            if r >= 0:
                spans[2, r] = end - spans[1, r]
                total += spans[2, r]
            r += 1
            spans[0, r] = f
            spans[1, r] = start
            spans[3, r] = total
        end = (o + rb + a - 1) // a * a  # ends never decrease within a file
        pos[i] = spans[3, r] + o - spans[1, r]
    if r >= 0:
        spans[2, r] = end - spans[1, r]
        total += spans[2, r]
    return r + 1, total


def _spans_reference(fds, off, rb, a, gap, spans, pos):
    """_spans_loop in numpy (its reference, and what runs without numba)."""
    n = off.size
    if n == 0:
        return 0, 0
    start, end = off // a * a, -(-(off + rb) // a) * a
    new = np.ones(n, dtype=bool)
    new[1:] = start[1:] > end[:-1] + gap
    if fds.size > 1:
        new[1:] |= fds[1:] != fds[:-1]
    first = np.flatnonzero(new)
    runs = first.size
    spans[0, :runs] = fds[first] if fds.size > 1 else fds[0]
    spans[1, :runs] = start[first]
    spans[2, :runs] = end[np.append(first[1:], n) - 1] - start[first]
    spans[3, :runs] = np.concatenate([[0], np.cumsum(spans[2, :runs])[:-1]])
    run_of = np.cumsum(new) - 1
    pos[:] = spans[3, run_of] + off - spans[1, run_of]
    return runs, int(spans[2, :runs].sum())


def _preads_loop(call, err, iov, spans, flat, todo, res, a, flags):
    """Read spans todo[j] (spans as _spans_loop makes them; span r into flat[spans[3, r]:])
    with preadv2 and `flags`, one at a time: res[r] = the bytes read, or -errno. Without
    flags a short read is read on from where it ended, until the span is whole or the
    file ends (0, or an O_DIRECT read that ends off its alignment `a`, the file's last
    sector); with RWF_NOWAIT a span the page cache does not hold whole is left short (or
    -EAGAIN) for a read that may wait. Returns how many reads were refused outright
    (EOPNOTSUPP: the file takes no RWF_NOWAIT)."""
    addr, iov_addr = flat.ctypes.data, iov.ctypes.data
    refused = 0
    for j in range(todo.shape[0]):
        r = todo[j]
        n = spans[2, r]
        got = 0
        while True:
            iov[0] = addr + spans[3, r] + got
            iov[1] = n - got
            k = call(_SYS_PREADV2, spans[0, r], iov_addr, 1, spans[1, r] + got, 0, flags)
            if k < 0:
                if err[0] == errno.EINTR:
                    continue
                refused += err[0] == errno.EOPNOTSUPP
                got = -np.int64(err[0])
                break
            got += k
            if k == 0 or got >= n or flags != 0 or got % a != 0:
                break
        res[r] = got
    return refused


_SPANS = Kernel(_spans_loop)
_PREADS = Kernel(_preads_loop, nogil=True)  # it may wait on the device: other threads run meanwhile


def _preads():
    """The compiled _preads_loop, or None (numba missing or off, not x86-64 Linux)."""
    return _PREADS.compiled() if _X86_64_LINUX else None


class Spans:
    """The reads of rows `offsets` (row numbers of the file at fd, rows of rb bytes): per read
    (`table`, int64 [4, reads]) its descriptor, file offset, length and place in `scratch`,
    the `a`-aligned span(s) of its rows (a = 1: exactly the rows), rows whose spans lie
    within `gap` bytes of each other in one file sharing it; per row its place (`pos`); per
    read its result (`res`: bytes read, or -errno; -1 not yet). fd: one descriptor, or an
    int array giving each row its own (rows of several files in one set); the offsets are
    sorted within each file and one file's rows are contiguous. buffer(n) gives an
    a-aligned scratch of >= n bytes, `give_back(scratch)` takes it back (give_back()).

    A plain record of reads and their results: who reads them (the read pipeline's submit
    and finish, on a ring, or pread) keeps them in flight; `landed` says every read is whole."""

    __slots__ = ("rb", "a", "pos", "table", "scratch", "res", "_give_back")

    def __init__(self, fd, offsets: np.ndarray, rb: int, a: int, buffer, give_back=None, gap: int = 0):
        fds = np.atleast_1d(np.asarray(fd, dtype=np.int64))
        n = int(offsets.size)
        table = np.empty((4, n), dtype=np.int64)
        self.pos = np.empty(n, dtype=np.int64)
        k = _SPANS.compiled()
        runs, nbytes = (k or _spans_reference)(fds, offsets * rb, rb, a, gap, table, self.pos)
        self.rb, self.a, self.table = rb, a, table[:, :runs]
        self.scratch, self._give_back = buffer(int(nbytes)), give_back
        self.res = np.full(runs, -1, dtype=np.int64)

    @property
    def landed(self) -> bool:
        return bool((self.res == self.table[2]).all())

    def short(self) -> np.ndarray:
        """The reads not whole yet (not read, short, failed)."""
        return np.flatnonzero(self.res != self.table[2])

    def ring_reads(self, todo: np.ndarray) -> tuple:
        """Reads `todo` as Ring.submit takes them: (descriptors, offsets, lengths, addresses)."""
        t = self.table[:, todo]
        return t[0], t[1], t[2], self.scratch.ctypes.data + t[3]

    def read_cached(self) -> None:
        """Every read tried here without waiting on the device (preadv2 RWF_NOWAIT, one compiled
        loop): what the page cache holds is read at once, the rest left short for a read that
        may wait. Nothing where that cannot be asked (no compiled preads, refused once)."""
        if self.res.size > 1 and _NOWAIT_OK and _preads() is not None:
            self.pread(np.arange(self.res.size), _RWF_NOWAIT)

    def pread(self, todo: np.ndarray, flags: int = 0) -> None:
        """Reads `todo` done here, one at a time (compiled: _preads_loop; else os.preadv), into res."""
        global _NOWAIT_OK
        k = _preads()
        if k is not None:
            call, err = uring._compiled_call()
            if k(call, err, np.empty(2, dtype=np.int64), self.table, self.scratch, todo, self.res, self.a, flags):
                _NOWAIT_OK = False
            return
        buf = memoryview(self.scratch)
        for r in todo.tolist():
            f, o, n, p = (int(x) for x in self.table[:, r])
            got = os.preadv(f, [buf[p:p + n]], o)
            while 0 < got < n and got % self.a == 0:  # read on, as _preads_loop does
                more = os.preadv(f, [buf[p + got:p + n]], o + got)
                if more == 0:
                    break
                got += more
            self.res[r] = got

    def settle(self) -> tuple[int, int]:
        """What is not read whole pread here (its file may have ended): (bytes read, index of
        the first row its file did not hold in full, or -1). OSError for a read that failed."""
        sp, res = self.table, self.res
        redo = self.short()
        if redo.size:
            self.pread(redo)
            failed = redo[res[redo] < 0]
            if failed.size:
                e = int(-res[failed[0]])
                raise OSError(e, f"reading {int(sp[2, failed[0]])} B at {int(sp[1, failed[0]])}: {os.strerror(e)}")
        total, short = int(res.sum()), -1
        for r in redo.tolist():  # in file order: the first row a short read left without all its bytes
            if res[r] < sp[2, r]:
                i = int(np.searchsorted(self.pos, sp[3, r] + res[r] - self.rb, side="right"))
                if i < self.pos.size and self.pos[i] < sp[3, r] + sp[2, r]:
                    short = i
                    break
        return total, short

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(src, at): row i is src[at[i]], where it landed. src is uint8 [*, rb] over the
        scratch, its rows 8-byte aligned wherever rb and the alignment allow (so the compiled
        placing takes it as words)."""
        rb, flat = self.rb, self.scratch
        g = rb if self.a == 1 else math.gcd(rb, self.a)  # every row starts at a multiple of g
        if g == rb and flat.size >= rb:
            src = flat[:flat.size // rb * rb].reshape(-1, rb)
        else:
            src = np.lib.stride_tricks.as_strided(flat, shape=((flat.size - rb) // g + 1, rb), strides=(g, 1),
                                                  writeable=False)
        return src, self.pos // g

    def copy_rows(self, out: np.ndarray, short: int) -> None:
        """Rows before `short` (-1: all) into out[:k]."""
        src, at = self.rows()
        k = at.size if short < 0 else short
        out[:k] = src[at[:k]]  # fancy indexing walks a strided view (np.take would copy it whole)

    def give_back(self) -> None:
        """The scratch given back (once; nothing may read it after)."""
        if self._give_back is not None and self.scratch is not None:
            self._give_back(self.scratch)
        self.scratch = None


def read_now(fd, offsets: np.ndarray, rb: int, out: np.ndarray, gap: int = 0) -> tuple[int, int]:
    """Rows `offsets` of the file at fd read here through the page cache, without a ring (what
    is cached at once, the rest pread), into out[:n]: (bytes read, the first row its file did
    not hold in full or -1). For small reads beside the read pipeline (row sums)."""
    spans = Spans(fd, offsets, rb, 1, spare_buffer, give_back, gap)
    try:
        spans.read_cached()
        total, short = spans.settle()
        spans.copy_rows(out, short)
        return total, short
    finally:
        spans.give_back()


def warm() -> None:
    """Compile (or load from the disk cache) the span and pread loops and the ring's, now: a
    reader's first miss must not pay for it. Two rows of /dev/zero, read both ways."""
    uring.warm()
    fd = os.open("/dev/zero", os.O_RDONLY | os.O_CLOEXEC)
    try:
        read_now(fd, np.array([0, 9]), 8, np.empty((2, 8), dtype=np.uint8))
    finally:
        os.close(fd)


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
SPARE_STEP = 1 << 20


def spare_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned buffer of >= nbytes that is this call's alone until give_back (reads in
    flight at once each need their own): one of this thread's spares, or a new one."""
    for i, b in enumerate(_SPARES.bufs):
        if b.size >= nbytes:
            return _SPARES.bufs.pop(i)
    return _aligned(-(-max(nbytes, 1) // SPARE_STEP) * SPARE_STEP)  # whole steps: a later call's part fits


def give_back(buf: np.ndarray) -> None:
    if len(_SPARES.bufs) < SPARES_KEPT:
        _SPARES.bufs.append(buf)


class DirectFiles:
    """O_DIRECT descriptors of one version's segments (`fds`) and the alignment their reads
    need (`align`), for Spans.

    paths: segment paths (None for a segment that is missing or not a regular file).
    Raises InvalidArgument when the filesystem refuses O_DIRECT.
    """

    def __init__(self, paths):
        self.fds: list[int | None] = []
        self.align = max(_ALIGNS)
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
            first = next((i for i, fd in enumerate(self.fds) if fd is not None), None)
            if first is not None:
                self.align = probe_alignment(self.fds[first], paths[first])
            uring.warm()  # the read loop compiled at open, not on the first miss
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            if fd is not None:
                os.close(fd)
