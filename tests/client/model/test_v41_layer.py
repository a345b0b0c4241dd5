"""V41EngramLayer against an independent float64 computation from the checkpoint's bytes.

The V4.1 gate, as pinned from public code (read, not copied):
- vLLM `vllm/models/deepseek_v41/common/engram.py` (`Engram.forward`,
  `_fused_engram_post_wkv_kernel`): kv = wkv(rows.flatten); key of hc copy m =
  kv[:, m*D:(m+1)*D], value = kv[:, hc*D:]; dot = sum(h*q*k*key) *
  rsqrt(mean(h^2)+eps) * rsqrt(mean(key^2)+eps) * rsqrt(D); gate =
  sigmoid(sign(dot)*sqrt(max(|dot|, 1e-6))); gate = 0 where token_mask is False;
  out = h + gate*value; eps = config.rms_norm_eps, q/k = q_weight/k_weight [hc, D].
- The same file's `_hash_ids_kernel`: walking back from t, once a position is
  before the sequence or dead (image span), it and all older ones read the pad id.
- ds4 (DeepSeek's reference, rev bd66c402) as summarised in the GitHub issue
  halo-box/strix-llama.cpp#48: the same gate formula; image positions masked, residual unmodified.
The reference rounds kv and the output to BF16; this layer computes in its
compute_dtype (fp32 here), so the check below is at fp32 tolerance.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from v41_checkpoint import IMAGE_TOKEN, write_checkpoint  # noqa: E402

from tierstore.table.hasher import NgramHasher
from tierstore.client.model.in_process_table import InProcessTable
from tierstore.client.model.v41_layer import V41EngramLayer
from tierstore.errors import InvalidArgument, SpecMismatch


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("v41")
    arrays = write_checkpoint(d)
    return d, arrays


def e4m3_f64(b: np.ndarray) -> np.ndarray:
    """float8 e4m3fn bytes -> float64, from the bit layout (independent of torch)."""
    b = b.astype(np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 7
    mag = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7.0))
    assert not ((e == 15) & (m == 7)).any(), "NaN byte in a synthetic tensor"
    return sign * mag


def expected(arrays, spec, L, row_ids, h, dead):
    a = arrays[L]
    dim = spec.row_dim
    rows = e4m3_f64(a["embed.weight"]) * np.repeat(2.0 ** (a["embed.scale"].astype(np.float64) - 127), 32, axis=1)
    e = rows[row_ids].reshape(*row_ids.shape[:2], spec.columns * dim)              # [B, L, E]
    O, I = a["wkv.weight"].shape
    ws = np.repeat(np.repeat(2.0 ** (a["wkv.scale"].astype(np.float64) - 127), 32, 0), 32, 1)[:O, :I]
    kv = e @ (e4m3_f64(a["wkv.weight"]) * ws).T
    M, D = spec.hc_mult, spec.hidden_size
    key, value = kv[..., : M * D].reshape(*kv.shape[:2], M, D), kv[..., M * D:]
    h64 = h.astype(np.float64)
    eps = spec.rms_norm_eps
    dot = (h64 * a["q_weight"] * a["k_weight"] * key).sum(-1)
    dot *= 1 / np.sqrt((h64 ** 2).mean(-1) + eps) / np.sqrt((key ** 2).mean(-1) + eps) / np.sqrt(D)
    gate = 1 / (1 + np.exp(-np.sign(dot) * np.sqrt(np.maximum(np.abs(dot), 1e-6))))
    gate[dead] = 0.0
    return h64 + gate[..., None] * value[:, :, None, :]


def _local(ckpt, spec):
    d, arrays = ckpt
    src = InProcessTable(spec)
    for L in spec.layer_ids:
        packed = np.concatenate([arrays[L]["embed.weight"], arrays[L]["embed.scale"]], axis=1)
        src.add(f"l{L}", packed, row_format=spec.row_format, row_dim=spec.row_dim)
    return src


def _inputs(spec, B=2, T=9, seed=1):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, spec.compressed_vocab_size - 1, (B, T))
    ids[0, 3] = ids[1, 6] = IMAGE_TOKEN
    h = rng.standard_normal((B, T, spec.hc_mult, spec.hidden_size)).astype(np.float32)
    return ids, h


@pytest.mark.parametrize("L", [1, 3])
def test_layer_matches_independent_fp64_from_checkpoint_bytes(ckpt, L):
    d, arrays = ckpt
    layer = V41EngramLayer.from_checkpoint(d, L)
    spec = layer.spec
    layer.source = _local(ckpt, spec)
    hasher = NgramHasher(spec)
    ids, h = _inputs(spec)
    dead = hasher.dead_mask(ids)
    row_ids = hasher.hash(ids, L, dead=dead)
    out = layer(torch.from_numpy(h), row_ids, dead=dead).numpy()
    want = expected(arrays, spec, L, row_ids, h, dead)
    assert dead.sum() == 2
    assert np.array_equal(out[dead], h[dead])  # gate 0: image positions pass through bit-exact
    np.testing.assert_allclose(out, want, rtol=2e-4, atol=2e-5)
    assert np.abs(out - h)[~dead].max() > 1e-3  # the gate did open somewhere


def test_prepare_forward_split_carries_the_dead_mask(ckpt):
    d, arrays = ckpt
    layer = V41EngramLayer.from_checkpoint(d, 1)
    layer.source = _local(ckpt, layer.spec)
    hasher = NgramHasher(layer.spec)
    ids, h = _inputs(layer.spec, seed=2)
    dead = hasher.dead_mask(ids)
    rows = hasher.hash(ids, 1, dead=dead)
    layer.prepare(rows, dead=dead)
    layer.prepare(rows)  # a second step without image tokens
    a = layer(torch.from_numpy(h)).numpy()
    b = layer(torch.from_numpy(h)).numpy()
    assert np.array_equal(a[dead], h[dead]) and not np.array_equal(b[dead], h[dead])
    assert np.array_equal(a[~dead], b[~dead])


def test_bad_dead_mask_refused_and_nothing_left_planned(ckpt):
    d, _ = ckpt
    layer = V41EngramLayer.from_checkpoint(d, 1)
    layer.source = _local(ckpt, layer.spec)
    rows = NgramHasher(layer.spec).hash(np.zeros((2, 5), np.int64), 1)
    with pytest.raises(InvalidArgument, match="dead mask"):
        layer.prepare(rows, dead=np.zeros((2, 4), bool))
    with pytest.raises(InvalidArgument, match="bool"):
        layer.prepare(rows, dead=np.zeros((2, 5), np.int64))
    assert not layer._pending


def test_weights_are_the_checkpoint_tensors(ckpt):
    d, arrays = ckpt
    layer = V41EngramLayer.from_checkpoint(d, 3)
    a = arrays[3]
    assert layer.table == "l3" and layer.eps == 1e-20
    assert np.array_equal(layer.wkv.weight.view(torch.uint8).numpy(), a["wkv.weight"])
    assert np.array_equal(layer.wkv.scale.numpy(), a["wkv.scale"])
    assert np.array_equal(layer.q_weight.float().numpy(), a["q_weight"])
    assert set(layer.state_dict()) == {"wkv.weight", "wkv.scale", "q_weight", "k_weight"}


def test_from_checkpoint_refuses_a_missing_tensor(ckpt, tmp_path):
    import json
    import shutil

    d, _ = ckpt
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    idx = json.loads((bad / "model.safetensors.index.json").read_text())
    del idx["weight_map"]["layers.1.engram.q_weight"]
    (bad / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(SpecMismatch, match=r"model.safetensors.index.json.*layers\.1\.engram\.q_weight"):
        V41EngramLayer.from_checkpoint(bad, 1)
