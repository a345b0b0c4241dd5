"""Leases as a user meets them: a step never reads rows that are no longer its own,
and no client can end another's lease."""
from __future__ import annotations

import time

import numpy as np
import pytest

from tierstore import errors
from tierstore.client.client import Client
from tierstore.ingest.writer import write_version
from tierstore.sidecar.launcher import SidecarProcess

ROWS, DIM = 200_000, 32


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    data = np.random.default_rng(3).integers(0, 256, size=(ROWS, DIM * 4), dtype=np.uint8)
    write_version(d, "t", [data], rows=ROWS, row_format="fp32", row_dim=DIM)
    return d, data


@pytest.fixture(scope="module")
def cache(table):
    d, data = table
    # 1 MiB of 128-B rows = 8,192 slots; leases live one second
    with SidecarProcess(d, dram_budget="1MiB", extra_args=["--lease-ttl", "1"]) as sc:
        yield sc, data


def _traffic(c: Client, steps: int, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        with c.plan("t", rng.choice(ROWS, n, replace=False)) as s:
            s.slots()


def test_a_stalled_step_never_reads_rows_that_are_no_longer_its_own(cache):
    """The issue's reproduction: A plans, takes its slots, stalls past its lease TTL;
    B's traffic reuses every slot; A's rows() are still A's rows (re-planned)."""
    sc, data = cache
    ids = np.arange(1000) * 7
    with Client(sc.socket) as a, Client(sc.socket) as b:
        step = a.plan("t", ids)
        step.slots()
        assert step.valid()
        time.sleep(2.5)
        _traffic(b, 40, 3000, seed=1)
        assert not step.valid()                       # the layer's check after its own gather
        rows = step.rows()                            # re-planned transparently
        assert np.array_equal(rows, data[ids]), "a stalled step read rows another step had overwritten"
        assert step.valid()
        step.release()


def test_rows_after_release_raise_instead_of_reading_reused_slots(cache):
    sc, data = cache
    with Client(sc.socket) as a:
        step = a.plan("t", np.arange(10))
        assert np.array_equal(step.rows(), data[:10])
        step.release()
        with pytest.raises(errors.StaleRows, match="released"):
            step.rows()


def test_no_client_can_end_another_clients_lease(cache):
    """16.3: B releases ids around its own lease id, and A's exact id: A keeps its rows."""
    sc, data = cache
    ids = np.arange(1000) * 11 + 5
    with Client(sc.socket) as a, Client(sc.socket) as b:
        step = a.plan("t", ids)
        step.slots()
        mine = b.plan("t", np.arange(10))
        mine.slots()
        guesses = [mine.lease_id - k for k in range(1, 2000)] + [step.lease_id]
        assert b.release(guesses) == 0
        _traffic(b, 10, 3000, seed=2)
        assert step.valid()
        assert np.array_equal(step.rows(), data[ids])
        assert a.release([step.lease_id]) == 1
        mine.release()


def test_lease_ids_are_unguessable(cache):
    sc, _ = cache
    with Client(sc.socket) as a:
        ids = []
        for _ in range(20):
            with a.plan("t", np.arange(4)) as s:
                s.slots()
                ids.append(s.lease_id)
    gaps = np.diff(np.array(ids, dtype=np.uint64).astype(np.float64))
    assert np.all(np.abs(gaps) > 1 << 24), "consecutive lease ids are predictable"


def test_a_ttl_over_the_maximum_is_refused_not_capped(cache):
    sc, _ = cache
    with Client(sc.socket) as a:
        with pytest.raises(errors.InvalidArgument, match="longest lease"):
            a.plan("t", np.arange(4), ttl_s=3600).slots()


def test_leases_per_client_are_bounded(table):
    d, _ = table
    with SidecarProcess(d, dram_budget="1MiB", extra_args=["--max-leases-per-client", "5"]) as sc, \
            Client(sc.socket) as a, Client(sc.socket) as b:
        held = [a.plan("t", np.arange(i * 10, i * 10 + 10)) for i in range(5)]
        for s in held:
            s.slots()
        with pytest.raises(errors.ResourceExhausted, match="per client"):
            a.plan("t", np.arange(100, 110)).slots()
        with b.plan("t", np.arange(100, 110)) as s:  # another client is not affected
            s.slots()
        for s in held:
            s.release()


def test_a_retried_plan_leaves_no_extra_lease(cache):
    """11.5: the same request id planned twice holds one lease, not two."""
    from tierstore.proto.frames import PlanItem

    sc, _ = cache
    with Client(sc.socket) as a:
        conn = a.step_channel
        item = PlanItem("t", np.arange(50, dtype="<i8"), 0, 0, 77)
        (first,) = conn.submit([item]).result()
        before = a.stats()["leases_active"]
        (second,) = conn.submit([item]).result()
        assert a.stats()["leases_active"] == before
        assert first.lease_id != second.lease_id
        assert a.release([first.lease_id, second.lease_id]) == 1


def test_a_released_step_ends_its_lease_soon_without_a_next_step(cache):
    """A step-socket release rides on the next step's request; with none coming, the client sends it alone."""
    sc, _ = cache
    with Client(sc.socket) as c:
        for burst in (1, 30, 1):  # the flusher waits again after each burst, and wakes again
            for k in range(burst):
                with c.plan("t", np.arange(k, k + 20)) as s:
                    s.rows()
            deadline = time.monotonic() + 0.5  # well before the leases' 1 s TTL would end them
            while int(c.stats()["leases_active"]) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert int(c.stats()["leases_active"]) == 0
