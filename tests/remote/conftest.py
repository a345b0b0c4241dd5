"""A real Mooncake cluster on loopback: one mooncake_master and two store
processes (each lending a DRAM segment), stopped at teardown. Never a mock."""
from __future__ import annotations

import pytest

from tierstore.tiers.remote.mooncake import LocalCluster, missing_reason


@pytest.fixture
def cluster(tmp_path):
    why = missing_reason()
    if why:
        pytest.skip(why)
    c = LocalCluster(stores=2, segment_bytes=64 << 20, client_ttl_s=2, log_dir=tmp_path / "mooncake-logs")
    try:
        yield c
    finally:
        c.stop()
        assert all(p.poll() is not None for p in [c.master, *c.stores])  # no process left
