"""The remote tier: rows of a published version read from Mooncake Store.

Same read interface as tiers.nvme.SegmentReader (the engine cannot tell them
apart): the blocks holding the requested rows are fetched in one batch, each
checked against the manifest's xxh3-64, then gathered into the caller's rows.

Faults, and what the caller sees:
- a block whose bytes do not match its checksum: ChecksumError (DATA_LOSS,
  naming table, version and block) at once, never a row of it;
- a block no replica holds any more (the master says it does not exist):
  ChecksumError for that block;
- a replica that does not answer (its store process died, the master has not
  noticed yet): the block is fetched again, from another replica once the
  master drops the dead one, until `retry_s`; then Unavailable;
- the master unreachable: Unavailable, within `retry_s`.

With a LocalCopy (`serve --remote` on a host whose --data lacks the rows), a
block already written back is read locally (verified) and only the others are
fetched; fetched blocks go to a WriteBack, off the request path.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import xxhash

from tierstore import cpu_token
from tierstore.store.catalog import TableVersion
from tierstore.errors import ChecksumError, InvalidArgument, Unavailable
from tierstore.tiers.remote.publish import block_keys
from tierstore.tiers.base import ColdTier, check_ids, check_out, gather_by_block

__all__ = ["RemoteReader"]

GROUP_BYTES = 8 << 20      # blocks fetched per batch (bounds scratch memory)
RETRY_S = 15.0             # > Mooncake's default client_ttl (10 s): a dead replica is dropped by then
RETRY_PAUSE_S = 0.1


class RemoteReader(ColdTier):
    """Verified reads of one published table version from Mooncake.

    store: a connected MooncakeDistributedStore (tierstore.tiers.remote.mooncake.connect).
    version, checksums: the manifest and uint64 [n_blocks] (publish.fetch_manifest,
    or the local catalog filled by `tierstore fetch-manifest`).
    retry_s: how long unanswered blocks are retried before Unavailable.
    copy: a LocalCopy of this version to read present blocks from and write
    fetched ones back to (a WriteBack thread; `fill` also fetches blocks no
    request asked for, so the copy completes). The reader then owns it.

    Thread-safe (Mooncake's client is); `bytes_read` and `blocks_fetched` count
    what came from Mooncake, `copy_blocks_read` blocks read from the local copy
    (a complete copy is then read row by row through a SegmentReader).
    """

    def __init__(self, store, version: TableVersion, checksums: np.ndarray, *, retry_s: float = RETRY_S,
                 copy=None, fill: bool = True):
        self.store, self.version, self.retry_s = store, version, float(retry_s)
        self.table, self.rows, self.row_bytes = version.table, version.rows, version.row_bytes
        self.block_rows = version.block_rows
        self.checksums = np.asarray(checksums, dtype=np.uint64)
        if self.checksums.shape != (version.n_blocks,):
            raise InvalidArgument(f"table {self.table!r} version {version.number}: expected "
                                  f"{version.n_blocks} checksums, got {self.checksums.shape}")
        self._block_bytes = version.block_bytes
        self._lock = threading.Lock()
        self.bytes_read = self.blocks_fetched = 0
        self.retries = 0
        self.copy, self.writeback, self.copy_blocks_read = copy, None, 0
        self._done = None  # SegmentReader once the local copy is complete
        if copy is not None:
            from tierstore.tiers.remote.writeback import WriteBack
            self.writeback = WriteBack(copy, self._fetch_rows, fill=fill)

    # ---- block fetch ---------------------------------------------------------
    def _block_len(self, blocks: np.ndarray) -> np.ndarray:
        end = np.minimum((blocks + 1) * self.block_rows, self.rows)
        return (end - blocks * self.block_rows) * self.version.record_bytes

    def _read_blocks(self, blocks: np.ndarray, buf: np.ndarray) -> None:
        """Sorted unique `blocks` into `buf` (block j at byte j * block_bytes), verified:
        from the local copy where present, else from Mooncake (then offered for write-back)."""
        if self.copy is None:
            return self._fetch(blocks, buf, np.arange(blocks.size))
        have = self.copy.present[blocks]
        at = np.flatnonzero(have)
        if at.size:
            ok = self.copy.read_blocks(blocks[at], buf, at)
            have[at[~ok]] = False
            with self._lock:
                self.copy_blocks_read += int(ok.sum())
        need = np.flatnonzero(~have)
        if need.size:
            self._fetch(blocks[need], buf, need)
            grid = buf[:blocks.size * self._block_bytes].reshape(-1, self._block_bytes)
            self.writeback.offer(blocks[need], grid[need])  # copies: buf is reused at once

    def _fetch_rows(self, blocks: np.ndarray) -> np.ndarray:
        """Blocks from Mooncake as uint8 [len(blocks), block_bytes], verified (the write-back fill)."""
        buf = np.empty(blocks.size * self._block_bytes, dtype=np.uint8)
        self._fetch(blocks, buf, np.arange(blocks.size))
        return buf.reshape(-1, self._block_bytes)

    def _fetch(self, blocks: np.ndarray, buf: np.ndarray, where: np.ndarray) -> None:
        """Fetch `blocks` from Mooncake into `buf` (block j at byte where[j] * block_bytes), verified."""
        where = where.tolist()
        lens = self._block_len(blocks).tolist()
        expect = self.checksums[blocks].tolist()
        keys = block_keys(self.table, self.version.number, blocks)
        bb, h = self._block_bytes, xxhash.xxh3_64_intdigest
        pending = list(range(len(keys)))
        deadline = time.monotonic() + self.retry_s
        total = 0
        while pending:
            with cpu_token.waiting():  # the network: other plans compute meanwhile
                values = self.store.get_batch([keys[j] for j in pending])
            failed = []
            for j, v in zip(pending, values):  # one step per 4 KiB block, not per row
                if len(v) != lens[j]:
                    failed.append(j)
                    continue
                if h(v) != expect[j]:
                    raise ChecksumError(self.table, self.version.number, int(blocks[j]), "object in Mooncake")
                buf[where[j] * bb:where[j] * bb + lens[j]] = np.frombuffer(v, dtype=np.uint8)
                total += lens[j]
            if failed:
                self._triage([keys[j] for j in failed], [int(blocks[j]) for j in failed], deadline)
            pending = failed
        with self._lock:
            self.bytes_read += total
            self.blocks_fetched += len(keys)

    def _triage(self, keys: list[str], blocks: list[int], deadline: float) -> None:
        """Decide about blocks a batch did not return: gone (DATA_LOSS), unreachable
        (Unavailable once the deadline passes), or worth another try."""
        exist = self.store.batch_is_exist(keys)
        gone = [b for b, e in zip(blocks, exist) if e == 0]
        if gone:
            raise ChecksumError(self.table, self.version.number, gone[0],
                                "no replica left in Mooncake; publish the version again")
        if time.monotonic() >= deadline:
            master = all(e < 0 for e in exist)
            raise Unavailable(f"table {self.table!r} version {self.version.number}: "
                              f"{'the Mooncake master does not answer' if master else 'no replica answers'} "
                              f"for {len(blocks)} blocks (first {blocks[0]}) after {self.retry_s:.0f}s")
        with self._lock:
            self.retries += 1
        time.sleep(RETRY_PAUSE_S)

    def _group_blocks(self) -> int:
        return max(1, GROUP_BYTES // self._block_bytes)

    def _gather(self, flat: np.ndarray, put) -> None:
        """Fetch the blocks of ids `flat`, group by group; put(sel, rows) stores rows for flat[sel].
        Blocks are on-disk bytes, verified whole: format 2 records are cut to their rows."""
        if self.version.segment_format == 2:
            rb, store = self.row_bytes, put
            put = lambda sel, recs: store(sel, recs[:, :rb])  # noqa: E731
        gather_by_block(flat, self.block_rows, self.version.record_bytes, self._group_blocks(),
                        self._read_blocks, put)

    def _finished_reader(self):
        """Once the local copy is complete: a SegmentReader on it (row-sized verified reads)."""
        if self._done is None and self.copy is not None and self.copy.finished:
            with self._lock:
                if self._done is None:
                    from tierstore.tiers.nvme.reader import SegmentReader
                    self._done = SegmentReader(self.copy.data_dir, self.version, self.checksums)
        return self._done

    # ---- public reads (SegmentReader's interface) ------------------------------
    def read_rows(self, ids, out: np.ndarray | None = None) -> np.ndarray:
        """Rows `ids` as uint8 [len(ids), row_bytes] in the caller's order.
        Raises IdOutOfRange, InvalidArgument, ChecksumError, Unavailable."""
        flat = check_ids(ids, self.rows, self.table)
        out = check_out(out, flat.size, self.row_bytes)
        if self._finished_reader() is not None:
            return self._done.read_rows(flat, out=out)
        if flat.size:
            self._gather(flat, lambda sel, rows: out.__setitem__(sel, rows))
        return out

    def submit(self, batch, at: np.ndarray):
        """The read pipeline's submit stage (tiers/nvme/miss_batch.py): once the local copy is
        complete, its SegmentReader's (parts in flight on this thread's ring); until then
        the rows batch.ids[at] fetched block by block, verified, straight into
        batch.dest[batch.slots[at]], and nothing left in flight."""
        done = self._finished_reader()
        if done is not None:
            yield from done.submit(batch, at)
        elif at.size:
            ids, slots = batch.ids[at], batch.slots[at]
            self._gather(ids, lambda sel, rows: batch.dest.__setitem__(slots[sel], rows))

    # the parts submit left in flight are the local copy's reader's
    def finish(self, part) -> None:
        self._done.finish(part)

    def place(self, part, batch) -> tuple[int, str]:
        return self._done.place(part, batch)

    def abandon(self, part) -> None:
        self._done.abandon(part)

    def landed(self, part) -> bool:
        return self._done.landed(part)

    def land(self, batch, share: float) -> None:
        if self._done is not None:
            self._done.land(batch, share)

    def row_error(self, row: int, why: str = ""):
        return self._done.row_error(row, why)

    def read_range(self, start: int, n: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows [start, start + n) (full-mode load), verified block by block."""
        start, n = int(start), int(n)
        if n < 0 or start < 0 or start + n > self.rows:
            raise InvalidArgument(f"table {self.table!r} has {self.rows} rows; "
                                  f"range [{start}, {start + n}) is out of range")
        out = check_out(out, n, self.row_bytes)
        step = self._group_blocks() * self.block_rows
        for a in range(start, start + n, step):
            k = min(step, start + n - a)
            self.read_rows(np.arange(a, a + k, dtype=np.int64), out=out[a - start:a - start + k])
        return out

    def iter_blocks(self, rows_per_chunk: int | None = None):
        step = rows_per_chunk or self._group_blocks() * self.block_rows
        buf = np.empty((step, self.row_bytes), dtype=np.uint8)
        for r in range(0, self.rows, step):
            k = min(step, self.rows - r)
            yield r, self.read_range(r, k, out=buf[:k])

    def close(self) -> None:
        # the store client is the caller's (one per sidecar, shared by tables); the local copy is ours
        if self._done is not None:
            self._done.close()
        if self.writeback is not None and not self.writeback.close():
            return  # its thread still holds the files: never close an fd it may write to
        if self.copy is not None:
            self.copy.close()
            self.copy = None
