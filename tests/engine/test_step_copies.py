"""The TP ranks of one engine each read every step: the cache learns a step once, whoever
sends it, so a hint lasts the engine steps it was given and a row read by a whole step
counts one access."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.cache import step_copies
from tierstore.jit import mix64

ROWS, SLOTS = 20_000, 2000
HINTED = np.arange(0, 200)


def _fresh_steps(n: int, size: int = 1000) -> list[np.ndarray]:
    """n steps of rows read by nothing else (sorted, as a client dedupes a step)."""
    order = np.random.default_rng(7).permutation(np.arange(HINTED.size, ROWS))
    return [np.sort(order[i * size:(i + 1) * size]) for i in range(n)]


@pytest.mark.parametrize("path", ["noted", "planned"])
def test_a_hint_lasts_its_steps_when_every_tp_rank_reads_each_step(cache_engines, path):
    """A queued request's rows read in and hinted for 20 steps outlast 15 steps of fresh rows
    (more than the arena holds) that two ranks each read, locally (noted) or by plan; a step
    counted once per rank would have ended the hint after 10 of them."""
    eng, data = cache_engines(ROWS, SLOTS)
    eng.hints.prefetch(HINTED, read=True, steps=20)
    for ids in _fresh_steps(15):
        for rank in (b"rank0", b"rank1"):
            if path == "noted":
                eng.notes.access(ids, np.array([ids.size]), source=rank)
            else:
                eng.plan(ids, ttl_s=30.0, conn_id=rank)
                eng.leases.release_client(rank)
    slots = eng.slots.find(HINTED)
    assert (slots >= 0).all(), f"{np.count_nonzero(slots < 0)} of the hinted rows were evicted before their request"
    assert np.array_equal(eng.arena.rows[slots], data[HINTED])
    counted = eng.counters.local_steps if path == "noted" else eng.counters.plans
    assert counted == 30 and eng.counters.steps_copied == 15  # both ranks' steps served, one rank's copies told


def test_a_step_counts_one_access_per_engine_step_and_a_clients_own_repeat_counts_again(cache_engines):
    eng, _ = cache_engines(ROWS, SLOTS)
    ids = _fresh_steps(1, 300)[0]
    for rank, order in ((b"rank0", ids), (b"rank1", ids[::-1].copy()), (b"rank2", np.roll(ids, 7))):
        eng.notes.access(order, np.array([ids.size]), source=rank)  # three ranks, each its own order
    assert (eng.policy.sketch.estimate(ids) == 1).mean() > 0.95  # a few share a counter with another id
    eng.notes.access(ids, np.array([ids.size]), source=b"rank0")  # rank 0 reads them again: a second access
    assert (eng.policy.sketch.estimate(ids) == 2).mean() > 0.95


def test_a_copy_trailing_by_more_than_the_window_is_learned(cache_engines, monkeypatch):
    """Copies are looked for among the last WINDOW steps learned: one that trails further is
    taken for a step of its own (the policy then counts it twice, as before copies were
    told apart), never refused."""
    monkeypatch.setattr(step_copies, "WINDOW", 4)
    eng, _ = cache_engines(ROWS, SLOTS)
    steps = _fresh_steps(6, 100)
    for ids in steps:
        eng.notes.access(ids, np.array([ids.size]), source=b"rank0")
    eng.notes.access(steps[0], np.array([steps[0].size]), source=b"rank1")  # 6 steps late
    eng.notes.access(steps[-1], np.array([steps[-1].size]), source=b"rank1")  # in the window: a copy
    assert (eng.policy.sketch.estimate(steps[0]) >= 2).mean() > 0.95
    assert (eng.policy.sketch.estimate(steps[-1]) == 1).mean() > 0.95


@settings(max_examples=50, deadline=None)
@given(ids=st.lists(st.integers(0, 2**40), max_size=300, unique=True), seed=st.integers(0, 2**16))
def test_a_steps_digest_is_the_same_in_any_order_and_compiled_or_not(ids, seed):
    """step_digest's compiled pass gives the vectorised one's digest, for the ids in any order."""
    ids = np.asarray(ids, dtype=np.int64)
    h = mix64(ids.astype(np.uint64) * step_copies.GAMMA)
    want = (ids.size, int(h.sum(dtype=np.uint64)), int(np.bitwise_xor.reduce(h)) if h.size else 0)
    assert step_copies.step_digest(ids) == want
    assert step_copies.step_digest(np.random.default_rng(seed).permutation(ids)) == want
