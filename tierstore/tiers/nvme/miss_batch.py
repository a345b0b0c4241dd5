"""The read pipeline: a batch of misses carried through named stages, the one way a miss is read.

    probe -> claim -> submit -> finish -> verify and place -> publish -> note

A client's local reads (client/local_reads.py: a lookup, or a step's tables in
Client.lookup_many, which the engines' stagers call) and the sidecar's promotions
(engine/cache.py: a plan's misses, a note's, a prefetch's, a warm start's) read their
misses here, the same way:

probe    the caller's: the client copies its hits from the arena through the slot
         index, the sidecar pins its hits in the slot table; what it did not find is the
         batch (`ids`: sorted, distinct) and where each row goes (dest[slots]).
claim    which ids this reader reads itself. Rows an earlier batch of the table holds or
         is reading (the last step's, or one read ahead: Client.lookup's `ahead`) are
         copied from it at finish; rows a peer is reading now are taken from it (the miss flights,
         cache/miss_flights.py: TP ranks missing one batch read each row once between
         them); rows a client already read and carried on its note are placed from those
         bytes, each checked (tierstore/tiers/trust.py says which form); the rest are the
         batch's own.
submit   the reads of its own ids put in flight, in parts (the tier's submit: on the
         calling thread's io_uring, reads the page cache holds done at once, or on the
         read pool where there is no io_uring). Returns while the device reads, so a
         caller submits several batches (a step's tables) and the device's queue does
         not drain between them.
finish   each part's reads waited for, in order (the tier's finish; the CPU token given
         up meanwhile, cpu_token.waiting)...
place    ...its rows verified against their sums and written to dest[slots] as they land
         (verify and place: the tier's place), their records kept where the caller asked...
publish  ...and each placed part offered to the peers waiting on its rows (the flights).
         Then the rows peers claimed are waited for and copied, each checked, or read here.
note     the caller's, on what finish hands back: the client notes the step to the
         sidecar and returns the rows; the sidecar marks the slots ready.

Abort and error handling are here, once: a read that fails (OSError) or a stage that
raises abandons the batch (every read in flight waited for, since it writes its scratch
until it ends; every scratch given back; every claim not yet published given up, so its
waiters read those rows themselves); a row that fails its sum, or a file cut short, is
the ChecksumError (DATA_LOSS) of the first such row in id order, raised by finish once
every part has ended; dest rows of the batch may then hold anything. A batch is
submitted, finished or abandoned in one thread: its reads are on that thread's ring.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

__all__ = ["MissBatch", "Part"]


class Part:
    """Batch positions `at` (sorted) whose reads the tier started together and ends together:
    its reads (`spans`: the records', then format 1's row sums'), their ring batches
    (`tickets`: (spans, reads, ticket)) or their pool task (`task`). A plain record: the
    tier's submit makes it, its finish waits for it, its place uses and gives it back."""

    __slots__ = ("at", "spans", "tickets", "task")

    def __init__(self, at: np.ndarray, spans: list):
        self.at, self.spans, self.tickets, self.task = at, spans, [], None

    def landed(self) -> bool:
        """Every read is done (the page cache held them all: nothing waited on)."""
        return not self.tickets and self.task is None and all(s.landed for s in self.spans)


class MissBatch:
    """Misses of one table version in the pipeline (the module docstring): row ids[i] goes to
    dest[slots[i]], verified; records[slots[i]] (optional, uint8 [*, carried width]) its record
    as a client carries it (trust.RECORDS: as read, no sum made again; rows taken from peers
    or of another form: made from the row).

    tier: the ColdTier the rows come from (its submit, finish, place, abandon, place_carried,
        carried_records, row_error). ids: sorted, distinct, in range int64 (not re-checked).
    note: the caller's last stage, note(batch), run by finish once the rows are placed; what
        it returns, finish returns. clock: entered as the batch's reads start, left when it
        ends (client/local_reads.BusyClock), or None.

    Counts what it did: `taken` (rows a note carried, placed), `refused` (rows a note carried
    that failed: read instead), `shared` (rows copied from peers), `kept` (rows copied from
    earlier batches), `started` (when submit began, perf_counter)."""

    def __init__(self, tier, ids: np.ndarray, dest: np.ndarray, slots: np.ndarray,
                 records: np.ndarray | None = None, *, note: Callable | None = None, clock=None):
        self.tier, self.ids, self.dest, self.slots, self.records = tier, ids, dest, slots, records
        self._note, self._clock = note, clock
        self.parts: list[Part] = []
        self.flights = None  # cache/miss_flights.MissFlights, where the claim shares the misses
        self.own = None  # positions this reader reads (None: all)
        self.queued = None  # (first, end) of its reads' places in the ring's queue (the tier's submit sets it)
        self.taken, self.refused, self.refused_first, self.shared, self.kept = 0, 0, -1, 0, 0
        self.finished = False  # finish returned (its rows placed and verified)
        self.started = 0.0
        self._claims = None  # (state, entry, seen) of the flights' claim
        self._kept_from: list[tuple] = []  # (batch, positions here, slots there) of the kept rows
        self._unpublished = None  # bool [n]: claimed here and not yet published
        self._bad: list[tuple[int, str]] = []  # (position, why) of rows that failed
        self._clocked = False

    @classmethod
    def done(cls, rows) -> "MissBatch":
        """A batch with no misses whose rows are in hand (a full-resident table's, a planned
        step's): its finish returns `rows`."""
        none = np.zeros(0, dtype=np.int64)
        return cls(None, none, None, none, note=lambda _: rows)

    # ---- the stages, in order ----
    def claim(self, flights=None, carried: tuple | None = None, kept=()) -> "MissBatch":
        """Which rows this reader reads. kept: batches of this table this thread read before or
        has in flight (the last step's, one read ahead: LocalReads), finished or not: the
        rows they hold are copied from them at finish (verified as they were placed), with
        their records (`kept` counts them; `kept_from` says which batches gave any). carried:
        (sorted ids, their index in rows, rows) a client read and its note carries
        (admitted by trust): those of the batch are placed now, checked
        (tier.place_carried); if one fails, all of them are read instead (`refused`).
        flights: claim the rest there (MissFlights.claim); the rows another client is
        reading are taken from it at finish."""
        n = self.ids.size
        own = np.ones(n, dtype=bool)
        for b in kept:
            at = np.flatnonzero(own)
            if at.size == 0:
                break
            if b.ids.size == 0:
                continue
            pos = np.minimum(np.searchsorted(b.ids, self.ids[at]), b.ids.size - 1)
            hit = b.ids[pos] == self.ids[at]
            if hit.any():
                self._kept_from.append((b, at[hit], b.slots[pos[hit]]))
                own[at[hit]] = False
                self.kept += int(np.count_nonzero(hit))
        if carried is not None and n:
            have_ids, row_at, rows = carried
            pos = np.minimum(np.searchsorted(have_ids, self.ids), have_ids.size - 1)
            have = (have_ids[pos] == self.ids) & own
            k = int(np.count_nonzero(have))
            if k:
                bad = self.tier.place_carried(self.ids[have], rows, row_at[pos[have]], self.dest, self.slots[have])
                if bad < 0:
                    self.taken = k
                    own &= ~have
                else:
                    self.refused, self.refused_first = k, int(self.ids[have][bad])
        if flights is not None and n:
            self.flights = flights
            at = np.flatnonzero(own)
            state, entry, seen = flights.claim(self.ids[at])
            self._claims = (at, state, entry, seen)
            own[at[state < flights.MINE]] = False  # ready or being read by a peer
            self._unpublished = np.zeros(n, dtype=bool)
            self._unpublished[at[state == flights.MINE]] = True
        self.own = None if own.all() else np.flatnonzero(own)
        return self

    def submit(self) -> "MissBatch":
        """The reads of this reader's own rows put in flight (tier.submit), in parts; a part
        whose reads are all done already (the page cache held it) is placed and published at
        once, while its scratch is still in the CPU's cache. Raises what tier.submit raises
        (ChecksumError for a segment not there), the batch abandoned."""
        self.started = time.perf_counter()
        if self._clock is not None and not self._clocked:
            self._clock.__enter__()
            self._clocked = True
        own = np.arange(self.ids.size) if self.own is None else self.own
        step = self.flights.PUBLISH_ROWS if self.flights is not None else max(1, own.size)
        try:
            for a in range(0, own.size, step):
                for part in self.tier.submit(self, own[a:a + step]):
                    self.parts.append(part)
                    if part.landed():
                        self._end(part)
        except BaseException:
            self.abandon()
            raise
        return self

    def finish(self):
        """Each part waited for (tier.finish), verified and placed (tier.place) and published,
        in order; then the rows kept from earlier batches copied (each finished first), the
        rows peers claimed taken (or read here), records made where asked,
        and the caller's note run: its result returned. ChecksumError (DATA_LOSS) for the
        first row that failed, OSError for a read that did, the batch abandoned first."""
        try:
            while self.parts:
                self._end(self.parts[0])
            if self._bad:
                pos, why = min(self._bad)
                raise self.tier.row_error(int(self.ids[pos]), why)
            self._take_kept()
            took = self._take_shared() if self.flights is not None else None
            self._make_records(took)
        except BaseException:
            self.abandon()
            raise
        self._leave_clock()
        self.finished = True
        return self._note(self) if self._note is not None else None

    def landed(self) -> bool:
        """Every read of the batch is done (its finish waits for nothing), asked without waiting."""
        return all(self.tier.landed(part) for part in self.parts)

    def land(self, share: float) -> None:
        """Wait until `share` of this batch's reads on the ring have landed (the rest stay in
        flight): Client.lookup_many lets a table's reads part land before it begins the next."""
        self.tier.land(self, share)

    def abandon(self) -> None:
        """End a batch that will not finish: the reads in flight waited for and their scratch
        given back, nothing more placed (dest rows of the batch may hold anything), the
        claims not yet published given up (their waiters read those rows themselves)."""
        parts, self.parts = self.parts, []
        for part in parts:
            self.tier.abandon(part)
        kept, self._kept_from = self._kept_from, []
        for b, _, _ in kept:
            if not b.finished:
                b.abandon()
        if self._unpublished is not None and self._unpublished.any():
            at, state, entry, seen = self._claims
            give = np.flatnonzero(self._unpublished[at])
            self.flights.give_up(entry[give], seen[give])
            self._unpublished[:] = False
        self._leave_clock()

    # ---- within the stages ----
    def _end(self, part: Part) -> None:
        """finish -> verify and place -> publish, for one part."""
        self.tier.finish(part)
        bad, why = self.tier.place(part, self)  # gives the part's scratch back, whatever happens
        self.parts.remove(part)
        if bad >= 0:
            self._bad.append((bad, why))
        else:
            self._publish(part.at)

    def _publish(self, at: np.ndarray) -> None:
        """The claimed rows among positions `at`, placed, offered to the peers waiting on them."""
        if self._unpublished is None:
            return
        mine = at[self._unpublished[at]]
        if mine.size:
            claimed_at, _, entry, seen = self._claims
            k = np.searchsorted(claimed_at, mine)
            rows = self.records[self.slots[mine]] if self.records is not None else self.dest[self.slots[mine]]
            self.flights.publish(entry[k], seen[k], rows)
            self._unpublished[mine] = False

    @property
    def kept_from(self) -> list["MissBatch"]:
        """The earlier batches the claim copies rows from (until finish has copied them)."""
        return [b for b, _, _ in self._kept_from]

    def _take_kept(self) -> None:
        """The rows the claim found in earlier batches copied from them, each batch finished
        first where it is not; the rows of one that fails are read here, as a batch of their own
        (and fail here, the same way, if they are bad)."""
        while self._kept_from:  # each taken off once it is ended (abandon ends the rest)
            b, mine, theirs = self._kept_from[0]
            try:
                if not b.finished:
                    b.finish()
            except Exception:  # noqa: BLE001 - its rows are read again here: their error is raised here
                self._kept_from.pop(0)
                self.kept -= mine.size
                MissBatch(self.tier, self.ids[mine], self.dest, self.slots[mine], self.records).submit().finish()
                continue
            self._kept_from.pop(0)
            self.dest[self.slots[mine]] = b.dest[theirs]
            if self.records is not None and b.records is not None:
                self.records[self.slots[mine]] = b.records[theirs]

    def _take_shared(self) -> np.ndarray:
        """The rows peers published or are reading, copied (each checked) as they are published;
        those that fail, change during the copy or outlast the wait are read here, as a batch
        of their own. The positions taken from peers."""
        at, state, entry, seen = self._claims
        peers = np.flatnonzero(state < self.flights.MINE)
        if peers.size == 0:
            return peers
        missed = self.flights.take(self.ids[at], peers, state, entry, seen, self.dest, self.slots[at],
                                   self.tier.place_carried)
        self.shared += peers.size - missed.size
        if missed.size:
            missed = np.sort(at[missed])
            rest = MissBatch(self.tier, self.ids[missed], self.dest, self.slots[missed], self.records)
            rest.submit().finish()
        return np.setdiff1d(at[peers], missed, assume_unique=True)

    def _make_records(self, took: np.ndarray | None) -> None:
        """Records the caller asked for that were not read as records: made from the rows."""
        if self.records is None or not self.tier.verifies_rows or self.ids.size == 0:
            return
        if self.tier.carried.form != "records":
            made = np.arange(self.ids.size)
        else:
            made = took if took is not None else np.zeros(0, np.int64)
        if made.size:
            s = self.slots[made]
            self.records[s] = self.tier.carried_records(self.ids[made], self.dest[s])

    def _leave_clock(self) -> None:
        if self._clocked:
            self._clocked = False
            self._clock.__exit__(None, None, None)
