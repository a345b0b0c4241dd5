"""Local reads: a host-side step of a cache-mode table served in the client, no round trip.

A Plan costs a round trip (two wake-ups) and the sidecar's CPU for every step,
however few rows miss. A client on the sidecar's host that wants the rows
copied out (Client.lookup) needs neither, when the sidecar publishes its slot
index (tierstore/cache/slot_index.py). A step is one batch of the read pipeline
(tiers/nvme/miss_batch.py), its stages here:
1. probe: resident rows are copied straight from the mapped arena, each checked
   against its slot's sequence lock: a row evicted or rewritten during the
   copy is not used, it is read like a miss;
2. claim, submit, finish, verify and place, publish: misses are read from the
   table's segment files and verified by their row checksums (inside each record,
   or format 1's row-sum file) in this process (tiers/nvme.SegmentReader, the same
   code the sidecar runs, with O_DIRECT when it runs with it), when the sidecar
   offers that (`cold_dir`); under O_DIRECT a row another client on the host is
   reading at the same time is copied from it instead (tierstore/cache/miss_flights.py:
   TP ranks staging one batch read each miss once between them); otherwise
   (Mooncake, versions without row checksums) a step with misses is planned
   through the sidecar as before;
3. note: each step's distinct ids are sent to the sidecar after the fact, in
   batches and one-way (client/step_channel.py: StepChannel.note): its policy
   learns the step as if it had been planned and promotes the misses, so the next
   steps find them resident; the note carries the rows this process read for
   them, in the table's carried form (tierstore/tiers/trust.py), so the sidecar
   does not read them from disk again (it verifies each first). For format 2 a
   row's sum on disk would cost the sidecar a read of its own, so the note
   carries whole records, each row with its sum keyed by the version's salt: the
   records as read and verified, kept by the batch, so no sum is made again here.

Rows are bit-exact and verified as on the planned path. What it does not give:
a lease. A kernel that reads the arena by slot later (the GPU gather over UVA)
needs the slots pinned, so it plans (Client.plan); a copy validated after the
fact cannot be.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable

import numpy as np

from tierstore.cache import miss_flights
from tierstore.cache.miss_flights import MissFlights
from tierstore.errors import StaleArena, TierstoreError
from tierstore.cache.slot_index import map_index
from tierstore.jit import Kernel, compiler_barrier, unique_inverse
from tierstore.tiers import trust
from tierstore.tiers.nvme.miss_batch import MissBatch

if TYPE_CHECKING:
    from tierstore.client.table_handle import TableHandle

__all__ = ["LocalReads", "BusyClock"]

log = logging.getLogger("tierstore.client")


class BusyClock:
    """Wall seconds during which at least one of a client's tables is in its miss path.

    Client.lookup_many reads a step's tables at once, so their own miss-path seconds
    (LocalReads.cold_seconds) overlap and their sum would count that time twice; this
    counts it once (`seconds`). Entered as a table's misses' reads start and left as they
    end (MissBatch's clock)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._inside, self._since, self.seconds = 0, 0.0, 0.0

    def __enter__(self):
        with self._lock:
            if not self._inside:
                self._since = time.perf_counter()
            self._inside += 1

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._inside -= 1
            if not self._inside:
                self.seconds += time.perf_counter() - self._since


class LocalReads:
    """Reads of one cache-mode table version through its published slot index.

    note: where each step read goes (StepChannel.note: table, version, distinct ids, the
    misses' ids and rows or None); called once per read, with arrays it keeps.
    clock: the client's BusyClock, timing its tables' miss paths together (one of its own if None).
    Raises StaleArena when the index is not the handle's (retired, another instance)."""

    def __init__(self, handle: "TableHandle", note: Callable[..., None], clock: BusyClock | None = None):
        self.handle, self._note = handle, note
        self._clock = clock if clock is not None else BusyClock()
        self.table, self.version, self.row_bytes = handle.table, handle.version, handle.row_bytes
        self.arena = handle.arena_np
        self.gen, self.id_of, self.map = map_index(handle.index_path, self.arena.shape[0], handle.rows,
                                                       handle.instance)
        # rows copied as 8-byte words where their width allows
        self._words = self.row_bytes % 8 == 0 and self.arena.flags.c_contiguous
        self._arena_words = self.arena.view(np.uint64) if self._words else self.arena
        self._seen = _seen_bitmap(self.arena.shape[0])
        self._cold = None  # SegmentReader over cold_dir, opened on the first miss
        self._cold_lock = threading.Lock()
        self.steps = self.rows_resident = self.rows_cold = 0  # what this reader served, and from where
        self.distinct_asked = self.distinct_cold = 0  # the same in distinct ids per step (as the sidecar counts)
        self.distinct_device = 0  # of distinct_cold, those this process read from the segment files itself
        self.cold_seconds = 0.0  # wall time in the miss path (claims, reads, checks): its rate beside the step's
        self._flights = None  # MissFlights under O_DIRECT (cache/miss_flights.py), opened with the reader
        self._mine = threading.local()  # per thread: `last`, its last step's batch (begin copies rows from it)
        self._closed = False

    def begin(self, ids: np.ndarray, out: np.ndarray | None = None,
              ahead: np.ndarray | None = None) -> MissBatch | None:
        """A lookup of int64 `ids` (in range, any order, repeats fine) begun: the probe (hits
        copied into `out`, uint8 [len(ids), row_bytes], C-contiguous: checked by the caller),
        then the misses' batch (tiers/nvme/miss_batch.py) claimed (rows this thread read for
        the table's last step, or read ahead for this one, copied from those batches; the
        miss flights, under O_DIRECT) and submitted: under io_uring in flight on this
        thread's ring when this returns. MissBatch.finish(), in this thread, waits for them,
        verifies and places them, notes the step (`note`) and returns the rows. So a caller
        begins a step's tables one after another and the device reads one table's misses
        while the next one's hits are copied (Client.lookup_many).

        ahead: the next step's ids (int64, in range), known ahead (a queued prefill's next
        chunk): their misses, bar this step's, are read as a batch of their own, submitted
        behind this step's reads and left in flight on this thread's ring, so the device
        has the next step's reads while this step's are placed and between the calls; this
        thread's next begin of the table claims its rows from it (copied at its finish). A
        hint: rows found resident by then are not used, and a begin from another thread
        does not see it. Until then it is this thread's (_ThreadAhead), never holding its
        ring entries and scratch past its reads: a begin of any table on the thread
        finishes it once they have landed.

        None when the misses have to be planned through the sidecar instead (no cold_dir
        offered, or its files would not open here): the hits are copied, nothing else is done."""
        queued = _AHEAD.reap(self)
        last, self._mine.last = getattr(self._mine, "last", None), None
        batch = None
        try:
            batch = self._begin(ids, out, ([last] if last is not None else []) + queued)
        finally:  # a batch read ahead that this step copies nothing from is let go once landed
            used = batch.kept_from if batch is not None else []
            for b in queued:
                if not any(b is u for u in used):
                    _AHEAD.add(None, b)
        if batch is not None and ahead is not None and ahead.size:
            _AHEAD.add(self, self._read_ahead(ahead, batch))
        return batch

    def _begin(self, ids: np.ndarray, out: np.ndarray | None, kept: list) -> MissBatch | None:
        """begin's probe, claim (rows of the `kept` batches claimed from them) and submit."""
        if out is None:
            out = np.empty((ids.size, self.row_bytes), dtype=np.uint8)
        where, asked = self.probe(ids, out)
        cold, flights, records = self._cold, None, None
        if where.size:
            cold = self._reader()
            if cold is None:
                return None
            uniq, inv = unique_inverse(ids[where])
            got = np.empty((uniq.size, self.row_bytes), dtype=np.uint8)
            # format 2: the misses' records as read ride on the note (no sum made again)
            if cold.carried.form == trust.RECORDS:
                records = np.empty((uniq.size, cold.carried.width), dtype=np.uint8)
            flights = self._flights  # a row another client is reading now is not read again
        else:
            uniq, inv, got = where, where, None
        batch = MissBatch(cold, uniq, got, np.arange(uniq.size), records, clock=self._clock if where.size else None,
                          note=lambda b: self.note(b, ids, out, where, asked, inv))
        return batch.claim(flights, kept=kept).submit()

    def _read_ahead(self, ids: np.ndarray, step: MissBatch) -> MissBatch | None:
        """The misses of `ids` (the slot index probed without copies: a hint needs no more) that
        this `step` does not read (the next step copies those from it), read into a batch of
        their own: submitted now, claimed by this thread's next begin of the table. None
        where there is nothing to read, or this process reads no misses; a batch that
        cannot start is let go (a hint: the next step reads those rows itself, and raises
        there)."""
        cold = self._reader()
        if cold is None:
            return None
        uniq = np.unique(ids[self.map.find(ids) < 0])
        uniq = uniq[~np.isin(uniq, step.ids, assume_unique=True)]
        if uniq.size == 0:
            return None
        records = np.empty((uniq.size, cold.carried.width), dtype=np.uint8) if cold.carried.form == trust.RECORDS \
            else None
        batch = MissBatch(cold, uniq, np.empty((uniq.size, self.row_bytes), dtype=np.uint8), np.arange(uniq.size),
                          records)
        try:
            return batch.claim().submit()
        except (TierstoreError, OSError):
            return None

    def probe(self, ids: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The probe stage: the rows the slot index holds READY copied into out, each checked
        against its slot's sequence lock (a probe racing the sidecar's writes may miss an id,
        never finds a wrong slot: slot_map.py); (the positions of the others, int64: the
        misses; the distinct ids of the rows kept)."""
        return _read_hits(ids, self.map.find(ids), self.gen, self.id_of, self._arena_words,
                          out.view(np.uint64) if self._words else out, self._seen)

    def note(self, batch: MissBatch, ids, out, where, asked, inv) -> np.ndarray:
        """The note stage (what MissBatch.finish returns): the misses' rows, verified and
        placed, copied into `out` at their positions `where`, the step noted to the sidecar
        (its distinct ids: the kept rows', then the misses'; the misses' rows in the
        table's carried form, tierstore/tiers/trust.py, so the sidecar promotes them without
        a disk read), the counts kept; returns `out`."""
        uniq, carried = batch.ids, None
        if where.size:
            self._mine.last = batch  # its rows, for this thread's next step's misses
            self.distinct_device += uniq.size - batch.shared - batch.kept
            self.cold_seconds += time.perf_counter() - batch.started
            out[where] = batch.dest[inv]
            self.distinct_cold += uniq.size
            # an id both kept and refused in one step, a probe racing a shift, is told twice:
            # two accesses, a hint
            asked = np.concatenate([asked, uniq])
            form = self._cold.carried.form
            if form:
                carried = batch.records if form == trust.RECORDS else batch.dest
        self._note(self.table, self.version, asked, uniq if carried is not None else None, carried)
        self.distinct_asked += asked.size
        self.steps += 1
        self.rows_resident += ids.size - where.size
        self.rows_cold += where.size
        return out

    def _reader(self):
        """The cold tier's reader, opened on the first miss; None where this process cannot
        open it (no cold_dir offered, or its catalog or files are out of reach): then steps
        with misses are planned, and a warning says why, once."""
        if self._cold is None and self.handle.cold_dir:
            with self._cold_lock:
                if self._cold is None and self.handle.cold_dir:
                    from tierstore.store.catalog import BlockChecksums, Catalog
                    from tierstore.tiers.nvme.reader import SegmentReader

                    try:
                        with Catalog(self.handle.cold_dir, readonly=True) as cat:
                            v = cat.get(self.table, self.version)
                            # format 2: a miss checks the sum in its record, the block sums are
                            # read from the catalog only if a block is read whole
                            checksums = BlockChecksums(self.handle.cold_dir, v) if v.segment_format >= 2 \
                                else cat.checksums(self.table, self.version)
                        # format 2: each record carries its row sum (nothing per row held here);
                        # format 1: the row-sum file is mapped, one page-cache copy for the host
                        cold = SegmentReader(self.handle.cold_dir, v, checksums, direct_io=self.handle.cold_direct)
                        self._flights = _flights(self.handle, cold)
                        self._cold = cold
                    except (OSError, TierstoreError) as e:
                        log.warning("table %s: cannot read misses from %s here (%s); planning them instead",
                                    self.table, self.handle.cold_dir, e)
                        self.handle.cold_dir = ""
        return self._cold

    def close(self) -> None:
        """Let the reader, the flights and the kept batches go; this thread's read ahead is
        abandoned now, another thread's by that thread's next begin of any table (its reads are
        on that thread's ring) or with the thread."""
        self._closed, self._mine = True, threading.local()
        _AHEAD.reap(self)
        if self._flights is not None:
            self._flights.close()
            self._flights = None
        if self._cold is not None:
            self._cold.close()
            self._cold = None


class _ThreadAhead(threading.local):
    """A thread's batches read ahead (LocalReads.begin's `ahead`), each with its reader, until
    that reader's next begin on the thread claims it (reader None: a batch no step claimed,
    let go). Their reads are on this thread's ring, and the ring's queue starts again only
    once every batch on it is waited for, so the next begin of any table on the thread
    finishes a batch whose reads have landed (nothing waited for: its scratch given back),
    lets go one no step wants, and abandons one whose reader is closed."""

    def __init__(self):
        self.batches: list[tuple[LocalReads | None, MissBatch]] = []

    def add(self, reads: LocalReads | None, batch: MissBatch | None) -> None:
        if batch is not None:
            self.batches.append((reads, batch))

    def reap(self, reads: LocalReads) -> list[MissBatch]:
        """`reads`' batches, taken; the others finished or let go as above."""
        mine, keep = [], []
        for r, b in self.batches:
            if r is reads and not r._closed:
                mine.append(b)
            elif r is None or r._closed:
                if r is not None or b.landed():
                    b.abandon()
                else:
                    keep.append((r, b))
            elif not b.finished and b.landed():
                try:
                    b.finish()
                    keep.append((r, b))
                except (TierstoreError, OSError):
                    pass  # a hint: the step that asks reads those rows itself, and raises there
            else:
                keep.append((r, b))
        self.batches = keep
        return mine


_AHEAD = _ThreadAhead()


def _flights(handle: "TableHandle", cold) -> MissFlights | None:
    """The table's miss flights, where the sidecar keeps them (O_DIRECT and rows verified by their
    sums: cache/miss_flights.py) and this process may share misses; None otherwise (each miss read here)."""
    if cold.direct is None or not cold.carried.form or not miss_flights.usable():
        return None
    try:
        return MissFlights(miss_flights.flights_path(handle.index_path), handle.rows, cold.carried.width,
                           handle.instance)
    except (OSError, StaleArena):
        return None  # a sidecar that keeps none (an older release): misses are read here, as before


# ---- the reader's hit path: one compiled call after the map probe (numpy below is the reference) ----
def _read_loop(ids, slots, gen, id_of, arena, out, miss, kept, seen):
    """The seqlock read of slot_index.py's reader over a whole batch.

    Pass 1 reads g1 = gen[s] of every probed slot; a barrier; pass 2 copies row i where
    g1 is even and id_of[s] still names ids[i]; a barrier; pass 3 keeps row i only if
    gen[s] still equals g1. Loads stay in program order on x86-64, so a kept row was row
    ids[i], READY, for its whole copy; every other position goes into `miss`. The kept
    rows' distinct ids go into `kept`, told apart by slot in the bitmap `seen` (one bit a
    slot, all clear between calls: cleared again here): a slot holds one row for all of
    a batch's kept positions, whose g1..g2 windows all span the pass between the barriers.
    Returns (misses, distinct kept ids)."""
    m = ids.shape[0]
    gens = np.empty(m, np.uint32)
    for i in range(m):  # pass 1: every g1 before any copy (the loads overlap)
        s = slots[i]
        gens[i] = gen[s] if s >= 0 else 1
    compiler_barrier()
    width = arena.shape[1]
    for i in range(m):  # pass 2: id confirmed, row copied
        s = slots[i]
        if (gens[i] & 1) == 0 and id_of[s] == ids[i]:
            for j in range(width):
                out[i, j] = arena[s, j]
        else:
            gens[i] = 1
    compiler_barrier()
    k = n = 0
    for i in range(m):  # pass 3: gen unchanged; the first position of each slot is noted (no branch)
        s = slots[i]
        if (gens[i] & 1) == 1 or gen[s] != gens[i]:
            miss[k] = i
            k += 1
            continue
        w, bit = s >> 6, np.uint64(1) << np.uint64(s & 63)
        word = seen[w]
        kept[n] = ids[i]
        n += (word & bit) == 0
        seen[w] = word | bit
    for i in range(m):
        if slots[i] >= 0:
            seen[slots[i] >> 6] = 0
    return k, n


_READ = Kernel(_read_loop)


def _seen_bitmap(capacity: int) -> np.ndarray:
    """The all-clear bitmap _read_hits tells a batch's slots apart with (one bit a slot)."""
    return np.zeros(-(-capacity // 64), np.uint64)


def _read_hits(ids, slots, gen, id_of, arena, out, seen) -> tuple[np.ndarray, np.ndarray]:
    """Copy into out[i] every row ids[i] that slots[i] (the map's probe, -1: not found) held READY
    for the whole copy (slot_index.py: the reader); returns (the positions of the others, int64:
    read them like misses; the distinct ids of the rows kept). `arena` and `out` may be viewed as
    uint64 words (rows a multiple of 8 bytes); `seen`: _seen_bitmap(arena slots), used within the
    one compiled call (which holds the GIL) and left clear."""
    n = ids.size
    miss = np.empty(n, np.int64)
    k = _READ.compiled()
    if k is not None:
        kept = np.empty(n, np.int64)
        m, a = k(ids, slots, gen, id_of, arena, out, miss, kept, seen)
        return miss[:m], kept[:a]
    # the reference: the same loads in the same order, one numpy call each
    gens = np.where(slots >= 0, gen[slots], 1).astype(np.uint32)
    ok = ((gens & 1) == 0) & (id_of[slots] == ids)
    np.take(arena, slots, axis=0, out=out, mode="clip")  # a -1 slot reads row 0: unused
    ok &= gen[slots] == gens
    return np.flatnonzero(~ok), np.unique(ids[ok])
