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

check() states the table's invariants as code: at most max_leases live, each under a
lease id whose low bits are its board index (1..max_leases as built, held by one lease; the
others free, and the board showing each live id at its index, 0 elsewhere); each client's count,
every table's per-client slot entries and the slots held equal what its live leases hold,
within max_per_client, max_slots and (client_share below 1) all but the table's reserve; a
retried Plan's request id names its live lease, and only it; every live lease waits on the
expiry heap at its deadline; a lease's slots are unique and below its arena's capacity, and
each pinned at least once for each live lease that holds it (the engine unpins only after a
lease has ended).
"""
from __future__ import annotations

import heapq
import os
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from tierstore.cache.slot_table import PIN_MAX
from tierstore.errors import BrokenInvariant, InvalidArgument, ResourceExhausted
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
    expires: float         # deadline on the table's clock (time.monotonic)
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
    board lives (None: no board, tests only). clock: seconds, monotonic: what deadlines
    and contention are measured on (time.monotonic; a test's own clock steps through TTLs).
    """

    def __init__(self, max_leases: int, *, max_per_client: int | None = None, max_slots: int = 1 << 26,
                 client_share: float = 1.0, contention_s: float = 30.0, board_path: Path | None = None,
                 clock: Callable[[], float] = time.monotonic):
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
        self.clock = clock
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
        self._indexes = max_leases  # board indexes 1.._indexes, fixed here (tests lower max_leases later)
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
            lease = Lease(lease_id, engine, conn_id, slots, self.clock() + ttl_s, request_id)
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
                self._pressed.setdefault(engine, {})[conn_id] = self.clock()
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
        since = self.clock() - self.contention_s
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
        """End every lease past its deadline (at `now`, on the table's clock: now when None)."""
        now = self.clock() if now is None else now
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

    def check(self, pins: dict | None = None) -> None:
        """BrokenInvariant unless the table keeps the invariants of the module docstring.

        pins: {engine: its slot table's pin counts} to check the leases of those engines
        against; read as they are, so pass it only when no step of theirs is in flight (a
        test, or a debug run between steps). Takes the table's lock for O(live leases' slots),
        vectorised: a test's and a debug run's check, not one per plan."""
        with self._lock:
            self._check(pins or {})

    def _check(self, pins: dict) -> None:
        def broken(invariant: str, at: str, detail: str = ""):
            return BrokenInvariant("lease table", invariant, at, detail)

        leases = list(self._leases.values())
        n = len(leases)
        if n > self.max_leases:
            raise broken("at most max_leases leases are live", f"{n} leases", f"max_leases {self.max_leases}")
        ids = np.array([lease.lease_id for lease in leases], np.int64)
        bad = np.flatnonzero(np.fromiter(self._leases, np.int64, n) != ids)
        if bad.size:
            raise broken("a lease is filed under its own id", f"lease {ids[bad[0]]:#x}")
        index = ids & INDEX_MASK
        bad = np.flatnonzero((index < 1) | (index > self._indexes) | ((ids >> INDEX_BITS) == 0))
        if bad.size:
            raise broken("a lease id is random bits above a board index", f"lease {ids[bad[0]]:#x}")
        free = np.array(self._free_index, np.int64)
        held = np.bincount(np.concatenate([index, free]), minlength=self._indexes + 1)
        at = np.arange(held.size)
        bad = np.flatnonzero(held != ((at >= 1) & (at <= self._indexes)))
        if bad.size:
            i = int(bad[0])
            live, freed = int(np.count_nonzero(index == i)), int(np.count_nonzero(free == i))
            raise broken("each board index is held by one live lease or free, once", f"index {i}",
                         f"{live} live leases, free {freed} times")
        if self.board is not None:
            want = np.zeros(self.board.n, np.uint64)
            want[index] = ids.astype(np.uint64)
            bad = np.flatnonzero(self.board.ids != want)
            if bad.size:
                raise broken("the board shows each live lease id at its index, 0 elsewhere", f"index {bad[0]}",
                             f"the board holds {int(self.board.ids[bad[0]]):#x}, the lease {int(want[bad[0]]):#x}")
        per_client: dict[bytes, int] = {}
        per_table: dict[tuple, int] = {}
        for lease in leases:
            per_client[lease.conn_id] = per_client.get(lease.conn_id, 0) + 1
            key = (lease.engine, lease.conn_id)
            per_table[key] = per_table.get(key, 0) + lease.slots.size
        for conn in per_client.keys() | self._per_client.keys():
            if per_client.get(conn) != self._per_client.get(conn):
                raise broken("each client's lease count is its live leases", f"client {conn!r}",
                             f"counted {self._per_client.get(conn)}, it holds {per_client.get(conn)}")
            if per_client[conn] > self.max_per_client:
                raise broken("a client holds at most max_per_client leases", f"client {conn!r}",
                             f"{per_client[conn]} leases, max_per_client {self.max_per_client}")
        counted = {(engine, conn): k for engine, of_table in self._table_slots.items() for conn, k in of_table.items()}
        for engine, conn in per_table.keys() | counted.keys():
            k = per_table.get((engine, conn))
            if k != counted.get((engine, conn)):
                raise broken("each table's per-client slot entries are its live leases'",
                             f"table {engine.table!r}, client {conn!r}",
                             f"counted {counted.get((engine, conn))}, its leases hold {k}")
            cap = engine.capacity
            alone = max(max(1, int(cap * self.client_share)), cap - cap // RESERVE)
            if cap and self.client_share < 1.0 and k > alone:
                raise broken("a client's leases of a table hold at most all but its reserve",
                             f"table {engine.table!r}, client {conn!r}", f"{k} of {cap} slots, at most {alone}")
        sizes = np.array([lease.slots.size for lease in leases], np.int64)
        if int(sizes.sum()) != self._slots_held or self._slots_held > self.max_slots:
            raise broken("the slots held are the live leases' and at most max_slots", f"{self._slots_held} slots held",
                         f"the leases hold {int(sizes.sum())}, max_slots {self.max_slots}")
        asked = {(lease.conn_id, lease.request_id): lease.lease_id for lease in leases if lease.request_id}
        for key in asked.keys() | self._by_request.keys():
            named, live = self._by_request.get(key, 0), asked.get(key, 0)
            if named != live:
                raise broken("a retried Plan's request id names its client's live lease",
                             f"client {key[0]!r}, request {key[1]}",
                             f"names lease {named:#x}, the live one is {live:#x}")
        self._check_expiry(leases, broken)
        self._check_slots(leases, sizes, pins, broken)

    def _check_expiry(self, leases: list, broken) -> None:
        """(lock held) The expiry heap is a heap, holding every live lease at its deadline."""
        due = np.array([e for e, _ in self._expiry], np.float64)
        lid = np.array([i for _, i in self._expiry], np.int64)
        k = np.arange(1, due.size)
        up = (k - 1) // 2
        bad = np.flatnonzero((due[k] < due[up]) | ((due[k] == due[up]) & (lid[k] < lid[up])))
        if bad.size:
            raise broken("the expiry heap is a heap", f"entry {k[bad[0]]}", f"{self._expiry[k[bad[0]]]} under "
                         f"{self._expiry[up[bad[0]]]}")
        waiting = set(self._expiry)
        for lease in leases:
            if (lease.expires, lease.lease_id) not in waiting:
                raise broken("every live lease waits on the expiry heap at its deadline", f"lease {lease.lease_id:#x}",
                             f"deadline {lease.expires}")

    @staticmethod
    def _check_slots(leases: list, sizes: np.ndarray, pins: dict, broken) -> None:
        """(lock held) Each lease's slots unique and below capacity; each pinned for every lease holding it."""
        if not leases:
            return
        slots = np.concatenate([lease.slots.astype(np.int64, copy=False) for lease in leases])
        of = np.repeat(np.arange(len(leases)), sizes)
        cap = np.array([lease.engine.capacity for lease in leases], np.int64)
        bad = np.flatnonzero((slots < 0) | (slots >= cap[of]))
        if bad.size:
            lease = leases[of[bad[0]]]
            raise broken("a lease's slots are below its arena's capacity", f"lease {lease.lease_id:#x}",
                         f"slot {slots[bad[0]]}, capacity {lease.engine.capacity}")
        key = np.sort(of * int(cap.max()) + slots)  # (lease, slot), one sort
        bad = np.flatnonzero(key[1:] == key[:-1])
        if bad.size:
            i, s = divmod(int(key[bad[0]]), int(cap.max()))
            raise broken("a lease's slots are unique", f"lease {leases[i].lease_id:#x}", f"slot {s} twice")
        for engine, counts in pins.items():
            mine = np.isin(of, [i for i, lease in enumerate(leases) if lease.engine is engine])
            need = np.bincount(slots[mine], minlength=counts.shape[0])
            bad = np.flatnonzero(need > counts)
            if bad.size:
                raise broken("each slot a lease holds is pinned once for every live lease holding it",
                             f"slot {bad[0]} of table {engine.table!r}",
                             f"{need[bad[0]]} live leases hold it, {counts[bad[0]]} pins")

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
