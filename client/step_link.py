"""StepLink: a client's step-socket connection (`<socket>.steps`) and what rides on it.

The connection is made on first use (StepConnection: one request in flight,
reconnecting once by itself). A released lease is queued to ride on the next
step's PLAN frame; a client that stops planning sends it in a RELEASE frame
after RELEASE_LINGER_S, from a background thread: one release path, carried by
the wire either way. Steps a client read itself (client/local_reads.py) are
noted here and sent in batches, one-way: every NOTE_EVERY_S or NOTE_IDS ids
while steps run, by the same thread after the last. A note carries the rows its
steps read from disk, up to NOTE_ROW_BYTES a frame, so the sidecar promotes them
without reading them again (it verifies each first); rows past that bound go
without their bytes (the sidecar reads the ones it promotes), as do all of them
with O_DIRECT (local_reads.py says why).
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from tierstore import errors
from tierstore.client.step_connection import StepConnection
from tierstore.proto.frames import AccessItem, step_socket_path

__all__ = ["StepLink", "RELEASE_LINGER_S"]

# a release waits this long for the next step's request to carry it
RELEASE_LINGER_S = 0.02
# local reads' notes go out at least this often while steps run, or once this many ids wait
NOTE_EVERY_S, NOTE_IDS = 0.002, 1 << 13
# bytes of rows one note carries at most (and at most half the sidecar's request limit)
NOTE_ROW_BYTES = 32 << 20


class StepLink:
    """The step socket of one Client, the sidecar's at `socket` + ".steps"."""

    def __init__(self, socket: Path, timeout: float):
        self.path, self._timeout = step_socket_path(socket), timeout
        self.conn: StepConnection | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._flusher, self._flush_event, self._flush_due = None, threading.Event(), 0.0
        # (table, version) -> (id arrays, sizes, row-id arrays, row arrays)
        self._notes: dict[tuple[str, int], tuple[list, list, list, list]] = {}
        self._note_ids, self._note_since, self._note_bytes = 0, 0.0, 0
        self._notes_lock = threading.Lock()

    def connection(self) -> StepConnection:
        """The connection, made on first use. Raises Unavailable (no sidecar answers on the
        step socket), ResourceExhausted (it serves its maximum of connections)."""
        if self.conn is None:
            with self._lock:
                if self._closed:
                    raise errors.InvalidArgument(f"the step socket link to {self.path} is closed")
                if self.conn is None:
                    self.conn = StepConnection(self.path, timeout=self._timeout)
        return self.conn

    def release_later(self, lease_id: int) -> None:
        """Queue a release: it rides on the next step's PLAN frame, or goes alone soon."""
        conn = self.conn
        if conn is None:
            return  # never connected: no lease of ours exists
        conn.release_later(lease_id)
        self._flusher_wake()

    def release(self, lease_ids: list[int]) -> int:
        """End leases now (and any queued); how many were live."""
        return self.conn.release(lease_ids) if self.conn is not None else 0

    def note(self, table: str, version: int, ids: np.ndarray, row_ids: np.ndarray | None = None,
             rows: np.ndarray | None = None) -> None:
        """A step of `table` this client read itself (int64 ids, kept as given: do not
        change them); sent with others, one-way, soon (see the module docstring).
        row_ids, rows: the rows of its misses as read from disk (int64 [n], uint8
        [n, row_bytes], kept as given too), carried while the note has room."""
        now = time.monotonic()
        with self._notes_lock:
            buf = self._notes.get((table, version))
            if buf is None:
                buf = self._notes[(table, version)] = ([], [], [], [])
            buf[0].append(ids)
            buf[1].append(ids.size)
            if rows is not None and rows.size and self._note_bytes + rows.nbytes <= NOTE_ROW_BYTES:
                buf[2].append(row_ids)
                buf[3].append(rows)
                self._note_bytes += rows.nbytes
            if not self._note_ids:
                self._note_since = now
            self._note_ids += ids.size
            due = self._note_ids >= NOTE_IDS or now - self._note_since >= NOTE_EVERY_S
        if due:
            self.flush_notes()
        else:
            self._flusher_wake()

    def flush_notes(self) -> None:
        """Send the noted steps now (dropped when no connection can be had: they are hints)."""
        with self._notes_lock:
            notes, self._notes, self._note_ids, self._note_bytes = self._notes, {}, 0, 0
        if not notes or self._closed:
            return
        items = [AccessItem(t, _joined(arrs), np.cumsum(sizes, dtype=np.int64), v,
                            _joined(row_ids) if row_ids else None, _joined(rows) if rows else None)
                 for (t, v), (arrs, sizes, row_ids, rows) in notes.items()]
        try:
            conn = self.connection()
            if sum(it.rows.nbytes for it in items if it.rows is not None) > conn.max_request_bytes // 2:
                for it in items:  # a sidecar with a small request limit: the ids still go
                    it.row_ids = it.rows = None
            conn.access(items)
        except errors.TierstoreError:
            pass

    def _flusher_wake(self) -> None:
        """Queued releases go out with the next request; a client that stops planning sends
        them after RELEASE_LINGER_S (a lease left until its TTL would hold its rows, and a
        retired arena, for nothing)."""
        self._flush_due = time.monotonic() + RELEASE_LINGER_S
        if self._flusher is None:
            self._flusher = threading.Thread(target=self._flush_loop, name="tierstore-release", daemon=True)
            self._flusher.start()
        if not self._flush_event.is_set():  # a set costs a lock and a notify; once per wait is enough
            self._flush_event.set()

    def _flush_loop(self) -> None:
        while not self._closed:
            self._flush_event.wait()
            # the event stays set while this loop runs, so a step loop's releases skip the set;
            # it is cleared before the queue is looked at, so a release is never left unseen
            while not self._closed:
                while not self._closed and time.monotonic() < self._flush_due:
                    time.sleep(max(0.0, self._flush_due - time.monotonic()))
                conn = self.conn
                if conn is not None and not self._closed and conn.queued:
                    try:
                        conn.release([])
                    except errors.TierstoreError:
                        pass  # the sidecar is gone: its leases went with it
                if self._note_ids and not self._closed:
                    self.flush_notes()
                self._flush_event.clear()
                conn = self.conn
                if (conn is None or not conn.queued) and not self._note_ids:
                    break

    def close(self) -> None:
        """Send what is noted, stop the flusher and close the connection (the sidecar ends its leases)."""
        self.flush_notes()
        self._closed = True
        self._flush_event.set()
        with self._lock:
            if self.conn is not None:
                self.conn.close()
                self.conn = None


def _joined(arrays: list) -> np.ndarray:
    return np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
