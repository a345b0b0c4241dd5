"""Reference policies for tests and ablations: exact LRU and random eviction.

Both are O(capacity) per victims call (a pass over the pins); `bench cache`
compares ours against them and against libCacheSim's policies.
"""
from __future__ import annotations

import numpy as np

from tierstore.cache.policy.base import CachePolicy

__all__ = ["LRUPolicy", "RandomPolicy"]


class LRUPolicy(CachePolicy):
    """Evicts the least recently used unpinned slots; one clock tick per step."""

    kind = "lru"

    def __init__(self, capacity, n_ids, config=None, slot_id=None):
        super().__init__(capacity, n_ids, config, slot_id)
        self._clock = 0
        self._last = np.zeros(self.capacity, dtype=np.int64)

    def _held(self):
        return [self._last]

    def _touch(self, slots):
        self._clock += 1
        self._last[slots] = self._clock

    def _admit(self, slots, ids):
        self._clock += 1
        self._last[slots] = self._clock

    def _victims(self, k, pins):
        cand = np.flatnonzero(self._evictable(pins))
        if cand.size < k:
            self._not_enough(k, pins)
        return cand[np.argpartition(self._last[cand], k - 1)[:k]] if cand.size > k else cand

    def _forget(self, slots):
        pass

    def _expect(self, slots, steps):
        self._last[slots] = self._clock + 1


class RandomPolicy(CachePolicy):
    """Evicts uniformly random unpinned slots (seeded by config.seed)."""

    kind = "random"

    def __init__(self, capacity, n_ids, config=None, slot_id=None):
        super().__init__(capacity, n_ids, config, slot_id)
        self._rng = np.random.default_rng(self.config.seed)

    def _touch(self, slots):
        pass

    def _admit(self, slots, ids):
        pass

    def _victims(self, k, pins):
        for _ in range(4):  # cheap when most slots are evictable
            s = np.unique(self._rng.integers(0, self.capacity, size=4 * k + 16))
            s = s[(pins[s] == 0) & (self.slot_id[s] >= 0)]
            if s.size >= k:
                return self._rng.permutation(s)[:k]
        cand = self._rng.permutation(np.flatnonzero(self._evictable(pins)))
        if cand.size < k:
            self._not_enough(k, pins)
        return cand[:k]

    def _forget(self, slots):
        pass

    def _expect(self, slots, steps):
        pass
