"""Arrays whose memory is all faulted in when they are made.

`np.zeros` and `np.empty` of a few MB get untouched pages (and numpy asks for
transparent huge pages over them): each page is faulted in, and charged to the
memory cgroup the process is in, the first time it is written, which for the
per-slot state of a cache is while serving, a little at a time, long after the
sidecar started. A sidecar that faults in its per-slot state when a table is
opened reports its whole steady-state footprint at start and stays inside a
limit set from it (`tierstore bench cold` caps it at its start-up size plus a
small allowance).
"""
from __future__ import annotations

import mmap

import numpy as np

__all__ = ["resident", "zeros"]


def resident(a: np.ndarray) -> np.ndarray:
    """a, with one byte of every page of its buffer rewritten (contents kept), so all are faulted in now."""
    flat = np.ravel(a).view(np.uint8)
    if flat.size and np.shares_memory(flat, a):  # a contiguous array: ravel did not copy
        flat[::mmap.PAGESIZE] = flat[::mmap.PAGESIZE].copy()
    return a


def zeros(shape, dtype) -> np.ndarray:
    """np.zeros, faulted in now."""
    return resident(np.zeros(shape, dtype))
