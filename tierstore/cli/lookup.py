"""tierstore lookup: read rows from a running sidecar, for humans.

--ids and --table are checked before connecting: ids are ASCII decimal integers
(no `1_000`, no other scripts' digits, at least one), the table a valid table name;
anything else is one line naming the input and exit 2."""
from __future__ import annotations

import argparse
import re

__all__ = ["add_arguments", "run"]

_IDS = re.compile(r"\s*(-?[0-9]+\s*)?(,\s*(-?[0-9]+\s*)?)*", re.ASCII)  # empty items are skipped


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

    ids = _ids(args.ids)
    _table(args.table)
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


def _shown(text: str) -> str:
    """`text` for an error line: escaped, and a bounded prefix of a long one."""
    return ascii(text) if len(text) <= 80 else f"{ascii(text[:64])}... ({len(text)} characters)"


def _ids(text: str):
    """--ids as int64 ids; InvalidArgument naming the input for anything but ASCII decimal integers."""
    import numpy as np

    from tierstore.errors import InvalidArgument

    if not _IDS.fullmatch(text):
        raise InvalidArgument(f"--ids must be comma-separated integers, got {_shown(text)}; e.g. --ids 1,2,3")
    try:
        ids = np.array([int(x) for x in text.split(",") if x.strip()], dtype=np.int64)
    except OverflowError:
        raise InvalidArgument(f"--ids holds an id beyond int64 ({_shown(text)}); row ids are 0..rows-1") from None
    if ids.size == 0:
        raise InvalidArgument(f"--ids names no row id, got {_shown(text)}; e.g. --ids 1,2,3")
    return ids


def _table(name: str) -> str:
    from tierstore.errors import InvalidArgument
    from tierstore.store.version import validate_table_name

    try:
        return validate_table_name(name)
    except InvalidArgument:
        raise InvalidArgument(f"--table {_shown(name)} is not a table name: use 1-64 characters from "
                              f"[A-Za-z0-9_.-], starting with a letter or digit (`tierstore tables` lists them)") \
            from None
