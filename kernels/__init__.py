"""Device kernels: gather(+dequantise) rows and the Engram gate.

Each kernel is a Triton kernel for CUDA beside a launcher that validates its
inputs, plus a torch reference of the same math that runs everywhere else.
`backend="auto"` chooses between them (see tierstore.kernels.dispatch).
"""
from tierstore.kernels.dispatch import choose_backend, triton_available
from tierstore.kernels.gate import engram_gate, engram_gate_torch
from tierstore.kernels.gather import gather_rows, gather_rows_torch

__all__ = ["gather_rows", "gather_rows_torch", "engram_gate", "engram_gate_torch",
           "choose_backend", "triton_available"]
