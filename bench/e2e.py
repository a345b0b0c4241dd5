"""End to end: the demo model with Engram served by the sidecar vs the table in process.

The same model (weights from a seed) runs over the same tokens with two
RowSources: an InProcessTable holding the rows read from disk, and the sidecar
Client. Outputs must be bit-identical (same rows, same kernels); tokens/s are
measured in interleaved rounds so machine noise hits both alike.

Variants: `sidecar` serves a full-resident arena (slot == id: no Plan RPC at
all, rows read straight from shared memory); `sidecar-cache` serves from a
cache-mode arena (DRAM budget below the table), planning at model entry (the
attach hook) and collecting at the Engram block, so the Plan RPC and any NVMe
promotion overlap the first blocks; `sidecar-cache-no-overlap` waits for each
plan before the model goes on (what a naive integration does).
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from tierstore.bench.lookup import BENCH_SIDECAR_FLAGS
from tierstore.client.model.source import RowSource
from tierstore.store.catalog import Catalog
from tierstore.table.spec import EngramSpec
from tierstore.tiers.nvme.reader import SegmentReader


def spec_from_catalog(data_dir) -> EngramSpec:
    """The EngramSpec stored with the data directory's tables (all layers must agree)."""
    with Catalog(data_dir, readonly=True) as cat:
        specs = {t: cat.current(t).spec for t in cat.tables()}
    found = {repr(sorted(s.items())) for s in specs.values() if s}
    if len(found) != 1:
        raise ValueError(f"tables in {data_dir} carry {len(found)} different Engram specs; "
                         f"create them with one `tierstore demo-table` run")
    return EngramSpec.from_dict(next(s for s in specs.values() if s))


def in_process_source(data_dir, spec: EngramSpec):
    """An InProcessTable holding every layer's rows exactly as stored on disk (verified on read)."""
    from tierstore.client.model.in_process_table import InProcessTable

    src = InProcessTable(spec)
    with Catalog(data_dir, readonly=True) as cat:
        for layer in spec.layer_ids:
            v = cat.current(spec.table_name(layer))
            reader = SegmentReader(data_dir, v, cat.checksums(v.table, v.number))
            try:
                src.add(v.table, reader.read_range(0, v.rows), version=v.number)
            finally:
                reader.close()
    return src


class BlockingSource(RowSource):
    """Wraps a RowSource so each plan completes before the caller goes on (no overlap)."""

    def __init__(self, source):
        self.source = source

    def plan(self, table, ids):
        handle = self.source.plan(table, ids)
        handle.slots()
        return handle

    def table_info(self, table):
        return self.source.table_info(table)


def _tokens(spec, vocab, batch, seq, seed):
    g = torch.Generator().manual_seed(seed)
    # Zipf-ish tokens, as text: many repeats, so dedupe and caches have work to do
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    probs = ranks ** -1.1
    return torch.multinomial(probs / probs.sum(), batch * seq, replacement=True, generator=g).reshape(batch, seq)


def _sidecar_stats(client) -> dict:
    out = {}
    for t in client.stats()["tables"]:
        hits, misses = int(t["hits"]), int(t["misses"])
        out[t["table"]] = dict(mode=t["mode"], hits=hits, misses=misses,
                               hit_ratio=hits / max(1, hits + misses))
    return out


_COUNTERS = ("tokens", "rows_read", "rows_fetched", "refresh_bytes", "h2d_bytes")


def _tier_traffic(model, run, rounds: int, hbm_rows: int) -> dict:
    """HBM hit ratio and host -> device bytes per token over `rounds` runs, with an
    adaptive HBMCache of `hbm_rows` rows per layer (starting empty) or none."""
    from tierstore.client.model.hbm_cache import HBMCache

    layers = model.engram_layers.values()
    for layer in layers:
        layer.hbm_cache = HBMCache.from_source(layer.source, layer.table, hbm_rows, "cpu") if hbm_rows else None
    try:
        before = model.engram.stats()["all"]
        for _ in range(rounds):
            run()
        after = model.engram.stats()["all"]
    finally:
        for layer in layers:
            layer.hbm_cache = None
    d = {k: after[k] - before[k] for k in _COUNTERS}
    return {"hbm_rows_per_layer": hbm_rows, "hbm_hit_ratio": 1 - d["rows_fetched"] / max(1, d["rows_read"]),
            "h2d_bytes_per_token": d["h2d_bytes"] / max(1, d["tokens"]),
            "refresh_bytes_per_token": d["refresh_bytes"] / max(1, d["tokens"])}


@torch.no_grad()
def run_e2e(data_dir, *, batch: int = 4, seq: int = 256, decode_tokens: int = 8, rounds: int = 3,
            seed: int = 0, cache_budget_fraction: float | None = 0.25, threads: int | None = None,
            log=print) -> dict:
    """Run the comparison; returns a dict of results (tokens/s, ratios, equality, hit ratios)."""
    from tierstore.client.model.demo_model import EngramDemoModel
    from tierstore.client.client import Client
    from tierstore.sidecar.launcher import SidecarProcess

    if threads:
        torch.set_num_threads(threads)
    data_dir = Path(data_dir)
    spec = spec_from_catalog(data_dir)
    table_bytes = sum(spec.rows(l) * spec.row_bytes for l in spec.layer_ids)
    in_process = in_process_source(data_dir, spec)
    model = EngramDemoModel(spec, in_process, seed=seed).eval()
    ids = _tokens(spec, model.vocab_size, batch, seq, seed)

    def forward_and_decode():
        cache = model.new_cache()
        logits = model(ids, cache)
        nxt = logits[:, -1].argmax(-1)
        steps = [logits]
        for _ in range(decode_tokens):
            step = model.decode_step(nxt, cache)
            steps.append(step[:, None])
            nxt = step.argmax(-1)
        return steps

    sidecars = {"sidecar": dict(budget=f"{int(table_bytes * 1.5) + (64 << 20)}")}
    if cache_budget_fraction:
        sidecars["sidecar-cache"] = dict(budget=str(max(1 << 20, int(table_bytes * cache_budget_fraction))))
    procs, clients = {}, {}
    try:
        for name, cfg in sidecars.items():
            procs[name] = SidecarProcess(data_dir, dram_budget=cfg["budget"], extra_args=BENCH_SIDECAR_FLAGS).start()
            clients[name] = Client(procs[name].socket)
        sources = {"in-process": in_process, "sidecar": clients["sidecar"]}
        if "sidecar-cache" in clients:
            sources["sidecar-cache"] = clients["sidecar-cache"]
            sources["sidecar-cache-no-overlap"] = BlockingSource(clients["sidecar-cache"])

        reference = None
        exact = {}
        times = {name: [] for name in sources}
        for r in range(rounds + 1):  # the first round is the warm-up
            for name, src in sources.items():
                model.set_source(src)
                t0 = time.perf_counter()
                outs = forward_and_decode()
                dt = time.perf_counter() - t0
                if r == 0:
                    if reference is None:
                        reference = outs
                    exact[name] = all(torch.equal(a, b) for a, b in zip(reference, outs))
                else:
                    times[name].append(dt)
        tokens = batch * (seq + decode_tokens)
        med = {n: float(np.median(t)) for n, t in times.items()}
        res = {
            "batch": batch, "seq": seq, "decode_tokens": decode_tokens, "rounds": rounds, "seed": seed,
            "table_bytes": table_bytes, "spec": spec.name,
            "tokens_per_s": {n: tokens / med[n] for n in med},
            "ratio_to_in_process": {n: med["in-process"] / med[n] for n in med},
            "penalty_pct": {n: 100.0 * (med[n] / med["in-process"] - 1.0) for n in med},
            "bit_exact": exact,
            "sidecar_tiers": {n: _sidecar_stats(c) for n, c in clients.items()},
        }
        # per-tier traffic of the client: without an HBM tier, and with an adaptive one of 2% of the rows
        model.set_source(sources.get("sidecar-cache", clients["sidecar"]))
        hbm_rows = max(1, min(spec.rows(l) for l in spec.layer_ids) // 50)
        res["client_tiers"] = {"no-hbm": _tier_traffic(model, forward_and_decode, rounds, 0),
                               "hbm-adaptive": _tier_traffic(model, forward_and_decode, rounds, hbm_rows)}
        return res
    finally:
        model.set_source(in_process)
        for c in clients.values():
            c.close()
        for p in procs.values():
            p.cleanup()


def summary(res: dict) -> str:
    tps, pen = res["tokens_per_s"], res["penalty_pct"]
    parts = [f"{n} {tps[n]:.0f} tok/s ({pen[n]:+.1f}% time)" for n in tps]
    exact = "bit-exact" if all(res["bit_exact"].values()) else f"NOT exact: {res['bit_exact']}"
    tiers = "".join(f"; {n}: HBM hit {t['hbm_hit_ratio']:.3f}, {t['h2d_bytes_per_token']:.0f} B/token host->device"
                    for n, t in res.get("client_tiers", {}).items())
    return "e2e: " + ", ".join(parts) + f"; outputs {exact}" + tiers


def run_e2e_bench(data_dir, out_dir, *, quick: bool = False, seed: int = 0, rounds: int | None = None) -> dict:
    """`tierstore bench e2e`: run_e2e sized for the bench (rounds: default 5, quick 2), plus its PNG."""
    from tierstore.bench.plots import plot_e2e

    res = run_e2e(data_dir, batch=2 if quick else 4, seq=64 if quick else 256, decode_tokens=4 if quick else 16,
                  rounds=rounds or (2 if quick else 5), seed=seed)
    res["plot"] = str(plot_e2e(res, Path(out_dir) / "e2e.png"))
    res["units"] = {"tokens_per_s": "tokens/s", "penalty_pct": "% time vs in-process", "table_bytes": "B",
                    "*_bytes_per_token": "B/token"}
    res["summary"] = summary(res)
    return res
