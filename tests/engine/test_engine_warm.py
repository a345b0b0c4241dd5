"""CacheEngine.hot_set and CacheEngine.warm: what a restart records and promotes again."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tierstore.cache.leases import LeaseTable
from tierstore.engine import make_engine
from tierstore.store.catalog import Catalog
from tierstore.tiers.dram import Arena
from tierstore.tiers.nvme.reader import SegmentReader

ROWS, SLOTS = 20_000, 2000


@pytest.fixture
def new_engine(make_table, data_dir):
    """new_engine() -> (a fresh cache-mode engine of SLOTS slots over table t, its rows)."""
    tv, data = make_table("t", rows=ROWS, row_bytes=64)
    with Catalog(data_dir, readonly=True) as cat:
        sums = cat.checksums("t", tv.version)
    made = []

    def make():
        reader = SegmentReader(data_dir, tv, sums)
        arena = Arena(Path("/dev/shm") / f"tierstore-test-warm.{time.monotonic_ns()}", SLOTS, tv.row_bytes)
        made.append((arena, reader))
        return make_engine(tv, reader, arena, leases=LeaseTable(64), full=False), data

    yield make
    for arena, reader in made:
        arena.close(unlink=True)
        reader.close()


def _step(eng, ids):
    res = eng.plan(np.asarray(ids), ttl_s=30.0, client=b"c")
    rows = eng.arena.rows[res.slots].copy()
    eng.leases.release_client(b"c")
    return res, rows


def test_the_hot_set_is_the_resident_rows_hottest_first(new_engine):
    eng, _ = new_engine()
    hot, warm = np.arange(0, 300), np.arange(1000, 1500)
    for _ in range(6):
        _step(eng, hot)
    _step(eng, warm)
    ids, counts = eng.hot_set()
    assert np.array_equal(np.sort(ids), np.concatenate([hot, warm]))
    assert set(ids[:hot.size].tolist()) == set(hot.tolist())  # the rows read six times lead
    assert np.all(np.diff(counts.astype(int)) <= 0)


def test_a_warm_engine_hits_from_its_first_step(new_engine):
    eng, data = new_engine()
    for _ in range(4):
        _step(eng, np.arange(SLOTS))
    ids, counts = eng.hot_set()
    fresh, _ = new_engine()
    assert fresh.warm(ids, counts) == SLOTS
    res, rows = _step(fresh, np.arange(SLOTS))
    assert res.hits == SLOTS and np.array_equal(rows, data[:SLOTS])
    # the recorded counts seed the policy: the rows are known as often read, not as new
    assert np.all(fresh.policy.sketch.estimate(ids) >= counts)


def test_warm_fills_free_slots_only(new_engine):
    eng, data = new_engine()
    served = np.arange(5000, 5000 + SLOTS - 500)
    _step(eng, served)  # rows a step brought in before the warm-up ran
    assert eng.warm(np.arange(SLOTS)) == 500  # the free slots, hottest first
    res, rows = _step(eng, served)
    assert res.hits == served.size and np.array_equal(rows, data[served])
    res, _ = _step(eng, np.arange(500))
    assert res.hits == 500


def test_warm_stops_when_told(new_engine):
    eng, _ = new_engine()
    stop = threading.Event()
    stop.set()
    assert eng.warm(np.arange(SLOTS), stop=stop) == 0
    assert eng.stats()["resident"] == 0
