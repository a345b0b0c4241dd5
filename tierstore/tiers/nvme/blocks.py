"""The block path: whole checksummed blocks of a version's segment files, each checked against
its xxh3-64 in the catalog over the on-disk bytes (a record's row and sum alike).

Loading a table into a full-resident arena (`read_range`, `iter_blocks`), publishing it to
the remote tier (`disk_blocks`), scrubbing it (`verify`: every block, and every row
against its own sum) and reading the rows of versions without row sums all read here:
one pread per run of neighbouring blocks, runs spread over a small pool when there are
many (the device needs a queue). Format 2 records are then cut to their rows by one
strided copy; format 1 blocks inside a range are read straight into the caller's rows.
A block that does not match is a ChecksumError, which says when the catalog, not the
rows, is the damaged part (each row passing its own sum).
"""
from __future__ import annotations

import os
import threading

import numpy as np
import xxhash

from tierstore.errors import ChecksumError, InvalidArgument
from tierstore.store.catalog import BlockChecksums
from tierstore.tiers.base import ShortRead, check_out, gather_by_block
from tierstore.tiers.nvme.record_format import RecordFormat
from tierstore.tiers.nvme.segment_files import SegmentFiles

__all__ = ["Blocks", "default_block_rows", "read_pool", "BLOCK_TARGET_BYTES"]

# A block is the unit of checksumming and of reading: verifying a row means
# reading its whole block, so the block size is the read amplification of a
# cache miss. About 4 KiB, one NVMe page: a random 4 KiB read is the cheapest
# the device does, so a bigger block only multiplies the bytes a miss reads
# (docs/decisions.md, "The checksum block"). The price is the checksum list:
# 8 B a block, 1/512 of the table.
BLOCK_TARGET_BYTES = 4 * 1024
# Bound the scratch memory of one call: blocks are read and verified in groups.
GROUP_BYTES = 8 << 20
# Reads of many scattered blocks go out from a small thread pool: NVMe needs a queue depth to
# reach its IOPS, and preadv releases the GIL.
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


class Blocks:
    """The block reads of one version: its `files`, its record format `fmt`, and `checksums`
    (uint64 [n_blocks], or a BlockChecksums read per call). `bytes_read` counts the bytes
    read. Thread-safe: every read is a pread at its offset. Under O_DIRECT (files.direct)
    the blocks are still read through the page cache, and what they read is dropped from it."""

    def __init__(self, files: SegmentFiles, fmt: RecordFormat, checksums):
        self.files, self.fmt, self.checksums = files, fmt, checksums
        v = self.version = files.version
        self.rows, self.row_bytes, self.record_bytes, self.block_rows = v.rows, v.row_bytes, v.record_bytes, v.block_rows
        self.block_bytes = self.block_rows * self.record_bytes
        self._per_seg = v.segment_rows // self.block_rows
        self._lock = threading.Lock()
        self.bytes_read = 0

    def group(self) -> int:
        """Blocks read and verified at a time (GROUP_BYTES of them)."""
        return max(1, GROUP_BYTES // self.block_bytes)

    def _len(self, blocks: np.ndarray) -> np.ndarray:
        """Bytes in each block on disk (only the table's last block may be short)."""
        end = np.minimum((blocks + 1) * self.block_rows, self.rows)
        return (end - blocks * self.block_rows) * self.record_bytes

    def read(self, blocks: np.ndarray, buf: memoryview) -> None:
        """Read sorted unique `blocks` into `buf` (block j at j * block_bytes) and verify each;
        adjacent blocks in one segment are read with one pread. ShortRead for a block whose
        file is missing or short, ChecksumError for one that fails its catalog checksum
        (saying when the catalog is the damaged part: _blame)."""
        seg = blocks // self._per_seg
        brk = np.flatnonzero((np.diff(blocks) != 1) | (np.diff(seg) != 0)) + 1
        starts = np.concatenate([[0], brk])
        lens = self._len(blocks)
        # per-run arithmetic in numpy, so the loop below is one syscall per run and nothing else
        run_bytes = np.add.reduceat(lens, starts)
        run_buf = starts * self.block_bytes
        run_seg = seg[starts]
        run_off = (blocks[starts] - run_seg * self._per_seg) * self.block_bytes
        runs = list(zip(run_seg.tolist(), run_off.tolist(), run_buf.tolist(), run_bytes.tolist()))
        if len(runs) >= 2 * PARALLEL_MIN_RUNS:
            # random misses are one pread each: issue them from several threads (preadv drops
            # the GIL), so the device sees a queue of requests instead of one at a time
            k = min(READ_THREADS, len(runs) // PARALLEL_MIN_RUNS)
            results = list(read_pool().map(lambda part: self._pread_runs(part, buf), [runs[i::k] for i in range(k)]))
        else:
            results = [self._pread_runs(runs, buf)]
        failed = [f for _, f in results if f is not None]
        with self._lock:
            self.bytes_read += sum(t for t, _ in results)
        v = self.version
        if failed:
            s, first_block, got = min(failed, key=lambda f: f[1])
            raise ShortRead(v.table, v.number, first_block + got // self.block_bytes,
                            f"segment {v.segments[s]} is {self.files.why[s] or 'truncated'}")
        expect = self.checksums[blocks].tolist()
        h, bb = xxhash.xxh3_64_intdigest, self.block_bytes
        for j, (e, n) in enumerate(zip(expect, lens.tolist())):
            if h(buf[j * bb:j * bb + n]) != e:
                raise ChecksumError(v.table, v.number, int(blocks[j]), self._blame(int(blocks[j]), buf[j * bb:j * bb + n]))

    def _blame(self, block: int, raw: memoryview) -> str:
        """Why `block` (its bytes as read, `raw`) failed its catalog checksum, for the error:
        "" when one of its rows fails its own row checksum too (or a format 2 record's zero
        padding is not zero), or the version has none: the block is corrupt. Else every byte
        of the block is as written, so the catalog's checksum of it is what is damaged, and
        the message names the catalog and the fix. Runs only on a failed block."""
        if not self.fmt.verifies_rows:
            return ""
        recs = np.frombuffer(raw, dtype=np.uint8).reshape(-1, self.record_bytes)
        r0 = block * self.block_rows
        if self.fmt.rows_wrong(recs, np.arange(r0, r0 + recs.shape[0], dtype=np.int64)).any():
            return ""
        d = self.files.data_dir
        catalog = d / "catalog"
        return (f"each of its rows {r0}..{r0 + recs.shape[0] - 1} passes its own row checksum: the block's checksum "
                f"in the catalog ({catalog}) is damaged, not the rows; `tierstore verify --data {d}` lists every "
                f"such block; restore {catalog} from a backup, or re-ingest or import the table")

    def _pread_runs(self, runs: list, buf: memoryview) -> tuple[int, tuple | None]:
        """pread each (segment, offset, buffer position, bytes) run; returns the bytes read and
        the first short run as (segment, first block, bytes got), if any."""
        total, fds, bb, bps = 0, self.files.fds, self.block_bytes, self._per_seg
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
                if self.files.direct is not None and got:  # O_DIRECT mode: leave no page cache behind
                    os.posix_fadvise(fd, off, got, os.POSIX_FADV_DONTNEED)
            total += got
            if got < nbytes:
                return total, (s, s * bps + off // bb, got)
        return total, None

    def read_rows(self, flat: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Rows `flat` (any order, repeats fine) into out, read by their whole blocks."""
        gather_by_block(flat, self.block_rows, self.row_bytes, self.group(),
                        lambda blocks, scratch: self.read(blocks, memoryview(scratch)),
                        lambda sel, rows: out.__setitem__(sel, rows))
        return out

    def read_range(self, start: int, n: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows [start, start + n) as uint8 [n, row_bytes], verified block by block. Blocks of
        rows alone (format 1) inside the range are read straight into `out` (loading a table
        costs one pass over its files); records are read into scratch, checked over their
        on-disk bytes, then cut to their rows by one strided copy."""
        start, n = int(start), int(n)
        if n < 0 or start < 0 or start + n > self.rows:
            raise InvalidArgument(f"table {self.version.table!r} has {self.rows} rows; "
                                  f"range [{start}, {start + n}) is out of range")
        out = check_out(out, n, self.row_bytes)
        if n == 0:
            return out
        br, g = self.block_rows, self.group()
        first, last = start // br, (start + n - 1) // br
        scratch = None
        for a in range(first, last + 1, g):
            blocks = np.arange(a, min(a + g, last + 1), dtype=np.int64)
            r0, r1 = a * br, min((a + len(blocks)) * br, self.rows)
            if self.fmt.records_are_rows and r0 >= start and r1 <= start + n:
                self.read(blocks, memoryview(out[r0 - start:r1 - start]).cast("B"))
                continue
            if scratch is None:
                scratch = np.empty(g * self.block_bytes, dtype=np.uint8)
            self.read(blocks, memoryview(scratch))
            c0, c1 = max(r0, start), min(r1, start + n)
            recs = scratch[:(r1 - r0) * self.record_bytes].reshape(-1, self.record_bytes)
            out[c0 - start:c1 - start] = self.fmt.rows_of(recs[c0 - r0:c1 - r0])
        return out

    def iter_blocks(self, rows_per_chunk: int | None = None):
        """Yield (first_row, uint8 [k, row_bytes]) over the whole table, verified; the array is
        reused between steps (copy it to keep it)."""
        step = rows_per_chunk or self.group() * self.block_rows
        step = max(self.block_rows, step // self.block_rows * self.block_rows)
        buf = np.empty((step, self.row_bytes), dtype=np.uint8)
        for r in range(0, self.rows, step):
            k = min(step, self.rows - r)
            yield r, self.read_range(r, k, out=buf[:k])

    def disk_blocks(self, group: int):
        """Yield (first block, uint8 [k, block_bytes]) over the whole table: `group` blocks at a
        time as they lie on disk (records, in either format), each checked against its block
        checksum; the last block's tail past the table is undefined. The array is reused."""
        g = max(1, group)
        buf = np.empty(g * self.block_bytes, dtype=np.uint8)
        for a in range(0, self.version.n_blocks, g):
            blocks = np.arange(a, min(a + g, self.version.n_blocks), dtype=np.int64)
            self.read(blocks, memoryview(buf))
            yield a, buf[:blocks.size * self.block_bytes].reshape(blocks.size, self.block_bytes)

    def verify(self) -> list[int]:
        """Scrub: re-check every block, and every row against its own row sum where the
        version has them; the numbers of bad blocks (corrupt, truncated, missing, or holding a
        row that fails its row sum), empty when intact."""
        bad: list[int] = []
        g, br, n_blocks = self.group(), self.block_rows, self.version.n_blocks
        buf = np.empty(g * self.block_bytes, dtype=np.uint8)
        a = 0
        while a < n_blocks:
            blocks = np.arange(a, min(a + g, n_blocks), dtype=np.int64)
            try:
                self.read(blocks, memoryview(buf))
                a = int(blocks[-1]) + 1
            except ChecksumError as e:
                bad.append(e.block)
                a = e.block + 1
                continue
            if self.fmt.verifies_rows:
                r0, r1 = int(blocks[0]) * br, min(a * br, self.rows)
                ids = np.arange(r0, r1, dtype=np.int64)
                wrong = self.fmt.rows_wrong(buf[:(r1 - r0) * self.record_bytes].reshape(-1, self.record_bytes), ids)
                bad += np.unique(ids[wrong] // br).tolist()
        return bad

    def close(self) -> None:
        if isinstance(self.checksums, BlockChecksums):
            self.checksums.close()
