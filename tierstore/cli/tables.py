"""`tierstore tables`: list tables, their current version and older versions."""
from __future__ import annotations

import json
import time

__all__ = ["add_arguments", "run"]


def add_arguments(p) -> None:
    p.add_argument("--data", required=True, help="data directory")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args) -> int:
    from tierstore.store.catalog import Catalog

    with Catalog(args.data, readonly=True) as cat:
        listing = []
        for name in cat.tables():
            cur = cat.current(name)
            listing.append({"table": name, "current": cur.to_dict(),
                            "versions": [v.number for v in cat.versions(name)]})
    if args.json:
        print(json.dumps(listing, indent=2))
        return 0
    print(f"{'TABLE':<12} {'VER':>4} {'ROWS':>12} {'FORMAT':<15} {'DIM':>5} {'SIZE':>10} {'LAYER':>5}  CREATED")
    for t in listing:
        c = t["current"]
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c["created_at"]))
        layer = "-" if c["layer_id"] is None else c["layer_id"]
        older = f"  (versions {t['versions']})" if len(t["versions"]) > 1 else ""
        print(f"{t['table']:<12} {c['version']:>4} {c['rows']:>12} {c['row_format']:<15} {c['row_dim']:>5} "
              f"{c['rows'] * c['row_bytes'] / 1e6:>8.1f}MB {layer:>5}  {created}{older}")
    if not listing:
        print("(no tables)")
    return 0
