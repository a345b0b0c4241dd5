"""The slot table of a cache-mode arena: which row each slot holds, who pins it,
whether its bytes are ready. One table, shared with the cache policy.

Every operation costs O(slots it is given), never O(arena): at V4.1 scale an
arena has 10^8 slots, and one pass over them would cost more than many steps.

States, read from `id_of` and `gen` (nothing stored for them): EMPTY (id_of < 0:
on the free stack, or taken off it and not assigned yet), FILLING (a row id,
gen odd: reserved for a row being read from the cold tier; pinned by its fill,
so it cannot be evicted half-written), READY (a row id, gen even). A READY row of
a cold block online verification found bad keeps gen odd and so reads as
FILLING: no fill in flight holds it, so a step that meets it waits for nothing,
and nothing reads it as READY again (warm start, the verifier). Callers hold
the engine's lock (a rewrite in place, begin_write..end_write, is bracketed
inside it, so none sees a rewritten row as FILLING).

Memory is O(slots), nothing per row: the id -> slot map is a hash table of
slots keyed by `id_of` (slot_map.py), and the free stack is threaded through
`id_of` itself: a slot on it holds -2 - (the next free slot, -1 at the
bottom), so every slot not holding a row reads negative (not resident) there.
A FILLING slot's fill is found by the engine among the fills in flight, not
stored per slot. Pins are two bytes a slot: a slot counts at most PIN_MAX pins
(live leases and its fill), and a step that would pin one more is refused
(PinsSaturated, a ResourceExhausted: a lease refusal, nothing changed), never
wrapped round to unpinned. Not one byte: one client within its lease quota
(max_leases_per_client, 1024) could then hold 255 leases on a hot row and have
every other client's steps over it refused. At two bytes leases never saturate a
slot: all live leases together stay under leases.MAX_LEASES, PIN_HEADROOM below
PIN_MAX (the headroom covers a fill's pin and inline lookups'), and the lease
table refuses the client over its fair share first (tierstore/cache/leases.py).

`gen`, `id_of` and the map may live in a shared slot index (slot_index.py)
that clients on the host read without a lock: `gen[s]` is a sequence lock, odd
while slot s is empty or being written, even while it holds a READY row
(odd too for a row of a cold block online verification found bad: never
served again, from the arena or the disk).
unmap() makes it odd before the slot's id or bytes change; ready() makes it
even once the new row is in place; begin_write()/end_write() bracket a
rewrite of a READY row in place.

check() states these invariants as code: the index's (slot_index.check_slots: an EMPTY slot's
gen odd, one slot per id, the map finds every row held); the free stack a chain of exactly
n_free slots from its top to its bottom, through every slot that threads it; an EMPTY slot off
it only while a caller has claimed it (taken or unmapped, not yet assigned or put back: none
lost); n_pinned the slots with pins; a fill's slots FILLING with its ids and pinned, in one
fill each. Pins on an EMPTY slot are allowed: a failed fill's slots go back on the free stack
while the steps that wanted them (its own and its waiters) still hold their pins, until each
releases them in the same call; a pin only ever over-protects a slot.
"""
from __future__ import annotations

import threading

import numpy as np

from tierstore.cache import prefault
from tierstore.errors import BrokenInvariant, ResourceExhausted
from tierstore.jit import Kernel
from tierstore.cache.slot_index import SlotIndexFile, check_slots, id_dtype
from tierstore.cache.slot_map import SlotMap

__all__ = ["SlotTable", "Fill", "PinsSaturated", "PINS", "PIN_MAX"]

PINS = np.uint16  # a slot's pin count
PIN_MAX = int(np.iinfo(PINS).max)


class PinsSaturated(ResourceExhausted):
    """A slot would count more than PIN_MAX pins: the step is refused, nothing pinned."""

    def __init__(self):
        super().__init__(f"a row this step reads is pinned by {PIN_MAX} live leases, the most a slot counts; "
                         "release finished steps (their leases) and plan again")


class Fill:
    """One batch of rows being read into reserved slots; other steps that need
    these rows wait on it (outside the engine lock).

    Most fills are waited on by nobody, so the Event is made only for a waiter:
    `waiter()` runs under the engine lock while the fill is still registered,
    before its filler unregisters it (also under the lock) and calls `finish()`."""

    __slots__ = ("fill_id", "ids", "slots", "done", "error")

    def __init__(self, fill_id: int, ids: np.ndarray, slots: np.ndarray):
        self.fill_id, self.ids, self.slots = fill_id, ids, slots
        self.done: threading.Event | None = None
        self.error: BaseException | None = None

    def waiter(self) -> "Fill":
        if self.done is None:
            self.done = threading.Event()
        return self

    def wait(self) -> None:
        self.done.wait()

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        if self.done is not None:
            self.done.set()


class SlotTable:
    """id <-> slot maps, pin counts and fill state of `capacity` slots over `rows` ids."""

    def __init__(self, capacity: int, rows: int, index: SlotIndexFile | None = None):
        """index: the shared slot index to keep gen, id_of and the map in (local reads); private when None."""
        self.capacity, self.rows = int(capacity), int(rows)
        self.index = index
        if index is not None:
            self.gen, self.id_of, table = index.gen, index.id_of, index.table
        else:
            self.id_of = np.full(self.capacity, -1, dtype=id_dtype(self.rows))  # = policy.slot_id
            self.gen = np.ones(self.capacity, dtype=np.uint32)
            table = SlotMap.empty_table(self.capacity)
        self.map = SlotMap(table, self.id_of, self.capacity)
        self.pins = prefault.zeros(self.capacity, PINS)
        # the free stack, threaded through id_of: popped from slot 0 up at first
        self.id_of[:] = -2 - np.arange(1, self.capacity + 1, dtype=self.id_of.dtype)
        self.id_of[-1] = -1
        self._free_top = 0  # the slot on top of the free stack (-1: none free)
        self.n_free = self.capacity
        self.n_pinned = 0  # slots with pins > 0, kept incrementally for stats

    @property
    def held_bytes(self) -> int:
        """Bytes of the map, ids, gen and pins (the shared index's included)."""
        return sum(a.nbytes for a in (self.map.table, self.id_of, self.gen, self.pins))

    @property
    def resident(self) -> int:
        return self.capacity - self.n_free

    def find(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id (int64; -1: not resident). Lock held: exact. (Finding gives
        slots; a lookup, in this code, gives rows.)"""
        return self.map.find(ids)

    def find_pin(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """The slot of each id (-1: not resident), the resident ones pinned once.

        ids: unique. Returns (slots int64, hit slots, how many of them may be FILLING: see
        is_filling). PinsSaturated if a hit slot counts PIN_MAX pins already (none pinned)."""
        slots = self.map.find(ids)
        k = _FIND_PIN.compiled()
        if k is not None:
            n_hit, newly, filling = k(slots, self.pins, self.gen, PIN_MAX)
            if n_hit < 0:
                raise PinsSaturated()
            self.n_pinned += newly
            return slots, slots[slots >= 0] if n_hit < ids.size else slots, filling
        hit = slots[slots >= 0]
        self.pin(hit)
        return slots, hit, int(np.count_nonzero(self.gen[hit] & 1))

    def pin(self, slots: np.ndarray, times: int = 1) -> None:
        """slots: unique. PinsSaturated if one would count more than PIN_MAX (none pinned)."""
        k = _PIN.compiled()
        if k is not None:
            delta = k(self.pins, slots, times, PIN_MAX)
            if delta > slots.shape[0]:
                raise PinsSaturated()
            self.n_pinned += delta
            return
        before = self.pins[slots].astype(np.int64)
        if before.size and int(before.max()) + times > PIN_MAX:
            raise PinsSaturated()
        self.n_pinned += int(np.count_nonzero(before == 0))
        self.pins[slots] = before + times

    def unpin(self, slots: np.ndarray) -> None:
        k = _PIN.compiled()
        if k is not None:
            self.n_pinned += k(self.pins, slots, -1, PIN_MAX)
            return
        after = self.pins[slots] - 1
        self.pins[slots] = after
        self.n_pinned -= int(np.count_nonzero(after == 0))

    def is_filling(self, slots) -> np.ndarray:
        """Which of `slots` (an index or a slice) hold a row that may still be FILLING: a row id,
        gen odd (a READY row of a bad block too: no fill in flight holds it)."""
        return (self.id_of[slots] >= 0) & ((self.gen[slots] & 1) == 1)

    def is_ready(self, slots) -> np.ndarray:
        """Which of `slots` (an index or a slice) hold a READY row: a row id, gen even."""
        return (self.id_of[slots] >= 0) & ((self.gen[slots] & 1) == 0)

    def take_free(self, k: int) -> np.ndarray:
        """Up to k slots off the free stack (EMPTY, id_of -1 once taken), in stack order."""
        take = min(k, self.n_free)
        got = np.empty(take, np.int64)
        self._free_top = (_TAKE.compiled() or _take_loop)(self.id_of, self._free_top, got)
        self.n_free -= take
        return got

    def put_free(self, slots: np.ndarray) -> None:
        """EMPTY slots (unmapped) back on the free stack."""
        self._free_top = (_PUT.compiled() or _put_loop)(self.id_of, self._free_top, np.asarray(slots, np.int64))
        self.n_free += slots.size

    def unmap(self, slots: np.ndarray) -> None:
        """Forget the rows `slots` hold (evicted, or a failed fill); they stay off the free stack.
        Their gen goes odd first (a local reader then rejects what it copies from them), then
        their map entries go, then their ids (-1)."""
        slots = np.asarray(slots, dtype=np.int64)
        self.gen[slots] |= np.uint32(1)
        held = self.id_of[slots].astype(np.int64)
        mapped = held >= 0
        self.map.delete(held[mapped], slots[mapped])
        self.id_of[slots] = -1

    def ready(self, slots: np.ndarray) -> None:
        """The rows of FILLING `slots` are written and verified: READY, gen even."""
        self.end_write(slots)

    def begin_write(self, slots: np.ndarray) -> None:
        """Before READY rows are rewritten in place (a repair): gen odd."""
        self.gen[slots] += np.uint32(1)

    def end_write(self, slots: np.ndarray) -> None:
        """After the rewrite (its own call, after begin_write returned): gen even again."""
        self.gen[slots] += np.uint32(1)

    def close(self) -> None:
        """Remove the shared index file, if any (clients mapping it keep their view)."""
        if self.index is not None:
            self.id_of = self.gen = self.map = None
            self.index.close()
            self.index = None

    def assign(self, slots: np.ndarray, ids: np.ndarray) -> None:
        """Map unmapped ids to EMPTY slots taken off the free stack or unmapped: FILLING (gen
        stays odd until ready). id_of first: the map's entries are confirmed by it."""
        self.id_of[slots] = ids
        self.map.insert(ids, slots)

    def check(self, fills=(), claimed=()) -> None:
        """BrokenInvariant unless the table keeps the invariants of the module docstring.

        fills: the fills in flight (Fill; the engine's, all of them or some). claimed: the EMPTY
        slots the caller holds off the free stack (taken, or unmapped, and not yet assigned or put
        back); any other EMPTY slot off the stack is lost. Call it with the engine's lock held
        (every writer holds it), between operations: O(capacity) vectorised, and one compiled
        walk of the free stack. Holding the lock that long, it is a test's and a debug run's
        check, not one per step."""
        if self.index is not None:
            self.index.check()
        else:
            check_slots("slot table", self.gen, self.id_of, self.map, self.rows)
        on_stack = self._check_free_stack()
        mine = np.zeros(self.capacity, bool)
        mine[np.asarray(claimed, np.int64)] = True
        lost = (self.id_of < 0) & ~on_stack
        bad = np.flatnonzero(lost & ~mine)
        if bad.size:
            raise BrokenInvariant("slot table", "an EMPTY slot off the free stack is claimed", f"slot {bad[0]}",
                                  "taken or unmapped, then neither assigned nor put back: lost")
        bad = np.flatnonzero(mine & ~lost)
        if bad.size:
            raise BrokenInvariant("slot table", "a claimed slot is EMPTY and off the free stack", f"slot {bad[0]}",
                                  f"id_of {self.id_of[bad[0]]}, on the free stack: {bool(on_stack[bad[0]])}")
        pinned = int(np.count_nonzero(self.pins))
        if pinned != self.n_pinned:
            raise BrokenInvariant("slot table", "n_pinned counts the slots with pins", f"n_pinned {self.n_pinned}",
                                  f"{pinned} slots have pins")
        fills = list(fills)
        if fills:
            self._check_fills(fills)

    def _check_free_stack(self) -> np.ndarray:
        """(check) The free stack is a chain of n_free slots from the top to the bottom, through
        every slot threading it (id_of <= -2); returns which slots are on it."""
        cap, id_of = self.capacity, self.id_of
        on_stack = np.zeros(cap, bool)
        walked, stop = (_STACK.compiled() or _stack_loop)(id_of, self._free_top, self.n_free, on_stack)
        if walked < self.n_free or stop != -1:
            at = f"slot {stop}" if 0 <= stop < cap else "the bottom" if stop == -1 else f"next {stop}"
            raise BrokenInvariant("slot table", "the free stack is a chain of n_free slots from its top to its bottom",
                                  at, f"{walked} slots down from the top {self._free_top}, n_free {self.n_free}")
        bad = np.flatnonzero((id_of <= -2) & ~on_stack)
        if bad.size:
            raise BrokenInvariant("slot table", "every slot threading the free stack is on it", f"slot {bad[0]}",
                                  f"it names slot {-2 - int(id_of[bad[0]])} next, the chain from the top passes it by")
        return on_stack

    def _check_fills(self, fills: list[Fill]) -> None:
        """(check) Each fill's slots FILLING with its ids and pinned, no slot in two fills."""
        slots = np.concatenate([np.asarray(f.slots, np.int64) for f in fills])
        ids = np.concatenate([np.asarray(f.ids, np.int64) for f in fills])
        of = np.repeat(np.arange(len(fills)), [np.size(f.slots) for f in fills])
        bad = np.flatnonzero(np.bincount(slots, minlength=self.capacity) > 1)
        if bad.size:
            raise BrokenInvariant("slot table", "a slot is in one fill at most", f"slot {bad[0]}",
                                  f"fills {sorted({fills[i].fill_id for i in of[slots == bad[0]]})}")
        bad = np.flatnonzero((self.id_of[slots] != ids) | ((self.gen[slots] & 1) == 0))
        if bad.size:
            s = slots[bad[0]]
            raise BrokenInvariant("slot table", "a fill's slots are FILLING with its ids", f"slot {s}",
                                  f"fill {fills[of[bad[0]]].fill_id} reads id {ids[bad[0]]} into it; it holds "
                                  f"{self.id_of[s]}, gen {self.gen[s]}")
        bad = np.flatnonzero(self.pins[slots] == 0)
        if bad.size:
            raise BrokenInvariant("slot table", "a fill's slots are pinned (by the fill)", f"slot {slots[bad[0]]}",
                                  f"fill {fills[of[bad[0]]].fill_id}")


# ---- compiled loops (tierstore/jit.py); the numpy code above is their reference ----
def _pin_loop(pins, slots, times, most):
    """pins[slots] += times; returns the change in slots with a nonzero count, or, changing
    nothing, more than len(slots) if a count would pass `most`."""
    if times > 0:
        for i in range(slots.shape[0]):
            if np.int64(pins[slots[i]]) + times > most:
                return slots.shape[0] + 1
    delta = 0
    for i in range(slots.shape[0]):
        s = slots[i]
        before = np.int64(pins[s])
        pins[s] = before + times
        delta += (before + times != 0) - (before != 0)
    return delta


def _find_pin_loop(slots, pins, gen, most):
    """Pin the found slots (>= 0) once: (hits, newly pinned, hits with gen odd), or (-1, 0, 0),
    nothing pinned, if one counts `most` pins already."""
    for i in range(slots.shape[0]):
        s = slots[i]
        if s >= 0 and pins[s] >= most:
            return -1, 0, 0
    n_hit = newly = n_filling = 0
    for i in range(slots.shape[0]):
        s = slots[i]
        if s >= 0:
            n_hit += 1
            newly += pins[s] == 0
            pins[s] += 1
            n_filling += gen[s] & 1
    return n_hit, newly, n_filling


def _take_loop(id_of, top, out):
    """Pop out.shape[0] slots off the free stack threaded through id_of; returns the new top.
    A sequential walk: the Python loop is the reference."""
    for i in range(out.shape[0]):
        out[i] = top
        top = -2 - id_of[top]
        id_of[out[i]] = -1
    return top


def _put_loop(id_of, top, slots):
    for i in range(slots.shape[0]):
        id_of[slots[i]] = -2 - top
        top = slots[i]
    return top


def _stack_loop(id_of, top, n, seen):
    """Walk the free stack down from `top` for at most n slots, marking each in `seen`; returns
    (slots walked, where the walk stopped: -1 past the bottom, else the slot or next that ends it:
    out of range, met twice, or holding a row). A sequential walk: the Python loop is the reference."""
    s = np.int64(top)
    for k in range(n):
        if s < 0 or s >= id_of.shape[0] or seen[s] or id_of[s] >= 0:
            return k, s
        seen[s] = True
        s = -2 - np.int64(id_of[s])
    return n, s


_PIN, _FIND_PIN, _TAKE, _PUT, _STACK = (Kernel(f) for f in (_pin_loop, _find_pin_loop, _take_loop, _put_loop,
                                                               _stack_loop))
