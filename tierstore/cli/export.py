"""`tierstore export`: one table version -> a zstd-compressed portable file."""
from __future__ import annotations

import sys

__all__ = ["add_arguments", "run"]


def add_arguments(p) -> None:
    p.add_argument("--data", required=True, help="data directory")
    p.add_argument("--table", required=True, help="table to export")
    p.add_argument("--version", type=int, help="version (default: current)")
    p.add_argument("--out", required=True, help="output file")
    p.add_argument("--level", type=int, default=3, help="zstd level (default 3)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
    import os

    from tierstore.errors import DataLoss
    from tierstore.ingest.portable import export_table

    try:
        tv = export_table(args.data, args.table, args.out, version=args.version, level=args.level,
                          progress=not args.quiet)
    except DataLoss as e:
        print(f"tierstore export: error: {e}", file=sys.stderr)
        return 1
    size = os.path.getsize(args.out)
    print(f"{tv.table} v{tv.number}: {tv.nbytes / 1e6:.1f} MB -> {args.out} ({size / 1e6:.1f} MB)")
    return 0
