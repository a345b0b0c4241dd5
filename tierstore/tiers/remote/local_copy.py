"""A version's rows arriving on this host block by block (the remote tier's write-back).

While the copy is partial, its files in the version directory are
  ``seg-NNNNN.bin.partial``  the segments, at full size from the start (sparse)
  ``<row sums>.partial``     per-row checksums, when the manifest names a file
                             (segment format 1; format 2 records carry their own)
  ``blocks.present``         a header, then one bit per block: which blocks are durable
Durability order per batch: the block bytes (checked against the manifest's
checksum first) and their row sums are written and fdatasync'ed, then their
bits are set and the bitmap is fdatasync'ed. A crash at any point leaves every
set bit naming bytes that are on disk; at worst a block is fetched again. A
local read still verifies each block, so a block damaged later is fetched
again too, never served.

When every bit is set, `finish` gives the row sums file and then the segments
their final names (the ones the catalog lists) and removes the bitmap: the
version is then an ordinary local one, served by SegmentReader after a restart.
"""
from __future__ import annotations

import logging
import os
import struct
import threading
from pathlib import Path

import numpy as np
import xxhash

from tierstore.store.data_dir import fsync_dir, private_dirs
from tierstore.store.version import TableVersion
from tierstore.tiers.nvme import rowsum

__all__ = ["BITMAP_NAME", "LocalCopy"]

log = logging.getLogger(__name__)
BITMAP_NAME = "blocks.present"
_MAGIC = b"TSWB0001"
_HEADER = struct.Struct("<8sQQQ")  # magic, n_blocks, xxh3 of the checksum list, reserved
SCAN_BLOCKS = 1 << 16  # absent blocks are looked for this many bits at a time


class LocalCopy:
    """The local, possibly partial, copy of one version under `data_dir`.

    `present[b]`: block b is durable here (read it locally). Reads and writes
    may run in different threads; writes come from one thread (WriteBack).
    Raises OSError when the version directory cannot be written.
    """

    def __init__(self, data_dir, version: TableVersion, checksums: np.ndarray):
        self.data_dir, self.version = Path(data_dir), version
        self.checksums = np.asarray(checksums, dtype=np.uint64)
        v = version
        rel = Path(v.segments[0]).parent
        self.dir = private_dirs(self.data_dir, *rel.parts)
        self._bb, self._bps = v.block_bytes, v.segment_rows // v.block_rows
        self._tag = xxhash.xxh3_64_intdigest(np.ascontiguousarray(self.checksums, dtype="<u8"))
        self.finished = False
        seg_rows = [min(v.segment_rows, v.rows - s * v.segment_rows) for s in range(len(v.segments))]
        self._fds = [self._open(self.data_dir / p, n * v.record_bytes) for p, n in zip(v.segments, seg_rows)]
        self._sums_path = self.dir / v.row_sums["file"] if v.row_sums else None
        self._sums_fd = self._open(self._sums_path, 8 * v.rows) if self._sums_path else None
        self.present = np.zeros(-(-v.n_blocks // 8) * 8, dtype=bool)  # padded to whole bytes
        self._bitmap = self.dir / BITMAP_NAME
        self._bitmap_fd = self._load_bitmap()
        self.n_present = int(self.present.sum())
        self._cursor = 0
        self._lock = threading.Lock()

    # ---- files ------------------------------------------------------------------
    @staticmethod
    def _open(final: Path, size: int) -> int:
        """The file under its final name when an interrupted `finish` already renamed it,
        else its .partial twin, created at full size."""
        if final.is_file():
            return os.open(final, os.O_RDWR | os.O_CLOEXEC)
        fd = os.open(f"{final}.partial", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)
        return fd

    def _load_bitmap(self) -> int:
        fd = os.open(self._bitmap, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        n = self.version.n_blocks
        raw = os.pread(fd, _HEADER.size + self.present.size // 8, 0)
        if len(raw) == _HEADER.size + self.present.size // 8 and \
                _HEADER.unpack_from(raw) == (_MAGIC, n, self._tag, 0):
            bits = np.frombuffer(raw, dtype=np.uint8, offset=_HEADER.size)
            self.present[:] = np.unpackbits(bits, bitorder="little").astype(bool)
            self.present[n:] = False
            return fd
        # none yet, or another version's: start empty (no bit set before its block is durable)
        os.ftruncate(fd, 0)
        os.pwrite(fd, _HEADER.pack(_MAGIC, n, self._tag, 0) + bytes(self.present.size // 8), 0)
        os.fsync(fd)
        fsync_dir(self.dir)
        return fd

    # ---- reading ------------------------------------------------------------------
    def _where(self, b: int) -> tuple[int, int, int]:
        """(fd, byte offset, length) of block b."""
        v = self.version
        n = (min((b + 1) * v.block_rows, v.rows) - b * v.block_rows) * v.record_bytes
        return self._fds[b // self._bps], (b % self._bps) * self._bb, n

    def read_blocks(self, blocks: np.ndarray, buf: np.ndarray, where: np.ndarray) -> np.ndarray:
        """Read present `blocks` into buf (block j at byte where[j] * block_bytes), each
        verified; returns bool [len(blocks)]: read and verified. A block that fails is
        marked absent (fetched and written again), never handed on."""
        ok = np.zeros(len(blocks), dtype=bool)
        expect = self.checksums[blocks].tolist()
        h, bb = xxhash.xxh3_64_intdigest, self._bb
        for j, (b, pos) in enumerate(zip(blocks.tolist(), where.tolist())):  # one step per 4 KiB block
            fd, off, n = self._where(b)
            view = buf[pos * bb:pos * bb + n]
            ok[j] = os.preadv(fd, [view], off) == n and h(view) == expect[j]
        if not ok.all():
            bad = blocks[~ok]
            log.warning("table %s v%d: %d local blocks (first %d) failed verification; fetching them again",
                        self.version.table, self.version.number, bad.size, int(bad[0]))
            with self._lock:
                self.present[bad] = False
                self.n_present = int(self.present.sum())
        return ok

    def absent(self, k: int) -> np.ndarray:
        """Up to k blocks not here yet (sorted), scanning on from where the last call stopped."""
        n, scanned = self.version.n_blocks, 0
        a = self._cursor if self._cursor < n else 0
        while scanned < n:
            hi = min(a + SCAN_BLOCKS, n)
            got = np.flatnonzero(~self.present[a:hi])[:k]
            if got.size:
                self._cursor = a + int(got[-1]) + 1
                return (got + a).astype(np.int64)
            scanned += hi - a
            a = 0 if hi >= n else hi
        return np.zeros(0, dtype=np.int64)

    @property
    def complete(self) -> bool:
        return self.n_present >= self.version.n_blocks

    # ---- writing (one thread) --------------------------------------------------------
    def write_blocks(self, blocks: np.ndarray, data: np.ndarray) -> int:
        """Make `blocks` durable here: data is uint8 [len(blocks), block_bytes] (a short
        last block uses its head). Blocks already here are skipped, blocks whose bytes do
        not match the manifest are dropped (logged). Returns the blocks written."""
        v, h = self.version, xxhash.xxh3_64_intdigest
        keep = ~self.present[blocks]
        blocks, data = blocks[keep], data[keep]
        if blocks.size == 0:
            return 0
        spans = [self._where(b) for b in blocks.tolist()]
        good = np.array([h(data[j, :n]) == int(self.checksums[b])
                         for j, (b, (_, _, n)) in enumerate(zip(blocks.tolist(), spans))], dtype=bool)
        if not good.all():
            log.warning("table %s v%d: %d fetched blocks (first %d) did not match their checksum; not written",
                        v.table, v.number, int((~good).sum()), int(blocks[~good][0]))
        touched = set()
        for (fd, off, n), row in zip([s for s, g in zip(spans, good) if g], data[good]):
            os.pwrite(fd, row[:n], off)
            touched.add(fd)
        blocks = blocks[good]
        if blocks.size == 0:
            return 0
        if self._sums_fd is not None and blocks.size:  # format 1 (record_bytes == row_bytes)
            ids = (blocks[:, None] * v.block_rows + np.arange(v.block_rows)).reshape(-1)
            sums = rowsum.row_sums(data[good].reshape(-1, v.row_bytes), ids, rowsum.RowKey.of(v.row_salt)).astype("<u8")
            sums = sums.reshape(blocks.size, v.block_rows)
            for b, s in zip(blocks.tolist(), sums):
                n = min(v.block_rows, v.rows - b * v.block_rows)
                os.pwrite(self._sums_fd, s[:n].tobytes(), 8 * b * v.block_rows)
            touched.add(self._sums_fd)
        for fd in touched:  # the bytes first ...
            os.fdatasync(fd)
        with self._lock:
            self.present[blocks] = True
            self.n_present = int(self.present.sum())
            lo, hi = int(blocks.min()) // 8, int(blocks.max()) // 8 + 1
            bits = np.packbits(self.present[lo * 8:hi * 8], bitorder="little")
        os.pwrite(self._bitmap_fd, bits.tobytes(), _HEADER.size + lo)  # ... then the bits that name them
        os.fdatasync(self._bitmap_fd)
        return int(blocks.size)

    def finish(self) -> bool:
        """Once every block is here: final names (row sums first, then segments, then the
        bitmap goes). Returns True when the copy is (now) an ordinary local version."""
        if self.finished or not self.complete:
            return self.finished
        v = self.version
        if self._sums_fd is not None:
            raw = os.pread(self._sums_fd, 8 * v.rows, 0)
            if xxhash.xxh3_64_intdigest(raw) != int(v.row_sums["xxh3"]):
                log.error("table %s v%d: the row checksums rebuilt here do not match the manifest; "
                          "keeping the copy partial", v.table, v.number)
                return False
            self._rename(self._sums_path)
        for p in v.segments:
            self._rename(self.data_dir / p)
        fsync_dir(self.dir)
        self._bitmap.unlink(missing_ok=True)
        fsync_dir(self.dir)
        self.finished = True
        log.info("table %s v%d: every block is local now; a restart serves it from %s without Mooncake",
                 v.table, v.number, self.dir)
        return True

    @staticmethod
    def _rename(final: Path) -> None:
        partial = Path(f"{final}.partial")
        if partial.exists():
            os.rename(partial, final)

    def close(self) -> None:
        for fd in [*self._fds, self._sums_fd, self._bitmap_fd]:
            if fd is not None:
                os.close(fd)
        self._fds, self._sums_fd, self._bitmap_fd = [], None, None
