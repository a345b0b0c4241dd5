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

One cohesive thing (a little over the house's 300 lines): the three stages share the
slot table's invariants and read best in one file.
"""
from __future__ import annotations

import itertools
import logging

import numpy as np

from tierstore import cpu_token
from tierstore.engine.base import Placement, TableEngine
from tierstore.errors import ChecksumError, DataLoss, InvalidArgument, ResourceExhausted, VersionNotFound
from tierstore.jit import distinct, strictly_increasing
from tierstore.cache.policy import make_policy
from tierstore.cache.miss_flights import MissFlightsFile, flights_path
from tierstore.cache.slot_index import SlotIndexFile
from tierstore.cache.slot_table import Fill, PinsSaturated, SlotTable
from tierstore.cache.step_copies import StepCopies, step_digest
from tierstore.jit import unique_inverse
from tierstore.tiers.nvme.miss_batch import MissBatch
from tierstore.tiers.nvme.verified_copy import warm

__all__ = ["CacheEngine"]

log = logging.getLogger("tierstore.engine.cache")

# a step waiting on another step's fill that failed plans again (bounded)
PLAN_ATTEMPTS = 3
# access notes are learned at most this many ids, and this many steps, per hold of the table
# lock and the CPU token (note_access): a step costs the policy's work even when it has one id
NOTE_CHUNK_IDS = 16384
NOTE_CHUNK_STEPS = 16
# prefetch hints are taken this many ids per hold of the table lock and the CPU token (background work)
HINT_CHUNK_IDS = 16384
# a warm start promotes this many rows per step of its own (warm); a hot set is read this
# many slots per hold of the lock (hot_set): planned steps wait on the lock and the CPU token
WARM_CHUNK_ROWS = 4096
HOT_SET_CHUNK_SLOTS = 1 << 16


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
        self._copies = StepCopies()  # the same step from each TP rank: learned once (lock held)
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

    def prefetch(self, ids: np.ndarray, read: bool = True, steps: int | None = None, conn_id: bytes = b"") -> int:
        """Rows a queued request will read: the scheduler calls this once, at admission.

        All are hinted to the policy for `steps` steps, about the request's wait
        (CachePolicy.expect: kept over others until then, resident now or
        admitted later; default PolicyConfig.expect_steps, at most
        max_expect_steps); with `read`, missing rows are promoted now, without a
        lease. Returns rows read. Never refuses for lack of room: when the
        arena is full of leased rows, the ids that do not fit are skipped; a read
        that fails (a corrupt block, EIO) reads nothing and raises nothing here
        (_promote): the step that reads those rows reports it.
        InvalidArgument for bad ids or steps (check_prefetch), before anything is hinted.
        Reading a deep queue ahead costs hit ratio in a small arena (`bench
        cache`: ours+queue16 against ours+queue16-read): pass read=False for
        requests more than a step or two from running. Hinting the whole queue
        again each step (read=False) protects more (ours+queue16-rehint).

        A hint costs O(its ids), whatever is pending, and at most
        HINT_CHUNK_IDS ids are hinted per hold of the table lock and the CPU
        token, taken as background work (cpu_token.background), so a plan waits
        for at most one chunk of a hint, never behind a long one; its first
        2 x capacity ids are used (more could not all be kept). conn_id: the hinting client's id;
        its pending ids are bounded per client (PolicyConfig.pending_client_share)."""
        ids, steps = self.check_prefetch(ids, steps)
        ids = ids[:2 * self.capacity]
        if ids.size == 0 or not self.enter():
            return 0
        try:
            read_in = 0
            for a in range(0, ids.size, HINT_CHUNK_IDS):
                with cpu_token.background():
                    read_in += self._prefetch_unique(np.unique(ids[a:a + HINT_CHUNK_IDS]), read, steps, conn_id)
            return read_in
        finally:
            self.leave()

    def check_prefetch(self, ids, steps: int | None) -> tuple[np.ndarray, int]:
        """(ids, steps) of a prefetch, validated (steps None: the policy's default); InvalidArgument otherwise."""
        return self.check_ids(ids), self.policy.config.hint_steps(steps)

    @property
    def max_prefetch_steps(self) -> int:
        """The longest hint check_prefetch accepts (PolicyConfig.max_expect_steps)."""
        return self.policy.config.max_expect_steps

    def _prefetch_unique(self, uniq: np.ndarray, read: bool, steps: int, conn_id: bytes) -> int:
        with self._lock:
            slots = self.slots.lookup(uniq)
            miss = uniq[slots < 0]
            # kept for the request: resident rows, and missing ones once read in (here, or by another step)
            self.policy.expect(slots[slots >= 0].astype(np.int64, copy=False), miss, steps, conn_id)
            # read ahead no more than the policy can keep until then (free slots evict nothing:
            # fill them regardless), and leave room for steps
            ahead = max(self.policy.protect_room(), self.slots.n_free)
            room = max(0, min(self.capacity - 2 * self.slots.n_pinned, ahead)) if read else 0
        misses = self._promote(miss[:room])
        self.counters.prefetched += misses
        return misses

    def _promote(self, miss: np.ndarray, carried=None) -> int:
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

    def note_access(self, ids: np.ndarray, ends: np.ndarray, row_ids: np.ndarray | None = None,
                    rows: np.ndarray | None = None, source: bytes = b"", trusted: bool = True) -> int:
        """Steps a client on the host served itself (client/local_reads.py), told after the fact in
        batches: `ids` of consecutive steps, step k being ids[ends[k-1]:ends[k]], each step's
        ids distinct (the client dedupes; a repeat counts twice, as two accesses would). The
        policy learns each step as if it had been planned (hits touched), and the rows that
        missed are promoted without a lease, so the next steps find them resident: every
        miss while the arena has free slots (a free slot is always better than a disk
        read), and past that as planned misses are, unless PolicyConfig.read_admit_freq
        (a doorkeeper, off by default) asks a row seen before. row_ids, rows: rows the client read
        for its misses (int64 [n], uint8 [n, width], any order) in the table's carried form
        (tierstore/tiers/trust.py: rows, or format 2's records): a promoted miss among
        them is placed from those bytes, each verified in the same pass, instead of read
        from disk; one that does not match is read from disk instead and counted
        (note_rows_refused): no row that failed its check is ever placed. What trust does
        not admit from this sender (`trusted`: a peer of the sidecar's uid; in-process
        callers are the sidecar itself) is left out: those misses are read from disk,
        batched, like any miss. Never refused: when the arena is full of leased rows, the
        misses that do not fit are skipped. source: the client (its conn_id): a step
        another client sent already, the same batch read by another TP rank, is not learned
        again (StepCopies); its misses are still promoted. Returns rows promoted.
        InvalidArgument for bad ids, step ends or rows (nothing is learned then):
        check_note, then learn_note.

        Bookkeeping, off the steps' path: learned at most NOTE_CHUNK_IDS ids and
        NOTE_CHUNK_STEPS steps per hold of the lock and the CPU token, each hold taken as
        background work (cpu_token.background), so a plan waits for at most one chunk of
        a note, however many steps it has."""
        return self.learn_note(*self.check_note(ids, ends, row_ids, rows, trusted), source=source)

    def learn_note(self, ids: np.ndarray, ends: np.ndarray, row_ids: np.ndarray | None, rows: np.ndarray | None,
                   source: bytes = b"") -> int:
        """note_access of a note check_note has passed (the learner checks a note as it arrives
        and learns it later): its rows, where given, admitted by trust."""
        if ids.size == 0 or not self.enter():
            return 0  # nothing to learn, or freed meanwhile (a version swap)
        try:
            carried = None
            if row_ids is not None and row_ids.size:
                with cpu_token.background():
                    have, first = np.unique(row_ids, return_index=True)  # sorted, for the lookup in _read_misses
                carried = (have, first.astype(np.int64, copy=False), rows)
            return self._note_access(ids, ends, carried, source)
        finally:
            self.leave()

    def check_note(self, ids, ends, row_ids=None, rows=None, trusted: bool = False) -> tuple:
        """(ids, ends, row_ids, rows) of an access note, validated (note_access); InvalidArgument
        otherwise. row_ids and rows are None when the note carries no rows, or rows that
        trust does not admit from this sender (`trusted`: trust.peer_trusted), whose misses
        are then read from disk."""
        ids = self.check_ids(ids)
        ends = np.asarray(ends, dtype=np.int64).reshape(-1)
        if ends.size == 0 or ends[-1] != ids.size or ends[0] < 0 or np.any(np.diff(ends) < 0):
            raise InvalidArgument(f"table {self.table!r}: access note of {ids.size} ids needs non-decreasing step "
                                  f"ends that finish at {ids.size}, got {ends.size} ends")
        if rows is None or row_ids is None or not np.size(row_ids):
            return ids, ends, None, None
        row_ids = self.check_ids(row_ids)
        rows = np.asarray(rows)
        widths = {self.version.row_bytes, self.version.record_bytes}  # rows, or format 2's records
        if rows.dtype != np.uint8 or rows.ndim != 2 or rows.shape[0] != row_ids.size or rows.shape[1] not in widths:
            raise InvalidArgument(f"table {self.table!r}: an access note carries {row_ids.size} row ids and rows "
                                  f"{rows.dtype} {rows.shape}; rows must be uint8 [{row_ids.size}, "
                                  f"{self.version.row_bytes}] (or records [{row_ids.size}, "
                                  f"{self.version.record_bytes}])")
        if not self.reader.carried.admits(rows, trusted):
            return ids, ends, None, None
        return ids, ends, row_ids, rows

    def _note_access(self, ids: np.ndarray, ends: np.ndarray, carried=None, source: bytes = b"") -> int:
        """note_access after its checks, a few steps at a time: the lock and the CPU token are
        held for at most NOTE_CHUNK_STEPS steps of at most NOTE_CHUNK_IDS ids (or one longer
        step), as background work (planned steps of every worker wait on both)."""
        read, a = 0, 0
        while a < ends.size:
            start = int(ends[a - 1]) if a else 0
            b = int(np.searchsorted(ends, start + NOTE_CHUNK_IDS, side="right"))
            b = max(a + 1, min(a + NOTE_CHUNK_STEPS, b))
            with cpu_token.background():
                read += self._note_steps(ids[start:int(ends[b - 1])], ends[a:b] - start, carried, source)
            a = b
        return read

    def _note_steps(self, ids: np.ndarray, ends: np.ndarray, carried=None, source: bytes = b"") -> int:
        """Steps ids[ends[k-1]:ends[k]], each step's ids distinct (repeats across steps are
        further accesses): learned under the lock (but another client's copies), then the
        admitted misses promoted."""
        st, starts = self.slots, np.concatenate([[0], ends[:-1]]).tolist()
        digests = [step_digest(ids[a:b]) for a, b in zip(starts, ends.tolist())]
        with self._lock:
            learned = np.ones(ids.size, bool)
            for a, b, digest in zip(starts, ends.tolist(), digests):
                if b > a and not self._copies.first(digest, source):
                    learned[a:b] = False
                    self.counters.steps_copied += 1
                elif b > a:
                    self.policy.record(ids[a:b])
                    if self.recorder is not None:
                        self.recorder.record(self.table, ids[a:b], n_ids=self.rows)
            slots = st.lookup(ids)
            hit = slots >= 0
            hit_slots = slots[hit].astype(np.int64, copy=False)
            if hit_slots.size:
                self.policy.touch(slots[hit & learned].astype(np.int64, copy=False))
                if self.verifier is not None:  # rows clients read locally are re-verified too
                    self.verifier.sample(self, ids[hit], hit_slots)
            c = self.counters
            c.local_steps += ends.size
            c.hits += hit_slots.size
            c.misses += ids.size - hit_slots.size
            miss = self._admitted_misses(np.sort(distinct(ids[~hit])))  # sorted, for the cold tier
            room = max(0, self.capacity - 2 * st.n_pinned)  # leave room for planned steps
        # the client has just read these rows: their bytes (carried), or at least their pages
        return self._promote(miss[:room], carried=carried)

    def hot_set(self) -> tuple[np.ndarray, np.ndarray]:
        """The resident rows, hottest first: (ids int64, counts uint8), counts the policy's
        frequency estimates, ties in slot order. What a restart promotes again (warm).

        Read HOT_SET_CHUNK_SLOTS slots per hold of the lock, so planned steps wait at most
        one chunk; the rows resident throughout are all there, a row promoted or evicted
        meanwhile may or may not be (it is a hint)."""
        st = self.slots
        ids, counts = [], []
        for a in range(0, self.capacity, HOT_SET_CHUNK_SLOTS):
            with cpu_token.background(), self._lock:
                b = min(self.capacity, a + HOT_SET_CHUNK_SLOTS)
                got = st.id_of[a:b][st.is_ready(slice(a, b))].astype(np.int64)
                ids.append(got)
                counts.append(np.minimum(self.policy.sketch.estimate(got), 255).astype(np.uint8))
        ids, counts = np.concatenate(ids), np.concatenate(counts)
        order = np.argsort(-counts.astype(np.int16), kind="stable")
        return ids[order], counts[order]

    def warm(self, ids: np.ndarray, counts: np.ndarray | None = None, stop=None) -> int:
        """Promote `ids` (hottest first: a recorded hot_set() or a profile's hot list) into
        free slots, WARM_CHUNK_ROWS at a time, without a lease; returns rows read.

        Only free slots are filled: a row a step brought in since the start is newer
        evidence than the hint and is not evicted for it (free slots are counted as each
        chunk starts; steps that take some meanwhile may cost a few rows); it ends once the
        arena is full, the ids run out, `stop` (a threading.Event) is set, or the engine
        is retired. `counts` (the recorded frequency estimates) seed the policy's sketch
        first, so the rows are kept as they were before the restart (main queue), not
        treated as one-hit wonders. Rows come from the cold tier, verified as any miss
        (a chunk whose read fails is skipped: a step reading those rows reports it).
        Planned steps never wait for the warm-up: each chunk holds the lock and the CPU
        token as background work (cpu_token.background), as a step's own promotion would,
        after the plans waiting for them. InvalidArgument for ids out of range."""
        ids = self.check_ids(ids)
        if counts is not None:
            counts = np.asarray(counts, dtype=np.int64).ravel()
            if counts.shape != ids.shape:
                raise InvalidArgument(f"table {self.table!r}: warm needs one count per id")
        read = a = 0
        while a < ids.size:
            if self.retired or (stop is not None and stop.is_set()):
                break
            with cpu_token.background():
                if not self.enter():
                    break
                try:
                    with self._lock:
                        room = self.slots.n_free
                        if room == 0:
                            break
                        chunk = ids[a:a + min(WARM_CHUNK_ROWS, room)]
                        if counts is not None:  # seeds, not accesses: no step toward halving
                            recorded = self.policy.sketch.recorded
                            self.policy.sketch.add(*_unique_max(chunk, counts[a:a + chunk.size]))
                            self.policy.sketch.recorded = recorded
                        miss = np.unique(chunk[self.slots.lookup(chunk) < 0])
                    got = self._promote(miss)
                finally:
                    self.leave()
            a += chunk.size
            read += got
            self.counters.warmed += got
        return read

    def _admitted_misses(self, miss: np.ndarray) -> np.ndarray:
        """(lock held) The misses of noted steps to promote, order kept: all of them while the
        free slots take them; otherwise the doorkeeper's (PolicyConfig.read_admit_freq: seen
        before, this access included) and, while free slots are left, the others in id
        order. The filter applies only to rows that need a victim: a one-hit wonder never
        displaces a resident row, but never leaves a slot empty either. The free count is
        this moment's: a planned step taking slots before the promotion evicts for a few."""
        free, gate = self.slots.n_free, self.policy.config.read_admit_freq
        if gate <= 1 or miss.size <= free:
            return miss
        passed = self.policy.sketch.estimate(miss) >= gate
        spare = free - int(np.count_nonzero(passed))
        if spare > 0:
            passed |= np.cumsum(~passed) <= spare
        return miss[passed]

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
        with self._lock:
            # hits pinned at once: also keeps this step's hits through its own evictions
            try:
                slots, hit_slots, n_filling = st.lookup_pin(uniq)
            except PinsSaturated:
                self.counters.lease_refusals += 1
                raise
            n_miss = uniq.size - hit_slots.size
            if not admit_only:
                self.counters.plans += 1
                if self._copies.first(digest, source):
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
                with self._lock:
                    self._drop_fill(fill)  # the fill's pin; the step's goes with its lease
                fill.finish(e)
                raise
            with self._lock:
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
        with self._lock:
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
        with self._lock:
            self.slots.unpin(slots)

    # ---- online verification (the verifier thread; never the hot path) ---------
    def _mark_bad(self, block: int) -> bool:
        """A bad cold block is refused from now on (TableEngine._mark_bad); its resident rows'
        gen goes odd too, so a local reader (which does not ask the sidecar) misses them,
        reads the block and gets DATA_LOSS as a Plan does. They stay mapped (a running step
        may hold a lease on them) until evicted, or until a re-check lifts the mark (_lift)."""
        if not super()._mark_bad(block):
            return False
        with self._lock:
            slots = self._block_slots(block)
            self.slots.gen[slots[slots >= 0]] |= np.uint32(1)
        return True

    def _lift(self, block: int, rows: np.ndarray) -> None:
        """A marked block that reads and checks again serves again: its resident rows that the
        mark left gen odd (mapped, no fill in flight holds them) get its verified `rows`
        written over them and gen even again, as a repair in place ends; then the mark goes."""
        with self._lock:
            slots = self._block_slots(block)
            held = np.flatnonzero(slots >= 0)
            s = slots[held]
            filling = [f.slots for f in self._fills.values()]
            left = ((self.slots.gen[s] & 1) == 1) & ~np.isin(s, np.concatenate(filling) if filling else [])
            s, held = s[left], held[left]
            if s.size:
                self.arena.rows[s] = rows[held]
                self.slots.end_write(s)
        super()._lift(block, rows)

    def _block_slots(self, block: int) -> np.ndarray:
        """(lock held) The slot of each row of `block`, -1 where it is not resident."""
        br = self.version.block_rows
        return self.slots.lookup(np.arange(block * br, min((block + 1) * br, self.rows), dtype=np.int64))

    def verify_rows(self, ids: np.ndarray, slots: np.ndarray) -> list[tuple]:
        """Check sampled served rows: their cold block's checksum, and the arena copy
        against the verified disk copy (repaired in place when it differs). A failed read is
        judged block by block (TableEngine._judge): a short read or EIO is no verdict."""
        found, vc, br = [], self.verify_counters, self.version.block_rows
        vc.checked["nvme"] += ids.size
        try:
            disk = self.reader.read_rows(ids)  # one batched, verified read: the common case
        except (ChecksumError, OSError):
            disk, ok = np.empty((ids.size, self.version.row_bytes), np.uint8), np.ones(ids.size, bool)
            blocks = ids // br
            for b in np.unique(blocks).tolist():  # pinpoint every bad block of the sample
                sel = blocks == b
                rows = self._judge(b, found, int(sel.sum()))
                if rows is None:
                    ok &= ~sel
                else:
                    disk[sel] = rows[ids[sel] - b * br]
            ids, slots, disk = ids[ok], slots[ok], disk[ok]
        with self._lock:
            st = self.slots
            still = (st.id_of[slots] == ids) & st.is_ready(slots)  # a slot may hold another row by now
            s, d = slots[still], disk[still]
            bad = np.any(self.arena.rows[s] != d, axis=1)
            vc.checked["dram"] += int(s.size)
            if bad.any():
                st.begin_write(s[bad])  # local readers reject what they copy meanwhile
                self.arena.rows[s[bad]] = d[bad]
                st.end_write(s[bad])
                vc.mismatches["dram"] += int(bad.sum())
                block = int(ids[still][bad][0] // self.version.block_rows)
                found.append(("dram", block, int(s[bad][0]),
                              f"{int(bad.sum())} arena rows differed from the verified disk copy; repaired"))
        return found

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


def _unique_max(ids: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct ids (the sketch takes each once per call), each with its largest count."""
    order = np.lexsort((-counts, ids))
    ids, counts = ids[order], counts[order]
    first = np.ones(ids.size, dtype=bool)
    first[1:] = ids[1:] != ids[:-1]
    return ids[first], counts[first]
