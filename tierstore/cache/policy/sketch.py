"""Count-min frequency sketch with periodic halving (the TinyLFU frequency filter).

A compact, approximate "how often was this id seen lately" over a table of
hundreds of millions of rows: `depth` rows of `width` small counters, each id
hashed to one counter per row; its estimate is the minimum of those counters.
The rows are *blocked* (as Caffeine's sketch is): an id's `depth` counters lie
in one 64-byte block, a segment of each row, so an update or estimate costs one
cache line per id instead of `depth` (the sketch is tens of MB and every
access misses the CPU cache). The block is picked by scaling the hash's top 32
bits to the number of blocks, so a sketch is as many blocks as asked for (no
rounding up to a power of two: its size is a per-slot budget).

Updates are *conservative* (only counters equal to the current minimum grow),
which keeps estimates tight, and an estimate never falls below the true count
until the counter saturates at `counter_max` or a halving runs. Every `period`
recorded accesses all counters are halved, so the sketch forgets old
popularity and follows a drifting workload (TinyLFU's "reset").

Counters are 4 bits (two a byte, as TinyLFU's) when counter_max <= 15, a byte
otherwise: a block then holds 128 counters, or 64.
"""
from __future__ import annotations

import numpy as np

from tierstore.cache import prefault
from tierstore.errors import InvalidArgument
from tierstore.jit import Kernel

__all__ = ["FrequencySketch"]

# Odd 64-bit multipliers of the id hash (any odd constants with mixed bits work).
_MULTIPLIERS = np.array([
    0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F,
], dtype=np.uint64)
_MAX_DEPTH = 8
_NONE = np.zeros(0, dtype=np.int64)
_BLOCK = 64  # bytes per block: one CPU cache line


class FrequencySketch:
    """Approximate per-id access counts in `depth * width` counters of 4 bits (counter_max
    <= 15) or 8.

    width: counters per row, rounded up to whole blocks. depth: hash rows, 1..8.
    counter_max: saturation value (15 mimics TinyLFU's 4-bit counters; at most 255).
    period: recorded accesses between halvings; 0 disables halving.
    """

    def __init__(self, width: int, depth: int = 4, counter_max: int = 15, period: int = 0):
        if width < 1:
            raise InvalidArgument(f"sketch width must be >= 1, got {width}")
        if not 1 <= depth <= _MAX_DEPTH:
            raise InvalidArgument(f"sketch depth must be in 1..{_MAX_DEPTH}, got {depth}")
        if not 1 <= counter_max <= 255:
            raise InvalidArgument(f"counter_max must be in 1..255 (uint8 counters), got {counter_max}")
        if period < 0:
            raise InvalidArgument(f"halving period must be >= 0 (0 = never), got {period}")
        self.depth = depth
        self.counter_max = counter_max
        self.period = period
        self.nibbles = counter_max <= 15
        # a 64-byte block holds a segment of `seg` counters of each row
        self.per_block = _BLOCK * (2 if self.nibbles else 1)
        seg = 1 << int(np.log2(self.per_block // depth))
        blocks = max(1, -(-width // seg))
        self.width = blocks * seg
        self.counters = prefault.zeros((blocks, _BLOCK), np.uint8)
        self.recorded = 0  # accesses since the last halving
        self.halvings = 0
        log2_seg = int(np.log2(seg))
        # one mixed 64-bit hash per id: its top 32 bits, scaled to the block count, pick
        # the block; the next log2(seg) bits per row pick that row's counter in the block
        self._blocks = np.uint64(blocks)
        self._row_shift = (32 - log2_seg * np.arange(1, depth + 1)).astype(np.uint64)[:, None]
        self._row_mask = np.uint64(seg - 1)
        self._row_base = (np.arange(depth, dtype=np.uint64) * np.uint64(seg))[:, None]
        self._flat = self.counters.ravel()

    def _index(self, ids: np.ndarray) -> np.ndarray:
        """Counter index [depth, n] of each id (counters numbered from 0, per_block a block):
        one block, one counter per row segment."""
        h = np.asarray(ids, dtype=np.int64).view(np.uint64) * _MULTIPLIERS[0]
        h ^= h >> np.uint64(31)
        h *= _MULTIPLIERS[1]
        idx = ((h >> self._row_shift) & self._row_mask) + self._row_base
        idx += (((h >> np.uint64(32)) * self._blocks) >> np.uint64(32)) * np.uint64(self.per_block)
        return idx.view(np.int64)

    def _get(self, idx: np.ndarray) -> np.ndarray:
        if not self.nibbles:
            return self._flat[idx]
        return (self._flat[idx >> 1] >> ((idx & 1) << 2).astype(np.uint8)) & np.uint8(15)

    def _set(self, idx: np.ndarray, vals: np.ndarray) -> None:
        """Counters idx = vals (distinct idx; in nibble mode two of one byte are written in turn)."""
        if not self.nibbles:
            self._flat[idx] = vals
            return
        for half in (0, 1):  # the low nibbles, then the high ones: no lost store within a byte
            sel = (idx & 1) == half
            b, v = idx[sel] >> 1, vals[sel].astype(np.uint8)
            self._flat[b] = (self._flat[b] & np.uint8(0xF0 >> (4 * half))) | (v << np.uint8(4 * half))

    def _params(self) -> tuple:
        """The hash layout as the compiled loops take it."""
        return (self._row_shift.ravel(), self._row_mask, self._row_base.ravel(), self._blocks,
                np.uint64(self.per_block), self.nibbles)

    def estimate(self, ids: np.ndarray) -> np.ndarray:
        """Estimated recent access count of each id (int64, same length as ids)."""
        ids = np.asarray(ids, dtype=np.int64).ravel()
        if ids.size == 0:
            return np.zeros(0, dtype=np.int64)
        k = _LOOP.compiled()
        if k is not None:
            return k(self._flat, ids, _NONE, 0, 0, False, *self._params())
        return self._get(self._index(ids)).min(axis=0).astype(np.int64)

    def add(self, ids: np.ndarray, counts: np.ndarray | int = 1) -> np.ndarray | None:
        """Record `counts` accesses of each id (ids should be unique within a call).

        Returns each id's new estimate (uint8), or None when the call ended in
        a halving (the estimates it computed are stale)."""
        ids = np.asarray(ids, dtype=np.int64).ravel()
        if ids.size == 0:
            return np.zeros(0, dtype=np.uint8)
        k = _LOOP.compiled()
        if k is not None:  # one pass; ids sharing a counter see each other's update, as a stream would
            scalar = np.ndim(counts) == 0
            many = _NONE if scalar else np.asarray(counts, dtype=np.int64).ravel()
            target = k(self._flat, ids, many, int(counts) if scalar else 0, self.counter_max, True, *self._params())
            return self._recorded(int(counts) * ids.size if scalar else int(many.sum()), target.astype(np.uint8))
        idx = self._index(ids)
        vals = self._get(idx)
        cur = vals.min(axis=0)
        if np.ndim(counts) == 0 and counts == 1:  # the per-step case: no int64 round trip
            target = cur + (cur < self.counter_max).astype(np.uint8)
        else:
            target = np.minimum(cur + np.asarray(counts, dtype=np.int64), self.counter_max).astype(np.uint8)
        # conservative update: raise each counter only up to the id's new estimate; ids of
        # one call that share a counter keep the largest of their values
        new = np.maximum(vals, target).ravel()
        flat_idx = idx.ravel()
        order = np.lexsort((new, flat_idx))
        last = np.ones(order.size, bool)
        last[:-1] = flat_idx[order][1:] != flat_idx[order][:-1]
        self._set(flat_idx[order][last], new[order][last])
        return self._recorded(int(np.sum(counts)) if np.ndim(counts) else int(counts) * ids.size, target)

    def _recorded(self, n: int, target: np.ndarray) -> np.ndarray | None:
        self.recorded += n
        if self.period and self.recorded >= self.period:
            self.halve()
            return None
        return target

    def halve(self) -> None:
        """Halve every counter (integer shift, each nibble on its own): old popularity fades."""
        np.right_shift(self.counters, 1, out=self.counters)
        if self.nibbles:
            np.bitwise_and(self.counters, np.uint8(0x77), out=self.counters)
        self.recorded = 0
        self.halvings += 1

    @property
    def nbytes(self) -> int:
        return self.counters.nbytes


# ---- compiled loop (tierstore/jit.py); the numpy code above is its reference ----
def _sketch_loop(flat, ids, many, one, counter_max, write, row_shift, row_mask, row_base, blocks, per_block,
                 nibbles):
    """Per id: the minimum of its counters (write=False), or its conservative
    update by many[i] (or `one`), capped at counter_max (write=True)."""
    depth = row_shift.shape[0]
    out = np.empty(ids.shape[0], np.int64)
    idx = np.empty(depth, np.uint64)
    for i in range(ids.shape[0]):
        h = np.uint64(ids[i]) * np.uint64(0x9E3779B97F4A7C15)  # _MULTIPLIERS
        h ^= h >> np.uint64(31)
        h *= np.uint64(0xC2B2AE3D27D4EB4F)
        base = (((h >> np.uint64(32)) * blocks) >> np.uint64(32)) * per_block
        m = 255
        for r in range(depth):
            c = ((h >> row_shift[r]) & row_mask) + row_base[r] + base
            idx[r] = c
            if nibbles:
                v = np.int64((np.uint64(flat[c >> np.uint64(1)]) >> ((c & np.uint64(1)) << np.uint64(2))) & np.uint64(15))
            else:
                v = np.int64(flat[c])
            m = min(m, v)
        if write:
            m = min(m + (many[i] if many.shape[0] else one), counter_max)
            for r in range(depth):  # conservative: only counters below the new estimate grow
                c = idx[r]
                if nibbles:
                    b, sh = c >> np.uint64(1), (c & np.uint64(1)) << np.uint64(2)
                    if np.int64((np.uint64(flat[b]) >> sh) & np.uint64(15)) < m:
                        keep = np.uint64(flat[b]) & (np.uint64(0xF0) >> sh)
                        flat[b] = np.uint8(keep | (np.uint64(m) << sh))
                elif flat[c] < m:
                    flat[c] = m
        out[i] = m
    return out


_LOOP = Kernel(_sketch_loop)
