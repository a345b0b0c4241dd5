"""Fixtures of the engine tests (cache_engines, the engines themselves, is shared: tests/conftest.py)."""
from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def step():
    """step(engine, ids) -> (its Placement, the rows read at its slots): one planned step,
    its lease released after the copy."""
    def run(eng, ids):
        res = eng.plan(np.asarray(ids), ttl_s=30.0, conn_id=b"c")
        rows = eng.arena.rows[res.slots].copy()
        eng.leases.release_client(b"c")
        return res, rows
    return run
