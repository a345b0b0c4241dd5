"""LeaseTable's per-client share of a table's arena, planned through a real cache-mode engine
(real table, arena and reader): a client alone leases all but the reserve; once another
client plans the table, each is bound to its share, and a refusal changes nothing."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tierstore.cache.leases import RESERVE, LeaseTable, arena_for_step, sole_client_slots
from tierstore.engine import make_engine
from tierstore.errors import ResourceExhausted
from tierstore.store.catalog import Catalog
from tierstore.tiers.dram import Arena
from tierstore.tiers.nvme.reader import SegmentReader

ROWS, SLOTS, SHARE = 4000, 800, 0.5
ALONE = SLOTS - SLOTS // RESERVE  # all but the reserve


@pytest.fixture
def engine(make_table, data_dir):
    """engine(contention_s=30, slots=SLOTS) -> a cache-mode engine of `slots` slots over table t, its leases at
    client share SHARE; arenas and readers are closed after the test."""
    tv, _ = make_table("t", rows=ROWS, row_bytes=64)
    with Catalog(data_dir, readonly=True) as cat:
        sums = cat.checksums("t", tv.number)
    made = []

    def make(contention_s: float = 30.0, slots: int = SLOTS):
        cold = SegmentReader(data_dir, tv, sums)
        arena = Arena(Path("/dev/shm") / f"tierstore-test-leases.{time.monotonic_ns()}", slots, tv.row_bytes)
        made.append((arena, cold))
        leases = LeaseTable(64, client_share=SHARE, contention_s=contention_s)
        return make_engine(tv, cold, arena, leases=leases, full=False)

    yield make
    for arena, cold in made:
        arena.close(unlink=True)
        cold.close()


def _plan(eng, client: bytes, n: int, first: int = 0, request_id: int = 0):
    return eng.plan(np.arange(first, first + n, dtype=np.int64), 30.0, client, request_id)


def test_a_client_alone_leases_all_but_the_reserve(engine):
    eng = engine()
    got = _plan(eng, b"a", ALONE)  # over its share: no other client wants this table
    assert got.unique == ALONE and eng.leases.alive(got.lease_id)
    pinned, leases = eng.slots.n_pinned, len(eng.leases)
    with pytest.raises(ResourceExhausted, match=f"to itself may lease {ALONE}, the last {SLOTS // RESERVE} are kept"):
        _plan(eng, b"a", 1, first=ALONE)
    assert (eng.slots.n_pinned, len(eng.leases)) == (pinned, leases)  # the refusal changed nothing
    eng.leases.release_client(b"a")
    with pytest.raises(ResourceExhausted, match="plan smaller steps"):
        _plan(eng, b"a", SLOTS)  # a whole arena in one plan, alone
    assert eng.slots.n_pinned == 0 and len(eng.leases) == 0


@pytest.mark.parametrize("step", [1, 7, 8, 500, 2801])
def test_an_arena_sized_for_a_step_leases_that_step_to_a_client_alone(engine, step):
    """arena_for_step: the arena a user sizes for one client's largest step serves it whole,
    and sole_client_slots is the bound the refusal applies: all of it leased, one slot more refused."""
    eng = engine(slots=arena_for_step(step))
    alone = sole_client_slots(eng.capacity, SHARE)
    assert step <= alone == eng.capacity - eng.capacity // RESERVE
    assert _plan(eng, b"a", step).unique == step
    if alone > step:
        assert _plan(eng, b"a", alone - step, first=step).unique == alone - step
    with pytest.raises(ResourceExhausted, match=f"to itself may lease {alone},"):
        _plan(eng, b"a", 1, first=alone)


def test_another_client_planning_binds_the_first_to_its_share(engine):
    eng = engine()
    greedy = _plan(eng, b"greedy", ALONE, request_id=1)
    honest = _plan(eng, b"honest", 64, first=ROWS - 64)  # served from the reserve
    assert honest.unique == 64
    eng.leases.release([honest.lease_id], b"honest")
    # honest holds nothing now, but wanted the reserve within contention_s: the renewal over the share is refused
    with pytest.raises(ResourceExhausted, match=r"over one client's share \(400: --max-client-share 0.5\)"):
        _plan(eng, b"greedy", ALONE, request_id=1)
    assert eng.leases.alive(greedy.lease_id)  # the refused renewal left the first attempt live
    renewed = _plan(eng, b"greedy", int(SLOTS * SHARE), request_id=1)  # its share is served
    assert not eng.leases.alive(greedy.lease_id) and eng.slots.n_pinned == int(SLOTS * SHARE)
    with pytest.raises(ResourceExhausted, match="over one client's share"):
        _plan(eng, b"greedy", 1, first=ROWS - 1)
    eng.leases.release_client(b"honest")  # its connection closed: greedy is alone again
    again = _plan(eng, b"greedy", ALONE, request_id=1)
    assert not eng.leases.alive(renewed.lease_id) and eng.slots.n_pinned == ALONE
    eng.leases.release([again.lease_id], b"greedy")


def test_a_step_into_the_reserve_contends_the_table_for_contention_s(engine):
    eng = engine(contention_s=0.3)
    _plan(eng, b"a", ALONE - 64)
    _plan(eng, b"b", 32, first=ROWS - 32)  # under the reserve line: the table stays a's alone
    eng.leases.release_client(b"b")
    assert _plan(eng, b"a", 32, first=ALONE - 64).unique == 32
    eng.leases.release([_plan(eng, b"b", 100, first=ROWS - 100).lease_id], b"b")  # into the reserve
    with pytest.raises(ResourceExhausted, match="while another client leases this table or wants its reserve"):
        _plan(eng, b"a", 32, first=ALONE - 32)
    time.sleep(0.4)  # b's step no longer counts
    assert _plan(eng, b"a", 32, first=ALONE - 32).unique == 32


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from([b"a", b"b", b"c"]), st.integers(1, SLOTS), st.booleans()),
                min_size=1, max_size=12))
def test_no_client_holds_more_than_all_but_the_reserve_and_a_refusal_changes_nothing(engine, steps):
    """Clients plan steps of any size (other rows each), some released at once: a client's
    leases never hold more than all but the reserve, nor more than its share while another
    holds leases; a refused plan leaves the pins and leases as they were."""
    eng = engine()
    share = int(SLOTS * SHARE)
    held = {b"a": 0, b"b": 0, b"c": 0}  # slots of each client's live leases
    for k, (client, n, release) in enumerate(steps):
        before = (eng.slots.n_pinned, len(eng.leases))
        others = any(v for c, v in held.items() if c != client)
        try:
            got = _plan(eng, client, n, first=(k * SLOTS) % (ROWS - SLOTS))
        except ResourceExhausted:
            assert (eng.slots.n_pinned, len(eng.leases)) == before
            continue
        assert held[client] + got.unique <= (share if others else ALONE)
        if release:
            eng.leases.release([got.lease_id], client)
        else:
            held[client] += got.unique
    for c in (b"a", b"b", b"c"):
        eng.leases.release_client(c)
    assert eng.slots.n_pinned == 0
