"""The block read path of a segment reader: whole checksummed blocks.

Used to load a full-mode arena (`read_range`), to scrub and verify a version
(`iter_blocks`, `verify`) and to read rows of versions written before row
checksums existed. Sorted unique blocks are read with one pread per run of
neighbours (many runs in flight from the shared pool), each block checked
against its xxh3-64 in the catalog. `SegmentReader` (nvme.py) mixes this in.
"""
from __future__ import annotations

import os
import threading

import numpy as np
import xxhash

from tierstore.errors import ChecksumError, InvalidArgument
from tierstore.tiers.nvme import rowsum
from tierstore.tiers.base import check_out, gather_by_block

__all__ = ["BlockReads", "default_block_rows", "read_pool", "BLOCK_TARGET_BYTES"]

# A block is the unit of checksumming and of reading: verifying a row means
# reading its whole block, so the block size is the read amplification of a
# cache miss. About 4 KiB, one NVMe page: a random 4 KiB read is the cheapest
# the device does, and measured on a 1M x 256 B table at a 10% DRAM budget
# (Zipf 1.0, 32k-id steps) 4 KiB blocks served 1.24M rows/s against 0.95M for
# 16 KiB (3.9 KB vs 13.4 KB read per miss). The price is the checksum list:
# 8 B per 4 KiB = 0.2%, 190 MB for a 98 GB V4.1 layer.
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


class BlockReads:
    """Block reads over the attributes SegmentReader sets up (fds, checksums, geometry)."""

    def _block_len(self, blocks: np.ndarray) -> np.ndarray:
        """Bytes in each block (only the table's last block may be short)."""
        end = np.minimum((blocks + 1) * self.block_rows, self.rows)
        return (end - blocks * self.block_rows) * self.row_bytes

    def _read_blocks(self, blocks: np.ndarray, buf: memoryview) -> None:
        """Read sorted unique `blocks` into `buf` (block j at j * block_bytes) and
        verify each; adjacent blocks in one segment are read with one pread."""
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
            raise ChecksumError(self.table, self.version.version, bad,
                                f"segment {self.version.segments[s]} is {what}")
        with self._lock:
            self.bytes_read += total
        expect = self.checksums[blocks].tolist()
        h = xxhash.xxh3_64_intdigest
        bb = self._block_bytes
        for j, (e, n) in enumerate(zip(expect, lens.tolist())):
            if h(buf[j * bb:j * bb + n]) != e:
                raise ChecksumError(self.table, self.version.version, int(blocks[j]))

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

        Whole blocks inside the range are read straight into `out` (no copy), so
        loading a table into a DRAM arena costs one pass over the files.
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

    def verify(self) -> list[int]:
        """Re-check every block, and every row against its row checksum when the
        version has them; return the numbers of bad (corrupt, truncated, missing,
        or holding a row that fails its row checksum) blocks, empty when intact."""
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
            if self.row_sums is not None:
                r0, r1 = int(blocks[0]) * br, min(a * br, self.rows)
                ids = np.arange(r0, r1, dtype=np.int64)
                rows = buf[:(r1 - r0) * self.row_bytes].reshape(-1, self.row_bytes)
                wrong = rowsum.row_sums(rows, ids) != self.row_sums[r0:r1]
                bad += np.unique(ids[wrong] // br).tolist()
        return bad
