"""SplitTable: a full-resident table served split-layout, mapped read-only for an engine.

    from tierstore.client import Client
    with Client("/run/tierstore.sock") as c:
        t = c.split_table("l1")                   # serve --split-layout l1
        weight, scale = t.tensors()               # float8_e4m3fn [rows, 256], float8_e8m0fnu [rows, 8]
        t.register_cuda()                         # once per process: kernels read it over UVA

The arena (tiers/dram.py, split layout) holds every row's e4m3 weights in id
order, then every row's ue8m0 scales: byte for byte the host table sglang
(`_HostTable`) and vLLM (`DPSharedEngramStorage`) allocate and load
themselves, one buffer, weights first. An engine maps it instead: one copy per
host, shared by every worker, warm across engine restarts, verified by the
sidecar at load and scrubbed while it serves (repairs land in this mapping:
it is the sidecar's pages, MAP_SHARED).

Invariants:
- The views never change while the table's arena is current: the sidecar
  never writes a full-resident row except to repair it to its checksummed
  bytes. `retired` turns True when the sidecar stops serving this arena (a
  reload to another version, a restart); the bytes stay mapped and stay the
  old version's, but nobody scrubs them any more: a caller checks `retired`
  at a step boundary (tierstore.client.engines does) and moves on.
- The mapping is PROT_READ: a write through a view (numpy refuses; a torch
  tensor from tensors() does not know) is a SIGSEGV, never a changed row.
- One mapping per arena per process, shared by every SplitTable of it, so
  register_cuda pins its pages once; the last close() unregisters and unmaps.
"""
from __future__ import annotations

import threading
import warnings
from typing import TYPE_CHECKING

from tierstore import errors
from tierstore.client.arena_map import MappedArena

if TYPE_CHECKING:
    import torch

    from tierstore.client.table_handle import TableHandle

__all__ = ["SplitTable", "CudaRegistrationError"]

# cudaHostRegister flags: Portable | Mapped | ReadOnly (the mapping is PROT_READ)
_REGISTER_FLAGS = 0x01 | 0x02 | 0x08


class CudaRegistrationError(errors.TierstoreError):
    """The split arena cannot be page-locked for CUDA here (no CUDA, or the driver refused)."""

    GRPC_CODE = "FAILED_PRECONDITION"


class _Shared:
    """One process-wide mapping of one split arena: its users and whether CUDA has it pinned."""

    def __init__(self, mapped: MappedArena):
        self.mapped, self.users, self.registered = mapped, 0, False


_LOCK = threading.Lock()
_SHARED: dict[tuple[str, str], _Shared] = {}  # (arena path, sidecar instance) -> its mapping


class SplitTable:
    """One split-layout table version as an engine reads it (see the module docstring).

    weight: numpy uint8 [rows, row_dim], read-only, all weights in id order.
    scale: numpy uint8 [rows, row_dim // 32], read-only, the ue8m0 scales in id order,
        in the same mapping right after the weights (scale.ctypes.data ==
        weight.ctypes.data + weight.nbytes).
    table, version, rows, row_dim, checkpoint: what the sidecar described (checkpoint:
        TableHandle.checkpoint, the tensors the rows were ingested from, or None).
    Made by Client.split_table(table); close() when done (the last close unmaps).
    """

    def __init__(self, handle: "TableHandle"):
        if not handle.split:
            raise errors.InvalidArgument(
                f"table {handle.table!r} is served {'full-resident' if handle.full_resident else 'as a cache'}, "
                f"interleaved; an engine's host table needs its split layout: serve it with "
                f"--split-layout {handle.table} (full-resident fp8-e4m3-ue8m0 tables)")
        self.table, self.version, self.rows, self.row_dim = handle.table, handle.version, handle.rows, handle.row_dim
        self.checkpoint = handle.checkpoint
        self._key = (handle._arena_path, handle.instance)
        with _LOCK:
            shared = _SHARED.get(self._key)
            if shared is None:
                shared = _SHARED[self._key] = _Shared(MappedArena(handle._arena_path, handle._arena_slots,
                                                                  handle.row_bytes, handle.instance,
                                                                  split=handle.split))
            shared.users += 1
        self._shared: _Shared | None = shared
        rows = shared.mapped.split_rows
        self.weight, self.scale = rows.weight, rows.scale
        self._tensors = None

    @property
    def retired(self) -> bool:
        """True once the sidecar no longer serves this arena (reload, restart): describe again."""
        self._check_open()
        return self._shared.mapped.retired

    def tensors(self) -> tuple["torch.Tensor", "torch.Tensor"]:
        """(weight float8_e4m3fn [rows, row_dim], scale float8_e8m0fnu [rows, row_dim // 32]) over
        the mapping, no copy (scale is uint8 on a torch without float8_e8m0fnu). Read-only memory."""
        self._check_open()
        if self._tensors is None:
            import torch

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # not writable: the mapping is PROT_READ
                w = torch.from_numpy(self.weight).view(torch.float8_e4m3fn)
                s = torch.from_numpy(self.scale)
            e8m0 = getattr(torch, "float8_e8m0fnu", None)
            self._tensors = (w, s.view(e8m0) if e8m0 is not None else s)
        return self._tensors

    def register_cuda(self) -> None:
        """Page-lock the mapping (weights and scales) for CUDA so kernels read it over UVA;
        once per process (idempotent, shared by every SplitTable of this arena).

        Read-only registration (cudaHostRegisterReadOnly): the mapping is PROT_READ.
        Raises CudaRegistrationError where torch has no CUDA device, or the driver
        refuses (e.g. no read-only host registration on this GPU/driver: a newer driver
        is the fix; the error says the code)."""
        self._check_open()
        import torch

        with _LOCK:
            if self._shared.registered:
                return
            if not torch.cuda.is_available():
                raise CudaRegistrationError(
                    f"cannot register table {self.table!r} for CUDA: torch sees no CUDA device "
                    f"(torch {torch.__version__}); on a CPU host read the views directly")
            nbytes = self.weight.nbytes + self.scale.nbytes
            err = torch.cuda.cudart().cudaHostRegister(self.weight.ctypes.data, nbytes, _REGISTER_FLAGS)
            if int(err) != 0:
                raise CudaRegistrationError(
                    f"cudaHostRegister of table {self.table!r}'s split arena ({nbytes / 2**30:.2f} GiB, read-only) "
                    f"failed: {err}; read-only host registration needs CUDA 11.1+ and a device with "
                    f"cudaDevAttrHostRegisterReadOnlySupported, and the pages must fit the locked-memory limit "
                    f"(ulimit -l)")
            self._shared.registered = True

    def close(self) -> None:
        """Let go of this table (idempotent); the last SplitTable of the arena unregisters and unmaps it.
        Views and tensors taken from it must not be used afterwards."""
        if self._shared is None:
            return
        with _LOCK:
            shared, self._shared = self._shared, None
            shared.users -= 1
            if shared.users == 0:
                _SHARED.pop(self._key, None)
                if shared.registered:
                    import torch

                    torch.cuda.cudart().cudaHostUnregister(shared.mapped.split_rows.weight.ctypes.data)
                shared.mapped.drop()
        self.weight = self.scale = self._tensors = None

    def _check_open(self) -> None:
        if self._shared is None:
            raise errors.InvalidArgument(f"SplitTable {self.table!r} is closed; call Client.split_table again")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"SplitTable({self.table!r} v{self.version}, {self.rows} rows x {self.row_dim} + {self.row_dim // 32} B)"

