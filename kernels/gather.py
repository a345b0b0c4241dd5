"""Gather rows from the HBM cache or the shared DRAM arena and dequantise them.

`gather_rows` is the public entry: it validates its inputs on the host, then runs
either the Triton kernel (`_gather_kernel`, one program per block of output rows
x block of columns) or the torch reference (`gather_rows_torch`). Both do the
same math and agree bit for bit: every format widens to fp32 exactly, the fp8
block scale is a power of two, and the fp32 -> bf16 output rounding is done with
explicit round-to-nearest-even on the bits (so the interpreter matches too).

Strides: `slots` and `inverse` are made contiguous (they are small). `cache` and
`arena` are never copied: any row stride is accepted, but each row's bytes must
be contiguous (last stride 1); a padded arena can be passed as `arena[:, :row_bytes]`.

One cohesive thing (a little over the house's 300 lines): the gather kernel, its
launcher's checks and its torch reference belong side by side.
"""
from __future__ import annotations

import torch

from tierstore.errors import IdOutOfRange, InvalidArgument
from tierstore.table.formats import FP8_BLOCK, RowFormat

from tierstore.kernels.dispatch import choose_backend, tl, triton

__all__ = ["OUT_DTYPES", "gather_rows", "gather_rows_torch", "decode_rows_torch"]

OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FMT_CODE = {RowFormat.FP32: 0, RowFormat.BF16: 1, RowFormat.FP16: 2, RowFormat.FP8_E4M3_UE8M0: 3}
_OUT_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ELEM_BYTES = {0: 4, 1: 2, 2: 2, 3: 1}


def gather_rows(slots: torch.Tensor, cache: torch.Tensor | None, arena: torch.Tensor | None,
                row_format: "str | RowFormat", dim: int, out_dtype: torch.dtype = torch.float32,
                inverse: torch.Tensor | None = None, *, backend: str = "auto",
                check_bounds: bool = True) -> torch.Tensor:
    """Read rows by slot and dequantise them to `out_dtype`.

    slots: int64/int32 [U]. A slot s >= 0 reads row s of `cache`; s < 0 reads row
        -s-1 of `arena` (so -1 is arena row 0).
    cache: uint8 [Nc, row_bytes], the per-worker device cache, or None.
    arena: uint8 [Na, row_bytes], the shared DRAM arena, or None. With CUDA
        inputs it may be a CPU tensor in registered (pinned) host memory: the
        kernel then reads it over UVA.
    row_format, dim: the table's RowFormat (or its name) and values per row;
        row_bytes must equal RowFormat.row_bytes(dim).
    out_dtype: torch.float32, torch.bfloat16 or torch.float16.
    inverse: optional int [...] into `slots` (as from torch.unique(return_inverse=True));
        then out[i] = row(slots[inverse[i]]) and the result has shape inverse.shape + (dim,).
    backend: "auto" (see tierstore.kernels.dispatch), "torch" or "triton".
    check_bounds: validate slot and inverse ranges on the host (one device sync
        on CUDA). With False, out-of-range slots or inverse entries read as zero
        rows; the kernel still never reads out of bounds.

    Returns [U, dim] (or inverse.shape + (dim,)) in out_dtype, on slots' device.
    Raises InvalidArgument for wrong dtypes, shapes, row widths or formats, and
    IdOutOfRange for a slot past the end of its cache/arena or an inverse
    entry past the end of slots.
    """
    fmt = _parse_format(row_format, dim)
    _check_inputs(slots, cache, arena, fmt, dim, out_dtype, inverse)
    slots = slots.contiguous()
    inverse = None if inverse is None else inverse.contiguous()
    if check_bounds:
        _check_ranges(slots, cache, arena, inverse)
    if choose_backend(backend, slots, cache, arena) == "torch":
        return gather_rows_torch(slots, cache, arena, fmt, dim, out_dtype, inverse)
    return _gather_triton(slots, cache, arena, fmt, dim, out_dtype, inverse)


# ---------------------------------------------------------------- validation

def _parse_format(row_format, dim: int) -> RowFormat:
    try:
        fmt = RowFormat.parse(row_format)
        fmt.row_bytes(int(dim))
    except ValueError as e:
        raise InvalidArgument(str(e)) from None
    return fmt


def _check_inputs(slots, cache, arena, fmt, dim, out_dtype, inverse) -> None:
    if not isinstance(slots, torch.Tensor) or slots.dtype not in (torch.int64, torch.int32) or slots.dim() != 1:
        got = f"{slots.dtype} {tuple(slots.shape)}" if isinstance(slots, torch.Tensor) else type(slots).__name__
        raise InvalidArgument(f"slots must be a 1-D int64/int32 tensor, got {got}")
    if out_dtype not in OUT_DTYPES:
        raise InvalidArgument(f"out_dtype {out_dtype} is not supported; use float32, bfloat16 or float16")
    if cache is None and arena is None:
        raise InvalidArgument("gather_rows needs a cache, an arena, or both; got neither")
    row_bytes = fmt.row_bytes(dim)
    for name, t in (("cache", cache), ("arena", arena)):
        if t is None:
            continue
        if t.dtype != torch.uint8 or t.dim() != 2:
            raise InvalidArgument(f"{name} must be a 2-D uint8 tensor of rows, got {t.dtype} {tuple(t.shape)}")
        if t.shape[1] != row_bytes:
            raise InvalidArgument(f"{name} rows are {t.shape[1]} bytes but a {fmt.value} row of {dim} values "
                                  f"is {row_bytes} bytes; check row_format and dim against the table spec")
        if t.stride(1) != 1 and t.shape[1] > 1:
            raise InvalidArgument(f"{name} rows must be contiguous bytes (last stride 1), got strides {t.stride()}")
    if cache is not None and cache.device != slots.device:
        raise InvalidArgument(f"slots are on {slots.device} but the cache is on {cache.device}; move slots there")
    if arena is not None and arena.device != slots.device:
        if not (slots.is_cuda and arena.device.type == "cpu" and arena.is_pinned()):
            raise InvalidArgument(f"slots are on {slots.device} but the arena is on {arena.device}; a CPU arena "
                                  "used from CUDA must be registered host memory (cudaHostRegister)")
    if inverse is not None:
        if not isinstance(inverse, torch.Tensor) or inverse.dtype not in (torch.int64, torch.int32):
            raise InvalidArgument(f"inverse must be an int64/int32 tensor, got {getattr(inverse, 'dtype', inverse)}")
        if inverse.device != slots.device:
            raise InvalidArgument(f"inverse is on {inverse.device} but slots are on {slots.device}")


def _check_ranges(slots, cache, arena, inverse) -> None:
    if slots.numel():
        lo, hi = (int(x) for x in torch.aminmax(slots))
        n_cache = 0 if cache is None else cache.shape[0]
        n_arena = 0 if arena is None else arena.shape[0]
        if hi >= n_cache:
            raise IdOutOfRange(f"slot {hi} is out of range: the HBM cache has {n_cache} rows "
                               "(slots >= 0 index the cache); re-plan the step or pass the right cache")
        if -lo - 1 >= n_arena:
            raise IdOutOfRange(f"slot {lo} addresses arena row {-lo - 1}, but the arena has {n_arena} rows "
                               "(slot -1-r reads arena row r); re-plan the step or pass the right arena")
    if inverse is not None and inverse.numel():
        lo, hi = (int(x) for x in torch.aminmax(inverse))
        if lo < 0 or hi >= slots.numel():
            bad = lo if lo < 0 else hi
            raise IdOutOfRange(f"inverse entry {bad} is out of range for {slots.numel()} slots; "
                               "inverse must index into slots (0 <= i < len(slots))")


# ---------------------------------------------------------------- torch reference

def decode_rows_torch(rows: torch.Tensor, fmt: RowFormat, dim: int) -> torch.Tensor:
    """uint8 [n, row_bytes] -> float32 [n, dim]; the kernel's math, in torch."""
    rows = rows.contiguous()
    n = rows.shape[0]
    if fmt is RowFormat.FP32:
        return rows.view(torch.float32).reshape(n, dim)
    if fmt is RowFormat.BF16:
        return rows.view(torch.bfloat16).reshape(n, dim).float()
    if fmt is RowFormat.FP16:
        return rows.view(torch.float16).reshape(n, dim).float()
    q = rows[:, :dim].contiguous().view(torch.float8_e4m3fn).float()
    s = rows[:, dim:].to(torch.int32)
    # 2**(s-127) built from its bits: s=0 is the subnormal 2**-127, s=255 is inf
    scale = torch.where(s == 0, 1 << 22, s << 23).view(torch.float32)
    return (q.view(n, dim // FP8_BLOCK, FP8_BLOCK) * scale.unsqueeze(-1)).view(n, dim)


def gather_rows_torch(slots, cache, arena, fmt: RowFormat, dim: int,
                      out_dtype: torch.dtype = torch.float32, inverse=None) -> torch.Tensor:
    """Reference gather: pick the rows, decode the U unique rows once, expand by inverse."""
    fmt = RowFormat.parse(fmt)
    slots = slots.to(torch.int64)
    n, row_bytes = slots.numel(), fmt.row_bytes(dim)
    rows = None
    for src, idx in ((cache, slots), (arena, -slots - 1)):
        if src is None:
            continue
        pos = ((idx >= 0) & (idx < src.shape[0]) & ((slots >= 0) == (src is cache))).nonzero().squeeze(1)
        # index_select/index_copy_: several times faster than boolean-mask indexing on CPU
        if pos.numel() == n:
            rows = src.index_select(0, idx.to(src.device)).to(slots.device)
            break
        if rows is None:  # zeros: a slot past the end (check_bounds=False) reads as a zero row, as in the kernel
            rows = torch.zeros((n, row_bytes), dtype=torch.uint8, device=slots.device)
        picked = src.index_select(0, idx[pos].to(src.device)).to(slots.device)
        rows.index_copy_(0, pos, picked)
    if rows is None:
        rows = torch.zeros((n, row_bytes), dtype=torch.uint8, device=slots.device)
    out = decode_rows_torch(rows, fmt, dim).to(out_dtype)
    if inverse is not None:
        inv = inverse.to(torch.int64)
        bad = (inv < 0) | (inv >= n)
        if bool(bad.any()):  # only with check_bounds=False: zero rows, as in the kernel
            out = torch.cat([out, out.new_zeros(1, dim)])
            inv = torch.where(bad, n, inv)
        out = out[inv]
    return out


# ---------------------------------------------------------------- Triton kernel

if triton is not None:

    @triton.jit
    def _e4m3_bits_to_f32(b):
        # b: uint32 holding one float8 e4m3fn byte. Integer decode so the same
        # code compiles for sm_80 (no native fp8) and runs in the interpreter.
        sign = (b & 0x80) << 24
        e = (b >> 3) & 0xF
        m = b & 0x7
        normal = ((e + 120) << 23) | (m << 20)  # rebias 7 -> 127
        sub = (m.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True)  # m * 2**-9
        mag = tl.where(e == 0, sub, normal)
        mag = tl.where((b & 0x7F) == 0x7F, 0x7FF00000, mag)  # NaN, as torch widens it
        return (mag | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _load_block(base_ptr, row, stride, cols, mask, dim, FMT: tl.constexpr, ROW_ALIGN: tl.constexpr):
        # row: int64 [BLOCK_R]; stride: row stride in elements of the format's load type
        start = row * stride
        if ROW_ALIGN > 1:
            start = tl.multiple_of(start, ROW_ALIGN)  # lets the compiler vectorise the row loads
        offs = start[:, None] + cols[None, :]
        if FMT == 0:
            x = tl.load(base_ptr.to(tl.pointer_type(tl.float32)) + offs, mask=mask, other=0.0)
        elif FMT == 1:
            u = tl.load(base_ptr.to(tl.pointer_type(tl.uint16)) + offs, mask=mask, other=0)
            x = (u.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        elif FMT == 2:
            x = tl.load(base_ptr.to(tl.pointer_type(tl.float16)) + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            q = tl.load(base_ptr + offs, mask=mask, other=0).to(tl.uint32)
            s = tl.load(base_ptr + (start[:, None] + dim + cols[None, :] // 32), mask=mask, other=127)
            s = s.to(tl.uint32)
            scale = tl.where(s == 0, 1 << 22, s << 23).to(tl.float32, bitcast=True)
            x = _e4m3_bits_to_f32(q) * scale
        return x

    @triton.jit
    def _gather_kernel(slots_ptr, inv_ptr, cache_ptr, arena_ptr, out_ptr,
                       n_out, n_slots, n_cache, n_arena, cache_stride, arena_stride, dim,
                       FMT: tl.constexpr, OUT: tl.constexpr, HAS_INV: tl.constexpr,
                       HAS_CACHE: tl.constexpr, HAS_ARENA: tl.constexpr,
                       CACHE_ALIGN: tl.constexpr, ARENA_ALIGN: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        # int64 from the start: a 100 GB arena needs 64-bit row offsets
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        rmask = rows < n_out
        cmask = cols < dim
        if HAS_INV:
            idx = tl.load(inv_ptr + rows, mask=rmask, other=0).to(tl.int64)
            rmask = rmask & (idx >= 0) & (idx < n_slots)  # unchecked inverse: zero row, no stray read
        else:
            idx = rows
        slot = tl.load(slots_ptr + idx, mask=rmask, other=0).to(tl.int64)
        in_cache = slot >= 0
        x = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        if HAS_CACHE:
            ok = rmask & in_cache & (slot < n_cache)
            xc = _load_block(cache_ptr, slot, cache_stride, cols, ok[:, None] & cmask[None, :], dim,
                             FMT, CACHE_ALIGN)
            x = tl.where(ok[:, None], xc, x)
        if HAS_ARENA:
            arow = -slot - 1
            ok = rmask & (slot < 0) & (arow < n_arena)
            xa = _load_block(arena_ptr, arow, arena_stride, cols, ok[:, None] & cmask[None, :], dim,
                             FMT, ARENA_ALIGN)
            x = tl.where(ok[:, None], xa, x)
        out_offs = rows[:, None] * dim + cols[None, :]
        omask = (rows < n_out)[:, None] & cmask[None, :]  # rmask may exclude rows that still get zeros
        if OUT == 0:
            tl.store(out_ptr + out_offs, x, mask=omask)
        elif OUT == 1:
            # explicit round-to-nearest-even: identical on GPU, interpreter and torch
            b = x.to(tl.uint32, bitcast=True)
            r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
            r = tl.where(x != x, 0x7FC0, r)
            tl.store(out_ptr + out_offs, r.to(tl.uint16).to(tl.int16, bitcast=True), mask=omask)
        else:
            tl.store(out_ptr + out_offs, x.to(tl.float16), mask=omask)


def _align(t: torch.Tensor, elem: int) -> int:
    """Largest power of two <= 16 bytes dividing the base address and row stride, in elements."""
    a = 16
    while a > elem and (t.data_ptr() % a or t.stride(0) % a):
        a //= 2
    return a // elem


def _block_sizes(n_out: int, dim: int) -> tuple[int, int]:
    block_d = min(triton.next_power_of_2(dim), 512)
    block_r = max(1, min(4096 // block_d, 64, triton.next_power_of_2(max(n_out, 1))))
    return block_r, block_d


def _gather_triton(slots, cache, arena, fmt: RowFormat, dim: int, out_dtype, inverse) -> torch.Tensor:
    code = _FMT_CODE[fmt]
    elem = _ELEM_BYTES[code]
    for name, t in (("cache", cache), ("arena", arena)):
        if t is not None and (t.data_ptr() % elem or t.stride(0) % elem):
            raise InvalidArgument(f"{name} rows must start on {elem}-byte boundaries for {fmt.value}; "
                                  f"got base address {t.data_ptr():#x} and row stride {t.stride(0)}")
    shape = (slots.numel(),) if inverse is None else tuple(inverse.shape)
    n_out = 1
    for s in shape:
        n_out *= s
    out = torch.empty(shape + (dim,), dtype=out_dtype, device=slots.device)
    if n_out == 0:
        return out
    inv = slots if inverse is None else inverse.reshape(-1)
    dummy = cache if cache is not None else arena
    block_r, block_d = _block_sizes(n_out, dim)
    grid = (triton.cdiv(n_out, block_r), triton.cdiv(dim, block_d))
    _gather_kernel[grid](
        slots, inv, cache if cache is not None else dummy, arena if arena is not None else dummy,
        out.view(torch.int16) if out_dtype == torch.bfloat16 else out,
        n_out, slots.numel(), 0 if cache is None else cache.shape[0], 0 if arena is None else arena.shape[0],
        1 if cache is None else cache.stride(0) // elem, 1 if arena is None else arena.stride(0) // elem, dim,
        FMT=code, OUT=_OUT_CODE[out_dtype], HAS_INV=inverse is not None,
        HAS_CACHE=cache is not None, HAS_ARENA=arena is not None,
        CACHE_ALIGN=1 if cache is None else _align(cache, elem),
        ARENA_ALIGN=1 if arena is None else _align(arena, elem),
        BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4,
    )
    return out
