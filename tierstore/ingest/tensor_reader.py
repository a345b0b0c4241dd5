"""Checkpoint tensors read lazily, by row slices, in bounded memory: safetensors, .npy, torch state dicts."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from tierstore import bounded_json
from tierstore.errors import InvalidArgument, SpecMismatch

__all__ = ["Tensor", "open_tensors", "pick", "dtype_name"]


class Tensor:
    """One checkpoint tensor read lazily by row slices (as torch tensors)."""

    def __init__(self, name: str, shape, dtype, read):
        self.name, self.shape, self.dtype, self.read = name, tuple(shape), dtype, read


def _pread_rows(path: Path, offset: int, shape, dtype):
    """Row reader for a C-ordered tensor stored raw at `offset` in `path`.

    pread into a fresh buffer rather than slicing a memory map: pages of a
    mapped file count in the process's RSS once touched, so a mapped 98 GB table
    would look like 98 GB of memory use; read pages stay only in the page cache.
    """
    import torch

    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()

    def read(a: int, b: int):
        buf = np.empty((b - a) * row_bytes, dtype=np.uint8)
        got = 0
        with open(path, "rb") as f:
            while got < buf.nbytes:
                n = os.preadv(f.fileno(), [memoryview(buf)[got:]], offset + a * row_bytes + got)
                if n == 0:
                    break
                got += n
        if got != buf.nbytes:
            raise SpecMismatch(f"{path} is truncated: rows {a}..{b - 1} are missing")
        return torch.from_numpy(buf).view(dtype).reshape((b - a,) + tuple(shape[1:]))
    return read


def open_tensors(src: Path) -> dict[str, Tensor]:
    import struct

    import torch

    with open(src, "rb") as f:
        head = f.read(8)
    if head.startswith(b"\x93NUMPY"):
        arr = np.load(src, mmap_mode="r")
        dtype = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16,
                 np.dtype(np.uint8): torch.uint8}.get(arr.dtype)
        if dtype is None:
            raise SpecMismatch(f"{src} holds {arr.dtype} values; .npy tables must be float32, float16 or "
                               f"uint8 packed rows")
        if not arr.flags.c_contiguous:
            raise SpecMismatch(f"{src} is stored in Fortran order; save it C-ordered (np.ascontiguousarray)")
        return {src.stem: Tensor(src.stem, arr.shape, dtype, _pread_rows(src, arr.offset, arr.shape, dtype))}
    if head.startswith(b"PK") or head[:2] == b"\x80\x02":
        # torch's zip format has no raw offsets to pread; mapped pages count in RSS
        # as they are read (they are page cache and reclaimable). Prefer safetensors.
        try:
            obj = torch.load(src, mmap=True, weights_only=True, map_location="cpu")
        except Exception as e:  # noqa: BLE001 - RuntimeError, UnpicklingError, zip errors: all "cannot read"
            why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            if head[:2] == b"\x80\x02":
                raise InvalidArgument(f"{src} is a torch.save file in the legacy (pre-1.6) format, which cannot be "
                                      f"read in bounded memory; save it again with torch.save's default (zip) "
                                      f"format or as safetensors") from None
            raise InvalidArgument(f"{src} is a zip file but not a torch state dict tierstore can load safely "
                                  f"({why}); give a safetensors, .npy or torch.save file") from None
        flat: dict[str, torch.Tensor] = {}

        def walk(prefix, o):
            if isinstance(o, torch.Tensor):
                flat[prefix or src.stem] = o
            elif isinstance(o, dict):
                for k, v in o.items():
                    walk(f"{prefix}.{k}" if prefix else str(k), v)
        walk("", obj)
        return {k: Tensor(k, t.shape, t.dtype, lambda a, b, t=t: t[a:b].contiguous()) for k, t in flat.items()}
    from safetensors import safe_open

    try:
        with safe_open(str(src), framework="pt") as f:  # validates the file, gives torch dtypes
            meta = {k: (f.get_slice(k).get_shape(), f.get_slice(k)[0:0].dtype if f.get_slice(k).get_shape()
                        else f.get_tensor(k).dtype) for k in f.keys()}
    except Exception as e:
        raise InvalidArgument(f"{src} is not a safetensors file, a .npy file or a torch state dict ({e})") from None
    with open(src, "rb") as f:  # safe_open has checked the header; parsed within the same limits
        (n,) = struct.unpack("<Q", f.read(8))
        header = bounded_json.loads(f.read(n), max_bytes=n)
    return {k: Tensor(k, shape, dtype, _pread_rows(src, 8 + n + header[k]["data_offsets"][0], shape, dtype))
            for k, (shape, dtype) in meta.items()}


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pick(tensors: dict[str, Tensor], key, want, what: str, src) -> Tensor:
    if key is not None:
        if key not in tensors:
            raise InvalidArgument(f"{src} has no tensor {key!r}; tensors are {sorted(tensors)}")
        return tensors[key]
    found = list(tensors.values()) if len(tensors) == 1 and what == "table" else [t for t in tensors.values() if want(t)]
    if len(found) != 1:
        raise InvalidArgument(f"{src} holds tensors {sorted(tensors)}; choose the {what} with "
                              f"{'--key' if what == 'table' else '--scale-key'}")
    return found[0]
