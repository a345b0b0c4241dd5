"""Our policy: S3-FIFO's queues with TinyLFU's frequency sketch for a ghost queue.

- a new row enters a small *probation* FIFO (`window` of the capacity), so a
  one-hit wonder leaves after one pass without disturbing anything else;
- a row hit while in probation, or whose sketch count says it was seen before
  (`main_freq`: it was evicted and came back), goes to the *main* FIFO, which
  evicts CLOCK-style: each hit since the last pass (capped at `max_hits`) buys
  one more pass.
A document's burst of repeats hits its rows while they sit in probation, so
they are kept (recency); the Zipf head returns often enough to live in main
(frequency). A miss whose part of the table is seldom hit (classes.py: a high
n-gram order's sub-table) needs one more sketch count to enter main directly,
and (PolicyConfig.first_out_ratio) one of a class hit less still, seen for the
first time, may enter probation at its head: first out, unless the next steps
hit it.
`victims` touches O(k + leased rows met) queue entries, never the
whole arena. The queues are lists linked through the slots and their walks
compiled loops (queues.py), 7 B a slot in all (link 4, queue and hits 1, hint end 2).
"""
from __future__ import annotations

import numpy as np

from tierstore.cache import prefault
from tierstore.jit import Kernel
from tierstore.cache.policy.base import CachePolicy
from tierstore.cache.policy.classes import ClassHitRates
from tierstore.cache.policy.pending import PendingHints
from tierstore.cache.policy.queues import (ADMIT, ENTRY, FIRST_OUT, FORGET, HIT, MAIN, PROBATION, SCAN,
                                           SWEEP_STEPS, TO_MAIN, UNTIL, _admit_loop, _forget_loop, _scan_loop,
                                           hinted, hits_of, live, slot_dtype, with_hits)

__all__ = ["S3FIFOPolicy"]


class S3FIFOPolicy(CachePolicy):
    kind = "s3fifo"

    def __init__(self, capacity, n_ids, config=None, slot_id=None):
        super().__init__(capacity, n_ids, config, slot_id)
        cfg, cap = self.config, self.capacity
        self._entry = prefault.zeros(cap, ENTRY)  # queue (FREE, PROBATION, MAIN; GHOST bit) and hits
        self._nxt = prefault.resident(np.full(cap, -1, dtype=slot_dtype(cap)))  # both queues' links
        self._count = np.zeros(3, dtype=np.int64)   # live entries per queue (index FREE unused)
        self._linked = np.zeros(3, dtype=np.int64)  # entries per queue's list, ghosts included
        self._heads = np.full(3, -1, dtype=np.int64)
        self._tails = np.full(3, -1, dtype=np.int64)
        self._window = max(1, int(cfg.window * cap))
        self._classes = ClassHitRates(n_ids, cfg.class_bins, cfg.class_decay) \
            if cfg.class_bins else None
        # window hill climbing: accesses and hits of the current sample period
        self._share, self._step, self._dir, self._prev_rate = cfg.window, cfg.adapt_step, 1.0, -1.0
        self._acc = self._hit = 0
        self._last = (np.zeros(0, np.int64), None)
        self._period = max(1, int(cfg.adapt_period * cap)) if cfg.adapt_window else 0
        self._cap = np.uint8(max(1, cfg.max_hits))
        # expect(): a hinted slot is passed over until step _until[slot] (mod 2^16, queues.py);
        # hinted ids not resident yet wait in _pending until their hint runs out
        self._steps = 0
        self._until = prefault.zeros(cap, UNTIL)
        self._sweep = 0  # where the next step's sweep of ended hint ends starts
        self._longest = cfg.max_expect_steps
        pending = max(cfg.pending_share * cap, min(cfg.pending_min, 2 * cap))
        self._pending = PendingHints(pending, pending * cfg.pending_client_share, cfg.hint_clients,
                                     cfg.max_expect_steps, n_ids)
        # at most half the arena protected at once: a deep queue of hints cannot crowd out
        # the rows in use or leave the queue walks nothing to evict. _protected counts every
        # slot whose hint is live (an extended protection still counts, until its new end);
        # _ends[e % R] of them end at step e (every live end is within max_expect_steps)
        self._protect_cap, self._protected = cap // 2, 0
        self._ring = cfg.max_expect_steps + 1
        self._ends = np.zeros(self._ring, np.int64)

    @property
    def window(self) -> float:
        return self._share

    def _held(self):
        classes = self._classes.arrays() if self._classes else []
        return [self._entry, self._nxt, self._until, self._ends, *self._pending.arrays(), *classes]

    def _recorded(self, ids, est):
        self._last = (ids, est)  # _admit reads the misses' estimates from here
        self._steps += 1
        if self._classes:
            self._classes.accessed(ids)
        end = self._steps % self._ring
        self._protected -= int(self._ends[end])
        self._ends[end] = 0
        self._pending.expire(self._steps)
        self._sweep_ends()
        if self._period:
            self._acc += ids.size
            if self._acc >= self._period:
                self._climb()

    def _sweep_ends(self) -> None:
        """Rewrite the ended hint ends of the next 1/SWEEP_STEPS of the arena to "ended a step
        ago": an end kept mod 2^16 never comes round to read live again (queues.py)."""
        a = self._sweep
        b = min(self.capacity, a + -(-self.capacity // SWEEP_STEPS))
        part = self._until[a:b]
        part[~hinted(part, self._steps, self._longest)] = (self._steps - 1) & 0xFFFF
        self._sweep = 0 if b == self.capacity else b

    def _hinted(self, slots) -> np.ndarray:
        """Which slots a live hint protects (slots: an index, or slice(None) for all)."""
        return hinted(self._until[slots], self._steps, self._longest)

    def _touch(self, slots):
        k = _TOUCH.compiled()
        if k is not None:
            k(self._entry, slots, self._cap)
        else:
            e = self._entry[slots]
            self._entry[slots] = with_hits(e, np.minimum(hits_of(e) + ENTRY(1), self._cap))  # uint8: no int64 copy
        self._hit += slots.size
        if self._classes:
            self._classes.hit(self.slot_id[slots])

    def _lists(self) -> tuple:
        return self._count, self._linked, self._nxt, self._heads, self._tails

    def _admit(self, slots, ids):
        where = np.zeros(slots.size, dtype=np.int8)  # TO_PROBATION
        if self.config.main_freq > 0:
            est = self._estimate_recorded(ids)
            where[est >= self.config.main_freq + self._weak(ids, self.config.class_ratio)] = TO_MAIN
            if self.config.first_out_ratio:
                where[self._weak(ids, self.config.first_out_ratio) & (est <= 1)] = FIRST_OUT  # a first sighting
        (ADMIT.compiled() or _admit_loop)(slots, where, self._entry, *self._lists())
        self._unprotect(slots)
        if self._pending.total:  # rows a queued request was promised: protected from now on
            until = self._pending.take(ids, self._steps)
            hinted_ = until > 0
            if hinted_.any():
                self._protect(slots[hinted_], until[hinted_])

    def _weak(self, ids, ratio) -> np.ndarray:
        """Which ids' classes are hit under `ratio` times the table's rate (none without the prior)."""
        return self._classes.weak(ids, ratio) if self._classes else np.zeros(ids.size, bool)

    def _forget(self, slots):
        (FORGET.compiled() or _forget_loop)(slots, self._entry, self._count)
        self._unprotect(slots)

    def _expect(self, slots, steps):
        """Full CLOCK credit: max_hits passes in main, promotion from probation
        when the hint has no steps (with steps its end protects the row instead);
        a credit over max_hits for hinted rows kept no more hits on `bench cache`."""
        slots = slots[live(self._entry[slots])]
        if steps:
            self._protect(slots, np.full(slots.size, self._steps + steps, dtype=np.int64))
        else:
            self._entry[slots] = with_hits(self._entry[slots], max(1, self.config.max_hits))

    def protect_room(self) -> int:
        return max(0, self._protect_cap - self._protected)

    def _end_of(self, slots) -> np.ndarray:
        """The step each slot's hint ends (int64; <= now: none live)."""
        d = (self._until[slots].astype(np.int64) - self._steps) & 0xFFFF
        return np.where((d != 0) & (d <= self._longest), self._steps + d, 0)

    def _protect(self, slots, until):
        """Pass over distinct `slots` until step `until` (theirs or later), within the cap.

        A slot protected already keeps its place and may only end later; new
        protections past the cap's room get CLOCK credit only (O(len(slots)))."""
        self._entry[slots] = with_hits(self._entry[slots], max(1, self.config.max_hits))
        cur = self._end_of(slots)
        new = cur <= self._steps
        room = max(0, self._protect_cap - self._protected)
        if int(np.count_nonzero(new)) > room:
            keep = np.ones(slots.size, bool)
            keep[np.flatnonzero(new)[room:]] = False
            slots, until, cur, new = slots[keep], until[keep], cur[keep], new[keep]
        grow = ~new & (until > cur)
        if grow.any():  # the count moves to the later end: counted until the protection really ends
            np.subtract.at(self._ends, cur[grow] % self._ring, 1)
            np.add.at(self._ends, until[grow] % self._ring, 1)
            self._until[slots[grow]] = until[grow] & 0xFFFF
        if new.any():
            np.add.at(self._ends, until[new] % self._ring, 1)
            self._until[slots[new]] = until[new] & 0xFFFF
            self._protected += int(np.count_nonzero(new))

    def _unprotect(self, slots):
        """End the protections of `slots` now (evicted, freed or admitted afresh)."""
        cur = self._end_of(slots)
        live = cur > self._steps
        if live.any():
            np.subtract.at(self._ends, cur[live] % self._ring, 1)
            self._protected -= int(np.count_nonzero(live))
        self._until[slots] = (self._steps - 1) & 0xFFFF

    def _expect_ids(self, ids, steps, conn_id):
        """Remember hinted ids that are not resident, until their hint runs out (bounded: pending.py)."""
        if steps:
            self._pending.add(ids, self._steps + steps, conn_id, self._steps)

    def _victims(self, k, pins):
        out, need = [], k
        fruitless = {PROBATION: 0, MAIN: 0}  # entries scanned since a queue last gave a victim
        while need > 0:
            usable = [q for q in (PROBATION, MAIN)
                      if self._count[q] > 0 and fruitless[q] <= (self.config.max_hits + 1) * self._count[q]]
            if not usable:
                # the queues' heads are all leased or still have CLOCK credit: take the rest
                # from one pass over the pins (O(capacity), rare) rather than refuse a step that fits
                taken = np.concatenate(out) if out else np.zeros(0, np.int64)
                mask = (pins == 0) & live(self._entry)
                mask[taken] = False
                extra = np.flatnonzero(mask & ~self._hinted(slice(None)))[:need]  # unhinted first
                if extra.size < need:
                    mask[extra] = False
                    extra = np.concatenate([extra, np.flatnonzero(mask)[:need - extra.size]])
                if extra.size < need:  # put back what this call took, so a failed call changes nothing
                    (ADMIT.compiled() or _admit_loop)(taken, np.zeros(taken.size, np.int8), self._entry,
                                                      *self._lists())
                    self._not_enough(k, pins)
                self._forget(extra)
                out.append(extra)
                break
            q = PROBATION if PROBATION in usable and (
                self._count[PROBATION] > self._window or MAIN not in usable) else MAIN
            got, scanned = self._scan(q, need, pins)
            fruitless[q] = 0 if got.size else fruitless[q] + scanned
            out.append(got)
            need -= got.size
        return np.concatenate(out)

    def _scan(self, q: int, need: int, pins: np.ndarray) -> tuple[np.ndarray, int]:
        """Walk queue q from its head: (its victims, entries walked)."""
        out = np.empty(need, dtype=np.int64)
        n, walked = (SCAN.compiled() or _scan_loop)(q, need, max(2 * need, 256), out, self._entry, pins,
                                                   self._until, self._steps, self._longest, *self._lists())
        return out[:n], walked

    def _estimate_recorded(self, ids: np.ndarray) -> np.ndarray:
        """Sketch estimates of `ids`, taken from the last record() when they are a
        subset of its (sorted, as the engine's unique gives) ids: no rehash."""
        rec, est = self._last
        if est is not None and rec.size and ids.size:
            k = _SUBSET.compiled()
            if k is not None:
                out = np.empty(ids.size, dtype=est.dtype)
                return out if k(rec, est, ids, out) else self.sketch.estimate(ids)
            pos = np.searchsorted(rec, ids)
            pos[pos == rec.size] = 0
            if np.array_equal(rec[pos], ids):  # fails, harmlessly, for unsorted or other ids
                return est[pos]
        return self.sketch.estimate(ids)

    def _climb(self) -> None:
        """One hill-climbing move of the probation window (a few scalar ops per period)."""
        rate = self._hit / self._acc
        if rate < self._prev_rate:
            self._dir = -self._dir
        self._prev_rate = rate
        self._share = min(0.6, max(0.02, self._share + self._dir * self._step))
        self._step *= 0.98
        self._window = max(1, int(self._share * self.capacity))
        self._acc = self._hit = 0


def _touch_loop(entry, slots, cap):
    """The hits of entry[slots] += 1, saturating at cap."""
    for i in range(slots.shape[0]):
        e = entry[slots[i]]
        if e // HIT < cap:
            entry[slots[i]] = e + HIT


def _subset_loop(rec, est, ids, out):
    """out[i] = est[j] where rec[j] == ids[i], both sorted; False if an id is not in rec."""
    j = 0
    for i in range(ids.shape[0]):
        while j < rec.shape[0] and rec[j] < ids[i]:
            j += 1
        if j == rec.shape[0] or rec[j] != ids[i]:
            return False
        out[i] = est[j]
    return True


_TOUCH, _SUBSET = Kernel(_touch_loop), Kernel(_subset_loop)
