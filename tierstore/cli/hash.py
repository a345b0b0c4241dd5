"""`tierstore hash`: token ids -> Engram row ids of one layer, printed as JSON."""
from __future__ import annotations

import argparse
import json

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="deepseek-v4.1-flash", help="model preset (default: %(default)s)")
    p.add_argument("--layer", type=int, required=True, help="Engram layer id, e.g. 1")
    p.add_argument("--ids", required=True,
                   help="comma-separated token ids of one sequence, e.g. 0,1,2,3 (compressed ids unless --raw-ids)")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="take the spec from a Hugging Face checkpoint's config.json (DeepSeek-V4.1) instead of "
                        "--preset; image-token positions are dead")
    p.add_argument("--scale", type=int, default=1, help="divide bucket counts by S, as demo tables do (default 1)")
    p.add_argument("--raw-ids", action="store_true", help="--ids are raw tokenizer ids: map them first")
    p.add_argument("--tokenizer", metavar="MAP",
                   help="compression map (.npy/.npz from `tierstore tokenizer-map`) or a tokenizer.json; "
                        "its C replaces the preset's")


def _parse_ids(text: str) -> list[int]:
    from tierstore.errors import InvalidArgument
    try:
        return [int(v) for v in text.replace(" ", "").split(",") if v != ""]
    except ValueError:
        raise InvalidArgument(f"--ids must be comma-separated integers, got {text!r}") from None


def run(args) -> int:
    import numpy as np

    from tierstore.table.hasher import NgramHasher
    from tierstore.table.hf_config import spec_from_config
    from tierstore.table.spec import preset
    from tierstore.table.tokenizer_map import load_or_build
    from tierstore.errors import InvalidArgument

    spec = spec_from_config(args.checkpoint) if args.checkpoint else preset(args.preset, args.scale)
    ids = np.asarray(_parse_ids(args.ids), dtype=np.int64)
    if args.raw_ids and not args.tokenizer:
        raise InvalidArgument("--raw-ids needs --tokenizer MAP.npy or tokenizer.json to map raw ids")
    hasher = NgramHasher(spec, load_or_build(args.tokenizer) if args.tokenizer else None)
    compressed = hasher.map_raw(ids) if args.raw_ids else ids
    # image_token_id is a raw id: compare it with raw ids (compressed ids equal raw ones without a map)
    dead = hasher.dead_mask(ids) if args.raw_ids or not args.tokenizer else None
    rows = hasher.hash(compressed, args.layer, dead=dead)
    out = {"preset": spec.name, "layer": args.layer, "table": spec.table_name(args.layer),
           "rows": hasher.spec.rows(args.layer), "columns": hasher.columns,
           "compressed_vocab_size": hasher.vocab, "pad_id": hasher.pad,
           "input_ids": ids.tolist(), "compressed_ids": compressed.tolist(), "ids": rows.tolist()}
    print(json.dumps(out))
    return 0
