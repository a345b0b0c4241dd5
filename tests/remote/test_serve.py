"""Two sidecars (two data directories, standing in for two hosts) serve one table
published once; one of them has no local copy of the rows."""
from __future__ import annotations

import time

import numpy as np
import pytest

from tierstore.client.sidecar import Client
from tierstore.errors import Unavailable
from tierstore.launcher import SidecarProcess

ROWS, ROW_BYTES = 20000, 256   # 5 MiB


@pytest.fixture
def two_hosts(cluster, make_table, data_dir, tmp_path, cli):
    _, data = make_table("emb", rows=ROWS, row_bytes=ROW_BYTES, chunk=4096)
    remote = ["--mooncake", cluster.master_addr, "--metadata", cluster.metadata]
    assert cli("publish", "--data", data_dir, "--table", "emb", "--replicas", "2", *remote)[0] == 0
    host_b = tmp_path / "host-b"
    assert cli("fetch-manifest", "--data", host_b, "--table", "emb", *remote)[0] == 0
    flags = ["--remote", f"mooncake://{cluster.master_addr}", "--metadata", cluster.metadata]
    return data_dir, host_b, flags, data


def test_both_hosts_serve_bit_exact_rows(two_hosts):
    host_a, host_b, flags, data = two_hosts
    ids = np.random.default_rng(3).integers(0, ROWS, 4000)
    # A: local segments, cache mode; B: rows only in Mooncake, cache mode (misses fetched) and full mode
    with SidecarProcess(host_a, dram_budget="1MiB", extra_args=flags) as a, \
            SidecarProcess(host_b, dram_budget="1MiB", extra_args=flags) as b, \
            Client(a.socket, timeout=30) as ca, Client(b.socket, timeout=30) as cb:
        assert np.array_equal(ca.lookup("emb", ids), data[ids])
        assert np.array_equal(cb.lookup("emb", ids), data[ids])
        assert np.array_equal(cb.lookup("emb", ids, inline=True), data[ids])
        assert "reading from Mooncake" in b.log() and "reading from Mooncake" not in a.log()
    with SidecarProcess(host_b, dram_budget="64MiB", extra_args=flags) as b, Client(b.socket, timeout=30) as cb:
        assert np.array_equal(cb.lookup("emb", np.arange(ROWS)), data)


def test_no_remote_flag_and_no_rows_is_a_clear_error(two_hosts):
    _, host_b, _, _ = two_hosts
    sc = SidecarProcess(host_b, dram_budget="64MiB")
    try:
        with pytest.raises(Exception):
            sc.start()
        assert "segment" in sc.log() and "missing" in sc.log()
        assert "Traceback" not in sc.log()
    finally:
        sc.cleanup()


@pytest.mark.reliability
def test_master_down_misses_unavailable_hits_served(two_hosts, cluster):
    _, host_b, flags, data = two_hosts
    hot = np.arange(100)
    with SidecarProcess(host_b, dram_budget="1MiB", extra_args=flags) as b, Client(b.socket, timeout=60) as cb:
        assert np.array_equal(cb.lookup("emb", hot), data[hot])
        cluster.stop_master()
        assert np.array_equal(cb.lookup("emb", hot), data[hot])   # DRAM hits keep being served
        t0 = time.monotonic()
        with pytest.raises(Unavailable):
            cb.lookup("emb", np.arange(ROWS - 100, ROWS))
        assert time.monotonic() - t0 < 40
        assert np.array_equal(cb.lookup("emb", hot), data[hot])
