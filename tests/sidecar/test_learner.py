"""Learner: local reads' notes queued per client and learned in turn, in process over a real
cache-mode engine. The queue's bounds are shrunk where a test fills them; the learner thread is
held up by holding the CPU token (its Notes.learn computes as background work)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from tierstore import cpu_token
from tierstore.errors import InvalidArgument
from tierstore.sidecar import learner as learner_mod
from tierstore.sidecar.learner import NOTE_QUEUE_STEPS, NOTE_TURN_STEPS, Learner
from tierstore.tiers import trust

ROWS, SLOTS = 20_000, 2000


@pytest.fixture
def engine(cache_engines):
    return cache_engines(ROWS, SLOTS)


@pytest.fixture
def learner():
    got = Learner()
    yield got
    got.stop()


def _one_id_steps(n: int, row: int = 7) -> tuple[np.ndarray, np.ndarray]:
    return np.full(n, row, np.int64), np.arange(1, n + 1, dtype=np.int64)


def _until(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "the learner never got there"
        time.sleep(0.001)


def test_a_note_longer_than_the_queue_is_dropped_unchecked_and_counted_over_share(engine, learner):
    eng, _ = engine
    ids, ends = _one_id_steps(NOTE_QUEUE_STEPS + 1)
    ids[-1] = ROWS  # out of range: a note that fits would be refused for it
    assert learner.note(eng, ids, ends, source=b"flood") is False
    s = eng.stats()
    assert (s["notes_dropped"], s["notes_over_share"], s["local_steps"]) == (ends.size, ends.size, 0)
    with pytest.raises(InvalidArgument):
        learner.note(eng, ids[-100:], ends[:100], source=b"flood")


def test_a_client_filling_the_queue_gives_way_to_another_clients_note(engine, learner, monkeypatch):
    """Client a alone fills the queue (its next note is dropped: the learner is behind); client b's
    note then takes the place of a's oldest (a held the most: dropped over its share)."""
    monkeypatch.setattr(learner_mod, "BOUNDS", (256, 1 << 14, 1 << 20))
    eng, data = engine
    a_ids, a_ends = _one_id_steps(64)
    b_ids = np.arange(1000, 1200, dtype=np.int64)
    b_ends = np.arange(20, 201, 20, dtype=np.int64)  # 10 steps of 20 rows
    with cpu_token.hold():  # the learner waits: what is queued stays queued
        sent = 0
        while learner.note(eng, a_ids, a_ends, source=b"a"):
            sent += 1
        assert 4 <= sent <= 5  # 256 steps queued, and maybe one note the learner took before it waited
        assert (eng.counters.notes_behind, eng.counters.notes_over_share) == (64, 0)
        assert learner.note(eng, b_ids, b_ends, source=b"b") is True
        assert (eng.counters.notes_behind, eng.counters.notes_over_share) == (64, 64)
    learned = sent * 64 - 64 + b_ends.size
    _until(lambda: eng.counters.local_steps == learned)
    slots = eng.slots.find(b_ids)
    assert (slots >= 0).all() and np.array_equal(eng.arena.rows[slots], data[b_ids])
    assert eng.stats()["notes_dropped"] == 128


def test_clients_are_learned_in_turn(engine, learner, tmp_path):
    """Client a's long backlog of one-id steps is learned a turn at a time: client b's note,
    sent after all of it, is learned after at most two turns of a's (the one the learner
    took before b's note came, and the one that was next in line), not after the backlog."""
    from tierstore.sidecar.trace_recorder import TraceRecorder

    eng, data = engine
    eng.recorder = TraceRecorder(tmp_path / "trace.npy")  # the steps in the order they are learned
    a_ids, a_ends = _one_id_steps(2048)
    b_ids = np.arange(3000, 3100, dtype=np.int64)
    with cpu_token.hold():
        for _ in range(7):
            assert learner.note(eng, a_ids, a_ends, source=b"a")
        assert learner.note(eng, b_ids, np.array([b_ids.size]), source=b"b")
    _until(lambda: eng.counters.local_steps == 7 * 2048 + 1)
    eng.recorder.close()
    steps = np.load(tmp_path / "trace.t.steps.npy")
    before_b = int(np.argmax(steps == b_ids.size))
    assert steps[before_b] == b_ids.size and steps.size == 7 * 2048 + 1
    assert before_b <= 2 * NOTE_TURN_STEPS, f"b's note waited for {before_b} of a's steps"
    assert np.array_equal(eng.arena.rows[eng.slots.find(b_ids)], data[b_ids])


def test_rows_past_the_budget_are_left_out_of_the_client_holding_the_most(engine, learner, monkeypatch):
    """The carried rows' budget is shared the same way: client a's rows fill it, client b's
    note keeps its rows and a's oldest note goes without (its ids learned, read from disk)."""
    eng, data = engine
    assert eng.reader.carried.form == trust.RECORDS
    carried = lambda i: eng.reader.carried_records(i, data[i])  # noqa: E731  (what a peer of the sidecar's uid carries)
    width = carried(np.arange(1)).shape[1]
    monkeypatch.setattr(learner_mod, "BOUNDS", (1 << 14, 1 << 18, 250 * width))
    a = [np.arange(k * 100, k * 100 + 100, dtype=np.int64) for k in range(3)]
    b_ids = np.arange(5000, 5100, dtype=np.int64)
    with cpu_token.hold():
        for ids in a:  # 100 records each, 250 records' bytes in the budget
            assert learner.note(eng, ids, np.array([ids.size]), ids, carried(ids), trusted=True, source=b"a")
        assert learner.note(eng, b_ids, np.array([b_ids.size]), b_ids, carried(b_ids), trusted=True, source=b"b")
    _until(lambda: eng.counters.local_steps == 4)
    _until(lambda: (eng.slots.find(np.concatenate(a + [b_ids])) >= 0).all())
    _until(lambda: eng.counters.promotions == 400)  # mapped is not filled: the last fill's rows placed
    # a's first note may be the learner's already (its rows no longer in the budget): then a's
    # second goes without, else its first (and its third, which found the budget full); b's rows
    # are placed either way
    assert eng.counters.note_rows_placed in (200, 300), eng.counters.note_rows_placed
    assert eng.stats()["notes_dropped"] == 0  # rows left out, never a note
    for ids in a + [b_ids]:
        assert np.array_equal(eng.arena.rows[eng.slots.find(ids)], data[ids])
