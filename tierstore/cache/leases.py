"""Leases: the slots a step will read are pinned until it releases them.

A lease holds the unique slots of one Plan. `pins[slot] > 0` means no policy
may evict that slot. Leases end on Release or after their TTL, so a client
that dies mid-step leaks nothing.

Every live lease is also written to a shared-memory *lease board* that clients
map read-only: entry `lease_id & INDEX_MASK` holds the lease id while the lease
lives, and is cleared *before* its slots are unpinned. A client that finds its
lease id still on the board after gathering knows every row it read was its
own (x86 keeps stores, and loads, in order). A stalled step whose lease ended
gets a clear error or a re-plan, never another step's rows.

Lease ids are unguessable (40 random bits above the board index) and belong to
the owner that took them: Release by anyone else is ignored.
"""
from __future__ import annotations

import heapq
import mmap
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tierstore.errors import InvalidArgument, ResourceExhausted

__all__ = ["Lease", "LeaseBoard", "LeaseTable", "INDEX_BITS", "INDEX_MASK", "requested_ttl"]

INDEX_BITS = 24
INDEX_MASK = (1 << INDEX_BITS) - 1
_RANDOM_BATCH = 512  # lease ids' random bits drawn at once: one getrandom call per 512 leases, not per lease


@dataclass(slots=True)
class Lease:
    lease_id: int
    owner: object          # the TableEngine whose pins hold these slots
    client: bytes          # who took it: only they may release it
    slots: np.ndarray      # unique slots (int32 when the arena allows: half the memory)
    expires: float         # time.monotonic() deadline
    request_id: int = 0


class LeaseBoard:
    """uint64 [n] in a 0600 shm file: entry i holds the live lease id with index i, or 0."""

    def __init__(self, path: Path, n: int):
        self.path, self.n = Path(path), int(n)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.posix_fallocate(fd, 0, 8 * self.n)
            self._mmap = mmap.mmap(fd, 8 * self.n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        os.close(fd)
        self.ids = np.frombuffer(self._mmap, dtype="<u8")

    def close(self) -> None:
        self.ids = None
        try:
            self._mmap.close()
        except BufferError:
            pass
        self.path.unlink(missing_ok=True)


class LeaseTable:
    """All live leases of one sidecar (thread-safe).

    max_leases: live leases in all. max_per_client: live leases of one client.
    max_slots: slot entries held by all leases together (bounds their memory).
    board_path: where the lease board lives (None: no board, tests only).
    """

    def __init__(self, max_leases: int, *, max_per_client: int | None = None, max_slots: int = 1 << 26,
                 board_path: Path | None = None):
        if not 1 <= max_leases <= INDEX_MASK:
            raise InvalidArgument(f"max_leases must be in 1..{INDEX_MASK}, got {max_leases}")
        self.max_leases = max_leases
        self.max_per_client = max_per_client or max_leases
        self.max_slots = max_slots
        self._leases: dict[int, Lease] = {}
        self._expiry: list[tuple[float, int]] = []
        self._per_client: dict[bytes, int] = {}
        self._by_request: dict[tuple[bytes, int], int] = {}
        self._slots_held = 0
        self._free_index = list(range(max_leases, 0, -1))  # index 0 is never used: lease id 0 means "none"
        self.board = LeaseBoard(board_path, max_leases + 1) if board_path is not None else None
        self._lock = threading.Lock()
        self._random: list[int] = []

    def __len__(self) -> int:
        return len(self._leases)

    def add(self, owner, slots: np.ndarray, ttl_s: float, client: bytes = b"", request_id: int = 0) -> Lease:
        """Record a lease whose slots the owner has already pinned.

        A request id seen before from the same client (a retried Plan) ends the
        lease the first attempt took, so a retry never leaves an extra lease.
        Every limit is checked before anything changes (the retried lease counted
        as ended): a refusal (ResourceExhausted) leaves the table exactly as it was,
        the first attempt's lease live, and the caller unpins the slots it passed."""
        arena = getattr(getattr(owner, "arena", None), "slots", None)  # slots index it: a bound without a max()
        if slots.size and ((arena is not None and arena <= 2**31) or int(slots.max()) < 2**31):
            slots = slots.astype(np.int32)
        retried = None
        with self._lock:
            if request_id:
                retried = self._leases.get(self._by_request.get((client, request_id), 0))
            freed = retried is not None  # what ending the first attempt would give back
            n_leases = len(self._leases) - freed
            n_client = self._per_client.get(client, 0) - freed
            held = self._slots_held - (retried.slots.size if freed else 0)
            if n_leases >= self.max_leases:
                raise ResourceExhausted(
                    f"{n_leases} leases are live (limit {self.max_leases}); release steps when they end")
            if n_client >= self.max_per_client:
                raise ResourceExhausted(
                    f"this client holds {n_client} live leases (limit {self.max_per_client} per client); "
                    "release finished steps")
            if held + slots.size > self.max_slots:
                raise ResourceExhausted(
                    f"live leases hold {held} slots (limit {self.max_slots}); release finished steps")
            if not self._random:  # os.urandom, as secrets uses: unguessable, only drawn in batches
                self._random = (np.frombuffer(os.urandom(8 * _RANDOM_BATCH), "<u8") >> (INDEX_BITS + 1)).tolist()
            # nothing below raises: the first attempt ends and the new lease starts together
            if freed:
                self._end(retried)
            index = self._free_index.pop()
            lease_id = (self._random.pop() or 1) << INDEX_BITS | index
            lease = Lease(lease_id, owner, client, slots, time.monotonic() + ttl_s, request_id)
            self._leases[lease_id] = lease
            self._per_client[client] = n_client + 1
            self._slots_held += slots.size
            if request_id:
                self._by_request[(client, request_id)] = lease_id
            heapq.heappush(self._expiry, (lease.expires, lease_id))
            if self.board is not None:
                self.board.ids[index] = lease_id
        if retried is not None:
            retried.owner.unpin(retried.slots)
        return lease

    def _end(self, lease: Lease) -> None:
        """Forget a lease (lock held); the caller unpins its slots afterwards."""
        del self._leases[lease.lease_id]
        if self.board is not None:
            self.board.ids[lease.lease_id & INDEX_MASK] = 0  # before the unpin: clients see it first
        self._free_index.append(lease.lease_id & INDEX_MASK)
        left = self._per_client[lease.client] - 1
        if left:
            self._per_client[lease.client] = left
        else:
            del self._per_client[lease.client]
        self._slots_held -= lease.slots.size
        if lease.request_id:
            self._by_request.pop((lease.client, lease.request_id), None)

    def alive(self, lease_id: int) -> bool:
        with self._lock:
            return lease_id in self._leases

    def release(self, lease_ids, client: bytes = b"") -> int:
        """End this client's leases (unknown, ended or foreign ids are ignored); how many ended."""
        lease_ids = [int(i) for i in lease_ids]  # a bad id raises here, before any lease has ended
        ended = []
        with self._lock:
            for i in lease_ids:
                lease = self._leases.get(i)
                if lease is not None and lease.client == client:
                    self._end(lease)
                    ended.append(lease)
        for lease in ended:
            lease.owner.unpin(lease.slots)
        return len(ended)

    def release_client(self, client: bytes) -> int:
        """End every lease of a client (its connection closed)."""
        with self._lock:
            ids = [i for i, lease in self._leases.items() if lease.client == client]
        return self.release(ids, client)

    def reap(self, now: float | None = None) -> int:
        """End every lease past its deadline."""
        now = time.monotonic() if now is None else now
        expired = []
        with self._lock:
            while self._expiry and self._expiry[0][0] <= now:
                _, lid = heapq.heappop(self._expiry)
                lease = self._leases.get(lid)
                if lease is not None and lease.expires <= now:
                    self._end(lease)
                    expired.append(lease)
        for lease in expired:
            lease.owner.unpin(lease.slots)
        return len(expired)

    def count_for(self, owner) -> int:
        with self._lock:
            return sum(1 for lease in self._leases.values() if lease.owner is owner)

    def close(self) -> None:
        if self.board is not None:
            self.board.close()


def requested_ttl(default_s: float, ttl_ms: int) -> float:
    """A Plan's lease TTL: the default, or the client's, never over 10 x --lease-ttl (refused, not
    capped: the client would trust its own TTL)."""
    if not ttl_ms:
        return default_s
    ttl = ttl_ms / 1000.0
    if ttl > default_s * 10:
        raise InvalidArgument(f"ttl_ms {ttl_ms} is over this sidecar's longest lease "
                              f"({default_s * 10:g} s = 10 x --lease-ttl)")
    return ttl
