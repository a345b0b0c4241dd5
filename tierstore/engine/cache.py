"""Cache mode: the arena holds `capacity` rows. A Plan costs O(step), never
O(arena), and promotes misses in three stages:
1. reserve (under the lock, O(misses)): hits are pinned, victims come from the
   policy's queues (which skip pinned slots as they walk), the misses' slots
   are mapped, marked FILLING and pinned by their fill;
2. fill (outside the lock): the misses are one batch of the read pipeline
   (tiers/nvme/miss_batch.py: claim, submit, finish, verify and place), read and
   verified straight into their slots, so another worker's Plan never waits
   behind this one's disk reads; a step that needs a row another step is filling waits for that
   fill only;
3. ready (under the lock): the slots are marked READY and the fill's pins drop.
Any failure in the fill returns its slots (unmapped, to the free stack) and
ends the step's lease: nothing leaks, no half-written row is ever served.

Promotion without a lease (promote: the same three stages, no step to pin for) serves
the jobs that stand beside the plan: access notes (notes.py, `notes`), prefetch hints
(hints.py, `hints`) and the warm start (hot_set.py, `hot_set`); online verification's
checks and repairs are repair.py's (`repair`).
"""
from __future__ import annotations

import itertools
import logging

import numpy as np

from tierstore import cpu_token
from tierstore.engine.base import Placement, TableEngine
from tierstore.errors import ChecksumError, DataLoss, ResourceExhausted, VersionNotFound
from tierstore.jit import strictly_increasing
from tierstore.cache.policy import make_policy
from tierstore.cache.miss_flights import MissFlightsFile, flights_path
from tierstore.cache.slot_index import SlotIndexFile
from tierstore.cache.slot_table import Fill, PinsSaturated, SlotTable
from tierstore.cache.step_copies import StepCopies, step_digest
from tierstore.engine.hints import Hints
from tierstore.engine.hot_set import HotSet
from tierstore.engine.notes import Notes
from tierstore.engine.repair import CacheRepair
from tierstore.jit import unique_inverse
from tierstore.tiers.nvme.miss_batch import MissBatch
from tierstore.tiers.nvme.verified_copy import warm

__all__ = ["CacheEngine"]

log = logging.getLogger("tierstore.engine.cache")

# a step waiting on another step's fill that failed plans again (bounded)
PLAN_ATTEMPTS = 3


class _FillFailed(Exception):
    """Another step's fill of a row this step needs failed (`error`, its fill's): plan again."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class CacheEngine(TableEngine):
    full = False

    def __init__(self, version, reader, arena, *, leases, policy_config=None,
                 profile=None, recorder=None, index_path=None, instance: str = ""):
        """index_path: where to keep the slot index in shared memory (slot_index.py), so local
        clients read resident rows without a round trip; None keeps it private. A constructor
        that raises (a signal included) leaves no index file: whatever fails after the file
        is made removes it."""
        super().__init__(version, reader, arena, leases=leases, recorder=recorder)
        index = SlotIndexFile(index_path, self.capacity, self.rows, instance) if index_path is not None else None
        try:
            self.slots = SlotTable(self.capacity, self.rows, index)
        except BaseException:
            if index is not None:
                index.close()
            raise
        try:
            # one id map for engine and policy: the policy reads the slot table's
            self.policy = make_policy(self.capacity, self.rows, policy_config, slot_id=self.slots.id_of)
            if profile is not None:
                self.policy.load_profile(*profile)
            warm()  # compile the miss path's kernels now (or load them), not on the first Plan
        except BaseException:
            self.slots.close()
            raise
        # under O_DIRECT the clients' own misses share nothing (no page cache between them): the
        # flights file lets a row several clients miss at once be read once (miss_flights.py), each
        # row in the form a note carries (tierstore/tiers/trust.py)
        self.flights = None
        if index_path is not None and reader.carried.form and reader.direct is not None:
            try:
                self.flights = MissFlightsFile(flights_path(index_path), self.rows, reader.carried.width, instance)
            except BaseException:
                self.slots.close()
                raise
        self._fills: dict[int, Fill] = {}
        self.copies = StepCopies()  # the same step from each TP rank: learned once (lock held)
        self.notes = Notes(self)  # steps clients on the host served themselves (notes.py)
        self.hints = Hints(self, self.policy.config)  # rows queued requests will read (hints.py)
        self.repair = CacheRepair(self)  # online verification's checks and repairs (repair.py)
        self.hot_set = HotSet(self)  # the resident rows recorded, and promoted again at a start (hot_set.py)
        self._refused_logged = False  # a client's rows that failed their row sums: logged once
        self._fill_ids = itertools.count(1)

    def slot_index(self):
        return self.slots.index

    # ---- requests -----------------------------------------------------------
    def plan(self, ids: np.ndarray, ttl_s: float, conn_id: bytes = b"", request_id: int = 0) -> Placement:
        """Make `ids` resident and lease their slots to one step, for the client `conn_id` (its
        connection's id: only it may release the lease; its fair share bounds the lease)."""
        with cpu_token.hold():
            return self._plan(ids, ttl_s, conn_id, request_id)

    def _plan(self, ids: np.ndarray, ttl_s: float, conn_id: bytes, request_id: int) -> Placement:
        ids = self._edge(ids)
        if ids.size == 0:
            return self._validated(ids)
        if strictly_increasing(ids):
            uniq, inverse = ids, None  # already sorted and unique (EngramLayer dedupes): skip the sort
        else:
            uniq, inverse = unique_inverse(ids)
        if not self.enter():
            raise VersionNotFound(f"table {self.table!r} version {self.version.number} is no longer served; "
                                  "plan the step again")
        try:
            return self._plan_unique(uniq, inverse, ttl_s, conn_id, request_id)
        finally:
            self.leave()

    def _plan_unique(self, uniq, inverse, ttl_s: float, conn_id: bytes, request_id: int) -> Placement:
        try:  # a client over its share is refused before its step reads or evicts a row
            self.leases.admit(self, conn_id, uniq.size, self.slots.n_pinned, request_id)
        except ResourceExhausted:
            self.counters.lease_refusals += 1
            raise
        slots, misses, lease = self._resident(uniq, "plan the step again", (ttl_s, conn_id, request_id))
        if self.verifier is not None:
            self.verifier.sample(self, uniq, slots)
        return Placement(slots if inverse is None else slots[inverse], lease.lease_id, uniq.size,
                          uniq.size - misses, misses, ttl_s)

    def _resident(self, uniq: np.ndarray, again: str, lease: tuple | None = None):
        """Stages 1-3 with the one retry of plan and lookup: sorted, unique `uniq` resident and
        pinned for the caller, this step's misses read and other steps' fills of its rows
        waited for. Returns (slots int64 [U], misses, the Lease or None).

        lease: (ttl_s, conn_id, request_id) leases the slots to one step, taken after the
        reservation and before any read (a refusal gives the reservation back, _abandon);
        None leaves them pinned for the caller to unpin. A fill of another step that fails
        sends the step round again (its pins dropped first), at most PLAN_ATTEMPTS times;
        then DataLoss when the last of those fills failed on the cold tier's bytes (a corrupt
        or cut-short block: planning again would not help), else ResourceExhausted, both
        saying `again`."""
        failed = None
        for _ in range(PLAN_ATTEMPTS):
            slots, fill, waits, misses = self._reserve(uniq, lease=True, source=lease[1] if lease else b"")
            held = None
            if lease is not None:
                try:
                    held = self.leases.add(self, slots, *lease)
                except BaseException as e:  # a refusal, or anything else: the reservation is given back
                    if isinstance(e, ResourceExhausted):
                        self.counters.lease_refusals += 1
                    self._abandon(slots, fill)
                    raise
            try:
                self._complete(fill, waits)
                return slots, misses, held
            except BaseException as e:
                if held is not None:
                    self.leases.release([held.lease_id], held.conn_id)
                else:
                    self.unpin(slots)
                if not isinstance(e, _FillFailed):
                    raise
                failed = e.error
        if isinstance(failed, DataLoss):
            raise DataLoss(f"table {self.table!r}: rows this step needs kept failing to load ({failed}); "
                           f"{again}") from failed
        raise ResourceExhausted(f"table {self.table!r}: rows this step needs kept failing to load; {again}")

    def promote(self, miss: np.ndarray, carried=None) -> int:
        """Read sorted, unique `miss` into the arena without a lease; rows read, 0 when
        the arena has no room (leased) or the read failed: a corrupt or cut-short block
        (ChecksumError) or an I/O error (OSError, EIO) is no error of a prefetch, a note or a
        warm start (their slots are given back, _complete); a step reading those rows
        reports it. carried: rows a client already read (_complete)."""
        if miss.size == 0:
            return 0
        try:
            slots, fill, waits, misses = self._reserve(miss, lease=False, admit_only=True)
        except ResourceExhausted:
            return 0
        try:
            self._complete(fill, (), carried=carried)
        except (_FillFailed, ChecksumError, OSError):
            return 0
        return misses

    def close(self) -> None:
        """Remove the shared slot index and miss flights (the arena is the sidecar's to close)."""
        self.slots.close()
        if self.flights is not None:
            self.flights.close()

    def _reserve(self, uniq: np.ndarray, lease: bool, admit_only: bool = False, source: bytes = b""):
        """Stage 1 (lock held inside): pin hits, reserve and map slots for misses; the step
        learned by the policy unless admit_only, or it is a copy another client (`source`: the
        client's conn_id) planned already (StepCopies).

        Returns (slots int64 [U], Fill of the misses or None, fills of other steps to wait for, n_miss).
        Every returned slot is pinned once for the caller (unless admit_only)."""
        st, digest = self.slots, None if admit_only else step_digest(uniq)
        with self.lock:
            # hits pinned at once: also keeps this step's hits through its own evictions
            try:
                slots, hit_slots, n_filling = st.find_pin(uniq)
            except PinsSaturated:
                self.counters.lease_refusals += 1
                raise
            n_miss = uniq.size - hit_slots.size
            if not admit_only:
                self.counters.plans += 1
                if self.copies.first(digest, source):
                    self.policy.record(uniq)
                    if hit_slots.size:
                        self.policy.touch(hit_slots)
                else:
                    self.counters.steps_copied += 1
                self.counters.hits += hit_slots.size
                self.counters.misses += n_miss
            if n_miss > self.capacity:
                st.unpin(hit_slots)
                self.counters.lease_refusals += 1
                raise ResourceExhausted(
                    f"table {self.table!r}: one step needs {n_miss} new rows but the arena holds {self.capacity}; "
                    f"raise --dram-budget or plan smaller steps")
            new, done = None, []  # the misses' slots once claimed; what was done to them so far
            try:
                waits = ()
                if n_filling:
                    filling = hit_slots[st.is_filling(hit_slots)]
                    waits = self._fills_of(filling)
                fill = None
                if n_miss:
                    new = self._claim(n_miss)
                    hit = slots >= 0
                    miss_ids = uniq[~hit]
                    fill = Fill(next(self._fill_ids) % (2**31 - 1) + 1, miss_ids, new)
                    st.assign(new, miss_ids)
                    done.append("assigned")
                    st.pin(new, times=2)  # one for the step, one for the fill
                    done.append("pinned")
                    self.policy.admitted(new, miss_ids)
                    self._fills[fill.fill_id] = fill
                    slots[~hit] = new
            except BaseException:
                self._unreserve(hit_slots, new, done)
                raise
            if admit_only:
                st.unpin(slots)  # a prefetch holds only its fill's pins
        return slots, fill, waits, n_miss

    def _unreserve(self, hit_slots: np.ndarray, new: np.ndarray | None, done: list) -> None:
        """(lock held) Undo a reservation that failed part-way: the hits' pins given back, and the
        misses' slots, if claimed, unmapped where assigned, their pins dropped where taken,
        freed and forgotten by the policy, so no pin and no slot is lost (SlotTable.check)."""
        st = self.slots
        st.unpin(hit_slots)
        if new is None:
            return
        if "assigned" in done:
            st.unmap(new)
        if "pinned" in done:
            st.unpin(new)
            st.unpin(new)
            self.policy.forget(new)
        st.put_free(new)

    def filling_slots(self) -> np.ndarray:
        """(lock held) The slots of every fill in flight."""
        slots = [f.slots for f in self._fills.values()]
        return np.concatenate(slots) if slots else np.zeros(0, np.int64)

    def _fills_of(self, filling: np.ndarray) -> list[Fill]:
        """(lock held) The fills in flight that hold FILLING `filling` (a waiter of each): a search
        of the few fills in flight, so no slot carries its fill's id."""
        return [f.waiter() for f in self._fills.values() if np.isin(filling, f.slots, assume_unique=True).any()]

    def _complete(self, fill: Fill | None, waits, carried=None) -> None:
        """Stages 2 and 3: read this step's misses into place, then wait for other steps'
        fills of rows it shares. Raises the fill's error, or _FillFailed (plan again).
        carried: (sorted row ids, their index in rows, rows) a client already read (_read_misses)."""
        if fill is not None:
            try:
                self._read_misses(fill.ids, fill.slots, carried)
            except BaseException as e:
                with self.lock:
                    self._drop_fill(fill)  # the fill's pin; the step's goes with its lease
                fill.finish(e)
                raise
            with self.lock:
                self.slots.ready(fill.slots)
                self.slots.unpin(fill.slots)
                del self._fills[fill.fill_id]
                self.counters.promotions += fill.ids.size
            fill.finish()
        for other in waits:
            self.counters.fill_waits += 1
            with cpu_token.waiting():
                other.wait()
            if other.error is not None:
                raise _FillFailed(other.error)

    def _read_misses(self, ids: np.ndarray, slots: np.ndarray, carried=None) -> None:
        """Stage 2: rows `ids` into `slots` (FILLING: no reader uses them yet), verified: one
        batch of misses through the read pipeline (tiers/nvme/miss_batch.py), whose claim
        places the ones in `carried` from those bytes, each checked in the same pass
        (ColdTier.place_carried, in the form trust admitted); if any does not match, all of
        them are read from disk like the rest (counted, logged once)."""
        batch = MissBatch(self.reader, ids, self.arena.rows, slots).claim(carried=carried)
        self.counters.note_rows_placed += batch.taken
        if batch.refused:
            self.counters.note_rows_refused += batch.refused
            if not self._refused_logged:
                self._refused_logged = True
                log.warning("table %s: rows a client on the host sent with its access note do not match "
                            "their row sums (row %d first); read from disk instead", self.table, batch.refused_first)
        batch.submit().finish()

    def _abandon(self, slots: np.ndarray, fill: Fill | None) -> None:
        """Undo a reservation whose lease was refused (its fill never started)."""
        with self.lock:
            self.slots.unpin(slots)
            if fill is not None:
                self._drop_fill(fill)
        if fill is not None:
            fill.finish(ResourceExhausted("lease refused"))

    def _drop_fill(self, fill: Fill) -> None:
        """(lock held) The one undo of a fill that will not complete: its slots unmapped, the
        fill's pin dropped, the slots freed and forgotten by the policy, the fill gone; the
        caller then finishes it with the error its waiters see."""
        self.slots.unmap(fill.slots)
        self.slots.unpin(fill.slots)
        self.slots.put_free(fill.slots)
        self.policy.forget(fill.slots)
        del self._fills[fill.fill_id]

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Rows [n, row_bytes] copied out of the arena (the inline gRPC path).

        The step's slots are pinned while they fill and are copied, then unpinned:
        no lease (nothing a caller could leave behind, no client to invent), and the
        pins last only this call, which the inline limit (proto.MAX_INLINE_BYTES)
        bounds. Counted as a plan for hits, misses and the policy."""
        with cpu_token.hold():
            ids = self._edge(ids)
            self.counters.lookups += 1
            if ids.size == 0:
                return np.empty((0, self.version.row_bytes), dtype=np.uint8)
            uniq, inverse = (ids, None) if strictly_increasing(ids) else unique_inverse(ids)
            if not self.enter():
                raise VersionNotFound(f"table {self.table!r} version {self.version.number} is no longer served; "
                                      "look the rows up again")
            try:
                slots, _, _ = self._resident(uniq, "look the rows up again")
                try:
                    return self.arena.rows[slots if inverse is None else slots[inverse]]
                finally:
                    self.unpin(slots)
            finally:
                self.leave()

    def unpin(self, slots: np.ndarray) -> None:
        with self.lock:
            self.slots.unpin(slots)

    # ---- internals (called with the lock held) --------------------------------
    def _claim(self, k: int) -> np.ndarray:
        """k empty slots: free ones first, then victims chosen by the policy."""
        st = self.slots
        got = st.take_free(k)
        need = k - got.size
        if need == 0:
            return got
        try:
            victims = np.asarray(self.policy.victims(need, st.pins), dtype=np.int64)
        except BaseException as e:
            st.put_free(got)  # the free slots taken go back whatever failed
            if not isinstance(e, ResourceExhausted):
                raise
            self.counters.lease_refusals += 1
            raise ResourceExhausted(
                f"table {self.table!r}: the arena's {self.capacity} slots are leased by running steps; "
                f"{need} more rows do not fit (release finished steps, or raise --dram-budget)") from None
        st.unmap(victims)
        self.counters.evictions += need
        return np.concatenate([got, victims])

    def _occupancy(self) -> tuple[int, int]:
        return self.slots.resident, self.slots.n_pinned

    def metadata_bytes(self) -> int:
        flights = self.flights.nbytes if self.flights is not None else 0
        return super().metadata_bytes() + self.slots.held_bytes + self.policy.held_bytes() + flights

