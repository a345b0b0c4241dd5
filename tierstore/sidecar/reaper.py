"""LeaseReaper: the thread that ends expired leases and frees the versions they held.

A step's lease outlives a dead client by at most its TTL: every REAP_S the reaper
ends the leases past their expiry (LeaseTable.reap), then frees each retired
engine whose last lease has ended (ServedVersions.free_retired).
"""
from __future__ import annotations

import threading

__all__ = ["LeaseReaper", "REAP_S"]

REAP_S = 0.05  # a lease ends at most this long after its expiry


class LeaseReaper:
    """The "lease-reaper" thread over a LeaseTable and the ServedVersions whose retired engines it frees."""

    def __init__(self, leases, versions):
        self.leases, self.versions = leases, versions
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lease-reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(REAP_S):
            self.leases.reap()
            self.versions.free_retired()

    def stop(self) -> None:
        """End the thread after its current pass (a no-op if it never started)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
