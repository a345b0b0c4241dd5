"""The Engram gate: mix a looked-up memory value into each hyper-connection branch.

For branch m of token t (all math in fp32):
    g_m   = <RMSNorm(k_m) * w_k_m, RMSNorm(h_m) * w_h_m> / sqrt(D)
    g_m   = sign(g_m) * sqrt(max(|g_m|, 1e-6))
    out_m = (h_m if residual else 0) + sigmoid(g_m) * v
with RMSNorm(x) = x / sqrt(mean(x^2) + eps). The dot product is computed as
rsqrt(mean h^2 + eps) * rsqrt(mean k^2 + eps) * sum(h*w_h*k*w_k), which is the
same math with the per-row scalars taken out of the sum, in both backends.

Strides: any strides on the leading dims of h, k, v, w_h, w_k are used as they
are; a tensor whose last dim is not contiguous is copied first.
Tolerance between backends (summation order, GPU rsqrt/sqrt approximations):
about 1e-5 relative for fp32 outputs, 1 ULP of the output dtype for bf16/fp16.
"""
from __future__ import annotations

import math

import torch

from tierstore.errors import InvalidArgument

from tierstore.kernels.dispatch import choose_backend, tl, triton

__all__ = ["engram_gate", "engram_gate_torch"]

_G_FLOOR = 1e-6


def engram_gate(h: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w_h: torch.Tensor, w_k: torch.Tensor,
                eps: float = 1e-6, residual: bool = True, *, backend: str = "auto") -> torch.Tensor:
    """Gate the memory value `v` into every branch of `h`.

    h: [T, M, D] hidden state per hyper-connection branch (any float dtype).
    k: [T, M, D] key projection of the looked-up embedding, per branch.
    v: [T, D] value projection of the looked-up embedding, shared by all branches.
    w_h, w_k: [M, D] RMSNorm weights for h and k, per branch.
    eps: RMSNorm epsilon. residual: add h to the output (False returns only the gated value).
    backend: "auto" (see tierstore.kernels.dispatch), "torch" or "triton".

    Returns [T, M, D] in h's dtype, on h's device. Raises InvalidArgument for
    mismatched shapes, non-float dtypes or tensors on different devices.
    """
    _check_inputs(h, k, v, w_h, w_k)
    if choose_backend(backend, h, k, v, w_h, w_k) == "torch":
        return engram_gate_torch(h, k, v, w_h, w_k, eps, residual)
    return _gate_triton(h, k, v, w_h, w_k, float(eps), bool(residual))


def _check_inputs(h, k, v, w_h, w_k) -> None:
    named = (("h", h), ("k", k), ("v", v), ("w_h", w_h), ("w_k", w_k))
    for name, t in named:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise InvalidArgument(f"{name} must be a floating-point tensor, got {got}")
        if t.device != h.device:
            raise InvalidArgument(f"{name} is on {t.device} but h is on {h.device}; put all gate inputs on one device")
    if h.dim() != 3:
        raise InvalidArgument(f"h must be [T, M, D], got shape {tuple(h.shape)}")
    T, M, D = h.shape
    want = {"k": (T, M, D), "v": (T, D), "w_h": (M, D), "w_k": (M, D)}
    for name, t in named[1:]:
        if tuple(t.shape) != want[name]:
            raise InvalidArgument(f"{name} must have shape {list(want[name])} to match h {list(h.shape)}, "
                                  f"got {list(t.shape)}")


def engram_gate_torch(h, k, v, w_h, w_k, eps: float = 1e-6, residual: bool = True) -> torch.Tensor:
    """Reference gate in torch, fp32 math; same formula as the Triton kernel."""
    hf, kf, vf = h.float(), k.float(), v.float()
    D = h.shape[-1]
    # einsum runs these row dot products as batched matmuls (same math as mul+sum, without
    # the [T, M, D] product in memory; docs/decisions.md, "The gate's reference")
    rh = torch.rsqrt(torch.einsum("tmd,tmd->tm", hf, hf) / D + eps)
    rk = torch.rsqrt(torch.einsum("tmd,tmd->tm", kf, kf) / D + eps)
    dot = torch.einsum("tmd,tmd->tm", hf * w_h.float(), kf * w_k.float())
    g = dot * rh * rk * (1.0 / math.sqrt(D))
    g = torch.sign(g) * torch.sqrt(g.abs().clamp_min(_G_FLOOR))
    gate = torch.sigmoid(g).unsqueeze(-1)
    vb = vf.unsqueeze(1)
    out = torch.addcmul(hf, gate, vb) if residual else gate * vb
    return out.to(h.dtype)


if triton is not None:

    @triton.jit
    def _gate_kernel(h_ptr, k_ptr, v_ptr, wh_ptr, wk_ptr, out_ptr,
                     n_rows, M, D,
                     sh_t, sh_m, sk_t, sk_m, sv_t, swh, swk,
                     eps, inv_sqrt_d,
                     RESIDUAL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        # one program per BLOCK_R (token, branch) rows; loops over D in BLOCK_D chunks
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = r < n_rows
        t = r // M
        m = r % M
        h_row = t * sh_t + m * sh_m
        k_row = t * sk_t + m * sk_m
        v_row = t * sv_t
        wh_row = m * swh
        wk_row = m * swk
        acc_hh = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        acc_kk = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        acc_hk = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            mask = rmask[:, None] & (cols < D)[None, :]
            hx = tl.load(h_ptr + h_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            kx = tl.load(k_ptr + k_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            wh = tl.load(wh_ptr + wh_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            wk = tl.load(wk_ptr + wk_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            acc_hh += hx * hx
            acc_kk += kx * kx
            acc_hk += (hx * wh) * (kx * wk)
        rh = tl.rsqrt(tl.sum(acc_hh, axis=1) / D + eps)
        rk = tl.rsqrt(tl.sum(acc_kk, axis=1) / D + eps)
        g = tl.sum(acc_hk, axis=1) * rh * rk * inv_sqrt_d
        sign = tl.where(g > 0, 1.0, tl.where(g < 0, -1.0, 0.0))
        g = sign * tl.sqrt(tl.maximum(tl.abs(g), 1e-6))
        gate = tl.sigmoid(g)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            mask = rmask[:, None] & (cols < D)[None, :]
            vx = tl.load(v_ptr + v_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            y = gate[:, None] * vx
            if RESIDUAL:
                y += tl.load(h_ptr + h_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + r[:, None] * D + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _inner_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _gate_triton(h, k, v, w_h, w_k, eps: float, residual: bool) -> torch.Tensor:
    h, k, v, w_h, w_k = (_inner_contiguous(t) for t in (h, k, v, w_h, w_k))
    T, M, D = h.shape
    out = torch.empty((T, M, D), dtype=h.dtype, device=h.device)
    n_rows = T * M
    if n_rows == 0 or D == 0:
        return out
    block_d = min(triton.next_power_of_2(D), 4096)
    block_r = max(1, min(2048 // block_d, triton.next_power_of_2(n_rows)))
    grid = (triton.cdiv(n_rows, block_r),)
    _gate_kernel[grid](
        h, k, v, w_h, w_k, out, n_rows, M, D,
        h.stride(0), h.stride(1), k.stride(0), k.stride(1), v.stride(0), w_h.stride(0), w_k.stride(0),
        eps, 1.0 / math.sqrt(D),
        RESIDUAL=residual, BLOCK_R=block_r, BLOCK_D=block_d,
        num_warps=8 if block_r * block_d >= 4096 else 4,
    )
    return out
