"""StepPlan (client/step_plan.py) as a user meets it, against a real sidecar with one-second
leases (tests/conftest.py: lease_sidecar): a step never reads rows that are no longer its own
(re-planned once, else StaleRows), and a released step's lease ends soon without a next step."""
from __future__ import annotations

import time

import numpy as np
import pytest

from tierstore import errors
from tierstore.client.client import Client


def test_a_stalled_step_never_reads_rows_that_are_no_longer_its_own(lease_sidecar, lease_traffic):
    """The issue's reproduction: A plans, takes its slots, stalls past its lease TTL;
    B's traffic reuses every slot; A's rows() are still A's rows (re-planned)."""
    sc, data = lease_sidecar
    ids = np.arange(1000) * 7
    with Client(sc.socket) as a, Client(sc.socket) as b:
        step = a.plan("t", ids)
        step.slots()
        assert step.valid()
        time.sleep(2.5)
        lease_traffic(b, 40, 3000, seed=1)
        assert not step.valid()                       # the layer's check after its own gather
        rows = step.rows()                            # re-planned transparently
        assert np.array_equal(rows, data[ids]), "a stalled step read rows another step had overwritten"
        assert step.valid()
        step.release()


def test_rows_after_release_raise_instead_of_reading_reused_slots(lease_sidecar):
    sc, data = lease_sidecar
    with Client(sc.socket) as a:
        step = a.plan("t", np.arange(10))
        assert np.array_equal(step.rows(), data[:10])
        step.release()
        with pytest.raises(errors.StaleRows, match="released"):
            step.rows()


def test_a_released_step_ends_its_lease_soon_without_a_next_step(lease_sidecar):
    """A step-socket release rides on the next step's request; with none coming, the client sends it alone."""
    sc, _ = lease_sidecar
    with Client(sc.socket) as c:
        for burst in (1, 30, 1):  # the flusher waits again after each burst, and wakes again
            for k in range(burst):
                with c.plan("t", np.arange(k, k + 20)) as s:
                    s.rows()
            deadline = time.monotonic() + 0.5  # well before the leases' 1 s TTL would end them
            while int(c.stats()["leases_active"]) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert int(c.stats()["leases_active"]) == 0
