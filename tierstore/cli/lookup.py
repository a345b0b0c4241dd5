"""tierstore lookup: read rows from a running sidecar, for humans."""
from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", required=True, help="the sidecar's unix socket")
    p.add_argument("--table", required=True)
    p.add_argument("--ids", required=True, help="comma-separated row ids, e.g. 1,2,3")
    p.add_argument("--inline", action="store_true", help="fetch rows inside the gRPC reply instead of the arena")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--hex", action="store_true", help="raw row bytes as hex (default)")
    out.add_argument("--json", action="store_true", help="dequantised values as JSON")


def run(args) -> int:
    import json

    import numpy as np

    from tierstore.client.client import Client
    from tierstore.table.formats import decode_rows

    try:
        ids = np.array([int(x) for x in args.ids.split(",") if x.strip()], dtype=np.int64)
    except ValueError:
        raise ValueError(f"--ids must be comma-separated integers, got {args.ids!r}") from None
    except OverflowError:
        raise ValueError(f"--ids holds an id beyond int64 ({args.ids[:80]!r}); row ids are 0..rows-1") from None
    with Client(args.socket, timeout=10.0) as c:
        info = c.table_info(args.table)
        rows = c.lookup(args.table, ids, inline=args.inline)
    if args.json:
        vals = decode_rows(rows, info["row_format"], info["row_dim"])
        print(json.dumps({"table": args.table, "version": info["version"], "row_format": info["row_format"],
                          "rows": {str(i): v.tolist() for i, v in zip(ids.tolist(), vals)}}))
    else:
        for i, r in zip(ids.tolist(), rows):
            print(f"{i}\t{r.tobytes().hex()}")
    return 0
