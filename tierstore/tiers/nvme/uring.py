"""Many reads in one system call: a minimal io_uring for O_DIRECT row reads.

A decode step's misses are a few dozen scattered 512-B reads. One `pread` at a
time, each waits out the device's latency (~50 µs on this project's virtual
disk, which serves ~3.5x the reads at queue depth 8); a thread pool puts them
in flight together, but on a host with few cores the hand-offs cost about what
they save. An io_uring takes every read of a call in one `io_uring_enter`:
the submission entries are written as one numpy structured array, the
completions read back the same way, so there is no Python loop per read.

Why our own and not a binding: the Python io_uring packages (liburing, pyuring,
uringio) submit one entry per Python call, the per-read loop this replaces.
This module uses the two system calls and the three shared rings directly:
x86-64 Linux only (the rings' index updates rely on its store and load
ordering, as local reads do), and only for plain reads (IORING_OP_READ, Linux
5.6+). Anywhere else, or where io_uring is refused (seccomp, a container,
`kernel.io_uring_disabled`), or with TIERSTORE_IO_URING=0, `Ring.open()` is
None and the caller preads as before.
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

__all__ = ["Ring", "supported"]

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


class Ring:
    """One io_uring for one thread's reads (not thread-safe: keep one per thread)."""

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
            self.entries = int(params.sq_entries)
            # the SQ array maps ring position -> entry: identity, set once
            u32(sq_map, sq.array, self.entries)[:] = np.arange(self.entries, dtype=np.uint32)
        except BaseException:
            self.close()
            raise

    def _map(self, size: int, offset: int) -> mmap.mmap:
        m = mmap.mmap(self.fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                      mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
        self._maps.append(m)
        return m

    @classmethod
    def open(cls) -> Ring | None:
        """A ring, or None where io_uring is not supported or refused (said once per process)."""
        if not supported() or _REFUSED:
            return None
        try:
            return cls()
        except OSError as e:
            with _LOCK:
                if not _REFUSED:
                    _REFUSED.append(str(e))
                    log.info("io_uring unavailable (%s): O_DIRECT rows are read one pread at a time", e)
            return None

    def read(self, fd: int, offsets: np.ndarray, lengths: np.ndarray, addrs: np.ndarray) -> np.ndarray:
        """Read lengths[i] bytes at offsets[i] of fd into memory at addrs[i], every read in
        flight together. Returns each read's result: bytes read (short at the end of a file)
        or -errno. The memory must stay alive and unmoved until this returns."""
        n = int(offsets.size)
        res = np.empty(n, dtype=np.int64)
        for lo in range(0, n, self.entries):
            hi = min(n, lo + self.entries)
            self._batch(fd, offsets[lo:hi], lengths[lo:hi], addrs[lo:hi], lo, res)
        return res

    def _batch(self, fd, offsets, lengths, addrs, base: int, res: np.ndarray) -> None:
        n = int(offsets.size)
        tail = int(self._sq_tail[0])
        idx = (tail + np.arange(n, dtype=np.int64)) & self._sq_mask
        e = self._sqes
        e["opcode"][idx] = _OP_READ
        e["fd"][idx] = fd
        e["off"][idx] = offsets
        e["addr"][idx] = addrs
        e["len"][idx] = lengths
        e["user_data"][idx] = np.arange(base, base + n, dtype=np.uint64)
        self._sq_tail[0] = (tail + n) & _MASK32  # published after the entries (x86-64: stores stay in order)
        todo, done = n, 0
        while done < n:
            # submit what is left and wait for every read in flight (a partial submission
            # returns at once, without waiting)
            took = self._enter(todo, n - done)
            reaped = self._reap(res)
            if todo and not took and not reaped:
                raise OSError(errno.EAGAIN, "io_uring_enter took none of the reads")
            todo, done = todo - took, done + reaped

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

    def _reap(self, res: np.ndarray) -> int:
        head, tail = int(self._cq_head[0]), int(self._cq_tail[0])
        k = (tail - head) & _MASK32
        if k:
            c = self._cqes[(head + np.arange(k, dtype=np.int64)) & self._cq_mask]
            res[c["user_data"].astype(np.int64)] = c["res"]
            self._cq_head[0] = tail  # after the entries are read (x86-64: loads stay in order)
        return k

    def close(self) -> None:
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

    def __del__(self):
        if getattr(self, "fd", -1) >= 0:
            self.close()
