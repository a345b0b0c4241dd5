"""Leases: the slots a step will read are pinned until it releases them.

A lease holds the unique slots of one Plan. `pins[slot] > 0` means no policy
may evict that slot. Leases end on Release or after their TTL, so a client
that dies mid-step leaks nothing.
"""
from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
from dataclasses import dataclass

import numpy as np

from tierstore.errors import ResourceExhausted


@dataclass(slots=True)
class Lease:
    lease_id: int
    owner: object          # the TableEngine whose pins hold these slots
    slots: np.ndarray      # unique int64 slots
    expires: float         # time.monotonic() deadline


class LeaseTable:
    """All live leases of one sidecar (thread-safe)."""

    def __init__(self, max_leases: int):
        self.max_leases = max_leases
        self._leases: dict[int, Lease] = {}
        self._expiry: list[tuple[float, int]] = []
        # ids start at a random epoch: a client that outlived a sidecar restart and
        # releases an old id must not end a new client's lease with the same number
        self._ids = itertools.count((int.from_bytes(os.urandom(4), "little") >> 1) << 32 | 1)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._leases)

    def add(self, owner, slots: np.ndarray, ttl_s: float) -> Lease:
        """Record a lease whose slots the owner has already pinned."""
        with self._lock:
            if len(self._leases) >= self.max_leases:
                raise ResourceExhausted(
                    f"{len(self._leases)} leases are live (limit {self.max_leases}); release steps when they end")
            lease = Lease(next(self._ids), owner, slots, time.monotonic() + ttl_s)
            self._leases[lease.lease_id] = lease
            heapq.heappush(self._expiry, (lease.expires, lease.lease_id))
            return lease

    def release(self, lease_ids) -> int:
        """End leases (unknown or already ended ids are ignored); returns how many ended."""
        with self._lock:
            ended = [self._leases.pop(i) for i in lease_ids if i in self._leases]
        for lease in ended:
            lease.owner.unpin(lease.slots)
        return len(ended)

    def reap(self, now: float | None = None) -> int:
        """End every lease past its deadline."""
        now = time.monotonic() if now is None else now
        expired = []
        with self._lock:
            while self._expiry and self._expiry[0][0] <= now:
                _, lid = heapq.heappop(self._expiry)
                lease = self._leases.pop(lid, None)
                if lease is not None:
                    expired.append(lease)
        for lease in expired:
            lease.owner.unpin(lease.slots)
        return len(expired)

    def count_for(self, owner) -> int:
        with self._lock:
            return sum(1 for lease in self._leases.values() if lease.owner is owner)
