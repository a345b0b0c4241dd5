"""`tierstore sglang --socket S -- ARGS`: sglang's server with its Engram tables from the sidecar.

Tables the sidecar serves split-layout (`tierstore serve --split-layout all`) are
mapped as sglang's host tables; the others (cache mode: tables larger than RAM)
are staged per batch by tierstore's row stager (`--stage`); see
tierstore.client.engines.sglang, sglang_stager and docs/engines.md.
"""
from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", required=True, help="the sidecar's unix socket (serve --socket)")
    p.add_argument("--prefix", default="", help="table name prefix of ingest-checkpoint (layer L is table PREFIXlL)")
    p.add_argument("--verify", default="sample", choices=("sample", "all", "off"),
                   help="check the checkpoint's Engram tensors at load: sampled rows and the shard's identity "
                        "(default), every byte, or the shape only (docs/engines.md, the checkpoint check)")
    p.add_argument("--stage", default="auto", choices=("auto", "on", "off"),
                   help="which layers tierstore's row stager serves ahead of each forward: those whose table is "
                        "not split-layout (auto, default: cache mode, tables larger than RAM), all, or none")
    p.add_argument("sglang_args", nargs=argparse.REMAINDER, help="-- then sglang.launch_server's arguments")


def run(args) -> int:
    from tierstore.client.engines.sglang import launch

    rest = args.sglang_args[1:] if args.sglang_args[:1] == ["--"] else args.sglang_args
    return launch(args.socket, rest, prefix=args.prefix, verify=args.verify, stage=args.stage)
