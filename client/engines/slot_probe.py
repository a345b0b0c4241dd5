"""A staged layer's view of its cache-mode table's slot index: which of a step's ids are resident.

The sidecar publishes its slot index (tierstore/cache/slot_index.py: `gen` seqlocks, `id_of`,
the id -> slot map) beside the arena. A stager reads it two ways:
- on the host, `misses(ids)`: how many of a step's ids the index does not hold READY now (the
  map's probe and an even gen; no row copied). A hint, exact for a quiescent index: a racing
  eviction or insert moves the count by the ids it touches. The stagers read a later Engram
  layer behind the forward only when it has misses to read (sglang_stager, vllm_stager);
- on the device, `tensors(device)`: the index, the arena and the arena's retired word as
  tensors (registered for CUDA over UVA, read-only) for the fast form's kernel
  (kernels/staged_gather.py), which probes them itself.

Invariants: a probe follows the table's current handle (a version swap or a restart makes
the client describe the table again: the next call maps the new index); a table served
full-resident has no misses; one without a published index (`serve --no-local-reads`) or
whose index is gone reads every id as a miss (the host's reads plan them).
"""
from __future__ import annotations

import threading
import warnings

import numpy as np

from tierstore.cache.slot_index import map_index
from tierstore.errors import StaleArena

__all__ = ["SlotProbe"]


class SlotProbe:
    """The slot index of table `table` as `client` serves it now (see the module docstring)."""

    def __init__(self, client, table: str):
        self.client, self.table = client, table
        self._lock = threading.Lock()  # a stager's thread and the scheduler's may probe at once
        self._handle = self._index = None
        self._tensors: dict = {}

    def _current(self):
        """(handle, (gen, id_of, SlotMap) or None) of the table's current handle."""
        h = self.client.handle(self.table)
        with self._lock:
            if h is not self._handle:
                self._handle, self._index, self._tensors = h, None, {}
                if not h.full_resident and h.index_path:
                    try:
                        self._index = map_index(h.index_path, h.arena_np.shape[0], h.rows, h.instance)
                    except StaleArena:
                        self._index = None  # retired meanwhile: every id a miss until it is described again
            return h, self._index

    def misses(self, ids: np.ndarray) -> int:
        """Ids of int64 `ids` (in range) that the slot index does not hold READY now."""
        h, index = self._current()
        if h.full_resident:
            return 0
        if index is None:
            return int(ids.size)
        gen, _, slot_map = index
        slots = slot_map.find(ids)
        found = slots >= 0
        held = found.copy()
        held[found] = (gen[slots[found]] & 1) == 0
        return int(ids.size - np.count_nonzero(held))

    def tensors(self, device) -> dict:
        """The fast form's kernel inputs for `device` (kernels/staged_gather.py): `gen` uint32
        [slots] as int32, `id_of` int32|int64 [slots], `table` (the map's entries) as int32|int64,
        `arena` uint8 [slots, row_bytes], `retired` uint8 [4] (the arena header's retired word),
        and the map's `slot_bits`, `tag_shift`, `tag_mask`. On CUDA the host mappings are
        registered read-only (UVA; the kernel reads them in place). StaleArena when the table
        has no slot index (full-resident, or `serve --no-local-reads`): the fast form needs one."""
        import torch

        h, index = self._current()
        if index is None:
            raise StaleArena(f"table {self.table} has no slot index to probe on the device (full-resident, served "
                             f"with --no-local-reads, or retired): the fast form stages cache-mode tables with local "
                             f"reads; use the simple form (TIERSTORE_SGLANG_STAGE_FORM / TIERSTORE_VLLM_STAGE_FORM "
                             f"simple, the default)")
        device = torch.device(device)
        key = str(device)
        with self._lock:
            got = self._tensors.get(key)
            if got is not None:
                return got
            gen, id_of, slot_map = index
            table = slot_map.table
            header = h.mapped.header._buf
            if device.type == "cuda":  # one registration a mapping (its pages once): the index, the header page
                _register_span(gen, table)
                _register_span(header, header)
                h.arena  # the arena's own registration (MappedArena.tensor)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only mappings: the kernel never writes them
                out = {"gen": torch.from_numpy(gen.view(np.int32)), "id_of": torch.from_numpy(id_of),
                       "table": torch.from_numpy(table.view(np.int32 if table.itemsize == 4 else np.int64)),
                       "arena": torch.from_numpy(h.arena_np), "retired": torch.from_numpy(header[8:12])}
            out.update(slot_bits=slot_map.slot_bits, tag_shift=slot_map.tag_shift, tag_mask=slot_map.tag_mask)
            self._tensors[key] = out
            return out


def _register_span(first: np.ndarray, last: np.ndarray) -> None:
    """cudaHostRegister (read-only, mapped) of the bytes from `first`'s start to `last`'s end, one
    mapping's arrays (their pages registered once). Warns and leaves them unregistered where the
    driver refuses (arena_map.register_for_cuda): the kernel's launch then fails naming the pointer."""
    from tierstore.client.arena_map import register_for_cuda

    start, end = first.ctypes.data, last.ctypes.data + last.nbytes
    register_for_cuda(np.frombuffer((np.ctypeslib.as_ctypes_type(np.uint8) * (end - start)).from_address(start),
                                    dtype=np.uint8))
