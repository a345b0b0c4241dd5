"""vLLM 0.32's real Engram classes built the way the CPU tests can build them (shared by the vLLM tests).

`ParallelEngramEmbedding.__init__` needs a tensor-parallel group and CUDA
(test_vllm_plugin.py says why), so `embedding` makes a real instance holding
exactly what that __init__ computes before it allocates, and `build` runs the
allocation and the weight attributes as __init__ does.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from tierstore.client.engines import vllm_plugin



def engram_module():
    from vllm.models.deepseek_v41.common import engram

    return engram


def layout(config: dict):
    """vLLM's EngramLayout of the synthetic checkpoint's text config (v41_checkpoint.CONFIG)."""
    engram = engram_module()
    cfg = dict(config, engram_num_embeddings=[0] * len(config["engram_layer_ids"]))
    probe = engram.EngramLayout(SimpleNamespace(**cfg))
    cfg["engram_num_embeddings"] = [sum(p for order in layer for p in order) for layer in probe.primes]
    return engram.EngramLayout(SimpleNamespace(**cfg))


def embedding(layout, index: int, shards: int = 1, rank: int = 0, cpu_offload: bool = True):
    """A real ParallelEngramEmbedding holding what its __init__ computes before it allocates,
    for head shard `rank` of `shards` (tensor or Engram-DP parallel)."""
    engram = engram_module()
    heads = tuple(size for order in layout.primes[index] for size in order)
    emb = engram.ParallelEngramEmbedding.__new__(engram.ParallelEngramEmbedding)
    nn.Module.__init__(emb)
    per = -(-len(heads) // shards)
    emb.cpu_offload, emb.dp_shared_memory, emb.use_thp = cpu_offload, False, False
    emb.num_embeddings, emb.dim, emb.block_size = layout.num_embeddings[index], layout.head_dim, 32
    emb.n_hash_cols, emb.part_n_hash_cols, emb.head_start = len(heads), per, rank * per
    emb.vocab_start_idx, emb.vocab_end_idx = sum(heads[:rank * per]), sum(heads[:(rank + 1) * per])
    emb.part_num_embeddings = emb.vocab_end_idx - emb.vocab_start_idx
    emb.dp_size, emb.tp_size = 1, shards
    emb._views = emb._view_src = None
    emb._num_sms = 4  # read by vLLM's lookup to size the kernel's grid (torch.cuda in __init__)
    return emb


def build(emb, layer_id: int):
    """The allocation and weight attributes, as ParallelEngramEmbedding.__init__ makes them."""
    engram = engram_module()
    with vllm_plugin.engram_layer(layer_id):
        weight, scales = emb._allocate_weights()
    emb.weight = nn.Parameter(weight, requires_grad=False)
    emb.weight_scale_inv = nn.Parameter(scales, requires_grad=False)
    for p in (emb.weight, emb.weight_scale_inv):
        engram.set_weight_attrs(p, {"weight_loader": emb._weight_loader, "engram_vocab_start": emb.vocab_start_idx})
    return emb


def holding(emb, weight, scale):
    """`emb` (cpu_offload off, so vLLM's `_storage()` is its parameters) holding table rows
    [vocab_start_idx, vocab_end_idx) of weight uint8 [rows, 256] / scale uint8 [rows, 8]:
    vLLM's own table in memory, which its own lookup (`_engram_lookup_kernel`) reads."""
    lo, hi = emb.vocab_start_idx, emb.vocab_end_idx
    w = torch.from_numpy(weight[lo:hi].copy()).view(torch.float8_e4m3fn)
    emb.weight = nn.Parameter(w, requires_grad=False)
    emb.weight_scale_inv = nn.Parameter(torch.from_numpy(scale[lo:hi].copy()), requires_grad=False)
    return emb


def checkpoint_tensors(ckpt: Path, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoint's Engram tensors as vLLM's safetensors iterator yields them (safe_open)."""
    from safetensors import safe_open

    for f in sorted(Path(ckpt).glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            if f"layers.{layer_id}.engram.embed.weight" in st.keys():
                return (st.get_tensor(f"layers.{layer_id}.engram.embed.weight"),
                        st.get_tensor(f"layers.{layer_id}.engram.embed.scale"))
    raise AssertionError(layer_id)
