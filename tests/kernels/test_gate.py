"""engram_gate: the torch reference against the formula written out in float64,
the Triton kernel against the reference through Triton's CPU interpreter (a child
pytest run, so TRITON_INTERPRET never leaks), and launcher errors.

Tolerance Triton vs reference: fp32 outputs within 1e-5 (summation order);
bf16/fp16 outputs within 1 ULP of the output dtype, because a tiny fp32
difference can flip a rounding and the interpreter rounds fp32 -> bf16 by truncation.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from tierstore.errors import InvalidArgument
from tierstore.kernels import dispatch, engram_gate

CHILD = os.environ.get("TIERSTORE_KERNEL_TEST_CHILD") == "1"
interp = pytest.mark.skipif(not CHILD, reason="runs in the interpreter child of test_triton_gate_under_interpreter")
MANTISSA = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


def inputs(T, M, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, M, D, generator=g).to(dtype)
    k = torch.randn(T, M, D, generator=g).to(dtype)
    v = torch.randn(T, D, generator=g).to(dtype)
    w_h = (1 + 0.1 * torch.randn(M, D, generator=g)).to(dtype)
    w_k = (1 + 0.1 * torch.randn(M, D, generator=g)).to(dtype)
    return h, k, v, w_h, w_k


def formula(h, k, v, w_h, w_k, eps=1e-6, residual=True):
    """The gate exactly as written in DESIGN.md, in float64."""
    h, k, v, w_h, w_k = (t.double() for t in (h, k, v, w_h, w_k))
    rms = lambda x: x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)  # noqa: E731
    g = (rms(k) * w_k * rms(h) * w_h).sum(-1) / math.sqrt(h.shape[-1])
    g = torch.sign(g) * torch.sqrt(torch.clamp(g.abs(), min=1e-6))
    return (h if residual else 0) + torch.sigmoid(g)[..., None] * v[:, None, :]


def assert_within_ulp(got, want, ulps=1):
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.double(), want.double()
    if want.dtype == torch.float32:
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        return
    ulp = torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(1e-30))) - MANTISSA[want.dtype])
    bad = (g - w).abs() > ulps * ulp + 1e-6
    assert not bad.any(), f"{int(bad.sum())} values off by more than {ulps} ULP, e.g. {g[bad][:4]} vs {w[bad][:4]}"


# ---------------------------------------------------------------- reference

@pytest.mark.parametrize("T,M,D", [(1, 1, 48), (7, 4, 64), (33, 2, 96)])
@pytest.mark.parametrize("residual", [True, False])
def test_reference_matches_formula(T, M, D, residual):
    x = inputs(T, M, D)
    got = engram_gate(*x, residual=residual, backend="torch")
    assert got.dtype == torch.float32 and got.shape == (T, M, D)
    torch.testing.assert_close(got.double(), formula(*x, residual=residual), rtol=1e-5, atol=1e-5)


def test_reference_keeps_h_dtype_and_gate_limits():
    h, k, v, w_h, w_k = inputs(5, 4, 64, torch.bfloat16)
    out = engram_gate(h, k, v, w_h, w_k, backend="torch")
    assert out.dtype == torch.bfloat16
    # no memory value: output is h unchanged
    assert torch.equal(engram_gate(h, k, torch.zeros_like(v), w_h, w_k, backend="torch"), h)
    # a zero key gives g = 0, so the gate is sigmoid(0) = 1/2
    half = engram_gate(h, torch.zeros_like(k), v, w_h, w_k, residual=False, backend="torch")
    assert torch.equal(half, (0.5 * v.float()).to(torch.bfloat16).unsqueeze(1).expand_as(h))


@pytest.mark.parametrize("bad,msg", [
    (lambda x: dict(k=x[1][:, :2]), r"k must have shape \[3, 4, 48\]"),
    (lambda x: dict(v=x[2][:, :40]), r"v must have shape \[3, 48\]"),
    (lambda x: dict(w_h=x[3][:3]), "w_h must have shape"),
    (lambda x: dict(w_k=x[4].t()), "w_k must have shape"),
    (lambda x: dict(h=x[0][0]), r"h must be \[T, M, D\]"),
    (lambda x: dict(h=x[0].to(torch.int32)), "h must be a floating-point tensor"),
    (lambda x: dict(v=[0.0]), "v must be a floating-point tensor"),
    (lambda x: dict(backend="cuda"), "unknown kernel backend"),
])
def test_bad_arguments_raise_invalid_argument(bad, msg):
    x = inputs(3, 4, 48)
    args = dict(zip(("h", "k", "v", "w_h", "w_k"), x))
    args.update(bad(x))
    with pytest.raises(InvalidArgument, match=msg):
        engram_gate(**args)


# ---------------------------------------------------------------- Triton kernel (interpreter child)

@pytest.mark.skipif(CHILD, reason="this is the parent of the interpreter run")
def test_triton_gate_under_interpreter(interpreter_child):
    interpreter_child(__file__)


def both(*x, **kw):
    return engram_gate(*x, backend="triton", **kw), engram_gate(*x, backend="torch", **kw)


@interp
def test_interp_auto_runs_triton():
    assert dispatch.INTERPRET and dispatch.choose_backend("auto", torch.zeros(1)) == "triton"


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,M,D", [(1, 1, 48), (7, 4, 64), (33, 2, 256)])
def test_interp_matches_reference(dtype, T, M, D):
    x = inputs(T, M, D, dtype, seed=T)
    for residual in (True, False):
        assert_within_ulp(*both(*x, residual=residual))


@interp
def test_interp_strided_inputs_and_d_past_one_block():
    T, M, D = 3, 2, 4100  # D > the 4096-wide block: exercises the chunk loop and its masks
    h, k, v, w_h, w_k = inputs(T, M, D)
    assert_within_ulp(*both(h, k, v, w_h, w_k, eps=1e-3))
    big = torch.randn(4, 6, 3, 64)
    h = big[:, 1:5:2, 0]             # [4, 2, 64], leading strides not packed
    k = big.transpose(0, 1)[:2, :4, 1].transpose(0, 1)  # [4, 2, 64], transposed leading dims
    v = torch.randn(64, 4).t()       # inner stride != 1: copied by the launcher
    w = torch.ones(2, 64)
    assert not h.is_contiguous() and not k.is_contiguous() and not v.is_contiguous()
    assert_within_ulp(*both(h, k, v, w, w))
