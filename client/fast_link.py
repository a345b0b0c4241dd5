"""FastLink: a sidecar client's fast-path connection (`<socket>.fast`) and its queued releases.

Made on first use; when the sidecar has no fast path (an older one, or refused)
the client plans over gRPC instead. A released lease is queued to ride on the
next step's request; a client that stops planning sends it after
RELEASE_LINGER_S, from a background thread.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

from tierstore import errors
from tierstore.client.fastpath import FastPathClient
from tierstore.fastpath import fast_socket_path

__all__ = ["FastLink", "RELEASE_LINGER_S"]

# a fast-path release waits this long for the next step's request to carry it
RELEASE_LINGER_S = 0.02


class FastLink:
    """The fast-path connection of one Client (None until used, or when the sidecar has none)."""

    def __init__(self, socket: Path | None, owner: bytes, timeout: float, wanted: bool):
        self._socket, self._owner, self._timeout = socket, owner, timeout
        self._wanted = wanted and socket is not None
        self.fast: FastPathClient | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._flusher, self._flush_event, self._flush_due = None, threading.Event(), 0.0

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
                self._flush_event.clear()
                fast = self.fast
                if fast is None or not fast._queued:
                    break

    def close(self) -> None:
        """Stop the flusher and close the connection (the sidecar ends its leases)."""
        self._closed = True
        self._flush_event.set()
        if self.fast is not None:
            self.fast.close()
            self.fast = None
