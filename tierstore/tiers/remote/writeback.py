"""Write-back: blocks fetched from Mooncake become local, off the request path.

The remote tier `offer`s each batch of blocks it fetched for a request; the
offer copies them into a bounded queue and returns at once (a full queue drops
the batch: a Plan never waits for the disk). One thread writes queued batches
through LocalCopy (verify, data, fdatasync, bitmap, fdatasync). When the queue
has been idle for a moment and `fill` is on, the same thread fetches blocks no
request has asked for yet, so a new host ends with the whole version local even
if its traffic never touches every block; then it calls LocalCopy.finish.
A write that fails (a full disk) stops write-back with one warning; serving
from Mooncake goes on.
"""
from __future__ import annotations

import logging
import queue
import threading
import time

import numpy as np

from tierstore.tiers.remote.local_copy import LocalCopy

__all__ = ["WriteBack"]

log = logging.getLogger(__name__)
QUEUE_BYTES = 64 << 20     # fetched bytes waiting to be written, at most
FLUSH_BYTES = 8 << 20      # bytes written per fdatasync round
FILL_BYTES = 8 << 20       # bytes fetched per background fill batch
IDLE_S = 0.05              # the queue is this quiet before the fill takes a turn
RETRY_PAUSE_S = 1.0        # a failed fill fetch (Mooncake away) waits this long


class WriteBack:
    """Background writer of fetched blocks into `copy`.

    fetch(blocks) -> uint8 [len(blocks), block_bytes]: verified blocks from the
    remote tier (used by the fill). fill: also fetch blocks nobody asked for.
    Counters: written, dropped (blocks), fill_fetched (blocks).
    """

    def __init__(self, copy: LocalCopy, fetch, *, fill: bool = True, queue_bytes: int = QUEUE_BYTES):
        self.copy, self.fetch, self.fill = copy, fetch, fill
        self.queue_bytes = queue_bytes
        self.written = self.dropped = self.fill_fetched = 0
        self.error: str | None = None
        self._logged_tenth = copy.n_present * 10 // copy.version.n_blocks
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"writeback-{copy.version.table}")
        if not copy.finish():
            self._thread.start()

    def offer(self, blocks: np.ndarray, rows: np.ndarray) -> bool:
        """Queue copies of fetched blocks (uint8 [k, block_bytes]); never blocks.
        Returns False when the batch was dropped (queue full, stopped, or done)."""
        if self.error or self.copy.finished or not self._thread.is_alive():
            return False
        nbytes = rows.nbytes
        with self._lock:
            if self._pending + nbytes > self.queue_bytes:
                self.dropped += len(blocks)
                return False
            self._pending += nbytes
            self._idle.clear()
        self._q.put((np.array(blocks, dtype=np.int64), np.array(rows, dtype=np.uint8)))
        return True

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until the queue is written (tests, the bench); True when it is."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                if self._pending == 0 and self._idle.is_set():
                    return True
            time.sleep(0.01)
        return False

    def _take(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Up to FLUSH_BYTES of queued batches as one, or None after IDLE_S of quiet."""
        try:
            first = self._q.get(timeout=IDLE_S)
        except queue.Empty:
            return None
        got, size = [first], first[1].nbytes
        while size < FLUSH_BYTES:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            got.append(item)
            size += item[1].nbytes
        with self._lock:
            self._pending -= size
        if len(got) == 1:
            return first
        return np.concatenate([b for b, _ in got]), np.concatenate([r for _, r in got])

    def _run(self) -> None:
        copy = self.copy
        while not self._stop.is_set():
            batch = self._take()
            try:
                if batch is None:
                    self._idle.set()
                    if copy.finish():
                        return
                    if self.fill:
                        self._fill_once()
                    continue
                blocks, rows = batch
                order = np.unique(blocks, return_index=True)[1]  # a block offered twice is written once
                self.written += copy.write_blocks(blocks[order], rows[order])
                self._progress()
            except OSError as e:
                self.error = f"write-back to {copy.dir} stopped: {e}; serving goes on from Mooncake"
                log.warning("table %s v%d: %s", copy.version.table, copy.version.number, self.error)
                return

    def _fill_once(self) -> None:
        copy = self.copy
        blocks = copy.absent(max(1, FILL_BYTES // copy.version.block_bytes))
        if blocks.size == 0:
            return
        try:
            rows = self.fetch(blocks)
        except Exception as e:  # noqa: BLE001 - Mooncake away: requests see it; the fill waits and retries
            log.debug("write-back fill of %d blocks failed: %s", blocks.size, e)
            self._stop.wait(RETRY_PAUSE_S)
            return
        self.fill_fetched += blocks.size
        if self._stop.is_set():
            return
        self.written += copy.write_blocks(blocks, rows)
        self._progress()

    def _progress(self) -> None:
        """One log line per tenth of the version made local (operators watch a host warm up)."""
        v, tenth = self.copy.version, self.copy.n_present * 10 // self.copy.version.n_blocks
        if tenth > self._logged_tenth:
            self._logged_tenth = tenth
            log.info("table %s v%d: %d%% of blocks local (%d written back, %d fetched by the fill)",
                     v.table, v.number, tenth * 10, self.written, self.fill_fetched)

    def stats(self) -> dict:
        return {"present_blocks": self.copy.n_present, "blocks": self.copy.version.n_blocks,
                "written": self.written, "dropped": self.dropped, "fill_fetched": self.fill_fetched,
                "finished": self.copy.finished, "error": self.error}

    def close(self, timeout: float = 30.0) -> bool:
        """Stop the thread; False when it is still inside a fetch (leave the files open)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()
