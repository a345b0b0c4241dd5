"""`tierstore verify`: re-read every block and check its xxh3-64 checksum, and every
row against its row checksum (inside its record in segment format 2, in the row-sum
file in format 1)."""
from __future__ import annotations

import sys

__all__ = ["add_arguments", "run"]


def add_arguments(p) -> None:
    p.add_argument("--data", required=True, help="data directory")
    p.add_argument("--table", action="append", help="table to check (repeatable; default: all)")
    p.add_argument("--version", type=int, help="version to check (default: current)")
    p.add_argument("--all-versions", action="store_true", help="check every version, not just the current one")


def run(args) -> int:
    from tierstore.store.catalog import Catalog
    from tierstore.tiers.nvme.reader import SegmentReader

    bad_total = 0
    with Catalog(args.data, readonly=True) as cat:
        names = args.table or cat.tables()
        for name in names:
            if args.all_versions:
                versions = cat.versions(name)
            else:
                versions = [cat.get(name, args.version)]
            for tv in versions:
                with SegmentReader(args.data, tv, cat.checksums(name, tv.version)) as r:
                    bad = r.verify()
                if not bad:
                    print(f"{name} v{tv.version}: ok ({tv.n_blocks} blocks, {tv.nbytes / 1e6:.1f} MB, "
                          f"segment format {tv.segment_format})")
                    continue
                bad_total += len(bad)
                for b in bad[:20]:
                    seg = b * tv.block_rows // tv.segment_rows
                    off = (b * tv.block_rows - seg * tv.segment_rows) * tv.record_bytes
                    print(f"{name} v{tv.version}: block {b} is corrupt (rows {b * tv.block_rows}.."
                          f"{min((b + 1) * tv.block_rows, tv.rows) - 1}, {tv.segments[seg]} at byte {off})",
                          file=sys.stderr)
                if len(bad) > 20:
                    print(f"{name} v{tv.version}: ... {len(bad) - 20} more bad blocks", file=sys.stderr)
                print(f"{name} v{tv.version}: {len(bad)} of {tv.n_blocks} blocks corrupt; re-ingest or "
                      f"import the table, or make an older version current", file=sys.stderr)
    return 1 if bad_total else 0
