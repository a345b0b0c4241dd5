"""Page-cache mode of the row path: rows gathered from a read-only map of each
segment, or pread where the map would fault.

Rows on "seen" pages are gathered through the map, on the guess that the page
cache holds them: at first every page (a table the host has room for is cached
once read), then the pages this reader pread. Under memory pressure (a table
larger than the host, a cgroup) the kernel evicts them and a gather takes major
faults, one at a time, inline. A gather slower than this per row says so: the
segment's seen flags are dropped and its rows are pread (many in flight) until
their pages are seen again. A call's first PROBE_ROWS rows go first, to find out.
"""
from __future__ import annotations

import mmap
import os
import time

import numpy as np

from tierstore.tiers.direct_io import _Scratch, pread_rows, row_buffer, thread_buffer
from tierstore.tiers.fused import place_verified

__all__ = ["MappedRows", "PAGE_SHIFT", "PROBE_ROWS", "EVICTED_S_PER_ROW"]

PAGE_SHIFT = 12
EVICTED_S_PER_ROW = 10e-6  # a major fault costs ~100 us, a first touch of a cached page ~1 us
PROBE_ROWS = 32


def _forget_if_evicted(seen: np.ndarray, rows: int, seconds: float) -> None:
    if rows >= PROBE_ROWS and seconds > rows * EVICTED_S_PER_ROW:
        seen[:] = False  # racy between threads, harmless: a page pread once more


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
                    # one flag per page: is it likely cached (see EVICTED_S_PER_ROW)?
                    view = self._maps[s] = (rows, np.ones((size >> PAGE_SHIFT) + 1, dtype=bool))
        return view

    def _fill_buffered(self, s: int, src, local: np.ndarray, ids, dest, slots, a: int, b: int) -> tuple[int, int, str]:
        """Page-cache mode: rows on pages this reader has read before come from its
        map (a gather: no syscall once mapped); rows on pages it has not are
        pread (a page fault on a cold page would wait for the device one at a
        time per thread, and a first touch of a cached page costs a few us too),
        after which their pages count as seen. Every row is placed and verified
        in one pass (tiers/fused.py)."""
        view, seen = src
        pages = local * self.row_bytes >> PAGE_SHIFT
        warm = seen[pages]
        if warm.all():
            t0 = time.perf_counter()
            bad = place_verified(view, local, ids[a:b], dest, slots[a:b], self.row_sums)
            _forget_if_evicted(seen, local.size, time.perf_counter() - t0)
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
            t0 = time.perf_counter()
            bad = place_verified(view, local[hot], ids[a:b][hot], dest, slots[a:b][hot], self.row_sums)
            _forget_if_evicted(seen, hot.size, time.perf_counter() - t0)
            nbytes += hot.size * self.row_bytes
            if bad >= 0:
                return nbytes, a + int(hot[bad]), ""
        return nbytes, -1, ""

    def _pread_buffer(self, nbytes: int) -> np.ndarray:
        return thread_buffer(_PREAD_SCRATCH, nbytes)
