"""Prefetcher: prefetch hints (Prefetch RPC) carried out in the background, on a bounded queue.

A hint is checked when it arrives, so its caller hears of a bad one; then it waits
for one of PREFETCH_THREADS threads. The queue is bounded by requests and by ids:
a hint that would pass either bound is dropped (hints are advice, never owed), so a
flood of hints costs bounded memory whatever its rate.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from tierstore.engine import TableEngine
from tierstore.errors import InvalidArgument

__all__ = ["Prefetcher", "PREFETCH_QUEUE", "PREFETCH_QUEUE_IDS", "MAX_HINT_IDS", "PREFETCH_THREADS"]

log = logging.getLogger("tierstore.sidecar.served")
PREFETCH_QUEUE = 64  # prefetch requests waiting at most; more are dropped (they are hints)
PREFETCH_QUEUE_IDS = 1 << 22  # and their ids waiting at most (8 B each)
# ids in one prefetch hint at most: one queued request's rows (a step is tens of thousands);
# a longer one is refused, so no hint holds more than 8 MiB of the queue
MAX_HINT_IDS = 1 << 20
PREFETCH_THREADS = 2  # hints are read beside the steps, never instead of them


class Prefetcher:
    """The queue of prefetch hints and the threads (made at the first hint) that carry them out."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending = self._ids = 0  # requests and ids queued or running
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, engine: TableEngine, ids, read: bool = True, steps: int | None = None,
               conn_id: bytes = b"") -> int:
        """Promote ids in the background; read=False only hints them to the policy, for
        `steps` (Hints.prefetch). Returns the ids queued: all of them, or 0 when the
        queue already holds PREFETCH_QUEUE requests or PREFETCH_QUEUE_IDS ids (the hint is
        dropped) or the table is held whole (nothing to promote).

        Checked now, before anything is queued, so the caller hears of it: InvalidArgument
        for bad ids or steps, or a hint of more than MAX_HINT_IDS ids."""
        if ids.size > MAX_HINT_IDS:
            raise InvalidArgument(f"a prefetch hint of {ids.size} ids for table {engine.table!r}; at most "
                                  f"{MAX_HINT_IDS} ids a hint: hint the rows of one queued request")
        ids, steps = engine.hints.check(ids, steps)
        if engine.full or ids.size == 0:
            return 0
        with self._lock:
            if self._pending >= PREFETCH_QUEUE or self._ids + ids.size > PREFETCH_QUEUE_IDS:
                return 0
            self._pending += 1
            self._ids += ids.size
            if self._pool is None:
                self._pool = ThreadPoolExecutor(PREFETCH_THREADS, thread_name_prefix="prefetch")
        self._pool.submit(self._run, engine, ids, read, steps, conn_id)
        return ids.size

    def _run(self, engine: TableEngine, ids, read: bool, steps: int, conn_id: bytes) -> None:
        try:
            if not engine.retired:
                engine.hints.prefetch(ids, read=read, steps=steps, conn_id=conn_id)
        except Exception:  # noqa: BLE001 - a hint; a bad block surfaces when a step reads it
            log.debug("prefetch of %d ids in %s failed", ids.size, engine.table, exc_info=True)
        finally:
            with self._lock:
                self._pending -= 1
                self._ids -= ids.size

    def stop(self) -> None:
        """Drop the hints still queued and wait for those running."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
