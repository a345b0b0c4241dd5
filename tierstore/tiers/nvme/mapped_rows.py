"""Page-cache mode of the row path: rows gathered from a read-only map of each
segment, or pread where the map would fault.

Rows on "seen" pages are gathered through the map, on the guess that the page
cache holds them: at first every page (a table the host has room for is cached
once read), then the pages this reader pread. Under memory pressure (a table
larger than the host, a cgroup) the kernel evicts them and a gather takes major
faults, one at a time, inline. A gather whose thread took major faults on more
than EVICTED_FRACTION of its rows says so (the thread's own fault count, from
getrusage: a gather that is merely slow because the CPU is busy elsewhere says
nothing): the segment's seen flags are dropped and its rows are pread (many in
flight) until their pages are seen again. A call's first PROBE_ROWS rows go
first, to find out. Where the thread's count is not to be had (not Linux), a
gather slower than EVICTED_S_PER_ROW a row counts instead.
"""
from __future__ import annotations

import mmap
import os
import resource
import time

import numpy as np

from tierstore.tiers.nvme.direct_io import _Scratch, pread_rows, row_buffer, thread_buffer
from tierstore.tiers.nvme.verified_copy import place_verified

__all__ = ["MappedRows", "PAGE_SHIFT", "PROBE_ROWS", "EVICTED_FRACTION", "EVICTED_S_PER_ROW"]

PAGE_SHIFT = 12
EVICTED_FRACTION = 0.1     # a gather that major-faulted on more of its rows than this
EVICTED_S_PER_ROW = 10e-6  # without fault counts: a major fault costs ~100 us, a cached page's first touch ~1 us
PROBE_ROWS = 32
_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)


def _faults() -> int | None:
    """Major faults this thread has taken so far (None where the OS does not say)."""
    return resource.getrusage(_RUSAGE_THREAD).ru_majflt if _RUSAGE_THREAD is not None else None


class _Gather:
    """Times a gather and counts its major faults: `with _Gather(seen, rows): ...`."""

    __slots__ = ("seen", "rows", "t0", "f0")

    def __init__(self, seen: np.ndarray, rows: int):
        self.seen, self.rows = seen, rows

    def __enter__(self):
        self.f0, self.t0 = _faults(), time.perf_counter()

    def __exit__(self, *exc):
        if self.rows < PROBE_ROWS:
            return
        if self.f0 is not None:
            evicted = _faults() - self.f0 > self.rows * EVICTED_FRACTION
        else:
            evicted = time.perf_counter() - self.t0 > self.rows * EVICTED_S_PER_ROW
        if evicted:
            self.seen[:] = False  # racy between threads, harmless: a page pread once more


_PREAD_SCRATCH = _Scratch()


class MappedRows:
    """Segment maps and their seen flags over the attributes SegmentReader sets up."""

    def _map(self, s: int) -> tuple[np.ndarray, np.ndarray]:
        """Segment s as a read-only uint8 [rows held, row_bytes] view, mapped once,
        and its pages' seen flags."""
        view = self._maps[s]
        if view is None:
            with self._lock:
                view = self._maps[s]
                if view is None:
                    size = os.fstat(self._fds[s]).st_size
                    held = size // self.row_bytes
                    if held == 0:
                        rows = np.empty((0, self.row_bytes), dtype=np.uint8)
                    else:
                        mm = mmap.mmap(self._fds[s], held * self.row_bytes, prot=mmap.PROT_READ)
                        mm.madvise(mmap.MADV_RANDOM)  # scattered rows: fault one page, no read-around
                        rows = np.frombuffer(mm, dtype=np.uint8).reshape(held, self.row_bytes)
                    # one flag per page: is it likely cached (see _Gather)?
                    view = self._maps[s] = (rows, np.ones((size >> PAGE_SHIFT) + 1, dtype=bool))
        return view

    def _fill_buffered(self, s: int, src, local: np.ndarray, ids, dest, slots, a: int, b: int) -> tuple[int, int, str]:
        """Page-cache mode: rows on pages this reader has read before come from its
        map (a gather: no syscall once mapped); rows on pages it has not are
        pread (a page fault on a cold page would wait for the device one at a
        time per thread, and a first touch of a cached page costs a few us too),
        after which their pages count as seen. Every row is placed and verified
        in one pass (tiers/nvme/verified_copy.py)."""
        view, seen = src
        pages = local * self.row_bytes >> PAGE_SHIFT
        warm = seen[pages]
        if warm.all():
            with _Gather(seen, local.size):
                bad = place_verified(view, local, ids[a:b], dest, slots[a:b], self.row_sums)
            return local.size * self.row_bytes, (a + bad if bad >= 0 else -1), ""
        cold = np.flatnonzero(~warm)
        got = row_buffer(cold.size, self.row_bytes)
        nbytes, short = pread_rows(self._fds[s], local[cold], self.row_bytes, 1, got, self._pread_buffer)
        if short >= 0:
            return nbytes, a + int(cold[short]), f"segment {self.version.segments[s]} is truncated"
        bad = place_verified(got, np.arange(cold.size), ids[a:b][cold], dest, slots[a:b][cold], self.row_sums)
        if bad >= 0:
            return nbytes, a + int(cold[bad]), ""
        seen[pages[cold]] = True  # racy between threads, harmless: a page read twice
        if cold.size < local.size:
            hot = np.flatnonzero(warm)
            with _Gather(seen, hot.size):
                bad = place_verified(view, local[hot], ids[a:b][hot], dest, slots[a:b][hot], self.row_sums)
            nbytes += hot.size * self.row_bytes
            if bad >= 0:
                return nbytes, a + int(hot[bad]), ""
        return nbytes, -1, ""

    def _pread_buffer(self, nbytes: int) -> np.ndarray:
        return thread_buffer(_PREAD_SCRATCH, nbytes)
