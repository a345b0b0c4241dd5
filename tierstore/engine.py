"""The engine: one TableEngine per served table, composing the DRAM arena
(tiers/dram.py) over the cold tier (tiers/nvme.py).

Full mode: the whole table sits in the arena in id order, slot == id; Plan
only validates (nothing is ever evicted, so nothing needs a lease).
Cache mode: the arena holds `capacity` rows; a dense int32 id -> slot map
finds residents, misses are promoted from the cold tier in one batched read,
victims are chosen by the policy among unpinned slots only, and the step's
slots are pinned until its lease ends.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

import xxhash

from tierstore.errors import ChecksumError, DataLoss, ResourceExhausted
from tierstore.leases import LeaseTable
from tierstore.tiers.base import check_ids
from tierstore.tiers.dram import Arena
from tierstore.verifier import VerifyCounters


@dataclass(slots=True)
class PlanResult:
    slots: np.ndarray     # int64, one per requested id
    lease_id: int         # 0 when no lease was needed
    unique: int
    hits: int
    misses: int


@dataclass(slots=True)
class Counters:
    plans: int = 0
    hits: int = 0
    misses: int = 0
    promotions: int = 0
    evictions: int = 0
    lease_refusals: int = 0
    lookups: int = 0


class TableEngine:
    def __init__(self, version, reader, arena: Arena, *, leases: LeaseTable, full: bool, policy=None):
        self.version = version            # catalog.TableVersion
        self.table = version.table
        self.rows = version.rows
        self.reader = reader              # tiers.nvme.SegmentReader (cold tier, verifies blocks)
        self.arena = arena
        self.full = full
        self.leases = leases
        self.counters = Counters()
        self._lock = threading.Lock()
        self.capacity = arena.slots
        self.verifier = None                          # tierstore.verifier.Verifier, set by the sidecar
        self.verify_counters = VerifyCounters()
        self.bad_blocks = np.zeros(0, dtype=np.int64)  # cold blocks online verification found corrupt
        if not full:
            self.policy = policy
            self.slot_of = np.full(self.rows, -1, dtype=np.int32)   # 4 B per row against >= 128 B rows
            self.id_of = np.full(self.capacity, -1, dtype=np.int64)
            self.pins = np.zeros(self.capacity, dtype=np.int32)
            self._free = np.arange(self.capacity - 1, -1, -1, dtype=np.int64)  # stack; pop from the end
            self._n_free = self.capacity

    # ---- loading ------------------------------------------------------------
    def load_full(self, chunk_rows: int = 1 << 16, progress=None) -> None:
        """Fill a full-mode arena from the cold tier (every block verified)."""
        for start in range(0, self.rows, chunk_rows):
            n = min(chunk_rows, self.rows - start)
            self.reader.read_range(start, n, out=self.arena.rows[start:start + n])
            if progress is not None:
                progress(n)

    def verify_arena(self, checksums: np.ndarray) -> list[int]:
        """Blocks of a full-mode arena whose bytes no longer match the catalog."""
        br, flat = self.version.block_rows, self.arena.rows
        return [b for b in range(self.version.n_blocks)
                if xxhash.xxh3_64_intdigest(flat[b * br:(b + 1) * br]) != int(checksums[b])]

    # ---- requests -----------------------------------------------------------
    def check_ids(self, ids) -> np.ndarray:
        return check_ids(ids, self.rows, self.table)

    def _refuse_bad_blocks(self, ids: np.ndarray) -> None:
        """DATA_LOSS for ids in a block online verification found corrupt (never a silent wrong row)."""
        hit = np.isin(ids // self.version.block_rows, self.bad_blocks)
        if hit.any():
            block = int(ids[np.argmax(hit)] // self.version.block_rows)
            raise ChecksumError(self.table, self.version.version, block,
                                "found by online verification; re-ingest or import a good copy")

    def plan(self, ids: np.ndarray, ttl_s: float) -> PlanResult:
        ids = self.check_ids(ids)
        if self.bad_blocks.size:
            self._refuse_bad_blocks(ids)
        if self.full or ids.size == 0:  # nothing to pin: no lease to hold or leak
            self.counters.plans += 1
            self.counters.hits += ids.size
            return PlanResult(ids, 0, ids.size, ids.size, 0)
        if ids.size < 2 or bool((ids[1:] > ids[:-1]).all()):
            uniq, inverse = ids, None  # already sorted and unique (EngramLayer dedupes): skip the sort
        else:
            uniq, inverse = np.unique(ids, return_inverse=True)
        with self._lock:
            self.counters.plans += 1
            slots = self._make_resident(uniq)
            self.pins[slots] += 1
            try:
                lease = self.leases.add(self, slots, ttl_s)
            except ResourceExhausted:
                self.pins[slots] -= 1
                self.counters.lease_refusals += 1
                raise
            misses = self._last_misses
        if self.verifier is not None:
            self.verifier.sample(self, uniq, slots)
        return PlanResult(slots if inverse is None else slots[inverse], lease.lease_id, uniq.size,
                          uniq.size - misses, misses)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Rows [n, row_bytes] copied out of the arena (inline path)."""
        ids = self.check_ids(ids)
        self.counters.lookups += 1
        if self.bad_blocks.size:
            self._refuse_bad_blocks(ids)
        if self.full:
            self.counters.hits += ids.size
            return self.arena.rows[ids]
        res = self.plan(ids, ttl_s=60.0)
        try:
            return self.arena.rows[res.slots]
        finally:
            self.leases.release([res.lease_id])

    def unpin(self, slots: np.ndarray) -> None:
        with self._lock:
            self.pins[slots] -= 1

    # ---- online verification (the verifier thread; never the hot path) ---------
    def _mark_bad(self, block: int) -> None:
        with self._lock:
            self.bad_blocks = np.union1d(self.bad_blocks, [block])

    def verify_rows(self, ids: np.ndarray, slots: np.ndarray) -> list[tuple]:
        """Check sampled served rows: their cold block's checksum, and the arena copy
        against the verified disk copy (repaired in place when it differs)."""
        found, vc = [], self.verify_counters
        vc.checked["nvme"] += ids.size
        try:
            disk = self.reader.read_rows(ids)  # one batched, verified read: the common case
        except ChecksumError:
            disk, ok = np.empty((ids.size, self.version.row_bytes), np.uint8), np.ones(ids.size, bool)
            blocks = ids // self.version.block_rows
            for b in np.unique(blocks).tolist():  # pinpoint every bad block of the sample
                sel = blocks == b
                try:
                    disk[sel] = self.reader.read_rows(ids[sel])
                except ChecksumError as e:
                    ok &= ~sel
                    vc.mismatches["nvme"] += int(sel.sum())
                    self._mark_bad(b)
                    found.append(("nvme", b, None, str(e)))
            ids, slots, disk = ids[ok], slots[ok], disk[ok]
        with self._lock:
            still = self.id_of[slots] == ids  # a slot may hold another row by now
            s, d = slots[still], disk[still]
            bad = np.any(self.arena.rows[s] != d, axis=1)
            vc.checked["dram"] += int(s.size)
            if bad.any():
                self.arena.rows[s[bad]] = d[bad]
                vc.mismatches["dram"] += int(bad.sum())
                block = int(ids[still][bad][0] // self.version.block_rows)
                found.append(("dram", block, int(s[bad][0]),
                              f"{int(bad.sum())} arena rows differed from the verified disk copy; repaired"))
        return found

    def scrub_blocks(self, blocks: np.ndarray) -> list[tuple]:
        """Full mode: hash arena blocks against the catalog, read the same cold blocks
        (verified); repair an arena block from disk, mark a corrupt cold block bad."""
        found, vc, br = [], self.verify_counters, self.version.block_rows
        sums = self.reader.checksums
        for b in np.sort(blocks).tolist():
            lo, hi = b * br, min((b + 1) * br, self.rows)
            vc.checked["nvme"] += hi - lo
            try:
                disk = self.reader.read_range(lo, hi - lo)
            except ChecksumError as e:
                vc.mismatches["nvme"] += hi - lo
                self._mark_bad(b)
                found.append(("nvme", b, None, str(e)))
                disk = None
            vc.checked["dram"] += hi - lo
            if xxhash.xxh3_64_intdigest(self.arena.rows[lo:hi]) == int(sums[b]) or disk is None:
                continue
            diff = np.any(self.arena.rows[lo:hi] != disk, axis=1)
            self.arena.rows[lo:hi] = disk
            vc.mismatches["dram"] += int(diff.sum())
            found.append(("dram", b, lo + int(np.argmax(diff)), f"{int(diff.sum())} arena rows repaired from disk"))
        return found

    # ---- cache mode internals (called with the lock held) --------------------
    def _make_resident(self, uniq: np.ndarray) -> np.ndarray:
        slots = self.slot_of[uniq].astype(np.int64)
        miss = slots < 0
        n_miss = int(miss.sum())
        self._last_misses = n_miss
        self.policy.record(uniq)
        if n_miss < uniq.size:
            self.policy.touch(slots[~miss])
        self.counters.hits += uniq.size - n_miss
        self.counters.misses += n_miss
        if n_miss == 0:
            return slots
        if n_miss > self.capacity:
            self.counters.lease_refusals += 1
            raise ResourceExhausted(
                f"table {self.table!r}: one step needs {n_miss} new rows but the arena holds {self.capacity}; "
                f"raise --dram-budget or plan smaller steps")
        miss_ids = uniq[miss]
        # this step's hits must survive its own evictions
        hit_slots = slots[~miss]
        self.pins[hit_slots] += 1
        try:
            new_slots = self._claim(n_miss)
        finally:
            self.pins[hit_slots] -= 1
        try:
            self.arena.rows[new_slots] = self.reader.read_rows(miss_ids)
        except DataLoss:
            self._free_slots(new_slots)
            raise
        self.id_of[new_slots] = miss_ids
        self.slot_of[miss_ids] = new_slots
        self.policy.admitted(new_slots, miss_ids)
        self.counters.promotions += n_miss
        slots[miss] = new_slots
        return slots

    def _claim(self, k: int) -> np.ndarray:
        """k empty slots: free ones first, then victims chosen by the policy."""
        take = min(k, self._n_free)
        got = self._free[self._n_free - take:self._n_free].copy()
        self._n_free -= take
        if take == k:
            return got
        need = k - take
        evictable = (self.pins == 0) & (self.id_of >= 0)
        evictable[got] = False
        if int(evictable.sum()) < need:
            self._free_slots(got)
            self.counters.lease_refusals += 1
            raise ResourceExhausted(
                f"table {self.table!r}: the arena's {self.capacity} slots are leased by running steps; "
                f"{need} more rows do not fit (release finished steps, or raise --dram-budget)")
        victims = np.asarray(self.policy.victims(need, evictable), dtype=np.int64)
        self.slot_of[self.id_of[victims]] = -1
        self.id_of[victims] = -1
        self.counters.evictions += need
        return np.concatenate([got, victims])

    def _free_slots(self, slots: np.ndarray) -> None:
        self.id_of[slots] = -1
        n = slots.size
        self._free[self._n_free:self._n_free + n] = slots
        self._n_free += n

    # ---- introspection ------------------------------------------------------
    def stats(self) -> dict:
        c = self.counters
        if self.full:
            resident, leased = self.rows, 0
        else:
            resident = int((self.id_of >= 0).sum())
            leased = int((self.pins > 0).sum())
        return dict(table=self.table, version=self.version.version, mode="full" if self.full else "cache",
                    capacity=self.capacity, resident=resident, hits=c.hits, misses=c.misses,
                    promotions=c.promotions, evictions=c.evictions, leases_active=self.leases.count_for(self),
                    leased_slots=leased, lease_refusals=c.lease_refusals,
                    bytes_read=int(getattr(self.reader, "bytes_read", 0)), plans=c.plans)
