"""HBMCache: a per-worker device cache of one table's hottest rows.

n-gram rows are Zipf-distributed, so a few percent of a table serves most
reads; holding those rows in HBM saves the PCIe (or UVA) traffic of reading
them from the shared DRAM arena every step. The cache holds encoded rows
(bit-exact, dequantised by the gather kernel like arena rows), so a hit and a
miss give identical output.

The id -> slot map is a dense int32 numpy array on the host (-1 = absent):
ids are hashed on the host, and the layer must split hits from misses
*before* it asks the RowSource for the misses. 4 bytes per table row
(1.5 GB for a 384 M-row V4.1 layer) against >= 128-byte rows.

Admission is by frequency, and adaptive by default: `seed()` fills the cache
from a hot-set list (the sidecar's sketch or a `tierstore profile` output,
hottest first); the layer calls `observe()` when it plans a step and
`maybe_refresh(source)` when the step's gather is enqueued. Every id read in a
step counts once (what a hit saves is one row fetch, however many positions
read it): residents exactly, others in a count-min sketch, both halved every
`half_life` steps so the cache follows drifting text. Every `refresh_every`
steps the most-read non-residents that beat the coldest residents replace
them, at most `refresh_bytes` per step of rows copied host -> device. On CUDA
that copy runs on a side stream after the work already queued (so a gather
still reading an evicted slot finishes first), and `rows` makes the reading
stream wait for it: it overlaps the next step's planning and earlier blocks.

Example::

    cache = HBMCache.from_source(source, "l1", capacity_rows=1 << 20,
                                 device="cuda", hot_ids=profile_ids)
    layer = EngramLayer(spec, 1, source=source, hbm_cache=cache)
    ...                       # the layer refreshes the cache between steps
    cache.stats()             # hit ratio, refresh traffic
"""
from __future__ import annotations

import numpy as np
import torch

from tierstore.errors import InvalidArgument
from tierstore.cache.policy.sketch import FrequencySketch
from tierstore.tiers.base import check_ids

__all__ = ["HBMCache"]

_SCORE_MAX = 255  # the sketch's counter ceiling: residents and candidates on one scale


class HBMCache:
    """Device cache of up to `capacity_rows` rows of one table.

    capacity_rows: rows held on `device` (uint8 [capacity_rows, row_bytes]).
    row_bytes: encoded row width of the table.
    device: torch device of the cached rows ("cuda", or "cpu" for tests).
    n_ids: rows in the table (size of the id -> slot map).
    table: table name, used by `maybe_refresh(source)` to fetch admitted rows.
    refresh_every: `maybe_refresh` acts at most once per this many observed steps.
    refresh_bytes: host -> device bytes a refresh may copy per observed step
        (None: no limit; 0: never adapt, the seeded set stays).
    half_life: steps after which a read counts half (how fast the cache forgets).
    admit_margin: reads by which a candidate's score must beat the row it
        replaces. Copying a row in costs about one read of it, so 0 churns:
        on held-out real text it copied 2.7 KB/token to gain 0.03 hit ratio,
        more host->device bytes than no HBM cache at all (`bench hbm`).
    """

    def __init__(self, capacity_rows: int, row_bytes: int, device, n_ids: int,
                 table: str | None = None, refresh_every: int = 4, refresh_bytes: int | None = 16 << 20,
                 half_life: int = 64, admit_margin: float = 1.0):
        if capacity_rows < 0 or row_bytes <= 0 or n_ids <= 0:
            raise InvalidArgument(
                f"HBMCache needs capacity_rows >= 0, row_bytes > 0, n_ids > 0; got "
                f"{capacity_rows}, {row_bytes}, {n_ids}")
        if (refresh_bytes is not None and refresh_bytes < 0) or half_life < 1:
            raise InvalidArgument(f"HBMCache needs refresh_bytes >= 0 (or None) and half_life >= 1; got "
                                  f"{refresh_bytes}, {half_life}")
        self.capacity, self.row_bytes, self.n_ids = int(capacity_rows), int(row_bytes), int(n_ids)
        self.table, self.refresh_every = table, max(1, int(refresh_every))
        self.refresh_bytes, self.half_life = refresh_bytes, int(half_life)
        if not admit_margin >= 0:
            raise InvalidArgument(f"HBMCache needs admit_margin >= 0 (reads), got {admit_margin}")
        self.admit_margin = float(admit_margin)
        self._rows = torch.zeros(self.capacity, self.row_bytes, dtype=torch.uint8, device=device)
        self.slot_of = np.full(self.n_ids, -1, dtype=np.int32)
        self.id_at = np.full(self.capacity, -1, dtype=np.int64)
        self.score = np.zeros(self.capacity, dtype=np.float64)
        self.hits = self.misses = self.refreshes = self.admitted = 0
        self.refresh_rows = 0  # rows copied host -> device by refreshes (seed excluded)
        self.pins = 0  # prepared steps whose cache slots must not move
        # read counts of non-residents: one sketch counter per cache slot x 8, as TinyLFU sizes it
        self.sketch = FrequencySketch(max(64, 8 * self.capacity), depth=4, counter_max=_SCORE_MAX)
        self._cand: list[np.ndarray] = []  # non-resident ids read since the last refresh
        self._steps = 0  # observed since the last refresh
        self._aged = 0  # observed since the last halving
        self._copy = None  # (event, host rows) of an in-flight CUDA refresh copy
        self._stream = torch.cuda.Stream(self._rows.device) if self._rows.is_cuda else None

    @property
    def rows(self) -> torch.Tensor:
        """uint8 [capacity_rows, row_bytes] cached rows; the current stream waits for a refresh copy."""
        if self._copy is not None:
            torch.cuda.current_stream(self._rows.device).wait_event(self._copy[0])
            if self._copy[0].query():
                self._copy = None
        return self._rows

    @property
    def device(self) -> torch.device:
        return self._rows.device

    @property
    def resident(self) -> int:
        return int((self.id_at >= 0).sum())

    # ---- finding slots -----------------------------------------------------------
    def _check(self, ids) -> np.ndarray:
        return check_ids(ids.cpu() if isinstance(ids, torch.Tensor) else ids, self.n_ids, self.table or "?")

    def find(self, ids, count: bool = True) -> np.ndarray:
        """int64 cache slot of each id (flattened), -1 where absent; counts hits/misses."""
        ids = self._check(ids)
        slots = self.slot_of[ids].astype(np.int64)
        if count:
            hit = int((slots >= 0).sum())
            self.hits += hit
            self.misses += ids.size - hit
        return slots

    # ---- admission -----------------------------------------------------------
    def seed(self, ids, rows, prior: float | None = None) -> int:
        """Replace the contents with the first `capacity_rows` of `ids` (hottest first).

        rows: uint8 [len(ids), row_bytes] encoded rows of those ids (numpy or tensor).
        prior: the score the first id starts with, in reads (falling linearly to
            0 along the list); default half_life / 2, as if read in half the
            steps of a half-life. Live reads must outweigh it to evict the row.
        Duplicate ids keep their first occurrence. Returns rows admitted."""
        self._require_unpinned("seed")
        ids = self._check(ids)
        rows = rows if isinstance(rows, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(rows))
        if rows.dtype != torch.uint8 or tuple(rows.shape) != (ids.size, self.row_bytes):
            raise InvalidArgument(
                f"HBMCache.seed: rows must be uint8 [{ids.size}, {self.row_bytes}], got "
                f"{rows.dtype} {tuple(rows.shape)}")
        _, first = np.unique(ids, return_index=True)
        keep = np.sort(first)[: self.capacity]
        n = keep.size
        if self._copy is not None:  # a refresh copy still writing slots
            self._copy[0].synchronize()
            self._copy = None
        self.slot_of[self.id_at[self.id_at >= 0]] = -1
        self.id_at[:] = -1
        self.score[:] = 0
        self.id_at[:n] = ids[keep]
        self.slot_of[ids[keep]] = np.arange(n, dtype=np.int32)
        # a prior on the scale of live scores (reads summed over ~a half-life), so
        # profiled rows stay until live reads outweigh them (a prior of 1 lost the
        # profile's head to one-off reads: -0.03 on held-out real text)
        prior = 0.5 * self.half_life if prior is None else float(prior)
        self.score[:n] = prior * np.arange(n, 0, -1, dtype=np.float64) / max(n, 1)
        self._cand, self._steps = [], 0
        if n:
            self._rows[:n] = rows[torch.from_numpy(keep)].to(self.device)
        self.admitted += n
        return n

    @classmethod
    def from_source(cls, source, table: str, capacity_rows: int, device, hot_ids=None,
                    **kw) -> "HBMCache":
        """A cache for `table` of `source`, seeded with `hot_ids` (hottest first) read from it."""
        info = source.table_info(table)
        cache = cls(capacity_rows, info["row_bytes"], device, info["rows"], table=table, **kw)
        if hot_ids is not None and len(hot_ids):
            hot = cache._check(hot_ids)
            _, first = np.unique(hot, return_index=True)
            hot = hot[np.sort(first)][:capacity_rows]
            cache.seed(hot, _read(source, table, hot))
        return cache

    def observe(self, ids, counts=None) -> None:
        """Record one step's reads: its unique ids (counts, if given, only mark which were read)."""
        ids = self._check(ids)
        if counts is not None:
            ids = ids[np.asarray(counts).reshape(-1) > 0]
        slots = self.slot_of[ids]
        res = slots >= 0
        self.score[slots[res]] = np.minimum(self.score[slots[res]] + 1, _SCORE_MAX)
        self.sketch.add(ids[~res])
        self._cand.append(ids[~res])
        self._steps += 1
        self._aged += 1
        if self._aged >= self.half_life:  # residents and sketch age together
            self.score *= 0.5
            self.sketch.halve()
            self._aged = 0
        if self._steps > 4 * self.refresh_every:  # nobody refreshes: keep memory bounded
            self._cand = self._cand[-self.refresh_every:]

    def maybe_refresh(self, source, table: str | None = None, force: bool = False) -> int:
        """Swap in the most-read non-residents that beat the coldest residents; returns rows admitted.

        Call between steps only: skipped (returns 0) while a prepared step still
        refers to cache slots (`pins` > 0), and until `refresh_every` steps were
        observed unless `force`. Copies at most `refresh_bytes` per observed step."""
        if self.pins or not self._cand or self.capacity == 0 or self.refresh_bytes == 0:
            return 0
        if self._steps < self.refresh_every and not force:
            return 0
        table = table or self.table
        if table is None:
            raise InvalidArgument("HBMCache.maybe_refresh needs the table name (pass table=)")
        limit = self.capacity if self.refresh_bytes is None else self.refresh_bytes * self._steps // self.row_bytes
        cand = np.unique(np.concatenate(self._cand))
        self._cand, self._steps = [], 0
        cand = cand[self.slot_of[cand] < 0]  # some were admitted since they were read
        est = self.sketch.estimate(cand).astype(np.float64)
        n = min(cand.size, self.capacity, int(limit))
        if n == 0:
            return 0
        # hottest candidates against coldest slots (empty slots first); both sorted,
        # so "candidate beats victim" holds on a prefix
        top = np.argpartition(-est, n - 1)[:n] if n < cand.size else np.arange(cand.size)
        top = top[np.argsort(-est[top], kind="stable")]
        victim_key = np.where(self.id_at >= 0, self.score, -np.inf)
        victims = np.argpartition(victim_key, n - 1)[:n] if n < self.capacity else np.arange(self.capacity)
        victims = victims[np.argsort(victim_key[victims], kind="stable")]
        k = int((est[top] > victim_key[victims] + self.admit_margin).sum())
        if k == 0:
            return 0
        new_ids, slots_new = cand[top[:k]], victims[:k]
        rows = _read(source, table, new_ids)
        old = self.id_at[slots_new]
        self.slot_of[old[old >= 0]] = -1
        self.id_at[slots_new] = new_ids
        self.slot_of[new_ids] = slots_new.astype(np.int32)
        self.score[slots_new] = est[top[:k]]
        self._install(slots_new, rows)
        self.refreshes += 1
        self.admitted += k
        self.refresh_rows += k
        return k

    def _install(self, slots: np.ndarray, rows: torch.Tensor) -> None:
        """Write rows into slots; on CUDA asynchronously, after the work already queued."""
        if self._stream is None:
            self._rows[torch.from_numpy(slots)] = rows.to(self._rows.device)
            return
        if self._copy is not None:  # one copy in flight at a time
            self._copy[0].synchronize()
        host = rows.pin_memory()
        self._stream.wait_stream(torch.cuda.current_stream(self._rows.device))
        with torch.cuda.stream(self._stream):
            idx = torch.from_numpy(slots).pin_memory().to(self._rows.device, non_blocking=True)
            self._rows.index_copy_(0, idx, host.to(self._rows.device, non_blocking=True))
            ev = torch.cuda.Event()
            ev.record(self._stream)
        self._copy = (ev, host, idx)  # host buffers live until the copy ran

    def _require_unpinned(self, what: str) -> None:
        if self.pins:
            raise InvalidArgument(
                f"HBMCache.{what} while {self.pins} prepared step(s) hold cache slots; "
                "run (or reset) those steps first")

    def stats(self) -> dict:
        total = self.hits + self.misses
        return {"hits": self.hits, "misses": self.misses, "hit_ratio": self.hits / total if total else 0.0,
                "resident": self.resident, "capacity": self.capacity,
                "refreshes": self.refreshes, "admitted": self.admitted,
                "refresh_bytes": self.refresh_rows * self.row_bytes}


def _read(source, table: str, ids: np.ndarray) -> torch.Tensor:
    """Encoded rows of `ids` from a RowSource, uint8 [len(ids), row_bytes]."""
    handle = source.plan(table, ids)
    try:
        slots = torch.from_numpy(np.asarray(handle.slots(), dtype=np.int64))
        arena = handle.arena
        return arena[slots.to(arena.device)].clone()
    finally:
        handle.release()
