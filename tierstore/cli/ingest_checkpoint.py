"""`tierstore ingest-checkpoint`: every Engram layer of a Hugging Face checkpoint -> tables."""
from __future__ import annotations

import json
import sys

__all__ = ["add_arguments", "run"]


def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="checkpoint directory: config.json, model.safetensors.index.json, shards")
    p.add_argument("--data", required=True, help="data directory (created if missing)")
    p.add_argument("--layers", help="comma-separated Engram layer ids (default: all in config.json)")
    p.add_argument("--prefix", default="", help="table name prefix (default none: layer 1 -> l1, the name the "
                   "model side and `tierstore hash` use; with a prefix pass table= to the layers)")
    p.add_argument("--force", action="store_true",
                   help="re-ingest layers whose current version came from the same, untouched shards")
    p.add_argument("--block-rows", type=int, help="rows per checksum block (default: ~4 KiB)")
    p.add_argument("--compare-read", action="store_true",
                   help="also time, in the same run, a plain sequential read of the same bytes and a plain "
                   "copy of them (read, write to the data directory's filesystem, fsync; then removed) and "
                   "print ingest's speed against each")
    p.add_argument("--drop-cache", action="store_true",
                   help="with --compare-read: evict the shards from the page cache before each timed pass")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
    import time

    from tierstore.table.checkpoint import Checkpoint
    from tierstore.errors import InvalidArgument
    from tierstore.ingest.checkpoint import (evict_from_page_cache, ingest_checkpoint, plain_copy_seconds,
                                             plain_read_seconds)

    try:
        layers = None if not args.layers else [int(v) for v in args.layers.split(",") if v.strip()]
    except ValueError:
        raise InvalidArgument(f"--layers must be comma-separated integers, got {args.layers!r}") from None
    plain = copy = None
    if args.compare_read:  # timed first, on the same bytes, in the same run
        ck = Checkpoint(args.checkpoint)
        refs = [r for L in (layers or ck.spec.layer_ids)
                for k, r in ck.engram_tensors(L).items() if k in ("weight", "scale")]

        def timed(fn, *a):
            if args.drop_cache:
                evict_from_page_cache(refs)
            return fn(refs, *a)
        plain = timed(plain_read_seconds)
        copy = timed(plain_copy_seconds, args.data)
        if args.drop_cache:
            evict_from_page_cache(refs)
    t0 = time.perf_counter()
    done = ingest_checkpoint(args.checkpoint, args.data, layers=layers, prefix=args.prefix,
                             progress=not args.quiet, block_rows=args.block_rows, force=args.force)
    secs = time.perf_counter() - t0
    nbytes = sum(tv.nbytes for tv, skipped in done if not skipped)
    out = {"tables": [{"table": tv.table, "version": tv.number, "rows": tv.rows, "layer": tv.layer_id,
                       "bytes": tv.nbytes, "skipped": skipped} for tv, skipped in done],
           "seconds": round(secs, 6), "bytes": nbytes, "MBps": round(nbytes / secs / 1e6, 1) if secs else None}
    if plain is not None and nbytes:
        # seconds to the microsecond: a small checkpoint's plain read takes well under a millisecond
        out["plain_read_seconds"] = round(plain, 6)
        out["speed_vs_plain_read"] = round(plain / secs, 3)
        out["plain_copy_seconds"] = round(copy, 6)
        out["speed_vs_plain_copy"] = round(copy / secs, 3)
    if args.json:
        print(json.dumps(out))
        return 0
    for t in out["tables"]:
        state = "unchanged (the same shards, untouched since; --force to redo)" if t["skipped"] else "ingested"
        print(f"{t['table']} v{t['version']}: layer {t['layer']}, {t['rows']} rows x 264 B, {state}")
    if nbytes:
        line = f"{nbytes / 1e6:.1f} MB in {secs:.2f} s ({out['MBps']} MB/s)"
        if "speed_vs_plain_read" in out:
            line += (f"; plain read of the same bytes {plain:.2f} s -> {out['speed_vs_plain_read']:.2f}x, "
                     f"plain copy (read, write, fsync) {copy:.2f} s -> {out['speed_vs_plain_copy']:.2f}x")
        print(line, file=sys.stderr)
    return 0
