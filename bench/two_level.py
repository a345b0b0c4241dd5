"""Two cache levels that cooperate: an HBM cache per worker over one shared DRAM arena.

W workers read different document streams of one corpus. Each step, every
worker looks its unique rows up in its own HBMCache (adaptive, as the layer
drives it); the misses go to the shared DRAM arena, driven as the engine
drives CachePolicy; DRAM misses are read from NVMe. Two ways to run DRAM:
- blind: the DRAM policy sees only what it is asked, so a row every worker
  now keeps in HBM keeps its DRAM slot until it ages out (never asked again);
- cooperative: when a refresh leaves a row in every worker's HBM, the DRAM
  slot is given back at once (`CachePolicy.forget`), and its space serves
  rows the workers still ask for. A worker that later drops the row reads it
  from NVMe: the trade is measured, not assumed.
Reported per tier: HBM hit ratio (all unique reads), DRAM hit ratio (reads
that missed HBM), NVMe share (reads that missed both), and refresh traffic.
"""
from __future__ import annotations

import numpy as np

from tierstore.bench.hbm import _ZeroSource
from tierstore.bench.traces import Trace
from tierstore.errors import InvalidArgument
from tierstore.cache.policy import make_policy


class _Dram:
    """The shared arena: slot map and CachePolicy, driven as the engine drives them."""

    def __init__(self, capacity: int, n_ids: int):
        self.policy = make_policy(capacity, n_ids)
        self.slot_of = np.full(n_ids, -1, dtype=np.int64)
        self._held_ids = np.full(capacity, -1, dtype=np.int64)
        self.free_arr = np.arange(capacity, dtype=np.int64)[::-1].copy()
        self.n_free = capacity
        self.pins = np.zeros(capacity, dtype=np.int32)
        self.hits = self.reads = 0

    def step(self, ids: np.ndarray) -> None:
        slots = self.slot_of[ids]
        hit = slots >= 0
        self.hits += int(hit.sum())
        self.reads += ids.size
        self.policy.record(ids)
        self.policy.touch(slots[hit])
        miss = ids[~hit]
        take = min(self.n_free, miss.size)
        fresh = self.free_arr[self.n_free - take:self.n_free].copy()
        self.n_free -= take
        k = miss.size - take
        if k:
            self.pins[slots[hit]] += 1  # the step's own rows are leased
            out = self.policy.victims(k, self.pins)
            self.pins[slots[hit]] -= 1
            self.slot_of[self._held_ids[out]] = -1
            fresh = np.concatenate([fresh, out])
        self._held_ids[fresh] = miss
        self.slot_of[miss] = fresh
        self.policy.admitted(fresh, miss)

    def drop(self, ids: np.ndarray) -> None:
        """Give back the DRAM slots of `ids` (every worker holds them in HBM)."""
        slots = self.slot_of[ids]
        slots = slots[slots >= 0]
        if slots.size == 0:
            return
        self.policy.forget(slots)
        self.slot_of[self._held_ids[slots]] = -1
        self._held_ids[slots] = -1
        self.free_arr[self.n_free:self.n_free + slots.size] = slots
        self.n_free += slots.size


def run_two_level(traces: list[Trace], hbm: float = 0.005, dram: float = 0.02, cooperative: bool = False) -> dict:
    """Replay `traces` (one per worker, same table) through HBM per worker + shared DRAM."""
    from tierstore.client.model.hbm_cache import HBMCache

    if not traces or len({t.n_ids for t in traces}) != 1:
        raise InvalidArgument("run_two_level needs one trace per worker, all over the same table")
    n_ids = traces[0].n_ids
    hcap = int(hbm * n_ids) if hbm < 1 else int(hbm)
    dcap = int(dram * n_ids) if dram < 1 else int(dram)
    caches = [HBMCache(hcap, 1, "cpu", n_ids, table="t") for _ in traces]
    d = _Dram(dcap, n_ids)
    src = _ZeroSource(1)
    held_by = np.zeros(n_ids, dtype=np.int16)  # workers holding each row in HBM
    reads = nvme = dropped = 0
    for i in range(min(t.steps for t in traces)):
        for w, (t, c) in enumerate(zip(traces, caches)):
            ids = t.step(i)
            miss = ids[c.find(ids) < 0]
            reads += ids.size
            before = d.reads - d.hits
            if miss.size:
                d.step(miss)
            nvme += (d.reads - d.hits) - before
            c.observe(ids)
            was = c.id_at.copy()
            if c.maybe_refresh(src):
                gone, new = was[was >= 0], c.id_at[c.id_at >= 0]
                np.subtract.at(held_by, np.setdiff1d(gone, new), 1)
                added = np.setdiff1d(new, was)
                np.add.at(held_by, added, 1)
                if cooperative:
                    everywhere = added[held_by[added] == len(traces)]
                    dropped += everywhere.size
                    d.drop(everywhere)
    hbm_hits = sum(c.hits for c in caches)
    return {"workers": len(traces), "hbm_rows_per_worker": hcap, "dram_rows": dcap, "cooperative": cooperative,
            "hbm_hit_ratio": hbm_hits / max(1, reads), "dram_hit_ratio": d.hits / max(1, d.reads),
            "nvme_share": nvme / max(1, reads), "fast_tiers_hit_ratio": 1 - nvme / max(1, reads),
            "dram_slots_given_back": dropped,
            "refresh_rows_per_worker_step": sum(c.refresh_rows for c in caches) / max(1, len(caches) * i + len(caches))}
