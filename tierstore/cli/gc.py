"""tierstore gc: remove table versions nobody serves.

Keeps, for every table, its current version and the `--keep` newest versions,
and every version a running sidecar serves (each holds a shared lock on the
version's directory). Prints what it removes; `--dry-run` only prints.
"""
from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="data directory")
    p.add_argument("--keep", type=int, default=2, help="newest versions kept per table besides the current (default 2)")
    p.add_argument("--table", help="only this table")
    p.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")


def run(args) -> int:
    from tierstore.store.catalog import Catalog

    if args.keep < 0:
        raise ValueError(f"--keep must be >= 0, got {args.keep}")
    with Catalog(args.data) as cat:
        tables = [args.table] if args.table else cat.tables()
        removed, kept_served = [], []
        for t in tables:
            r, s = cat.collect_garbage(t, keep=args.keep, dry_run=args.dry_run)
            removed += [(t, v) for v in r]
            kept_served += [(t, v) for v in s]
    verb = "would remove" if args.dry_run else "removed"
    for t, v in removed:
        print(f"{verb} {t} v{v}")
    for t, v in kept_served:
        print(f"kept {t} v{v}: a running sidecar serves it")
    if not removed:
        print("nothing to remove")
    return 0
