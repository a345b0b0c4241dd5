"""Verifier.sample: the share of served rows handed to the verification thread."""
from __future__ import annotations

import numpy as np

from tierstore.engine.verifier import Verifier


def _sampled(v: Verifier) -> tuple[int, list]:
    n, got = 0, []
    while not v._queue.empty():
        _, ids, slots = v._queue.get_nowait()
        n += ids.size
        got.append((ids, slots))
    return n, got


def test_sample_hands_over_about_the_fraction_of_rows_as_matching_pairs():
    v = Verifier(0.01, max_queue=100000)
    ids = np.arange(256, dtype=np.int64)
    for _ in range(400):  # 102400 rows: ~1024 expected
        v.sample("engine", ids, ids + 1000)
    n, got = _sampled(v)
    assert 850 < n < 1200
    for ids_, slots in got:
        assert np.array_equal(slots, ids_ + 1000)  # each id travels with its own slot


def test_sample_of_one_takes_every_plan_and_of_zero_none():
    v = Verifier(1.0, max_queue=1000)
    ids = np.arange(7, dtype=np.int64)
    for _ in range(5):
        v.sample("engine", ids, ids)
    assert _sampled(v)[0] == 35
    off = Verifier(0.0)
    off.sample("engine", ids, ids)
    assert off._queue.empty()
