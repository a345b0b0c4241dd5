"""The sidecar's shared DRAM arenas and lease board, as a client on the same host maps them.

A client reads rows straight from an arena file the sidecar writes (/dev/shm),
mapped read-only; a torch view of it is page-locked for CUDA on first use so
kernels read it over UVA. The lease board (one u64 per lease) tells a reader
whether its lease still lived when its gather ended.
"""
from __future__ import annotations

import mmap
import os
import threading
import warnings
from typing import TYPE_CHECKING

import numpy as np

from tierstore import errors
from tierstore.cache.leases import INDEX_MASK
from tierstore.tiers.dram import map_readonly, map_split_readonly

if TYPE_CHECKING:
    import torch

__all__ = ["MappedArena", "ArenaMaps", "register_for_cuda", "unregister_for_cuda", "map_board"]

# cudaHostRegister flags: Portable | Mapped | ReadOnly (our mapping is PROT_READ)
_CUDA_HOST_REGISTER_FLAGS = 0x01 | 0x02 | 0x08


def register_for_cuda(arr: np.ndarray) -> bool:
    """Page-lock a mapped arena so CUDA kernels read it over UVA (no staging copy).

    Returns False (with a warning) when the driver refuses, e.g. a GPU without
    read-only host registration: the layer then gathers on the host and copies.
    Not yet exercised on a GPU in CI (no device there).
    """
    import torch

    err = torch.cuda.cudart().cudaHostRegister(arr.ctypes.data, arr.nbytes, _CUDA_HOST_REGISTER_FLAGS)
    if int(err) != 0:
        warnings.warn(f"cudaHostRegister of the arena failed ({err}); CUDA gathers will copy through the host")
        return False
    return True


def unregister_for_cuda(arr: np.ndarray) -> None:
    """Undo register_for_cuda before dropping a mapping (page-locked pages would stay pinned)."""
    import torch

    torch.cuda.cudart().cudaHostUnregister(arr.ctypes.data)


class MappedArena:
    """One arena file mapped read-only (numpy view, its header, a torch view on demand).

    split > 0: a split arena (tiers/dram.py): `rows` is None, `split_rows` holds its
    weight and scale views (client/split_table.py hands them to engines); take()
    reads interleaved rows from either layout."""

    def __init__(self, path: str, slots: int, row_bytes: int, instance: str | None, allow_retired: bool = False,
                 split: int = 0):
        self.path = path
        self.split = split
        if split:  # full-resident only: never leased, never read retired
            self.split_rows, self.header = map_split_readonly(path, slots, row_bytes, split, instance=instance)
            self.rows = None
        else:
            self.rows, self.header = map_readonly(path, slots, row_bytes, instance=instance,
                                                  allow_retired=allow_retired)
            self.split_rows = None
        self._tensor = None
        self._registered = False

    @property
    def retired(self) -> bool:
        return self.header.retired

    def take(self, slots: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows uint8 [n, row_bytes] at `slots` (checked by the caller), interleaved, a copy:
        into `out` where given (uint8 [n, row_bytes], C-contiguous: checked by the caller)."""
        if self.split:
            return self.split_rows.take(slots, out)
        if out is None:  # not rows[slots]: take skips fancy indexing's setup, which a small step pays
            return np.take(self.rows, slots, axis=0)
        # mode "clip": the slots are in range, and "raise" would gather into a buffer and copy that
        return np.take(self.rows, slots, axis=0, out=out, mode="clip")

    @property
    def tensor(self) -> "torch.Tensor":
        if self.split:
            raise errors.InvalidArgument(
                f"arena {self.path} is split-layout (serve --split-layout: all weights, then all scales, for "
                f"sglang/vLLM); tierstore's own layers gather interleaved rows: read it with Client.lookup or "
                f"Client.split_table, or serve the table without --split-layout")
        if self._tensor is None:
            import torch  # here: a numpy-only client does not pay torch's import

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only mapping: we never write through it
                self._tensor = torch.from_numpy(self.rows)
            if torch.cuda.is_available():
                self._registered = register_for_cuda(self.rows)
        return self._tensor

    def drop(self) -> None:
        """Forget the mapping (its pages go when the last view does)."""
        if self._registered:
            unregister_for_cuda(self.rows)
            self._registered = False
        self._tensor = None


def map_board(path: str, entries: int) -> np.ndarray:
    """The sidecar's lease board, read-only."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        mm = mmap.mmap(fd, 8 * entries, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    return np.frombuffer(mm, dtype="<u8")


class ArenaMaps:
    """Every arena one client has mapped (once per file), and the lease board of its sidecar."""

    def __init__(self, lock: threading.Lock):
        self._lock = lock  # the client's: handles and arenas change together
        self._arenas: dict[str, MappedArena] = {}
        self._boards: dict[str, np.ndarray] = {}

    def arena(self, path: str, slots: int, row_bytes: int, instance: str, leased: bool = False,
              split: int = 0) -> MappedArena:
        """The mapped arena at `path`; retired ones are let go (unless `leased`: the caller
        holds a lease in it, so a retired arena may still be read). split: as MappedArena."""
        with self._lock:
            m = self._arenas.get(path)
            if m is not None and (leased or not m.retired):
                return m
            for p in [p for p, x in self._arenas.items() if x.retired and p != path]:
                self._arenas.pop(p).drop()
        m = MappedArena(path, slots, row_bytes, instance, allow_retired=leased, split=split)
        with self._lock:
            self._arenas[path] = m
        return m

    def lease_alive(self, board_path: str, entries: int, lease_id: int) -> bool:
        board = self._boards.get(board_path)
        if board is None:
            if not board_path:  # a sidecar without a board: trust the TTL
                return True
            board = map_board(board_path, entries)
            self._boards = {board_path: board}  # one sidecar instance at a time
        return int(board[lease_id & INDEX_MASK]) == lease_id

    def drop(self) -> None:
        """Let every mapping go (the client closes)."""
        for m in self._arenas.values():
            m.drop()
        self._arenas.clear()
