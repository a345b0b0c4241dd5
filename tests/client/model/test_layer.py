"""EngramLayer against a plain re-implementation of the paper demo's Engram forward."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tierstore.table.hasher import NgramHasher
from tierstore.client.model.layer import EngramLayer
from tierstore.client.model.in_process_table import InProcessTable
from tierstore.table.spec import EngramSpec
from tierstore.errors import IdOutOfRange, InvalidArgument, SpecMismatch
from tierstore.table.formats import decode_rows

D, M = 32, 2


def make_spec(fmt="fp32", conv=True):
    return EngramSpec(name="t", layer_ids=(1, 3), max_ngram=3, n_heads=2, engram_vocab_size=300,
                      compressed_vocab_size=40, row_dim=32, row_format=fmt, hidden_size=D, hc_mult=M,
                      use_conv=conv)


class CountingTable(InProcessTable):
    """An InProcessTable that records what was planned and which leases are still held."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.planned, self.open = [], 0

    def plan(self, table, ids):
        handle = super().plan(table, ids)
        self.planned.append(handle.slots().copy())
        self.open += 1
        outer = self

        class Handle:
            def __init__(self):
                self.table, self.arena, self._done = handle.table, handle.arena, False

            def slots(self, timeout=None):
                return handle.slots()

            def valid(self):
                return handle.valid()

            def release(self):
                if not self._done:
                    self._done = True
                    outer.open -= 1
        return Handle()


def randomise(layer, seed=0):
    """Non-trivial norm and conv weights, so swapped norms or taps would show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "norm" not in name else 0.5) + ("norm" in name))
    return layer


def paper_forward(layer, table_values, h, row_ids):
    """The paper demo's Engram.forward + block residual, written out plainly."""
    emb = nn.Embedding.from_pretrained(torch.from_numpy(table_values))
    e = emb(torch.from_numpy(row_ids)).flatten(start_dim=-2)
    gates = []
    for m in range(layer.hc_mult):
        key = layer.key_projs[m](e)
        nk = F.rms_norm(key, (D,), layer.norm1[m].weight)
        nq = F.rms_norm(h[:, :, m, :], (D,), layer.norm2[m].weight)
        gate = (nk * nq).sum(dim=-1) / math.sqrt(D)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gates.append(gate.sigmoid().unsqueeze(-1))
    value = torch.stack(gates, dim=2) * layer.value_proj(e).unsqueeze(2)
    if layer.short_conv is None:
        return value + h
    sc = layer.short_conv
    B, T, G, C = value.shape
    x = torch.cat([sc.norms[i](value[:, :, i, :]) for i in range(G)], dim=-1).transpose(1, 2)
    pad = (sc.kernel_size - 1) * sc.dilation
    y = F.conv1d(x, sc.conv.weight, padding=pad, dilation=sc.dilation, groups=G * C)[..., :T]
    y = F.silu(y).transpose(1, 2).reshape(B, T, G, C)
    return (value + y) + h


def setup(fmt="fp32", conv=True, seed=0, B=2, T=12, vocab=6):
    spec = make_spec(fmt, conv)
    src = CountingTable.synthetic(spec, seed=seed)
    layer = randomise(EngramLayer(spec, 3, source=src), seed)
    ids = np.random.default_rng(seed).integers(0, vocab, (B, T))  # small vocab: many repeats
    rows = NgramHasher(spec).hash(ids, 3)
    h = torch.randn(B, T, M, D, generator=torch.Generator().manual_seed(seed + 1))
    values = decode_rows(src.rows("l3").numpy(), spec.row_format, spec.row_dim)
    return spec, src, layer, ids, rows, h, values


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8-e4m3-ue8m0"])
@pytest.mark.parametrize("conv", [True, False])
def test_matches_paper_demo_forward(fmt, conv):
    spec, src, layer, ids, rows, h, values = setup(fmt, conv)
    with torch.no_grad():
        out = layer(h, rows)
        ref = paper_forward(layer, values, h, rows)
    assert out.shape == h.shape and out.dtype == h.dtype
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert (out - h).abs().mean() > 1e-2  # Engram changed the stream


def test_plans_each_distinct_row_once_and_releases():
    spec, src, layer, ids, rows, h, values = setup(vocab=2, T=40)
    with torch.no_grad():
        out = layer(h, rows)
        ref = paper_forward(layer, values, h, rows)
    (planned,) = src.planned
    assert planned.size == np.unique(rows).size < rows.size / 4  # deduped
    np.testing.assert_array_equal(np.sort(planned), np.unique(rows))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert src.open == 0


def test_two_phase_steps_queue_in_order():
    spec, src, layer, ids, rows, h, values = setup()
    with torch.no_grad():
        a, b = layer(h, rows), layer(h[:1, :5], rows[:1, :5])
        layer.prepare(rows)
        layer.prepare(rows[:1, :5])  # planned ahead while step 1 has not run
        assert src.open == 2
        assert torch.equal(layer(h), a) and torch.equal(layer(h[:1, :5]), b)
    assert src.open == 0


def test_decode_token_by_token_equals_prefill():
    """fp tolerance, not bit-exact: projections run as [B, E] instead of [B*T, E] matmuls."""
    spec, src, layer, ids, rows, h, values = setup(T=16, vocab=40)
    hasher = NgramHasher(spec)
    with torch.no_grad():
        full = layer(h, rows)
        parts = [layer(h[:, :5], rows[:, :5])]
        state = hasher.state_from_prefix(ids[:, :5])
        for t in range(5, 16):
            step_rows = hasher.step(state, ids[:, t])[3]
            layer.prepare(step_rows[:, None, :], continue_state=True)
            parts.append(layer(h[:, t:t + 1]))
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)
    assert layer.conv_state.shape == (2, (spec.kernel_size - 1) * spec.max_ngram, M * D)


def test_bad_input_gets_a_clear_error_and_leaks_no_lease():
    spec, src, layer, ids, rows, h, values = setup()
    n = spec.rows(3)
    with pytest.raises(IdOutOfRange, match=f"table 'l3' has {n} rows; id {n} is out of range"):
        layer.prepare(np.full((1, 1, spec.columns), n))
    with pytest.raises(InvalidArgument, match=r"\[B, L, 4\]"):
        layer.prepare(rows[..., :3])
    with pytest.raises(InvalidArgument, match="no rows planned"):
        layer(h)
    with pytest.raises(InvalidArgument, match=r"hidden states must be \[B, L, hc_mult, hidden\]"):
        layer(h[..., :16], rows)
    assert src.open == 0
    with pytest.raises(InvalidArgument, match="decode step continues"):
        layer.prepare(rows[:, :1], continue_state=True)
        layer(h[:, :1])


def test_weights_load_with_named_errors():
    spec, src, layer, ids, rows, h, values = setup()
    sd = layer.state_dict()
    fresh = EngramLayer(spec, 3, source=src)
    fresh.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), sd.values()))
    missing = {k: v for k, v in sd.items() if k != "norm2.1.weight"}
    with pytest.raises(SpecMismatch, match=r"missing 'norm2.1.weight' \(32,\)"):
        fresh.load_state_dict(missing)
    bad = {**sd, "value_proj.weight": torch.zeros(D, 64)}
    with pytest.raises(SpecMismatch, match=r"'value_proj.weight' has shape \(32, 64\), expected \(32, 128\)"):
        fresh.load_state_dict(bad)


def test_from_paper_demo_state_dict():
    spec, src, layer, ids, rows, h, values = setup()
    demo = {f"layers.3.engram.{k}": v for k, v in layer.state_dict().items()}
    demo["layers.3.engram.multi_head_embedding.embedding.weight"] = torch.from_numpy(values)
    demo["layers.3.engram.multi_head_embedding.offsets"] = torch.zeros(4, dtype=torch.long)
    demo["layers.1.engram.value_proj.weight"] = torch.zeros(1)
    loaded = EngramLayer.from_state_dict(spec, 3, demo, source=src, prefix="layers.3.engram.")
    assert (loaded.hidden_size, loaded.hc_mult, loaded.use_conv) == (D, M, True)
    with torch.no_grad():
        assert torch.equal(loaded(h, rows), layer(h, rows))
    with pytest.raises(SpecMismatch, match="no 'value_proj.weight' under prefix 'engram.'"):
        EngramLayer.from_state_dict(spec, 3, demo, prefix="engram.")
