"""The id -> slot map of a cache-mode arena: an open-addressing hash table the
size of the arena, not of the table (O(slots), never O(rows)).

The table holds SLOTS, not ids: entry = (tag << slot_bits) | slot, the key
implicit in `id_of[slot]` (the slot table's slot -> id array, which a find
reads to confirm a match), all ones for an empty entry. `tag` is the rest of
the entry's bits, taken from the id's hash, so a probe reads `id_of` (a cache
miss of its own) only for an entry whose tag matches. capacity < 2^slot_bits,
so a slot's bits are never all ones and a full entry never reads as empty.
Linear probing from h(id) (the top bits of a multiplicative hash, scaled to
the table's size: no power-of-two rounding), deletion by backward shift (no
tombstones), at most MAX_LOAD of the entries full, so every probe of a
consistent table ends at an empty entry. MAX_LOAD is 4/5 (5 B a slot with
4-byte entries): linear probing then reads 3 entries for a hit and 13 for a
miss on average (2 and 5 at 2/3, 6 B a slot), 16 entries a cache line, and a
probe reads `id_of` only on a tag match (docs/decisions.md, "The slot map's load").

Writers hold the engine's lock (one writer). Readers (a client on the host, see
slot_index.py) read the table with no lock while the writer inserts and
shifts, and this is why that can only cost a miss, never a wrong row:
- find returns slot s only if `id_of[s] == id` when it read it; the local
  reader then checks that `gen[s]` was even before that and is unchanged after
  its copy (slot_index.py), so whatever the table said, the row it keeps was
  row `id` for the whole copy. The table is only a hint of where to look;
- what a racing shift can do is move the entry a reader looks for from a
  position it has not reached to one it has passed (or, for a moment, leave
  it at both): the reader then meets an empty entry, or its bound, and calls
  the id a miss, which it reads from disk, exact;
- a probe is bounded (by twice the table's size), so a reader never loops,
  whatever it sees mid-shift.
The writer's own finds run under the lock on a consistent table: exact.
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np

from tierstore.jit import Kernel

__all__ = ["SlotMap", "map_size", "entry_dtype", "MAX_LOAD"]

MAX_LOAD = Fraction(4, 5)  # full entries at most (exact: the index file's size is computed from it)
_MUL = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: the top bits of id * 2^64/phi


def map_size(capacity: int, max_load: Fraction = MAX_LOAD) -> int:
    """Entries of the table of an arena of `capacity` slots (capacity / max_load rounded up, at least 16)."""
    return max(16, -(-int(capacity) * max_load.denominator // max_load.numerator))


def entry_dtype(capacity: int) -> np.dtype:
    """uint32 entries below 2^31 slots (every arena a host holds): 5 B a slot at MAX_LOAD."""
    return np.dtype(np.uint32 if capacity < 2**31 else np.uint64)


def _layout(capacity: int) -> tuple[int, int, int]:
    """(slot_bits, tag shift, tag mask) of an arena's entries."""
    bits = entry_dtype(capacity).itemsize * 8
    slot_bits = max(1, int(capacity).bit_length())  # capacity < 2^slot_bits: a slot is never all ones
    return slot_bits, 64 - (bits - slot_bits) - 32, (1 << (bits - slot_bits)) - 1


class SlotMap:
    """id -> slot over `table` (an empty-initialised entry array of map_size(capacity), private or
    in the shared slot index) and `id_of` (the slot table's slot -> id). Callers hold the engine's lock
    for insert and delete; find runs anywhere (see the module docstring)."""

    def __init__(self, table: np.ndarray, id_of: np.ndarray, capacity: int):
        self.table, self.id_of, self.capacity = table, id_of, int(capacity)
        self.slot_bits, self.tag_shift, self.tag_mask = _layout(capacity)
        self._args = (np.uint64(self.slot_bits), np.uint64(self.tag_shift), np.uint64(self.tag_mask),
                      np.uint64((1 << self.slot_bits) - 1), np.uint64(np.iinfo(table.dtype).max))

    @staticmethod
    def empty_table(capacity: int, max_load: Fraction = MAX_LOAD) -> np.ndarray:
        """All-empty entries for `capacity` slots (another max_load: bench scale's comparison)."""
        return np.full(map_size(capacity, max_load), np.iinfo(entry_dtype(capacity)).max, dtype=entry_dtype(capacity))

    def find(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The slot of each id (int64; -1: not resident), into `out` when given."""
        ids = np.asarray(ids, dtype=np.int64).ravel()
        out = np.empty(ids.size, np.int64) if out is None else out
        find(ids, self.table, self.id_of, self._args, out)
        return out

    def insert(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Map ids (none of them mapped) to slots; id_of[slots] must hold them already."""
        k = _INSERT.compiled()
        with np.errstate(over="ignore"):  # the Python loop's hash wraps, as the compiled one's does
            (k or _insert_loop)(np.asarray(ids, dtype=np.int64), np.asarray(slots, dtype=np.int64), self.table,
                                *self._args)

    def delete(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Unmap ids from their slots (id_of still holding them; entries of other ids are
        moved back by backward shift, and their keys read from id_of)."""
        k = _DELETE.compiled()
        with np.errstate(over="ignore"):
            (k or _delete_loop)(np.asarray(ids, dtype=np.int64), np.asarray(slots, dtype=np.int64), self.table,
                                self.id_of, *self._args)


def find(ids, table, id_of, args, out) -> None:
    """out[i] = the slot of ids[i] in `table` (-1: none); a bounded probe, safe without a lock."""
    k = _FIND.compiled()
    if k is not None:
        k(ids, table, id_of, *args, out)
        return
    # the numpy reference: all ids probe one position per round
    slot_bits, tag_shift, tag_mask, slot_mask, empty = args
    n = table.shape[0]
    h = ids.view(np.uint64) * _MUL
    pos = (((h >> np.uint64(32)) * np.uint64(n)) >> np.uint64(32)).astype(np.int64)
    tag = (h >> tag_shift) & tag_mask
    out[:] = -1
    todo = np.arange(ids.size)
    for _ in range(n):
        if todo.size == 0:
            break
        e = table[pos[todo]].astype(np.uint64)
        full = e != empty
        s = (e & slot_mask).astype(np.int64)
        cand = full & ((e >> slot_bits) == tag[todo])
        cand[cand] = id_of[s[cand]] == ids[todo[cand]]
        out[todo[cand]] = s[cand]
        todo = todo[full & ~cand]
        pos[todo] += 1
        pos[todo[pos[todo] == n]] = 0


# ---- compiled loops (tierstore/jit.py); find's numpy path above is their reference ----
def _find_loop(ids, table, id_of, slot_bits, tag_shift, tag_mask, slot_mask, empty, out):
    """Three passes, so the cache misses of different ids overlap (a probe that loops on
    what it loaded stalls on every one): each id's home entry; the probe from there to the
    first entry whose tag matches (its lines now cached); that entry's id confirmed, the
    probe going on past it in the rare case it is another id's. At most twice the table's
    size in probes: a reader racing a shift never loops."""
    n = table.shape[0]
    m = ids.shape[0]
    pos = np.empty(m, np.int64)
    for i in range(m):  # pass 1: the home entries, no branch on what is loaded
        h = np.uint64(ids[i]) * np.uint64(0x9E3779B97F4A7C15)
        p = np.int64(((h >> np.uint64(32)) * np.uint64(n)) >> np.uint64(32))
        pos[i] = p
        out[i] = np.int64(table[p])
    for i in range(m):  # pass 2: to the first tag match or an empty entry
        tag = ((np.uint64(ids[i]) * np.uint64(0x9E3779B97F4A7C15)) >> tag_shift) & tag_mask
        p = pos[i]
        out[i] = -1
        for _ in range(n):
            e = np.uint64(table[p])
            if e == empty:
                break
            if (e >> slot_bits) == tag:
                out[i] = np.int64(e & slot_mask)
                break
            p += 1
            if p == n:
                p = 0
        pos[i] = p
    for i in range(m):  # pass 3: the match confirmed by id_of (its loads overlap too)
        s = out[i]
        if s < 0 or id_of[s] == ids[i]:
            continue
        x = ids[i]
        tag = ((np.uint64(x) * np.uint64(0x9E3779B97F4A7C15)) >> tag_shift) & tag_mask
        p = pos[i]
        out[i] = -1
        for _ in range(n - 1):
            p += 1
            if p == n:
                p = 0
            e = np.uint64(table[p])
            if e == empty:
                break
            if (e >> slot_bits) == tag and id_of[np.int64(e & slot_mask)] == x:
                out[i] = np.int64(e & slot_mask)
                break


def _insert_loop(ids, slots, table, slot_bits, tag_shift, tag_mask, slot_mask, empty):
    n = table.shape[0]
    for i in range(ids.shape[0]):
        h = np.uint64(ids[i]) * np.uint64(0x9E3779B97F4A7C15)
        p = np.int64(((h >> np.uint64(32)) * np.uint64(n)) >> np.uint64(32))
        while np.uint64(table[p]) != empty:  # MAX_LOAD: an empty entry exists
            p += 1
            if p == n:
                p = 0
        table[p] = (((h >> tag_shift) & tag_mask) << slot_bits) | np.uint64(slots[i])


def _delete_loop(ids, slots, table, id_of, slot_bits, tag_shift, tag_mask, slot_mask, empty):
    n = table.shape[0]
    for i in range(ids.shape[0]):
        h = np.uint64(ids[i]) * np.uint64(0x9E3779B97F4A7C15)
        p = np.int64(((h >> np.uint64(32)) * np.uint64(n)) >> np.uint64(32))
        want = np.uint64(slots[i])
        found = False
        for _ in range(n):
            e = table[p]
            if np.uint64(e) == empty:
                break
            if (np.uint64(e) & slot_mask) == want:
                found = True
                break
            p += 1
            if p == n:
                p = 0
        if not found:
            continue
        # backward shift: pull each later entry of the cluster into the hole unless its home
        # lies cyclically in (hole, its position]
        hole, j = p, p
        while True:
            j += 1
            if j == n:
                j = 0
            e = table[j]
            if np.uint64(e) == empty:
                break
            key = id_of[np.int64(np.uint64(e) & slot_mask)]
            hk = np.uint64(key) * np.uint64(0x9E3779B97F4A7C15)
            home = np.int64(((hk >> np.uint64(32)) * np.uint64(n)) >> np.uint64(32))
            if (j > hole and (home <= hole or home > j)) or (j < hole and home <= hole and home > j):
                table[hole] = e
                hole = j
        table[hole] = empty


_FIND, _INSERT, _DELETE = Kernel(_find_loop), Kernel(_insert_loop), Kernel(_delete_loop)
