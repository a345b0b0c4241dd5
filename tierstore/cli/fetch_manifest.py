"""`tierstore fetch-manifest`: record a published version in a local catalog, rows left in
Mooncake, so `tierstore serve --remote` serves it on a host with no copy of the rows.
`serve --remote-table T` does the same at start-up; this is the step by hand."""
from __future__ import annotations

__all__ = ["add_arguments", "run"]


def add_arguments(p) -> None:
    p.add_argument("--data", required=True, help="data directory (created when missing)")
    p.add_argument("--table", required=True, help="published table")
    p.add_argument("--version", type=int, help="version (default: the latest published)")
    p.add_argument("--mooncake", required=True, help="Mooncake master HOST:PORT (or mooncake://HOST:PORT)")
    p.add_argument("--metadata", required=True, help="Mooncake metadata URL")


def run(args) -> int:
    from tierstore.tiers.remote.mooncake import connect
    from tierstore.tiers.remote.publish import fetch_manifest, import_manifest

    store = connect(args.mooncake, args.metadata)
    try:
        tv, sums = fetch_manifest(store, args.table, args.version)
    finally:
        store.close()
    new = import_manifest(args.data, tv, sums)
    print(f"{tv.table} v{tv.number}: {tv.rows} rows x {tv.row_bytes} B "
          f"{'recorded' if new else 'already recorded'} in {args.data} (rows stay in Mooncake)")
    return 0
