"""TableEngine.prefetch: the scheduler's call at admission hints the policy (expect)
and, when asked, reads the missing rows in ahead."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from tierstore.store.catalog import Catalog
from tierstore.engine import make_engine
from tierstore.cache.leases import LeaseTable
from tierstore.tiers.dram import Arena
from tierstore.tiers.nvme.reader import SegmentReader

ROWS, SLOTS = 20_000, 2000


@pytest.fixture
def engine(make_table, data_dir):
    tv, data = make_table("t", rows=ROWS, row_bytes=64)
    with Catalog(data_dir, readonly=True) as cat:
        sums = cat.checksums("t", tv.version)
    reader = SegmentReader(data_dir, tv, sums)
    arena = Arena(Path("/dev/shm") / f"tierstore-test-prefetch.{time.monotonic_ns()}", SLOTS, tv.row_bytes)
    eng = make_engine(tv, reader, arena, leases=LeaseTable(64), full=False)
    yield eng, data
    arena.close(unlink=True)
    reader.close()


def _step(eng, ids):
    res = eng.plan(np.asarray(ids), ttl_s=30.0, client=b"c")
    rows = eng.arena.rows[res.slots].copy()
    eng.leases.release_client(b"c")
    return res, rows


def test_rows_a_queued_request_reads_outlive_others(engine):
    eng, data = engine
    _step(eng, np.arange(SLOTS))  # fill the arena
    assert eng.prefetch(np.arange(300), read=False) == 0  # a hint: nothing read
    for lo in range(5000, 6700, 340):  # other traffic evicts 1,700 rows
        _step(eng, np.arange(lo, lo + 340))
    res, rows = _step(eng, np.arange(600))
    assert res.hits == 300  # the queued request's rows stayed (without the hint: 0), the others left
    assert np.array_equal(rows, data[:600])


def test_prefetch_reads_missing_rows_ahead(engine):
    eng, data = engine
    assert eng.prefetch(np.arange(100, 200)) == 100
    res, rows = _step(eng, np.arange(100, 200))
    assert res.hits == 100 and np.array_equal(rows, data[100:200])


def test_a_prefetch_fills_free_slots_past_what_it_protects(engine):
    """Reading ahead is capped at what the policy can protect (half the arena) only where it
    would evict: into an empty arena every missing row of the request is read."""
    eng, data = engine
    ids = np.arange(7000, 7000 + int(0.8 * SLOTS))
    assert eng.prefetch(ids) == ids.size and eng.counters.evictions == 0
    res, rows = _step(eng, ids)
    assert res.hits == ids.size and np.array_equal(rows, data[ids])
    more = np.arange(12000, 12000 + SLOTS)  # a full arena: the cap holds, no more than half is read
    assert eng.prefetch(more) <= SLOTS // 2
