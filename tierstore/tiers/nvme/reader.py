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
import os
import stat
import threading
from pathlib import Path

import numpy as np
import xxhash

from tierstore import cpu_token
from tierstore.store.catalog import BlockChecksums, TableVersion
from tierstore.errors import ChecksumError, InvalidArgument
from tierstore.tiers.nvme import rowsum
from tierstore.tiers.base import ColdTier, check_ids, check_out, gather_by_block
from tierstore.tiers.nvme.verified_copy import place_records, place_verified
from tierstore.tiers.nvme.direct_io import (DirectFiles, RowReads, _Scratch, give_back, part_starts, spare_buffer,
                                            start_rows, thread_buffer, thread_ring, warm)

log = logging.getLogger(__name__)

__all__ = ["SegmentReader", "default_block_rows", "read_pool", "BLOCK_TARGET_BYTES"]

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
# through the page cache, records this close share a read (the bytes between read too): a read
# costs about what copying a few KiB does, so misses that fall near each other (a table the
# page cache holds, a prefill's many misses) take fewer reads. O_DIRECT: none (each sector is
# the device's work)
PAGE_CACHE_GAP = 2048
SUM_BYTES = 8  # a row sum: format 2's record ends with it, format 1's row-sum file is one a row
_SUMS = _Scratch()  # this thread's buffer of format 1 row sums as read


def _open_segment(path: Path) -> tuple[int | None, str | None]:
    """(fd, None) for a regular file, else (None, why). O_NONBLOCK: opening a
    FIFO put where a segment was must not wait for a writer; a regular file's
    reads may then block (io_uring queues a read of a page not in the page
    cache rather than answering EAGAIN). Advised random: a miss reads its own
    pages, no read-ahead around them (a block read asks for its whole range)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, "missing"
    mode = os.fstat(fd).st_mode
    if stat.S_ISREG(mode):
        os.set_blocking(fd, True)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return fd, None
    os.close(fd)
    kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "not a file"
    return None, f"not a regular file ({kind}); restore it or re-ingest the table"


def _xxh3_of(fd: int, nbytes: int) -> int | None:
    """xxh3-64 of the first `nbytes` of the file at fd, read in pieces (into this thread's sums
    scratch); None when it is shorter."""
    h, got = xxhash.xxh3_64(), 0
    view = memoryview(thread_buffer(_SUMS, 1 << 20))
    while got < nbytes:
        n = os.preadv(fd, [view[:min(len(view), nbytes - got)]], got)
        if n == 0:
            return None
        h.update(view[:n])
        got += n
    return h.intdigest()


# ---- the block path's sizes and pool ----
# A block is the unit of checksumming and of reading: verifying a row means
# reading its whole block, so the block size is the read amplification of a
# cache miss. About 4 KiB, one NVMe page: a random 4 KiB read is the cheapest
# the device does, so a bigger block only multiplies the bytes a miss reads
# (docs/decisions.md, "The checksum block"). The price is the checksum list:
# 8 B a block, 1/512 of the table.
BLOCK_TARGET_BYTES = 4 * 1024
# Bound the scratch memory of one call: blocks are read and verified in groups.
GROUP_BYTES = 8 << 20


# Reads of many scattered blocks or rows go out from a small thread pool: NVMe
# needs a queue depth to reach its IOPS, and preadv (like a gather that faults
# pages in) releases the GIL.
READ_THREADS = 32
PARALLEL_MIN_RUNS = 32
_POOL = None
_POOL_LOCK = threading.Lock()


def read_pool():
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            from concurrent.futures import ThreadPoolExecutor
            _POOL = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="nvme-read")
        return _POOL


def default_block_rows(row_bytes: int) -> int:
    """Rows per checksummed block for rows of `row_bytes` (about BLOCK_TARGET_BYTES)."""
    return max(1, BLOCK_TARGET_BYTES // row_bytes)


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
    """Verified reads of one table version from its segment files.

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
        self.data_dir = Path(data_dir)
        self.version = version
        self.table = version.table
        self.rows = version.rows
        self.row_bytes = version.row_bytes
        self.block_rows = version.block_rows
        self.sums_in_records = version.segment_format == 2  # each record carries its row sum
        self.row_key = rowsum.RowKey.of(version.row_salt)  # what this version's row sums are keyed by
        self.record_bytes = version.record_bytes
        # an array, or read from the catalog per call (BlockChecksums: only the block path reads them)
        self.checksums = checksums if isinstance(checksums, BlockChecksums) else np.asarray(checksums, np.uint64)
        if self.checksums.shape != (version.n_blocks,):
            raise InvalidArgument(f"table {self.table!r} version {version.number}: expected "
                                  f"{version.n_blocks} checksums, got {self.checksums.shape}")
        self._block_bytes = self.block_rows * self.record_bytes
        self._blocks_per_seg = version.segment_rows // self.block_rows
        self._fds: list[int | None] = []
        self._why: list[str | None] = []  # why a segment cannot be read
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.direct = None
        self._sums_fd = None  # format 1's row-sum file, read beside the rows
        for rel in version.segments:
            fd, why = _open_segment(self.data_dir / rel)
            self._fds.append(fd)
            self._why.append(why)
        try:
            self._sums_path, self.row_sums_error = self._open_row_sums()
            self.verifies_rows = self.sums_in_records or self._sums_fd is not None
            if direct_io:
                paths = [self.data_dir / rel if fd is not None else None
                         for rel, fd in zip(version.segments, self._fds)]
                self.direct = DirectFiles(paths)
            warm()  # the read loops compiled at open, not on the first miss
        except BaseException:
            self.close()
            raise
        # what rows are read through: O_DIRECT's descriptors and sector alignment, or the page
        # cache's descriptors and each record's own bytes (-1: a segment not there)
        fds, self._align, self._gap = ((self.direct.fds, self.direct.align, 0) if self.direct is not None
                                       else (self._fds, 1, PAGE_CACHE_GAP))
        self._row_fds = np.array([-1 if fd is None else fd for fd in fds], dtype=np.int64)
        self._all_present = bool((self._row_fds >= 0).all())
        # read_into's records are the records as read (no sum made again): carried_form "records"
        self._records_read = self.carried_form == "records"

    def _open_row_sums(self) -> tuple[Path | None, str | None]:
        """Format 1: open the row-sum file (self._sums_fd) if it holds the manifest's sums
        (its xxh3 over the first 8 B x rows); (its path, why it is not usable or None)."""
        meta = self.version.row_sums
        if not meta:
            return None, None
        where = f"table {self.table!r} version {self.version.number}"
        if meta.get("algo") != self.row_key.algo:
            known = "" if meta.get("algo") in rowsum.ALGOS else f"; this build knows {list(rowsum.ALGOS)}"
            return None, (f"{where}: row checksums use {meta.get('algo')!r}, yet its row_salt makes them "
                          f"{self.row_key.algo!r}{known}")
        path = self.data_dir / Path(self.version.segments[0]).parent / meta["file"]
        fd, why = _open_segment(path)
        if fd is None:
            err = f"{where}: row checksum file {path} is {why}"
        elif _xxh3_of(fd, self.rows * SUM_BYTES) != int(meta["xxh3"]):
            os.close(fd)
            err = f"{where}: row checksum file {path} is corrupt or truncated"
        else:
            self._sums_fd = fd
            return path, None
        log.warning("%s; rows are verified by their 4 KiB blocks instead (slower); re-ingest to restore", err)
        return path, err

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
            return self._read_rows_by_block(flat, out)
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
            dest[slots] = self._read_rows_by_block(ids, np.empty((n, self.row_bytes), dtype=np.uint8))
            return Reading(self, ids, dest, slots, None, [])  # nothing carried: no row sums
        self._check_present(ids)
        ring = thread_ring()
        if ring is None:
            return Reading(self, ids, dest, slots, records,
                           self._read_many(ids, dest, slots, records if self._records_read else None))
        # a call's rows over all its segments through this thread's one ring, in parts of
        # RING_BYTES of spans (PAGE_CACHE_PART_BYTES through the page cache), all submitted
        # now: the ring stays at its depth to the last read, one drain a call (or a step, for
        # a caller that starts its tables first)
        fds, offs = self._where(ids)
        cuts = part_starts(fds, offs, self.record_bytes, self._align, self._gap,
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
            self.bytes_read += sum(r[0] for r in results)
        bad = [r[1:] for r in results if r[1] >= 0]
        if bad:
            i, why = min(bad)
            raise self._error(int(ids[i]), why)

    def _error(self, row: int, why: str) -> ChecksumError:
        """ChecksumError for `row` (its block named; err.row = row): `why`, or a row sum mismatch."""
        err = ChecksumError(self.table, self.version.number, row // self.block_rows,
                            f"row {row}" + (f": {why}" if why else ""))
        err.row = row
        return err

    def _check_present(self, ids: np.ndarray) -> None:
        """ChecksumError naming the first of sorted `ids` whose segment is not there (missing,
        not a regular file)."""
        if self._all_present:
            return
        sr = self.version.segment_rows
        seg = ids // sr
        held = seg[:1] if seg[0] == seg[-1] else seg[np.r_[0, np.flatnonzero(seg[1:] != seg[:-1]) + 1]]
        gone = held[self._row_fds[held] < 0]
        if gone.size:
            s = int(gone[0])
            raise self._error(int(ids[np.searchsorted(ids, s * sr)]),
                              f"segment {self.version.segments[s]} is {self._why[s]}")

    def _where(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where sorted `ids` are read: (their segments' descriptors, one a row, or the one
        for a table of one segment; each row's record number in its segment)."""
        if self._row_fds.size == 1:
            return self._row_fds, ids
        sr = self.version.segment_rows
        seg = ids // sr
        return self._row_fds[seg], ids - seg * sr

    def _start_part(self, ids: np.ndarray, fds: np.ndarray, offs: np.ndarray, a: int, b: int, ring) -> _Part:
        """The reads of rows ids[a:b] (sorted, in segments that are there; fds, offs: _where(ids))
        started: submitted to `ring`, or with ring None to be pread when the part is placed.
        Each has a scratch of its own (spare_buffer), so several parts may be in flight at once."""
        cached = self.direct is None  # through the page cache: what it holds is read at once, no ring
        rows = start_rows(fds[a:b] if fds.size > 1 else fds, offs[a:b], self.record_bytes, self._align,
                          spare_buffer, ring, give_back, self._gap, cached)
        sums = None
        if not self.sums_in_records:
            try:
                sums = start_rows(self._sums_fd, ids[a:b], SUM_BYTES, 1, spare_buffer, ring, give_back, PAGE_CACHE_GAP,
                                  True)
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
            s = int(ids[a + short]) // self.version.segment_rows
            return nbytes, a + short, f"segment {self.version.segments[s]} is truncated"
        sums = None
        if part.sums is not None:
            got = thread_buffer(_SUMS, SUM_BYTES * (b - a))[:SUM_BYTES * (b - a)].reshape(b - a, SUM_BYTES)
            _, short = part.sums.finish(got)
            if short >= 0:
                return nbytes, a + short, f"the row checksum file {self._sums_path} is truncated"
            sums = got.view("<u8").reshape(-1)
        bad = self._place(src, at, ids[a:b], dest, slots[a:b], sums)
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
        fds, offs = self._where(ids)
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
        if self.sums_in_records and self.row_key.binds_version:
            return "records"
        return "" if self.sums_in_records and self.direct is not None else "rows"

    def carried_records(self, ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The format 2 records (row, padding, row sum) of verified rows uint8 [n, row_bytes]
        stored as `ids` (int64 [n]), as a client carries them (carried_form "records")."""
        return rowsum.records(rows, ids, self.row_key)

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
        if not (self.verifies_rows and self.sums_in_records and self.row_key.binds_version) or src.ndim != 2 \
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
        sums[order] = self._stored_sums(ids[order])
        return place_verified(src, row_at, ids, dest, slots, sums, self.row_key, np.arange(ids.size))

    def _stored_sums(self, ids: np.ndarray) -> np.ndarray:
        """The row sums of sorted `ids` as stored (format 2: each record's last word; format 1:
        the row-sum file), read through the page cache; ChecksumError for a file that is
        not there or ends before one of them."""
        got, short = self._read_sums(ids)
        if short >= 0:
            raise self._error(int(ids[short]), self._sums_gone(int(ids[short])))
        return got

    def _read_sums(self, ids: np.ndarray) -> tuple[np.ndarray, int]:
        """(the stored row sums of sorted, unique `ids`, uint64 [n]; the index of the first whose
        file is not there or ends before it, or -1: the sums from there on are undefined)."""
        out = np.empty((ids.size, SUM_BYTES), dtype=np.uint8)
        if not self.sums_in_records:
            _, short = start_rows(self._sums_fd, ids, SUM_BYTES, 1, spare_buffer, thread_ring(), give_back,
                                  PAGE_CACHE_GAP, True).finish(out)
            return out.view("<u8").reshape(-1), short
        # a record's sum is its last 8-B word, and records are whole words: word k of its segment
        sr, words = self.version.segment_rows, self.record_bytes // SUM_BYTES
        seg = ids // sr
        fds = np.array([-1 if fd is None else fd for fd in self._fds], dtype=np.int64)[seg]
        gone = np.flatnonzero(fds < 0)
        n = int(gone[0]) if gone.size else ids.size
        short = -1
        if n:
            _, short = start_rows(fds[:n], (ids[:n] - seg[:n] * sr) * words + words - 1, SUM_BYTES, 1,
                                  spare_buffer, thread_ring(), give_back, PAGE_CACHE_GAP, True).finish(out)
        return out.view("<u8").reshape(-1), short if short >= 0 or n == ids.size else n

    def _sums_gone(self, row: int) -> str:
        """Why the stored sum of `row` could not be read (_read_sums found it short)."""
        if not self.sums_in_records:
            return f"the row checksum file {self._sums_path} is truncated"
        s = row // self.version.segment_rows
        return f"segment {self.version.segments[s]} is {self._why[s] or 'truncated'}"

    def _place(self, src: np.ndarray, at: np.ndarray, ids: np.ndarray, dest: np.ndarray,
               slots: np.ndarray, sums: np.ndarray | None = None) -> int:
        """Place records src[at] (as read from a segment) into dest[slots], each row verified:
        against the sum its record carries (format 2) or sums[i] (format 1: the rows' sums
        as read from the row-sum file, in the rows' order)."""
        if self.sums_in_records:
            return place_records(src, at, ids, dest, slots, self.row_key)
        return place_verified(src, at, ids, dest, slots, sums, self.row_key, np.arange(ids.size))

    def close(self) -> None:
        fds, self._fds = self._fds, []
        sums_fd, self._sums_fd = self._sums_fd, None
        for fd in fds + [sums_fd]:
            if fd is not None:
                os.close(fd)
        if self.direct is not None:
            self.direct.close()
        if isinstance(self.checksums, BlockChecksums):
            self.checksums.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ---- the block path: whole checksummed blocks ----

    def _block_len(self, blocks: np.ndarray) -> np.ndarray:
        """Bytes in each block on disk (only the table's last block may be short)."""
        end = np.minimum((blocks + 1) * self.block_rows, self.rows)
        return (end - blocks * self.block_rows) * self.record_bytes

    def _read_blocks(self, blocks: np.ndarray, buf: memoryview) -> None:
        """Read sorted unique `blocks` into `buf` (block j at j * block_bytes) and
        verify each; adjacent blocks in one segment are read with one pread. A block
        that fails its catalog checksum is a ChecksumError, which says the catalog is
        the damaged part when each of the block's rows passes its own row checksum
        (_blame)."""
        seg = blocks // self._blocks_per_seg
        brk = np.flatnonzero((np.diff(blocks) != 1) | (np.diff(seg) != 0)) + 1
        starts = np.concatenate([[0], brk])
        lens = self._block_len(blocks)
        # per-run arithmetic in numpy, so the loop below is one syscall per run and nothing else
        run_bytes = np.add.reduceat(lens, starts)
        run_buf = starts * self._block_bytes
        run_seg = seg[starts]
        run_off = (blocks[starts] - run_seg * self._blocks_per_seg) * self._block_bytes
        runs = list(zip(run_seg.tolist(), run_off.tolist(), run_buf.tolist(), run_bytes.tolist()))
        if len(runs) >= 2 * PARALLEL_MIN_RUNS:
            # random misses are one pread each: issue them from several threads (preadv drops
            # the GIL), so the device sees a queue of requests instead of one at a time
            k = min(READ_THREADS, len(runs) // PARALLEL_MIN_RUNS)
            parts = [runs[i::k] for i in range(k)]
            results = list(read_pool().map(lambda part: self._pread_runs(part, buf), parts))
        else:
            results = [self._pread_runs(runs, buf)]
        total = sum(t for t, _ in results)
        failed = [f for _, f in results if f is not None]
        if failed:
            s, first_block, got = min(failed, key=lambda f: f[1])
            bad = first_block + got // self._block_bytes
            what = self._why[s] or "truncated"
            raise ChecksumError(self.table, self.version.number, bad,
                                f"segment {self.version.segments[s]} is {what}")
        with self._lock:
            self.bytes_read += total
        expect = self.checksums[blocks].tolist()
        h = xxhash.xxh3_64_intdigest
        bb = self._block_bytes
        for j, (e, n) in enumerate(zip(expect, lens.tolist())):
            if h(buf[j * bb:j * bb + n]) != e:
                raise ChecksumError(self.table, self.version.number, int(blocks[j]),
                                    self._blame(int(blocks[j]), buf[j * bb:j * bb + n]))

    def _blame(self, block: int, raw: memoryview) -> str:
        """Why `block` (its bytes as read, `raw`) failed its catalog checksum, for the error:
        "" when one of its rows fails its own row checksum too (or a format 2 record's zero
        padding is not zero), or the version has none: the block is corrupt. Else every byte
        of the block is as written (each row checked by a sum keyed by its id, the padding
        zero, the sums themselves matching), so the catalog's checksum of it is what is
        damaged, and the message names the catalog and the fix. Runs only on a failed block."""
        if not self.verifies_rows:
            return ""
        recs = np.frombuffer(raw, dtype=np.uint8).reshape(-1, self.record_bytes)
        r0 = block * self.block_rows
        ids = np.arange(r0, r0 + recs.shape[0], dtype=np.int64)
        if self.sums_in_records:
            if recs[:, self.row_bytes:self.record_bytes - 8].any():
                return ""
            want = np.ascontiguousarray(recs[:, -8:]).view("<u8")[:, 0]
        else:
            want, short = self._read_sums(ids)
            if short >= 0:  # the row-sum file shrank: the rows cannot speak for themselves
                return ""
        if not np.array_equal(rowsum.row_sums(recs[:, :self.row_bytes], ids, self.row_key), want):
            return ""
        catalog = self.data_dir / "catalog"
        return (f"each of its rows {r0}..{r0 + ids.size - 1} passes its own row checksum: the block's checksum "
                f"in the catalog ({catalog}) is damaged, not the rows; `tierstore verify --data {self.data_dir}` "
                f"lists every such block; restore {catalog} from a backup, or re-ingest or import the table")

    def _pread_runs(self, runs: list, buf: memoryview) -> tuple[int, tuple | None]:
        """pread each (segment, offset, buffer position, bytes) run; returns the bytes
        read and the first short run as (segment, first block, bytes got), if any."""
        total, fds, bb, bps = 0, self._fds, self._block_bytes, self._blocks_per_seg
        for s, off, pos, nbytes in runs:
            fd = fds[s]
            got = 0
            if fd is not None:
                view = buf[pos:pos + nbytes]
                got = os.preadv(fd, [view], off)
                while 0 < got < nbytes:  # short read: the file ends, or a signal
                    n = os.preadv(fd, [view[got:]], off + got)
                    if n == 0:
                        break
                    got += n
                if self.direct is not None and got:  # O_DIRECT mode: leave no page cache behind
                    os.posix_fadvise(fd, off, got, os.POSIX_FADV_DONTNEED)
            total += got
            if got < nbytes:
                return total, (s, s * bps + off // bb, got)
        return total, None

    def _group_blocks(self) -> int:
        return max(1, GROUP_BYTES // self._block_bytes)

    def _read_rows_by_block(self, flat: np.ndarray, out: np.ndarray) -> np.ndarray:
        gather_by_block(flat, self.block_rows, self.row_bytes, self._group_blocks(),
                        lambda blocks, scratch: self._read_blocks(blocks, memoryview(scratch)),
                        lambda sel, rows: out.__setitem__(sel, rows))
        return out

    def read_range(self, start: int, n: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows [start, start + n) as uint8 [n, row_bytes], verified block by block.

        Format 1: whole blocks inside the range are read straight into `out` (no
        copy), so loading a table into a DRAM arena costs one pass over the files.
        Format 2: blocks are read into scratch, checked over their on-disk bytes
        (rows and their sums), then de-interleaved into `out` by one strided copy.
        """
        start, n = int(start), int(n)
        if n < 0 or start < 0 or start + n > self.rows:
            raise InvalidArgument(f"table {self.table!r} has {self.rows} rows; "
                                  f"range [{start}, {start + n}) is out of range")
        out = check_out(out, n, self.row_bytes)
        if n == 0:
            return out
        br, g = self.block_rows, self._group_blocks()
        first, last = start // br, (start + n - 1) // br
        scratch = None
        for a in range(first, last + 1, g):
            blocks = np.arange(a, min(a + g, last + 1), dtype=np.int64)
            r0, r1 = a * br, min((a + len(blocks)) * br, self.rows)
            if self.sums_in_records:
                if scratch is None:
                    scratch = np.empty(g * self._block_bytes, dtype=np.uint8)
                self._read_blocks(blocks, memoryview(scratch))
                c0, c1 = max(r0, start), min(r1, start + n)
                recs = scratch[:(r1 - r0) * self.record_bytes].reshape(-1, self.record_bytes)
                # the blocks' xxh3 covered rows and sums alike: one strided copy of the rows
                out[c0 - start:c1 - start] = recs[c0 - r0:c1 - r0, :self.row_bytes]
                continue
            if r0 >= start and r1 <= start + n:
                self._read_blocks(blocks, memoryview(out[r0 - start:r1 - start]).cast("B"))
                continue
            if scratch is None:
                scratch = np.empty(g * self._block_bytes, dtype=np.uint8)
            self._read_blocks(blocks, memoryview(scratch))
            c0, c1 = max(r0, start), min(r1, start + n)
            out[c0 - start:c1 - start] = scratch.reshape(-1, self.row_bytes)[c0 - r0:c1 - r0]
        return out

    def iter_blocks(self, rows_per_chunk: int | None = None):
        """Yield (first_row, uint8 [k, row_bytes]) over the whole table, verified.
        The yielded array is reused between steps; copy it to keep it."""
        step = rows_per_chunk or self._group_blocks() * self.block_rows
        step = max(self.block_rows, step // self.block_rows * self.block_rows)
        buf = np.empty((step, self.row_bytes), dtype=np.uint8)
        for r in range(0, self.rows, step):
            k = min(step, self.rows - r)
            yield r, self.read_range(r, k, out=buf[:k])

    def disk_blocks(self, group: int):
        """Yield (first block, uint8 [k, block_bytes]) over the whole table: `group`
        blocks at a time as they lie on disk (records, in either format), each checked
        against its block checksum; the last block's tail past the table is
        undefined. The array is reused between steps (remote publish: objects are
        on-disk blocks)."""
        buf = np.empty(max(1, group) * self._block_bytes, dtype=np.uint8)
        for a in range(0, self.version.n_blocks, max(1, group)):
            blocks = np.arange(a, min(a + max(1, group), self.version.n_blocks), dtype=np.int64)
            self._read_blocks(blocks, memoryview(buf))
            yield a, buf[:blocks.size * self._block_bytes].reshape(blocks.size, self._block_bytes)

    def verify(self) -> list[int]:
        """Re-check every block, and every row against its row checksum when the
        version has them (inline in its record, format 2; the row-sum file, format 1);
        return the numbers of bad (corrupt, truncated, missing, or holding a row that
        fails its row checksum) blocks, empty when intact."""
        bad: list[int] = []
        g = self._group_blocks()
        buf = np.empty(g * self._block_bytes, dtype=np.uint8)
        scratch = memoryview(buf)
        n_blocks, br = self.version.n_blocks, self.block_rows
        a = 0
        while a < n_blocks:
            blocks = np.arange(a, min(a + g, n_blocks), dtype=np.int64)
            try:
                self._read_blocks(blocks, scratch)
                a = int(blocks[-1]) + 1
            except ChecksumError as e:
                bad.append(e.block)
                a = e.block + 1
                continue
            if self.verifies_rows:
                r0, r1 = int(blocks[0]) * br, min(a * br, self.rows)
                ids = np.arange(r0, r1, dtype=np.int64)
                recs = buf[:(r1 - r0) * self.record_bytes].reshape(-1, self.record_bytes)
                if self.sums_in_records:
                    want, short = recs.view("<u8")[:, -1], -1
                else:
                    want, short = self._read_sums(ids)
                wrong = rowsum.row_sums(recs[:, :self.row_bytes], ids, self.row_key) != want
                if short >= 0:  # the row-sum file ends before these rows' sums
                    wrong[short:] = True
                bad += np.unique(ids[wrong] // br).tolist()
        return bad
