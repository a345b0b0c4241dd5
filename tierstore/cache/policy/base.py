"""The cache policy's interface: which arena slots to evict, learned from whole steps.

The engine drives one policy per cached table, once per step:

    policy.record(step_ids)                 # every unique id the step reads
    policy.touch(hit_slots)                 # slots that were already resident
    slots = policy.victims(k, pins)         # k unpinned resident slots to reuse for the misses
    policy.admitted(slots_written, miss_ids)

`make_policy(capacity, n_ids, config)` (__init__.py) builds the class of
`config.kind`: S3-FIFO with a TinyLFU sketch (ours, s3fifo.py), or
the LRU and random references (reference.py). This base holds what they share:
the frequency sketch, argument checks, the profile prior and the error when
too few slots are evictable. A subclass implements `_touch`, `_admit`,
`_victims`, `_forget` and `_expect` on whole numpy batches.
"""
from __future__ import annotations

import numpy as np

from tierstore.errors import InvalidArgument, ResourceExhausted
from tierstore.cache.policy.config import PolicyConfig
from tierstore.cache.policy.sketch import FrequencySketch
from tierstore.tiers.base import check_ids

__all__ = ["CachePolicy", "NotEnoughEvictable"]



class NotEnoughEvictable(ResourceExhausted, ValueError):
    """victims(k) was asked for more slots than are resident and unleased."""


class CachePolicy:
    """Eviction and admission policy for an arena of `capacity` slots over `n_ids` rows.

    All arrays are int64 numpy arrays; ids within one call must be unique (the
    engine dedupes a step). The policy never moves rows: it only says which
    slots to empty (`victims`) and learns what was written (`admitted`).
    slot_id: the engine's slot -> id array (tierstore/cache/slot_table.py), so one id map
    serves both; without it the policy keeps its own.
    """

    kind = ""

    def __init__(self, capacity: int, n_ids: int, config: PolicyConfig | None = None,
                 slot_id: np.ndarray | None = None):
        if capacity < 1 or n_ids < 1:
            raise InvalidArgument(f"capacity and n_ids must be >= 1, got {capacity}, {n_ids}")
        self.capacity, self.n_ids = int(capacity), int(n_ids)
        self.config = cfg = config or PolicyConfig()
        self._own_map = slot_id is None
        self.slot_id = np.full(capacity, -1, dtype=np.int64) if slot_id is None else slot_id
        if self.slot_id.shape != (capacity,):
            raise InvalidArgument(f"slot_id must have shape [{capacity}], got {self.slot_id.shape}")
        budget = int(cfg.sketch_max_mib * 2**20) // cfg.sketch_depth
        self.sketch = FrequencySketch(
            width=max(16, min(int(cfg.sketch_width * capacity), budget)), depth=cfg.sketch_depth,
            counter_max=cfg.counter_max, period=int(cfg.halve_every * capacity))

    def held_bytes(self) -> int:
        """Bytes of memory the policy holds (its sketch and per-slot state)."""
        own = [self.slot_id] if self._own_map else []
        return sum(a.nbytes for a in [self.sketch.counters, *own, *self._held()])

    def _held(self) -> list[np.ndarray]:
        """The subclass's per-slot arrays."""
        return []

    # ---- per-step calls ------------------------------------------------------
    def record(self, ids: np.ndarray) -> None:
        """Count one access of each (unique) id of a step, hits and misses alike."""
        ids = self._check_ids(ids)
        self._recorded(ids, self.sketch.add(ids))

    def touch(self, slots: np.ndarray) -> None:
        """Mark resident slots as hit in this step."""
        self._touch(np.asarray(slots, dtype=np.int64))

    def admitted(self, slots: np.ndarray, ids: np.ndarray) -> None:
        """`ids` were written into `slots` (emptied by victims() or never used)."""
        slots, ids = np.asarray(slots, dtype=np.int64), self._check_ids(ids)
        if slots.shape != ids.shape:
            raise InvalidArgument(f"admitted: {slots.size} slots for {ids.size} ids")
        self.slot_id[slots] = ids
        self._admit(slots, ids)

    def victims(self, k: int, pins: np.ndarray) -> np.ndarray:
        """k distinct resident slots to empty now, none of them pinned.

        pins: [capacity] array (the engine's pin counts, or a bool "leased"
        mask); a nonzero entry means the slot is in use and must not be evicted.
        The returned slots are forgotten by the policy (they read as free until
        admitted again). Raises NotEnoughEvictable (a ValueError and a
        ResourceExhausted) when fewer than k slots are resident and unpinned:
        the arena is full of leased rows, so the caller must wait for releases
        or plan less. A failed call changes nothing.
        """
        pins = np.asarray(pins)
        if pins.shape != (self.capacity,):
            raise InvalidArgument(f"pins must have shape [{self.capacity}], got {pins.dtype} {pins.shape}")
        if k <= 0:
            return np.zeros(0, dtype=np.int64)
        out = self._victims(k, pins)
        if self._own_map:  # a shared map is the engine's to clear (it reads the victims' ids first)
            self.slot_id[out] = -1
        return out

    def forget(self, slots: np.ndarray) -> None:
        """The engine emptied `slots` itself (a failed fill, a row invalidated)."""
        slots = np.asarray(slots, dtype=np.int64)
        if self._own_map:
            self.slot_id[slots] = -1
        self._forget(slots)

    def expect(self, slots: np.ndarray, ids: np.ndarray | None = None, steps: int | None = None,
               conn_id: bytes = b"") -> None:
        """Queued work will read these rows within `steps` steps (prefill ids are
        known when a request is admitted; default PolicyConfig.expect_steps, at most
        max_expect_steps: more raises InvalidArgument, as does a negative count).

        slots: resident rows; ids: rows not resident now, protected if they are
        admitted before the hint runs out (read ahead, or by another step); conn_id:
        the hinting client's id: pending ids are bounded per client and in all
        (PolicyConfig.pending_share), the ids past a bound are dropped. A
        soft hint: hinted rows are kept over others until then, but unlike a pin
        it never makes victims() fail. Hints.prefetch calls it once, when
        a request is admitted. Say when the request will run: a hint that
        outlives its use keeps rows nobody reads, and gains less the longer it
        overstays (docs/decisions.md, "How long a hint lasts").
        Costs O(len(slots) + len(ids)), whatever is pending already."""
        steps = self.config.hint_steps(steps)
        slots = np.asarray(slots, dtype=np.int64)
        if slots.size:
            self._expect(slots, steps)
        if ids is not None and np.size(ids):
            self._expect_ids(self._check_ids(ids), steps, conn_id)

    def load_profile(self, ids: np.ndarray, counts: np.ndarray) -> None:
        """Seed the sketch from an offline frequency profile (`tierstore profile`)."""
        ids, counts = self._check_ids(ids), np.asarray(counts, dtype=np.int64)
        if ids.shape != counts.shape or np.any(counts < 0):
            raise InvalidArgument("profile needs one non-negative count per id")
        uniq, inv = np.unique(ids, return_inverse=True)
        summed = np.bincount(inv, weights=counts).astype(np.int64)
        # scale so the hottest id lands at counter_max; not counted toward halving
        top = max(1, int(summed.max(initial=1)))
        seed = np.ceil(summed * self.sketch.counter_max / top).astype(np.int64)
        recorded = self.sketch.recorded
        self.sketch.add(uniq, seed)
        self.sketch.recorded = recorded

    def protect_room(self) -> int:
        """How many more rows a hint may protect now (reading ahead more is wasted I/O:
        the rows would be evicted before their request runs)."""
        return self.capacity

    @property
    def window(self) -> float:
        """The probation window's share of the capacity (TinyLFU; the config's elsewhere)."""
        return self.config.window

    # ---- what a policy implements -----------------------------------------------
    def _recorded(self, ids: np.ndarray, est: np.ndarray | None) -> None:
        """After record(): the step's ids and their new sketch estimates (None after a halving)."""

    def _touch(self, slots: np.ndarray) -> None:
        raise NotImplementedError

    def _admit(self, slots: np.ndarray, ids: np.ndarray) -> None:
        raise NotImplementedError

    def _victims(self, k: int, pins: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _forget(self, slots: np.ndarray) -> None:
        raise NotImplementedError

    def _expect(self, slots: np.ndarray, steps: int) -> None:
        raise NotImplementedError

    def _expect_ids(self, ids: np.ndarray, steps: int, conn_id: bytes) -> None:
        """Rows not resident yet (a policy without memory for them ignores the hint)."""

    # ---- shared pieces -----------------------------------------------------------
    def _check_ids(self, ids) -> np.ndarray:
        """The policy is also used alone (`bench cache` replays traces through it)."""
        return check_ids(ids, self.n_ids)

    def _evictable(self, pins: np.ndarray) -> np.ndarray:
        """Mask of resident, unpinned slots: O(capacity), for references and error paths."""
        return (pins == 0) & (self.slot_id >= 0)

    def _not_enough(self, k: int, pins: np.ndarray):
        n = int(np.count_nonzero(self._evictable(pins)))
        raise NotEnoughEvictable(
            f"asked for {k} victims but only {n} of {self.capacity} slots are evictable; "
            "release leases or plan fewer ids per step")
