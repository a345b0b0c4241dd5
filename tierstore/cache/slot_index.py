"""The slot index of a cache-mode arena in shared memory, so a local client reads
resident rows with no round trip (client/local_reads.py).

The sidecar's slot table (slots.py) keeps three of its arrays in this file:

    gen      uint32 [slots]   a sequence lock per slot: odd while the slot is
                              empty or being written (or holds a row of a cold
                              block found bad), even while it holds a READY row
                              that does not change
    id_of    int32|64 [slots] the row a slot holds (-1: none)
    slot_of  int32|64 [rows]  the slot of a row (-1: not resident)

Writer (the sidecar, engine lock held): a slot's gen goes odd before its
row or its id changes (unmap), and back to even only once the new row is
written and verified (ready). Each of these is its own call, after the one
before it returned, so the stores are seen in that order (x86-64 keeps stores
in program order).

Reader (a client, no lock, no syscall): for each id, s = slot_of[id] and
g1 = gen[s]; then id_of[s] == id and the row copied; then gen[s] == g1 and
g1 even. Three separate calls, each reading only after the previous one
returned: x86-64 does not reorder loads with other loads, so a row that
passes was whole and was row `id` for the entire copy. A row that fails
(evicted or rewritten meanwhile) is read like a miss. Other architectures
need load fences here, so `supported()` is False there and clients ask the
sidecar instead.

The file: one 4 KiB header (magic, element widths, slots, rows, the sidecar
instance) and the three arrays, each 64-byte aligned. Created 0600 under an
unpredictable name beside the arena, removed with it.
"""
from __future__ import annotations

import mmap
import os
import platform
import struct
from pathlib import Path

import numpy as np

from tierstore.errors import ResourceExhausted, StaleArena
from tierstore.tiers.dram import map_file_readonly

__all__ = ["SlotIndexFile", "map_index", "supported", "index_dtypes"]

HEADER_BYTES = 4096
_MAGIC = b"TSINDEX1"
_LAYOUT = struct.Struct("<8sII QQ 16s")  # magic, id width, slot width, slots, rows, instance
_ALIGN = 64


def supported() -> bool:
    """Local reads rely on x86-64's load ordering (see the module docstring)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def index_dtypes(capacity: int, rows: int) -> tuple[np.dtype, np.dtype]:
    """(id dtype for id_of, slot dtype for slot_of): 4 B where they fit."""
    return (np.dtype(np.int32 if rows < 2**31 else np.int64), np.dtype(np.int32 if capacity < 2**31 else np.int64))


def _layout(capacity: int, rows: int, id_dt: np.dtype, slot_dt: np.dtype) -> tuple[int, int, int, int]:
    """Byte offsets of gen, id_of, slot_of and the file size."""
    up = lambda x: -(-x // _ALIGN) * _ALIGN
    gen = HEADER_BYTES
    id_of = up(gen + 4 * capacity)
    slot_of = up(id_of + id_dt.itemsize * capacity)
    return gen, id_of, slot_of, up(slot_of + slot_dt.itemsize * rows)


def _views(buf, capacity: int, rows: int, id_dt, slot_dt):
    g, i, s, _ = _layout(capacity, rows, id_dt, slot_dt)
    whole = np.frombuffer(buf, dtype=np.uint8)
    return (whole[g:g + 4 * capacity].view(np.uint32), whole[i:i + id_dt.itemsize * capacity].view(id_dt),
            whole[s:s + slot_dt.itemsize * rows].view(slot_dt))


class SlotIndexFile:
    """The sidecar's writable index file: `gen`, `id_of`, `slot_of` are views of it,
    initialised empty (gen 1, ids and slots -1)."""

    def __init__(self, path: Path, capacity: int, rows: int, instance: str = ""):
        self.path = Path(path)
        id_dt, slot_dt = index_dtypes(capacity, rows)
        size = _layout(capacity, rows, id_dt, slot_dt)[3]
        # O_EXCL on an unpredictable name: never someone else's file, never a link
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.posix_fallocate(fd, 0, size)
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            self.path.unlink(missing_ok=True)
            raise ResourceExhausted(f"cannot reserve {size / 2**20:.1f} MiB for the slot index {self.path.name} "
                                    f"in {self.path.parent} ({e.strerror}); lower --dram-budget or enlarge "
                                    f"{self.path.parent}") from None
        except BaseException:
            self.path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self.gen, self.id_of, self.slot_of = _views(self._mmap, capacity, rows, id_dt, slot_dt)
        self.gen[:] = 1
        self.id_of[:] = -1
        self.slot_of[:] = -1
        self._mmap[:_LAYOUT.size] = _LAYOUT.pack(_MAGIC, id_dt.itemsize, slot_dt.itemsize, capacity, rows,
                                                 instance.encode()[:16])

    def close(self) -> None:
        """Remove the file; mappings (ours until our views go, clients') stay valid."""
        self.gen = self.id_of = self.slot_of = None
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with it
        self.path.unlink(missing_ok=True)


def map_index(path: str | Path, capacity: int, rows: int, instance: str | None = None):
    """A client's read-only (gen, id_of, slot_of) of the index at `path`; StaleArena when
    the file is not the index described (another instance, shape, or gone)."""
    id_dt, slot_dt = index_dtypes(capacity, rows)
    mm = map_file_readonly(path, _layout(capacity, rows, id_dt, slot_dt)[3], "slot index",
                           "the sidecar restarted or swapped the table's version")
    magic, iw, sw, cap, n, inst = _LAYOUT.unpack_from(mm)
    if (magic, iw, sw, cap, n) != (_MAGIC, id_dt.itemsize, slot_dt.itemsize, capacity, rows) or \
            (instance is not None and inst.rstrip(b"\0").decode() != instance):
        raise StaleArena(f"slot index {path} is not the index of this arena ({capacity} slots over {rows} rows, "
                         f"instance {instance}); describe the table again")
    return _views(mm, capacity, rows, id_dt, slot_dt)
