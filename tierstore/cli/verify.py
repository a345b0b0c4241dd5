"""`tierstore verify`: re-read every block and check its xxh3-64 checksum, and every
row against its row checksum (inside its record in segment format 2, in the row-sum
file in format 1).

A block whose bytes fail the catalog's checksum while each of its rows passes its own
row checksum is reported as the catalog's fault, not the segment's: the rows are
served right (a sidecar checks them by their row sums), and re-ingesting is not the
fix. Either way the exit status is 1."""
from __future__ import annotations

import sys

import numpy as np

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
                with SegmentReader(args.data, tv, cat.checksums(name, tv.number)) as r:
                    bad = r.verify()
                if not bad:
                    print(f"{name} v{tv.number}: ok ({tv.n_blocks} blocks, {tv.nbytes / 1e6:.1f} MB, "
                          f"segment format {tv.segment_format})")
                    continue
                bad_total += len(bad)
                with SegmentReader(args.data, tv, cat.checksums(name, tv.number)) as r:
                    sums_wrong = [b for b in bad if _rows_pass(r, tv, b)]
                for b in bad[:20]:
                    seg = b * tv.block_rows // tv.segment_rows
                    off = (b * tv.block_rows - seg * tv.segment_rows) * tv.record_bytes
                    rows = f"rows {b * tv.block_rows}..{min((b + 1) * tv.block_rows, tv.rows) - 1}"
                    if b in sums_wrong:
                        print(f"{name} v{tv.number}: block {b}'s checksum in the catalog ({args.data}/catalog) "
                              f"does not match {tv.segments[seg]} at byte {off}, whose {rows} each pass their "
                              f"own row checksum: the catalog is damaged, not the rows", file=sys.stderr)
                    else:
                        print(f"{name} v{tv.number}: block {b} is corrupt ({rows}, {tv.segments[seg]} at byte "
                              f"{off})", file=sys.stderr)
                if len(bad) > 20:
                    print(f"{name} v{tv.number}: ... {len(bad) - 20} more bad blocks", file=sys.stderr)
                if len(sums_wrong) < len(bad):
                    print(f"{name} v{tv.number}: {len(bad) - len(sums_wrong)} of {tv.n_blocks} blocks corrupt; "
                          f"re-ingest or import the table, or make an older version current", file=sys.stderr)
                if sums_wrong:
                    print(f"{name} v{tv.number}: {len(sums_wrong)} of {tv.n_blocks} block checksums in the "
                          f"catalog are damaged; restore {args.data}/catalog from a backup, or re-ingest or "
                          f"import the table", file=sys.stderr)
    return 1 if bad_total else 0


def _rows_pass(reader, tv, block: int) -> bool:
    """Each row of `block` reads back and passes its own row checksum (False for a version
    without row checksums: a failed block checksum cannot then be told from a damaged row)."""
    from tierstore.errors import DataLoss

    if not reader.verifies_rows:
        return False
    try:
        reader.read_rows(np.arange(block * tv.block_rows, min((block + 1) * tv.block_rows, tv.rows)))
    except (DataLoss, OSError):
        return False
    return True
