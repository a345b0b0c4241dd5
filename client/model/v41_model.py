"""A small model around DeepSeek-V4.1's real Engram layers, for `tierstore audit --checkpoint`.

The Engram layers are the checkpoint's (V41EngramLayer.from_checkpoint: wkv,
q/k weights, spec from config.json); around them sit a seeded embedding of the
hyper-connection stream and a seeded LM head, so the audit can compare every
execution path's Engram outputs and logits on the real weights without the
rest of the 280B-parameter model.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tierstore.table.hasher import NgramHasher
from tierstore.client.model.v41_layer import V41EngramLayer

__all__ = ["V41AuditModel", "audit_model"]


class V41AuditModel(nn.Module):
    """ids [B, T] (compressed ids) -> logits [B, T, n_out], through every Engram layer in order.

    checkpoint: the checkpoint directory; source: the RowSource serving its
    tables; seed: weights of the embedding and head (the Engram layers are the
    checkpoint's). The embedding has `n_embed` rows (ids are folded into it)
    so a real-size hidden state (5120 x 4 copies) costs tens of MB, not GBs."""

    def __init__(self, checkpoint, source, seed: int = 0, n_embed: int = 4096, n_out: int = 256):
        super().__init__()
        self.engram = nn.ModuleList()
        for L in _spec(checkpoint).layer_ids:
            self.engram.append(V41EngramLayer.from_checkpoint(checkpoint, L, source=source))
        spec = self.engram[0].spec
        self.spec, self.vocab_size = spec, spec.compressed_vocab_size
        self.hasher = NgramHasher(spec)
        g = torch.Generator().manual_seed(seed)
        M, D = spec.hc_mult, spec.hidden_size
        self.n_embed = n_embed
        self.embed = nn.Parameter(torch.randn(n_embed, D, generator=g), requires_grad=False)
        self.copy_scale = nn.Parameter(1 + 0.1 * torch.randn(M, D, generator=g), requires_grad=False)
        self.head = nn.Parameter(torch.randn(D, n_out, generator=g) / D ** 0.5, requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        raw = ids.detach().cpu().numpy().astype(np.int64)
        dead = self.hasher.dead_mask(raw)
        rows = self.hasher.hash_all(raw, dead=dead)
        h = self.embed[ids.long() % self.n_embed][:, :, None, :] * self.copy_scale  # [B, T, M, D]
        for layer in self.engram:
            h = layer(h, rows[layer.layer_id], dead=dead)
        return h.mean(2).float() @ self.head.float()


def _spec(checkpoint):
    from tierstore.table.hf_config import spec_from_config

    return spec_from_config(checkpoint)


def audit_model(source, checkpoint: str, seed: int = 0) -> V41AuditModel:
    """The `tierstore audit --module` factory behind `--checkpoint DIR`."""
    return V41AuditModel(checkpoint, source, seed=seed)
