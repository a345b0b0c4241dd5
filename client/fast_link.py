"""FastLink: a sidecar client's fast-path connection (`<socket>.fast`) and its queued releases.

Made on first use; when the sidecar has no fast path (an older one, or refused)
the client plans over gRPC instead. A released lease is queued to ride on the
next step's request; a client that stops planning sends it after
RELEASE_LINGER_S, from a background thread. Steps a client read itself
(client/local_reads.py) are noted here and sent in batches, one-way: every
NOTE_EVERY_S or NOTE_IDS ids while steps run, by the same thread after the last.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from tierstore import errors
from tierstore.client.fastpath import FastPathClient
from tierstore.fastpath import fast_socket_path
from tierstore.fastwire import AccessItem

__all__ = ["FastLink", "RELEASE_LINGER_S"]

# a fast-path release waits this long for the next step's request to carry it
RELEASE_LINGER_S = 0.02
# local reads' notes go out at least this often while steps run, or once this many ids wait
NOTE_EVERY_S, NOTE_IDS = 0.002, 1 << 13


class FastLink:
    """The fast-path connection of one Client (None until used, or when the sidecar has none)."""

    def __init__(self, socket: Path | None, owner: bytes, timeout: float, wanted: bool):
        self._socket, self._owner, self._timeout = socket, owner, timeout
        self._wanted = wanted and socket is not None
        self.fast: FastPathClient | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._flusher, self._flush_event, self._flush_due = None, threading.Event(), 0.0
        self._notes: dict[tuple[str, int], tuple[list, list]] = {}  # (table, version) -> (id arrays, sizes)
        self._note_ids, self._note_since = 0, 0.0
        self._notes_lock = threading.Lock()

    def client(self) -> FastPathClient | None:
        """The fast-path connection, made on first use; None when the sidecar has none."""
        if not self._wanted:
            return None
        if self.fast is None:
            with self._lock:
                if self.fast is None:
                    path = fast_socket_path(self._socket)
                    try:
                        self.fast = FastPathClient(path, owner=self._owner, timeout=self._timeout)
                    except errors.TierstoreError:
                        self._wanted = False  # an older sidecar, or refused: gRPC it is
                        return None
        return self.fast

    def release_later(self, lease_id: int) -> bool:
        """Queue a release on the fast path; False when there is none (release over gRPC)."""
        fast = self.fast
        if fast is None:
            return False
        fast.release_later(lease_id)    # rides on the next step's request...
        self._flusher_wake()            # ...or goes alone if none comes soon
        return True

    def release(self, lease_ids: list[int]) -> int:
        """End leases now on the fast path (and any queued); how many were live there."""
        return self.fast.release(lease_ids) if self.fast is not None else 0

    def note(self, table: str, version: int, ids: np.ndarray) -> None:
        """A step of `table` this client read itself (int64 ids, kept as given: do not
        change them); sent with others, one-way, soon (see the module docstring)."""
        now = time.monotonic()
        with self._notes_lock:
            buf = self._notes.get((table, version))
            if buf is None:
                buf = self._notes[(table, version)] = ([], [])
            buf[0].append(ids)
            buf[1].append(ids.size)
            if not self._note_ids:
                self._note_since = now
            self._note_ids += ids.size
            due = self._note_ids >= NOTE_IDS or now - self._note_since >= NOTE_EVERY_S
        if due:
            self.flush_notes()
        else:
            self._flusher_wake()

    def flush_notes(self) -> None:
        """Send the noted steps now (dropped when there is no connection: they are hints)."""
        with self._notes_lock:
            notes, self._notes, self._note_ids = self._notes, {}, 0
        fast = self.fast
        if not notes or fast is None:
            return
        items = [AccessItem(t, np.concatenate(arrs) if len(arrs) > 1 else arrs[0],
                            np.cumsum(sizes, dtype=np.int64), v) for (t, v), (arrs, sizes) in notes.items()]
        try:
            fast.access(items)
        except errors.TierstoreError:
            pass

    def _flusher_wake(self) -> None:
        """Releases queued on the fast path go out with the next request; a client that
        stops planning sends them after RELEASE_LINGER_S (a lease left until its TTL would
        hold its rows, and a retired arena, for nothing)."""
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
                fast = self.fast
                if fast is not None and not self._closed and fast._queued:
                    try:
                        fast.release([])
                    except errors.TierstoreError:
                        pass  # the sidecar is gone: its leases went with it
                if self._note_ids and not self._closed:
                    self.flush_notes()
                self._flush_event.clear()
                fast = self.fast
                if (fast is None or not fast._queued) and not self._note_ids:
                    break

    def close(self) -> None:
        """Send what is noted, stop the flusher and close the connection (the sidecar ends its leases)."""
        self.flush_notes()
        self._closed = True
        self._flush_event.set()
        if self.fast is not None:
            self.fast.close()
            self.fast = None
