"""A table version's manifest (TableVersion) and the rules its names and records obey.

The catalog (catalog.py) stores one JSON record per version; this module
parses and validates them, so a record damaged on disk or a hostile manifest
from a remote store (tiers/remote/reader.py) is refused with a clear error.
"""
from __future__ import annotations

import re
from dataclasses import MISSING, asdict, dataclass
from pathlib import Path

from tierstore.errors import DataLoss, InvalidArgument

__all__ = ["FORMATS", "LATEST_FORMAT", "TableVersion", "record_bytes", "validate_table_name"]

FORMATS = (1, 2)  # segment formats this build reads (TableVersion)
LATEST_FORMAT = 2  # what writers write


def record_bytes(row_bytes: int, segment_format: int) -> int:
    """On-disk bytes of one row of `row_bytes` in `segment_format`: the row alone (1), or
    the row padded to whole 8-byte words and its 8-byte row sum (2)."""
    return row_bytes if segment_format == 1 else -(-row_bytes // 8) * 8 + 8

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def validate_table_name(name: str) -> str:
    """Return `name` if it is a safe table name, else raise InvalidArgument.

    Names become directory names, so they must match
    ``[A-Za-z0-9][A-Za-z0-9_.-]{0,63}`` (no ``/``, no leading dot).
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidArgument(
            f"invalid table name {name!r}: use 1-64 characters from [A-Za-z0-9_.-], starting with a letter or digit")
    return name


@dataclass(frozen=True)
class TableVersion:
    """Manifest of one immutable table version.

    ``number`` is the version's number within its table (1, 2, ...), stored
    (catalog, portable file, published manifest) and sent as "version".

    Rows are ``row_bytes`` bytes each, stored in records of ``record_bytes``
    back to back; row i lives in segment ``i // segment_rows`` at byte
    ``(i % segment_rows) * record_bytes``. ``segment_format`` says what a record is:

    - 2 (written by default): the row, zero padding to a multiple of 8 bytes,
      then its row sum (tierstore.tiers.nvme.rowsum) as one little-endian
      uint64, so the sector a miss reads carries the row's checksum and
      nothing per row is held in memory; ``row_sums`` is None.
    - 1 (older versions): the row alone (record_bytes == row_bytes);
      ``row_sums`` is ``{"file": name in the version directory,
      "algo": the algorithm of rowsum.ALGOS, "xxh3": xxh3-64 of that file}``
      (the file holds one little-endian uint64 per row), or None for versions
      written before per-row checksums (rows then verify by block).

    ``row_salt``: 64 random bits drawn when the version is written; its row sums
    are fmix64-v2 keyed by it (rowsum.RowKey.of), so a row's sum holds at its
    id in this version only: a row of another table or version, or at another
    id, fails its check wherever it is put. None in versions written before it
    (fmix64-v1, the id alone): their sums are checked only where they are
    stored, never taken from a client (tierstore/tiers/trust.py).

    Block checksums (xxh3-64) cover the on-disk bytes of ``block_rows``
    records (the last block may be short), in either format.

    ``checkpoint``: for a version ingested from a checkpoint (ingest-checkpoint,
    or imported from one that was), the tensors its rows came from,
    ``{"weight": ..., "scale": ...}``, each a
    tierstore.table.checkpoint.TensorSource's to_dict(); None otherwise, and in
    versions ingested before it was kept (`checkpoint_record` then reads what
    their ``source`` note says).
    """

    table: str
    number: int  # stored as "version" (to_dict)
    rows: int
    row_format: str
    row_dim: int
    row_bytes: int
    block_rows: int
    n_blocks: int
    segments: tuple[str, ...]  # paths relative to the data directory
    segment_rows: int
    spec: dict | None
    layer_id: int | None
    created_at: float
    source: str
    row_sums: dict | None = None
    segment_format: int = 1  # records written before the field existed are format 1
    row_salt: int | None = None  # records written before the field existed: fmix64-v1 row sums
    checkpoint: dict | None = None  # records written before the field existed: see checkpoint_record

    @property
    def nbytes(self) -> int:
        """Bytes of row data (what an arena holding the whole table needs)."""
        return self.rows * self.row_bytes

    @property
    def record_bytes(self) -> int:
        """Bytes one row takes in a segment file (see the class docstring)."""
        return record_bytes(self.row_bytes, self.segment_format)

    @property
    def block_bytes(self) -> int:
        """Bytes of one checksum block on disk."""
        return self.block_rows * self.record_bytes

    def checkpoint_record(self) -> dict | None:
        """{"weight": TensorSource, "scale": TensorSource} of the checkpoint this version was
        ingested from: `checkpoint`, or for a version ingested before it was kept, the weight
        shard's path, size and mtime its `source` note gives ({"weight": ...} only: the note
        names one shard); None for a version not ingested from a checkpoint."""
        from tierstore.table.checkpoint import TensorSource

        if self.checkpoint is not None:
            return {k: TensorSource.from_dict(v) for k, v in self.checkpoint.items()}
        note = _SOURCE_NOTE.fullmatch(self.source)
        if note is None:
            return None
        return {"weight": TensorSource(note["file"], note["tensor"], int(note["size"]), int(note["mtime_ns"]))}

    def to_dict(self) -> dict:
        """The stored record (catalog, portable file, published manifest): each field
        under its name, but `number` under its stored name "version"."""
        d = {_STORED.get(k, k): v for k, v in asdict(self).items()}
        d["segments"] = list(self.segments)
        return d

    @classmethod
    def from_dict(cls, d: dict, table: str | None = None, version: int | None = None) -> "TableVersion":
        """A manifest from its stored record, checked for internal consistency:
        DataLoss naming table, version and field when any check fails (a record
        that disagrees with itself would serve half rows or read past a segment).
        `table`/`version`: the catalog key the record was stored under."""
        where = f"table {table!r} version {version}"
        if not isinstance(d, dict):
            raise DataLoss(f"catalog record of {where} is not a JSON object; the catalog is corrupt")
        if table is None or version is None:
            where = f"table {d.get('table', table)!r} version {d.get('version', version)}"
        bad = _record_problem(d, table, version)
        if bad:
            raise DataLoss(f"catalog record of {where} is inconsistent: {bad}; the catalog is corrupt "
                           f"(restore it or ingest the table again)")
        d = {_FIELD.get(k, k): v for k, v in d.items()}
        d["segments"] = tuple(d["segments"])
        return cls(**d)


# the source note ingest-checkpoint wrote: "{shard}:{weight tensor}+{scale tensor} (size N, mtime_ns M)"
_SOURCE_NOTE = re.compile(r"(?P<file>.+):(?P<tensor>[^:+]+)\+[^:+]+ \(size (?P<size>\d+), mtime_ns (?P<mtime_ns>\d+)\)",
                          re.S)
_STORED = {"number": "version"}  # field -> its name in the stored record (unchanged on disk and wire)
_FIELD = {v: k for k, v in _STORED.items()}
_INT_FIELDS = ("version", "rows", "row_dim", "row_bytes", "block_rows", "n_blocks", "segment_rows")


def _record_problem(d: dict, table: str | None, version: int | None) -> str | None:
    """What is wrong with a stored manifest record (to_dict's names), or None."""
    from dataclasses import fields as dc_fields

    from tierstore.table.formats import RowFormat

    names = {_STORED.get(f.name, f.name) for f in dc_fields(TableVersion)}
    required = {_STORED.get(f.name, f.name) for f in dc_fields(TableVersion)
                if f.default is MISSING and f.default_factory is MISSING}
    if not required <= set(d) <= names:
        return f"fields {sorted(required - set(d))} missing, {sorted(set(d) - names)} unknown"
    for k in _INT_FIELDS:
        if not isinstance(d[k], int) or isinstance(d[k], bool) or d[k] < 1:
            return f"{k} = {d[k]!r} is not a positive integer"
    if table is not None and d["table"] != table:
        return f"table = {d['table']!r} but the record is stored under {table!r}"
    if version is not None and d["version"] != version:
        return f"version = {d['version']!r} but the record is stored under {version}"
    try:
        want = RowFormat.parse(d["row_format"]).row_bytes(d["row_dim"])
    except (ValueError, TypeError) as e:
        return f"row_format/row_dim: {e}"
    if d["row_bytes"] != want:
        return f"row_bytes = {d['row_bytes']} but {d['row_format']} x {d['row_dim']} is {want} bytes"
    if d["n_blocks"] != -(-d["rows"] // d["block_rows"]):
        return (f"n_blocks = {d['n_blocks']} but {d['rows']} rows in blocks of {d['block_rows']} "
                f"make {-(-d['rows'] // d['block_rows'])}")
    if d["segment_rows"] % d["block_rows"]:
        return f"segment_rows = {d['segment_rows']} is not a whole number of blocks of {d['block_rows']} rows"
    fmt = d.get("segment_format", 1)
    if fmt not in FORMATS or isinstance(fmt, bool):
        return (f"segment_format = {fmt!r}; this build reads formats {list(FORMATS)} "
                f"(a newer tierstore wrote it: upgrade, or re-ingest the table)")
    if fmt == 2 and d.get("row_sums") is not None:
        return "segment_format 2 carries its row sums in its records, yet row_sums names a file"
    salt = d.get("row_salt")
    if salt is not None and (not isinstance(salt, int) or isinstance(salt, bool) or not 0 <= salt < 1 << 64):
        return f"row_salt = {salt!r} is not a 64-bit unsigned integer"
    ckpt = d.get("checkpoint")
    if ckpt is not None:
        from tierstore.table.checkpoint import TensorSource

        if not isinstance(ckpt, dict) or not set(ckpt) <= {"weight", "scale"}:
            return f"checkpoint = {ckpt!r} is not an object of weight / scale tensor records"
        try:
            for v in ckpt.values():
                TensorSource.from_dict(v)
        except ValueError as e:
            return str(e)
    segs = d["segments"]
    if not isinstance(segs, list) or not all(isinstance(p, str) for p in segs):
        return "segments is not a list of paths"
    if len(segs) != -(-d["rows"] // d["segment_rows"]):
        return (f"segments: {len(segs)} segments of {d['segment_rows']} rows cannot hold exactly "
                f"{d['rows']} rows")
    for p in segs:
        if p.startswith("/") or ".." in Path(p).parts:
            return f"segments: {p!r} is not a path inside the data directory"
    return None
