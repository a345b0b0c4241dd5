"""Request-level prefetch: rows promoted before the step that reads them (issue 10.5)."""
from __future__ import annotations

import time

import numpy as np
import torch

from tierstore.bench.e2e import spec_from_catalog
from tierstore.client.demo_model import EngramDemoModel
from tierstore.client.sidecar import Client
from tierstore.demo_table import make_demo_tables
from tierstore.ingest import write_version
from tierstore.launcher import SidecarProcess


def _wait_prefetched(c: Client, table: str, n: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = int(next(t for t in c.stats()["tables"] if t["table"] == table).get("prefetched", 0))
        if got >= n:
            return got
        time.sleep(0.02)
    return got


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


@torch.no_grad()
def test_an_attachment_prefetches_a_queued_request(tmp_path):
    d = tmp_path / "demo"
    make_demo_tables(d, "engram-paper-demo", 512)
    spec = spec_from_catalog(d)
    with SidecarProcess(d, dram_budget="2MiB") as sc, Client(sc.socket) as c:
        model = EngramDemoModel(spec, c, d_model=64, n_heads=2, seed=3).eval()
        att = model.engram
        ids = torch.randint(0, model.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
        asked = att.prefetch(ids)
        assert asked > 0
        for lid, layer in att.layers.items():
            _wait_prefetched(c, layer.table, 1)
        time.sleep(0.3)
        before = {t["table"]: int(t["misses"]) for t in c.stats()["tables"]}
        model(ids, model.new_cache())
        after = {t["table"]: int(t["misses"]) for t in c.stats()["tables"]}
        assert after == before, "a prefetched request still missed in DRAM"
