"""Publish a table version to Mooncake Store, and bring its manifest to another host.

Object layout (keys under ``tierstore/<table>/v<version>/``):
  ``b<block>``      one checksum block as it lies on disk (``block_rows`` records, about 4 KiB)
  ``checksums``     uint64 little-endian [n_blocks], xxh3-64 of each block
  ``manifest``      TableVersion JSON + xxh3 of the checksum list; written LAST
and ``tierstore/<table>/latest`` -> the newest published version number.

One object per checksum block: a random cache miss needs one block, and
bigger objects would multiply the bytes it moves, while a block object verifies
on its own with the catalog's checksum. Mooncake's cost is mostly per object,
so bulk loads (publish, a new host's write-back) pay for the many small ones
(docs/decisions.md, "One remote object per block"; `tierstore bench remote`).

The manifest goes last, so a reader never sees a half-published version; a
re-publish of a version whose manifest exists is a no-op.
"""
from __future__ import annotations

import json
import struct

import numpy as np
import xxhash

from tierstore import bounded_json
from tierstore.store.catalog import MAX_RECORD_BYTES, Catalog, TableVersion, validate_table_name
from tierstore.errors import DataLoss, InvalidArgument, Unavailable, VersionNotFound

__all__ = ["publish", "fetch_manifest", "import_manifest", "import_published", "parse_remote_table", "block_keys",
           "prefix"]

PUT_GROUP_BYTES = 8 << 20   # rows read, verified and put per batch


def prefix(table: str, version: int) -> str:
    return f"tierstore/{table}/v{int(version)}/"


def block_keys(table: str, version: int, blocks) -> list[str]:
    p = prefix(table, version) + "b"
    return [p + str(b) for b in np.asarray(blocks).tolist()]


def _replicate(replicas: int):
    from mooncake.store import ReplicateConfig

    if replicas < 1:
        raise InvalidArgument(f"--replicas must be >= 1, got {replicas}")
    cfg = ReplicateConfig()
    cfg.replica_num = int(replicas)
    cfg.with_hard_pin = True  # a published block is never evicted to make room
    return cfg


def publish(store, data_dir, table: str, version: int | None = None, *, replicas: int = 1) -> tuple[TableVersion, bool]:
    """Write `table` (current version unless `version`) from `data_dir` to Mooncake.

    Rows are read through SegmentReader, so only verified rows leave the host.
    Returns (manifest, published): published is False when the version was
    already there (nothing written). Raises TableNotFound/VersionNotFound,
    ChecksumError (a corrupt local block), Unavailable (a put failed).
    """
    from tierstore.tiers.nvme.reader import SegmentReader

    with Catalog(data_dir, readonly=True) as cat:
        tv = cat.get(table, version)
        sums = cat.checksums(table, tv.number)
    p = prefix(tv.table, tv.number)
    if store.is_exist(p + "manifest") == 1:
        return tv, False
    cfg = _replicate(replicas)
    group = max(1, PUT_GROUP_BYTES // tv.block_bytes)
    with SegmentReader(data_dir, tv, sums) as reader:
        for b0, grid in reader.disk_blocks(group):
            n = grid.shape[0]
            tail = (tv.rows - (tv.n_blocks - 1) * tv.block_rows) * tv.record_bytes  # the last block may be short
            values = [grid[i] if b0 + i < tv.n_blocks - 1 else grid[i, :tail] for i in range(n)]
            # upsert: a publish killed half way leaves blocks behind; re-running overwrites them
            _check(store.upsert_batch(block_keys(tv.table, tv.number, range(b0, b0 + n)), values, cfg),
                   f"blocks {b0}..{b0 + n - 1}")
    raw = np.ascontiguousarray(sums, dtype="<u8").tobytes()
    _check(store.upsert(p + "checksums", raw, cfg), "checksums")
    manifest = json.dumps({"manifest": tv.to_dict(), "checksums_xxh3": xxhash.xxh3_64_intdigest(raw)},
                          sort_keys=True).encode()
    _check(store.upsert(p + "manifest", manifest, cfg), "manifest")
    _check(store.upsert(f"tierstore/{tv.table}/latest", struct.pack("<Q", tv.number), cfg), "latest pointer")
    return tv, True


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise Unavailable(f"Mooncake refused the put of {what} (code {rc}); is the pool large enough "
                          f"for the table x replicas, and are the store processes up?")


def fetch_manifest(store, table: str, version: int | None = None) -> tuple[TableVersion, np.ndarray]:
    """(manifest, checksums) of a published version (default: the latest published).
    Raises VersionNotFound when it is not (fully) published, DataLoss when corrupt."""
    validate_table_name(table)
    if version is None:
        raw = store.get_batch([f"tierstore/{table}/latest"])[0]
        if len(raw) != 8:
            raise VersionNotFound(f"table {table!r} is not published in Mooncake; run `tierstore publish` first")
        version = struct.unpack("<Q", raw)[0]
    p = prefix(table, version)
    head, raw_sums = store.get_batch([p + "manifest", p + "checksums"])
    if not head:
        raise VersionNotFound(f"table {table!r} version {version} is not published in Mooncake")
    try:  # written by a publish, but read from a store other hosts can write: parsed within bounds
        d = bounded_json.loads(head, max_bytes=MAX_RECORD_BYTES)
        tv = TableVersion.from_dict(d["manifest"])
        want = d["checksums_xxh3"]
    except (ValueError, KeyError, TypeError) as e:
        raise DataLoss(f"table {table!r} version {version}: the manifest in Mooncake is refused "
                       f"({type(e).__name__}: {str(e)[:200]}); publish the version again") from None
    if xxhash.xxh3_64_intdigest(raw_sums) != want or len(raw_sums) != 8 * tv.n_blocks:
        raise DataLoss(f"table {table!r} version {version}: the checksum list in Mooncake is corrupt or missing")
    return tv, np.frombuffer(raw_sums, dtype="<u8").copy()


def import_manifest(data_dir, tv: TableVersion, checksums: np.ndarray, *, make_current: bool = True) -> bool:
    """Record a published version in `data_dir`'s catalog (created when missing), rows left
    in Mooncake, and make it current. Keeps the version number, so both hosts name it alike.
    Returns False when the catalog already has that version (nothing recorded)."""
    with Catalog(data_dir) as cat:
        return cat.register_version(tv, checksums, make_current=make_current)


def parse_remote_table(text: str) -> tuple[str, int | None]:
    """'T' (latest published) or 'T@V' -> (table, version or None)."""
    table, at, v = str(text).partition("@")
    if at and not (v.isdigit() and int(v) > 0):
        raise InvalidArgument(f"--remote-table {text!r}: write TABLE or TABLE@VERSION (a positive number)")
    return validate_table_name(table), (int(v) if at else None)


def import_published(data_dir, store, names) -> list[tuple[TableVersion, bool]]:
    """Record each named published table (`T` or `T@V`) in `data_dir`'s catalog before a
    sidecar opens it: [(manifest, newly recorded)]. The version becomes current when named
    explicitly, when the table has none here, or when it is newer than the local current
    one (a host never rolls back on its own). Raises VersionNotFound (not published),
    InvalidArgument (the local catalog holds other rows under that version number)."""
    from tierstore.errors import TableNotFound

    out = []
    for name in names:
        table, version = parse_remote_table(name)
        tv, sums = fetch_manifest(store, table, version)
        with Catalog(data_dir) as cat:
            try:
                cur = cat.current(table).number
            except TableNotFound:
                cur = None
            newer = version is not None or cur is None or tv.number > cur
            out.append((tv, cat.register_version(tv, sums, make_current=newer)))
    return out
