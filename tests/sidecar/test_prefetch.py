"""Request-level prefetch: rows promoted before the step that reads them."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from tierstore import errors
from tierstore.bench.e2e import spec_from_catalog
from tierstore.client.model.demo_model import EngramDemoModel
from tierstore.client.client import Client
from tierstore.ingest.demo_table import make_demo_tables
from tierstore.ingest.writer import write_version
from tierstore.sidecar.launcher import SidecarProcess


def _wait_prefetched(c: Client, table: str, n: int, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = int(next(t for t in c.stats()["tables"] if t["table"] == table).get("prefetched", 0))
        if got >= n:
            return got
        time.sleep(0.02)
    return got


def _wait_stat(c: Client, table: str, name: str, n: int, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = int(next(t for t in c.stats()["tables"] if t["table"] == table).get(name, 0))
        if got >= n:
            return got
        time.sleep(0.01)
    raise AssertionError(f"{table}'s {name} stayed at {got}, below {n}")


def test_prefetched_rows_are_hits_and_hold_no_lease(tmp_path):
    d = tmp_path / "data"
    data = np.random.default_rng(0).integers(0, 256, size=(50_000, 64), dtype=np.uint8)
    write_version(d, "t", [data], rows=50_000, row_format="fp32", row_dim=16)
    ids = np.random.default_rng(1).choice(50_000, 2000, replace=False)
    with SidecarProcess(d, dram_budget="1MiB") as sc, Client(sc.socket) as c:
        c.prefetch("t", ids)
        assert _wait_prefetched(c, "t", ids.size) == ids.size
        assert int(c.stats()["leases_active"]) == 0
        with c.plan("t", ids) as step:
            assert np.array_equal(step.rows(), data[ids])
            assert step.misses == 0 and step.hits == ids.size


@pytest.fixture
def demo_served(tmp_path):
    """(client, demo model, token ids of one queued request) against a real sidecar."""
    d = tmp_path / "demo"
    make_demo_tables(d, "engram-paper-demo", 512)
    with SidecarProcess(d, dram_budget="2MiB") as sc, Client(sc.socket) as c:
        model = EngramDemoModel(spec_from_catalog(d), c, d_model=64, n_heads=2, seed=3).eval()
        yield c, model, torch.randint(0, model.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def test_an_attachment_prefetches_a_queued_request(demo_served):
    c, model, ids = demo_served
    att = model.engram
    asked = att.prefetch(ids)
    assert asked > 0
    for lid, layer in att.layers.items():
        _wait_prefetched(c, layer.table, 1)
    time.sleep(0.3)
    before = {t["table"]: int(t["misses"]) for t in c.stats()["tables"]}
    model(ids, model.new_cache())
    after = {t["table"]: int(t["misses"]) for t in c.stats()["tables"]}
    assert after == before, "a prefetched request still missed in DRAM"


def _table_stats(c: Client, table: str) -> dict:
    return next(t for t in c.stats()["tables"] if t["table"] == table)


def test_a_hint_only_prefetch_reads_nothing_and_a_default_one_promotes(tmp_path):
    d = tmp_path / "data"
    data = np.random.default_rng(0).integers(0, 256, size=(50_000, 64), dtype=np.uint8)
    write_version(d, "t", [data], rows=50_000, row_format="fp32", row_dim=16)
    hinted, promoted = np.random.default_rng(1).choice(50_000, (2, 2000), replace=False)
    with SidecarProcess(d, dram_budget="1MiB") as sc, Client(sc.socket) as c:
        before = _table_stats(c, "t")
        c.prefetch("t", hinted, read=False)
        c.prefetch("t", promoted)  # queued behind the hint: once its rows are in, the hint ran too
        assert _wait_prefetched(c, "t", promoted.size) == promoted.size
        time.sleep(0.2)
        after = _table_stats(c, "t")
        assert int(after["prefetched"]) == promoted.size  # the hint read none of its rows
        assert int(after["bytes_read"]) > int(before["bytes_read"])
        with c.plan("t", hinted) as step:
            assert np.array_equal(step.rows(), data[hinted])
            assert step.misses == hinted.size
        with c.plan("t", promoted) as step:
            assert np.array_equal(step.rows(), data[promoted])
            assert step.hits == promoted.size


def test_a_hint_only_prefetch_moves_no_bytes(tmp_path):
    d = tmp_path / "data"
    write_version(d, "t", [np.zeros((20_000, 64), np.uint8)], rows=20_000, row_format="fp32", row_dim=16)
    with SidecarProcess(d, dram_budget="1MiB") as sc, Client(sc.socket) as c:
        before = _table_stats(c, "t")
        c.prefetch("t", np.arange(0, 20_000, 7), read=False)
        time.sleep(0.3)
        after = _table_stats(c, "t")
        assert (after["prefetched"], after["bytes_read"]) == (before["prefetched"], before["bytes_read"])


@torch.no_grad()
def test_an_attachment_passes_a_hint_only_prefetch_through(demo_served):
    c, model, ids = demo_served
    att = model.engram
    assert att.prefetch(ids, read=False) > 0
    time.sleep(0.3)
    assert all(int(t.get("prefetched", 0)) == 0 for t in c.stats()["tables"])
    assert att.prefetch(ids) > 0
    assert all(_wait_prefetched(c, layer.table, 1) > 0 for layer in att.layers.values())


def test_a_hinted_row_read_in_later_outlasts_a_scan_until_its_request_runs(tmp_path):
    """prefetch(read=False, steps=N): ids not resident at the hint are kept, once some
    step reads them in, for N steps; the same rows unhinted are scanned out."""
    d = tmp_path / "data"
    data = np.random.default_rng(0).integers(0, 256, size=(60_000, 64), dtype=np.uint8)
    write_version(d, "t", [data], rows=60_000, row_format="fp32", row_dim=16)
    hinted, unhinted = np.arange(0, 400), np.arange(400, 800)
    with SidecarProcess(d, dram_budget="1MiB") as sc, Client(sc.socket) as c:
        with pytest.raises(errors.InvalidArgument, match="steps"):
            c.prefetch("t", hinted, read=False, steps=0)
        c.prefetch("t", hinted, read=False, steps=60)  # the request runs within 60 steps
        time.sleep(0.3)
        for ids in (hinted, unhinted):  # another request reads both sets in
            with c.plan("t", ids) as step:
                assert np.array_equal(step.rows(), data[ids]) and step.misses == ids.size
        for i in range(25):  # 25 steps of fresh rows: more than the arena holds
            with c.plan("t", 1000 + 1000 * i + np.arange(1000)) as step:
                step.rows()
        with c.plan("t", hinted) as step:
            assert np.array_equal(step.rows(), data[hinted]) and step.hits == hinted.size
        with c.plan("t", unhinted) as step:
            assert np.array_equal(step.rows(), data[unhinted]) and step.hits < unhinted.size // 10


@pytest.mark.parametrize("path", ["plan", "local"])
def test_a_hint_lasts_its_steps_when_two_tp_ranks_read_every_step(tmp_path, path):
    """An engine's TP ranks are clients of their own, each reading every step (by plan, or
    locally and noted): the sidecar learns a step once, so rows read in and hinted for 30 steps
    outlast 25 steps of fresh rows (three times what the arena holds) that both ranks read.
    Counted once a rank, the hint would have ended after 15 of them and the fresh rows
    scanned them out."""
    d = tmp_path / "data"
    data = np.random.default_rng(1).integers(0, 256, size=(60_000, 64), dtype=np.uint8)
    write_version(d, "t", [data], rows=60_000, row_format="fp32", row_dim=16)
    hinted = np.arange(0, 400)
    with SidecarProcess(d, dram_budget="1MiB") as sc, Client(sc.socket) as sched, \
            Client(sc.socket) as rank0, Client(sc.socket) as rank1:
        sched.prefetch("t", hinted, read=True, steps=30)  # the scheduler's hint: it runs within 30 steps
        assert _wait_prefetched(sched, "t", hinted.size) >= hinted.size
        for i in range(25):
            ids = 1000 + 2000 * i + np.arange(2000)
            for rank in (rank0, rank1):
                if path == "plan":
                    with rank.plan("t", ids) as step:
                        assert np.array_equal(step.rows(), data[ids])
                else:
                    assert np.array_equal(rank.lookup("t", ids), data[ids])
            if path == "local":  # the learner has both ranks' notes of the step before the next
                _wait_stat(sched, "t", "local_steps", 2 * (i + 1))
        s = next(t for t in sched.stats()["tables"] if t["table"] == "t")
        assert int(s.get("steps_copied", 0)) == 25 - int(s.get("notes_dropped", 0)), s  # one rank's copy a step
        if path == "plan":
            with rank0.plan("t", hinted) as step:
                assert np.array_equal(step.rows(), data[hinted]) and step.hits == hinted.size, step.hits
        else:
            reads = rank0.handle("t").local_reads
            before = reads.rows_resident
            assert np.array_equal(rank0.lookup("t", hinted), data[hinted])
            assert reads.rows_resident - before == hinted.size, "hinted rows were evicted before their request"


def test_a_hint_longer_than_the_sidecars_longest_is_refused_invalid_argument(tmp_path):
    """A hint must end, or steps=10**9 would keep its rows for good: over the sidecar's
    longest hint (the table says which) the Prefetch RPC answers INVALID_ARGUMENT, and the
    client refuses it before sending; the longest itself is taken."""
    import grpc

    from tierstore.proto import tierstore_pb2 as pb

    d = tmp_path / "data"
    write_version(d, "t", [np.zeros((20_000, 64), np.uint8)], rows=20_000, row_format="fp32", row_dim=16)
    with SidecarProcess(d, dram_budget="1MiB") as sc, Client(sc.socket) as c:
        longest = c.handle("t").max_prefetch_steps
        assert longest == 4096
        req = pb.PrefetchRequest(table="t", ids=np.arange(100, dtype="<i8").tobytes(), hint_only=True,
                                 steps=10**9, owner=b"w" * 16)
        with pytest.raises(grpc.RpcError) as e:
            c._stub.Prefetch(req, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "4096" in e.value.details()
        with pytest.raises(errors.InvalidArgument, match="longest"):
            c.prefetch("t", np.arange(100), read=False, steps=10**9)
        c.prefetch("t", np.arange(100), read=False, steps=longest)
        assert c._stub.Prefetch(pb.PrefetchRequest(table="t", ids=req.ids, hint_only=True, steps=longest),
                                timeout=10).queued == 100


def test_a_client_flooding_pending_hints_leaves_room_for_anothers(tmp_path):
    """One client hints far more ids than the arena holds (read=False, the longest hint):
    its pending ids stop at its share, and another client's hint still keeps its rows."""
    d = tmp_path / "data"
    data = np.random.default_rng(0).integers(0, 256, size=(60_000, 64), dtype=np.uint8)
    write_version(d, "t", [data], rows=60_000, row_format="fp32", row_dim=16)
    hinted = np.arange(0, 400)
    with SidecarProcess(d, dram_budget="1MiB") as sc, Client(sc.socket) as c, Client(sc.socket) as hog:
        hog.prefetch("t", np.arange(30_000, 60_000), read=False, steps=4096)
        c.prefetch("t", hinted, read=False, steps=60)
        time.sleep(0.5)
        with c.plan("t", hinted) as step:  # the request's rows are read in by some step
            assert np.array_equal(step.rows(), data[hinted]) and step.misses == hinted.size
        for i in range(25):  # then more fresh rows than the arena holds
            with c.plan("t", 1000 + 1000 * i + np.arange(1000)) as step:
                step.rows()
        with c.plan("t", hinted) as step:
            assert np.array_equal(step.rows(), data[hinted]) and step.hits == hinted.size
