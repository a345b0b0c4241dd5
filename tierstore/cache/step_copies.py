"""StepCopies: the copies of one step that an engine's ranks each read, learned once.

The tensor-parallel ranks of one engine each stage the same batch, and each is a
client of the sidecar: every step's ids come once per rank, planned or noted. The
policy learns from whole steps (policy/base.py), so without this it would learn
each step TP times: every row counted TP times by the sketch (4-bit counters
saturate, and the halving period is spent TP times as fast), touched TP times (its
CLOCK credit full after one step), and the policy's step clock TP times as fast as
the engine's, so a hint for w steps (a queued request's wait) would lapse after
w / TP of them.

A step is a copy when its ids are those of one of the last WINDOW steps learned
from another client, in any order (a rank lists the rows it found resident first,
then its misses, and two ranks may find different rows resident). A client that
repeats its own step is learning again: that is two accesses. Steps are told apart
by an order-free digest of their ids: their count, and the sum and the xor of a
64-bit mix of each (a collision merges two steps' learning; it never changes a row
that is served).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from tierstore.jit import Kernel, mix64

__all__ = ["StepCopies", "WINDOW", "GAMMA", "step_digest"]

GAMMA = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's step: ids spread before the finaliser
WINDOW = 256  # steps learned that a rank's copy may trail by (its notes are batched: a few steps late)


class StepCopies:
    """The last `window` steps learned, by their ids' digest, each with the client it came from."""

    def __init__(self, window: int | None = None):
        self.window = WINDOW if window is None else int(window)
        self._seen: OrderedDict[tuple, bytes] = OrderedDict()  # digest -> the client it was learned from

    def first(self, digest: tuple, source: bytes) -> bool:
        """Whether the step of `digest` (step_digest of its ids) from client `source` is to be
        learned: False for another client's copy of a step learned within the window. O(1):
        the caller digests the ids before it takes the engine's lock."""
        seen = self._seen.get(digest)
        if seen is not None and seen != source:
            return False
        self._seen[digest] = source
        self._seen.move_to_end(digest)
        if len(self._seen) > self.window:
            self._seen.popitem(last=False)
        return True


def _digest_loop(ids):
    total = np.uint64(0)
    xor = np.uint64(0)
    for i in range(ids.shape[0]):
        h = mix64(np.uint64(ids[i]) * GAMMA)
        total += h
        xor ^= h
    return total, xor


_DIGEST = Kernel(_digest_loop)


def step_digest(ids: np.ndarray) -> tuple:
    """A step's digest for StepCopies.first: (count, sum, xor) of splitmix64's finaliser over
    its ids, the same for any order; one compiled pass (vectorised without numba)."""
    k = _DIGEST.compiled()
    if k is not None and ids.dtype == np.int64:
        total, xor = k(ids)
        return ids.size, int(total), int(xor)
    h = mix64(ids.astype(np.uint64) * GAMMA)
    return ids.size, int(h.sum(dtype=np.uint64)), int(np.bitwise_xor.reduce(h)) if h.size else 0
