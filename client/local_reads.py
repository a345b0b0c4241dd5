"""Local reads: a host-side step of a cache-mode table served in the client, no round trip.

A Plan costs a round trip (two wake-ups) and the sidecar's CPU for every step,
however few rows miss. A client on the sidecar's host that wants the rows
copied out (Client.lookup) needs neither, when the sidecar publishes its slot
index (tierstore/cache/slot_index.py):
1. resident rows are copied straight from the mapped arena, each checked
   against its slot's sequence lock: a row evicted or rewritten during the
   copy is not used, it is read like a miss;
2. misses are read from the table's segment files and verified by their row
   checksums (inside each record, or format 1's mapped row-sum file) in this process (tiers/nvme.SegmentReader, the same code the
   sidecar runs, with O_DIRECT when it runs with it), when the sidecar offers
   that (`cold_dir`); under O_DIRECT a row another local client is reading at
   the same time is copied from it instead (tierstore/cache/miss_flights.py:
   TP ranks staging one batch read each miss once between them); otherwise (Mooncake, versions without row checksums) a
   step with misses is planned through the sidecar as before;
3. each step's distinct ids are noted and sent to the sidecar after the fact, in batches
   and one-way (client/step_link.py): its policy learns the step as if it had
   been planned and promotes the misses, so the next steps find them resident;
   the note carries the rows this process read for them, so the sidecar does not
   read them from disk again (it verifies each against its row sum first). For
   format 2 under O_DIRECT it does not: a row's sum is not in the page cache then,
   so checking the row would read its record anyway, and the sidecar reads the
   records itself, batched at queue depth.

Rows are bit-exact and verified as on the planned path. What it does not give:
a lease. A kernel that reads the arena by slot later (the GPU gather over UVA)
needs the slots pinned, so it plans (Client.plan); a copy validated after the
fact cannot be.
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import numpy as np

from tierstore.cache import miss_flights
from tierstore.cache.miss_flights import MissFlights
from tierstore.errors import StaleArena, TierstoreError
from tierstore.jit import Kernel, distinct
from tierstore.cache.slot_index import map_index
from tierstore.jit import unique_inverse

if TYPE_CHECKING:
    from tierstore.client.client import Client
    from tierstore.client.table_handle import TableHandle

__all__ = ["LocalReads"]

log = logging.getLogger("tierstore.client")


class LocalReads:
    """Reads of one cache-mode table version through its published slot index."""

    def __init__(self, client: "Client", handle: "TableHandle"):
        self.client, self.handle = client, handle
        self.table, self.version, self.row_bytes = handle.table, handle.version, handle.row_bytes
        self.arena = handle.arena_np
        self.gen, self.id_of, self.map = map_index(handle.index_path, self.arena.shape[0], handle.rows,
                                                       handle.instance)
        self._cold = None  # SegmentReader over cold_dir, opened on the first miss
        self._cold_lock = threading.Lock()
        self.steps = self.rows_resident = self.rows_cold = 0  # what this reader served, and from where
        self.distinct_asked = self.distinct_cold = 0  # the same in distinct ids per step (as the sidecar counts)
        self.distinct_device = 0  # of distinct_cold, those this process read from the segment files itself
        self._flights = None  # MissFlights under O_DIRECT (cache/miss_flights.py), opened with the reader

    def read(self, ids: np.ndarray) -> np.ndarray | None:
        """Rows uint8 [len(ids), row_bytes] of int64 `ids` (in range, any order, repeats
        fine); None when a miss has to be planned through the sidecar (no cold_dir)."""
        n = ids.size
        out = np.empty((n, self.row_bytes), dtype=np.uint8)
        slots, gens = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.uint32)
        # three calls, each reading after the previous returned (slot_index.py: the reader)
        _probe(ids, self.map, self.gen, slots, gens)
        _copy(ids, slots, gens, self.id_of, self.arena, out)
        missing = _confirm(slots, gens, self.gen)
        asked = distinct(ids)
        uniq = got = None
        if missing:
            cold = self._reader()
            if cold is None:
                return None
            where = np.flatnonzero(gens & 1)
            uniq, inv = unique_inverse(ids[where])
            got = np.empty((uniq.size, self.row_bytes), dtype=np.uint8)
            if self._flights is not None:  # a row another client is reading now is not read again
                shared = self._flights.rows_shared
                self._flights.read(uniq, got, cold)  # verified; ChecksumError is DATA_LOSS
                self.distinct_device += uniq.size - (self._flights.rows_shared - shared)
            else:
                cold.read_into(uniq, got, np.arange(uniq.size))  # verified; ChecksumError is DATA_LOSS
                self.distinct_device += uniq.size
            out[where] = got[inv]
            self.distinct_cold += uniq.size
        # the misses' verified rows ride on the note: the sidecar promotes them without a disk read.
        # Format 2 under O_DIRECT: as records, each row with its sum (the sidecar's copy of the
        # sum is on disk, a read of its own); a version without row sums: nothing to send
        if uniq is not None:
            form = self._cold.carried_form
            if form == "records":
                got = self._cold.carried_records(uniq, got)
            elif not form:
                uniq = got = None
        self.client.link.note(self.table, self.version, asked, uniq, got)
        self.distinct_asked += asked.size
        self.steps += 1
        self.rows_resident += n - missing
        self.rows_cold += missing
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
        if self._flights is not None:
            self._flights.close()
            self._flights = None
        if self._cold is not None:
            self._cold.close()
            self._cold = None


def _flights(handle: "TableHandle", cold) -> MissFlights | None:
    """The table's miss flights, where the sidecar keeps them (O_DIRECT and rows verified by their
    sums: cache/miss_flights.py) and this process may share misses; None otherwise (each miss read here)."""
    if cold.direct is None or not cold.carried_form or not miss_flights.usable():
        return None
    width = cold.record_bytes if cold.carried_form == "records" else cold.row_bytes
    try:
        return MissFlights(miss_flights.flights_path(handle.index_path), handle.rows, width, handle.instance)
    except (OSError, StaleArena):
        return None  # a sidecar that keeps none (an older release): misses are read here, as before


# ---- the reader's three passes (compiled; numpy below is the reference) ----
def _probe_loop(slots, gen, gens):
    for i in range(slots.shape[0]):
        s = slots[i]
        gens[i] = gen[s] if s >= 0 else 1


def _copy_loop(ids, slots, gens, id_of, arena, out):
    width = arena.shape[1]
    for i in range(ids.shape[0]):
        s = slots[i]
        if (gens[i] & 1) == 0 and id_of[s] == ids[i]:
            for j in range(width):
                out[i, j] = arena[s, j]
        else:
            gens[i] = 1


def _confirm_loop(slots, gens, gen):
    missing = 0
    for i in range(slots.shape[0]):
        if (gens[i] & 1) == 0 and gen[slots[i]] != gens[i]:
            gens[i] = 1
        missing += gens[i] & 1
    return missing


_PROBE, _COPY, _CONFIRM = Kernel(_probe_loop), Kernel(_copy_loop), Kernel(_confirm_loop)


def _probe(ids, slot_map, gen, slots, gens) -> None:
    """slots[i] = the slot the map finds for ids[i] (slot_map.py: a probe racing the sidecar's
    writes may miss it, never finds a wrong one); gens[i] = its gen (odd: not resident)."""
    slot_map.find(ids, out=slots)
    k = _PROBE.compiled()
    if k is not None:
        k(slots, gen, gens)
        return
    gens[:] = np.where(slots >= 0, gen[slots], 1)


def _copy(ids, slots, gens, id_of, arena, out) -> None:
    """Copy the rows whose slot was READY and held that id; mark the others odd."""
    k = _COPY.compiled()
    if k is not None:
        k(ids, slots, gens, id_of, arena, out)
        return
    ok = ((gens & 1) == 0) & (id_of[slots] == ids)
    np.take(arena, slots, axis=0, out=out)  # a -1 slot reads the last row: unused
    gens[~ok] = 1


def _confirm(slots, gens, gen) -> int:
    """Rows whose slot changed since the probe are marked odd; returns how many are odd (misses)."""
    k = _CONFIRM.compiled()
    if k is not None:
        return int(k(slots, gens, gen))
    gens[(gens & 1 == 0) & (gen[slots] != gens)] = 1
    return int(np.count_nonzero(gens & 1))
