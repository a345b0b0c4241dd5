"""Leases as the sidecar keeps them: no client can end another's lease, lease ids are
unguessable, a lease's TTL and a client's leases are bounded, a retried plan holds one
lease. (A step's own view of its lease, re-planned or StaleRows: tests/client/test_step_plan.py.)"""
from __future__ import annotations

import numpy as np
import pytest

from tierstore import errors
from tierstore.client.client import Client
from tierstore.sidecar.launcher import SidecarProcess


def test_no_client_can_end_another_clients_lease(lease_sidecar, lease_traffic):
    """16.3: B releases ids around its own lease id, and A's exact id: A keeps its rows."""
    sc, data = lease_sidecar
    ids = np.arange(1000) * 11 + 5
    with Client(sc.socket) as a, Client(sc.socket) as b:
        step = a.plan("t", ids)
        step.slots()
        mine = b.plan("t", np.arange(10))
        mine.slots()
        guesses = [mine.lease_id - k for k in range(1, 2000)] + [step.lease_id]
        assert b.release(guesses) == 0
        lease_traffic(b, 10, 3000, seed=2)
        assert step.valid()
        assert np.array_equal(step.rows(), data[ids])
        assert a.release([step.lease_id]) == 1
        mine.release()


def test_lease_ids_are_unguessable(lease_sidecar):
    sc, _ = lease_sidecar
    with Client(sc.socket) as a:
        ids = []
        for _ in range(20):
            with a.plan("t", np.arange(4)) as s:
                s.slots()
                ids.append(s.lease_id)
    gaps = np.diff(np.array(ids, dtype=np.uint64).astype(np.float64))
    assert np.all(np.abs(gaps) > 1 << 24), "consecutive lease ids are predictable"


def test_a_ttl_over_the_maximum_is_refused_not_capped(lease_sidecar):
    sc, _ = lease_sidecar
    with Client(sc.socket) as a:
        with pytest.raises(errors.InvalidArgument, match="longest lease"):
            a.plan("t", np.arange(4), ttl_s=3600).slots()


def test_leases_per_client_are_bounded(lease_table):
    d, _ = lease_table
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


def test_a_retried_plan_leaves_no_extra_lease(lease_sidecar):
    """11.5: the same request id planned twice holds one lease, not two."""
    from tierstore.proto.frames import PlanItem

    sc, _ = lease_sidecar
    with Client(sc.socket) as a:
        conn = a.step_channel
        item = PlanItem("t", np.arange(50, dtype="<i8"), 0, 0, 77)
        (first,) = conn.submit([item]).result()
        before = a.stats()["leases_active"]
        (second,) = conn.submit([item]).result()
        assert a.stats()["leases_active"] == before
        assert first.lease_id != second.lease_id
        assert a.release([first.lease_id, second.lease_id]) == 1
