"""The cold tier: rows read straight from a version's segment files.

Addresses are computed (row i's record sits at a fixed offset). A record is
the row followed by its per-row checksum (segment format 2, the default:
tierstore.store.version.TableVersion), or the row alone with the checksums in
a separate row-sum file (format 1, older versions): record_format.py. Two read paths:

- Rows (the read pipeline's submit, finish and place stages, miss_batch.py; and
  `read_rows` on top of it), for versions that carry a per-row checksum
  (tierstore.tiers.nvme.rowsum, written at ingest): each miss reads only its
  record, verified in one compiled pass against the sum the record carries
  (format 2: nothing per row is held in memory) or the one read beside it from
  the row-sum file (format 1), and written into the caller's slots. A batch's
  records are read into scratch buffers (direct_io.Spans) and placed from where
  they land: through the page cache by default (each record's own bytes, records
  a few KiB apart in one read), or with `direct_io=True` with O_DIRECT (the
  aligned sectors of each row), so the cold tier is not cached twice. Through the
  page cache a batch's reads are first tried without waiting (what the page cache
  holds is copied at once, in one compiled loop, and placed part by part while
  its scratch is cache-hot); what must wait on the device, and every O_DIRECT
  read, goes through the calling thread's one io_uring, in parts (submit returns
  while the device reads them, so a caller keeps several batches' reads in flight
  at once), or, where there is no io_uring, through the read pool's preads.
- Blocks (blocks.py: `read_range`, `iter_blocks`, `disk_blocks`, `verify`, and
  rows of versions written before row checksums existed): one pread per run of
  neighbouring blocks, each checked against its xxh3-64 in the catalog over the
  on-disk bytes (a record's row and sum alike).

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
from tierstore.errors import ChecksumError, InvalidArgument
from tierstore.tiers import trust
from tierstore.tiers.nvme import direct_io, rowsum
from tierstore.tiers.base import ColdTier, check_ids, check_out
from tierstore.tiers.nvme.blocks import Blocks, read_pool
from tierstore.tiers.nvme.record_format import RecordFormat
from tierstore.tiers.nvme.segment_files import SUM_BYTES, SegmentFiles
from tierstore.tiers.nvme.verified_copy import place_verified
from tierstore.tiers.nvme.direct_io import (Spans, _Scratch, give_back, part_starts, spare_buffer, thread_buffer,
                                            thread_ring, warm)
from tierstore.tiers.nvme.miss_batch import MissBatch, Part

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
# through the page cache a part's reads are tried at once (submit) and, where the page cache
# held them, placed before the next part is read: small enough that its scratch is still in the
# CPU's cache then
PAGE_CACHE_PART_BYTES = 1 << 20
_SUMS = _Scratch()  # this thread's buffer of format 1 row sums as read


def _pread_parts(parts: list) -> None:
    """A pool task: every span of `parts` pread (what is short is read on at finish)."""
    for part in parts:
        for spans in part.spans:
            spans.pread(np.arange(spans.res.size))


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
        # what a client on the host carries for the misses it read (tierstore/tiers/trust.py)
        self.carried = trust.Carried.of(verifies_rows=self.verifies_rows, sums_in_records=self.format.sums_in_records,
                                        binds_version=key.binds_version, direct=self.direct is not None,
                                        row_bytes=self.row_bytes, record_bytes=self.record_bytes)
        self._lock = threading.Lock()
        self._rows_read = 0

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
            MissBatch(self, flat, out, np.arange(flat.size)).submit().finish()
            return out
        uniq, inv = np.unique(flat, return_inverse=True)
        tmp = np.empty((uniq.size, self.row_bytes), dtype=np.uint8)
        MissBatch(self, uniq, tmp, np.arange(uniq.size)).submit().finish()
        np.take(tmp, inv.reshape(-1), axis=0, out=out, mode="clip")  # in range; "raise" would buffer
        return out

    # ---- the read pipeline's stages on this tier (miss_batch.py) ----
    def submit(self, batch: MissBatch, at: np.ndarray):
        """The submit stage: the reads of rows batch.ids[at] (sorted positions) started, one Part
        at a time (a generator: the batch places a part the page cache held whole before the
        next is read, its scratch still in the CPU's cache). With io_uring, all of them over
        all their segments go through this thread's one ring, in parts of RING_BYTES of spans
        (PAGE_CACHE_PART_BYTES through the page cache, each first read here without waiting:
        what the page cache holds needs no ring); without it, the parts are pread on the read
        pool. Each part has a scratch of its own (spare_buffer), so several are in flight at
        once. A version without row sums is read here by its blocks, placed, and yields
        nothing. ChecksumError for a segment that is not there, before any read."""
        ids = batch.ids[at]
        if ids.size == 0:
            return
        if not self.verifies_rows:  # a version written before row checksums: verify whole blocks
            batch.dest[batch.slots[at]] = self.blocks.read_rows(ids, np.empty((ids.size, self.row_bytes), np.uint8))
            return
        self.files.check_present(ids)
        fds, offs = self.files.where(ids)
        ring = thread_ring()
        if ring is None:
            yield from self._pool_parts(ids, fds, offs, at)
            return
        cached = self.direct is None  # through the page cache: what it holds is read at once
        cuts = part_starts(fds, offs, self.record_bytes, self.files.align, self.files.gap,
                           PAGE_CACHE_PART_BYTES if cached else RING_BYTES).tolist()
        start = ring.queued
        for a, b in zip([0] + cuts, cuts + [ids.size]):
            part = self._part(ids, fds, offs, at, a, b)
            try:
                for spans in part.spans:
                    if cached:
                        spans.read_cached()
                    todo = spans.short()
                    if todo.size > 1:  # one read alone: left for finish to pread
                        depth = min(direct_io.READ_DEPTH, ring.entries)
                        part.tickets.append((spans, todo, ring.submit(*spans.ring_reads(todo), depth,
                                                                      keep=spans.scratch)))
            except BaseException:
                self.abandon(part)
                raise
            batch.queued = (start if batch.queued is None else batch.queued[0], ring.queued)
            yield part

    def _part(self, ids, fds, offs, at, a: int, b: int) -> Part:
        """The spans of rows ids[a:b] (records, then format 1's sums), nothing read yet."""
        rows = Spans(fds[a:b] if fds.size > 1 else fds, offs[a:b], self.record_bytes, self.files.align, spare_buffer,
                     give_back, self.files.gap)
        try:
            sums = self.format.sum_spans(ids[a:b])
        except BaseException:
            rows.give_back()
            raise
        return Part(at[a:b], [rows] if sums is None else [rows, sums])

    def _pool_parts(self, ids, fds, offs, at):
        """Without io_uring: parts of CHUNK_ROWS, pread on the read pool by at most READ_TASKS
        tasks of at least ROWS_PER_TASK rows (a pread at a time a thread: the device sees a
        queue only across threads, and the compiled preads drop the GIL)."""
        n = int(ids.size)
        parts = [self._part(ids, fds, offs, at, a, min(a + CHUNK_ROWS, n)) for a in range(0, n, CHUNK_ROWS)]
        k = max(1, min(READ_TASKS, len(parts), n // ROWS_PER_TASK))
        groups = [parts[i::k] for i in range(k)]
        try:
            for group in groups:
                task = read_pool().submit(_pread_parts, group)
                for part in group:
                    part.task = task
        except BaseException:
            for part in parts:
                self.abandon(part)
            raise
        yield from parts

    def finish(self, part: Part) -> None:
        """The finish stage: a part's reads waited for (its ring batches, or its pool task). The
        CPU token is given up only for a pool task (cpu_token.waiting): a ring wait keeps it, so
        the sidecar's fills do not run side by side and pin a small arena's slots all at once
        (planned steps were refused ResourceExhausted so: tests/reliability/
        test_truncation_while_serving.py). OSError where io_uring_enter failed."""
        if part.task is not None:
            task, part.task = part.task, None
            with cpu_token.waiting():  # reads on the pool's threads: other plans compute meanwhile
                task.result()
        if part.tickets:
            ring = thread_ring()
            while part.tickets:
                spans, todo, ticket = part.tickets.pop(0)
                spans.res[todo] = ring.wait(ticket)

    def place(self, part: Part, batch: MissBatch) -> tuple[int, str]:
        """The verify and place stage: a finished part's rows (what the ring left short pread
        now) checked against their sums and written to batch.dest[batch.slots[at]] from where
        they landed, their records as read into batch.records where it asks (trust.RECORDS);
        the part's scratch given back. (position of the first row that failed or -1, why:
        its file cut short, or "" for a row that fails its sum). OSError for a read that failed."""
        at = part.at
        ids = batch.ids[at]
        nbytes = 0
        try:
            rows = part.spans[0]
            got, short = rows.settle()
            nbytes += got
            if short >= 0:
                return int(at[short]), self.files.gone(int(ids[short]))
            sums = None
            if len(part.spans) > 1:
                k = at.size
                buf = thread_buffer(_SUMS, SUM_BYTES * k)[:SUM_BYTES * k].reshape(k, SUM_BYTES)
                got, short = part.spans[1].settle()
                if short >= 0:
                    return int(at[short]), self.format.sums_short(int(ids[short]))
                part.spans[1].copy_rows(buf, -1)
                sums = buf.view("<u8").reshape(-1)
            src, row_at = rows.rows()
            slots = batch.slots[at]
            bad = self.format.place(src, row_at, ids, batch.dest, slots, sums)
            if bad >= 0:
                return int(at[bad]), ""
            if batch.records is not None and self.carried.form == trust.RECORDS:
                batch.records[slots] = src[row_at]  # verified by place: each its row and the sum keyed by its id
            return -1, ""
        finally:
            with self._lock:
                self._rows_read += nbytes
            for spans in part.spans:
                spans.give_back()

    def abandon(self, part: Part) -> None:
        """A part that will not be placed: its reads still in flight waited for (they write its
        scratch until they end), then its scratch given back. Never raises."""
        task, part.task = part.task, None
        if task is not None:
            try:
                task.result()
            except BaseException:  # noqa: BLE001 - abandoning: its error is not this one's
                pass
        while part.tickets:
            _, _, ticket = part.tickets.pop(0)
            try:
                thread_ring().wait(ticket)
            except (OSError, KeyError):
                pass  # the ring is broken: closing it (with its thread) cancels what is left
        for spans in part.spans:
            spans.give_back()

    def landed(self, part: Part) -> bool:
        """Every read of `part` done (its pool task, its ring batches), asked without waiting."""
        if part.task is not None and not part.task.done():
            return False
        return not part.tickets or all(thread_ring().done(ticket) for _, _, ticket in part.tickets)

    def land(self, batch: MissBatch, share: float) -> None:
        """`share` of batch's reads on this thread's ring landed (MissBatch.land)."""
        ring = thread_ring()
        if ring is not None and batch.queued is not None:
            q0, q1 = batch.queued
            ring.settle(q0 + int((q1 - q0) * share))

    def row_error(self, row: int, why: str = "") -> ChecksumError:
        """The ChecksumError of `row` (SegmentFiles.error): a batch raises it for its first bad row."""
        return self.files.error(row, why)

    @property
    def cold_dir(self) -> Path | None:
        """This reader's data directory when its rows verify one by one (a client on the host
        then reads its misses from the same segment files), else None."""
        return self.data_dir if self.verifies_rows else None

    def carried_records(self, ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The format 2 records (row, padding, row sum) of verified rows uint8 [n, row_bytes]
        stored as `ids` (int64 [n]), as a client carries them (trust.RECORDS)."""
        return self.format.carried_records(ids, rows)

    def place_carried(self, ids: np.ndarray, src: np.ndarray, row_at: np.ndarray, dest: np.ndarray,
                      slots: np.ndarray) -> int:
        """Write src[row_at[i]], row ids[i] as a client on the host read it and carries it in
        this version's form (`carried`, tierstore/tiers/trust.py, which admitted it), into
        dest[slots[i]], each checked in the same pass: a record (trust.RECORDS) against the
        sum it carries, keyed by this version's salt, so a damaged record fails and so does
        a genuine record of another id, table or version; a bare row (trust.ROWS) against
        the sum on disk (place_rows). src: uint8 [*, carried.width]; ids, row_at, slots:
        int64 [n]. Returns the index of the first that fails, or -1; every one fails where
        the version carries nothing. ChecksumError as place_rows raises it."""
        if ids.size == 0:
            return -1
        if self.carried.form == trust.RECORDS:
            return self.format.place(src, row_at, ids, dest, slots)
        if self.carried.form == trust.ROWS:
            return self.place_rows(ids, src, row_at, dest, slots)
        return 0

    def place_rows(self, ids: np.ndarray, src: np.ndarray, row_at: np.ndarray, dest: np.ndarray,
                   slots: np.ndarray) -> int:
        """Write src[row_at[i]], row ids[i] as someone else read it, into dest[slots[i]], each
        row verified against its row sum in the same pass (verified_copy.place_verified).

        ids: int64, in range (the engine checked them); src: uint8 [*, row_bytes];
        row_at, slots: int64 [len(ids)]. Returns the index of the first row that does
        not match its row sum, or -1 when all do; after a mismatch the rows of this
        call in dest may hold anything (the caller reads them from disk instead).
        Every row mismatches for a version without row sums: nothing unverified is
        ever placed. The sums are read from disk, never taken from the sender: format
        2's from the records' last words (pages the client's read has just brought into
        the page cache), format 1's from the row-sum file. ChecksumError when a segment
        or the row-sum file is not there or ends before a row's sum."""
        if ids.size == 0:
            return -1
        if not self.verifies_rows:
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
