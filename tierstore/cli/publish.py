"""`tierstore publish`: one table version -> Mooncake Store (rows, checksums, manifest last)."""
from __future__ import annotations

import sys

__all__ = ["add_arguments", "run"]


def add_arguments(p) -> None:
    p.add_argument("--data", required=True, help="data directory holding the version")
    p.add_argument("--table", required=True, help="table to publish")
    p.add_argument("--version", type=int, help="version (default: current)")
    p.add_argument("--mooncake", required=True, help="Mooncake master HOST:PORT (or mooncake://HOST:PORT)")
    p.add_argument("--metadata", required=True, help="Mooncake metadata URL, e.g. http://HOST:8080/metadata")
    p.add_argument("--replicas", type=int, default=1, help="copies of each block in the pool (default 1)")


def run(args) -> int:
    import time

    from tierstore.tiers.remote.mooncake import connect
    from tierstore.tiers.remote.publish import publish

    store = connect(args.mooncake, args.metadata)
    try:
        t0 = time.monotonic()
        tv, done = publish(store, args.data, args.table, args.version, replicas=args.replicas)
    finally:
        store.close()
    if not done:
        print(f"{tv.table} v{tv.number}: already published; nothing written")
        return 0
    dt = time.monotonic() - t0
    print(f"{tv.table} v{tv.number}: {tv.n_blocks} blocks, {tv.nbytes / 1e6:.1f} MB x {args.replicas} replicas "
          f"published in {dt:.2f}s ({tv.nbytes / 1e6 / max(dt, 1e-9):.0f} MB/s)", file=sys.stdout)
    return 0
