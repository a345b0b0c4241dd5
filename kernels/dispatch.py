"""Backend choice for the kernels: Triton where it can run, the torch reference elsewhere.

`backend="auto"` picks Triton when an input lives on a CUDA device, or when the
Triton kernels were built for Triton's CPU interpreter (env `TRITON_INTERPRET=1`
set before `tierstore.kernels` was first imported); otherwise it picks the torch
reference. Env `TIERSTORE_FORCE_TORCH=1` makes "auto" pick the reference always.
An explicit `backend="torch"` or `backend="triton"` is honoured as asked.
"""
from __future__ import annotations

import os

import torch

from tierstore.errors import InvalidArgument

__all__ = ["BACKENDS", "INTERPRET", "triton_available", "choose_backend"]

try:  # triton is optional: CPU-only installs run the torch reference
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

BACKENDS = ("auto", "torch", "triton")


def _env_on(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


# triton.jit decides interpreter vs compiler when a kernel is decorated, i.e.
# when this package is imported, so the env is read once here, not per call.
INTERPRET = triton is not None and _env_on("TRITON_INTERPRET")


def triton_available() -> bool:
    """True when the triton package could be imported."""
    return triton is not None


def choose_backend(backend: str, *tensors: torch.Tensor | None) -> str:
    """Resolve `backend` ("auto" | "torch" | "triton") to "torch" or "triton" for these inputs.

    Raises InvalidArgument for an unknown name, or for "triton" where it cannot
    run (triton missing, or CPU tensors without the interpreter).
    """
    if backend not in BACKENDS:
        raise InvalidArgument(f"unknown kernel backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    on_cuda = any(t is not None and t.is_cuda for t in tensors)
    if backend == "torch":
        return "torch"
    if backend == "auto":
        if _env_on("TIERSTORE_FORCE_TORCH") or triton is None:
            return "torch"
        return "triton" if (on_cuda or INTERPRET) else "torch"
    if triton is None:
        raise InvalidArgument("backend='triton' needs the triton package; pip install 'tierstore[gpu]' "
                              "or use backend='torch'")
    if not on_cuda and not INTERPRET:
        raise InvalidArgument("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before "
                              "tierstore.kernels is imported; move the tensors to CUDA or use backend='torch'")
    return "triton"
