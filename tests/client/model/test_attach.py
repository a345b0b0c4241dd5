"""attach_engram on a small model, and the demo model built with it."""
import numpy as np
import pytest
import torch
from torch import nn

from tierstore.client.model.attach import attach_engram, engram_decode_step
from tierstore.client.model.demo_model import EngramDemoModel
from tierstore.table.hasher import NgramHasher
from tierstore.client.model.in_process_table import InProcessTable
from tierstore.table.spec import EngramSpec
from tierstore.errors import IdOutOfRange, InvalidArgument

D = 32


def make_spec(hc_mult):
    return EngramSpec(name="t", layer_ids=(1, 3), max_ngram=3, n_heads=2, engram_vocab_size=300,
                      compressed_vocab_size=40, row_dim=16, row_format="bf16", hidden_size=D,
                      hc_mult=hc_mult)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.fail = False

    def forward(self, hidden_states):
        if self.fail:
            raise RuntimeError("block failed")
        return hidden_states + torch.tanh(self.lin(hidden_states))


class Tiny(nn.Module):
    """Position-wise (no attention), so one decode step equals the full forward's last position."""

    def __init__(self, vocab, hc_mult, n_blocks=3):
        super().__init__()
        self.hc_mult = hc_mult
        self.embed = nn.Embedding(vocab, D)
        self.blocks = nn.ModuleList([Block() for _ in range(n_blocks)])
        self.head = nn.Linear(D, vocab)

    def stream(self, input_ids):
        x = self.embed(input_ids)
        return x if self.hc_mult == 1 else x.unsqueeze(2).expand(-1, -1, self.hc_mult, D)

    def forward(self, input_ids):
        h = self.stream(input_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h if self.hc_mult == 1 else h.mean(2))


class LeaseCountingTable(InProcessTable):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.open = 0

    def plan(self, table, ids):
        inner, outer = super().plan(table, ids), self
        outer.open += 1

        class Handle:
            table, arena, done = inner.table, inner.arena, False

            def slots(self, timeout=None):
                return inner.slots()

            def valid(self):
                return inner.valid()

            def release(self):
                if not self.done:
                    self.done = True
                    outer.open -= 1
        return Handle()


def build(hc_mult, cmap=None):
    torch.manual_seed(0)
    spec = make_spec(hc_mult)
    src = LeaseCountingTable.synthetic(spec, seed=2)
    vocab = 40 if cmap is None else len(cmap)
    model = Tiny(vocab, hc_mult)
    hasher = NgramHasher(spec, compression_map=cmap)
    att = attach_engram(model, spec, src, {1: "blocks.0", 3: model.blocks[2]}, hasher=hasher)
    ids = torch.from_numpy(np.random.default_rng(1).integers(0, vocab, (2, 9)))
    return spec, src, model, hasher, att, ids


def by_hand(model, att, hasher, ids):
    """The same forward with the Engram layers called explicitly."""
    comp = ids.numpy() if hasher.compression_map is None else hasher.map_raw(ids.numpy())
    at_block = {0: 1, 2: 3}
    h = model.stream(ids)
    for i, block in enumerate(model.blocks):
        if i in at_block:
            layer = att.layers[at_block[i]]
            flat = h.ndim == 3
            h = layer(h.unsqueeze(2) if flat else h, hasher.hash(comp, at_block[i]))
            h = h.squeeze(2) if flat else h
        h = block(h)
    return model.head(h if model.hc_mult == 1 else h.mean(2))


@pytest.mark.parametrize("hc_mult,cmap", [(2, None), (1, np.arange(60) % 40)])
def test_hooks_equal_calling_layers_by_hand(hc_mult, cmap):
    spec, src, model, hasher, att, ids = build(hc_mult, cmap)
    with torch.no_grad():
        hooked = model(ids)
        att.detach()
        manual = by_hand(model, att, hasher, ids)
        plain = model(ids)
    assert torch.equal(hooked, manual)
    assert not torch.allclose(hooked, plain)  # the hooks did change the model
    assert not hasattr(model.blocks[0], "engram")
    assert src.open == 0


def test_engram_is_a_submodule_of_its_block():
    spec, src, model, hasher, att, ids = build(2)
    assert model.blocks[0].engram is att.layers[1] and model.blocks[2].engram is att.layers[3]
    assert "blocks.2.engram.value_proj.weight" in model.state_dict()
    with pytest.raises(InvalidArgument, match="already has an 'engram'"):
        attach_engram(model, spec, src, {1: model.blocks[0]})
    with pytest.raises(KeyError, match="no Engram layer 2"):
        attach_engram(model, spec, src, {2: model.blocks[1]})


def test_decode_step_equals_full_forward():
    spec, src, model, hasher, att, ids = build(2)
    with torch.no_grad():
        full = model(ids)
        model(ids[:, :4])
        steps = [engram_decode_step(att, ids[:, t]) for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 4:], rtol=1e-5, atol=1e-5)
    assert src.open == 0


def test_a_failed_forward_does_not_poison_the_next():
    spec, src, model, hasher, att, ids = build(2)
    with torch.no_grad():
        want = model(ids)
        model.blocks[1].fail = True
        with pytest.raises(RuntimeError, match="block failed"):
            model(ids)
        model.blocks[1].fail = False
        assert src.open == 1  # layer 3's step was planned but never ran
        assert torch.equal(model(ids), want)
        assert src.open == 0
        with pytest.raises(IdOutOfRange, match="compressed id 40 is out of range"):
            model(torch.full((1, 3), 40))
        with pytest.raises(InvalidArgument, match="prefill"):
            att.decode_state = None
            engram_decode_step(att, ids[:, 0])


# ---- the demo model ----------------------------------------------------------

DEMO_SPEC = EngramSpec(name="demo", layer_ids=(1, 15), max_ngram=3, n_heads=2, engram_vocab_size=500,
                       compressed_vocab_size=99_092, row_dim=16, row_format="fp32", hidden_size=64,
                       hc_mult=2)


def demo(source=None, seed=0):
    source = source or InProcessTable.synthetic(DEMO_SPEC, seed=5)
    return EngramDemoModel(DEMO_SPEC, source, vocab_size=128, d_model=64, n_layers=4, n_heads=2, seed=seed)


def test_demo_model_is_deterministic_and_source_agnostic():
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 128, (2, 10)))
    a, b, c = demo(), demo(), demo(seed=1)
    assert set(a.engram_layers) == {1, 15}
    assert a.backbone.blocks[1].engram is a.engram_layers[1] and a.backbone.blocks[3].engram is a.engram_layers[15]
    with torch.no_grad():
        la = a(ids)
        assert la.shape == (2, 10, 128)
        assert torch.equal(la, b(ids)) and not torch.equal(la, c(ids))
        b.set_source(InProcessTable.synthetic(DEMO_SPEC, seed=5))  # same rows, another RowSource
        assert torch.equal(la, b(ids))
        b.set_source(InProcessTable.synthetic(DEMO_SPEC, seed=6))  # other rows change the logits
        assert not torch.allclose(la, b(ids))


def test_demo_decode_equals_prefill_and_generates():
    m = demo()
    ids = torch.from_numpy(np.random.default_rng(3).integers(0, 128, (2, 12)))
    with torch.no_grad():
        full = m(ids)
        cache = m.new_cache()
        m(ids[:, :7], cache)
        steps = torch.stack([m.decode_step(ids[:, t], cache) for t in range(7, 12)], dim=1)
        torch.testing.assert_close(steps, full[:, 7:], rtol=1e-4, atol=1e-5)
        out = m.generate(ids[:, :5], max_new_tokens=4)
    assert out.shape == (2, 9) and torch.equal(out[:, :5], ids[:, :5])
    assert ((out >= 0) & (out < 128)).all()
    with pytest.raises(InvalidArgument, match=r"token ids must be in \[0, 128\)"):
        m(torch.full((1, 2), 128))
