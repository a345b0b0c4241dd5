"""Many reads in one system call: a minimal io_uring for O_DIRECT row reads.

A decode step's misses are a few dozen scattered 512-B reads. One `pread` at a
time, each waits out the device's latency; a thread pool puts them in flight
together, but on a host with few cores the hand-offs cost about what they save.
An io_uring takes the reads of a call in few `io_uring_enter`s, every read
with its own descriptor if the caller likes (the disk probe reads over all of
a table's segments in one call).

A call's reads are kept at a queue depth (`Ring.submit`'s `depth`, at most the
ring's entries): as completions come back, the next reads take their places,
so the device sees a steady queue however many reads the call has, never a
batch that drains to its slowest read before the next batch starts. That loop
is compiled (numba, tierstore/jit.py) and runs without the GIL: it writes the
submission entries, calls `io_uring_enter` through libc and reads the
completions with no Python per read or per batch. Without numba the numpy
reference runs instead: batches of `depth` entries written as one structured
array, each waited for whole (the same results, a shallower queue).

Why our own and not a binding: the Python io_uring packages (liburing, pyuring,
uringio) submit one entry per Python call, the per-read loop this replaces.
This module uses the two system calls and the three shared rings directly:
x86-64 Linux only (the rings' index updates rely on its store and load
ordering, as local reads do), and only for plain reads (IORING_OP_READ, Linux
5.6+). Anywhere else, or where io_uring is refused (seccomp, a container,
`kernel.io_uring_disabled`), or with TIERSTORE_IO_URING=0, `Ring.open()` is
None and the caller preads instead.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import platform
import threading

import numpy as np

from tierstore.errors import InvalidArgument
from tierstore.jit import Kernel

__all__ = ["Ring", "supported", "warm"]

log = logging.getLogger(__name__)

_SETUP, _ENTER = 425, 426  # x86-64 syscall numbers
_ENTER_GETEVENTS = 1
_FEAT_SINGLE_MMAP = 1
_OP_READ = 22
_OFF_SQ_RING, _OFF_CQ_RING, _OFF_SQES = 0, 0x8000000, 0x10000000
_MASK32 = 0xFFFFFFFF


class _SqOffsets(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("head", "tail", "ring_mask", "ring_entries", "flags", "dropped",
                                                "array", "resv1")] + [("user_addr", ctypes.c_uint64)]


class _CqOffsets(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("head", "tail", "ring_mask", "ring_entries", "overflow", "cqes",
                                                "flags", "resv1")] + [("user_addr", ctypes.c_uint64)]


class _Params(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("sq_entries", "cq_entries", "flags", "sq_thread_cpu",
                                                "sq_thread_idle", "features", "wq_fd")] + [
        ("resv", ctypes.c_uint32 * 3), ("sq_off", _SqOffsets), ("cq_off", _CqOffsets)]


# struct io_uring_sqe (64 B) and io_uring_cqe (16 B): the fields a read uses; the rest stay zero
_SQE = np.dtype({"names": ["opcode", "flags", "ioprio", "fd", "off", "addr", "len", "rw_flags", "user_data"],
                 "formats": ["u1", "u1", "<u2", "<i4", "<u8", "<u8", "<u4", "<u4", "<u8"],
                 "offsets": [0, 1, 2, 4, 8, 16, 24, 28, 32], "itemsize": 64})
_CQE = np.dtype({"names": ["user_data", "res", "flags"], "formats": ["<u8", "<i4", "<u4"],
                 "offsets": [0, 8, 12], "itemsize": 16})

_LIBC = None
_CALL = None  # (syscall with seven long arguments, for the compiled loop; this thread's errno, as an array)
_REFUSED: list[str] = []  # why io_uring is off in this process (said once)
_LOCK = threading.Lock()


def supported() -> bool:
    """io_uring may be tried here: x86-64 Linux, not switched off."""
    return (platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")
            and os.environ.get("TIERSTORE_IO_URING", "1") != "0")


def _syscall():
    global _LIBC
    if _LIBC is None:
        libc = ctypes.CDLL(None, use_errno=True)  # CDLL: the GIL is released while the kernel waits
        libc.syscall.restype = ctypes.c_long
        _LIBC = libc
    return _LIBC.syscall


class _Errno(threading.local):
    view: np.ndarray | None = None


_ERRNO = _Errno()


def _compiled_call():
    """(libc's syscall typed for the compiled loop, this thread's errno as an int32 [1] array):
    the loop is passed both, so its on-disk cache holds no address of this process."""
    global _CALL
    if _CALL is None:
        libc = ctypes.CDLL(None)  # a handle of its own: the typed `syscall` does not change _syscall()'s
        fn = libc.syscall
        fn.argtypes, fn.restype = [ctypes.c_long] * 7, ctypes.c_long
        where = libc.__errno_location
        where.argtypes, where.restype = [], ctypes.c_void_p
        _CALL = (fn, where)
    if _ERRNO.view is None:
        _ERRNO.view = np.ctypeslib.as_array((ctypes.c_int * 1).from_address(_CALL[1]()))
    return _CALL[0], _ERRNO.view


class Ring:
    """One io_uring for one thread's reads (not thread-safe: keep one per thread).

    Reads go through a queue the ring owes: `submit` appends a batch (a ticket) and
    puts as many reads in flight as the depth allows, without waiting; `wait(ticket)`
    keeps the queue at its depth, taking later batches' reads into the places that
    free up, until that batch's reads are all done, and returns their results. So a
    caller with several batches (a step's tables, a table's parts) submits them all
    and waits for each in turn, working on the one that landed while the device reads
    the next, and the device's queue does not drain between them. A batch's memory stays
    the caller's to keep alive and unmoved until its wait returns (`keep=` hands the ring
    references to hold until then). The read pipeline's submit and finish stages are its
    users (tiers/nvme/miss_batch.py, SegmentReader), and the disk probe (bench/disk.py)."""

    def __init__(self, entries: int = 256):
        params = _Params()
        call = _syscall()
        fd = call(ctypes.c_long(_SETUP), ctypes.c_uint32(entries), ctypes.byref(params))
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"io_uring_setup: {os.strerror(e)}")
        self.fd, self._maps = int(fd), []
        try:
            sq, cq = params.sq_off, params.cq_off
            sq_size = sq.array + params.sq_entries * 4
            cq_size = cq.cqes + params.cq_entries * _CQE.itemsize
            single = bool(params.features & _FEAT_SINGLE_MMAP)
            sq_map = self._map(max(sq_size, cq_size) if single else sq_size, _OFF_SQ_RING)
            cq_map = sq_map if single else self._map(cq_size, _OFF_CQ_RING)
            sqe_map = self._map(params.sq_entries * _SQE.itemsize, _OFF_SQES)
            u32 = lambda m, off, n=1: np.frombuffer(m, np.uint32, n, off)
            self._sq_tail = u32(sq_map, sq.tail)
            self._sq_mask = int(u32(sq_map, sq.ring_mask)[0])
            self._cq_head, self._cq_tail = u32(cq_map, cq.head), u32(cq_map, cq.tail)
            self._cq_mask = int(u32(cq_map, cq.ring_mask)[0])
            self._cqes = np.frombuffer(cq_map, _CQE, params.cq_entries, cq.cqes)
            self._sqes = np.frombuffer(sqe_map, _SQE, params.sq_entries)
            # the same entries as int64 words, for the compiled loop
            self._sq_words = np.frombuffer(sqe_map, np.int64, params.sq_entries * 8).reshape(-1, 8)
            self._cq_words = np.frombuffer(cq_map, np.int64, params.cq_entries * 2, cq.cqes).reshape(-1, 2)
            self.entries = int(params.sq_entries)
            # the SQ array maps ring position -> entry: identity, set once
            u32(sq_map, sq.array, self.entries)[:] = np.arange(self.entries, dtype=np.uint32)
        except BaseException:
            self.close()
            raise
        # the queue: reads [0, _n) (descriptor, offset, length, address; result; batch), of which
        # _state = (sent to the ring, done, written to the ring but not yet taken by the kernel)
        self._n, self._depth, self._cap = 0, self.entries, 0
        self._state = np.zeros(3, dtype=np.int64)
        self._left = np.zeros(0, dtype=np.int64)  # per batch: its reads not yet done
        self._batches: dict[int, tuple[int, int, object]] = {}  # ticket -> (first read, end, what to keep alive)
        self._grow(256)

    def _grow(self, need: int) -> None:
        if need <= self._cap:
            return
        cap = max(need, 2 * self._cap)
        old = (self._q_fd, self._q_off, self._q_len, self._q_addr, self._q_res, self._q_batch) if self._cap else None
        self._q_fd = np.zeros(cap, np.int32)
        self._q_off, self._q_len, self._q_addr, self._q_res, self._q_batch = (np.zeros(cap, np.int64)
                                                                              for _ in range(5))
        if old is not None:
            for new, o in zip((self._q_fd, self._q_off, self._q_len, self._q_addr, self._q_res, self._q_batch), old):
                new[:self._n] = o[:self._n]
        self._cap = cap

    def _map(self, size: int, offset: int) -> mmap.mmap:
        m = mmap.mmap(self.fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                      mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
        self._maps.append(m)
        return m

    @classmethod
    def open(cls, entries: int = 256) -> Ring | None:
        """A ring, or None where io_uring is not supported or refused (said once per process)."""
        if not supported() or _REFUSED:
            return None
        try:
            return cls(entries)
        except OSError as e:
            with _LOCK:
                if not _REFUSED:
                    _REFUSED.append(str(e))
                    log.info("io_uring unavailable (%s): O_DIRECT rows are read one pread at a time", e)
            return None

    def submit(self, fd, offsets: np.ndarray, lengths: np.ndarray, addrs: np.ndarray,
               depth: int | None = None, keep=None) -> int:
        """Queue lengths[i] bytes at offsets[i] of descriptor fd (an int, or an int array
        giving each read its own) into memory at addrs[i] as one batch, and put what the
        depth allows in flight, without waiting; returns the batch's ticket for `wait`.
        `depth`: reads in flight at most, for the whole queue from now on (default and
        most: the ring's entries; a completion's place is taken by the next read at once,
        compiled). The memory must stay alive and unmoved until the batch's wait returns
        (`keep`: held until then). InvalidArgument for a depth out of range or fds that do
        not match the reads; OSError when io_uring_enter itself fails (then close the ring)."""
        n = int(np.size(offsets))
        depth = self.entries if depth is None else int(depth)
        if not 1 <= depth <= self.entries:
            raise InvalidArgument(f"io_uring queue depth {depth} is outside 1..{self.entries} (the ring's entries)")
        fds = np.atleast_1d(np.asarray(fd))
        if fds.size not in (1, n):
            raise InvalidArgument(f"{fds.size} descriptors for {n} reads: give one, or one per read")
        ticket = self._left.size
        self._left = np.append(self._left, n)
        lo, hi = self._n, self._n + n
        self._batches[ticket] = (lo, hi, keep)
        if n == 0:
            return ticket
        self._grow(hi)
        self._q_fd[lo:hi], self._q_off[lo:hi], self._q_len[lo:hi], self._q_addr[lo:hi] = fds, offsets, lengths, addrs
        self._q_batch[lo:hi] = ticket
        self._n, self._depth = hi, depth
        self._pump(-1)
        return ticket

    def wait(self, ticket: int) -> np.ndarray:
        """The results of batch `ticket`, once all its reads are done: each read's bytes read
        (short at the end of a file) or -errno; the queue is kept at its depth meanwhile. OSError when io_uring_enter
        fails (then close the ring); KeyError for a ticket not submitted or already waited."""
        lo, hi, _ = self._batches[ticket]
        if self._left[ticket]:
            self._pump(ticket)
        del self._batches[ticket]
        res = self._q_res[lo:hi].copy()
        if not self._batches and self._state[1] == self._n:  # nothing owed: the queue starts again at 0
            self._n, self._left = 0, self._left[:0]
            self._state[:] = 0
        return res

    def done(self, ticket: int) -> bool:
        """Whether every read of batch `ticket` is done (what has landed reaped, nothing waited
        for; its results stay for its wait). The numpy reference, which reads a batch only when
        it is waited for, reads it whole here. KeyError for a ticket not submitted or waited."""
        self._batches[ticket]
        if self._left[ticket]:
            self._pump(-1 if _READ.compiled() is not None else ticket)
        return not self._left[ticket]

    @property
    def queued(self) -> int:
        """Reads queued so far (the queue starts again at 0 once a wait leaves nothing owed)."""
        return self._n

    def settle(self, upto: int) -> None:
        """Keep the queue at its depth until the batch holding queued read `upto` is done
        (its results stay for its wait): a caller lets part of its reads land first."""
        for ticket, (lo, hi, _) in self._batches.items():
            if lo <= upto < hi:
                if self._left[ticket]:
                    self._pump(ticket)
                return

    def _pump(self, target: int) -> None:
        """Reads put in flight as places free, until batch `target` is done (-1: once, no wait)."""
        loop = _READ.compiled()
        if loop is not None:
            call, err = _compiled_call()
            rc = loop(call, err, self.fd, self._sq_tail, self._sq_mask, self._sq_words, self._cq_head,
                      self._cq_tail, self._cq_mask, self._cq_words, self._q_fd, self._q_off, self._q_len,
                      self._q_addr, self._q_res, self._q_batch, self._left, self._state, self._n, self._depth, target)
            if rc < 0:
                raise OSError(-rc, f"io_uring_enter: {os.strerror(-rc)}")
            return
        self._settle()  # the reference: what a compiled pump left in flight first, then whole batches
        while target >= 0 and self._left[target]:
            lo = int(self._state[0])
            self._batch(lo, min(self._n, lo + self._depth))

    def _settle(self) -> None:
        """Every read in flight done (submitted first where the kernel has not taken it)."""
        sent, done, waiting = (int(x) for x in self._state)
        while done < sent:
            waiting -= self._enter(waiting, sent - done)
            done += self._reap()
        self._state[1], self._state[2] = done, waiting

    def _batch(self, lo: int, hi: int) -> None:
        """The reference: reads [lo, hi) of the queue written at once, waited for whole."""
        n = hi - lo
        tail = int(self._sq_tail[0])
        idx = (tail + np.arange(n, dtype=np.int64)) & self._sq_mask
        e = self._sqes
        e["opcode"][idx] = _OP_READ
        e["fd"][idx] = self._q_fd[lo:hi]
        e["off"][idx] = self._q_off[lo:hi]
        e["addr"][idx] = self._q_addr[lo:hi]
        e["len"][idx] = self._q_len[lo:hi]
        e["user_data"][idx] = np.arange(lo, hi, dtype=np.uint64)
        self._sq_tail[0] = (tail + n) & _MASK32  # published after the entries (x86-64: stores stay in order)
        self._state[0] = hi
        todo, done = n, 0
        while done < n:
            # submit what is left and wait for every read in flight (a partial submission
            # returns at once, without waiting)
            took = self._enter(todo, n - done)
            reaped = self._reap()
            if todo and not took and not reaped:
                raise OSError(errno.EAGAIN, "io_uring_enter took none of the reads")
            todo, done = todo - took, done + reaped
        self._state[1] += n

    def _enter(self, to_submit: int, min_complete: int) -> int:
        call = _syscall()
        while True:
            r = call(ctypes.c_long(_ENTER), ctypes.c_uint(self.fd), ctypes.c_uint(to_submit),
                     ctypes.c_uint(min_complete), ctypes.c_uint(_ENTER_GETEVENTS), ctypes.c_void_p(None),
                     ctypes.c_size_t(0))
            if r >= 0:
                return int(r)
            e = ctypes.get_errno()
            if e != errno.EINTR:
                raise OSError(e, f"io_uring_enter: {os.strerror(e)}")

    def _reap(self) -> int:
        """Completions into the queue's results and their batches' counts; how many."""
        head, tail = int(self._cq_head[0]), int(self._cq_tail[0])
        k = (tail - head) & _MASK32
        if k:
            c = self._cqes[(head + np.arange(k, dtype=np.int64)) & self._cq_mask]
            at = c["user_data"].astype(np.int64)
            self._q_res[at] = c["res"]
            np.subtract.at(self._left, self._q_batch[at], 1)
            self._cq_head[0] = tail  # after the entries are read (x86-64: loads stay in order)
        return k

    def close(self) -> None:
        """Close the ring; reads in flight are waited for first (their memory is written until they end)."""
        if self.fd >= 0 and getattr(self, "_state", None) is not None and self._state[0] > self._state[1]:
            try:
                self._settle()
            except OSError:
                pass  # the ring is broken: closing it cancels what is left
        self._sqes = self._cqes = self._sq_tail = self._cq_head = self._cq_tail = None
        maps, self._maps = self._maps, []
        for m in maps:
            try:
                m.close()
            except BufferError:  # a view still exported: the map goes with it
                pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._batches = {}

    def __del__(self):
        if getattr(self, "fd", -1) >= 0:
            self.close()


def warm() -> None:
    """Compile (or load from the disk cache) the read loop now, not on a miss: one read of
    /dev/zero through a ring of two entries. Nothing where there is no numba or no ring."""
    if _READ.compiled() is None:
        return
    ring = Ring.open(2)
    if ring is None:
        return
    fd = os.open("/dev/zero", os.O_RDONLY | os.O_CLOEXEC)
    try:
        buf = np.empty(16, dtype=np.uint8)
        ring.wait(ring.submit(fd, np.zeros(2, np.int64), np.full(2, 8, np.int64), buf.ctypes.data + np.array([0, 8])))
    finally:
        os.close(fd)
        ring.close()


# ---- the compiled pump (Ring.submit / Ring.wait; the numpy batches above are its reference) ----
_WORD_FD_SHIFT = 32  # word 0 of an entry: opcode (byte 0), flags, ioprio, fd (bytes 4-7)


def _read_loop(call, err, ring_fd, sq_tail, sq_mask, sqes, cq_head, cq_tail, cq_mask, cqes, q_fd, q_off, q_len,
               q_addr, q_res, q_batch, left, state, n, depth, target):
    """The queue's reads [0, n) through the ring, at most `depth` in flight: entries are
    written as places free up, submitted and reaped in one io_uring_enter per round,
    q_res[i] = read i's result and left[q_batch[i]] counted down as each completes;
    until batch `target` is done, or, target -1, one round that waits for nothing.
    state: (reads sent, done, written but not yet taken by the kernel), kept between
    calls. Returns 0, or -errno of an io_uring_enter that failed. The tail is stored
    after the entries and the head after the completions are read, and both before
    the system call, which the compiler does not move stores across (x86-64: the CPU
    keeps them in order too)."""
    tail, head = np.int64(sq_tail[0]), np.int64(cq_head[0])
    sent, done, waiting = state[0], state[1], state[2]
    rc = 0
    while True:
        while sent < n and sent - done < depth:
            e = tail & sq_mask
            sqes[e, 0] = _OP_READ | (np.int64(q_fd[sent]) << _WORD_FD_SHIFT)
            sqes[e, 1] = q_off[sent]
            sqes[e, 2] = q_addr[sent]
            sqes[e, 3] = q_len[sent]  # rw_flags (the high half) zero
            sqes[e, 4] = sent  # user_data: the read's place in the queue
            sqes[e, 5] = 0
            sqes[e, 6] = 0
            sqes[e, 7] = 0
            tail = (tail + 1) & _MASK32
            sent += 1
            waiting += 1
        sq_tail[0] = tail
        blocking = target >= 0 and left[target] > 0
        if not blocking and waiting == 0:
            break
        # the batch's last reads: wait for them; otherwise for a quarter of the depth, then refill
        want = min(left[target], sent - done, max(1, depth // 4)) if blocking else 0
        r = call(_ENTER, ring_fd, waiting, want, _ENTER_GETEVENTS, 0, 0)
        if r < 0:
            if err[0] == errno.EINTR:
                continue
            rc = -np.int64(err[0])
            break
        waiting -= r
        t = np.int64(cq_tail[0])
        reaped = 0
        while head != t:
            c = head & cq_mask
            i = cqes[c, 0]
            q_res[i] = (cqes[c, 1] << 32) >> 32  # res: the low, signed half of word 1
            left[q_batch[i]] -= 1
            head = (head + 1) & _MASK32
            reaped += 1
        cq_head[0] = head
        done += reaped
        if r == 0 and waiting and not reaped:
            rc = -errno.EAGAIN
            break
        if not blocking:
            break  # one round: what fits is in flight
    state[0], state[1], state[2] = sent, done, waiting
    return rc


_READ = Kernel(_read_loop, nogil=True)  # it waits on the device: other threads run meanwhile
