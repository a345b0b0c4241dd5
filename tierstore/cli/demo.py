"""tierstore demo: a sidecar on a demo table, the demo model served by it vs the
table held in process; checks outputs are identical and prints tokens/s and
per-tier hit ratios, then stops the sidecar."""
from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run", "ensure_demo_table"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="data directory; a demo table is created if absent")
    p.add_argument("--preset", default="engram-paper-demo")
    p.add_argument("--scale", type=int, default=64, help="demo table scale (rows per bucket / S)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results to this JSON file")


def ensure_demo_table(data, preset: str, scale: int) -> None:
    from pathlib import Path

    from tierstore.store.catalog import has_tables

    if has_tables(data):
        return
    from tierstore.ingest.demo_table import make_demo_tables

    print(f"creating demo table {preset} / {scale} in {Path(data)}", flush=True)
    make_demo_tables(data, preset, scale, progress=True)


def run(args) -> int:
    import json

    from tierstore.bench.e2e import run_e2e, summary

    ensure_demo_table(args.data, args.preset, args.scale)
    res = run_e2e(args.data, batch=args.batch, seq=args.seq, decode_tokens=args.decode_tokens,
                  rounds=args.rounds, seed=args.seed)
    print(f"demo model ({res['spec']}, {res['table_bytes'] / 2**20:.0f} MiB of Engram rows), "
          f"batch {res['batch']} x {res['seq']} tokens + {res['decode_tokens']} decode steps:")
    # the step time against the in-process table's: -15% is 15% less time (faster), +15% slower
    print(f"  {'path':<24} {'tokens/s':>10} {'time vs in-process':>19} {'bit-exact':>10}")
    for name, tps in res["tokens_per_s"].items():
        print(f"  {name:<24} {tps:>10.0f} {res['penalty_pct'][name]:>+18.1f}% {str(res['bit_exact'][name]):>10}")
    for side, tables in res["sidecar_tiers"].items():
        for t, s in tables.items():
            if s["mode"] == "full":
                print(f"  {side} {t}: full-resident arena, every row from DRAM (slot == id, no Plan RPC)")
            else:
                print(f"  {side} {t}: cache mode, DRAM hit ratio {s['hit_ratio']:.3f} "
                      f"({s['hits']} hits, {s['misses']} promoted from NVMe)")
    print(summary(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if all(res["bit_exact"].values()) else 1
