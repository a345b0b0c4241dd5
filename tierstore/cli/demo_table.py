"""`tierstore demo-table`: deterministic synthetic tables with a preset's layout."""
from __future__ import annotations

import sys

__all__ = ["add_arguments", "run"]


def add_arguments(p) -> None:
    p.add_argument("--preset", required=True, help="Engram preset (e.g. engram-paper-demo, deepseek-v4.1-flash)")
    p.add_argument("--scale", type=int, default=1, help="divide every bucket count by this (default 1: full size)")
    p.add_argument("--data", required=True, help="data directory (created if missing)")
    p.add_argument("--seed", type=int, default=0, help="value seed; same seed, same bytes")
    p.add_argument("--format", dest="row_format", choices=["fp32", "bf16", "fp16", "fp8-e4m3-ue8m0"],
                   help="row format (default: the preset's)")
    p.add_argument("--dim", type=int, help="values per row (default: the preset's)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
    from tierstore.ingest.demo_table import make_demo_tables
    from tierstore.errors import ResourceExhausted

    try:
        made = make_demo_tables(args.data, args.preset, args.scale, seed=args.seed, row_format=args.row_format,
                                row_dim=args.dim, progress=not args.quiet)
    except ResourceExhausted as e:
        print(f"tierstore demo-table: error: {e}", file=sys.stderr)
        return 1
    for tv in made:
        print(f"{tv.table} v{tv.number}: {tv.rows} rows x {tv.row_dim} {tv.row_format} "
              f"({tv.nbytes / 1e6:.1f} MB)")
    return 0
