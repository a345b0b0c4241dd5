"""The cold tier: rows read straight from a version's segment files.

Addresses are computed (row i's record sits at a fixed offset). A record is
the row followed by its per-row checksum (segment format 2, the default:
tierstore.store.version.TableVersion), or the row alone with the checksums in
a separate row-sum file (format 1, older versions). Two read paths:

- Rows (`read_into`, and `read_rows` on top of it), for versions that carry a
  per-row checksum (tierstore.tiers.nvme.rowsum, written at ingest): each miss reads
  only its record, verified in one compiled pass against the sum the record
  carries (format 2: nothing per row is held in memory) or the mapped row-sum
  file (format 1), and written straight into the caller's arena slots.
  Page-cache mode gathers from a read-only memory map of each segment; big
  calls go to a thread pool so cold reads are in flight together. O_DIRECT mode
  (`direct_io=True`) reads the aligned sectors of each row (direct_io.py), so the
  cold tier is not cached twice: a call's rows through the calling thread's one
  io_uring, in parts of RING_BYTES of spans (`start_into` submits them and returns,
  so a caller keeps several calls' reads in flight at once), or the pool's preads
  where there is no io_uring.
- Blocks (`read_range`, `iter_blocks`, `disk_blocks`, `verify`, and rows of versions
  written before row checksums existed): one pread per run of neighbouring
  blocks, each checked against its xxh3-64 in the catalog over the on-disk
  bytes (a record's row and sum alike); format 2 records are then
  de-interleaved into rows by one strided copy.

A row or block that does not match raises ChecksumError, never returned; a
missing, truncated or non-regular segment reads as corrupt, naming it.

In page-cache mode, rows on "seen" pages are gathered through the map, on the
guess that the page cache holds them: at first every page (a table the host has room for is cached
once read), then the pages this reader pread. Under memory pressure (a table
larger than the host, a cgroup) the kernel evicts them and a gather takes major
faults, one at a time, inline. A gather whose thread took major faults on more
than EVICTED_FRACTION of its rows says so (the thread's own fault count, from
getrusage: a gather that is merely slow because the CPU is busy elsewhere says
nothing): the segment's seen flags are dropped and its rows are pread (many in
flight) until their pages are seen again. A call's first PROBE_ROWS rows go
first, to find out. Where the thread's count is not to be had (not Linux), a
gather slower than EVICTED_S_PER_ROW a row counts instead.
"""
from __future__ import annotations

import contextlib
import logging
import mmap
import os
import resource
import stat
import threading
import time
from pathlib import Path

import numpy as np
import xxhash

from tierstore import cpu_token
from tierstore.store.catalog import BlockChecksums, TableVersion
from tierstore.errors import ChecksumError, InvalidArgument
from tierstore.tiers.nvme import rowsum
from tierstore.tiers.base import ColdTier, check_ids, check_out, gather_by_block
from tierstore.tiers.nvme.verified_copy import kernels, place_records, place_verified
from tierstore.tiers.nvme.direct_io import _Scratch, pread_rows, row_buffer, thread_buffer, thread_ring

log = logging.getLogger(__name__)

__all__ = ["SegmentReader", "default_block_rows", "read_pool", "BLOCK_TARGET_BYTES"]

# Row reads: a call's misses are cut into chunks of about CHUNK_BYTES, dealt to
# at most ROW_TASKS pool tasks (one hand-off each: a cold step has that many page
# faults in flight); O_DIRECT waits on the device for every row, so more tasks.
CHUNK_BYTES = 256 << 10
ROW_TASKS, ROWS_PER_TASK = 16, 512
# compiled (tiers/nvme/verified_copy.py), a row costs a small fraction of a pool hand-off: only a task
# this big pays for one
COMPILED_ROWS_PER_TASK = 16384
DIRECT_TASKS, DIRECT_ROWS_PER_TASK, DIRECT_CHUNK_ROWS = 32, 64, 128
# O_DIRECT through io_uring: the aligned spans of one part of a call, read into a scratch of its
# own (8,192 rows of 264 B on 512-B sectors, 1,024 on 4 KiB ones); a bigger call is several parts,
# all in flight on the thread's ring at once
RING_BYTES = 8 << 20


def _open_segment(path: Path) -> tuple[int | None, str | None]:
    """(fd, None) for a regular file, else (None, why). O_NONBLOCK: opening a
    FIFO put where a segment was must not wait for a writer."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, "missing"
    mode = os.fstat(fd).st_mode
    if stat.S_ISREG(mode):
        return fd, None
    os.close(fd)
    kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "not a file"
    return None, f"not a regular file ({kind}); restore it or re-ingest the table"


def _map_sums(fd: int, rows: int) -> np.ndarray | None:
    """The first `rows` u64 of the row-sum file at fd, mapped read-only; None when the file is shorter."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size < rows * 8:
        return None
    if rows == 0:
        return np.zeros(0, np.uint64)
    m = mmap.mmap(fd, rows * 8, mmap.MAP_SHARED, mmap.PROT_READ)
    return np.frombuffer(m, "<u8", rows).view(np.uint64)



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


# ---- page-cache mode ----
PAGE_SHIFT = 12
EVICTED_FRACTION = 0.1     # a gather that major-faulted on more of its rows than this
# without fault counts: a gather this slow a row waited on the device (major faults), not on a cached
# page's first touch, which costs orders of magnitude less
EVICTED_S_PER_ROW = 10e-6
PROBE_ROWS = 32
_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)


def _faults() -> int | None:
    """Major faults this thread has taken so far (None where the OS does not say)."""
    return resource.getrusage(_RUSAGE_THREAD).ru_majflt if _RUSAGE_THREAD is not None else None


class _Gather:
    """Times a gather and counts its major faults: `with _Gather(seen, rows): ...`."""

    __slots__ = ("seen", "rows", "t0", "f0")

    def __init__(self, seen: np.ndarray, rows: int):
        self.seen, self.rows = seen, rows

    def __enter__(self):
        self.f0, self.t0 = _faults(), time.perf_counter()

    def __exit__(self, *exc):
        if self.rows < PROBE_ROWS:
            return
        if self.f0 is not None:
            evicted = _faults() - self.f0 > self.rows * EVICTED_FRACTION
        else:
            evicted = time.perf_counter() - self.t0 > self.rows * EVICTED_S_PER_ROW
        if evicted:
            self.seen[:] = False  # racy between threads, harmless: a page pread once more


_PREAD_SCRATCH = _Scratch()


class Reading:
    """A SegmentReader.start_into call: rows read (`results`) or in flight on this thread's
    ring (`parts`: (a, b, segments) with their RowReads). finish() once, in the thread that
    started it: the parts waited for in order, verified and placed; records made where
    they were not read; the bytes counted; ChecksumError for the first bad row. Where
    finishing fails part-way, the parts not finished are still waited for (their reads
    write buffers until they end) before the error passes."""

    def __init__(self, reader: "SegmentReader", ids, dest, slots, records, results: list, parts=()):
        self.reader, self.ids, self.dest, self.slots, self.records = reader, ids, dest, slots, records
        self.results, self.parts = results, list(parts)

    def finish(self) -> None:
        r, ids, dest, slots, records = self.reader, self.ids, self.dest, self.slots, self.records
        read = records if r._records_read else None
        parts, self.parts = self.parts, []
        try:
            for k, ((a, b, seg), pending) in enumerate(parts):
                tmp = row_buffer(b - a, r.record_bytes)
                nbytes, short = pending.finish(tmp)
                self.results.append(r._place_read(tmp, nbytes, short, a, b, seg, ids, dest, slots, read))
        finally:
            for _, pending in parts:
                pending.abandon()  # finished ones: nothing left
        if records is not None and ids.size and not r._records_read:
            records[slots] = r.carried_records(ids, dest[slots])
        r._report(ids, self.results)

    def abandon(self) -> None:
        """Nothing placed: the reads still in flight waited for (their buffers given back)."""
        parts, self.parts = self.parts, []
        for _, pending in parts:
            pending.abandon()


class SegmentReader(ColdTier):
    """Verified reads of one table version from its segment files.

    data_dir: the data directory the manifest's segment paths are relative to.
    version: the manifest (Catalog.get / Catalog.current).
    checksums: uint64 [n_blocks] from Catalog.checksums, or a BlockChecksums (closed with the reader).
    direct_io: read rows with O_DIRECT (no page cache); InvalidArgument when
        the filesystem refuses it (tmpfs). Block reads stay buffered and drop
        what they read from the page cache.

    Thread-safe: reads use pread or a read-only map, never a shared file
    offset. A missing, truncated or non-regular segment file reads as corrupt
    (ChecksumError). `bytes_read` counts bytes read from the files (rows in
    page-cache mode, sectors with O_DIRECT, whole blocks on the block path).
    `verifies_rows`: each row read is checked against its own checksum (a
    format 2 version, whose records carry it; or a format 1 version with a
    usable row-sum file), else rows verify by their block.
    `row_sums` (format 1 only) is the per-row checksum array (8 B per row) or
    None (format 2, or a version written without one); `row_sums_error` says
    why a format 1 version's row sums were not usable.
    map_row_sums (format 1): map the row-sum file read-only (default) rather
        than copy it: the sidecar and its clients on the host share one page-cache
        copy, not 8 B a row in each process; checked once at open like a copy,
        and a file shrunk since then reads as corrupt, not SIGBUS.
    """

    def __init__(self, data_dir, version: TableVersion, checksums: np.ndarray, *, direct_io: bool = False,
                 map_row_sums: bool = True):
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
        self._maps: list = [None] * len(version.segments)
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.direct = None
        self._sums_fd = None  # the mapped row-sum file (map_row_sums), checked for shrinking per read
        self._map_sums = map_row_sums
        for rel in version.segments:
            fd, why = _open_segment(self.data_dir / rel)
            self._fds.append(fd)
            self._why.append(why)
        self.row_sums, self.row_sums_error = self._load_row_sums()
        self.verifies_rows = self.sums_in_records or self.row_sums is not None
        if direct_io:
            from tierstore.tiers.nvme.direct_io import DirectFiles

            paths = [self.data_dir / rel if fd is not None else None for rel, fd in zip(version.segments, self._fds)]
            try:
                self.direct = DirectFiles(paths, self.record_bytes)
            except BaseException:
                self.close()
                raise

    def _load_row_sums(self) -> tuple[np.ndarray | None, str | None]:
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
        else:
            try:
                if self._map_sums:
                    raw = _map_sums(fd, self.rows)
                    ok = raw is not None
                else:
                    raw = np.empty(self.rows, dtype="<u8")
                    ok = os.preadv(fd, [memoryview(raw).cast("B")], 0) == raw.nbytes
                ok = ok and xxhash.xxh3_64_intdigest(raw) == int(meta["xxh3"])
                err = None if ok else f"{where}: row checksum file {path} is corrupt or truncated"
                if ok and self._map_sums:
                    self._sums_fd, fd = fd, None
            finally:
                if fd is not None:
                    os.close(fd)
        if err:
            log.warning("%s; rows are verified by their 4 KiB blocks instead (slower); re-ingest to restore", err)
            return None, err
        return raw.view(np.uint64), None

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

    def read_into(self, ids: np.ndarray, dest: np.ndarray, slots: np.ndarray, cached: bool = False,
                  records: np.ndarray | None = None) -> None:
        """Write row ids[i] into dest[slots[i]], each row verified; the engine's miss path.

        ids: int64, sorted, unique and in range (not re-checked: the engine
            validated them at the edge).
        dest: writable uint8 [capacity, row_bytes] (the arena view); rows are
            written in place, no bounce copy in page-cache mode.
        slots: integer [len(ids)], distinct rows of dest.
        cached: the caller knows the rows' pages are in the page cache (a local
            client has just read them): page-cache mode gathers them through the
            map at once, no probe, no pool hand-off (ignored with O_DIRECT).
        records: optional writable uint8 [capacity, W] (W the width carried_records gives:
            record_bytes in format 2): records[slots[i]] = row ids[i]'s record as a client
            carries it (carried_records). Under O_DIRECT
            with sums in the records (carried_form "records") the verified records as read,
            so no sum is computed again; elsewhere made from the rows.
        Thread-safe: call concurrently on one reader, no lock needed.
        Raises ChecksumError (DATA_LOSS: table, version, block and row) when any
        row fails verification or its segment is missing/truncated/not a file;
        dest rows of that call may then hold anything (free those slots).
        OSError passes through. start_into(...).finish(), at once.
        """
        self.start_into(ids, dest, slots, cached, records).finish()

    def start_into(self, ids: np.ndarray, dest: np.ndarray, slots: np.ndarray, cached: bool = False,
                   records: np.ndarray | None = None) -> "Reading":
        """read_into in two halves. Under O_DIRECT through io_uring, the rows' reads are
        submitted to this thread's ring and this returns while the device reads them;
        Reading.finish(), in this thread, waits, verifies and places them and raises what
        read_into raises. So a caller puts several calls' reads in flight (a step's tables)
        and works on one while the device reads the next, the queue never draining between
        them. Elsewhere (page cache, preads) the rows are read here and finish() reports.
        Raises ChecksumError for a segment that is not there, before any read."""
        n = int(ids.size)
        if n == 0:
            return Reading(self, ids, dest, slots, records, [])
        if not self.verifies_rows:  # a version written before row checksums: verify whole blocks
            dest[slots] = self._read_rows_by_block(ids, np.empty((n, self.row_bytes), dtype=np.uint8))
            return Reading(self, ids, dest, slots, None, [])  # nothing carried: no row sums
        self._check_sums(ids)
        sr = self.version.segment_rows
        first = int(ids[0]) // sr
        if cached and self.direct is None:
            results = self._fill_cached(ids, dest, slots)
        elif self.direct is None and n <= 2 * PROBE_ROWS and int(ids[-1]) // sr == first:
            results = [self._fill_small(first, ids, dest, slots)]  # a decode step's few misses
        elif self.direct is not None and thread_ring() is not None:
            # io_uring: a call's rows over all its segments through this thread's one ring, in parts
            # of RING_BYTES of spans, all submitted now: the ring stays at its depth to the last
            # read, one drain a call (or a step, for a caller that starts its tables first)
            for s in np.unique(ids // sr).tolist():
                self._source(s, None, ids[np.searchsorted(ids, s * sr)])  # a segment not there: raised now
            per = self.direct.rows_per(RING_BYTES)
            parts = []
            try:
                for a in range(0, n, per):
                    b = min(a + per, n)
                    seg = ids[a:b] // sr
                    parts.append(((a, b, seg), self.direct.start_rows(seg, ids[a:b] - seg * sr)))
            except BaseException:
                for _, p in parts:
                    p.abandon()
                raise
            return Reading(self, ids, dest, slots, records, [], parts)
        else:
            results = self._fill_many(ids, dest, slots, records if self._records_read else None)
        return Reading(self, ids, dest, slots, records, results)

    def _report(self, ids: np.ndarray, results: list) -> None:
        """Count the bytes a call read; ChecksumError for its first bad row."""
        with self._lock:
            self.bytes_read += sum(r[0] for r in results)
        bad = [r[1:] for r in results if r[1] >= 0]
        if bad:
            i, why = min(bad)
            row = int(ids[i])
            err = ChecksumError(self.table, self.version.number, row // self.block_rows,
                                f"row {row}" + (f": {why}" if why else ""))
            err.row = row
            raise err

    def _place_read(self, tmp: np.ndarray, nbytes: int, short: int, a: int, b: int, seg, ids, dest, slots,
                    records) -> tuple[int, int, str]:
        """Rows ids[a:b] as read into tmp (O_DIRECT: `short` the first the file did not hold, or -1)
        verified and placed into dest[slots[a:b]], their records as read into records[slots]."""
        if short >= 0:
            s = int(seg[short]) if np.ndim(seg) else seg
            return nbytes, a + short, f"segment {self.version.segments[s]} is truncated"
        bad = self._place(tmp, np.arange(b - a), ids[a:b], dest, slots[a:b])
        if bad < 0 and records is not None:
            records[slots[a:b]] = tmp[:b - a]  # verified by _place: each its row and the sum keyed by its id
        return nbytes, (a + bad if bad >= 0 else -1), ""

    def held_arrays(self) -> tuple[np.ndarray, ...]:
        return (self.checksums,) if self.row_sums is None else (self.checksums, self.row_sums)

    @property
    def cold_dir(self) -> Path | None:
        """This reader's data directory when its rows verify one by one (a client on the host
        then reads its misses from the same segment files), else None."""
        return self.data_dir if self.verifies_rows else None

    @property
    def carried_form(self) -> str:
        """How a client on the host hands the sidecar the misses it read and verified, so the
        sidecar promotes them without reading them again: "rows", checked against sums
        the sidecar holds (format 1) or finds in the page cache the client's read has
        just filled (format 2 without O_DIRECT: place_rows); "records", each row with its
        row sum, for format 2 under O_DIRECT, where the sum on disk would cost a read of
        its own (place_records; the sidecar takes records only from a peer with its own
        uid, who can write the segments anyway: served.note), and only where the sums
        are keyed by the version's salt (fmix64-v2), so a record of another table or
        version fails; "" for a version without row sums, or a format 2 version under
        O_DIRECT written before row_salt (its misses are read from disk: nothing the
        sidecar did not verify for this place is ever placed)."""
        if not self.verifies_rows:
            return ""
        if not (self.sums_in_records and self.direct is not None):
            return "rows"
        return "records" if self.row_key.binds_version else ""

    @property
    def _records_read(self) -> bool:
        """read_into's records are the records as read (no sum made again): carried_form "records"."""
        return self.carried_form == "records"

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
        the sidecar promotes the rows a client on the host read without reading them again.

        ids: int64, in range (the engine checked them); src: uint8 [*, row_bytes];
        row_at, slots: int64 [len(ids)]. Returns the index of the first row that does
        not match its row sum, or -1 when all do; after a mismatch the rows of this
        call in dest may hold anything (the caller reads them from disk instead).
        Every row mismatches for a version without row sums: nothing unverified is
        ever placed. Format 2: the sums are read from the records' last words through
        the segment maps (pages the client's read has just brought into the page
        cache), never taken from the client; with O_DIRECT they are not cached, and the
        client carries whole records instead (carried_form, place_records). ChecksumError
        when a segment or the row-sum file shrank since it was opened."""
        if ids.size == 0:
            return -1
        if not self.verifies_rows or src.ndim != 2 or src.shape[1] != self.row_bytes:
            return 0
        if self.sums_in_records:
            order = np.argsort(ids, kind="stable")
            sums = np.empty(ids.size, dtype=np.uint64)
            sums[order] = self._stored_sums(ids[order])
            return place_verified(src, row_at, ids, dest, slots, sums, self.row_key, np.arange(ids.size))
        self._check_sums(ids)
        return place_verified(src, row_at, ids, dest, slots, self.row_sums, self.row_key)

    def _stored_sums(self, ids: np.ndarray) -> np.ndarray:
        """Format 2: the row sums the records of sorted `ids` carry, gathered from the
        segment maps (ChecksumError for a segment missing or shrunk)."""
        sr, out = self.version.segment_rows, np.empty(ids.size, dtype=np.uint64)
        segs = np.arange(int(ids[0]) // sr, int(ids[-1]) // sr + 1)
        cut = np.append(np.searchsorted(ids, segs * sr), ids.size)
        for s, lo, hi in zip(segs.tolist(), cut[:-1].tolist(), cut[1:].tolist()):
            if lo < hi:
                offsets = ids[lo:hi] - s * sr
                view, _ = self._mapped(s, offsets, ids[lo])
                out[lo:hi] = view.view("<u8")[offsets, -1]
        return out

    def _place(self, src: np.ndarray, offsets: np.ndarray, ids: np.ndarray, dest: np.ndarray,
               slots: np.ndarray) -> int:
        """Place records src[offsets] (as read from a segment) into dest[slots], each row
        verified: against the sum its record carries (format 2) or the row-sum file's."""
        if self.sums_in_records:
            return place_records(src, offsets, ids, dest, slots, self.row_key)
        return place_verified(src, offsets, ids, dest, slots, self.row_sums, self.row_key)

    def _check_sums(self, ids: np.ndarray) -> None:
        """ChecksumError (naming ids[0]) when the mapped row-sum file shrank: touching the
        map past the file's end would be SIGBUS."""
        if self._sums_fd is not None and os.fstat(self._sums_fd).st_size < self.rows * 8:
            row = int(ids[0])
            err = ChecksumError(self.table, self.version.number, row // self.block_rows,
                                f"row {row}: the row checksum file shrank after it was opened")
            err.row = row
            raise err

    def _fill_small(self, s: int, ids, dest, slots) -> tuple[int, int, str]:
        """A few rows of one segment: inline, no chunking or pool hand-off."""
        offsets = ids - s * self.version.segment_rows
        src = self._source(s, offsets, ids[0])
        cold = not src[1][offsets * self.record_bytes >> PAGE_SHIFT].all()
        with cpu_token.waiting() if cold else contextlib.nullcontext():
            return self._fill_buffered(s, src, offsets, ids, dest, slots, 0, ids.size)

    def _fill_cached(self, ids, dest, slots) -> list[tuple[int, int, str]]:
        """Rows on cached pages, gathered through each segment's map in one compiled pass."""
        sr, out = self.version.segment_rows, []
        segs = np.arange(int(ids[0]) // sr, int(ids[-1]) // sr + 1)
        cut = np.append(np.searchsorted(ids, segs * sr), ids.size)
        for s, lo, hi in zip(segs.tolist(), cut[:-1].tolist(), cut[1:].tolist()):
            if lo < hi:
                offsets = ids[lo:hi] - s * sr
                view, seen = self._source(s, offsets, ids[lo])
                bad = self._place(view, offsets, ids[lo:hi], dest, slots[lo:hi])
                seen[offsets * self.record_bytes >> PAGE_SHIFT] = True
                out.append((offsets.size * self.record_bytes, lo + bad if bad >= 0 else -1, ""))
        return out

    def _fill_many(self, ids, dest, slots, records=None) -> list[tuple[int, int, str]]:
        """Rows over segments and chunks, read by the pool when there are many."""
        n, sr = int(ids.size), self.version.segment_rows
        segs = np.arange(int(ids[0]) // sr, int(ids[-1]) // sr + 1)
        cut = np.searchsorted(ids, segs * sr)
        cut = np.append(cut, n)
        groups = [(s, self._source(s, ids[lo:hi] - s * sr, ids[lo]), lo, hi)
                  for s, lo, hi in zip(segs.tolist(), cut[:-1].tolist(), cut[1:].tolist()) if lo < hi]
        results, cold = [], n if self.direct is not None else 0
        if self.direct is None:
            s, src, lo, hi = groups[0]
            if hi - lo > 2 * PROBE_ROWS and src[1][(ids[lo:lo + PROBE_ROWS] - s * sr) * self.record_bytes
                                                   >> PAGE_SHIFT].all():
                # pages taken to be cached: a few rows first, timed, before the rest goes inline
                results.append(self._fill((s, src, lo, lo + PROBE_ROWS), ids, dest, slots))
                groups[0] = (s, src, lo + PROBE_ROWS, hi)
            for s, src, lo, hi in groups:
                pages = (ids[lo:hi] - s * sr) * self.record_bytes >> PAGE_SHIFT
                cold += int(pages.size - np.count_nonzero(src[1][pages]))
        # mostly reads that wait on the device (O_DIRECT without io_uring: a pread at a time
        # a thread): small chunks over many tasks (queue depth); mostly gathers from cached
        # pages: big chunks over few tasks (few hand-offs)
        deep = cold * 4 > n
        chunk = DIRECT_CHUNK_ROWS if deep else max(1, CHUNK_BYTES // self.record_bytes)
        chunks = [(s, src, a, min(a + chunk, hi)) for s, src, lo, hi in groups for a in range(lo, hi, chunk)]
        per, most = (DIRECT_ROWS_PER_TASK, DIRECT_TASKS) if deep else \
            (COMPILED_ROWS_PER_TASK if kernels() else ROWS_PER_TASK, ROW_TASKS)
        k = max(1, min(most, len(chunks), n // per))
        run = lambda part: [self._fill(c, ids, dest, slots, records) for c in part]
        # reads of the device: other plans compute meanwhile; gathers from cached pages: compute
        with cpu_token.waiting() if cold else contextlib.nullcontext():
            if k > 1:
                results += [r for rs in read_pool().map(run, [chunks[i::k] for i in range(k)]) for r in rs]
            else:
                results += run(chunks)
        return results

    def _source(self, s: int, offsets: np.ndarray, first_id) -> object:
        """Where rows of segment s come from: its row view (page-cache mode) or
        its index (O_DIRECT); ChecksumError for a segment that is not there."""
        if self._fds[s] is None:
            row = int(first_id)
            err = ChecksumError(self.table, self.version.number, row // self.block_rows,
                                f"row {row}: segment {self.version.segments[s]} is {self._why[s]}")
            err.row = row
            raise err
        if self.direct is not None:
            return s
        return self._mapped(s, offsets, first_id)

    def _mapped(self, s: int, offsets: np.ndarray, first_id) -> tuple[np.ndarray, np.ndarray]:
        """Segment s's map (see _map), ChecksumError when it no longer holds rows `offsets`."""
        if self._fds[s] is None:
            return self._source(s, offsets, first_id)  # raises
        view = self._map(s)
        size = os.fstat(self._fds[s]).st_size  # shrunk since mapped? touching those pages would SIGBUS
        limit = min(view[0].shape[0], size // self.record_bytes)
        if int(offsets[-1]) >= limit:
            row = int(first_id) + int(offsets[np.argmax(offsets >= limit)] - offsets[0])
            err = ChecksumError(self.table, self.version.number, row // self.block_rows,
                                f"row {row}: segment {self.version.segments[s]} is truncated")
            err.row = row
            raise err
        return view

    def _fill(self, task, ids, dest, slots, records=None) -> tuple[int, int, str]:
        """Read, verify and place ids[a:b] (all in segment s), their records as read into
        records[slots] when given (O_DIRECT); returns (bytes read, index of the first bad
        row or -1, why)."""
        s, src, a, b = task
        sr = self.version.segment_rows
        if self.direct is None:
            return self._fill_buffered(s, src, ids[a:b] - s * sr, ids, dest, slots, a, b)
        tmp = row_buffer(b - a, self.record_bytes)
        nbytes, short = self.direct.read_rows(s, ids[a:b] - s * sr, tmp)
        return self._place_read(tmp, nbytes, short, a, b, s, ids, dest, slots, records)

    def close(self) -> None:
        fds, self._fds = self._fds, []
        self._maps = [None] * len(self._maps)  # a map goes with its last view
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

    # ---- page-cache mode of the row path (read_into through the segment maps) ----

    def _map(self, s: int) -> tuple[np.ndarray, np.ndarray]:
        """Segment s as a read-only uint8 [records held, record_bytes] view, mapped once,
        and its pages' seen flags."""
        view = self._maps[s]
        if view is None:
            with self._lock:
                view = self._maps[s]
                if view is None:
                    size = os.fstat(self._fds[s]).st_size
                    rb = self.record_bytes
                    held = size // rb
                    if held == 0:
                        rows = np.empty((0, rb), dtype=np.uint8)
                    else:
                        mm = mmap.mmap(self._fds[s], held * rb, prot=mmap.PROT_READ)
                        mm.madvise(mmap.MADV_RANDOM)  # scattered rows: fault one page, no read-around
                        rows = np.frombuffer(mm, dtype=np.uint8).reshape(held, rb)
                    # one flag per page: is it likely cached (see _Gather)?
                    view = self._maps[s] = (rows, np.ones((size >> PAGE_SHIFT) + 1, dtype=bool))
        return view

    def _fill_buffered(self, s: int, src, offsets: np.ndarray, ids, dest, slots, a: int, b: int) -> tuple[int, int, str]:
        """Page-cache mode: rows on pages this reader has read before come from its
        map (a gather: no syscall once mapped); rows on pages it has not are
        pread (a page fault on a cold page would wait for the device one at a
        time per thread, and a first touch of a cached page is a fault too),
        after which their pages count as seen. Every row is placed and verified
        in one pass (tiers/nvme/verified_copy.py)."""
        view, seen = src
        rb = self.record_bytes
        pages = offsets * rb >> PAGE_SHIFT
        warm = seen[pages]
        if warm.all():
            with _Gather(seen, offsets.size):
                bad = self._place(view, offsets, ids[a:b], dest, slots[a:b])
            return offsets.size * rb, (a + bad if bad >= 0 else -1), ""
        cold = np.flatnonzero(~warm)
        got = row_buffer(cold.size, rb)
        nbytes, short = pread_rows(self._fds[s], offsets[cold], rb, 1, got, self._pread_buffer)
        if short >= 0:
            return nbytes, a + int(cold[short]), f"segment {self.version.segments[s]} is truncated"
        bad = self._place(got, np.arange(cold.size), ids[a:b][cold], dest, slots[a:b][cold])
        if bad >= 0:
            return nbytes, a + int(cold[bad]), ""
        seen[pages[cold]] = True  # racy between threads, harmless: a page read twice
        if cold.size < offsets.size:
            hot = np.flatnonzero(warm)
            with _Gather(seen, hot.size):
                bad = self._place(view, offsets[hot], ids[a:b][hot], dest, slots[a:b][hot])
            nbytes += hot.size * rb
            if bad >= 0:
                return nbytes, a + int(hot[bad]), ""
        return nbytes, -1, ""

    def _pread_buffer(self, nbytes: int) -> np.ndarray:
        return thread_buffer(_PREAD_SCRATCH, nbytes)

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
            try:
                self._check_sums(ids)
            except ChecksumError:  # the row-sum file shrank: the rows cannot speak for themselves
                return ""
            want = self.row_sums[r0:r0 + ids.size]
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
                want = recs.view("<u8")[:, -1] if self.sums_in_records else self.row_sums[r0:r1]
                wrong = rowsum.row_sums(recs[:, :self.row_bytes], ids, self.row_key) != want
                bad += np.unique(ids[wrong] // br).tolist()
        return bad
