"""Notes, in process: a cache-mode engine learning the steps clients on the host read
themselves, a chunk at a time, promoting their misses (from the rows a note carries, each
verified) past the doorkeeper."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tierstore.engine import notes
from tierstore.errors import InvalidArgument
from tierstore.tiers import trust

ROWS = 20_000


@pytest.fixture
def engine(cache_engines):
    return cache_engines(ROWS, 2000)


def _plan(eng, ids, client=b"c"):
    res = eng.plan(np.asarray(ids), ttl_s=30.0, conn_id=client)
    return res, eng.arena.rows[res.slots].copy()


def test_plans_do_not_wait_for_a_long_note_of_one_id_steps(engine):
    """A note costs the policy's work per step, even of one id: it is learned a chunk of
    NOTE_CHUNK_STEPS steps at a time, so a plan computes between two chunks, never after the
    whole note."""
    eng, data = engine
    _plan(eng, np.arange(0, 300), b"warm")
    n = 1 << 16
    note = threading.Thread(target=eng.notes.access, args=(np.full(n, 7, np.int64), np.arange(1, n + 1)),
                            kwargs=dict(source=b"flood"))
    note.start()
    while eng.counters.local_steps == 0:
        time.sleep(0.001)
    res, rows = _plan(eng, np.arange(0, 300), b"fast")
    learned, learning = eng.counters.local_steps, note.is_alive()
    note.join()
    assert np.array_equal(rows, data[:300]) and res.hits == 300
    assert learning and learned < n, f"the plan waited for {learned} of the note's {n} steps"
    assert eng.counters.local_steps == n


def test_access_notes_fill_free_slots_at_once_and_the_doorkeeper_guards_evictions(engine, monkeypatch):
    """Local reads' notes (Notes.access): every step counted, a few steps per hold of the
    lock; while the arena has free slots every miss is promoted at first sight (a free
    slot beats a disk read); once a row must be evicted for it, only a miss seen before
    is (the doorkeeper, read_admit_freq), so one-hit wonders never displace resident rows."""
    monkeypatch.setattr(notes, "NOTE_CHUNK_IDS", 100)  # many lock holds for one note
    eng, data = engine
    eng.policy.config.read_admit_freq = 2  # the doorkeeper on (the default, 1, promotes every miss)
    rng = np.random.default_rng(5)
    order = rng.permutation(ROWS)
    ids = order[:720]  # 12 steps of 60 rows, none seen before
    ends = np.arange(60, 721, 60)
    assert eng.notes.access(ids, ends) == ids.size  # an empty arena takes every one
    c = eng.counters
    assert (c.local_steps, c.hits + c.misses, c.plans, c.evictions) == (12, ids.size, 0, 0)
    slots = eng.slots.find(ids)
    assert (slots >= 0).all() and np.array_equal(eng.arena.rows[slots], data[ids])
    assert not (eng.slots.gen[slots] & 1).any() and eng.slots.n_pinned == 0
    more = order[720:2300]  # more distinct rows than the 1,280 free slots left: those fill up, none evicts
    assert eng.notes.access(more, np.array([more.size])) == eng.capacity - ids.size
    assert (eng.slots.resident, c.evictions) == (eng.capacity, 0)
    fresh = order[2300:2400]  # a full arena: first sight evicts only for sketch collisions (2,400 ids
    first = eng.notes.access(fresh, np.array([fresh.size]))  # seen by 2 x 4 counters a slot: a few in 100)
    assert first == c.evictions == int(np.count_nonzero(eng.policy.sketch.estimate(fresh) >= 2)) <= 15
    assert eng.notes.access(fresh, np.array([fresh.size])) == fresh.size - first  # seen twice: worth a victim
    assert c.evictions == fresh.size and np.array_equal(eng.arena.rows[eng.slots.find(fresh)], data[fresh])
    with pytest.raises(InvalidArgument):
        eng.notes.access(ids, ends - 1)  # ends that do not cover the ids
    assert eng.counters.local_steps == 15


def test_rows_a_note_carries_are_placed_verified_without_a_disk_read(engine):
    """A note's rows (what the client read for its misses; format 2: their records, each
    row with its sum) are promoted from those bytes: bit-exact, no disk read; a note whose
    rows do not match their row sums is refused row for row and those rows are read from
    disk: the arena never holds the bad bytes."""
    eng, data = engine
    carried = lambda i: eng.reader.carried_records(i, data[i])  # noqa: E731
    assert eng.reader.carried.form == trust.RECORDS
    ids = np.arange(100, 400)
    disk = eng.reader.bytes_read
    assert eng.notes.access(ids, np.array([ids.size]), ids[::-1].copy(), carried(ids[::-1])) == ids.size
    assert eng.reader.bytes_read == disk, "rows the note carried were read from disk again"
    assert np.array_equal(eng.arena.rows[eng.slots.find(ids)], data[ids])
    assert (eng.counters.note_rows_placed, eng.counters.note_rows_refused) == (ids.size, 0)
    bad_ids = np.arange(1000, 1050)
    rows = carried(bad_ids)
    rows[7, 3] ^= 0x10  # one flipped bit in row 1007
    assert eng.notes.access(bad_ids, np.array([bad_ids.size]), bad_ids, rows) == bad_ids.size
    assert eng.counters.note_rows_refused == bad_ids.size and eng.reader.bytes_read > disk
    assert np.array_equal(eng.arena.rows[eng.slots.find(bad_ids)], data[bad_ids])
    part = np.arange(2000, 2100)  # rows for half the misses: the other half read from disk
    assert eng.notes.access(part, np.array([part.size]), part[:50], carried(part[:50])) == part.size
    assert np.array_equal(eng.arena.rows[eng.slots.find(part)], data[part])
    assert eng.counters.note_rows_placed == ids.size + 50
    with pytest.raises(InvalidArgument, match="uint8"):
        eng.notes.access(part, np.array([part.size]), part, data[part][:, :32])  # rows of the wrong width
