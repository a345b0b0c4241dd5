"""gather_rows: the torch reference against formats.decode_rows, the Triton kernel
against the reference (through Triton's CPU interpreter, in a child pytest run so
TRITON_INTERPRET never leaks into other test modules), and launcher errors."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.errors import IdOutOfRange, InvalidArgument
from tierstore.table.formats import RowFormat, decode_rows, encode_rows
from tierstore.kernels import choose_backend, gather_rows, triton_available
from tierstore.kernels import dispatch

CHILD = os.environ.get("TIERSTORE_KERNEL_TEST_CHILD") == "1"
interp = pytest.mark.skipif(not CHILD, reason="runs in the interpreter child of test_triton_kernel_under_interpreter")
FP8 = RowFormat.FP8_E4M3_UE8M0.value
CASES = [("fp32", 48), ("bf16", 48), ("fp16", 48), ("fp32", 64), (FP8, 32), (FP8, 64), (FP8, 96), (FP8, 256)]
OUT = [torch.float32, torch.bfloat16, torch.float16]


def make_table(fmt: str, dim: int, n: int, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    # wide dynamic range so fp8 blocks get different scales, some tiny (subnormal) values
    vals = rng.standard_normal((n, dim)).astype(np.float32) * np.exp2(rng.integers(-12, 12, (n, 1)))
    return torch.from_numpy(encode_rows(vals, fmt))


def mixed_slots(n: int, n_cache: int, n_arena: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    cache = torch.randint(0, n_cache, (n,), generator=g)
    arena = -1 - torch.randint(0, n_arena, (n,), generator=g)
    return torch.where(torch.rand(n, generator=g) < 0.5, cache, arena)


def expected(slots, cache, arena, fmt, dim):
    """Rows picked by plain indexing, decoded by the numpy reference."""
    s = slots.numpy().astype(np.int64)
    rows = np.where((s >= 0)[:, None], cache.numpy()[np.clip(s, 0, None)], arena.numpy()[np.clip(-s - 1, 0, None)])
    return torch.from_numpy(decode_rows(rows, fmt, dim))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality; NaNs only need to sit in the same places (payloads differ by device)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    na, nb = torch.isnan(a.float()), torch.isnan(b.float())
    ia = a.view(torch.int32 if a.element_size() == 4 else torch.int16)
    ib = b.view(ia.dtype)
    return torch.equal(na, nb) and torch.equal(ia[~na], ib[~nb])


# ---------------------------------------------------------------- reference vs formats.decode_rows

@pytest.mark.parametrize("fmt,dim", CASES)
def test_reference_is_bit_exact_with_decode_rows(fmt, dim):
    table = make_table(fmt, dim, 40)
    cache, arena = table[:15], table[15:]
    slots = mixed_slots(333, 15, 25)
    want = expected(slots, cache, arena, fmt, dim)
    for out_dtype in OUT:
        got = gather_rows(slots, cache, arena, fmt, dim, out_dtype, backend="torch")
        assert same_bits(got, want.to(out_dtype)), (fmt, dim, out_dtype)


def test_reference_fp8_decodes_every_byte_and_scale():
    dim = 256  # every e4m3 byte once, under 8 different block scales incl. 0 (2**-127) and 254
    q = torch.arange(256, dtype=torch.uint8).reshape(1, dim)
    scales = torch.tensor([[0, 1, 100, 127, 128, 140, 200, 254]], dtype=torch.uint8)
    rows = torch.cat([q, scales], dim=1)
    got = gather_rows(torch.tensor([-1]), None, rows, FP8, dim, backend="torch")
    assert same_bits(got, torch.from_numpy(decode_rows(rows.numpy(), FP8, dim)))
    assert torch.isnan(got).sum() == 2  # 0x7F and 0xFF


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(CASES), st.integers(1, 50), st.integers(1, 6), st.integers(1, 6), st.integers(0, 2**16))
def test_reference_property_any_mix_of_slots(case, n, n_cache, n_arena, seed):
    fmt, dim = case
    table = make_table(fmt, dim, n_cache + n_arena, seed)
    cache, arena = table[:n_cache], table[n_cache:]
    slots = mixed_slots(n, n_cache, n_arena, seed)
    assert same_bits(gather_rows(slots, cache, arena, fmt, dim, backend="torch"),
                     expected(slots, cache, arena, fmt, dim))


def test_inverse_expands_deduplicated_slots_to_its_shape():
    table = make_table("bf16", 48, 10)
    slots = torch.tensor([3, -2, 0])
    inverse = torch.tensor([[0, 1, 2, 1], [2, 2, 0, 1]])
    got = gather_rows(slots, table[:5], table[5:], "bf16", 48, inverse=inverse, backend="torch")
    assert got.shape == (2, 4, 48)
    full = gather_rows(slots[inverse.reshape(-1)], table[:5], table[5:], "bf16", 48, backend="torch")
    assert torch.equal(got.reshape(8, 48), full)


def test_padded_arena_view_and_empty_slots():
    table = make_table(FP8, 64, 6)
    padded = torch.zeros((6, 80), dtype=torch.uint8)  # 66-byte rows in 80-byte slots
    padded[:, :66] = table
    got = gather_rows(torch.tensor([-6, -1]), None, padded[:, :66], FP8, 64, backend="torch")
    assert same_bits(got, torch.from_numpy(decode_rows(table[[5, 0]].numpy(), FP8, 64)))
    empty = gather_rows(torch.empty(0, dtype=torch.int64), None, table, FP8, 64, torch.bfloat16)
    assert empty.shape == (0, 64) and empty.dtype == torch.bfloat16


# ---------------------------------------------------------------- launcher errors

@pytest.fixture
def small():
    return make_table(FP8, 64, 8)


@pytest.mark.parametrize("bad,msg", [
    (lambda t: dict(slots=torch.tensor([0.0])), "int64/int32"),
    (lambda t: dict(slots=torch.zeros((2, 2), dtype=torch.int64)), "1-D"),
    (lambda t: dict(cache=t.float()), "uint8"),
    (lambda t: dict(cache=t[:, :64]), "66 bytes"),
    (lambda t: dict(row_format="fp4"), "unknown row format"),
    (lambda t: dict(dim=48), "divisible by 32"),
    (lambda t: dict(out_dtype=torch.int8), "out_dtype"),
    (lambda t: dict(cache=None, arena=None), "neither"),
    (lambda t: dict(cache=t.t().contiguous().t()), "contiguous"),
    (lambda t: dict(inverse=torch.tensor([0.5])), "inverse"),
    (lambda t: dict(backend="cuda"), "unknown kernel backend"),
])
def test_bad_arguments_raise_invalid_argument(small, bad, msg):
    args = dict(slots=torch.tensor([0, -1]), cache=small[:4], arena=small[4:], row_format=FP8, dim=64)
    args.update(bad(small))
    with pytest.raises(InvalidArgument, match=msg):
        gather_rows(**args)


@pytest.mark.parametrize("slots,inverse,msg", [
    ([4], None, "slot 4 is out of range: the HBM cache has 4 rows"),
    ([-5], None, "slot -5 addresses arena row 4, but the arena has 4 rows"),
    ([0, -1], [0, 2], "inverse entry 2 is out of range for 2 slots"),
    ([0, -1], [-1], "inverse entry -1"),
])
def test_out_of_range_slots_raise_id_out_of_range(small, slots, inverse, msg):
    inv = None if inverse is None else torch.tensor(inverse)
    with pytest.raises(IdOutOfRange, match=msg):
        gather_rows(torch.tensor(slots), small[:4], small[4:], FP8, 64, inverse=inv)


def test_cache_slot_without_a_cache_is_out_of_range(small):
    with pytest.raises(IdOutOfRange, match="cache has 0 rows"):
        gather_rows(torch.tensor([0]), None, small, FP8, 64)


def test_unchecked_out_of_range_slots_read_zero_rows(small):
    got = gather_rows(torch.tensor([9, -1, -99]), small[:4], small[4:], FP8, 64, check_bounds=False,
                      backend="torch")
    assert torch.equal(got[[0, 2]], torch.zeros(2, 64))
    assert same_bits(got[1], torch.from_numpy(decode_rows(small[4:5].numpy(), FP8, 64))[0])
    got = gather_rows(torch.tensor([-1]), None, small, FP8, 64, inverse=torch.tensor([0, 1, -1]),
                      check_bounds=False, backend="torch")
    assert torch.equal(got[1:], torch.zeros(2, 64)) and not torch.equal(got[0], torch.zeros(64))


def test_auto_backend_picks_reference_on_cpu_and_when_forced(monkeypatch):
    cpu = torch.zeros(1)
    if not dispatch.INTERPRET:
        assert choose_backend("auto", cpu) == "torch"
        if triton_available():
            with pytest.raises(InvalidArgument, match="TRITON_INTERPRET=1"):
                choose_backend("triton", cpu)
    monkeypatch.setenv("TIERSTORE_FORCE_TORCH", "1")
    assert choose_backend("auto", cpu) == "torch"
    assert choose_backend("torch", cpu) == "torch"


# ---------------------------------------------------------------- Triton kernel (interpreter child)

@pytest.mark.skipif(CHILD, reason="this is the parent of the interpreter run")
def test_triton_kernel_under_interpreter(interpreter_child):
    interpreter_child(__file__)


def both(*args, **kw):
    got = gather_rows(*args, backend="triton", **kw)
    want = gather_rows(*args, backend="torch", **kw)
    return got, want


@interp
def test_interp_runs_triton_kernel():
    assert dispatch.INTERPRET and choose_backend("auto", torch.zeros(1)) == "triton"


@interp
@pytest.mark.parametrize("fmt,dim", CASES)
def test_interp_bit_exact_for_every_format_size_and_dtype(fmt, dim):
    table = make_table(fmt, dim, 30)
    cache, arena = table[:11], table[11:]
    # every out dtype at U=7; U=1 and U=333 (many row blocks, partial last block) with one each
    runs = [(7, d) for d in OUT] + [(1, OUT[len(fmt) % 3]), (333, OUT[dim % 3])]
    for n, out_dtype in runs:
        slots = mixed_slots(n, 11, 19, seed=n)
        got, want = both(slots, cache, arena, fmt, dim, out_dtype)
        assert same_bits(got, want), (fmt, dim, n, out_dtype)


@interp
@pytest.mark.parametrize("fmt,dim", [("fp16", 48), (FP8, 96)])
def test_interp_inverse_int32_strided_and_one_sided(fmt, dim):
    table = make_table(fmt, dim, 12)
    padded = torch.zeros((12, table.shape[1] + 16), dtype=torch.uint8)
    padded[:, :table.shape[1]] = table
    arena = padded[:, :table.shape[1]]  # row stride != row bytes
    slots = mixed_slots(40, 5, 12)[::2].to(torch.int32)  # non-contiguous int32 slots
    inverse = torch.randint(0, 20, (3, 11)).t()  # non-contiguous 2-D inverse
    got, want = both(slots, table[:5], arena, fmt, dim, torch.bfloat16, inverse)
    assert got.shape == (11, 3, dim) and same_bits(got, want)
    only_arena = -1 - torch.arange(12)
    assert same_bits(*both(only_arena, None, arena, fmt, dim))
    assert same_bits(*both(torch.arange(5), table[:5], None, fmt, dim, torch.float16))


@interp
@pytest.mark.filterwarnings("ignore:overflow encountered")  # scale 254 -> inf, as in torch
def test_interp_fp8_special_bytes_and_unchecked_slots():
    q = torch.arange(256, dtype=torch.uint8).reshape(1, 256)
    rows = torch.cat([q, torch.tensor([[0, 1, 100, 127, 128, 140, 200, 254]], dtype=torch.uint8)], dim=1)
    for out_dtype in OUT:
        assert same_bits(*both(torch.tensor([-1, -1]), None, rows, FP8, 256, out_dtype))
    got, want = both(torch.tensor([3, -1, -7]), None, rows, FP8, 256, check_bounds=False)
    assert same_bits(got, want) and torch.equal(got[[0, 2]], torch.zeros(2, 256))
    got, want = both(torch.tensor([-1]), None, rows, FP8, 256, inverse=torch.tensor([0, 5, -3]),
                     check_bounds=False)
    assert same_bits(got, want) and torch.equal(got[1:], torch.zeros(2, 256))


def test_public_api_is_pinned():
    import tierstore.kernels as k
    assert sorted(k.__all__) == sorted(["gather_rows", "gather_rows_torch", "engram_gate", "engram_gate_torch",
                                        "choose_backend", "triton_available"])
