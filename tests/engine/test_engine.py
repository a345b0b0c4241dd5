"""TableEngine in cache mode, in process: promotion off the lock, failures that give
every slot back, and steps that share rows being filled."""
from __future__ import annotations

import errno
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierstore import cpu_token
from tierstore.errors import ResourceExhausted
from tierstore.tiers.nvme.reader import SegmentReader

ROWS = 20_000


class FaultyReader(SegmentReader):
    """The real cold tier, with an I/O error (EIO) or a slow device injected on demand, where
    the read pipeline waits for a part's reads (its finish stage)."""

    fail_next = 0
    delay_s = 0.0

    def finish(self, part):
        if self.delay_s:
            with cpu_token.waiting():  # a device read, as the real reader waits on one
                time.sleep(self.delay_s)
        if self.fail_next:
            self.fail_next -= 1
            raise OSError(errno.EIO, "Input/output error")
        return super().finish(part)


@pytest.fixture
def engine(cache_engines):
    return cache_engines(ROWS, 2000, FaultyReader)


def _plan(eng, ids, client=b"c"):
    res = eng.plan(np.asarray(ids), ttl_s=30.0, conn_id=client)
    return res, eng.arena.rows[res.slots].copy()


def test_an_io_error_while_promoting_gives_every_slot_back(engine):
    eng, data = engine
    _plan(eng, np.arange(0, 1500))  # some residents, so the failed step also pins hits
    eng.leases.release_client(b"c")
    before = (eng.slots.n_free, eng.slots.resident)
    eng.reader.fail_next = 1
    with pytest.raises(OSError):
        eng.plan(np.arange(1000, 2500), ttl_s=30.0)
    assert eng.slots.n_pinned == 0 and len(eng.leases) == 0, "the failed step left pins or a lease"
    eng.slots.check()  # every slot the failed fill claimed is back on the free stack: none lost
    assert eng.slots.n_free >= before[0]  # the reserved slots came back
    res, rows = _plan(eng, np.arange(1000, 2500))
    assert np.array_equal(rows, data[1000:2500])


def test_a_prefetch_whose_read_fails_reads_nothing_raises_nothing_and_gives_its_slots_back(engine, step):
    eng, data = engine
    eng.reader.fail_next = 1  # EIO
    assert eng.hints.prefetch(np.arange(300, 400)) == 0
    assert eng.slots.n_pinned == 0 and eng.slots.resident == 0
    eng.slots.check()
    res, rows = step(eng, np.arange(300, 400))  # the step reads them itself
    assert res.misses == 100 and np.array_equal(rows, data[300:400])


@pytest.mark.parametrize("fails", ["admitted", "victims"])
def test_a_reserve_that_fails_part_way_gives_back_every_pin_and_slot_it_took(engine, monkeypatch, fails):
    """Whatever fails inside a reservation (here the policy, made to raise where it admits the
    misses or picks victims), its hits' pins and its misses' slots come back: nothing pinned,
    no slot lost off the free stack, and the same step plans afterwards."""
    eng, data = engine
    _plan(eng, np.arange(eng.capacity))  # a full arena: the next misses need victims
    eng.leases.release_client(b"c")
    ids = np.arange(eng.capacity - 100, eng.capacity + 200)  # 100 hits, 200 misses

    def broken(*a, **k):
        raise MemoryError("injected")
    monkeypatch.setattr(eng.policy, fails, broken)
    with pytest.raises(MemoryError):
        eng.plan(ids, ttl_s=30.0, conn_id=b"c")
    assert eng.slots.n_pinned == 0 and len(eng.leases) == 0, "the failed reserve left pins or a lease"
    eng.slots.check()
    monkeypatch.undo()
    res, rows = _plan(eng, ids)
    assert np.array_equal(rows, data[ids])


def test_a_step_waits_for_the_fill_of_a_row_it_shares_and_reads_it_whole(engine):
    eng, data = engine
    eng.reader.delay_s = 0.3
    out = {}

    def first():
        out["a"] = _plan(eng, np.arange(100, 600), b"a")

    t = threading.Thread(target=first)
    t.start()
    time.sleep(0.1)  # a is reading rows 100..599 now, outside the lock
    eng.reader.delay_s = 0.0
    t0 = time.monotonic()
    res, rows = _plan(eng, np.arange(500, 700), b"b")  # shares 500..599 with a's fill
    t.join()
    assert np.array_equal(rows, data[500:700]) and np.array_equal(out["a"][1], data[100:600])
    assert eng.counters.fill_waits >= 1
    assert time.monotonic() - t0 < 5


def test_plans_do_not_wait_behind_another_steps_disk_reads(engine):
    eng, data = engine
    _plan(eng, np.arange(0, 300), b"warm")
    eng.reader.delay_s = 1.0
    t = threading.Thread(target=lambda: _plan(eng, np.arange(5000, 5500), b"slow"))
    t.start()
    time.sleep(0.1)
    eng.reader.delay_s = 0.0
    t0 = time.monotonic()
    res, rows = _plan(eng, np.arange(0, 300), b"fast")  # all resident: no read of its own
    took = time.monotonic() - t0
    t.join()
    assert np.array_equal(rows, data[:300])
    assert took < 0.5, f"a plan of resident rows waited {took:.2f}s behind another step's reads"


def test_a_refused_lease_changes_nothing(engine):
    eng, _ = engine
    eng.leases.max_per_client = 1
    _plan(eng, np.arange(10))
    state = (eng.slots.n_free, eng.slots.resident, eng.slots.n_pinned)
    with pytest.raises(ResourceExhausted, match="per client"):
        eng.plan(np.arange(3000, 3100), ttl_s=30.0, conn_id=b"c")
    assert (eng.slots.n_free, eng.slots.resident, eng.slots.n_pinned) == state


def test_a_refused_retry_keeps_the_first_attempts_lease_and_leaks_no_pin(engine):
    """A retried Plan (same request id) refused by the slot budget leaves the table as it
    was, so a client retrying after a refusal neither loses its lease nor leaks a pin: the
    first attempt's lease stays live (its client releases it), and once every client has
    released nothing is pinned, so the whole arena plans again."""
    eng, data = engine
    eng.leases.max_slots = 1000
    first = eng.plan(np.arange(600), ttl_s=30.0, conn_id=b"a", request_id=777)
    eng.plan(np.arange(5000, 5300), ttl_s=30.0, conn_id=b"b")  # another client holds part of the budget
    before = (len(eng.leases), eng.slots.pins.copy(), eng.slots.n_pinned)
    with pytest.raises(ResourceExhausted, match="limit 1000"):
        eng.plan(np.arange(800), ttl_s=30.0, conn_id=b"a", request_id=777)  # 300 + 800 > 1000
    assert len(eng.leases) == before[0] and eng.leases.alive(first.lease_id)
    assert np.array_equal(eng.slots.pins, before[1]) and eng.slots.n_pinned == before[2]
    eng.leases.release_client(b"a")
    eng.leases.release_client(b"b")
    assert eng.slots.n_pinned == 0, "a refused retry left pins no lease holds"
    eng.leases.max_slots = 1 << 26
    res, rows = _plan(eng, np.arange(10_000, 10_000 + eng.capacity))  # every slot is evictable again
    assert np.array_equal(rows, data[10_000:10_000 + eng.capacity])


# mostly plans, mostly retries (request ids 1 and 2; 0 is none), of sizes that overrun the budget
_OPS = st.lists(st.tuples(st.sampled_from(["plan"] * 4 + ["release", "reap"]), st.sampled_from([b"a", b"b"]),
                          st.sampled_from([0, 1, 1, 2]), st.sampled_from([100, 400, 700]),
                          st.integers(0, ROWS - 1)), max_size=25)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_every_pin_belongs_to_a_live_lease_whatever_is_refused(engine, ops):
    """Plans (retried or not), refusals by each limit, releases and reaps in any order:
    a slot's pin count is always the number of live leases that hold it, and a refused
    plan changes neither the pins nor the leases."""
    eng, _ = engine
    lt = eng.leases
    lt.max_slots, lt.max_per_client, lt.max_leases = 1000, 3, 5
    held: dict[bytes, list] = {b"a": [], b"b": []}
    try:
        for op, client, rid, n, lo in ops:
            if op == "plan":
                ids = (lo + np.arange(n) * 7) % ROWS
                pins, live = eng.slots.pins.copy(), len(lt)
                try:
                    held[client].append(eng.plan(ids, ttl_s=30.0, conn_id=client, request_id=rid).lease_id)
                except ResourceExhausted:
                    assert np.array_equal(eng.slots.pins, pins) and len(lt) == live, "a refusal changed the table"
            elif op == "release" and held[client]:
                lt.release([held[client].pop(0)], client)
            elif op == "reap":
                lt.reap(time.monotonic() + 60.0)  # every lease past its TTL
            with lt._lock:
                expect = np.bincount(np.concatenate([x.slots for x in lt._leases.values()] or [np.zeros(0, int)])
                                     .astype(np.int64), minlength=eng.capacity)
            assert np.array_equal(eng.slots.pins, expect), "a pin no live lease holds"
            lt.check({eng: eng.slots.pins})
    finally:
        lt.release_client(b"a")
        lt.release_client(b"b")
        lt.max_slots, lt.max_per_client, lt.max_leases = 1 << 26, 64, 64
    assert eng.slots.n_pinned == 0


def test_a_row_pinned_as_often_as_a_slot_counts_refuses_the_next_lease(engine):
    """Pins are two bytes a slot (slot_table.PIN_MAX): the step that would pin a row once more
    is refused as a lease refusal (ResourceExhausted, plan again), nothing pinned, never a
    count wrapped round to 'unpinned'."""
    from tierstore.cache.slot_table import PIN_MAX

    eng, data = engine
    _plan(eng, np.arange(100))
    eng.leases.release_client(b"c")
    slot = int(eng.slots.find(np.array([7]))[0])
    eng.slots.pin(np.array([slot]), times=PIN_MAX - 1)  # as if that many other steps leased it
    res, rows = _plan(eng, np.arange(5, 10))  # the last pin the slot can count
    assert np.array_equal(rows, data[5:10]) and eng.slots.pins[slot] == PIN_MAX
    before = (eng.slots.pins.copy(), eng.slots.n_pinned, len(eng.leases), eng.counters.lease_refusals)
    with pytest.raises(ResourceExhausted, match="plan again"):
        eng.plan(np.array([3, 7, 5000]), ttl_s=30.0, conn_id=b"c")
    assert np.array_equal(eng.slots.pins, before[0]) and eng.slots.n_pinned == before[1]
    assert len(eng.leases) == before[2] and eng.counters.lease_refusals == before[3] + 1
    eng.leases.release_client(b"c")  # a lease ends: the row is served again
    res, rows = _plan(eng, np.array([3, 7, 5000]))
    assert np.array_equal(rows, data[[3, 7, 5000]])


def test_steps_and_prefetches_on_four_threads_through_failing_fills_lose_no_slot_and_leak_no_pin(engine):
    """Four clients plan overlapping steps and prefetch rows at once while fills fail (EIO) and
    take a while: steps share rows being filled, wait on fills that fail and plan again. When
    all have released, the slot table and the lease table keep their invariants (no slot
    lost off the free stack, none mapped twice), nothing is pinned, and every resident row
    is its own."""
    eng, data = engine
    eng.reader.delay_s = 0.002
    errors = []

    def client(k: int) -> None:
        rng = np.random.default_rng(k)
        name = f"c{k}".encode()
        try:
            for i in range(25):
                ids = np.unique(rng.integers(0, 6000, 300))
                if i % 4 == k % 4:
                    eng.reader.fail_next = 1  # some thread's next read fails: its fill, or a prefetch's
                try:
                    if i % 5 == 0:
                        eng.hints.prefetch(np.unique(rng.integers(0, 6000, 200)))
                        continue
                    res = eng.plan(ids, ttl_s=30.0, conn_id=name)
                except (OSError, ResourceExhausted):  # its read failed (EIO), or rows it shares did
                    continue
                if not np.array_equal(eng.arena.rows[res.slots], data[ids]):
                    errors.append(f"client {k} read rows not its own")
                eng.leases.release([res.lease_id], name)
        except BaseException as e:  # noqa: BLE001 (the test thread reports it)
            errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[:3]
    assert not any(t.is_alive() for t in threads)
    eng.slots.check()
    eng.leases.check({eng: eng.slots.pins})
    assert eng.slots.n_pinned == 0 and len(eng.leases) == 0
    slots = np.flatnonzero(eng.slots.is_ready(slice(0, eng.capacity)))
    assert np.array_equal(eng.arena.rows[slots], data[eng.slots.id_of[slots]])
