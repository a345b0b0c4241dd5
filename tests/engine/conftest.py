"""Fixtures of the engine tests: cache-mode engines in process over a real table, arena and reader."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from tierstore.cache.leases import LeaseTable
from tierstore.engine import make_engine
from tierstore.store.catalog import Catalog
from tierstore.tiers.dram import Arena
from tierstore.tiers.nvme.reader import SegmentReader


@pytest.fixture
def cache_engines(make_table, data_dir):
    """cache_engines(rows, slots, reader=SegmentReader) -> (a fresh cache-mode engine of `slots`
    slots over table t of `rows` x 64 B, those rows). The table is written on the first call;
    every engine's arena and reader are closed after the test."""
    made, table = [], {}

    def make(rows: int, slots: int, reader=SegmentReader):
        if not table:
            tv, data = make_table("t", rows=rows, row_bytes=64)
            with Catalog(data_dir, readonly=True) as cat:
                table.update(tv=tv, data=data, sums=cat.checksums("t", tv.number))
        tv = table["tv"]
        cold = reader(data_dir, tv, table["sums"])
        arena = Arena(Path("/dev/shm") / f"tierstore-test-engine.{time.monotonic_ns()}", slots, tv.row_bytes)
        made.append((arena, cold))
        return make_engine(tv, cold, arena, leases=LeaseTable(64), full=False), table["data"]

    yield make
    for arena, cold in made:
        arena.close(unlink=True)
        cold.close()


@pytest.fixture
def step():
    """step(engine, ids) -> (its Placement, the rows read at its slots): one planned step,
    its lease released after the copy."""
    def run(eng, ids):
        res = eng.plan(np.asarray(ids), ttl_s=30.0, conn_id=b"c")
        rows = eng.arena.rows[res.slots].copy()
        eng.leases.release_client(b"c")
        return res, rows
    return run
