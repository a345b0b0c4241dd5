"""HotSet.record and HotSet.warm: what a restart records and promotes again."""
from __future__ import annotations

import threading

import numpy as np
import pytest


ROWS, SLOTS = 20_000, 2000


@pytest.fixture
def new_engine(cache_engines):
    """new_engine() -> (a fresh cache-mode engine of SLOTS slots over table t, its rows)."""
    return lambda: cache_engines(ROWS, SLOTS)


def test_the_hot_set_is_the_resident_rows_hottest_first(new_engine, step):
    eng, _ = new_engine()
    hot, warm = np.arange(0, 300), np.arange(1000, 1500)
    for _ in range(6):
        step(eng, hot)
    step(eng, warm)
    ids, counts = eng.hot_set.record()
    assert np.array_equal(np.sort(ids), np.concatenate([hot, warm]))
    # the rows read six times lead (bar the few warm ones whose sketch counters they share)
    assert len(set(ids[:hot.size].tolist()) & set(hot.tolist())) >= 0.97 * hot.size
    assert np.all(np.diff(counts.astype(int)) <= 0)


def test_a_warm_engine_hits_from_its_first_step(new_engine, step):
    eng, data = new_engine()
    for _ in range(4):
        step(eng, np.arange(SLOTS))
    ids, counts = eng.hot_set.record()
    fresh, _ = new_engine()
    assert fresh.hot_set.warm(ids, counts) == SLOTS
    res, rows = step(fresh, np.arange(SLOTS))
    assert res.hits == SLOTS and np.array_equal(rows, data[:SLOTS])
    # the recorded counts seed the policy: the rows are known as often read, not as new
    assert np.all(fresh.policy.sketch.estimate(ids) >= counts)


def test_warm_fills_free_slots_only(new_engine, step):
    eng, data = new_engine()
    served = np.arange(5000, 5000 + SLOTS - 500)
    step(eng, served)  # rows a step brought in before the warm-up ran
    assert eng.hot_set.warm(np.arange(SLOTS)) == 500  # the free slots, hottest first
    res, rows = step(eng, served)
    assert res.hits == served.size and np.array_equal(rows, data[served])
    res, _ = step(eng, np.arange(500))
    assert res.hits == 500


def test_warm_stops_when_told(new_engine):
    eng, _ = new_engine()
    stop = threading.Event()
    stop.set()
    assert eng.hot_set.warm(np.arange(SLOTS), stop=stop) == 0
    assert eng.stats()["resident"] == 0
