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
the client that took them (its conn_id): Release by anyone else is ignored.

Fairness: no client (a step-socket connection) can refuse another's steps from
within its own bounds. A client holds at most max_per_client leases; a lease
pins each of its slots once, so a client counts at most max_per_client pins on
any row. A client's leases of one table hold at most client_share of that
table's arena slots while the table is *contended*: another live client holds
leases of it, or within the last contention_s planned a step that reached into
its reserve (the table's pinned slots and the step over all but 1/RESERVE of
its slots, refused or not). Otherwise a client's leases may hold all but the
reserve, kept for the next client: a sole client's large steps are served, and
a newcomer's first steps find the reserve free. Both bounds are checked once per
plan, from per-table counts, never per id. All leases together stay under
MAX_LEASES, PIN_HEADROOM below what a slot's pin count holds (slot_table.PIN_MAX):
no set of leases can saturate a row, however many clients share it. Where
clients are bounded (max_per_client below max_leases; client_share below 1),
the last 1/RESERVE of the sidecar's leases, and of each table's slots, go only
to clients holding less than their fair share (what is left before the
reserve, over the clients holding some; of leases, at most max_per_client /
RESERVE): a client that took more is refused there (ResourceExhausted, saying
so), and a client below its share is refused only when the reserve too is spent.
"""
from __future__ import annotations

import heapq
import os
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from tierstore.cache.slot_table import PIN_MAX
from tierstore.errors import InvalidArgument, ResourceExhausted
from tierstore.tiers.shm_file import create_shm_file

__all__ = ["Lease", "LeaseBoard", "LeaseTable", "LeasedEngine", "INDEX_BITS", "INDEX_MASK", "MAX_LEASES", "RESERVE",
           "requested_ttl", "sole_client_slots", "arena_for_step"]

INDEX_BITS = 24
INDEX_MASK = (1 << INDEX_BITS) - 1
# pins a slot may count beyond its leases: its fill's and those of inline lookups in flight
# (one per gRPC worker of the unix and TCP servers: 2 x sidecar.config.MAX_WORKERS at most)
PIN_HEADROOM = 4095
MAX_LEASES = PIN_MAX - PIN_HEADROOM  # live leases in all, at most: a row's pins never saturate
RESERVE = 8  # the last 1/RESERVE of the leases, and of a table's slots, is kept for clients under their fair share
_RANDOM_BATCH = 512  # lease ids' random bits drawn at once: one getrandom call per 512 leases, not per lease


def sole_client_slots(capacity: int, client_share: float) -> int:
    """The most of a table's `capacity` arena slots one client's leases may hold while no other
    client contends the table: all but the last 1/RESERVE, kept for the next client, or
    client_share of them where that is more; every slot at client_share 1 (no bound)."""
    if client_share >= 1.0:
        return capacity
    return max(max(1, int(capacity * client_share)), capacity - capacity // RESERVE)


def arena_for_step(slots: int) -> int:
    """Arena slots of which a client with the table to itself may lease a step of `slots`
    distinct slots, whatever the client share (sole_client_slots of it is at least `slots`):
    a cache-mode arena sized for the largest step its one client plans."""
    return slots + -(-slots // (RESERVE - 1))


class LeasedEngine(Protocol):
    """What a lease needs of the table engine whose pins hold its slots
    (CacheEngine, tierstore/engine/cache.py; TableEngine declares table and capacity)."""

    table: str       # the table's name, in refusals
    capacity: int    # the arena's slots: every slot a lease holds is below it

    def unpin(self, slots: np.ndarray) -> None:
        """Drop one pin of each slot (the lease's end); slots were pinned when it was added."""


@dataclass(slots=True)
class Lease:
    lease_id: int
    engine: LeasedEngine   # whose pins hold these slots
    conn_id: bytes         # the client that took it (its connection's id): only it may release it
    slots: np.ndarray      # unique slots (int32 when the arena allows: half the memory)
    expires: float         # time.monotonic() deadline
    request_id: int = 0


class LeaseBoard:
    """uint64 [n] in a 0600 shm file: entry i holds the live lease id with index i, or 0."""

    def __init__(self, path: Path, n: int):
        self.path, self.n = Path(path), int(n)
        self._mmap = create_shm_file(self.path, 8 * self.n, "the lease board")
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

    max_leases: live leases in all (1..MAX_LEASES). max_per_client: live leases of one
    client (None: max_leases). max_slots: slot entries held by all leases together
    (bounds their memory). client_share: the fraction of a table's arena slots
    (engine.capacity) one client's live leases of it may hold while the table is
    contended, in (0, 1]; alone, at most all but the table's reserve (or client_share,
    if more); 1: no per-client slot bound at all. A slot in two of a client's leases
    counts twice. contention_s: how long a client's plan into a table's reserve makes
    the table contended for the others (the sidecar passes --lease-ttl); a closed
    client's plans stop counting at once (release_client). board_path: where the lease
    board lives (None: no board, tests only).
    """

    def __init__(self, max_leases: int, *, max_per_client: int | None = None, max_slots: int = 1 << 26,
                 client_share: float = 1.0, contention_s: float = 30.0, board_path: Path | None = None):
        if isinstance(max_leases, bool) or not 1 <= max_leases <= MAX_LEASES:
            raise InvalidArgument(f"max_leases must be in 1..{MAX_LEASES}, got {max_leases}")
        max_per_client = max_leases if max_per_client is None else max_per_client
        if isinstance(max_per_client, bool) or not 1 <= max_per_client <= MAX_LEASES:
            raise InvalidArgument(f"max_per_client must be in 1..{MAX_LEASES}, got {max_per_client}")
        if not 0.0 < client_share <= 1.0:  # also refuses nan
            raise InvalidArgument(f"client_share must be a fraction in (0, 1], got {client_share}")
        if not contention_s >= 0.0:  # also refuses nan
            raise InvalidArgument(f"contention_s must be seconds >= 0, got {contention_s}")
        self.max_leases = max_leases
        self.max_per_client = max_per_client
        self.max_slots = max_slots
        self.client_share = client_share
        self.contention_s = contention_s
        self._leases: dict[int, Lease] = {}
        self._expiry: list[tuple[float, int]] = []
        self._per_client: dict[bytes, int] = {}
        self._table_slots: dict[LeasedEngine, dict[bytes, int]] = {}  # engine -> conn_id -> slot entries held
        self._by_request: dict[tuple[bytes, int], int] = {}
        # engine -> conn_id -> when it last planned a step into that table's reserve; weak: a retired
        # engine's entry goes with it
        self._pressed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._slots_held = 0
        self._free_index = list(range(max_leases, 0, -1))  # index 0 is never used: lease id 0 means "none"
        self.board = LeaseBoard(board_path, max_leases + 1) if board_path is not None else None
        self._lock = threading.Lock()
        self._random: list[int] = []

    def __len__(self) -> int:
        return len(self._leases)

    def add(self, engine: LeasedEngine, slots: np.ndarray, ttl_s: float, conn_id: bytes = b"",
            request_id: int = 0) -> Lease:
        """Record a lease whose slots the engine has already pinned.

        A request id seen before from the same client (a retried Plan) ends the
        lease the first attempt took, so a retry never leaves an extra lease.
        Every limit is checked before anything changes (the retried lease counted
        as ended): a refusal (ResourceExhausted) leaves the table exactly as it was,
        the first attempt's lease live, and the caller unpins the slots it passed."""
        if slots.size and (engine.capacity <= 2**31 or int(slots.max()) < 2**31):  # slots index the arena
            slots = slots.astype(np.int32)
        with self._lock:
            retried = self._leases.get(self._by_request.get((conn_id, request_id), 0)) if request_id else None
            refused = self._refusal(engine, conn_id, slots.size, retried)
            if refused is not None:
                raise refused
            freed = retried is not None
            n_client = self._per_client.get(conn_id, 0) - freed
            if not self._random:  # os.urandom, as secrets uses: unguessable, only drawn in batches
                self._random = (np.frombuffer(os.urandom(8 * _RANDOM_BATCH), "<u8") >> (INDEX_BITS + 1)).tolist()
            # nothing below raises: the first attempt ends and the new lease starts together
            if freed:
                self._end(retried)
            index = self._free_index.pop()
            lease_id = (self._random.pop() or 1) << INDEX_BITS | index
            lease = Lease(lease_id, engine, conn_id, slots, time.monotonic() + ttl_s, request_id)
            self._leases[lease_id] = lease
            self._per_client[conn_id] = n_client + 1
            self._slots_held += slots.size
            of_table = self._table_slots.setdefault(engine, {})
            of_table[conn_id] = of_table.get(conn_id, 0) + slots.size
            if request_id:
                self._by_request[(conn_id, request_id)] = lease_id
            heapq.heappush(self._expiry, (lease.expires, lease_id))
            if self.board is not None:
                self.board.ids[index] = lease_id
        if retried is not None:
            retried.engine.unpin(retried.slots)
        return lease

    def admit(self, engine: LeasedEngine, conn_id: bytes, n_slots: int, pinned: int, request_id: int = 0) -> None:
        """Before a plan of `n_slots` unique slots reserves any (no row is read or evicted for a
        lease add would refuse): once `pinned` (the table's pinned slots) and the step fill all
        but the table's reserve (1/RESERVE of engine.capacity), records that `conn_id` wants
        the reserve (the table is contended for the others, whether this plan is refused or
        not); then raises the refusal add would give, or, past the reserve line, the
        fair-share refusal for a client holding its share of the rest."""
        capacity = engine.capacity
        calm = capacity - capacity // RESERVE
        pressing = bool(capacity) and self.client_share < 1.0 and pinned + n_slots > calm
        with self._lock:
            if pressing:
                self._pressed.setdefault(engine, {})[conn_id] = time.monotonic()
            retried = self._leases.get(self._by_request.get((conn_id, request_id), 0)) if request_id else None
            refused = self._refusal(engine, conn_id, n_slots, retried)
            if refused is not None:
                raise refused
            if not pressing:
                return
            of_table = self._table_slots.get(engine, {})
            mine = of_table.get(conn_id, 0) - (retried.slots.size if retried is not None and retried.engine is engine
                                              else 0)
            fair = calm // (len(of_table) + (conn_id not in of_table))
            if mine + n_slots > fair:
                raise ResourceExhausted(
                    f"table {engine.table!r}: {pinned} of the arena's {capacity} slots are leased; "
                    f"its last {capacity // RESERVE} go to clients under their fair share ({fair} slots each), "
                    f"and this client's leases would hold {mine + n_slots}: release finished steps, or plan "
                    "smaller ones")

    def _refusal(self, engine: LeasedEngine, conn_id: bytes, n_slots: int,
                 retried: Lease | None) -> ResourceExhausted | None:
        """(lock held) Why a lease of `n_slots` slots for `conn_id` is refused, or None; the lease a
        retried Plan ends (`retried`) counts as ended."""
        freed = retried is not None  # what ending the first attempt would give back
        n_leases = len(self._leases) - freed
        n_client = self._per_client.get(conn_id, 0) - freed
        held = self._slots_held - (retried.slots.size if freed else 0)
        if n_leases >= self.max_leases:
            return ResourceExhausted(
                f"{n_leases} leases are live (limit {self.max_leases}); release steps when they end")
        if n_client >= self.max_per_client:
            return ResourceExhausted(
                f"this client holds {n_client} live leases (limit {self.max_per_client} per client); "
                "release finished steps")
        calm = self.max_leases - self.max_leases // RESERVE
        if n_leases >= calm and self.max_per_client < self.max_leases:
            # a latecomer of a greedy group is under the average: the reserve's share is small too
            fair = min(calm // (len(self._per_client) + (conn_id not in self._per_client)),
                       max(1, self.max_per_client // RESERVE))
            if n_client >= fair:
                return ResourceExhausted(
                    f"{n_leases} leases are live (limit {self.max_leases}); the last {self.max_leases - calm} go "
                    f"to clients under their fair share ({fair} each) and this client holds {n_client}: "
                    "release finished steps")
        if held + n_slots > self.max_slots:
            return ResourceExhausted(
                f"live leases hold {held} slots (limit {self.max_slots}); release finished steps")
        capacity = engine.capacity
        if capacity and self.client_share < 1.0:
            share = max(1, int(capacity * self.client_share))
            of_table = self._table_slots.get(engine, {})
            mine = of_table.get(conn_id, 0)
            if freed and retried.engine is engine:
                mine -= retried.slots.size
            alone = sole_client_slots(capacity, self.client_share)
            wanted = mine + n_slots
            if wanted > share and self._contended(engine, conn_id, of_table):
                return ResourceExhausted(
                    f"table {engine.table!r}: this client's leases would hold {wanted} of the "
                    f"arena's {capacity} slots, over one client's share ({share}: --max-client-share "
                    f"{self.client_share:g}) while another client leases this table or wants its reserve; plan "
                    "smaller steps, release finished ones, or raise --max-client-share")
            if wanted > alone:
                return ResourceExhausted(
                    f"table {engine.table!r}: this client's leases would hold {wanted} of the "
                    f"arena's {capacity} slots; a client with the table to itself may lease {alone}, the last "
                    f"{capacity - alone} are kept for the next client (--max-client-share 1 lifts the bound); "
                    "plan smaller steps or release finished ones")
        return None

    def _contended(self, engine: LeasedEngine, conn_id: bytes, of_table: dict) -> bool:
        """(lock held) Whether another live client holds leases of engine's table or planned a step
        into its reserve within the last contention_s: a loop over the table's clients, once per
        plan past the client's share."""
        if len(of_table) > (conn_id in of_table):
            return True
        since = time.monotonic() - self.contention_s
        return any(when >= since for other, when in self._pressed.get(engine, {}).items() if other != conn_id)

    def _end(self, lease: Lease) -> None:
        """Forget a lease (lock held); the caller unpins its slots afterwards."""
        del self._leases[lease.lease_id]
        if self.board is not None:
            self.board.ids[lease.lease_id & INDEX_MASK] = 0  # before the unpin: clients see it first
        self._free_index.append(lease.lease_id & INDEX_MASK)
        left = self._per_client[lease.conn_id] - 1
        if left:
            self._per_client[lease.conn_id] = left
        else:
            del self._per_client[lease.conn_id]
        self._slots_held -= lease.slots.size
        of_table = self._table_slots[lease.engine]
        left = of_table[lease.conn_id] - lease.slots.size
        if left:
            of_table[lease.conn_id] = left
        else:
            del of_table[lease.conn_id]
            if not of_table:
                del self._table_slots[lease.engine]
        if lease.request_id:
            self._by_request.pop((lease.conn_id, lease.request_id), None)

    def alive(self, lease_id: int) -> bool:
        with self._lock:
            return lease_id in self._leases

    def release(self, lease_ids, conn_id: bytes = b"") -> int:
        """End this client's leases (unknown, ended or foreign ids are ignored); how many ended."""
        lease_ids = [int(i) for i in lease_ids]  # a bad id raises here, before any lease has ended
        ended = []
        with self._lock:
            for i in lease_ids:
                lease = self._leases.get(i)
                if lease is not None and lease.conn_id == conn_id:
                    self._end(lease)
                    ended.append(lease)
        for lease in ended:
            lease.engine.unpin(lease.slots)
        return len(ended)

    def release_client(self, conn_id: bytes) -> int:
        """End every lease of a client (its connection closed); its plans no longer contend any table."""
        with self._lock:
            ids = [i for i, lease in self._leases.items() if lease.conn_id == conn_id]
            for pressed in list(self._pressed.values()):
                pressed.pop(conn_id, None)
        return self.release(ids, conn_id)

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
            lease.engine.unpin(lease.slots)
        return len(expired)

    def count_for(self, engine: LeasedEngine) -> int:
        with self._lock:
            return sum(1 for lease in self._leases.values() if lease.engine is engine)

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
