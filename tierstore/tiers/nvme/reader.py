"""The cold tier: rows read straight from a version's segment files.

Addresses are computed (row i's record sits at a fixed offset). A record is
the row followed by its per-row checksum (segment format 2, the default:
tierstore.store.version.TableVersion), or the row alone with the checksums in
a separate row-sum file (format 1, older versions). Two read paths:

- Rows (`read_into`, and `read_rows` on top of it), for versions that carry a
  per-row checksum (tierstore.tiers.nvme.rowsum, written at ingest): each miss reads
  only its record, verified in one compiled pass against the sum the record
  carries (format 2: nothing per row is held in memory) or the one read beside it
  from the row-sum file (format 1), and written into the caller's arena slots.
  A call's records are read into a scratch buffer (direct_io.start_rows) and
  placed from where they land: through the page cache by default (each record's
  own bytes, records a few KiB apart in one read), or with `direct_io=True` with
  O_DIRECT (the aligned sectors of each row, direct_io.py), so the cold tier is
  not cached twice. Through the page cache a call's reads are first tried
  without waiting (what the page cache holds is copied at once, in one compiled
  loop, and placed part by part while its scratch is cache-hot); what must wait
  on the device, and every O_DIRECT read, goes through the calling thread's one
  io_uring, in parts (`start_into` submits them and returns, so a caller keeps
  several calls' reads in flight at once), or, where there is no io_uring,
  through the pool's preads.
- Blocks (`read_range`, `iter_blocks`, `disk_blocks`, `verify`, and rows of versions
  written before row checksums existed): one pread per run of neighbouring
  blocks, each checked against its xxh3-64 in the catalog over the on-disk
  bytes (a record's row and sum alike); format 2 records are then
  de-interleaved into rows by one strided copy.

A row or block that does not match raises ChecksumError, never returned; a
missing, truncated or non-regular segment reads as corrupt, naming it.

Nothing is read through a memory map: a segment or row-sum file that an operator
truncates (a `cp` over it truncates first) while it is read must be a short
read, hence DATA_LOSS, never a touch of a mapped page past the file's end,
which is SIGBUS for the whole process (the sidecar, or every client on the host
that reads its misses itself).
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np

from tierstore import cpu_token
from tierstore.store.catalog import BlockChecksums, TableVersion
from tierstore.errors import InvalidArgument
from tierstore.tiers.nvme import rowsum
from tierstore.tiers.base import ColdTier, check_ids, check_out
from tierstore.tiers.nvme.blocks import Blocks, read_pool
from tierstore.tiers.nvme.record_format import RecordFormat
from tierstore.tiers.nvme.segment_files import SUM_BYTES, SegmentFiles
from tierstore.tiers.nvme.verified_copy import place_records, place_verified
from tierstore.tiers.nvme.direct_io import (RowReads, _Scratch, give_back, part_starts, spare_buffer, start_rows,
                                            thread_buffer, thread_ring, warm)

log = logging.getLogger(__name__)

__all__ = ["SegmentReader"]

# Row reads without io_uring: a call's misses are cut into chunks of CHUNK_ROWS, dealt to at most
# READ_TASKS pool tasks of at least ROWS_PER_TASK rows (a pread at a time a thread: the device sees
# a queue only across threads, and the compiled preads drop the GIL)
READ_TASKS, ROWS_PER_TASK, CHUNK_ROWS = 32, 64, 128
# O_DIRECT through io_uring: the spans of one part of a call, read into a scratch of its own
# (8,192 rows of 264 B on 512-B sectors, 1,024 on 4 KiB ones); a bigger call is several parts,
# all in flight on the thread's ring at once
RING_BYTES = 8 << 20
# through the page cache a part's reads are tried at once (start_into) and, where the page cache
# held them, placed before the next part is read: small enough that its scratch is still in the
# CPU's cache then
PAGE_CACHE_PART_BYTES = 1 << 20
_SUMS = _Scratch()  # this thread's buffer of format 1 row sums as read


class _Part:
    """Rows ids[a:b] of a read_into call, their reads in flight on the thread's ring or to
    be pread when finished: their records (`rows`) and, format 1, their sums from the
    row-sum file (`sums`). SegmentReader._place_part finishes it once;
    abandon() waits for what is still in flight (its reads write the scratch until they end)."""

    __slots__ = ("a", "b", "rows", "sums")

    def __init__(self, a: int, b: int, rows: RowReads, sums: RowReads | None):
        self.a, self.b, self.rows, self.sums = a, b, rows, sums

    def landed(self) -> bool:
        """Every read of the part is done already (start_rows read it all without waiting)."""
        return self.rows.landed() and (self.sums is None or self.sums.landed())

    def abandon(self) -> None:
        self.rows.abandon()
        if self.sums is not None:
            self.sums.abandon()


class Reading:
    """A SegmentReader.start_into call: rows read and placed (`results`) or in flight on this
    thread's ring (`parts`). finish() once, in the thread that started it: the parts waited for in
    order, verified and placed; records made where they were not read; the bytes counted;
    ChecksumError for the first bad row. Where finishing fails part-way, the parts not
    finished are still waited for (their reads write buffers until they end) before the
    error passes."""

    def __init__(self, reader: "SegmentReader", ids, dest, slots, records, results: list, parts=()):
        self.reader, self.ids, self.dest, self.slots, self.records = reader, ids, dest, slots, records
        self.results, self.parts = results, list(parts)

    def finish(self) -> None:
        r, ids, dest, slots, records = self.reader, self.ids, self.dest, self.slots, self.records
        read = records if r._records_read else None
        parts, self.parts = self.parts, []
        try:
            for part in parts:
                self.results.append(r._place_part(part, ids, dest, slots, read))
        finally:
            for part in parts:
                part.abandon()  # finished ones: nothing left
        if records is not None and ids.size and not r._records_read:
            records[slots] = r.carried_records(ids, dest[slots])
        r._report(ids, self.results)

    def abandon(self) -> None:
        """Nothing more placed (rows the page cache held may be placed already: the call's dest
        rows hold anything): the reads still in flight waited for (their buffers given back)."""
        parts, self.parts = self.parts, []
        for part in parts:
            part.abandon()


class SegmentReader(ColdTier):
    """Verified reads of one table version from its segment files: the row path (misses, each
    row checked against its own sum) here, built on the version's open files
    (segment_files.SegmentFiles), its record format (record_format.RecordFormat) and the block
    path (blocks.Blocks: loading, publishing and scrubbing, and the rows of versions without
    row sums).

    data_dir: the data directory the manifest's segment paths are relative to.
    version: the manifest (Catalog.get / Catalog.current).
    checksums: uint64 [n_blocks] from Catalog.checksums, or a BlockChecksums (closed with the reader).
    direct_io: read rows with O_DIRECT (no page cache); InvalidArgument when
        the filesystem refuses it (tmpfs). Block reads stay buffered and drop
        what they read from the page cache.

    Thread-safe: every read is a pread (or an io_uring read) at its offset, never
    a shared file offset, and nothing is mapped. A missing, truncated or
    non-regular segment file reads as corrupt (ChecksumError), and so does one cut
    short while it is read: a short read, never a signal. `bytes_read` counts bytes
    read from the files (records through the page cache, sectors with O_DIRECT,
    whole blocks on the block path; not the sums place_rows reads to check rows
    it is handed). `verifies_rows`: each row read is checked against its own
    checksum (a format 2 version, whose records carry it; or a format 1 version
    with a usable row-sum file), else rows verify by their block. Format 1's
    row-sum file is checked once at open against the manifest's xxh3 and then
    read beside the rows, 8 B a row (nothing per row held: the sidecar and its
    clients on the host share its page-cache copy); `row_sums_error` says why a
    format 1 version's row sums were not usable.
    """

    def __init__(self, data_dir, version: TableVersion, checksums: np.ndarray, *, direct_io: bool = False):
        self.data_dir, self.version = Path(data_dir), version
        self.table, self.rows, self.row_bytes = version.table, version.rows, version.row_bytes
        self.block_rows, self.record_bytes = version.block_rows, version.record_bytes
        # an array, or read from the catalog per call (BlockChecksums: only the block path reads them)
        self.checksums = checksums if isinstance(checksums, BlockChecksums) else np.asarray(checksums, np.uint64)
        if self.checksums.shape != (version.n_blocks,):
            raise InvalidArgument(f"table {self.table!r} version {version.number}: expected "
                                  f"{version.n_blocks} checksums, got {self.checksums.shape}")
        key = rowsum.RowKey.of(version.row_salt)  # what this version's row sums are keyed by
        self.files = SegmentFiles(self.data_dir, version, key, direct_io)
        try:
            self.format = RecordFormat(version, self.files, key)
            self.blocks = Blocks(self.files, self.format, self.checksums)
            warm()  # the read loops compiled at open, not on the first miss
        except BaseException:
            self.files.close()
            raise
        self.direct, self.row_sums_error = self.files.direct, self.files.row_sums_error
        self.verifies_rows, self.row_key = self.format.verifies_rows, key
        self._lock = threading.Lock()
        self._rows_read = 0
        # read_into's records are the records as read (no sum made again): carried_form "records"
        self._records_read = self.carried_form == "records"

    @property
    def bytes_read(self) -> int:
        return self._rows_read + self.blocks.bytes_read

    # ---- public reads ------------------------------------------------------
    def read_rows(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows `ids` as uint8 [len(ids), row_bytes] in the caller's order.

        ids: any integer array (flattened); duplicates are fine and read once.
        out: optional C-contiguous uint8 [len(ids), row_bytes] to fill.
        Raises IdOutOfRange, InvalidArgument (dtype/out), ChecksumError.
        """
        flat = check_ids(ids, self.rows, self.table)
        out = check_out(out, flat.size, self.row_bytes)
        if flat.size == 0:
            return out
        if not self.verifies_rows:
            return self.blocks.read_rows(flat, out)
        if flat.size == 1 or np.all(flat[1:] > flat[:-1]):  # already sorted and unique: no bounce
            self.read_into(flat, out, np.arange(flat.size))
            return out
        uniq, inv = np.unique(flat, return_inverse=True)
        tmp = np.empty((uniq.size, self.row_bytes), dtype=np.uint8)
        self.read_into(uniq, tmp, np.arange(uniq.size))
        np.take(tmp, inv.reshape(-1), axis=0, out=out, mode="clip")  # in range; "raise" would buffer
        return out

    def read_into(self, ids: np.ndarray, dest: np.ndarray, slots: np.ndarray,
                  records: np.ndarray | None = None) -> None:
        """Write row ids[i] into dest[slots[i]], each row verified; the engine's miss path.

        ids: int64, sorted, unique and in range (not re-checked: the engine
            validated them at the edge).
        dest: writable uint8 [capacity, row_bytes] (the arena view).
        slots: integer [len(ids)], distinct rows of dest.
        records: optional writable uint8 [capacity, W] (W the width carried_records gives:
            record_bytes in format 2): records[slots[i]] = row ids[i]'s record as a client
            carries it (carried_records). With sums in the records (carried_form
            "records") the verified records as read, so no sum is computed again;
            elsewhere made from the rows.
        Thread-safe: call concurrently on one reader, no lock needed.
        Raises ChecksumError (DATA_LOSS: table, version, block and row) when any
        row fails verification or its segment (or format 1's row-sum file) is
        missing/truncated/not a file, truncated while read included; dest rows of
        that call may then hold anything (free those slots).
        OSError passes through. start_into(...).finish(), at once.
        """
        self.start_into(ids, dest, slots, records).finish()

    def start_into(self, ids: np.ndarray, dest: np.ndarray, slots: np.ndarray,
                   records: np.ndarray | None = None) -> "Reading":
        """read_into in two halves. Through io_uring, the rows' reads are submitted to this
        thread's ring and this returns while the device (or the page cache) serves them;
        Reading.finish(), in this thread, waits, verifies and places them and raises what
        read_into raises. So a caller puts several calls' reads in flight (a step's tables)
        and works on one while the next is read, the queue never draining between them.
        Through the page cache, each part is first read here without waiting (the rows the
        page cache holds) and, when that read it all, placed at once, while its scratch is
        still in the CPU's cache; only the rest waits on the ring. Without io_uring the
        rows are pread here (by the pool, for many) and finish() places nothing more.
        Raises ChecksumError for a segment that is not there, before any read."""
        n = int(ids.size)
        if n == 0:
            return Reading(self, ids, dest, slots, records, [])
        if not self.verifies_rows:  # a version written before row checksums: verify whole blocks
            dest[slots] = self.blocks.read_rows(ids, np.empty((n, self.row_bytes), dtype=np.uint8))
            return Reading(self, ids, dest, slots, None, [])  # nothing carried: no row sums
        self.files.check_present(ids)
        ring = thread_ring()
        if ring is None:
            return Reading(self, ids, dest, slots, records,
                           self._read_many(ids, dest, slots, records if self._records_read else None))
        # a call's rows over all its segments through this thread's one ring, in parts of
        # RING_BYTES of spans (PAGE_CACHE_PART_BYTES through the page cache), all submitted
        # now: the ring stays at its depth to the last read, one drain a call (or a step, for
        # a caller that starts its tables first)
        fds, offs = self.files.where(ids)
        cuts = part_starts(fds, offs, self.record_bytes, self.files.align, self.files.gap,
                           RING_BYTES if self.direct is not None else PAGE_CACHE_PART_BYTES).tolist()
        parts, results, read = [], [], records if self._records_read else None
        try:
            for a, b in zip([0] + cuts, cuts + [n]):
                part = self._start_part(ids, fds, offs, a, b, ring)
                if not part.landed():
                    parts.append(part)
                    continue
                try:  # read whole by now (the page cache held it): placed while its bytes are cache-hot
                    results.append(self._place_part(part, ids, dest, slots, read))
                finally:
                    part.abandon()  # its scratch is the next part's
        except BaseException:
            for p in parts:
                p.abandon()
            raise
        return Reading(self, ids, dest, slots, records, results, parts)

    def _report(self, ids: np.ndarray, results: list) -> None:
        """Count the bytes a call read; ChecksumError for its first bad row."""
        with self._lock:
            self._rows_read += sum(r[0] for r in results)
        bad = [r[1:] for r in results if r[1] >= 0]
        if bad:
            i, why = min(bad)
            raise self.files.error(int(ids[i]), why)

    def _start_part(self, ids: np.ndarray, fds: np.ndarray, offs: np.ndarray, a: int, b: int, ring) -> _Part:
        """The reads of rows ids[a:b] (sorted, in segments that are there; fds, offs: _where(ids))
        started: submitted to `ring`, or with ring None to be pread when the part is placed.
        Each has a scratch of its own (spare_buffer), so several parts may be in flight at once."""
        cached = self.direct is None  # through the page cache: what it holds is read at once, no ring
        rows = start_rows(fds[a:b] if fds.size > 1 else fds, offs[a:b], self.record_bytes, self.files.align,
                          spare_buffer, ring, give_back, self.files.gap, cached)
        try:
            sums = self.format.start_sums(ids[a:b], ring)
        except BaseException:
            rows.abandon()
            raise
        return _Part(a, b, rows, sums)

    def _place_part(self, part: _Part, ids, dest, slots, records) -> tuple[int, int, str]:
        """A part's rows, once read, verified and placed into dest[slots[a:b]], their records as
        read into records[slots] (given under carried_form "records"); (bytes read, index of
        the first bad row or -1, why: "" for a row that fails its sum)."""
        a, b = part.a, part.b
        nbytes, short, src, at = part.rows.finish_in_place()  # placed from where they landed: no copy
        if short >= 0:
            return nbytes, a + short, self.files.gone(int(ids[a + short]))
        sums = None
        if part.sums is not None:
            got = thread_buffer(_SUMS, SUM_BYTES * (b - a))[:SUM_BYTES * (b - a)].reshape(b - a, SUM_BYTES)
            _, short = part.sums.finish(got)
            if short >= 0:
                return nbytes, a + short, self.format.sums_short(int(ids[a + short]))
            sums = got.view("<u8").reshape(-1)
        bad = self.format.place(src, at, ids[a:b], dest, slots[a:b], sums)
        if bad < 0 and records is not None:
            records[slots[a:b]] = src[at]  # verified by _place: each its row and the sum keyed by its id
        return nbytes, (a + bad if bad >= 0 else -1), ""

    def _read_part(self, ids, fds, offs, a: int, b: int, dest, slots, records) -> tuple[int, int, str]:
        """Rows ids[a:b] pread, verified and placed, at once (_place_part's result)."""
        part = self._start_part(ids, fds, offs, a, b, None)
        try:
            return self._place_part(part, ids, dest, slots, records)
        finally:
            part.abandon()  # its scratch given back

    def _read_many(self, ids, dest, slots, records) -> list[tuple[int, int, str]]:
        """Without io_uring: rows in chunks of CHUNK_ROWS, pread one at a time a thread, over
        the pool's threads when there are many (the device sees a queue only across them)."""
        n = int(ids.size)
        chunks = [(a, min(a + CHUNK_ROWS, n)) for a in range(0, n, CHUNK_ROWS)]
        k = max(1, min(READ_TASKS, len(chunks), n // ROWS_PER_TASK))
        fds, offs = self.files.where(ids)
        run = lambda part: [self._read_part(ids, fds, offs, a, b, dest, slots, records) for a, b in part]
        with cpu_token.waiting():  # reads that may wait on the device: other plans compute meanwhile
            if k > 1:
                return [r for rs in read_pool().map(run, [chunks[i::k] for i in range(k)]) for r in rs]
            return run(chunks)

    @property
    def cold_dir(self) -> Path | None:
        """This reader's data directory when its rows verify one by one (a client on the host
        then reads its misses from the same segment files), else None."""
        return self.data_dir if self.verifies_rows else None

    @property
    def carried_form(self) -> str:
        """How a client on the host hands the sidecar the misses it read and verified, so the
        sidecar promotes them without reading them again: "records", each row with its row
        sum as read (format 2, whose sum on disk would cost the sidecar a read of its own:
        place_records; the sidecar takes records only from a peer with its own uid, who can
        write the segments anyway: served.note), and only where the sums are keyed by the
        version's salt (fmix64-v2), so a record of another table or version fails; "rows",
        checked against sums the sidecar reads itself (place_rows: format 1's row-sum
        file, 8 B a row; a format 2 version written before row_salt, through the page
        cache); "" for a version without row sums, or a format 2 version under O_DIRECT
        written before row_salt (its misses are read from disk: nothing the sidecar did
        not verify for this place is ever placed)."""
        if not self.verifies_rows:
            return ""
        if self.format.sums_in_records and self.row_key.binds_version:
            return "records"
        return "" if self.format.sums_in_records and self.direct is not None else "rows"

    def carried_records(self, ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The format 2 records (row, padding, row sum) of verified rows uint8 [n, row_bytes]
        stored as `ids` (int64 [n]), as a client carries them (carried_form "records")."""
        return self.format.carried_records(ids, rows)

    def place_records(self, ids: np.ndarray, src: np.ndarray, row_at: np.ndarray, dest: np.ndarray,
                      slots: np.ndarray) -> int:
        """Write the row of record src[row_at[i]] into dest[slots[i]], each checked against
        the sum its record carries for row ids[i] of this version: a damaged record fails,
        and so does a genuine record of another id, table or version (its sum is keyed by
        another salt, rowsum.RowKey). The sum comes with the record: the caller vouches
        for whoever sent it (the sidecar only for a peer of its own uid). src: uint8 [*,
        record_bytes]; ids, row_at, slots: int64 [n]. Returns the index of the first record
        that fails, or -1; every record fails for a table without row sums in its records keyed
        by its salt (fmix64-v1 binds the id alone: a record would pass at any version)."""
        if ids.size == 0:
            return -1
        if not (self.verifies_rows and self.format.sums_in_records and self.row_key.binds_version) or src.ndim != 2 \
                or src.shape[1] != self.record_bytes:
            return 0
        return place_records(src, row_at, ids, dest, slots, self.row_key)

    def place_rows(self, ids: np.ndarray, src: np.ndarray, row_at: np.ndarray, dest: np.ndarray,
                   slots: np.ndarray) -> int:
        """Write src[row_at[i]], row ids[i] as someone else read it, into dest[slots[i]], each
        row verified against its row sum in the same pass (verified_copy.place_verified):
        the sidecar promotes the rows a client on the host read without reading the rows again.

        ids: int64, in range (the engine checked them); src: uint8 [*, row_bytes];
        row_at, slots: int64 [len(ids)]. Returns the index of the first row that does
        not match its row sum, or -1 when all do; after a mismatch the rows of this
        call in dest may hold anything (the caller reads them from disk instead).
        Every row mismatches for a version without row sums: nothing unverified is
        ever placed. The sums are read from disk, never taken from the client: format
        2's from the records' last words (pages the client's read has just brought into
        the page cache), format 1's from the row-sum file; with O_DIRECT format 2's are
        not cached, and the client carries whole records instead (carried_form,
        place_records). ChecksumError when a segment or the row-sum file is not there
        or ends before a row's sum."""
        if ids.size == 0:
            return -1
        if not self.verifies_rows or src.ndim != 2 or src.shape[1] != self.row_bytes:
            return 0
        order = np.argsort(ids, kind="stable")
        sums = np.empty(ids.size, dtype=np.uint64)
        sums[order] = self.format.stored_sums(ids[order])
        return place_verified(src, row_at, ids, dest, slots, sums, self.row_key, np.arange(ids.size))

    def close(self) -> None:
        self.files.close()
        self.blocks.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ---- the block path (blocks.py) ----
    def read_range(self, start: int, n: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows [start, start + n) as uint8 [n, row_bytes], verified block by block (Blocks.read_range)."""
        return self.blocks.read_range(start, n, out)

    def iter_blocks(self, rows_per_chunk: int | None = None):
        """Yield (first_row, uint8 [k, row_bytes]) over the whole table, verified (Blocks.iter_blocks)."""
        return self.blocks.iter_blocks(rows_per_chunk)

    def disk_blocks(self, group: int):
        """Yield (first block, its on-disk blocks), `group` at a time, verified (Blocks.disk_blocks)."""
        return self.blocks.disk_blocks(group)

    def verify(self) -> list[int]:
        """Every block re-checked, and every row against its row sum: the bad blocks (Blocks.verify)."""
        return self.blocks.verify()
