"""The slot index of a cache-mode arena in shared memory, so a client on the host reads
resident rows with no round trip (client/local_reads.py).

The sidecar's slot table (slot_table.py) keeps three of its arrays in this file,
all O(slots), nothing per row:

    gen      uint32 [slots]   a sequence lock per slot: odd while the slot is
                              empty or being written (or holds a row of a cold
                              block found bad), even while it holds a READY row
                              that does not change
    id_of    int32|64 [slots] the row a slot holds (negative: none)
    map      uint32|64 [~1.25 x slots]  the id -> slot hash table (slot_map.py):
                              slots, keyed by id_of

Writer (the sidecar, engine lock held): a slot's gen goes odd before its
row, its id or its map entry changes (unmap), and back to even only once the
new row is written and verified (ready). Each of these is its own call, after
the one before it returned, so the stores are seen in that order (x86-64 keeps
stores in program order).

Reader (a client, no lock, no syscall): for each id, s = the map's slot for
it (a probe that confirms id_of[s] == id, slot_map.py) and g1 = gen[s]; then
id_of[s] == id again and the row copied; then gen[s] == g1 and g1 even. The
probe is one call; the rest is one compiled loop (client/local_reads.py) whose
loads are kept in this order by compiler barriers (jit.compiler_barrier: every
g1 before any copy, each row's copy before its second gen load). x86-64 does
not reorder loads with other loads, so a row that passes was whole and was row
`id` for the entire copy. A row that fails (evicted or rewritten meanwhile), or
an id the probe did not find (a concurrent insert or backward shift hid it:
slot_map.py says why that is only ever a miss), is read like a miss. Other
architectures need load fences here, so `supported()` is False there and
clients ask the sidecar instead.

Invariants (check_slots states them as code; SlotIndexFile.check and SlotTable.check call
it): a slot holding no row has an odd gen (so a row assigned to it is FILLING until ready()
makes it even); every row id held is below the table's rows and held by one slot; every map
entry names a slot below capacity that holds a row, one entry a slot; every row held is
found by a probe from its home entry (a reader of a quiescent index misses no resident row).

The file: one 4 KiB header (magic and format version, element widths, slots,
rows, the sidecar instance) and the three arrays, each 64-byte aligned.
Created 0600 under an unpredictable name beside the arena, removed with it.
A client built for another format version refuses the file (StaleArena).
"""
from __future__ import annotations

import platform
import struct
from pathlib import Path

import numpy as np

from tierstore.errors import BrokenInvariant, StaleArena
from tierstore.cache.slot_map import SlotMap, entry_dtype, map_size
from tierstore.tiers.dram import map_file_readonly
from tierstore.tiers.shm_file import create_shm_file

__all__ = ["SlotIndexFile", "map_index", "check_slots", "supported", "id_dtype", "FORMAT"]

HEADER_BYTES = 4096
_MAGIC = b"TSINDEX"  # + the format version, one ASCII digit
FORMAT = 3  # 1: a per-row slot_of array; 2: the slot-sized hash map at 2/3 load; 3: at 4/5
_LAYOUT = struct.Struct("<8sII QQ 16s")  # magic+version, id width, map entry width, slots, rows, instance
_ALIGN = 64


def supported() -> bool:
    """Local reads rely on x86-64's load ordering (see the module docstring)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def id_dtype(rows: int) -> np.dtype:
    """The dtype of id_of: 4 B where the table's ids fit."""
    return np.dtype(np.int32 if rows < 2**31 else np.int64)


def _layout(capacity: int, rows: int) -> tuple[int, int, int, int]:
    """Byte offsets of gen, id_of, map and the file size."""
    up = lambda x: -(-x // _ALIGN) * _ALIGN
    gen = HEADER_BYTES
    id_of = up(gen + 4 * capacity)
    table = up(id_of + id_dtype(rows).itemsize * capacity)
    return gen, id_of, table, up(table + entry_dtype(capacity).itemsize * map_size(capacity))


def _views(buf, capacity: int, rows: int):
    g, i, t, _ = _layout(capacity, rows)
    id_dt, e_dt = id_dtype(rows), entry_dtype(capacity)
    whole = np.frombuffer(buf, dtype=np.uint8)
    return (whole[g:g + 4 * capacity].view(np.uint32), whole[i:i + id_dt.itemsize * capacity].view(id_dt),
            whole[t:t + e_dt.itemsize * map_size(capacity)].view(e_dt))


class SlotIndexFile:
    """The sidecar's writable index file: `gen`, `id_of` and `table` (the map's entries) are
    views of it, initialised empty (gen 1, ids -1, entries all ones)."""

    def __init__(self, path: Path, capacity: int, rows: int, instance: str = ""):
        self.path, self.capacity, self.rows, self.instance = Path(path), int(capacity), int(rows), instance
        size = _layout(capacity, rows)[3]
        self._mmap = create_shm_file(self.path, size, "the slot index")
        self.gen, self.id_of, self.table = _views(self._mmap, capacity, rows)
        self.gen[:] = 1
        self.id_of[:] = -1
        self.table[:] = np.iinfo(self.table.dtype).max
        self._mmap[:_LAYOUT.size] = _LAYOUT.pack(_MAGIC + str(FORMAT).encode(), self.id_of.itemsize,
                                                 self.table.itemsize, capacity, rows, instance.encode()[:16])

    def check(self) -> None:
        """BrokenInvariant unless the header describes this file (format, widths, slots, rows,
        instance) and its arrays keep check_slots' invariants. Call it with the engine's lock
        held (the writer's): O(slots), vectorised; never from a client racing the writer."""
        magic, iw, ew, cap, rows, inst = _LAYOUT.unpack_from(self._mmap)
        head = (magic, iw, ew, cap, rows, inst.rstrip(b"\0"))
        want = (_MAGIC + str(FORMAT).encode(), self.id_of.itemsize, self.table.itemsize, self.capacity, self.rows,
                self.instance.encode()[:16])
        if head != want:
            raise BrokenInvariant("slot index", "the header describes the file", "the header",
                                  f"reads {head}, the file is {want}")
        check_slots("slot index", self.gen, self.id_of, SlotMap(self.table, self.id_of, self.capacity), self.rows)

    def close(self) -> None:
        """Remove the file; mappings (ours until our views go, clients') stay valid."""
        self.gen = self.id_of = self.table = None
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with it
        self.path.unlink(missing_ok=True)


def map_index(path: str | Path, capacity: int, rows: int, instance: str | None = None):
    """A client's read-only (gen, id_of, SlotMap) of the index at `path`; StaleArena when the
    file is not the index described (another format version, instance or shape, or gone)."""
    head = map_file_readonly(path, HEADER_BYTES, "slot index", "the sidecar restarted or swapped the table's version")
    magic, iw, ew, cap, n, inst = _LAYOUT.unpack_from(head)
    head.close()
    if magic != _MAGIC + str(FORMAT).encode():
        got = magic[7:8].decode("ascii", "replace") if magic[:7] == _MAGIC else "unknown"
        raise StaleArena(f"slot index {path} has format version {got}; this client reads version {FORMAT} "
                         f"(the sidecar and the client are different tierstore releases): run the same "
                         f"release on both sides")
    mm = map_file_readonly(path, _layout(capacity, rows)[3], "slot index",
                           "the sidecar restarted or swapped the table's version")
    if (iw, ew, cap, n) != (id_dtype(rows).itemsize, entry_dtype(capacity).itemsize, capacity, rows) or \
            (instance is not None and inst.rstrip(b"\0").decode() != instance):
        raise StaleArena(f"slot index {path} is not the index of this arena ({capacity} slots over {rows} rows, "
                         f"instance {instance}); describe the table again")
    gen, id_of, table = _views(mm, capacity, rows)
    return gen, id_of, SlotMap(table, id_of, capacity)


def check_slots(structure: str, gen: np.ndarray, id_of: np.ndarray, slot_map: SlotMap, rows: int) -> None:
    """BrokenInvariant (naming `structure`) unless gen, id_of and the map keep the invariants a
    reader relies on (the module docstring). O(slots) vectorised, and one probe of each id held.
    Quiescent only: the writer's lock held, or no writer."""
    capacity = id_of.shape[0]
    held = id_of >= 0
    bad = np.flatnonzero(~held & ((gen & 1) == 0))
    if bad.size:
        raise BrokenInvariant(structure, "a slot holding no row has an odd gen", f"slot {bad[0]}",
                              f"gen {gen[bad[0]]}: a row assigned to it would read READY before it is written")
    slots = np.flatnonzero(held)
    ids = id_of[slots].astype(np.int64)
    bad = np.flatnonzero(ids >= rows)
    if bad.size:
        raise BrokenInvariant(structure, "every row id held is below the table's rows", f"slot {slots[bad[0]]}",
                              f"id {ids[bad[0]]}, rows {rows}")
    table = slot_map.table
    full = np.flatnonzero(table != np.iinfo(table.dtype).max)
    named = (table[full].astype(np.uint64) & np.uint64((1 << slot_map.slot_bits) - 1)).astype(np.int64)
    bad = np.flatnonzero(named >= capacity)
    if bad.size:
        raise BrokenInvariant(structure, "each map entry names a slot below capacity", f"entry {full[bad[0]]}",
                              f"slot {named[bad[0]]}, capacity {capacity}")
    bad = np.flatnonzero(~held[named])
    if bad.size:
        raise BrokenInvariant(structure, "each map entry names a slot holding a row", f"entry {full[bad[0]]}",
                              f"slot {named[bad[0]]} holds none")
    bad = np.flatnonzero(np.bincount(named, minlength=capacity) > 1)
    if bad.size:
        raise BrokenInvariant(structure, "one map entry per slot", f"slot {bad[0]}",
                              f"entries {full[named == bad[0]].tolist()}")
    found = slot_map.find(ids)  # an id held twice is found at one slot at most: not at the other
    bad = np.flatnonzero(found != slots)
    if bad.size:
        x, s, f = ids[bad[0]], slots[bad[0]], found[bad[0]]
        if f >= 0 and id_of[f] == x:
            raise BrokenInvariant(structure, "one slot per id", f"id {x}",
                                  f"held by slots {min(s, f)} and {max(s, f)}")
        raise BrokenInvariant(structure, "every row held is found by a probe from its home entry", f"id {x}",
                              f"held by slot {s}, the probe found {f}")
