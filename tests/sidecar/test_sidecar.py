"""The sidecar as users meet it: a real `tierstore serve` process on a unix socket."""
from __future__ import annotations

import os
import stat
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierstore import errors
from tierstore.client.client import Client
from tierstore.table.formats import encode_rows
from tierstore.ingest.writer import write_version
from tierstore.sidecar.launcher import SidecarProcess
from tierstore.tiers.dram import HEADER_BYTES

ROWS, DIM = 20_000, 32


@pytest.fixture(scope="module")
def table_dir(tmp_path_factory):
    """Two small tables in different row formats; `expected` is what disk holds."""
    d = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(7)
    expected = {}
    for name, fmt, n in (("t32", "fp32", ROWS), ("t8", "fp8-e4m3-ue8m0", ROWS // 2)):
        rows = encode_rows(rng.standard_normal((n, DIM)).astype(np.float32), fmt)
        write_version(d, name, [rows[: n // 3], rows[n // 3:]], rows=n, row_format=fmt, row_dim=DIM)
        expected[name] = rows
    return d, expected


def _sidecar(data_dir, budget, *extra):
    return SidecarProcess(data_dir, dram_budget=budget, extra_args=extra)


@pytest.fixture(scope="module")
def full(table_dir):
    d, expected = table_dir
    with _sidecar(d, "64MiB") as sc, Client(sc.socket, timeout=10) as c:
        yield sc, c, expected


@pytest.fixture(scope="module")
def cached(table_dir):
    # the two tables need ~1.1 MiB; 10% of that forces cache mode and evictions
    d, expected = table_dir
    with _sidecar(d, "110KiB", "--lease-ttl", "2") as sc, Client(sc.socket, timeout=10) as c:
        yield sc, c, expected


def test_full_resident_rows_are_bit_exact_on_every_path(full):
    sc, c, expected = full
    info = {t["table"]: t for t in c.tables()}
    assert info["t32"]["full_resident"] and info["t8"]["full_resident"]
    ids = np.random.default_rng(1).integers(0, ROWS, 5000)
    assert np.array_equal(c.lookup("t32", ids), expected["t32"][ids])
    assert np.array_equal(c.lookup("t32", ids, inline=True), expected["t32"][ids])
    with c.plan("t32", ids) as step:
        assert np.array_equal(step.slots(), ids)  # slot == id when the table fits
        assert np.array_equal(step.rows(), expected["t32"][ids])


def test_cache_mode_serves_bit_exact_rows_and_evicts(cached):
    sc, c, expected = cached
    info = {t["table"]: t for t in c.tables()}
    assert not info["t32"]["full_resident"]
    assert info["t32"]["arena_slots"] < ROWS
    rng = np.random.default_rng(2)
    for _ in range(6):
        ids = rng.integers(0, ROWS, 600)
        with c.plan("t32", ids) as step:
            rows = step.rows()
        assert np.array_equal(rows, expected["t32"][ids])
        assert np.array_equal(c.lookup("t32", ids, inline=True), expected["t32"][ids])
    s = {t["table"]: t for t in c.stats()["tables"]}["t32"]
    assert int(s["evictions"]) > 0 and int(s["promotions"]) > 0 and int(s["bytes_read"]) > 0
    # DRAM beyond the arena is O(slots): the slot map and table, the policy; nothing per row
    # (row sums live in the records on disk, block checksums are read from the catalog)
    slots = int(info["t32"]["arena_slots"])
    # 31 B a slot (tests/cache/test_memory.py), plus fixed parts: the ring of hint ends (32 KiB)
    assert slots * 19 < int(s["metadata_bytes"]) < slots * 31 + (40 << 10)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, ROWS - 1), min_size=0, max_size=400), table=st.sampled_from(["t32", "t8"]))
def test_any_ids_read_back_bit_exact_in_cache_mode(cached, ids, table):
    sc, c, expected = cached
    ids = np.array(ids, dtype=np.int64) % len(expected[table])
    assert np.array_equal(c.lookup(table, ids), expected[table][ids])
    assert np.array_equal(c.lookup(table, ids, inline=True), expected[table][ids])


def test_a_leased_row_is_not_evicted_until_release(cached):
    sc, c, expected = cached
    capacity = {t["table"]: t for t in c.tables()}["t32"]["arena_slots"]
    rng = np.random.default_rng(3)
    held_ids = rng.choice(ROWS, capacity // 2, replace=False)
    held = c.plan("t32", held_ids)
    slots = held.slots().copy()
    # churn through many other rows; the held slots must keep their rows
    for _ in range(8):
        other = rng.choice(ROWS, capacity // 3, replace=False)
        with c.plan("t32", other) as step:
            step.slots()
    assert np.array_equal(held.slots(), slots)
    assert np.array_equal(held.rows(), expected["t32"][held_ids])
    # a step that needs more than the unleased space is refused, not served wrong rows
    with pytest.raises(errors.ResourceExhausted):
        c.plan("t32", rng.choice(ROWS, capacity - capacity // 4, replace=False)).slots()
    held.release()
    with c.plan("t32", rng.choice(ROWS, capacity - capacity // 4, replace=False)) as step:
        step.slots()


def test_bad_input_gets_a_status_and_the_next_request_is_served(cached):
    sc, c, expected = cached
    with pytest.raises(errors.IdOutOfRange, match="20000 rows; id 20000"):
        c.lookup("t32", [1, ROWS])
    with pytest.raises(errors.IdOutOfRange):
        c.lookup("t32", [-1], inline=True)
    with pytest.raises(errors.TableNotFound):
        c.lookup("nope", [1])
    with pytest.raises(errors.NotFound):
        c.lookup("../x", [1], inline=True)
    with pytest.raises(errors.InvalidArgument):
        c.lookup("t32", np.array([1.5]))
    # a malformed message: ids not a multiple of 8 bytes
    from tierstore.proto import tierstore_pb2 as pb
    with pytest.raises(errors.InvalidArgument, match="8 bytes"):
        c._call("Lookup", pb.LookupRequest(table="t32", ids=b"\x01\x02\x03"))
    with pytest.raises(errors.VersionNotFound):
        c._call("Lookup", pb.LookupRequest(table="t32", version=999, ids=np.array([1], "<i8").tobytes()))
    assert np.array_equal(c.lookup("t32", [5, 6]), expected["t32"][[5, 6]])


def test_leases_of_a_dead_client_expire(cached, tmp_path):
    import subprocess
    import sys
    import time

    sc, c, expected = cached
    code = (
        "import sys, numpy as np\n"
        "from tierstore.client.client import Client\n"
        f"c = Client({str(sc.socket)!r})\n"
        "s = c.plan('t32', np.arange(0, 200)); s.slots()\n"  # within its share while c is about
        "print('planned', flush=True); import time; time.sleep(60)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=tmp_path)
    try:
        assert p.stdout.readline().strip() == b"planned"
        leased = lambda: int({t["table"]: t for t in c.stats()["tables"]}["t32"]["leased_slots"])
        assert leased() >= 200
        p.kill()
        p.wait()
        deadline = time.monotonic() + 10
        while leased() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert leased() == 0  # TTL is 2 s here
    finally:
        p.kill()
        p.wait()


def test_socket_and_arena_are_private_and_cleaned_up(table_dir):
    d, _ = table_dir
    sc = _sidecar(d, "64MiB").start()
    try:
        assert stat.S_IMODE(os.stat(sc.socket).st_mode) == 0o600
        arenas = sc.arena_files()
        assert len(arenas) == 2
        for a in arenas:
            st_ = os.stat(a)
            assert stat.S_IMODE(st_.st_mode) == 0o600 and st_.st_uid == os.getuid()
        sc.stop()
        assert not sc.socket.exists() and sc.arena_files() == []
    finally:
        sc.cleanup()  # a failed check above still leaves nothing behind


def test_unreachable_sidecar_is_unavailable_quickly(tmp_path):
    import time
    t0 = time.monotonic()
    with Client(tmp_path / "none.sock", timeout=3) as c, pytest.raises(errors.Unavailable):
        c.tables()
    assert time.monotonic() - t0 < 5


def test_persisted_arena_is_reattached_after_verification(table_dir):
    d, expected = table_dir
    sc = _sidecar(d, "64MiB", "--persist-arena").start()
    try:
        sc.stop()
        arenas = sc.arena_files()
        assert len(arenas) == 2  # left for the next sidecar
        # corrupt one byte of one arena: the next sidecar must notice and reload that table
        t32 = next(a for a in arenas if ".t32." in a.name)
        with open(t32, "r+b") as f:
            f.seek(HEADER_BYTES + 1000)
            b = f.read(1)
            f.seek(HEADER_BYTES + 1000)
            f.write(bytes([b[0] ^ 0xFF]))
        sc2 = SidecarProcess(d, socket=sc.socket, dram_budget="64MiB", extra_args=["--persist-arena"]).start()
        try:
            log = sc2.log()
            assert "re-attached" in log and "reloading from disk" in log
            with Client(sc2.socket) as c:
                ids = np.arange(ROWS)
                assert np.array_equal(c.lookup("t32", ids), expected["t32"])
        finally:
            sc2.stop()
            sc2.cleanup()
    finally:
        sc.cleanup()
    assert sc.arena_files() == []


def test_corrupt_cold_block_is_data_loss_and_the_rest_keeps_serving(tmp_path):
    rng = np.random.default_rng(5)
    rows = encode_rows(rng.standard_normal((4000, DIM)).astype(np.float32), "fp32")
    tv = write_version(tmp_path, "c", [rows], rows=4000, row_format="fp32", row_dim=DIM)
    seg = tmp_path / tv.segments[0]
    bad_row = 1234
    with open(seg, "r+b") as f:
        f.seek(bad_row * tv.record_bytes + 3)
        b = f.read(1)
        f.seek(bad_row * tv.record_bytes + 3)
        f.write(bytes([b[0] ^ 0x01]))
    bad_block = bad_row // tv.block_rows
    with _sidecar(tmp_path, "64KiB") as sc, Client(sc.socket) as c:
        assert not c.table_info("c")["full_resident"]
        with pytest.raises(errors.DataLoss, match=f"'c' version {tv.number}.*block {bad_block}"):
            c.lookup("c", [bad_row])
        with pytest.raises(errors.DataLoss):
            c.lookup("c", [bad_row], inline=True)
        good = np.array([0, 10, 3999])
        assert np.array_equal(c.lookup("c", good), rows[good])


def test_oversize_requests_are_refused_cleanly(full):
    sc, c, expected = full
    from tierstore.proto import tierstore_pb2 as pb
    big = np.zeros(9_000_000, dtype="<i8").tobytes()  # 72 MB > the 64 MiB request limit
    with pytest.raises(errors.ResourceExhausted):
        c._call("Lookup", pb.LookupRequest(table="t32", ids=big))
    assert np.array_equal(c.lookup("t32", [1]), expected["t32"][[1]])


def test_metrics_endpoint_counts_per_tier(table_dir):
    import socket as socketlib
    import urllib.request

    d, _ = table_dir
    with socketlib.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with _sidecar(d, "110KiB", "--metrics-port", port) as sc, Client(sc.socket) as c:
        with c.plan("t32", np.arange(500)) as step:  # planned: counted by the time the reply comes
            step.rows()
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        c_stats = c.stats()["tables"]
    assert 'tierstore_misses_total{table="t32",tier="dram"} 500.0' in text
    assert 'tierstore_bytes_read_total{table="t32",tier="nvme"}' in text
    assert "tierstore_rpc_seconds_bucket" in text and "tierstore_evictions_total" in text
    assert 'tierstore_metadata_bytes{table="t32"}' in text
    st = next(t for t in c_stats if t["table"] == "t32")  # what Stats says, the endpoint says
    assert f'tierstore_arena_page_bytes{{table="t32"}} {float(st["arena_page_bytes"])}' in text


def test_tcp_needs_an_explicit_flag_and_the_token(table_dir, tmp_path):
    import socket as socketlib
    import subprocess
    import sys

    d, expected = table_dir
    refused = subprocess.run([sys.executable, "-m", "tierstore", "serve", "--data", str(d),
                              "--socket", str(tmp_path / "s.sock"), "--listen", "127.0.0.1:0"],
                             capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert refused.returncode != 0 and "--allow-tcp" in refused.stderr
    with socketlib.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    extra = ["--listen", f"127.0.0.1:{port}", "--allow-tcp", "--auth-token", "s3cret"]
    with _sidecar(d, "64MiB", *extra) as sc:
        with Client(target=f"127.0.0.1:{port}", timeout=5) as anon, pytest.raises(errors.Unauthenticated):
            anon.lookup("t32", [1], inline=True)
        with Client(target=f"127.0.0.1:{port}", token="wrong", timeout=5) as bad, pytest.raises(errors.Unauthenticated):
            bad.tables()
        with Client(target=f"127.0.0.1:{port}", token="s3cret", timeout=5) as ok:
            assert np.array_equal(ok.lookup("t32", [3, 4], inline=True), expected["t32"][[3, 4]])
        with Client(sc.socket) as local:  # the 0600 unix socket needs no token
            assert np.array_equal(local.lookup("t32", [3]), expected["t32"][[3]])


def _local_steps(c: Client, table: str, at_least: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        n = int(next(t for t in c.stats()["tables"] if t["table"] == table)["local_steps"])
        if n >= at_least or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


def test_client_survives_a_sidecar_restart_in_cache_mode(table_dir):
    d, expected = table_dir
    sc = _sidecar(d, "110KiB").start()
    try:
        c = Client(sc.socket, timeout=5)
        ids = np.arange(100, 400)
        assert np.array_equal(c.lookup("t32", ids), expected["t32"][ids])
        sc.kill()
        with pytest.raises(errors.Unavailable):
            with c.plan("t32", ids) as step:
                step.rows()
        # local reads need no sidecar: the dead one's arena and segment files still serve, bit-exact
        assert np.array_equal(c.lookup("t32", ids), expected["t32"][ids])
        sc2 = SidecarProcess(d, socket=sc.socket, dram_budget="110KiB").start()
        try:
            # a new instance fills its arena in a different order: the client must remap, not reuse old slots
            other = np.arange(5000, 5300)
            assert np.array_equal(c.lookup("t32", other), expected["t32"][other])
            assert np.array_equal(c.lookup("t32", ids), expected["t32"][ids])
            with c.plan("t32", ids) as step:
                assert np.array_equal(step.rows(), expected["t32"][ids])
            c.flush()  # and the new sidecar hears of the client's local steps (the link reconnects)
            assert _local_steps(c, "t32", 1) >= 1
        finally:
            c.close()
            sc2.cleanup()
    finally:
        sc.cleanup()


def test_a_profile_seeds_the_cache_and_a_missing_one_is_refused(table_dir, tmp_path):
    import subprocess
    import sys

    from tierstore.table.profile import Profile
    from tierstore.table.spec import preset

    d, expected = table_dir
    hot = np.arange(50, 80)
    prof = Profile(preset("engram-paper-demo", 512), {"t32": hot}, {"t32": np.full(hot.size, 100)}, tokens=1)
    path = prof.save(tmp_path / "p.npz")
    with _sidecar(d, "110KiB", "--profile", path) as sc, Client(sc.socket) as c:
        assert np.array_equal(c.lookup("t32", hot), expected["t32"][hot])
    bad = subprocess.run([sys.executable, "-m", "tierstore", "serve", "--data", str(d), "--socket",
                          str(tmp_path / "s.sock"), "--profile", str(tmp_path / "nope.npz")],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert bad.returncode == 2 and "tierstore profile" in bad.stderr
