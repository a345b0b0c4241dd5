"""Two sidecars (two data directories, standing in for two hosts) serve one table
published once; one of them has no local copy of the rows."""
from __future__ import annotations

import time

import numpy as np
import pytest

from tierstore.client.client import Client
from tierstore.errors import Unavailable
from tierstore.sidecar.launcher import SidecarProcess

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


@pytest.mark.slow
def test_both_hosts_serve_bit_exact_rows(two_hosts):
    host_a, host_b, flags, data = two_hosts
    ids = np.random.default_rng(3).integers(0, ROWS, 3000)  # ~2,900 distinct: within a lone client's 7/8 of the 4,096 slots
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
    # a --data that refuses write-back (a file where the version directory goes): every miss
    # goes to Mooncake, as on a host whose disk is full; written-back blocks would be served
    vdir = host_b / "tables" / "emb" / "v1"
    vdir.parent.mkdir(parents=True)
    vdir.write_text("not a directory")
    with SidecarProcess(host_b, dram_budget="1MiB", extra_args=flags) as b, Client(b.socket, timeout=60) as cb:
        assert "no write-back" in b.log()
        assert np.array_equal(cb.lookup("emb", hot), data[hot])
        cluster.stop_master()
        assert np.array_equal(cb.lookup("emb", hot), data[hot])   # DRAM hits keep being served
        t0 = time.monotonic()
        with pytest.raises(Unavailable):
            cb.lookup("emb", np.arange(ROWS - 100, ROWS))
        assert time.monotonic() - t0 < 40
        assert np.array_equal(cb.lookup("emb", hot), data[hot])


def test_new_host_imports_serves_and_warms_into_a_local_copy(cluster, make_table, data_dir, tmp_path, cli):
    """serve --remote --remote-table on an empty --data: manifest imported at start-up, rows
    served bit-exact while written back; then the copy serves without Mooncake."""
    rows = 4000
    _, data = make_table("emb", rows=rows, row_bytes=ROW_BYTES, chunk=4096)
    remote = ["--mooncake", cluster.master_addr, "--metadata", cluster.metadata]
    assert cli("publish", "--data", data_dir, "--table", "emb", *remote)[0] == 0
    host_c = tmp_path / "host-c"  # does not exist yet
    flags = ["--remote", f"mooncake://{cluster.master_addr}", "--metadata", cluster.metadata,
             "--remote-table", "emb"]
    vdir = host_c / "tables" / "emb" / "v1"
    with SidecarProcess(host_c, dram_budget="256KiB", extra_args=flags) as c, Client(c.socket, timeout=30) as cc:
        ids = np.arange(rows)
        for part in np.array_split(ids, 20):  # cache mode: 1,024 slots
            assert np.array_equal(cc.lookup("emb", part), data[part])
        assert "manifest recorded from Mooncake" in c.log() and "writing them back" in c.log()
        deadline = time.monotonic() + 30
        while "every block is local now" not in c.log():  # written back (and the fill did the rest)
            assert time.monotonic() < deadline, c.log()
            time.sleep(0.05)
        assert (vdir / "seg-00000.bin").exists() and "100% of blocks local" in c.log()
        for part in np.array_split(ids[::-1], 20):
            assert np.array_equal(cc.lookup("emb", part), data[part])
    assert not (vdir / "blocks.present").exists()
    with SidecarProcess(host_c, dram_budget="64MiB") as c2, Client(c2.socket, timeout=30) as cc2:
        assert np.array_equal(cc2.lookup("emb", np.arange(rows)), data)
        assert "Mooncake" not in c2.log()


def test_remote_table_errors_are_clear(cluster, tmp_path, cli):
    host = tmp_path / "host-d"
    code, _, err = cli("serve", "--data", host, "--remote-table", "emb")
    assert code == 2 and "--remote-table needs --remote" in err and not host.exists()
    sock = ["--socket", tmp_path / "s.sock"]
    code, _, err = cli("serve", "--data", host, *sock, "--remote", f"mooncake://{cluster.master_addr}",
                       "--metadata", cluster.metadata, "--remote-table", "nope")
    assert code == 2 and "'nope' is not published" in err
    code, _, err = cli("serve", "--data", host, *sock, "--remote", f"mooncake://{cluster.master_addr}",
                       "--metadata", cluster.metadata, "--remote-table", "emb@x")
    assert code == 2 and "TABLE@VERSION" in err
    assert not (host / "catalog").exists() and not (tmp_path / "s.sock").exists()


@pytest.mark.reliability  # ~15 s
def test_a_sidecar_killed_mid_write_back_restarts_without_a_wrong_block(cluster, make_table, data_dir, tmp_path,
                                                                          cli):
    """kill -9 while blocks are being written back: every block the bitmap names verifies,
    and a restart completes the copy."""
    from tierstore.store.catalog import Catalog
    from tierstore.tiers.remote.local_copy import LocalCopy

    rows = 100_000  # 25 MiB: a few write-back rounds
    _, data = make_table("emb", rows=rows, row_bytes=ROW_BYTES, chunk=8192)
    assert cli("publish", "--data", data_dir, "--table", "emb", "--mooncake", cluster.master_addr,
               "--metadata", cluster.metadata)[0] == 0
    host = tmp_path / "host-e"
    flags = ["--remote", f"mooncake://{cluster.master_addr}", "--metadata", cluster.metadata, "--remote-table", "emb"]
    bitmap = host / "tables" / "emb" / "v1" / "blocks.present"
    sc = SidecarProcess(host, dram_budget="1MiB", extra_args=flags).start()
    try:
        deadline = time.monotonic() + 30
        while not (bitmap.exists() and any(bitmap.read_bytes()[32:])):  # some blocks are durable
            assert time.monotonic() < deadline, sc.log()
            time.sleep(0.005)
        sc.kill()
    finally:
        sc.stop()
        sc.cleanup()  # the killed sidecar's arena and lease board
    with Catalog(host, readonly=True) as cat:
        tv = cat.current("emb")
        sums = cat.checksums("emb", tv.number)
    copy = LocalCopy(host, tv, sums)
    try:
        have = np.flatnonzero(copy.present[:tv.n_blocks])
        assert 0 < have.size < tv.n_blocks  # killed part way
        buf = np.empty(have.size * tv.block_bytes, np.uint8)
        assert copy.read_blocks(have, buf, np.arange(have.size)).all()  # every named block verifies
    finally:
        copy.close()
    with SidecarProcess(host, dram_budget="1MiB", extra_args=flags) as sc, Client(sc.socket, timeout=30) as c:
        ids = np.random.default_rng(4).integers(0, rows, 2000)
        assert np.array_equal(c.lookup("emb", ids), data[ids])
        deadline = time.monotonic() + 60
        while bitmap.exists():
            assert time.monotonic() < deadline, sc.log()
            time.sleep(0.05)
    with SidecarProcess(host, dram_budget="64MiB") as sc, Client(sc.socket, timeout=30) as c:
        assert np.array_equal(c.lookup("emb", np.arange(rows)), data)
