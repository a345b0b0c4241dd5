"""`tierstore import`: a portable file -> a new current table version (verified)."""
from __future__ import annotations

import sys

__all__ = ["add_arguments", "run"]


def add_arguments(p) -> None:
    p.add_argument("file", help="portable file written by `tierstore export`")
    p.add_argument("--data", required=True, help="data directory (created if missing)")
    p.add_argument("--table", help="table name (default: the exported table's name)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
    from tierstore.errors import DataLoss, ResourceExhausted
    from tierstore.ingest.portable import import_table

    try:
        tv = import_table(args.file, args.data, args.table, progress=not args.quiet)
    except (DataLoss, ResourceExhausted) as e:
        print(f"tierstore import: error: {e}", file=sys.stderr)
        return 1
    print(f"{tv.table} v{tv.number}: {tv.rows} rows x {tv.row_dim} {tv.row_format} imported")
    return 0
