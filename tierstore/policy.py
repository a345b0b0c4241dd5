"""Which arena slots to evict: the DRAM cache policy, batched.

The engine drives one `CachePolicy` per cached table, once per step:

    policy.record(step_ids)                 # every unique id the step reads
    policy.touch(hit_slots)                 # slots that were already resident
    slots = policy.victims(k, pins)         # k unpinned resident slots to reuse for the misses
    policy.admitted(slots_written, miss_ids)

`kind="tinylfu"` (the default) is S3-FIFO's queue structure with TinyLFU's
frequency sketch standing in for the ghost queue:
- a new row enters a small *probation* FIFO (`window` of the capacity), so a
  one-hit wonder leaves after one pass without disturbing anything else;
- a row hit while in probation, or whose sketch count says it was seen before
  (`main_freq`: it was evicted and came back), goes to the *main* FIFO, which
  evicts CLOCK-style: each hit since the last pass (capped at `max_hits`) buys
  one more pass.
A document's burst of repeats hits its rows while they sit in probation, so
they are kept (recency); the Zipf head returns often enough to live in main
(frequency). Every operation works on whole batches with numpy, and `victims`
touches O(k + leased rows met) queue entries, never the whole arena.

`kind="lru"` (exact LRU, O(capacity) per victims call) and `kind="random"`
are references for tests and ablations.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tierstore.errors import InvalidArgument, ResourceExhausted
from tierstore.sketch import FrequencySketch

_FREE, _PROBATION, _MAIN = 0, 1, 2


class NotEnoughEvictable(ResourceExhausted, ValueError):
    """victims(k) was asked for more slots than are resident and unleased."""


@dataclass(slots=True)
class PolicyConfig:
    """Tuning knobs; the defaults won on the traces of `tierstore bench cache`.

    kind: "tinylfu" (ours), "lru" or "random" (references).
    window: probation FIFO share of the capacity, in (0, 1); where it starts when adapted.
    adapt_window: hill-climb the window online (as Caffeine's W-TinyLFU does):
        every `adapt_period` accesses per cache slot, move it by `adapt_step`
        of the capacity in the direction that last raised the hit ratio (turn
        back when it fell); the step decays by 2% per move. Off by default: the
        best window differs by trace and cache size (0.1 to 0.35 on the text
        traces) but hit-ratio noise between periods misled the climber on them
        (up to -0.015 against a fixed 0.2, which stays within 0.001 of the best
        reference at every size; `bench cache`).
    main_freq: sketch count at which a missed id enters main directly (it was
        seen before and evicted); 0 sends every miss to probation.
    max_hits: CLOCK hit budget of a main-queue row (extra passes it survives).
    sketch_width: sketch counters per row per cache slot (rounded up to 2^n).
    sketch_depth: hash rows of the sketch.
    counter_max: sketch counter saturation (15 = TinyLFU's 4-bit counters).
    halve_every: recorded accesses between sketch halvings, per cache slot.
    sketch_max_mib: ceiling on the sketch's memory (depth * width bytes).
    seed: for kind="random" only.
    """

    kind: str = "tinylfu"
    window: float = 0.2
    adapt_window: bool = False
    adapt_period: float = 1.0
    adapt_step: float = 0.05
    main_freq: int = 2
    max_hits: int = 3
    sketch_width: float = 8.0
    sketch_depth: int = 4
    counter_max: int = 15
    halve_every: float = 5.0
    sketch_max_mib: float = 256.0
    seed: int = 0

    def __post_init__(self):
        if self.kind not in ("tinylfu", "lru", "random"):
            raise InvalidArgument(f"policy kind {self.kind!r} is unknown; use 'tinylfu', 'lru' or 'random'")
        if not 0.0 < self.window < 1.0:
            raise InvalidArgument(f"window must be in (0, 1), got {self.window}")
        if not self.adapt_period > 0 or not 0 <= self.adapt_step < 1:
            raise InvalidArgument(f"adapt_period must be > 0 and adapt_step in [0, 1), got "
                                  f"{self.adapt_period}, {self.adapt_step}")
        if self.main_freq < 0 or not 0 <= self.max_hits <= 127:
            raise InvalidArgument(f"main_freq must be >= 0 and max_hits in 0..127, got {self.main_freq}, {self.max_hits}")
        if self.sketch_width <= 0 or self.halve_every < 0 or self.sketch_max_mib <= 0:
            raise InvalidArgument(f"sketch_width must be > 0 and halve_every >= 0, got "
                                  f"{self.sketch_width}, {self.halve_every}")
        if not 1 <= self.counter_max <= 255 or not 1 <= self.sketch_depth <= 8:
            raise InvalidArgument(f"counter_max must be in 1..255 and sketch_depth in 1..8, got "
                                  f"{self.counter_max}, {self.sketch_depth}")


class _SlotQueue:
    """FIFO of (slot, ticket) in a ring-free buffer; stale entries are skipped lazily."""

    def __init__(self, capacity: int):
        self.slot = np.empty(2 * capacity + 1024, dtype=np.int64)
        self.ticket = np.empty_like(self.slot)
        self.head = self.tail = 0

    def push(self, slots: np.ndarray, tickets: np.ndarray, live) -> None:
        n = slots.size
        if self.tail + n > self.slot.size:
            self._compact(live, n)
        self.slot[self.tail:self.tail + n] = slots
        self.ticket[self.tail:self.tail + n] = tickets
        self.tail += n

    def _compact(self, live, extra: int) -> None:
        s, t = self.slot[self.head:self.tail], self.ticket[self.head:self.tail]
        keep = live(s, t)
        s, t = s[keep], t[keep]
        if s.size + extra > self.slot.size:
            self.slot = np.empty(2 * (s.size + extra), dtype=np.int64)
            self.ticket = np.empty_like(self.slot)
        self.slot[:s.size], self.ticket[:s.size] = s, t
        self.head, self.tail = 0, s.size

    def peek(self, m: int) -> tuple[np.ndarray, np.ndarray]:
        end = min(self.head + m, self.tail)
        return self.slot[self.head:end].copy(), self.ticket[self.head:end].copy()


class CachePolicy:
    """Eviction and admission policy for an arena of `capacity` slots over `n_ids` rows.

    All arrays are int64 numpy arrays; ids within one call must be unique (the
    engine dedupes a step). The policy never moves rows: it only says which
    slots to empty (`victims`) and learns what was written (`admitted`).
    """

    def __init__(self, capacity: int, n_ids: int, config: PolicyConfig | None = None,
                 slot_id: np.ndarray | None = None):
        if capacity < 1 or n_ids < 1:
            raise InvalidArgument(f"capacity and n_ids must be >= 1, got {capacity}, {n_ids}")
        self.capacity, self.n_ids = int(capacity), int(n_ids)
        self.config = cfg = config or PolicyConfig()
        # id held by each slot, -1 free; the engine passes its own slot table's array,
        # so one id map serves both (the writes here repeat the engine's, harmlessly)
        self._own_map = slot_id is None
        self.slot_id = np.full(capacity, -1, dtype=np.int64) if slot_id is None else slot_id
        if self.slot_id.shape != (capacity,):
            raise InvalidArgument(f"slot_id must have shape [{capacity}], got {self.slot_id.shape}")
        budget = int(cfg.sketch_max_mib * 2**20) // cfg.sketch_depth // 2  # the width rounds up to 2^n
        self.sketch = FrequencySketch(
            width=max(16, min(int(cfg.sketch_width * capacity), budget)), depth=cfg.sketch_depth,
            counter_max=cfg.counter_max, period=int(cfg.halve_every * capacity))
        self._profile = (np.zeros(0, np.int64), np.zeros(0, np.int64))
        self._rng = np.random.default_rng(cfg.seed)
        self._clock = 0  # one tick per pushed entry (tinylfu) or per step (lru)
        if cfg.kind == "tinylfu":
            self._where = np.zeros(capacity, dtype=np.int8)
            self._ticket = np.zeros(capacity, dtype=np.int64)
            self._hits = np.zeros(capacity, dtype=np.uint8)
            self._queues = {_PROBATION: _SlotQueue(capacity), _MAIN: _SlotQueue(capacity)}
            self._count = {_PROBATION: 0, _MAIN: 0}
            self._window = max(1, int(cfg.window * capacity))
            # window hill climbing: accesses and hits of the current sample period
            self._share, self._step, self._dir, self._prev_rate = cfg.window, cfg.adapt_step, 1.0, -1.0
            self._acc = self._hit = 0
            self._recorded = (np.zeros(0, np.int64), None)
            self._period = max(1, int(cfg.adapt_period * capacity)) if cfg.adapt_window else 0
            self._cap = np.uint8(max(1, cfg.max_hits))
        elif cfg.kind == "lru":
            self._last = np.zeros(capacity, dtype=np.int64)

    # ---- per-step calls ------------------------------------------------------
    def record(self, ids: np.ndarray) -> None:
        """Count one access of each (unique) id of a step, hits and misses alike."""
        ids = self._check_ids(ids)
        est = self.sketch.add(ids)
        if self.config.kind == "tinylfu":
            self._recorded = (ids, est)  # admitted() reads the misses' estimates from here
        if self.config.kind == "tinylfu" and self._period:
            self._acc += ids.size
            if self._acc >= self._period:
                self._climb()

    def touch(self, slots: np.ndarray) -> None:
        """Mark resident slots as hit in this step."""
        slots = np.asarray(slots, dtype=np.int64)
        kind = self.config.kind
        if kind == "tinylfu":
            self._hits[slots] = np.minimum(self._hits[slots] + np.uint8(1), self._cap)  # uint8: no int64 copy
            self._hit += slots.size
        elif kind == "lru":
            self._clock += 1
            self._last[slots] = self._clock

    def admitted(self, slots: np.ndarray, ids: np.ndarray) -> None:
        """`ids` were written into `slots` (emptied by victims() or never used)."""
        slots, ids = np.asarray(slots, dtype=np.int64), self._check_ids(ids)
        if slots.shape != ids.shape:
            raise InvalidArgument(f"admitted: {slots.size} slots for {ids.size} ids")
        self.slot_id[slots] = ids
        kind = self.config.kind
        if kind == "lru":
            self._clock += 1
            self._last[slots] = self._clock
        elif kind == "tinylfu":
            old = self._where[slots]
            for q in (_PROBATION, _MAIN):
                self._count[q] -= int(np.count_nonzero(old == q))
            to_main = np.zeros(slots.size, dtype=bool)
            if self.config.main_freq > 0:
                to_main = self._estimate_recorded(ids) >= self.config.main_freq
            self._hits[slots] = 0
            self._push(_MAIN, slots[to_main])
            self._push(_PROBATION, slots[~to_main])

    def victims(self, k: int, pins: np.ndarray) -> np.ndarray:
        """k distinct resident slots to empty now, none of them pinned.

        pins: [capacity] array (the engine's pin counts, or a bool "leased"
        mask); a nonzero entry means the slot is in use and must not be evicted.
        Only the entries the queues walk past are read, so a call costs
        O(k + pinned slots met), never a pass over the arena (except the rare
        fallback when the queue heads are all pinned or still have CLOCK credit).
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
        kind = self.config.kind
        if kind == "tinylfu":
            out = self._victims_fifo(k, pins)
        else:
            cand = np.flatnonzero((pins == 0) & (self.slot_id >= 0)) if kind == "lru" else self._sample(k, pins)
            if cand.size < k:
                self._not_enough(k, pins)
            if kind == "lru":
                cand = cand[np.argpartition(self._last[cand], k - 1)[:k]] if cand.size > k else cand
            out = cand[:k]
        if self._own_map:  # a shared map is the engine's to clear (it reads the victims' ids first)
            self.slot_id[out] = -1
        return out

    def forget(self, slots: np.ndarray) -> None:
        """The engine emptied `slots` itself (a table dropped, a row invalidated)."""
        slots = np.asarray(slots, dtype=np.int64)
        if self._own_map:
            self.slot_id[slots] = -1
        if self.config.kind == "tinylfu":
            old = self._where[slots]
            for q in (_PROBATION, _MAIN):
                self._count[q] -= int(np.count_nonzero(old == q))
            self._where[slots] = _FREE

    # ---- lookahead, hot set, profile ---------------------------------------
    def expect(self, slots: np.ndarray) -> None:
        """Resident `slots` hold rows that queued work will read soon (prefill known ahead).

        A soft hint: each gets the full CLOCK credit (`max_hits` passes in main,
        promotion from probation), so victims() passes over them while others
        can go; unlike a pin it never makes victims() fail. TableEngine.prefetch
        calls it once, when a request is admitted, with the request's resident
        rows (a longer credit for hinted rows measured no better)."""
        slots = np.asarray(slots, dtype=np.int64)
        if self.config.kind == "tinylfu" and slots.size:
            slots = slots[self._where[slots] != _FREE]
            self._hits[slots] = max(1, self.config.max_hits)
        elif self.config.kind == "lru" and slots.size:
            self._last[slots] = self._clock + 1

    def admit_mask(self, ids: np.ndarray, victim_ids: np.ndarray) -> np.ndarray:
        """TinyLFU admission for optional (prefetch) rows: True where ids[i] is
        estimated more frequent than victim_ids[i], the row it would displace."""
        ids, victim_ids = self._check_ids(ids), np.asarray(victim_ids, dtype=np.int64)
        if ids.shape != victim_ids.shape:
            raise InvalidArgument(f"admit_mask: {ids.size} ids against {victim_ids.size} victims")
        return self.sketch.estimate(ids) > self.sketch.estimate(victim_ids)

    def hot_set(self, k: int) -> np.ndarray:
        """Up to k ids with the highest estimated frequency, most frequent first.

        Candidates are the resident ids and the loaded profile (the sketch cannot
        enumerate ids): O(capacity), meant for occasional HBM-cache seeding."""
        cand = np.union1d(self.slot_id[self.slot_id >= 0], self._profile[0])
        if cand.size == 0 or k <= 0:
            return np.zeros(0, dtype=np.int64)
        est = self.sketch.estimate(cand)
        prof = np.zeros(cand.size, dtype=np.int64)
        prof[np.searchsorted(cand, self._profile[0])] = self._profile[1]
        order = np.lexsort((-prof, -est))  # sketch first, profile count breaks ties
        return cand[order[:k]]

    def load_profile(self, ids: np.ndarray, counts: np.ndarray) -> None:
        """Seed the sketch from an offline frequency profile (`tierstore profile`)."""
        ids, counts = self._check_ids(ids), np.asarray(counts, dtype=np.int64)
        if ids.shape != counts.shape or np.any(counts < 0):
            raise InvalidArgument("profile needs one non-negative count per id")
        uniq, inv = np.unique(ids, return_inverse=True)
        summed = np.bincount(inv, weights=counts).astype(np.int64)
        self._profile = (uniq, summed)
        # scale so the hottest id lands at counter_max; not counted toward halving
        top = max(1, int(summed.max(initial=1)))
        seed = np.ceil(summed * self.sketch.counter_max / top).astype(np.int64)
        recorded = self.sketch.recorded
        self.sketch.add(uniq, seed)
        self.sketch.recorded = recorded

    # ---- internals -------------------------------------------------------------
    def _check_ids(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise InvalidArgument(f"ids must be integers, got dtype {ids.dtype}")
        ids = ids.astype(np.int64, copy=False).ravel()
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_ids):
            bad = ids[(ids < 0) | (ids >= self.n_ids)][0]
            raise InvalidArgument(f"table has {self.n_ids} rows; id {bad} is out of range")
        return ids

    def _not_enough(self, k: int, pins: np.ndarray):
        n = int(np.count_nonzero((pins == 0) & (self.slot_id >= 0)))  # error path only
        raise NotEnoughEvictable(
            f"asked for {k} victims but only {n} of {self.capacity} slots are evictable; "
            "release leases or plan fewer ids per step")

    def _sample(self, k: int, pins: np.ndarray) -> np.ndarray:
        for _ in range(4):  # cheap when most slots are evictable
            s = np.unique(self._rng.integers(0, self.capacity, size=4 * k + 16))
            s = s[(pins[s] == 0) & (self.slot_id[s] >= 0)]
            if s.size >= k:
                return self._rng.permutation(s)[:k]
        return self._rng.permutation(np.flatnonzero((pins == 0) & (self.slot_id >= 0)))

    def _estimate_recorded(self, ids: np.ndarray) -> np.ndarray:
        """Sketch estimates of `ids`, taken from the last record() when they are a
        subset of its (sorted, as the engine's np.unique gives) ids: no rehash."""
        rec, est = self._recorded
        if est is not None and rec.size and ids.size:
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

    @property
    def window(self) -> float:
        """The probation window's current share of the capacity (tinylfu)."""
        return getattr(self, "_share", self.config.window)

    def _push(self, q: int, slots: np.ndarray) -> None:
        if slots.size == 0:
            return
        tickets = np.arange(self._clock, self._clock + slots.size, dtype=np.int64)
        self._clock += slots.size
        self._where[slots] = q
        self._ticket[slots] = tickets
        self._count[q] += slots.size
        self._queues[q].push(slots, tickets, lambda s, t: (self._where[s] == q) & (self._ticket[s] == t))

    def _victims_fifo(self, k: int, pins: np.ndarray) -> np.ndarray:
        out, need = [], k
        fruitless = {_PROBATION: 0, _MAIN: 0}  # entries scanned since a queue last gave a victim
        while need > 0:
            usable = [q for q in (_PROBATION, _MAIN)
                      if self._count[q] > 0 and fruitless[q] <= (self.config.max_hits + 1) * self._count[q]]
            if not usable:
                # the queues' heads are all leased or still have CLOCK credit: take the rest
                # from one pass over the pins (O(capacity), rare) rather than
                # refuse a step that fits
                taken = np.concatenate(out) if out else np.zeros(0, np.int64)
                mask = (pins == 0) & (self._where != _FREE)
                mask[taken] = False
                extra = np.flatnonzero(mask)[:need]
                if extra.size < need:  # put back what this call took, so a failed call changes nothing
                    self._push(_PROBATION, taken)
                    self._not_enough(k, pins)
                for q in (_PROBATION, _MAIN):
                    self._count[q] -= int(np.count_nonzero(self._where[extra] == q))
                self._where[extra] = _FREE
                out.append(extra)
                break
            q = _PROBATION if _PROBATION in usable and (
                self._count[_PROBATION] > self._window or _MAIN not in usable) else _MAIN
            got = self._scan(q, need, pins)
            fruitless[q] = 0 if got.size else fruitless[q] + self._last_scanned
            out.append(got)
            need -= got.size
        return np.concatenate(out)

    def _scan(self, q: int, need: int, pins: np.ndarray) -> np.ndarray:
        """Pop one chunk from queue q's head; return its victims, requeue the rest."""
        queue = self._queues[q]
        s, t = queue.peek(max(2 * need, 256))
        live = (self._where[s] == q) & (self._ticket[s] == t)
        free = (pins[s] == 0) & live
        hits = self._hits[s]
        victim = free & (hits == 0)
        cum = np.cumsum(victim)
        cut = s.size if cum.size == 0 or cum[-1] < need else int(np.searchsorted(cum, need)) + 1
        s, live, free, hits, victim = s[:cut], live[:cut], free[:cut], hits[:cut], victim[:cut]
        queue.head += cut
        self._last_scanned = cut
        out = s[victim]
        self._where[out] = _FREE
        self._count[q] -= out.size
        keep = live & ~victim
        if q == _PROBATION:
            promote = keep & free  # hit while on probation
            self._count[q] -= int(np.count_nonzero(keep))
            self._hits[s[promote]] = 0
            self._push(_MAIN, s[promote])
            self._push(_PROBATION, s[keep & ~free])  # leased: in use, so recent
        else:
            self._hits[s[free & keep]] -= 1  # CLOCK: a hit buys one more pass
            self._count[q] -= int(np.count_nonzero(keep))
            self._push(_MAIN, s[keep])
        return out
