"""The Triton kernels compile to PTX and cubin for Hopper (sm_90) and Ampere (sm_80)
on this GPU-less machine, with the specialisations a real launch would get."""
from __future__ import annotations

import re

import pytest

from tierstore.kernels import dispatch, gate, gather

triton = pytest.importorskip("triton", reason="triton is not installed; nothing to compile")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

ARCHS = [90, 80]
WARP = 32
ALIGNED = [["tt.divisibility", 16]]  # what a launch infers for 16-byte-aligned pointers and ints


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    if dispatch.INTERPRET:
        pytest.skip("TRITON_INTERPRET=1 in this process: kernels were built for the interpreter")


def compile_for(fn, signature: dict, constexprs: dict, aligned: tuple, arch: int):
    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    names = list(sig)
    attrs = {(names.index(a),): ALIGNED for a in aligned}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", arch, WARP))


def assert_binary(k, arch: int, name: str):
    ptx, cubin = k.asm["ptx"], k.asm["cubin"]
    assert f".target sm_{arch}" in ptx and f".entry {name}" in ptx
    assert isinstance(cubin, bytes) and cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("arch", ARCHS)
def test_gather_fp8_rows_to_bf16_compiles(arch):
    # V4.1 rows: 256 fp8 values + 8 scale bytes = 264 B, a stride that is not 16-aligned
    signature = dict(slots_ptr="*i64", inv_ptr="*i64", cache_ptr="*u8", arena_ptr="*u8", out_ptr="*i16",
                     n_out="i32", n_slots="i32", n_cache="i32", n_arena="i64",
                     cache_stride="i32", arena_stride="i32", dim="i32")
    constexprs = dict(FMT=3, OUT=1, HAS_INV=True, HAS_CACHE=True, HAS_ARENA=True, CACHE_ALIGN=8,
                      ARENA_ALIGN=8, BLOCK_R=8, BLOCK_D=256)
    aligned = ("slots_ptr", "inv_ptr", "cache_ptr", "arena_ptr", "out_ptr", "dim")
    k = compile_for(gather._gather_kernel, signature, constexprs, aligned, arch)
    assert_binary(k, arch, "_gather_kernel")
    # the row-alignment hint turns 264-byte rows into 8-byte vector loads, not byte loads
    assert "ld.global.v2.b32" in k.asm["ptx"]
    # row offsets are 64-bit: a 100 GB arena overflows int32 byte offsets
    assert re.search(r"arith\.muli .*tensor<8xi64>", k.asm["ttir"])


@pytest.mark.parametrize("arch", ARCHS)
def test_gather_fp16_rows_compile(arch):
    signature = dict(slots_ptr="*i32", inv_ptr="*i32", cache_ptr="*u8", arena_ptr="*u8", out_ptr="*fp16",
                     n_out="i32", n_slots="i32", n_cache="i32", n_arena="i32",
                     cache_stride="i32", arena_stride="i32", dim="i32")
    constexprs = dict(FMT=2, OUT=2, HAS_INV=False, HAS_CACHE=False, HAS_ARENA=True, CACHE_ALIGN=1,
                      ARENA_ALIGN=8, BLOCK_R=16, BLOCK_D=64)
    k = compile_for(gather._gather_kernel, signature, constexprs, ("arena_ptr", "out_ptr", "dim"), arch)
    assert_binary(k, arch, "_gather_kernel")


@pytest.mark.parametrize("arch", ARCHS)
def test_gate_compiles(arch):
    signature = dict(h_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", wh_ptr="*fp32", wk_ptr="*fp32",
                     out_ptr="*bf16", n_rows="i32", M="i32", D="i32", sh_t="i32", sh_m="i32", sk_t="i32",
                     sk_m="i32", sv_t="i32", swh="i32", swk="i32", eps="fp32", inv_sqrt_d="fp32")
    constexprs = dict(RESIDUAL=True, BLOCK_R=1, BLOCK_D=4096)
    aligned = ("h_ptr", "k_ptr", "v_ptr", "wh_ptr", "wk_ptr", "out_ptr", "D", "sh_t", "sh_m", "sk_t", "sk_m",
               "sv_t", "swh", "swk")
    k = compile_for(gate._gate_kernel, signature, constexprs, aligned, arch)
    assert_binary(k, arch, "_gate_kernel")
