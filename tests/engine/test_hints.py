"""Hints.prefetch: the scheduler's call at admission hints the policy (expect)
and, when asked, reads the missing rows in ahead."""
from __future__ import annotations


import numpy as np
import pytest


ROWS, SLOTS = 20_000, 2000


@pytest.fixture
def engine(cache_engines):
    return cache_engines(ROWS, SLOTS)


def test_rows_a_queued_request_reads_outlive_others(engine, step):
    eng, data = engine
    step(eng, np.arange(SLOTS))  # fill the arena
    assert eng.hints.prefetch(np.arange(300), read=False) == 0  # a hint: nothing read
    for lo in range(5000, 6700, 340):  # other traffic evicts 1,700 rows
        step(eng, np.arange(lo, lo + 340))
    held = eng.slots.find(np.arange(600)) >= 0
    # the queued request's rows stayed (without the hint: none), the others left (bar a few
    # of the traffic's rows the sketch took for seen before, sent to main and kept longer)
    assert held[:300].all() and np.count_nonzero(held[300:]) <= 15
    res, rows = step(eng, np.arange(600))
    assert res.hits == np.count_nonzero(held) and np.array_equal(rows, data[:600])


def test_prefetch_reads_missing_rows_ahead(engine, step):
    eng, data = engine
    assert eng.hints.prefetch(np.arange(100, 200)) == 100
    res, rows = step(eng, np.arange(100, 200))
    assert res.hits == 100 and np.array_equal(rows, data[100:200])


def test_a_prefetch_fills_free_slots_past_what_it_protects(engine, step):
    """Reading ahead is capped at what the policy can protect (half the arena) only where it
    would evict: into an empty arena every missing row of the request is read."""
    eng, data = engine
    ids = np.arange(7000, 7000 + int(0.8 * SLOTS))
    assert eng.hints.prefetch(ids) == ids.size and eng.counters.evictions == 0
    res, rows = step(eng, ids)
    assert res.hits == ids.size and np.array_equal(rows, data[ids])
    more = np.arange(12000, 12000 + SLOTS)  # a full arena: the cap holds, no more than half is read
    assert eng.hints.prefetch(more) <= SLOTS // 2
