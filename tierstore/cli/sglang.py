"""`tierstore sglang --socket S -- ARGS`: sglang's server with its Engram tables from the sidecar.

The sidecar must serve the model's Engram tables split-layout (`tierstore serve
--split-layout all`); see tierstore.client.engines.sglang and docs/engines.md.
"""
from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", required=True, help="the sidecar's unix socket (serve --socket)")
    p.add_argument("--prefix", default="", help="table name prefix of ingest-checkpoint (layer L is table PREFIXlL)")
    p.add_argument("--verify", default="sample", choices=("sample", "all", "off"),
                   help="compare the checkpoint's Engram rows with the arena at load: a spread of rows (default), "
                        "all of them, or none")
    p.add_argument("sglang_args", nargs=argparse.REMAINDER, help="-- then sglang.launch_server's arguments")


def run(args) -> int:
    from tierstore.client.engines.sglang import launch

    rest = args.sglang_args[1:] if args.sglang_args[:1] == ["--"] else args.sglang_args
    return launch(args.socket, rest, prefix=args.prefix, verify=args.verify)
