"""A real Mooncake cluster on loopback for a test, or the test skipped where Mooncake is missing."""
from __future__ import annotations

from contextlib import contextmanager

import pytest

from tierstore.tiers.remote.mooncake import LocalCluster, missing_reason


@contextmanager
def local_cluster(log_dir, stores: int = 2):
    """One mooncake_master and `stores` store processes (each lending a 64 MiB DRAM segment);
    all stopped on exit, and the exit checks that none is left running."""
    why = missing_reason()
    if why:
        pytest.skip(why)
    c = LocalCluster(stores=stores, segment_bytes=64 << 20, client_ttl_s=2, log_dir=log_dir)
    try:
        yield c
    finally:
        c.stop()
        assert all(p.poll() is not None for p in [c.master, *c.stores])  # no process left
