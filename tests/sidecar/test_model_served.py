"""A model whose Engram table is served by the sidecar computes exactly what the
same model computes with the table in process memory: prefill and decode."""
from __future__ import annotations

import pytest
import torch

from tierstore.bench.e2e import in_process_source, spec_from_catalog
from tierstore.client.model.demo_model import EngramDemoModel
from tierstore.client.client import Client
from tierstore.ingest.demo_table import make_demo_tables
from tierstore.sidecar.launcher import SidecarProcess


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("demo")
    make_demo_tables(d, "engram-paper-demo", 512)  # ~20k rows per layer, 5 MiB
    return d


@pytest.mark.parametrize("budget", ["64MiB", "2MiB"], ids=["full-resident", "cache-mode"])
@torch.no_grad()
def test_sidecar_model_equals_in_process_model(demo_data, budget):
    spec = spec_from_catalog(demo_data)
    local = in_process_source(demo_data, spec)
    model = EngramDemoModel(spec, local, d_model=64, n_heads=2, seed=3).eval()
    ids = torch.randint(0, model.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))

    def run():
        cache = model.new_cache()
        outs = [model(ids, cache)]
        nxt = outs[0][:, -1].argmax(-1)
        for _ in range(4):
            outs.append(model.decode_step(nxt, cache))
            nxt = outs[-1].argmax(-1)
        return outs

    expected = run()
    with SidecarProcess(demo_data, dram_budget=budget) as sc, Client(sc.socket) as client:
        model.set_source(client)
        got = run()
        tables = {t["table"]: t for t in client.stats()["tables"]}
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
    if budget == "2MiB":
        assert all(t["mode"] == "cache" and int(t["misses"]) > 0 for t in tables.values())


@pytest.mark.parametrize("field,value", [("seed", 1), ("pad_id", 3), ("compressed_vocab_size", 999)])
def test_a_table_hashed_with_other_constants_is_refused_at_attach(demo_data, field, value):
    """11.4: a table in range for every id but hashed with another seed / pad / vocabulary."""
    import dataclasses

    import numpy as np

    from tierstore.client.model.layer import EngramLayer
    from tierstore.errors import SpecMismatch

    spec = spec_from_catalog(demo_data)
    other = dataclasses.replace(spec, **{field: value})
    with SidecarProcess(demo_data, dram_budget="64MiB") as sc, Client(sc.socket) as client:
        layer = EngramLayer(other, other.layer_ids[0], hidden_size=8, hc_mult=1, source=client)
        with pytest.raises(SpecMismatch, match=f"{field}="):
            layer.prepare(np.zeros((1, 2, spec.columns), dtype=np.int64))
        ok = EngramLayer(spec, spec.layer_ids[0], hidden_size=8, hc_mult=1, source=client)
        ok.prepare(np.zeros((1, 2, spec.columns), dtype=np.int64))
        ok.drop_pending()
