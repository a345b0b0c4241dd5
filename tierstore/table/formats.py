"""Row formats: how one table row is laid out in bytes, on disk and in the arena.

Rows are stored and served bit-exact as ingested; dequantisation happens in the
kernel on the device that consumes the row. The numpy helpers here encode
synthetic rows (demo tables, tests) and decode rows for reference checks.

fp8-e4m3-ue8m0 row of width D (D % 32 == 0): D bytes of float8 e4m3fn values,
then D/32 bytes of ue8m0 block scales (scale = 2**(byte - 127), one per 32
values). DeepSeek-V4.1: D=256 -> 256 + 8 = 264 bytes.
"""
from __future__ import annotations

from enum import Enum

import numpy as np

from tierstore.errors import InvalidArgument

__all__ = ["RowFormat", "encode_rows", "decode_rows", "FP8_BLOCK", "UE8M0_BIAS", "E4M3_MAX"]

FP8_BLOCK = 32
UE8M0_BIAS = 127
E4M3_MAX = 448.0


class RowFormat(str, Enum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8_E4M3_UE8M0 = "fp8-e4m3-ue8m0"

    @classmethod
    def parse(cls, name: "str | RowFormat") -> "RowFormat":
        try:
            return cls(name)
        except ValueError:
            known = ", ".join(f.value for f in cls)
            raise ValueError(f"unknown row format {name!r}; known formats: {known}") from None

    def row_bytes(self, dim: int) -> int:
        """Bytes of one row holding `dim` values."""
        if dim <= 0:
            raise ValueError(f"row width must be positive, got {dim}")
        if self is RowFormat.FP32:
            return 4 * dim
        if self in (RowFormat.BF16, RowFormat.FP16):
            return 2 * dim
        if dim % FP8_BLOCK:
            raise ValueError(f"fp8-e4m3-ue8m0 rows need a width divisible by {FP8_BLOCK}, got {dim}")
        return dim + dim // FP8_BLOCK


# Largest finite value of each lossy format: a finite fp32 beyond it (after
# round-to-nearest-even, hence the half-ulp margin) would be stored as inf.
_FINITE_MAX = {"bf16": (3.3895313892515355e38, 2.0 ** 119), "fp16": (65504.0, 16.0)}  # (max, half ulp)


def encode_rows(values: np.ndarray, fmt: "RowFormat | str", first_row: int = 0) -> np.ndarray:
    """float32 [n, D] -> uint8 [n, row_bytes] in `fmt` (round to nearest even).

    fp32 keeps every value bit-exact (inf and nan included). The lossy formats
    refuse (InvalidArgument, naming row ``first_row + i`` and column) a
    non-finite value - in fp8 it would spoil its whole 32-value scale block -
    and, for bf16/fp16, a finite value that would round to inf.
    """
    import torch

    fmt = RowFormat.parse(fmt)
    values = np.ascontiguousarray(values, dtype=np.float32)
    if fmt is not RowFormat.FP32:
        _check_representable(values, fmt, first_row)
    x = torch.from_numpy(values)
    n, dim = x.shape
    if fmt is RowFormat.FP32:
        out = x
    elif fmt is RowFormat.BF16:
        out = x.to(torch.bfloat16)
    elif fmt is RowFormat.FP16:
        out = x.to(torch.float16)
    else:
        fmt.row_bytes(dim)
        blocks = x.reshape(n, dim // FP8_BLOCK, FP8_BLOCK)
        amax = blocks.abs().amax(dim=-1).clamp_min(1e-30)
        # smallest power of two that brings the block inside e4m3's range
        exp = torch.ceil(torch.log2(amax / E4M3_MAX)).clamp(-UE8M0_BIAS, 127).to(torch.int32)
        scaled = blocks / torch.pow(2.0, exp.to(torch.float32)).unsqueeze(-1)
        q = scaled.to(torch.float8_e4m3fn).reshape(n, dim).view(torch.uint8)
        s = (exp + UE8M0_BIAS).to(torch.uint8)
        return torch.cat([q, s], dim=1).numpy()
    return out.contiguous().view(torch.uint8).reshape(n, -1).numpy()


def _check_representable(values: np.ndarray, fmt: RowFormat, first_row: int) -> None:
    top, half_ulp = _FINITE_MAX.get(fmt.value, (np.inf, 0.0))
    limit = top + half_ulp
    with np.errstate(invalid="ignore"):
        bad = ~(np.abs(values) < limit)  # nan compares False
    if bad.any():
        r, c = np.argwhere(bad)[0]
        v = values[r, c]
        why = "is not finite" if not np.isfinite(v) else f"rounds to inf in {fmt.value} (largest finite {top:.6g})"
        raise InvalidArgument(f"value {v} at row {first_row + int(r)}, column {int(c)} {why}; {fmt.value} cannot "
                              f"store it. Fix the source or keep fp32 (--format fp32)")


def decode_rows(rows: np.ndarray, fmt: "RowFormat | str", dim: int) -> np.ndarray:
    """uint8 [n, row_bytes] -> float32 [n, dim] (exact widening; the reference dequant)."""
    import torch

    fmt = RowFormat.parse(fmt)
    rows = np.ascontiguousarray(rows, dtype=np.uint8)
    if rows.ndim != 2 or rows.shape[1] != fmt.row_bytes(dim):
        raise ValueError(f"expected rows of shape [n, {fmt.row_bytes(dim)}], got {rows.shape}")
    t = torch.from_numpy(rows)
    if fmt is RowFormat.FP32:
        return t.view(torch.float32).numpy().copy()
    if fmt is RowFormat.BF16:
        return t.view(torch.bfloat16).float().numpy()
    if fmt is RowFormat.FP16:
        return t.view(torch.float16).float().numpy()
    q = t[:, :dim].contiguous().view(torch.float8_e4m3fn).float()
    exp = t[:, dim:].to(torch.float32) - UE8M0_BIAS
    scale = torch.pow(2.0, exp).repeat_interleave(FP8_BLOCK, dim=1)
    return (q * scale).numpy()
