"""The slot table of a cache-mode arena: which row each slot holds, who pins it,
whether its bytes are ready. One table, shared with the cache policy.

Every operation costs O(slots it is given), never O(arena): at V4.1 scale an
arena has 10^8 slots, and a pass over them is hundreds of milliseconds.

States: EMPTY (on the free stack), FILLING (reserved for a row being read from
the cold tier; pinned by its fill, so it cannot be evicted half-written),
READY. Callers hold the engine's lock.

`gen`, `id_of` and `slot_of` may live in a shared slot index (slot_index.py)
that local clients read without a lock: `gen[s]` is a sequence lock, odd
while slot s is empty or being written, even while it holds a READY row
(odd too for a row of a cold block online verification found bad: never
served again, from the arena or the disk).
unmap() makes it odd before the slot's id or bytes change; ready() makes it
even once the new row is in place; begin_write()/end_write() bracket a
rewrite of a READY row in place.
"""
from __future__ import annotations

import threading

import numpy as np

from tierstore.cache import prefault
from tierstore.jit import Kernel
from tierstore.cache.slot_index import SlotIndexFile, index_dtypes

__all__ = ["SlotTable", "Fill", "EMPTY", "FILLING", "READY"]

EMPTY, FILLING, READY = 0, 1, 2


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
        """index: the shared slot index to keep gen, id_of and slot_of in (local reads); private when None."""
        self.capacity, self.rows = int(capacity), int(rows)
        self.index = index
        if index is not None:
            self.gen, self.id_of, self.slot_of = index.gen, index.id_of, index.slot_of
        else:
            # 4 B per row and 17 B per slot at V4.1 scale (rows and slots < 2^31)
            id_dt, slot_dt = index_dtypes(self.capacity, self.rows)
            self.slot_of = np.full(self.rows, -1, dtype=slot_dt)
            self.id_of = np.full(self.capacity, -1, dtype=id_dt)  # = policy.slot_id
            self.gen = np.ones(self.capacity, dtype=np.uint32)
        self.pins = prefault.zeros(self.capacity, np.int32)
        self.state = prefault.zeros(self.capacity, np.uint8)
        self.fill_of = prefault.zeros(self.capacity, np.int32)  # fill id (mod 2^31) of a FILLING slot
        # a stack: pop from the end (int32 below 2^31 slots, handed out as int64)
        self._free = np.arange(self.capacity - 1, -1, -1, dtype=np.int32 if self.capacity < 2**31 else np.int64)
        self.n_free = self.capacity
        self.n_pinned = 0  # slots with pins > 0, kept incrementally for stats

    @property
    def held_bytes(self) -> int:
        """Bytes of the maps, pins and fill state (the shared index's included)."""
        return sum(a.nbytes for a in (self.slot_of, self.id_of, self.gen, self.pins, self.state, self.fill_of,
                                      self._free))

    @property
    def resident(self) -> int:
        return self.capacity - self.n_free

    def lookup_pin(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """The slot of each id (-1: not resident), the resident ones pinned once.

        ids: unique. Returns (slots int64, hit slots, how many of them are FILLING)."""
        k = _LOOKUP_PIN.compiled()
        if k is not None:
            slots, n_hit, newly, filling = k(self.slot_of, ids, self.pins, self.state, FILLING)
            self.n_pinned += newly
            return slots, slots[slots >= 0] if n_hit < ids.size else slots, filling
        slots = self.slot_of[ids].astype(np.int64)
        hit = slots[slots >= 0]
        self.pin(hit)
        return slots, hit, int(np.count_nonzero(self.state[hit] == FILLING))

    def pin(self, slots: np.ndarray, times: int = 1) -> None:
        """slots: unique."""
        k = _PIN.compiled()
        if k is not None:
            self.n_pinned += k(self.pins, slots, times)
            return
        before = self.pins[slots]
        self.n_pinned += int(np.count_nonzero(before == 0))
        self.pins[slots] = before + times

    def unpin(self, slots: np.ndarray) -> None:
        k = _PIN.compiled()
        if k is not None:
            self.n_pinned += k(self.pins, slots, -1)
            return
        after = self.pins[slots] - 1
        self.pins[slots] = after
        self.n_pinned -= int(np.count_nonzero(after == 0))

    def take_free(self, k: int) -> np.ndarray:
        take = min(k, self.n_free)
        got = self._free[self.n_free - take:self.n_free].astype(np.int64)
        self.n_free -= take
        return got

    def put_free(self, slots: np.ndarray) -> None:
        n = slots.size
        self._free[self.n_free:self.n_free + n] = slots
        self.n_free += n

    def unmap(self, slots: np.ndarray) -> None:
        """Forget the rows `slots` hold (evicted, or a failed fill); they stay off the free stack.
        Their gen goes odd first (a local reader then rejects what it copies from them)."""
        k = _UNMAP.compiled()
        if k is not None:
            k(self.slot_of, self.id_of, self.state, self.gen, slots, EMPTY)
            return
        self.gen[slots] |= np.uint32(1)
        held = self.id_of[slots]
        self.slot_of[held[held >= 0]] = -1
        self.id_of[slots] = -1
        self.state[slots] = EMPTY

    def ready(self, slots: np.ndarray) -> None:
        """The rows of FILLING `slots` are written and verified: READY, gen even."""
        self.state[slots] = READY
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
            self.slot_of = self.id_of = self.gen = None
            self.index.close()
            self.index = None

    def assign(self, slots: np.ndarray, ids: np.ndarray, fill_id: int) -> None:
        """Map ids to slots, FILLING by fill `fill_id`."""
        k = _ASSIGN.compiled()
        if k is not None:
            k(self.slot_of, self.id_of, self.state, self.fill_of, slots, ids, FILLING, fill_id)
            return
        self.id_of[slots] = ids
        self.slot_of[ids] = slots
        self.state[slots] = FILLING
        self.fill_of[slots] = fill_id


# ---- compiled loops (tierstore/jit.py); the numpy code above is their reference ----
def _pin_loop(pins, slots, times):
    """pins[slots] += times; returns the change in slots with a nonzero count."""
    delta = 0
    for i in range(slots.shape[0]):
        s = slots[i]
        before = pins[s]
        pins[s] = before + times
        delta += (before + times != 0) - (before != 0)
    return delta


def _lookup_pin_loop(slot_of, ids, pins, state, filling):
    slots = np.empty(ids.shape[0], np.int64)
    n_hit = newly = n_filling = 0
    for i in range(ids.shape[0]):
        s = slot_of[ids[i]]
        slots[i] = s
        if s >= 0:
            n_hit += 1
            newly += pins[s] == 0
            pins[s] += 1
            n_filling += state[s] == filling
    return slots, n_hit, newly, n_filling


def _unmap_loop(slot_of, id_of, state, gen, slots, empty):
    for i in range(slots.shape[0]):
        s = slots[i]
        gen[s] |= 1
        if id_of[s] >= 0:
            slot_of[id_of[s]] = -1
        id_of[s] = -1
        state[s] = empty


def _assign_loop(slot_of, id_of, state, fill_of, slots, ids, filling, fill_id):
    for i in range(slots.shape[0]):
        s = slots[i]
        id_of[s] = ids[i]
        slot_of[ids[i]] = s
        state[s] = filling
        fill_of[s] = fill_id


_PIN, _LOOKUP_PIN, _UNMAP, _ASSIGN = (Kernel(f) for f in (_pin_loop, _lookup_pin_loop, _unmap_loop, _assign_loop))
