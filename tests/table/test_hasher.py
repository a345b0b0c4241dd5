"""NgramHasher against a pure-Python reference of DESIGN.md §2, decode, CLI, bad input."""
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tierstore import cli
from tierstore.bench.hash import plain_numpy_hash, run_hash_bench
from tierstore.table.hasher import NgramHasher
from tierstore.table.spec import EngramSpec, preset
from tierstore.errors import IdOutOfRange, InvalidArgument

V41 = preset("deepseek-v4.1-flash")


def reference_rows(spec, seqs, layer, pad):
    """Python ints only: rows[b][t] = list of global row ids, n-major head-minor."""
    m = [int(v) for v in spec.multipliers(layer)]
    primes = [int(v) for v in spec.primes(layer)]
    offs = [int(v) for v in spec.offsets(layer)]
    out = []
    for seq in seqs:
        rows_b = []
        for t in range(len(seq)):
            row, c = [], 0
            for n in range(2, spec.max_ngram + 1):
                mix = 0
                for i in range(n):
                    tok = seq[t - i] if t - i >= 0 else pad
                    assert 0 <= tok * m[i] < 2**63
                    mix ^= tok * m[i]
                for _ in range(spec.n_heads):
                    row.append(mix % primes[c] + offs[c])
                    c += 1
            rows_b.append(row)
        out.append(rows_b)
    return out


@st.composite
def specs(draw):
    order = draw(st.integers(2, 5))
    c = draw(st.one_of(st.integers(2, 300), st.integers(2, 2**40)))
    return EngramSpec(
        name="h", layer_ids=tuple(draw(st.lists(st.integers(0, 40), min_size=1, max_size=3, unique=True))),
        max_ngram=order, n_heads=draw(st.integers(1, 4)),
        engram_vocab_size=tuple(draw(st.lists(st.integers(20, 3000), min_size=order - 1, max_size=order - 1))),
        compressed_vocab_size=c, row_dim=4, row_format="fp32",
        pad_id=draw(st.integers(0, c - 1)), seed=draw(st.integers(0, 1000)))


def id_arrays(draw, c, shape):
    edge = st.one_of(st.just(0), st.just(c - 1), st.integers(0, c - 1))
    return np.array(draw(st.lists(edge, min_size=int(np.prod(shape)), max_size=int(np.prod(shape)))),
                    dtype=np.int64).reshape(shape)


# paths: one broadcast pass, cache blocks (tiny, to cross row/time boundaries), threads
PATHS = {"broadcast": {}, "blocks": {"small_tokens": 0}, "threads": {"small_tokens": 0, "threads": 2}}


@settings(max_examples=60, deadline=None)
@given(data=st.data(), spec=specs(), path=st.sampled_from(sorted(PATHS)))
def test_matches_pure_python_reference(data, spec, path):
    shape = (data.draw(st.integers(1, 3)), data.draw(st.integers(0, 12)))
    ids = id_arrays(data.draw, spec.compressed_vocab_size, shape)
    kw = dict(PATHS[path], chunk_tokens=data.draw(st.integers(1, 9))) if path != "broadcast" else {}
    hasher = NgramHasher(spec, **kw)
    try:
        for layer in spec.layer_ids:
            got = hasher.hash(ids, layer)
            assert got.dtype == np.int64 and got.shape == (*shape, spec.columns)
            assert got.tolist() == reference_rows(spec, ids.tolist(), layer, spec.pad_id)
            if shape[0] == 1:  # a [T] input is one sequence
                assert hasher.hash(ids[0], layer).tolist() == got[0].tolist()
        all_layers = hasher.hash_all(ids)
        assert sorted(all_layers) == sorted(spec.layer_ids)
        for layer, rows in all_layers.items():
            assert (rows == hasher.hash(ids, layer)).all()
            assert ((rows >= 0) & (rows < spec.rows(layer))).all()
    finally:
        hasher.close()


def test_v41_edge_ids_match_reference_and_plain_numpy():
    ids = np.array([[0, 1, 2, 3, 99091, 99091, 0]])
    hasher = NgramHasher(V41)
    for layer in V41.layer_ids:
        got = hasher.hash(ids, layer)
        assert got.tolist() == reference_rows(V41, ids.tolist(), layer, V41.pad_id)
        assert (got == plain_numpy_hash(V41, ids, layer)).all()


def test_reused_out_buffer_is_filled():
    ids = np.random.default_rng(0).integers(0, V41.compressed_vocab_size, size=(2, 700))
    hasher = NgramHasher(V41)
    out = np.full((2, 700, 24), -1, np.int64)
    assert hasher.hash(ids, 14, out=out) is out
    assert (out == plain_numpy_hash(V41, ids, 14)).all()
    with pytest.raises(InvalidArgument, match="C-contiguous int64"):
        hasher.hash(ids, 14, out=np.empty((2, 700, 23), np.int64))


@settings(max_examples=30, deadline=None)
@given(data=st.data(), spec=specs())
def test_decode_token_by_token_equals_whole_sequence(data, spec):
    shape = (data.draw(st.integers(1, 3)), data.draw(st.integers(1, 10)))
    ids = id_arrays(data.draw, spec.compressed_vocab_size, shape)
    split = data.draw(st.integers(0, shape[1]))
    hasher = NgramHasher(spec)
    whole = hasher.hash_all(ids)
    state = hasher.state_from_prefix(ids[:, :split])  # split 0 == a fresh sequence
    for t in range(split, shape[1]):
        got = hasher.step(state, ids[:, t])
        for layer in spec.layer_ids:
            assert (got[layer] == whole[layer][:, t]).all()
    fresh = hasher.new_state(shape[0])
    for t in range(shape[1]):
        hasher.step(fresh, ids[:, t])
    assert (fresh.history == state.history).all()


def test_decode_step_subset_of_layers_and_bad_step_leaves_state():
    hasher = NgramHasher(V41)
    state = hasher.state_from_prefix([[5, 6, 7, 8, 9]])
    before = state.history.copy()
    with pytest.raises(IdOutOfRange):
        hasher.step(state, [99092])
    with pytest.raises(InvalidArgument, match="batch of 1"):
        hasher.step(state, [1, 2])
    assert (state.history == before).all()
    assert list(hasher.step(state, [10], layers=[14])) == [14]


def test_compression_map_sets_c_and_pad():
    # raw vocab 10 -> 4 canonical ids; raw pad id 2 maps to canonical 3
    cmap = np.array([0, 1, 3, 1, 2, 0, 3, 2, 1, 0])
    hasher = NgramHasher(V41, cmap)
    assert hasher.vocab == 4 and hasher.spec.compressed_vocab_size == 4 and hasher.pad == 3
    assert hasher.spec.multipliers(1).tolist() != V41.multipliers(1).tolist()  # C feeds the multipliers
    raw = np.array([[9, 2, 4, 4, 7]])
    comp = hasher.map_raw(raw)
    assert comp.tolist() == [[0, 3, 2, 2, 2]]
    assert hasher.hash(comp, 1).tolist() == reference_rows(hasher.spec, comp.tolist(), 1, 3)
    with pytest.raises(IdOutOfRange, match="raw token id 10"):
        hasher.map_raw([10])
    with pytest.raises(IdOutOfRange, match="compressed id 4"):
        hasher.hash([4], 1)


@pytest.mark.parametrize("ids, err, msg", [
    ([0, 99092], IdOutOfRange, "compressed id 99092 is out of range"),
    ([-1, 5], IdOutOfRange, "compressed id -1"),
    ([0.0, 1.0], InvalidArgument, "must be integers"),
    ([[[1]]], InvalidArgument, r"\[T\] or \[B, T\]"),
])
def test_bad_ids(ids, err, msg):
    with pytest.raises(err, match=msg):
        NgramHasher(V41).hash(ids, 1)


def test_bad_construction():
    with pytest.raises(KeyError, match="layers are"):
        NgramHasher(V41).hash([1], 3)
    with pytest.raises(InvalidArgument, match="no compression map"):
        NgramHasher(V41).map_raw([1])
    with pytest.raises(InvalidArgument, match="pad id"):
        NgramHasher(EngramSpec(**{**V41.to_dict(), "pad_id": 99092}))
    with pytest.raises(InvalidArgument, match="pad id"):
        NgramHasher(V41, np.array([0, 1]))  # raw pad id 2 is outside a 2-id map
    for bad in (np.zeros((2, 2), np.int64), np.array([0, -1, 1]), np.array([0.5, 1.0])):
        with pytest.raises(InvalidArgument, match="compression map"):
            NgramHasher(V41, bad)


def test_cli_hash_prints_rows(capsys):
    assert cli.main(["hash", "--layer", "1", "--ids", "0,1,2,3,99091"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["layer"], out["table"], out["rows"]) == (1, "l1", 384_006_168)
    assert out["ids"] == reference_rows(V41, [[0, 1, 2, 3, 99091]], 1, 2)[0]


def test_cli_hash_scaled_and_errors(capsys):
    assert cli.main(["hash", "--layer", "14", "--ids", "7,8", "--scale", "1000"]) == 0
    out = json.loads(capsys.readouterr().out)
    small = preset("deepseek-v4.1-flash", 1000)
    assert out["rows"] == small.rows(14)
    assert out["ids"] == reference_rows(small, [[7, 8]], 14, 2)[0]
    assert cli.main(["hash", "--layer", "1", "--ids", "0,99092"]) == 2
    assert "compressed id 99092 is out of range" in capsys.readouterr().err
    assert cli.main(["hash", "--layer", "1", "--ids", "1,x"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err
    assert cli.main(["hash", "--layer", "1", "--ids", "1", "--raw-ids"]) == 2
    assert "--tokenizer" in capsys.readouterr().err


def test_bench_agrees_with_plain_numpy():
    r = run_hash_bench(batch=2, seq=300, repeats=1)
    assert r["outputs_equal"]
    assert r["tierstore_tokens_per_s"] > 0 and r["plain_numpy_tokens_per_s"] > 0 and r["speedup"] > 0


def reference_dead(spec, seq, dead, layer, pad):
    """Python ints: as reference_rows, but walking back from t the n-gram is blocked
    from the first dead (image) position on, and blocked ids read pad (vLLM's
    `_hash_ids_kernel` in vllm/models/deepseek_v41/common/engram.py)."""
    m = [int(v) for v in spec.multipliers(layer)]
    primes, offs = [int(v) for v in spec.primes(layer)], [int(v) for v in spec.offsets(layer)]
    out = []
    for t in range(len(seq)):
        row, mix, blocked = [], 0, False
        for s in range(spec.max_ngram):
            blocked = blocked or t - s < 0 or dead[t - s]
            mix ^= (pad if blocked else seq[t - s]) * m[s]
            if s:
                for k in range(spec.n_heads):
                    c = (s - 1) * spec.n_heads + k
                    row.append(mix % primes[c] + offs[c])
        out.append(row)
    return out


@settings(max_examples=40, deadline=None)
@given(data=st.data(), spec=specs())
def test_dead_positions_stop_hashing_as_the_reference_does(data, spec):
    h = NgramHasher(spec)
    B = data.draw(st.integers(1, 3))
    T = data.draw(st.integers(1, 12))
    ids = np.asarray(data.draw(st.lists(st.lists(st.integers(0, spec.compressed_vocab_size - 1),
                                                 min_size=T, max_size=T), min_size=B, max_size=B)))
    dead = np.asarray(data.draw(st.lists(st.lists(st.booleans(), min_size=T, max_size=T), min_size=B, max_size=B)))
    L = spec.layer_ids[0]
    got = h.hash(ids, L, dead=dead)
    for b in range(B):
        assert got[b].tolist() == reference_dead(spec, ids[b].tolist(), dead[b].tolist(), L, h.pad)
    # decode from a prefix, one token at a time, equals the whole sequence
    cut = data.draw(st.integers(0, T))
    state = h.state_from_prefix(ids[:, :cut], dead=dead[:, :cut])
    for t in range(cut, T):
        assert np.array_equal(h.step(state, ids[:, t], dead=dead[:, t])[L], got[:, t])
    assert np.array_equal(h.hash_all(ids, dead=dead)[L], got)
    assert np.array_equal(h.hash(ids, L, dead=np.zeros_like(dead)), h.hash(ids, L))


def test_dead_mask_from_the_image_token_and_bad_masks():
    spec = EngramSpec(name="t", layer_ids=(1,), max_ngram=3, n_heads=2, engram_vocab_size=50,
                      compressed_vocab_size=40, row_dim=32, row_format="fp32", image_token_id=39)
    h = NgramHasher(spec)
    assert h.dead_mask([1, 2, 3]) is None
    assert h.dead_mask([1, 39, 3]).tolist() == [False, True, False]
    assert NgramHasher(preset("engram-paper-demo")).dead_mask([1, 2]) is None  # no image token
    with pytest.raises(InvalidArgument, match="bool mask"):
        h.hash(np.zeros((2, 4), np.int64), 1, dead=np.zeros((2, 3), bool))
    with pytest.raises(InvalidArgument, match="bool mask"):
        h.hash(np.zeros(4, np.int64), 1, dead=np.zeros(4, np.int64))
