"""tierstore profile: count which Engram rows token traces read, per table (hot set)."""
from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("tokens", nargs="+", help=".npy files of token ids ([T] or [B, T]) or, with --tokenizer, .txt files")
    p.add_argument("--out", required=True, help="profile file to write (.npz)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="Engram preset the ids are hashed with")
    src.add_argument("--data", help="take the spec from this data directory's tables")
    p.add_argument("--scale", type=int, default=1, help="with --preset: demo table scale")
    p.add_argument("--tokenizer", help="tokenizer.json (tokenizes .txt inputs) or a compression map (.npy/.npz)")
    p.add_argument("--raw-ids", action="store_true", help=".npy ids are raw tokenizer ids (needs --tokenizer)")
    p.add_argument("--top", type=int, help="keep the TOP hottest rows per table")


def run(args) -> int:
    from pathlib import Path

    import numpy as np

    from tierstore.table.hasher import NgramHasher
    from tierstore.table.profile import build_profile
    from tierstore.table.spec import preset

    if args.preset:
        spec = preset(args.preset, args.scale)
    else:
        from tierstore.bench.e2e import spec_from_catalog
        spec = spec_from_catalog(args.data)
    cmap, tok = None, None
    if args.tokenizer:
        from tierstore.table.tokenizer_map import load_or_build
        cmap, _ = load_or_build(args.tokenizer)
        if args.tokenizer.endswith(".json"):
            from tokenizers import Tokenizer
            tok = Tokenizer.from_file(args.tokenizer)
    if (args.raw_ids or any(f.endswith(".txt") for f in args.tokens)) and cmap is None:
        raise ValueError("raw ids and .txt inputs need --tokenizer (tokenizer.json or a compression map)")
    hasher = NgramHasher(spec, compression_map=cmap)

    def sequences():
        for f in args.tokens:
            if f.endswith(".txt"):
                if tok is None:
                    raise ValueError(f"{f}: tokenizing text needs --tokenizer tokenizer.json")
                yield np.asarray(tok.encode(Path(f).read_text(), add_special_tokens=False).ids, dtype=np.int64)
            else:
                yield np.load(f)

    raw = cmap is not None and (args.raw_ids or any(f.endswith(".txt") for f in args.tokens))
    prof = build_profile(spec, sequences(), hasher=hasher, top=args.top, raw=raw)
    path = prof.save(args.out)
    for t in sorted(prof.ids):
        c = prof.counts[t]
        head = c[: max(1, len(c) // 100)].sum() / max(1, c.sum())
        print(f"{t}: {len(c)} distinct rows over {prof.tokens} tokens; the hottest 1% take {head:.1%} of reads")
    print(f"wrote {path}")
    return 0
