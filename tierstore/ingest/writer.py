"""Writing table versions: stream rows to segment files, then commit atomically.

A version is written into a private staging directory under DATA/tmp (locked
with flock while its writer lives): each chunk is checksummed from the
source's bytes, written, and read back from its file a few chunks later, every
block against its checksum. Then everything is fsynced, the staged files are
opened the way a reader will and spot-checked, moved into place and made
current in one catalog transaction. Until that transaction commits, readers
see the previous version; a killed writer leaves only a staging directory that
the next writer removes.

The read-back goes through the page cache (the pages just written), not the
device: it checks that each file holds, at each offset, the bytes the
checksums were made from (a short or misplaced write, a file changed under
the writer, a fault between hashing and writing), which is what readers will
be served. Faults of the device later are caught by the checksums every read
verifies; reading the device back here would be a second full pass over it.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import xxhash

from tierstore.store.catalog import Catalog
from tierstore.store.data_dir import LOCK_NAME, fsync_dir, private_dirs, staging_guard
from tierstore.store.version import FORMATS, LATEST_FORMAT, TableVersion, record_bytes, validate_table_name
from tierstore.errors import ChecksumError, DataLoss, InvalidArgument, ResourceExhausted, SpecMismatch
from tierstore.ingest.pipeline import Pipeline
from tierstore.table.formats import RowFormat
from tierstore.tiers.nvme import rowsum
from tierstore.tiers.nvme.blocks import default_block_rows
from tierstore.tiers.nvme.reader import SegmentReader

__all__ = ["write_version", "ExpectedBlocks", "SEGMENT_BYTES", "CHUNKS_IN_FLIGHT"]

# Segments are capped at ~1 GiB so a 98 GB layer is ~100 files that copy,
# rsync and checksum in pieces; reads never cross a segment (whole blocks each).
SEGMENT_BYTES = 1 << 30
# segment format 1: one uint64 checksum per row (tierstore.tiers.nvme.rowsum), beside the segments
ROW_SUMS_FILE = "rowsums.u64"
# A checksum block is read and hashed whole; the default is about BLOCK_TARGET_BYTES
# (tiers/nvme/blocks.py: default_block_rows), this is the most a version may ask for.
MAX_BLOCK_BYTES = 64 << 20
_DISK_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
# Chunks between the source and the end of the read-back (write_version's
# pipeline): its memory is this many chunks, and a source may reuse a chunk's
# buffer this many chunks later.
CHUNKS_IN_FLIGHT = 6
# bytes read back per call by the read-back stage (one reused buffer)
CHECK_BYTES = 8 << 20


class _BlockHashes:
    """xxh3-64 of every `block_bytes` block of a stream of `total` bytes fed in
    order and in pieces of any size (a block split across pieces is hashed in
    parts; the stream's last block may be short): `sums` once all is fed."""

    def __init__(self, total: int, block_bytes: int):
        self.total, self.block_bytes = total, block_bytes
        self.sums = np.zeros(-(-total // block_bytes), dtype=np.uint64)
        self._hash = xxhash.xxh3_64()
        self._block = 0
        self._pos = 0

    def update(self, data: memoryview) -> None:
        bb, h, p = self.block_bytes, xxhash.xxh3_64_intdigest, self._pos
        if p % bb and len(data):  # finish the block the last piece began
            end = min((self._block + 1) * bb, self.total)
            take = min(len(data), end - p)
            self._hash.update(data[:take])
            p += take
            data = data[take:]
            if p == end:
                self.sums[self._block] = self._hash.intdigest()
                self._hash.reset()
                self._block += 1
        whole = len(data) // bb
        if whole:  # one xxh3 call per block, no other Python per block
            self.sums[self._block:self._block + whole] = [h(data[i:i + bb]) for i in range(0, whole * bb, bb)]
            self._block += whole
            p += whole * bb
            data = data[whole * bb:]
        if len(data):  # a block that the next piece finishes (or the stream's short last block)
            self._hash.update(data)
            p += len(data)
            if p == self.total:
                self.sums[self._block] = self._hash.intdigest()
                self._hash.reset()
                self._block += 1
        self._pos = p


class _Staging:
    """Segment files of one version being written, plus their block checksums
    (over the bytes on disk) and, for segment format 1, the row-checksum file
    (one uint64 per row, hashed as it is written). Format 2 writes each row's
    sum into its record instead (tierstore.store.version.TableVersion).

    Written by write_version's pipeline, one method per stage, each called
    from one thread in row order: `hash` (row sums of a chunk, its records and
    their block checksums, from the source's bytes), `put` (pwrite them into
    the page cache; the kernel writes them back as a copy's would), `check`
    (read back what is now on file, block by block, against the checksums
    `hash` made), then `finish` (one fsync a file).
    `key`: the new version's row-sum key (rowsum.RowKey of its row_salt).
    `source_layout` (an import of a version laid out otherwise: its (segment format,
    RowKey)): `source_checksums` are then the blocks of the source rows laid out that
    way, what an import compares with the exported version's checksums."""

    def __init__(self, data_dir: Path, table: str, rows: int, row_bytes: int, block_rows: int,
                 segment_format: int, key: rowsum.RowKey, source_layout: tuple | None = None):
        tmp = private_dirs(data_dir, "tmp")
        with staging_guard(data_dir, exclusive=False):  # cleanup never sees the dir before its lock
            self.dir = Path(tempfile.mkdtemp(prefix=f"{table}.", dir=tmp))
            self._lock_fd = os.open(self.dir / LOCK_NAME, os.O_CREAT | os.O_RDWR, 0o600)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)  # "alive": cleanup skips held dirs
        self.data_dir, self.table = data_dir, table
        self.rows, self.row_bytes, self.block_rows = rows, row_bytes, block_rows
        self.segment_format, self.key = segment_format, key
        self.record_bytes = rec = record_bytes(row_bytes, segment_format)
        self.block_bytes = block_rows * rec
        self.total = rows * rec  # bytes on disk
        self.segment_rows = max(1, SEGMENT_BYTES // self.block_bytes) * block_rows
        self.segment_bytes = self.segment_rows * rec
        self.n_blocks = -(-rows // block_rows)
        self._blocks = _BlockHashes(self.total, self.block_bytes)
        self.checksums = self._blocks.sums
        self._source_layout = source_layout
        self._source = None
        if source_layout is not None:
            src_rec = record_bytes(row_bytes, source_layout[0])
            self._source = _BlockHashes(rows * src_rec, block_rows * src_rec)
        self.pos = 0  # bytes on disk the source's rows so far take
        self.written = 0  # bytes on file
        self.checked = 0  # blocks read back and found as hashed
        # every segment stays open (read-write: `check` reads through the same fd) until finish
        self._fds: list[int] = []
        self._sums_fd: int | None = None
        if segment_format == 1:
            self._sums_fd = os.open(self.dir / ROW_SUMS_FILE, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600)
        self._sums_hash = xxhash.xxh3_64()
        self._scratch: np.ndarray | None = None
        self._taken = 0  # chunks taken from the source
        self._ring: list[np.ndarray | None] = [None] * CHUNKS_IN_FLIGHT  # format 2's records, by chunk number

    @property
    def source_checksums(self) -> np.ndarray | None:
        return None if self._source is None else self._source.sums

    def take(self, chunk) -> tuple[int, int, tuple[np.ndarray, ...]]:
        """Source stage: check a chunk's shape and place; returns (chunk number, byte
        offset on disk, its column blocks: the packed rows, or weight and scale)."""
        parts = chunk if isinstance(chunk, tuple) else (chunk,)
        ok = 1 <= len(parts) <= 2 and all(isinstance(c, np.ndarray) and c.dtype == np.uint8 and c.ndim == 2
                                          and c.shape[0] == parts[0].shape[0] for c in parts)
        if not ok or sum(c.shape[1] for c in parts) != self.row_bytes:
            raise InvalidArgument(f"row chunks must be uint8 [n, {self.row_bytes}] (or two uint8 [n, *] column "
                                  f"blocks as wide together), got "
                                  f"{[(getattr(c, 'dtype', type(c)), getattr(c, 'shape', '')) for c in parts]}")
        if len(parts) > 1 and (self.segment_format == 1 or self._source is not None):
            parts = (np.concatenate(parts, axis=1),)  # those layouts hash and write the packed rows
        parts = tuple(np.ascontiguousarray(c) for c in parts)
        n = parts[0].shape[0]
        if self.pos + n * self.record_bytes > self.total:
            raise SpecMismatch(f"the source yields more than the declared {self.rows} rows")
        pos = self.pos
        self.pos += n * self.record_bytes
        self._taken += 1
        return self._taken - 1, pos, parts

    def hash(self, item: tuple[int, int, tuple[np.ndarray, ...]]) -> tuple[int, np.ndarray, np.ndarray | None]:
        """Hash stage: the chunk's row sums, its bytes on disk (format 2: records
        carrying them, built in one pass into a ring of CHUNKS_IN_FLIGHT buffers: a
        chunk is out of the pipeline before its buffer is reused) and their block
        checksums. Returns (offset, bytes to write, format 1's row sums or None)."""
        seq, pos, parts = item
        n = parts[0].shape[0]
        first = pos // self.record_bytes
        ids = np.arange(first, first + n, dtype=np.int64)
        if self._source is not None:
            fmt, key = self._source_layout
            self._source.update(memoryview(parts[0] if fmt == 1 else rowsum.records(parts[0], ids, key)).cast("B"))
        if self.segment_format == 2:
            slot = seq % CHUNKS_IN_FLIGHT
            if self._ring[slot] is None or self._ring[slot].shape[0] < n:
                self._ring[slot] = np.empty((n, self.record_bytes), np.uint8)
            disk, sums = rowsum.records(parts, ids, self.key, out=self._ring[slot][:n]), None
        else:
            disk, sums = parts[0], rowsum.row_sums(parts[0], ids, self.key).astype("<u8", copy=False)
        self._blocks.update(memoryview(disk).cast("B"))
        return pos, disk, sums

    def put(self, item: tuple[int, np.ndarray, np.ndarray | None]) -> int:
        """Write stage: pwrite the chunk's bytes (and format 1's row sums); returns the bytes now on file."""
        pos, chunk, sums = item
        data = memoryview(chunk).cast("B")
        while len(data):
            seg = pos // self.segment_bytes
            if seg == len(self._fds):
                self._fds.append(os.open(self.dir / f"seg-{seg:05d}.bin", os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600))
            off = pos - seg * self.segment_bytes
            n = _pwrite_all(self._fds[seg], data[:min(len(data), self.segment_bytes - off)], off)
            pos += n
            data = data[n:]
        if sums is not None:
            raw = memoryview(sums).cast("B")
            self._sums_hash.update(raw)
            _pwrite_all(self._sums_fd, raw, item[0] // self.record_bytes * 8)
        self.written = pos
        return pos

    def check(self, written: int) -> int:
        """Read-back stage: every whole block now on file (and the last block once
        the table is complete) read through the segment's fd and compared with the
        checksum `hash` computed from the source's bytes. Returns the bytes checked."""
        upto = self.n_blocks if written == self.total else written // self.block_bytes
        if self._scratch is None:
            self._scratch = np.empty(max(1, CHECK_BYTES // self.block_bytes) * self.block_bytes, np.uint8)
        buf, bb, h = memoryview(self._scratch), self.block_bytes, xxhash.xxh3_64_intdigest
        blocks_per_seg = self.segment_rows // self.block_rows
        before = self.checked
        while self.checked < upto:
            b0 = self.checked
            seg = b0 // blocks_per_seg
            b1 = min(upto, (seg + 1) * blocks_per_seg, b0 + len(buf) // bb)
            first = b0 * bb
            n = min(b1 * bb, self.total) - first
            got = _pread_all(self._fds[seg], buf[:n], first - seg * self.segment_bytes)
            sums = [h(buf[i:min(i + bb, got)]) for i in range(0, n, bb)]
            bad = np.flatnonzero(np.asarray(sums, dtype=np.uint64) != self.checksums[b0:b1])
            if got < n or len(bad):
                blk = b0 + (int(bad[0]) if len(bad) else got // bb)
                raise DataLoss(f"table {self.table!r}: block {blk} does not read back as written; check the "
                               f"disk under {self.data_dir}; nothing was committed")
            self.checked = b1
        return min(self.checked * bb, self.total) - min(before * bb, self.total)

    @property
    def row_sums_meta(self) -> dict | None:
        """The manifest's `row_sums`: format 1's file, None for format 2 (each record carries its sum)."""
        if self.segment_format == 2:
            return None
        return {"file": ROW_SUMS_FILE, "algo": self.key.algo, "xxh3": self._sums_hash.intdigest()}

    def finish(self) -> None:
        if self.pos != self.total:
            raise SpecMismatch(f"the source ended after {self.pos // self.record_bytes} rows; "
                               f"{self.rows} were declared")
        for fd in self._fds + ([self._sums_fd] if self._sums_fd is not None else []):
            os.fsync(fd)
        self._close()
        fsync_dir(self.dir)

    def _close(self) -> None:
        for fd in self._fds + ([self._sums_fd] if self._sums_fd is not None else []):
            os.close(fd)
        self._fds, self._sums_fd = [], None

    def abort(self) -> None:
        import shutil

        self._close()
        shutil.rmtree(self.dir, ignore_errors=True)
        self.release()

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _pwrite_all(fd: int, data: memoryview, off: int) -> int:
    n = 0
    while n < len(data):
        n += os.pwrite(fd, data[n:], off + n)
    return n


def _pread_all(fd: int, buf: memoryview, off: int) -> int:
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], off + got)
        if n == 0:
            break
        got += n
    return got


@dataclass(frozen=True)
class ExpectedBlocks:
    """What an import must reproduce (tierstore.ingest.portable): the exported version's
    block checksums, over its rows laid out in its `segment_format` (None: the new
    version's) with row sums keyed by its `row_salt` (None: fmix64-v1). write_version
    commits nothing unless the incoming rows, laid out that way, hash to exactly these
    (DataLoss). Checked where built: a segment format this build cannot read is
    InvalidArgument."""

    checksums: np.ndarray
    segment_format: int | None = None
    row_salt: int | None = None

    def __post_init__(self):
        if self.segment_format is not None and self.segment_format not in FORMATS:
            raise InvalidArgument(f"checksums of segment format {self.segment_format!r}: this build reads "
                                  f"{list(FORMATS)}")


def write_version(data_dir, table: str, chunks: Iterable[np.ndarray], *, rows: int, row_format: str,
                  row_dim: int, spec: dict | None = None, layer_id: int | None = None, source: str = "",
                  checkpoint: Callable[[], dict | None] | None = None, block_rows: int | None = None,
                  segment_format: int = LATEST_FORMAT, expected: ExpectedBlocks | None = None, verify: bool = True,
                  progress: bool = False) -> TableVersion:
    """Write a new version of `table` from row chunks and make it current.

    chunks: uint8 arrays [n, row_bytes] in row order (any n), `rows` in total,
        or pairs (a, b) of uint8 [n, *] column blocks whose concatenation is the
        rows (weight and scale read apart: no packed copy is made), taken from a
        thread of the writer's. A chunk is used until it is written: a source
        may reuse an array's memory only CHUNKS_IN_FLIGHT chunks after yielding
        it (a ring of that many buffers).
    row_format/row_dim: the rows' format (tierstore.table.formats) and values per row.
    spec/layer_id: the Engram spec dict and layer the table serves (stored as is).
    source: where the rows came from, stored in the manifest.
    checkpoint: called once every chunk is read: the manifest's `checkpoint` record
        (TableVersion), whose digests the source computes as the chunks pass.
    block_rows: rows per checksum block (default: about 4 KiB of records on disk).
    segment_format: 2 (default: each row's checksum inside its record) or 1 (a
        separate row-sum file; older versions, kept readable and writable so they
        stay tested); tierstore.store.version.TableVersion says what each holds.
    expected: an import's block checksums (ExpectedBlocks), which the incoming
        rows must match or nothing is committed (DataLoss). The new version's rows
        are summed under a salt of its own all the same (every version written
        draws one: TableVersion.row_salt).
    verify: read every block back from its file against its checksum before
        commit (as the pipeline goes, a few chunks behind the writes).

    Chunks are read, checksummed, written and read back in a pipeline, each
    stage in a thread, so the slowest sets the pace (tierstore.ingest.pipeline);
    everything is fsynced before the commit. Memory use is CHUNKS_IN_FLIGHT
    chunks plus constant. Raises InvalidArgument / SpecMismatch
    for bad input, ResourceExhausted for a full disk; on any failure the staged
    files are removed and the current version is unchanged.
    """
    data_dir = Path(data_dir)
    validate_table_name(table)
    fmt = RowFormat.parse(row_format)
    row_bytes = fmt.row_bytes(int(row_dim))
    if rows < 1:
        raise InvalidArgument(f"table {table!r} needs at least one row, got {rows}")
    if segment_format not in FORMATS:
        raise InvalidArgument(f"segment format {segment_format!r}: this build writes {list(FORMATS)}")
    block_rows = _block_rows(rows, record_bytes(row_bytes, segment_format), block_rows)
    salt = rowsum.new_salt()
    with Catalog(data_dir) as cat:  # opening for writing cleans a killed writer's leftovers
        stage = _Staging(data_dir, table, rows, row_bytes, block_rows, segment_format, rowsum.RowKey.of(salt),
                         source_layout=_source_layout(expected, segment_format))
        try:
            _stream(stage, chunks, verify, progress)
            stage.finish()
            if expected is not None:
                _compare(stage, expected)
            fields = dict(rows=rows, row_format=fmt.value, row_dim=int(row_dim), row_bytes=row_bytes,
                          block_rows=block_rows, n_blocks=stage.n_blocks, segment_rows=stage.segment_rows,
                          spec=spec, layer_id=layer_id, source=str(source), row_sums=stage.row_sums_meta,
                          segment_format=segment_format, row_salt=salt,
                          checkpoint=None if checkpoint is None else checkpoint())
            if verify:
                _spot_check(data_dir, stage, table, fields)
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


def _block_rows(rows: int, rec: int, block_rows: int | None) -> int:
    """Rows per checksum block of `rec`-byte records: `block_rows`, by default about
    BLOCK_TARGET_BYTES of them; a block is read and hashed whole, so at most
    MAX_BLOCK_BYTES (a table smaller than that may be one block)."""
    block_rows = int(block_rows or default_block_rows(rec))
    if block_rows < 1:
        raise InvalidArgument(f"block_rows must be >= 1, got {block_rows}")
    if block_rows * rec > MAX_BLOCK_BYTES and rows * rec <= MAX_BLOCK_BYTES:
        return rows  # the whole table is one block either way
    if block_rows * rec > MAX_BLOCK_BYTES:
        raise InvalidArgument(f"--block-rows {block_rows} x {rec} B records makes {block_rows * rec} B "
                              f"checksum blocks; at most {MAX_BLOCK_BYTES >> 20} MiB "
                              f"(--block-rows <= {MAX_BLOCK_BYTES // rec})")
    return block_rows


def _source_layout(expected: ExpectedBlocks | None, segment_format: int) -> tuple | None:
    """The layout (segment format, RowKey) the incoming rows must be hashed in for `expected`,
    or None where the new version's own block checksums are comparable: blocks of format 1
    are the rows alone, whatever the salt; format 2's carry sums keyed by another salt."""
    if expected is None:
        return None
    fmt = segment_format if expected.segment_format is None else expected.segment_format
    if fmt == segment_format == 1:
        return None
    return fmt, rowsum.RowKey.of(expected.row_salt)


def _stream(stage: _Staging, chunks, verify: bool, progress: bool) -> None:
    """Every chunk through the pipeline: take, hash, put and (verify) check, each stage a
    thread; the progress bar (stderr) counts the bytes checked, or written without verify."""
    from tqdm import tqdm

    bar = tqdm(total=stage.total, unit="B", unit_scale=True, unit_divisor=1024,
               desc=f"ingest {stage.table}", file=sys.stderr, disable=not progress, mininterval=0.25)
    stages = [stage.hash, stage.put] + ([stage.check] if verify else [])
    with bar, Pipeline(map(stage.take, chunks), stages, in_flight=CHUNKS_IN_FLIGHT,
                       name=f"ingest-{stage.table}") as pipe:
        done = 0
        for out in pipe:  # bytes checked (or written, without verify) by this chunk
            step = out if verify else out - done
            done += step
            bar.update(step)


def _compare(stage: _Staging, expected: ExpectedBlocks) -> None:
    """DataLoss unless the incoming rows' blocks, laid out as `expected` says, are its checksums."""
    got = stage.checksums if stage.source_checksums is None else stage.source_checksums
    want = np.asarray(expected.checksums, dtype=np.uint64)
    bad = np.flatnonzero(want != got) if len(want) == stage.n_blocks else np.zeros(0, dtype=np.int64)
    if len(bad) or len(want) != stage.n_blocks:
        blk = int(bad[0]) if len(bad) else stage.n_blocks
        raise DataLoss(f"table {stage.table!r}: block {blk} of the incoming rows does not match its "
                       f"checksum; the source is corrupt, nothing was committed")


def _spot_check(data_dir: Path, stage: _Staging, table: str, fields: dict) -> None:
    """Open the staged files as a reader will once committed (its geometry, format
    1's row-sum file against its xxh3) and read the first and last row of every
    segment through it (each checked against its row sum; the table's first
    and last block against their checksums). The
    pipeline's read-back compared every block already; this checks that the
    manifest describes the files the way the reader reads them."""
    n_segs = -(-stage.rows // stage.segment_rows)
    rel = stage.dir.relative_to(data_dir)
    tv = TableVersion(table=table, number=0, created_at=0.0,
                      segments=tuple(f"{rel}/seg-{i:05d}.bin" for i in range(n_segs)), **fields)
    ends = np.arange(n_segs, dtype=np.int64) * stage.segment_rows
    ids = np.unique(np.concatenate([ends, np.minimum(ends + stage.segment_rows, stage.rows) - 1]))
    try:
        with SegmentReader(data_dir, tv, stage.checksums) as reader:
            if not reader.verifies_rows:
                raise DataLoss(reader.row_sums_error or "no row sums")
            reader.read_range(int(ids[0]), 1)
            reader.read_range(int(ids[-1]), 1)
            reader.read_rows(ids)
    except ChecksumError as e:
        raise DataLoss(f"table {table!r}: {e}; the staged files do not read back as written; check the disk "
                       f"under {data_dir}; nothing was committed") from None
