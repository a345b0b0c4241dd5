"""Portable table files: one table version in one zstd-compressed stream.

Layout of the decompressed stream (all integers little-endian)::

    b"TSTABLE1"                      magic, format version 1
    u32 header length, header JSON   {"manifest": {...}, "checksums_xxh3": int}
    u64 x n_blocks                   per-block xxh3-64 checksums of the exported version's
                                     on-disk blocks (its manifest's segment_format)
    rows                             rows x row_bytes bytes, in id order

The zstd frame carries its own content checksum; on import every block is also
checked against the header's checksums (rebuilt in the exported version's segment
format, its row sums keyed by the exported version's row_salt) before the version
is committed, written in the current format under a row_salt of its own, so a
corrupt or truncated file imports nothing. Export and import both stream: memory
use is a few MB whatever the table size.
"""
from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import numpy as np
import xxhash

from tierstore import bounded_json
from tierstore.store.catalog import Catalog
from tierstore.store.version import TableVersion, _record_problem, validate_table_name
from tierstore.errors import DataLoss

__all__ = ["export_table", "import_table", "MAGIC"]

MAGIC = b"TSTABLE1"
_STEP_BYTES = 8 << 20
# Real headers are a few KB (the spec dominates); the u32 length allows 4 GiB.
MAX_HEADER_BYTES = 1 << 20
MAX_TABLE_BYTES = 1 << 50  # 1 PiB: far above any Engram table, far below overflow


def export_table(data_dir, table: str, out, *, version: int | None = None, level: int = 3,
                 progress: bool = False) -> TableVersion:
    """Write `table` (current version unless `version`) to the portable file `out`.

    Rows are read from the segments with their checksums verified, so a
    corrupt table is never exported (ChecksumError). The file appears under
    its name only when complete. Raises TableNotFound / VersionNotFound.
    """
    import zstandard
    from tqdm import tqdm

    from tierstore.tiers.nvme.reader import SegmentReader

    out = Path(out)
    with Catalog(data_dir, readonly=True) as cat:
        tv = cat.get(table, version)
        sums = cat.checksums(table, tv.number)
    header = json.dumps({"manifest": tv.to_dict(),
                         "checksums_xxh3": xxhash.xxh3_64_intdigest(sums.astype("<u8").tobytes())}).encode()
    tmp = out.with_name(f".{out.name}.partial")
    try:
        with open(tmp, "wb") as f, SegmentReader(data_dir, tv, sums) as reader:
            cctx = zstandard.ZstdCompressor(level=level, write_checksum=True, threads=-1)
            with cctx.stream_writer(f, closefd=False) as z, \
                    tqdm(total=tv.nbytes, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                         desc=f"export {table}", disable=not progress) as bar:
                z.write(MAGIC + struct.pack("<I", len(header)) + header)
                z.write(sums.astype("<u8").tobytes())
                for _, rows in reader.iter_blocks(max(1, _STEP_BYTES // tv.row_bytes)):
                    z.write(rows)
                    bar.update(rows.nbytes)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tv


class _Exact:
    """Read exactly n bytes from a zstd stream; a short read means the file is cut."""

    def __init__(self, stream, path):
        self.stream, self.path = stream, path

    def read(self, n: int) -> bytes:
        import zstandard

        parts, got = [], 0
        try:
            while got < n:
                b = self.stream.read(n - got)
                if not b:
                    raise DataLoss(f"{self.path} is truncated: the stream ended {n - got} bytes early; "
                                   f"export the table again")
                parts.append(b)
                got += len(b)
            return b"".join(parts)
        except zstandard.ZstdError as e:
            raise DataLoss(f"{self.path} is corrupt ({e}); export the table again") from None


def import_table(src, data_dir, table: str | None = None, *, progress: bool = False) -> TableVersion:
    """Import a portable file as a new current version of `table` (default: the
    exported table's name). Raises DataLoss for a corrupt or truncated file (and
    commits nothing), InvalidArgument for a bad table name."""
    import zstandard

    from tierstore.ingest.writer import ExpectedBlocks, write_version

    src = Path(src)
    with open(src, "rb") as f, zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True) as z:
        r = _Exact(z, src)
        if r.read(len(MAGIC)) != MAGIC:
            raise DataLoss(f"{src} is not a tierstore portable table (bad magic)")
        (hlen,) = struct.unpack("<I", r.read(4))
        if hlen > MAX_HEADER_BYTES:
            raise DataLoss(f"{src} claims a {hlen}-byte header; tierstore headers are at most "
                           f"{MAX_HEADER_BYTES >> 20} MiB: the file is corrupt or not a tierstore export")
        header, m = _parse_header(r.read(hlen), src)
        raw_sums = _read_hashed(r, 8 * m["n_blocks"], header["checksums_xxh3"], src)
        sums = np.frombuffer(raw_sums, dtype="<u8")
        name = validate_table_name(table or m["table"])
        rows, row_bytes = m["rows"], m["row_bytes"]
        step = max(1, _STEP_BYTES // row_bytes)

        def chunks():
            for a in range(0, rows, step):
                n = min(step, rows - a)
                yield np.frombuffer(r.read(n * row_bytes), dtype=np.uint8).reshape(n, row_bytes)
            try:
                tail = z.read(1)  # reaching the end makes zstd check the frame checksum
            except zstandard.ZstdError as e:
                raise DataLoss(f"{src} is corrupt ({e}); export the table again") from None
            if tail:
                raise DataLoss(f"{src} has trailing data after the rows; export the table again")

        return write_version(
            data_dir, name, chunks(), rows=rows, row_format=m["row_format"], row_dim=m["row_dim"],
            spec=m["spec"], layer_id=m["layer_id"], block_rows=m["block_rows"],
            source=f"import {src.name} ({m['table']} v{m['version']}: {m['source']})",
            checkpoint=lambda: m.get("checkpoint"),  # the rows are the exported ones: so is where they came from
            expected=ExpectedBlocks(sums, segment_format=m.get("segment_format", 1), row_salt=m.get("row_salt")),
            progress=progress)


def _parse_header(raw: bytes, src: Path) -> tuple[dict, dict]:
    """The header JSON, every field checked for type and consistency (DataLoss)."""
    def corrupt(why: str) -> DataLoss:
        return DataLoss(f"{src} has a corrupt header ({why}); export the table again")

    try:
        header = bounded_json.loads(raw, max_bytes=MAX_HEADER_BYTES)
    except ValueError as e:
        raise corrupt(str(e)) from None
    if not isinstance(header, dict) or not isinstance(header.get("manifest"), dict):
        raise corrupt("not an object with a 'manifest' object")
    sums = header.get("checksums_xxh3")
    if not isinstance(sums, int) or isinstance(sums, bool) or not 0 <= sums < 1 << 64:
        raise corrupt("checksums_xxh3 is not a 64-bit integer")
    m = header["manifest"]
    bad = _record_problem(m, None, None)
    if bad:
        raise corrupt(bad)
    if not isinstance(m["table"], str) or not isinstance(m["source"], str):
        raise corrupt("table and source must be strings")
    if not (m["spec"] is None or isinstance(m["spec"], dict)):
        raise corrupt("spec is not an object")
    if not (m["layer_id"] is None or (isinstance(m["layer_id"], int) and not isinstance(m["layer_id"], bool))):
        raise corrupt("layer_id is not an integer")
    if m["rows"] * m["row_bytes"] > MAX_TABLE_BYTES:
        raise corrupt(f"{m['rows']} rows of {m['row_bytes']} bytes is over {MAX_TABLE_BYTES >> 50} PiB")
    return header, m


def _read_hashed(r: _Exact, n: int, want: int, src: Path) -> bytes:
    """n bytes read step by step (memory follows what the file really holds, not
    what its header claims), checked against their xxh3-64."""
    h, parts = xxhash.xxh3_64(), []
    while n:
        b = r.read(min(n, _STEP_BYTES))
        h.update(b)
        parts.append(b)
        n -= len(b)
    if h.intdigest() != want:
        raise DataLoss(f"{src}: the block checksum list is corrupt; export the table again")
    return b"".join(parts)
