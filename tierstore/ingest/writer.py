"""Writing table versions: stream rows to segment files, then commit atomically.

A version is written into a private staging directory under DATA/tmp (locked
with flock while its writer lives), fsynced, read back against its checksums,
then moved into place and made current in one catalog transaction. Until that
transaction commits, readers see the previous version; a killed writer leaves
only a staging directory that the next writer removes.

Readers of what gets written live beside it: `tierstore.ingest.tensor_file` (one
tensor of a checkpoint file, via `tierstore.ingest.tensor_reader`) and
`tierstore.ingest.checkpoint` (every Engram layer of a Hugging Face checkpoint).
"""
from __future__ import annotations

import errno
import fcntl
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterable

import numpy as np
import xxhash

from tierstore.store.catalog import Catalog
from tierstore.store.data_dir import LOCK_NAME, fsync_dir, private_dirs, staging_guard
from tierstore.store.version import TableVersion, validate_table_name
from tierstore.errors import DataLoss, InvalidArgument, ResourceExhausted, SpecMismatch
from tierstore.table.formats import RowFormat
from tierstore.tiers.nvme import rowsum
from tierstore.tiers.nvme.reader import SegmentReader, default_block_rows

__all__ = ["write_version", "SEGMENT_BYTES"]

# Segments are capped at ~1 GiB so a 98 GB layer is ~100 files that copy,
# rsync and checksum in pieces; reads never cross a segment (whole blocks each).
SEGMENT_BYTES = 1 << 30
# one uint64 checksum per row (tierstore.tiers.nvme.rowsum), beside the segments
ROW_SUMS_FILE = "rowsums.u64"
# A checksum block is read and hashed whole; the default is ~16 KiB.
MAX_BLOCK_BYTES = 64 << 20
_DISK_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


class _Staging:
    """Segment files of one version being written, plus their block checksums
    and the row-checksum file (one uint64 per row, hashed as it is written)."""

    def __init__(self, data_dir: Path, table: str, rows: int, row_bytes: int, block_rows: int):
        tmp = private_dirs(data_dir, "tmp")
        with staging_guard(data_dir, exclusive=False):  # cleanup never sees the dir before its lock
            self.dir = Path(tempfile.mkdtemp(prefix=f"{table}.", dir=tmp))
            self._lock_fd = os.open(self.dir / LOCK_NAME, os.O_CREAT | os.O_RDWR, 0o600)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)  # "alive": cleanup skips held dirs
        self.rows, self.row_bytes, self.block_rows = rows, row_bytes, block_rows
        self.block_bytes = block_rows * row_bytes
        self.total = rows * row_bytes
        self.segment_rows = max(1, SEGMENT_BYTES // self.block_bytes) * block_rows
        self.segment_bytes = self.segment_rows * row_bytes
        self.n_blocks = -(-rows // block_rows)
        self.checksums = np.zeros(self.n_blocks, dtype=np.uint64)
        self.pos = 0
        self._fd: int | None = None
        self._seg = -1
        self._hash = xxhash.xxh3_64()
        self._block = 0
        self._sums_fd: int | None = os.open(self.dir / ROW_SUMS_FILE, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600)
        self._sums_hash = xxhash.xxh3_64()

    def write(self, data: memoryview) -> None:
        """Append whole rows (data is a byte view of uint8 [n, row_bytes])."""
        if self.pos + len(data) > self.total:
            raise SpecMismatch(f"the source yields more than the declared {self.rows} rows")
        self._checksum(data)
        self._row_sums(data)
        while len(data):
            seg = self.pos // self.segment_bytes
            if seg != self._seg:
                self._close_segment()
                self._fd = os.open(self.dir / f"seg-{seg:05d}.bin", os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600)
                self._seg = seg
            take = min(len(data), (seg + 1) * self.segment_bytes - self.pos)
            n = os.write(self._fd, data[:take])
            self.pos += n
            data = data[n:]

    def _checksum(self, data: memoryview) -> None:
        p = self.pos
        while len(data):
            end = min((self._block + 1) * self.block_bytes, self.total)
            take = min(len(data), end - p)
            if take == self.block_bytes:  # a whole block in hand: hash in one call
                self.checksums[self._block] = xxhash.xxh3_64_intdigest(data[:take])
            else:
                self._hash.update(data[:take])
                if p + take == end:
                    self.checksums[self._block] = self._hash.intdigest()
                    self._hash.reset()
            p += take
            data = data[take:]
            if p == end:
                self._block += 1

    def _row_sums(self, data: memoryview) -> None:
        first = self.pos // self.row_bytes
        rows = np.frombuffer(data, dtype=np.uint8).reshape(-1, self.row_bytes)
        sums = rowsum.row_sums(rows, np.arange(first, first + rows.shape[0], dtype=np.int64))
        raw = memoryview(sums.astype("<u8", copy=False)).cast("B")
        self._sums_hash.update(raw)
        while len(raw):
            raw = raw[os.write(self._sums_fd, raw):]

    @property
    def row_sums_meta(self) -> dict:
        return {"file": ROW_SUMS_FILE, "algo": rowsum.ALGO, "xxh3": self._sums_hash.intdigest()}

    def _close_segment(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None

    def finish(self) -> None:
        if self.pos != self.total:
            raise SpecMismatch(f"the source ended after {self.pos // self.row_bytes} rows; "
                               f"{self.rows} were declared")
        self._close_segment()
        os.fsync(self._sums_fd)
        os.close(self._sums_fd)
        self._sums_fd = None
        fsync_dir(self.dir)

    def abort(self) -> None:
        import shutil

        for fd in (self._fd, self._sums_fd):
            if fd is not None:
                os.close(fd)
        self._fd = self._sums_fd = None
        shutil.rmtree(self.dir, ignore_errors=True)
        self.release()

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def write_version(data_dir, table: str, chunks: Iterable[np.ndarray], *, rows: int, row_format: str,
                  row_dim: int, spec: dict | None = None, layer_id: int | None = None, source: str = "",
                  block_rows: int | None = None, progress: bool = False,
                  expected_checksums: np.ndarray | None = None, verify: bool = True) -> TableVersion:
    """Write a new version of `table` from row chunks and make it current.

    chunks: uint8 arrays [n, row_bytes] in row order (any n), `rows` in total.
    row_format/row_dim: the rows' format (tierstore.table.formats) and values per row.
    spec/layer_id: the Engram spec dict and layer the table serves (stored as is).
    block_rows: rows per checksum block (default: about 16 KiB of rows).
    expected_checksums: when given (import), the computed block checksums must
        match them or nothing is committed (ChecksumError).
    verify: read the written files back against their checksums before commit.

    Memory use is one chunk plus constant. Raises InvalidArgument / SpecMismatch
    for bad input, ResourceExhausted for a full disk; on any failure the staged
    files are removed and the current version is unchanged.
    """
    from tqdm import tqdm

    data_dir = Path(data_dir)
    validate_table_name(table)
    fmt = RowFormat.parse(row_format)
    row_bytes = fmt.row_bytes(int(row_dim))
    if rows < 1:
        raise InvalidArgument(f"table {table!r} needs at least one row, got {rows}")
    block_rows = int(block_rows or default_block_rows(row_bytes))
    if block_rows < 1:
        raise InvalidArgument(f"block_rows must be >= 1, got {block_rows}")
    if block_rows * row_bytes > MAX_BLOCK_BYTES and rows * row_bytes <= MAX_BLOCK_BYTES:
        block_rows = rows  # the whole table is one block either way
    if block_rows * row_bytes > MAX_BLOCK_BYTES:
        raise InvalidArgument(f"--block-rows {block_rows} x {row_bytes} B rows makes {block_rows * row_bytes} B "
                              f"checksum blocks; at most {MAX_BLOCK_BYTES >> 20} MiB "
                              f"(--block-rows <= {MAX_BLOCK_BYTES // row_bytes})")
    with Catalog(data_dir) as cat:  # opening for writing cleans a killed writer's leftovers
        stage = _Staging(data_dir, table, rows, row_bytes, block_rows)
        try:
            bar = tqdm(total=rows * row_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                       desc=f"ingest {table}", file=sys.stderr, disable=not progress, mininterval=0.25)
            with bar:
                for chunk in chunks:
                    if not isinstance(chunk, np.ndarray) or chunk.dtype != np.uint8 or chunk.ndim != 2 \
                            or chunk.shape[1] != row_bytes:
                        raise InvalidArgument(f"row chunks must be uint8 [n, {row_bytes}] ({fmt.value} x {row_dim}), "
                                              f"got {getattr(chunk, 'dtype', type(chunk))} "
                                              f"{getattr(chunk, 'shape', '')}")
                    stage.write(memoryview(np.ascontiguousarray(chunk)).cast("B"))
                    bar.update(chunk.nbytes)
            stage.finish()
            if expected_checksums is not None:
                bad = np.flatnonzero(np.asarray(expected_checksums, dtype=np.uint64) != stage.checksums)
                if len(bad) or len(expected_checksums) != stage.n_blocks:
                    blk = int(bad[0]) if len(bad) else stage.n_blocks
                    raise DataLoss(f"table {table!r}: block {blk} of the incoming rows does not match its "
                                   f"checksum; the source is corrupt, nothing was committed")
            fields = dict(rows=rows, row_format=fmt.value, row_dim=int(row_dim), row_bytes=row_bytes,
                          block_rows=block_rows, n_blocks=stage.n_blocks, segment_rows=stage.segment_rows,
                          spec=spec, layer_id=layer_id, source=str(source), row_sums=stage.row_sums_meta)
            if verify:
                _verify_staged(data_dir, stage, table, fields)
            tv = cat.commit_version(table, stage.dir, fields, stage.checksums)
            stage.release()
            return tv
        except OSError as e:
            stage.abort()
            if e.errno in _DISK_FULL:
                raise ResourceExhausted(
                    f"disk full while writing table {table!r} to {data_dir} ({e.strerror}); free space "
                    f"or use another --data; the current version is unchanged") from e
            raise
        except BaseException:
            stage.abort()
            raise


def _verify_staged(data_dir: Path, stage: _Staging, table: str, fields: dict) -> None:
    n_segs = -(-stage.rows // stage.segment_rows)
    rel = stage.dir.relative_to(data_dir)
    tv = TableVersion(table=table, version=0, created_at=0.0,
                      segments=tuple(f"{rel}/seg-{i:05d}.bin" for i in range(n_segs)), **fields)
    with SegmentReader(data_dir, tv, stage.checksums) as reader:
        bad = reader.verify()
    if bad:
        raise DataLoss(f"table {table!r}: block {bad[0]} does not read back as written; check the disk "
                       f"under {data_dir}; nothing was committed")

