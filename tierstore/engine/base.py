"""One engine per served table version: the arena (tiers/dram.py) over the cold tier.

`make_engine(version, reader, arena, leases=..., full=...)` (tierstore/engine/__init__.py)
builds the engine of that mode:
- FullEngine (full.py): the whole table sits in the arena in id order, slot ==
  id; a Plan only validates (nothing is ever evicted, so nothing needs a lease);
- CacheEngine (cache.py): the arena caches `capacity` rows under a policy
  (tierstore/cache/policy), promoting misses from the cold tier with leases.
This base holds what both share: validation at the edge, refusal of blocks
online verification found corrupt (bad_blocks.py), counters and stats. Each mode's
engine has a `repair` (repair.py: what online verification does to it) and `hints`
(hints.py); cache mode `notes` too (notes.py).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from tierstore.cache.leases import LeaseTable
from tierstore.cache.policy.config import PolicyConfig
from tierstore.engine.bad_blocks import BadBlocks
from tierstore.tiers.base import ColdTier, check_ids
from tierstore.tiers.dram import Arena
from tierstore.tiers.pages import huge_page_bytes
from tierstore.engine.hints import Hints
from tierstore.engine.verifier import VerifyCounters

__all__ = ["TableEngine", "Placement", "Counters"]


@dataclass(slots=True)
class Placement:
    slots: np.ndarray     # int64, one per requested id
    lease_id: int         # 0 when no lease was needed
    unique: int
    hits: int
    misses: int
    expires_s: float = 0.0  # the lease's TTL as applied (0: no lease)


@dataclass(slots=True)
class Counters:
    plans: int = 0
    hits: int = 0
    misses: int = 0
    promotions: int = 0
    evictions: int = 0
    lease_refusals: int = 0
    lookups: int = 0
    fill_waits: int = 0
    prefetched: int = 0
    local_steps: int = 0  # steps clients on the host read themselves, told by access notes (Notes.access)
    # of those, steps the sidecar dropped unlearned (learner.py): it was behind, or their client held the
    # most of the learner's queue while others' notes waited (Stats notes_dropped: the two together)
    notes_behind: int = 0
    notes_over_share: int = 0
    notes_refused: int = 0  # notes refused as malformed (ids out of range, bad step ends)
    warmed: int = 0  # rows a warm start promoted (HotSet.warm)
    note_rows_placed: int = 0  # promoted from the rows a note carried (no disk read)
    note_rows_refused: int = 0  # rows a note carried that failed their row sums (read from disk instead)
    steps_copied: int = 0  # planned or noted steps another client sent first (a TP rank's copy): not learned again


class TableEngine:
    """What every engine has; tierstore.engine.make_engine builds FullEngine or CacheEngine."""

    full: bool

    def __init__(self, version, reader: ColdTier, arena: Arena, *, leases: LeaseTable, recorder=None):
        self.version = version            # catalog.TableVersion
        self.table = version.table        # the table's name (a lease's refusals say it: leases.LeasedEngine)
        self.rows = version.rows
        self.reader = reader              # the cold tier (tiers.base.ColdTier: segment files or remote), verifies rows
        self.arena = arena
        self.leases = leases
        self.counters = Counters()
        self.lock = threading.Lock()       # the table lock: every writer of the slot table and the policy holds it
        self.capacity = arena.slots       # the arena's slots: every slot is below it (leases.LeasedEngine)
        self.verifier = None                          # tierstore.engine.verifier.Verifier, set by the sidecar
        self.verify_counters = VerifyCounters()
        self.bad_blocks = BadBlocks(version)          # cold blocks online verification found corrupt, or suspects
        self.recorder = recorder                      # tierstore.sidecar.trace_recorder.TraceRecorder (serve --record-trace)
        self.retired = False                          # replaced by another version; freed when unleased
        self.freed = False                            # set (under the lock) once the sidecar may free it
        self._active = 0                              # plans running now (a retired engine waits for them)
        self.hints = Hints(self, PolicyConfig())      # prefetch hints (hints.py); cache mode: by its policy's config

    # ---- requests -----------------------------------------------------------
    def check_ids(self, ids) -> np.ndarray:
        return check_ids(ids, self.rows, self.table)

    def _edge(self, ids) -> np.ndarray:
        """Validate a request's ids, refuse corrupt blocks, record the trace: every Plan's first step."""
        ids = self.check_ids(ids)
        self.bad_blocks.refuse(ids)
        if self.recorder is not None and ids.size:
            self.recorder.record(self.table, np.unique(ids), n_ids=self.rows)
        return ids

    def _validated(self, ids: np.ndarray) -> Placement:
        """A Plan with nothing to pin (full mode, or no ids): no lease to hold or leak."""
        self.counters.plans += 1
        self.counters.hits += ids.size
        return Placement(ids, 0, ids.size, ids.size, 0)

    def close(self) -> None:
        """Let go of what the engine holds besides its arena and reader (both the sidecar's)."""

    def slot_index(self):
        """The slot index (cache/slot_index.py SlotIndexFile) through which clients on the host read
        this table's resident rows without a Plan, or None: full mode (slot == id needs
        none), or a sidecar that keeps it private (--no-local-reads)."""
        return None

    @property
    def busy(self) -> bool:
        return self._active > 0

    def try_free(self) -> bool:
        """Whether nothing runs in the engine now; if so it is marked freed (under the lock),
        so a late note or prefetch that has not entered yet finds it gone (enter())."""
        with self.lock:
            if self._active:
                return False
            self.freed = True
            return True

    def enter(self) -> bool:
        """Count one request as running (busy), unless the engine is freed: False then."""
        with self.lock:
            if self.freed:
                return False
            self._active += 1
            return True

    def leave(self) -> None:
        with self.lock:
            self._active -= 1

    # ---- introspection ------------------------------------------------------
    def _occupancy(self) -> tuple[int, int]:
        """(resident rows, leased slots)."""
        raise NotImplementedError

    def metadata_bytes(self) -> int:
        """DRAM this table holds beyond its arena rows: block checksums, format 1's row
        checksums (format 2 keeps them in the records on disk: nothing per row), and
        (cache mode) the id/slot maps and the policy's state."""
        return int(sum(a.nbytes for a in self.reader.held_arrays()))

    def stats(self) -> dict:
        c = self.counters
        resident, leased = self._occupancy()
        over_share = c.notes_over_share  # read once: notes_dropped less it is a counter too (metrics.py)
        return dict(table=self.table, version=self.version.number, mode="full" if self.full else "cache",
                    capacity=self.capacity, resident=resident, hits=c.hits, misses=c.misses,
                    promotions=c.promotions, evictions=c.evictions, leases_active=self.leases.count_for(self),
                    leased_slots=leased, lease_refusals=c.lease_refusals,
                    bytes_read=int(self.reader.bytes_read), plans=c.plans,
                    prefetched=c.prefetched, fill_waits=c.fill_waits, local_steps=c.local_steps,
                    notes_dropped=c.notes_behind + over_share, notes_refused=c.notes_refused, warmed=c.warmed,
                    note_rows_placed=c.note_rows_placed, note_rows_refused=c.note_rows_refused,
                    steps_copied=c.steps_copied, notes_over_share=over_share, metadata_bytes=self.metadata_bytes(),
                    arena_page_bytes=self.arena.backing.page,
                    arena_huge_bytes=huge_page_bytes(self.arena.path, max_age=1.0)[0])
