"""`tierstore tokenizer-map`: build the compression map from a tokenizer.json."""
from __future__ import annotations

import argparse
import json

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("tokenizer_json", metavar="TOKENIZER_JSON", help="a Hugging Face tokenizer.json (read offline)")
    p.add_argument("--out", required=True, metavar="FILE",
                   help="FILE.npy (spec, if any, beside it as FILE.spec.json) or FILE.npz (map and spec in one)")
    p.add_argument("--preset", help="also save this preset's spec, with C set to the map's size")
    p.add_argument("--scale", type=int, default=1, help="scale of the saved spec (with --preset)")


def run(args) -> int:
    from tierstore.table.spec import preset
    from tierstore.table.tokenizer_map import build_compression_map, describe, save_map

    cmap = build_compression_map(args.tokenizer_json)
    spec = preset(args.preset, args.scale) if args.preset else None
    path = save_map(args.out, cmap, spec)
    print(json.dumps({"out": str(path), **describe(cmap)}))
    return 0
