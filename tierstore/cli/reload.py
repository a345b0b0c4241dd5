"""tierstore reload: make a running sidecar serve another table version, live.

The sidecar builds the new version's arena aside (verified), then swaps it in
at a step boundary: steps already planned finish on the old version, new
steps get the new one, no step mixes the two, clients switch without being
recreated, and the old arena is freed when its last lease ends.

    tierstore ingest new.safetensors --data D --table l1   # new version, made current
    tierstore reload --socket S                            # serve every table's current version
    tierstore reload --socket S --table l1 --version 3     # roll back (or forward) to version 3
"""
from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", required=True, help="the sidecar's unix socket")
    p.add_argument("--table", default="", help="only this table (default: every table in the catalog)")
    p.add_argument("--version", type=int, default=0,
                   help="serve this version of --table (default: the catalog's current version)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (a full arena loads first)")


def run(args) -> int:
    from tierstore.client.client import Client

    if args.version < 0:
        raise ValueError(f"--version must be a positive version number, got {args.version}")
    with Client(args.socket, timeout=args.timeout) as c:
        changed = c.reload(args.table, args.version)
    for table, old, new in changed:
        print(f"{table}: v{old} -> v{new}" if old else f"{table}: now served at v{new}")
    if not changed:
        print("nothing to change: the sidecar already serves those versions")
    return 0
