"""FullEngine over a split arena: loaded, verified, looked up and repaired as interleaved rows."""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from tierstore.cache.leases import LeaseTable
from tierstore.engine import make_engine
from tierstore.ingest.writer import write_version
from tierstore.store.catalog import Catalog
from tierstore.table.formats import encode_rows
from tierstore.tiers.dram import Arena
from tierstore.tiers.nvme.reader import SegmentReader


def test_a_split_full_engine_serves_and_repairs_the_catalogs_rows(data_dir):
    rows = encode_rows(np.random.default_rng(0).standard_normal((3000, 256)).astype(np.float32), "fp8-e4m3-ue8m0")
    tv = write_version(data_dir, "l1", [rows[:1000], rows[1000:]], rows=3000, row_format="fp8-e4m3-ue8m0", row_dim=256)
    with Catalog(data_dir, readonly=True) as cat:
        sums = cat.checksums("l1", tv.number)
    reader = SegmentReader(data_dir, tv, sums)
    arena = Arena(Path("/dev/shm") / f"tierstore-test-split.{os.getpid()}.{time.monotonic_ns()}", 3000, 264, split=256)
    try:
        eng = make_engine(tv, reader, arena, leases=LeaseTable(8), full=True)
        eng.load_full(chunk_rows=700)
        assert np.array_equal(arena.split_rows.weight, rows[:, :256])
        assert np.array_equal(arena.split_rows.scale, rows[:, 256:])
        assert eng.verify_arena(sums, chunk_blocks=7) == []
        ids = np.random.default_rng(1).integers(0, 3000, 500)
        assert np.array_equal(eng.lookup(ids), rows[ids])
        arena.split_rows.scale[1234, 3] ^= 0x40  # a flipped bit in one row's scales
        arena.split_rows.weight[17, 0] ^= 0x01  # and one in another row's weights
        bad = eng.verify_arena(sums)
        assert len(bad) == 2
        found = eng.repair.scrub_blocks(np.array(bad))
        assert sorted(f[2] for f in found) == [17, 1234]  # the rows repaired, named
        assert np.array_equal(arena.split_rows.weight, rows[:, :256])
        assert np.array_equal(arena.split_rows.scale, rows[:, 256:])
        assert eng.verify_arena(sums) == []
    finally:
        arena.close(unlink=True)
        reader.close()
