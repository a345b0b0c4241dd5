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

Admission is by frequency: `seed()` fills the cache from a hot-set list (the
sidecar's sketch or a `tierstore profile` output, hottest first); with
`observe()` (the layer calls it every step) and `maybe_refresh(source)`
between steps, ids seen more often than the coldest residents replace them.
Resident scores are halved at every refresh, so the cache follows drifting text.

Example::

    cache = HBMCache.from_source(source, "l1", capacity_rows=1 << 20,
                                 device="cuda", hot_ids=profile_ids)
    layer = EngramLayer(spec, 1, source=source, hbm_cache=cache)
    ...                       # after each step:
    cache.maybe_refresh(source)
"""
from __future__ import annotations

from collections import deque

import numpy as np
import torch

from tierstore.errors import IdOutOfRange, InvalidArgument


class HBMCache:
    """Device cache of up to `capacity_rows` rows of one table.

    capacity_rows: rows held on `device` (uint8 [capacity_rows, row_bytes]).
    row_bytes: encoded row width of the table.
    device: torch device of the cached rows ("cuda", or "cpu" for tests).
    n_ids: rows in the table (size of the id -> slot map).
    table: table name, used by `maybe_refresh(source)` to fetch admitted rows.
    refresh_every: `maybe_refresh` acts at most once per this many observed steps,
        and weighs the reads of the last this many steps.
    """

    def __init__(self, capacity_rows: int, row_bytes: int, device, n_ids: int,
                 table: str | None = None, refresh_every: int = 16):
        if capacity_rows < 0 or row_bytes <= 0 or n_ids <= 0:
            raise InvalidArgument(
                f"HBMCache needs capacity_rows >= 0, row_bytes > 0, n_ids > 0; got "
                f"{capacity_rows}, {row_bytes}, {n_ids}")
        self.capacity, self.row_bytes, self.n_ids = int(capacity_rows), int(row_bytes), int(n_ids)
        self.table, self.refresh_every = table, max(1, int(refresh_every))
        self.rows = torch.zeros(self.capacity, self.row_bytes, dtype=torch.uint8, device=device)
        self.slot_of = np.full(self.n_ids, -1, dtype=np.int32)
        self.id_at = np.full(self.capacity, -1, dtype=np.int64)
        self.score = np.zeros(self.capacity, dtype=np.float64)
        self.hits = self.misses = self.refreshes = self.admitted = 0
        self.pins = 0  # prepared steps whose cache slots must not move
        # the last refresh_every steps' reads; bounded when nobody calls maybe_refresh
        self._window: deque[tuple[np.ndarray, np.ndarray]] = deque(maxlen=self.refresh_every)
        self._steps = 0

    @property
    def device(self) -> torch.device:
        return self.rows.device

    @property
    def resident(self) -> int:
        return int((self.id_at >= 0).sum())

    # ---- lookups -----------------------------------------------------------
    def _check(self, ids) -> np.ndarray:
        ids = np.asarray(ids.cpu() if isinstance(ids, torch.Tensor) else ids).reshape(-1)
        if ids.dtype.kind not in "iu":
            raise InvalidArgument(f"HBMCache ids must be integers, got dtype {ids.dtype}")
        ids = ids.astype(np.int64, copy=False)
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_ids):
            bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
            raise IdOutOfRange(f"table {self.table or '?'!r} has {self.n_ids} rows; id {bad} is out of range")
        return ids

    def lookup(self, ids, count: bool = True) -> np.ndarray:
        """int64 cache slot of each id (flattened), -1 where absent; counts hits/misses."""
        ids = self._check(ids)
        slots = self.slot_of[ids].astype(np.int64)
        if count:
            hit = int((slots >= 0).sum())
            self.hits += hit
            self.misses += ids.size - hit
        return slots

    # ---- admission -----------------------------------------------------------
    def seed(self, ids, rows) -> int:
        """Replace the contents with the first `capacity_rows` of `ids` (hottest first).

        rows: uint8 [len(ids), row_bytes] encoded rows of those ids (numpy or tensor).
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
        self.slot_of[self.id_at[self.id_at >= 0]] = -1
        self.id_at[:] = -1
        self.score[:] = 0
        self.id_at[:n] = ids[keep]
        self.slot_of[ids[keep]] = np.arange(n, dtype=np.int32)
        # hotter ids start with higher scores so refresh evicts the tail of the list first
        self.score[:n] = np.arange(n, 0, -1, dtype=np.float64) / max(n, 1)
        if n:
            self.rows[:n] = rows[torch.from_numpy(keep)].to(self.device)
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
        """Record one step's reads (unique ids and their counts) for the next refresh."""
        ids = self._check(ids)
        counts = np.ones(ids.size) if counts is None else np.asarray(counts, dtype=np.float64).reshape(-1)
        self._window.append((ids, counts))
        self._steps += 1

    def maybe_refresh(self, source, table: str | None = None, force: bool = False) -> int:
        """Admit ids observed more often than the coldest residents; returns rows admitted.

        Call between steps only: skipped (returns 0) while a prepared step still
        refers to cache slots (`pins` > 0), and until `refresh_every` steps were
        observed unless `force`."""
        if self.pins or not self._window or self.capacity == 0:
            return 0
        if self._steps < self.refresh_every and not force:
            return 0
        table = table or self.table
        if table is None:
            raise InvalidArgument("HBMCache.maybe_refresh needs the table name (pass table=)")
        ids = np.concatenate([w[0] for w in self._window])
        cnt = np.concatenate([w[1] for w in self._window])
        self._window.clear()
        self._steps = 0
        uniq, inv = np.unique(ids, return_inverse=True)
        freq = np.bincount(inv, weights=cnt)
        self.score *= 0.5
        slots = self.slot_of[uniq]
        res = slots >= 0
        self.score[slots[res]] += freq[res]
        cand, cfreq = uniq[~res], freq[~res]
        # hottest candidates against coldest slots (empty slots first); both sorted,
        # so "candidate beats victim" holds on a prefix
        cand_order = np.argsort(-cfreq, kind="stable")
        victim_key = np.where(self.id_at >= 0, self.score, -np.inf)
        victims = np.argsort(victim_key, kind="stable")[: cand_order.size]
        cand_order = cand_order[: victims.size]
        k = int((cfreq[cand_order] > victim_key[victims]).sum())
        if k == 0:
            return 0
        new_ids, slots_new = cand[cand_order[:k]], victims[:k]
        rows = _read(source, table, new_ids)
        old = self.id_at[slots_new]
        self.slot_of[old[old >= 0]] = -1
        self.id_at[slots_new] = new_ids
        self.slot_of[new_ids] = slots_new.astype(np.int32)
        self.score[slots_new] = cfreq[cand_order[:k]]
        self.rows[torch.from_numpy(slots_new).to(self.device)] = rows.to(self.device)
        self.refreshes += 1
        self.admitted += k
        return k

    def _require_unpinned(self, what: str) -> None:
        if self.pins:
            raise InvalidArgument(
                f"HBMCache.{what} while {self.pins} prepared step(s) hold cache slots; "
                "run (or reset) those steps first")

    def stats(self) -> dict:
        total = self.hits + self.misses
        return {"hits": self.hits, "misses": self.misses, "hit_ratio": self.hits / total if total else 0.0,
                "resident": self.resident, "capacity": self.capacity,
                "refreshes": self.refreshes, "admitted": self.admitted}


def _read(source, table: str, ids: np.ndarray) -> torch.Tensor:
    """Encoded rows of `ids` from a RowSource, uint8 [len(ids), row_bytes]."""
    handle = source.plan(table, ids)
    try:
        slots = torch.from_numpy(np.asarray(handle.slots(), dtype=np.int64))
        arena = handle.arena
        return arena[slots.to(arena.device)].clone()
    finally:
        handle.release()
