"""Full mode: the whole table in the arena in id order (slot == id), verified at load.

A Plan only validates: nothing is ever evicted, so nothing needs a lease. The
verifier scrubs arena blocks against the catalog and repairs them from disk
(repair.py, FullRepair: the engine's `repair`).

The arena is interleaved or split (tiers/dram.py: all weights, then all
scales, as the engines keep a table); this engine reads and writes it through
Arena.take / range / put, so checksums, lookups and repairs see the same
interleaved rows, the catalog's bytes, in either layout.
"""
from __future__ import annotations

import numpy as np

import xxhash

from tierstore import cpu_token
from tierstore.engine.base import Placement, TableEngine
from tierstore.engine.repair import FullRepair
from tierstore.tiers.nvme import rowsum

__all__ = ["FullEngine"]

class FullEngine(TableEngine):
    full = True

    def __init__(self, version, reader, arena, *, leases, recorder=None):
        super().__init__(version, reader, arena, leases=leases, recorder=recorder)
        self.repair = FullRepair(self)  # online verification's scrub (repair.py)

    # ---- loading ------------------------------------------------------------
    def load_full(self, chunk_rows: int = 1 << 16, progress=None) -> None:
        """Fill a full-mode arena from the cold tier (every block verified): straight into
        an interleaved arena, through one chunk buffer into a split one."""
        buf = np.empty((min(chunk_rows, self.rows), self.arena.row_bytes), np.uint8) if self.arena.split else None
        for start in range(0, self.rows, chunk_rows):
            n = min(chunk_rows, self.rows - start)
            if buf is None:
                self.reader.read_range(start, n, out=self.arena.rows[start:start + n])
            else:
                self.arena.put(start, self.reader.read_range(start, n, out=buf[:n]))
            if progress is not None:
                progress(n)

    def verify_arena(self, checksums: np.ndarray, chunk_blocks: int | None = None) -> list[int]:
        """Blocks of a full-mode arena whose bytes no longer match the catalog (each block's
        rows hashed as the segment holds them, whatever the arena's layout: format 2
        rebuilds their records first); `chunk_blocks` at a time (default: 8 MiB of them)."""
        v, h = self.version, xxhash.xxh3_64_intdigest
        br, bb = v.block_rows, v.block_bytes
        group = chunk_blocks or max(1, (8 << 20) // bb)
        bad: list[int] = []
        for a in range(0, v.n_blocks, group):
            z = min(a + group, v.n_blocks)
            lo, hi = a * br, min(z * br, self.rows)
            raw = memoryview(self.stored(lo, hi)).cast("B")
            want = checksums[a:z].tolist()
            bad += [a + j for j, off in enumerate(range(0, len(raw), bb)) if h(raw[off:off + bb]) != want[j]]
        return bad

    def stored(self, lo: int, hi: int, rows: np.ndarray | None = None) -> np.ndarray:
        """Arena rows [lo, hi) (`rows`: already read interleaved) as the segments store
        them (what block checksums cover)."""
        rows = self.arena.range(lo, hi) if rows is None else rows
        if self.version.segment_format == 1:
            return np.ascontiguousarray(rows)
        return rowsum.records(rows, np.arange(lo, hi, dtype=np.int64), rowsum.RowKey.of(self.version.row_salt))

    # ---- requests -----------------------------------------------------------
    def plan(self, ids: np.ndarray, ttl_s: float, conn_id: bytes = b"", request_id: int = 0) -> Placement:
        """Validate `ids`: every row is resident at slot == id."""
        with cpu_token.hold():
            return self._validated(self._edge(ids))

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Rows [n, row_bytes] copied out of the arena (inline path)."""
        ids = self.check_ids(ids)
        self.counters.lookups += 1
        self.bad_blocks.refuse(ids)
        self.counters.hits += ids.size
        return self.arena.take(ids)

    def _occupancy(self) -> tuple[int, int]:
        return self.rows, 0
