"""A small causal transformer with Engram at two blocks: the demo, benchmark and audit model.

Deterministic from a seed, so the same model can be built twice with different
RowSources (an InProcessTable, the sidecar Client) and compared logit
for logit. The Engram layers are attached with `attach_engram`, exactly as a
user would attach them to their own model.

    from tierstore.client.model.demo_model import EngramDemoModel
    from tierstore.client.model.in_process_table import InProcessTable
    from tierstore.table.spec import preset

    spec = preset("engram-paper-demo", scale=64)
    model = EngramDemoModel(spec, InProcessTable.synthetic(spec), seed=0)
    logits = model(ids)                          # ids int64 [B, T] < model.vocab_size
    out = model.generate(ids, max_new_tokens=8)  # greedy, KV cache + Engram decode state

Hyper-connections are mocked as in the paper demo: the residual stream is M
copies [B, T, M, D]; attention and MLP read the mean of the copies and add
their output to every copy; Engram gates each copy separately; the head reads
the mean. Spec layer ids map to blocks by `engram_blocks` (default: layer id,
clipped to the last block, so the paper demo's (1, 15) sit at blocks 1 and 3).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tierstore.client.model.attach import attach_engram, engram_decode_step
from tierstore.client.model.layer import EngramLayer
from tierstore.errors import InvalidArgument

__all__ = ["EngramDemoModel", "DemoTransformer", "Block", "KVCache"]


class KVCache:
    """Keys/values of every block for a batch being decoded; `length` tokens so far."""

    def __init__(self, n_layers: int):
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self.length = 0


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, mlp_mult: int, index: int):
        super().__init__()
        self.index, self.n_heads = index, n_heads
        self.norm1, self.norm2 = nn.RMSNorm(d_model), nn.RMSNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.up = nn.Linear(d_model, mlp_mult * d_model, bias=False)
        self.down = nn.Linear(mlp_mult * d_model, d_model, bias=False)

    def forward(self, hidden_states: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        h = hidden_states                                     # [B, L, M, D]
        B, L, _, D = h.shape
        H = self.n_heads
        q, k, v = self.qkv(self.norm1(h.mean(2))).view(B, L, 3, H, D // H).permute(2, 0, 3, 1, 4)
        past = 0
        if cache is not None:
            if cache.k[self.index] is not None:
                past = cache.k[self.index].shape[2]
                k = torch.cat([cache.k[self.index], k], dim=2)
                v = torch.cat([cache.v[self.index], v], dim=2)
            cache.k[self.index], cache.v[self.index] = k, v
        if past == 0:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # new token i sits at absolute position past + i
            pos_k = torch.arange(past + L, device=h.device)
            mask = pos_k[None, :] <= (past + torch.arange(L, device=h.device))[:, None]
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = h + self.proj(a.transpose(1, 2).reshape(B, L, D)).unsqueeze(2)
        return h + self.down(F.silu(self.up(self.norm2(h.mean(2))))).unsqueeze(2)


class DemoTransformer(nn.Module):
    """The backbone: token + position embedding, `n_layers` blocks, tied-free LM head."""

    def __init__(self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, hc_mult: int,
                 mlp_mult: int = 4, max_seq: int = 2048):
        super().__init__()
        if d_model % n_heads:
            raise InvalidArgument(f"d_model {d_model} is not divisible by n_heads {n_heads}")
        self.hc_mult, self.max_seq = hc_mult, max_seq
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_seq, d_model)
        self.blocks = nn.ModuleList([Block(d_model, n_heads, mlp_mult, i) for i in range(n_layers)])
        self.norm = nn.RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, L = input_ids.shape
        start = cache.length if cache is not None else 0
        if start + L > self.max_seq:
            raise InvalidArgument(f"sequence of {start + L} tokens is longer than max_seq {self.max_seq}")
        x = self.embed(input_ids) + self.pos(torch.arange(start, start + L, device=input_ids.device))
        h = x.unsqueeze(2).expand(B, L, self.hc_mult, x.shape[-1]).contiguous()
        for block in self.blocks:
            h = block(h, cache)
        if cache is not None:
            cache.length += L
        return self.head(self.norm(h.mean(2)))


class EngramDemoModel(nn.Module):
    """DemoTransformer + Engram at the spec's layers, weights from `seed`.

    spec: EngramSpec (hc_mult, layer ids, table layout). source: RowSource.
    vocab_size: token ids are [0, vocab_size) and are used as compressed ids
        (no tokenizer map), so vocab_size <= spec.compressed_vocab_size.
    engram_blocks: {layer_id: block index}. hbm_cache: {layer_id: HBMCache}.
    """

    def __init__(self, spec, source, *, vocab_size: int = 4096, d_model: int = 256, n_layers: int = 4,
                 n_heads: int = 4, seed: int = 0, engram_blocks: dict | None = None, hasher=None,
                 hbm_cache: dict | None = None, max_seq: int = 2048):
        super().__init__()
        self.spec, self.seed = spec, seed
        self.vocab_size = min(vocab_size, spec.compressed_vocab_size)
        blocks = engram_blocks or {lid: min(lid, n_layers - 1) for lid in spec.layer_ids}
        if len(set(blocks.values())) != len(blocks) or not all(0 <= b < n_layers for b in blocks.values()):
            raise InvalidArgument(f"engram_blocks {blocks} must map layers to distinct blocks in [0, {n_layers})")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.backbone = DemoTransformer(self.vocab_size, d_model, n_layers, n_heads, spec.hc_mult,
                                            max_seq=max_seq)
            layers = {lid: EngramLayer(spec, lid, d_model, spec.hc_mult, source=source,
                                       hbm_cache=(hbm_cache or {}).get(lid)) for lid in blocks}
        self.engram = attach_engram(self.backbone, spec, source,
                                    {lid: self.backbone.blocks[b] for lid, b in blocks.items()},
                                    hasher=hasher, engram_layers=layers)

    @property
    def engram_layers(self) -> dict[int, EngramLayer]:
        return self.engram.layers

    def set_source(self, source) -> None:
        """Serve the same weights from another RowSource (e.g. the sidecar)."""
        for layer in self.engram.layers.values():
            layer.reset()
            layer.source = source

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """input_ids int64 [B, T] -> logits [B, T, vocab_size] (fills `cache` when given)."""
        self._check_ids(input_ids)
        return self.backbone(input_ids, cache=cache)

    def new_cache(self) -> KVCache:
        return KVCache(len(self.backbone.blocks))

    def decode_step(self, new_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One token per sequence (int64 [B]) after a prefill `forward(ids, cache)` -> logits [B, vocab]."""
        self._check_ids(new_ids.reshape(-1, 1))
        return engram_decode_step(self.engram, new_ids, cache=cache)[:, -1]

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding: [B, T] -> [B, T + max_new_tokens]."""
        cache = self.new_cache()
        nxt = self.forward(input_ids, cache)[:, -1].argmax(-1)
        out = [input_ids, nxt[:, None]]
        for _ in range(max_new_tokens - 1):
            nxt = self.decode_step(nxt, cache).argmax(-1)
            out.append(nxt[:, None])
        return torch.cat(out, dim=1)[:, : input_ids.shape[1] + max_new_tokens]

    def _check_ids(self, ids: torch.Tensor) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise InvalidArgument(f"token ids must be in [0, {self.vocab_size}), got "
                                  f"[{int(ids.min())}, {int(ids.max())}]")

