"""`tierstore ingest`: a checkpoint tensor -> a new current table version."""
from __future__ import annotations

import sys

__all__ = ["add_arguments", "run"]


def add_arguments(p) -> None:
    p.add_argument("src", help="checkpoint: .safetensors, .npy or a torch state dict (torch.save)")
    p.add_argument("--data", required=True, help="data directory (created if missing)")
    p.add_argument("--table", help="table name (default: the preset's name for --layer, e.g. l1)")
    p.add_argument("--key", help="tensor to ingest, when the file holds several")
    p.add_argument("--scale-key", help="ue8m0 block scales [rows, dim/32] of an fp8 tensor")
    p.add_argument("--format", dest="row_format", choices=["fp32", "bf16", "fp16", "fp8-e4m3-ue8m0"],
                   help="stored row format (default: from the dtype; another float format converts)")
    p.add_argument("--preset", help="check rows/width against this Engram preset and store its spec")
    p.add_argument("--layer", type=int, help="Engram layer id the table serves (with --preset)")
    p.add_argument("--scale", type=int, default=1, help="preset scale-down factor (demo tables)")
    p.add_argument("--block-rows", type=int, help="rows per checksum block (default: ~16 KiB)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
    from tierstore.errors import DataLoss, ResourceExhausted
    from tierstore.ingest.tensor_file import ingest_file

    try:
        tv = ingest_file(args.src, args.data, args.table, key=args.key, scale_key=args.scale_key,
                         row_format=args.row_format, preset=args.preset, layer=args.layer, scale=args.scale,
                         progress=not args.quiet, block_rows=args.block_rows)
    except (DataLoss, ResourceExhausted) as e:
        print(f"tierstore ingest: error: {e}", file=sys.stderr)
        return 1
    print(f"{tv.table} v{tv.number}: {tv.rows} rows x {tv.row_dim} {tv.row_format} "
          f"({tv.nbytes / 1e6:.1f} MB) from {tv.source}")
    return 0
