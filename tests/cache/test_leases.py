"""LeaseTable's per-client share of a table's arena, planned through a real cache-mode engine
(real table, arena and reader): a client alone leases all but the reserve; once another
client plans the table, each is bound to its share, and a refusal changes nothing."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from tierstore.cache.leases import INDEX_MASK, RESERVE, LeaseTable, arena_for_step, sole_client_slots
from tierstore.engine import make_engine
from tierstore.errors import BrokenInvariant, ResourceExhausted
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


# ---- check(): a state machine of clients planning, releasing, closing and timing out over two
# real engines sharing one lease table, and each invariant broken by hand ----
M_ROWS, M_SLOTS, M_TTLS = 400, 32, (1.0, 4.0)
CLIENTS = (b"a", b"b", b"c")
# deterministic (a seed from the test's name, no example database), short, no deadline on a loaded host
MACHINE = settings(max_examples=30, stateful_step_count=25, deadline=None, derandomize=True, database=None)


@pytest.fixture(scope="module")
def small_table(tmp_path_factory):
    """(data dir, version, row sums) of table t: M_ROWS rows of 64 B, written once for the module."""
    from tierstore.ingest.writer import write_version

    d = tmp_path_factory.mktemp("data")
    data = np.random.default_rng(5).integers(0, 256, size=(M_ROWS, 64), dtype=np.uint8)
    tv = write_version(d, "t", [data], rows=M_ROWS, row_format="fp32", row_dim=16)
    with Catalog(d, readonly=True) as cat:
        return d, tv, cat.checksums("t", tv.number)


class Leased:
    """A lease table on a clock of its own (with its board) and `n` cache-mode engines of M_SLOTS
    slots over small_table that it leases for; close() ends it all."""

    def __init__(self, table, n: int = 2, **lease_kw):
        d, tv, sums = table
        self.now = 0.0
        self.board = Path("/dev/shm") / f"tierstore-test-board.{time.monotonic_ns()}"
        kw = dict(max_per_client=6, client_share=SHARE, contention_s=5.0) | lease_kw
        self.leases = LeaseTable(12, board_path=self.board, clock=lambda: self.now, **kw)
        self.engines, self._made = [], []
        for _ in range(n):
            cold = SegmentReader(d, tv, sums)
            arena = Arena(Path("/dev/shm") / f"tierstore-test-leases.{time.monotonic_ns()}", M_SLOTS, tv.row_bytes)
            self._made.append((arena, cold))
            self.engines.append(make_engine(tv, cold, arena, leases=self.leases, full=False))

    def pins(self) -> dict:
        return {eng: eng.slots.pins for eng in self.engines}

    def close(self) -> None:
        for c in CLIENTS:
            self.leases.release_client(c)
        for eng, (arena, cold) in zip(self.engines, self._made):
            eng.close()
            arena.close(unlink=True)
            cold.close()
        self.leases.close()


class LeaseMachine(RuleBasedStateMachine):
    """Three clients plan steps (some retried under a request id), release their own leases and
    others', close their connections, and let leases run past their TTL on the table's clock,
    over two engines. After each rule: check() (pins included) and each engine's slot table
    check() hold, and the live leases are the model's, each row it holds still resident and
    READY, pinned exactly once for each lease that holds it; a refused plan changed nothing."""

    table = None  # small_table, set by the test

    def __init__(self):
        super().__init__()
        self.w = Leased(self.table)
        self.live: dict[int, tuple] = {}  # lease id -> (engine, client, ids, slots, deadline, request id)

    def teardown(self):
        self.w.close()

    @rule(e=st.integers(0, 1), client=st.sampled_from(CLIENTS), request_id=st.integers(0, 2),
          ids=st.lists(st.integers(0, M_ROWS // 2 - 1), min_size=1, max_size=20, unique=True),
          ttl=st.sampled_from(M_TTLS))
    def plan(self, e, client, request_id, ids, ttl):
        eng, ids = self.w.engines[e], np.array(ids, np.int64)
        before = {k: v.copy() for k, v in self.w.pins().items()}, len(self.w.leases)
        try:
            got = eng.plan(ids, ttl, client, request_id)
        except ResourceExhausted:
            assert all(np.array_equal(before[0][k], v) for k, v in self.w.pins().items()), "a refusal pinned"
            assert len(self.w.leases) == before[1], "a refusal changed the leases"
            return
        if request_id:  # a retried Plan ends the first attempt's lease
            for lid, (eng_, client_, *_, rid) in list(self.live.items()):
                if client_ == client and rid == request_id:
                    assert not self.w.leases.alive(lid)
                    del self.live[lid]
        self.live[got.lease_id] = (eng, client, ids, got.slots, self.w.now + ttl, request_id)

    @rule(client=st.sampled_from(CLIENTS), data=st.data())
    def release(self, client, data):
        """Release some live leases, anyone's, and an id nobody holds: only the client's own end."""
        pick = data.draw(st.lists(st.sampled_from(sorted(self.live)), unique=True)) if self.live else []
        mine = [lid for lid in pick if self.live[lid][1] == client]
        assert self.w.leases.release(pick + [12345], client) == len(mine)
        for lid in mine:
            del self.live[lid]

    @rule(client=st.sampled_from(CLIENTS))
    def close_client(self, client):
        gone = [lid for lid, lease in self.live.items() if lease[1] == client]
        assert self.w.leases.release_client(client) == len(gone)
        for lid in gone:
            del self.live[lid]

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 3.0]))
    def time_passes(self, dt):
        """The clock moves on and the reaper runs: exactly the leases past their deadline end."""
        self.w.now += dt
        gone = [lid for lid, lease in self.live.items() if lease[4] <= self.w.now]
        assert self.w.leases.reap() == len(gone)
        for lid in gone:
            del self.live[lid]

    @invariant()
    def checked_and_as_modelled(self):
        self.w.leases.check(self.w.pins())
        assert len(self.w.leases) == len(self.live)
        for eng in self.w.engines:
            eng.slots.check()
            want = np.zeros(M_SLOTS, np.int64)
            for lid, (eng_, client, ids, slots, *_) in self.live.items():
                if eng_ is eng:
                    assert self.w.leases.alive(lid)
                    assert np.array_equal(eng.slots.id_of[slots], ids) and eng.slots.is_ready(slots).all(), \
                        "a leased slot no longer holds its READY row"
                    want[np.unique(slots)] += 1
            assert eng.slots.pins.tolist() == want.tolist(), "pins are not one per live lease"
            assert self.w.leases.count_for(eng) == sum(lease[0] is eng for lease in self.live.values())


def test_the_lease_table_keeps_its_invariants_through_clients_plans_releases_and_ttls(small_table):
    LeaseMachine.table = small_table
    run_state_machine_as_test(LeaseMachine, settings=MACHINE)


def _lease_a_few(w):
    """Leases of clients a (two: one under request id 1) and b, on the first engine."""
    eng = w.engines[0]
    a1 = eng.plan(np.arange(0, 6), 1.0, b"a", 1)
    a2 = eng.plan(np.arange(4, 10), 2.0, b"a")
    b1 = eng.plan(np.arange(20, 24), 3.0, b"b")
    w.leases.check(w.pins())
    return eng, w.leases._leases[a1.lease_id], w.leases._leases[a2.lease_id], w.leases._leases[b1.lease_id]


def _too_many(lt, eng, a1, a2, b1):
    lt.max_leases = 2
    return "at most max_leases leases are live", "3 leases"


def _filed_under_another_id(lt, eng, a1, a2, b1):
    lt._leases[a1.lease_id], lt._leases[a2.lease_id] = a2, a1
    return "a lease is filed under its own id", f"lease {a2.lease_id:#x}"


def _no_random_bits(lt, eng, a1, a2, b1):
    del lt._leases[b1.lease_id]
    b1.lease_id &= INDEX_MASK
    lt._leases[b1.lease_id] = b1
    return "a lease id is random bits above a board index", f"lease {b1.lease_id:#x}"


def _index_live_and_free(lt, eng, a1, a2, b1):
    lt._free_index.append(a2.lease_id & INDEX_MASK)
    return "each board index is held by one live lease or free, once", f"index {a2.lease_id & INDEX_MASK}"


def _board_cleared_early(lt, eng, a1, a2, b1):
    lt.board.ids[b1.lease_id & INDEX_MASK] = 0
    return "the board shows each live lease id at its index, 0 elsewhere", f"index {b1.lease_id & INDEX_MASK}"


def _client_miscounted(lt, eng, a1, a2, b1):
    lt._per_client[b"b"] = 2
    return "each client's lease count is its live leases", "client b'b'"


def _client_over_its_leases(lt, eng, a1, a2, b1):
    lt.max_per_client = 1
    return "a client holds at most max_per_client leases", "client b'a'"


def _table_slots_miscounted(lt, eng, a1, a2, b1):
    lt._table_slots[eng][b"a"] += 1
    return "each table's per-client slot entries are its live leases'", "table 't', client b'a'"


def _over_max_slots(lt, eng, a1, a2, b1):
    lt.max_slots = 15
    return "the slots held are the live leases' and at most max_slots", "16 slots held"


def _request_id_of_another_client(lt, eng, a1, a2, b1):
    lt._by_request[(b"b", 1)] = b1.lease_id
    return "a retried Plan's request id names its client's live lease", "client b'b', request 1"


def _heap_upside_down(lt, eng, a1, a2, b1):
    lt._expiry.reverse()
    return "the expiry heap is a heap", "entry 1"


def _deadline_moved(lt, eng, a1, a2, b1):
    b1.expires = 99.0
    return "every live lease waits on the expiry heap at its deadline", f"lease {b1.lease_id:#x}"


def _slot_past_capacity(lt, eng, a1, a2, b1):
    a2.slots[0] = M_SLOTS
    return "a lease's slots are below its arena's capacity", f"lease {a2.lease_id:#x}"


def _slot_twice(lt, eng, a1, a2, b1):
    b1.slots[1] = b1.slots[0]
    return "a lease's slots are unique", f"lease {b1.lease_id:#x}"


def _lease_on_a_slot_not_pinned(lt, eng, a1, a2, b1):
    eng.slots.unpin(b1.slots[:1])  # the engine dropped a pin the lease still counts on
    return "each slot a lease holds is pinned once for every live lease holding it", f"slot {b1.slots[0]} of table 't'"


@pytest.mark.parametrize("corrupt", [_too_many, _filed_under_another_id, _no_random_bits, _index_live_and_free,
                                     _board_cleared_early, _client_miscounted, _client_over_its_leases,
                                     _table_slots_miscounted, _over_max_slots, _request_id_of_another_client,
                                     _heap_upside_down, _deadline_moved, _slot_past_capacity, _slot_twice,
                                     _lease_on_a_slot_not_pinned], ids=lambda f: f.__name__.strip("_"))
def test_check_names_each_broken_invariant_and_where(small_table, corrupt):
    w = Leased(small_table, n=1)
    try:
        eng, *leases = _lease_a_few(w)
        invariant, at = corrupt(w.leases, eng, *leases)
        with pytest.raises(BrokenInvariant) as e:
            w.leases.check(w.pins())
        assert (e.value.structure, e.value.invariant, e.value.at) == ("lease table", invariant, at)
    finally:
        w.leases._leases.clear()  # the corrupt table is dropped, not released
        w.close()


def test_a_fake_clock_moves_deadlines_and_contention_and_reap_follows_it(small_table):
    """The table's clock, not the host's: a lease lives until its TTL on that clock."""
    w = Leased(small_table, n=1)
    try:
        lease = w.engines[0].plan(np.arange(3), 2.0, b"a")
        w.now = 1.9
        assert w.leases.reap() == 0 and w.leases.alive(lease.lease_id)
        w.now = 2.0
        assert w.leases.reap() == 1 and not w.leases.alive(lease.lease_id)
        assert w.engines[0].slots.n_pinned == 0
        w.leases.check(w.pins())
    finally:
        w.close()
