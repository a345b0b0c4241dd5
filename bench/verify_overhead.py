"""Cost of online verification (--verify-sample) on lookup throughput.

Cache-mode sidecars with P = 0 (off), the default 0.001 and 0.01 serve the same
Zipf batches in interleaved rounds; the result is each one's rows/s as a ratio
to verification off. Run: python -m tierstore.bench.verify_overhead --data DIR
"""
from __future__ import annotations

import argparse
import json

from tierstore.bench.lookup import BENCH_SIDECAR_FLAGS, _Arena, run_rounds, summarize
from tierstore.bench.workload import make_batches


def run_verify_overhead(data_dir, *, table: str | None = None, samples=(0.0, 0.001, 0.01), batch: int = 32768,
                        budget_fraction: float = 0.10, batches: int = 8, rounds: int = 5, seed: int = 0) -> dict:
    from tierstore.store.catalog import Catalog
    from tierstore.client.client import Client
    from tierstore.sidecar.launcher import SidecarProcess

    with Catalog(data_dir, readonly=True) as cat:
        tables = [cat.current(t) for t in cat.tables()]
    v = next(t for t in tables if table in (None, t.table))
    budget = int(sum(t.nbytes for t in tables) * budget_fraction)
    ids = make_batches("zipf1.0", v.rows, batch, batches * (rounds + 1), seed)
    procs, clients, fns = [], [], {}
    try:
        for p in samples:
            sc = SidecarProcess(data_dir, dram_budget=budget, extra_args=[*BENCH_SIDECAR_FLAGS, "--verify-sample", p]).start()
            procs.append(sc)
            c = Client(sc.socket)
            clients.append(c)
            cap = c.tables()[0]["arena_slots"]
            fns[f"P={p:g}"] = _Arena(c, v.table, piece=max(1, cap // 2)).get
        timings = run_rounds(fns, ids[:batches], rounds,
                             round_batches=[ids[(r + 1) * batches:(r + 2) * batches] for r in range(rounds)])
        res = summarize(timings, batch * batches, ref="P=0")
        for d in res.values():
            d["ratio_vs_off"] = d.pop("ratio_vs_ceiling")
        return {"table": v.table, "batch": batch, "budget_bytes": budget, "competitors": res}
    finally:
        for c in clients:
            c.close()
        for sc in procs:
            sc.cleanup()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--table")
    a = ap.parse_args()
    r = run_verify_overhead(a.data, table=a.table)
    print(json.dumps(r["competitors"], indent=1, default=float))
    print("verify overhead: " + ", ".join(f"{k} {d['ratio_vs_off']:.3f}x of off ({d['rows_per_s'] / 1e6:.2f} M rows/s)"
                                          for k, d in r["competitors"].items()))
