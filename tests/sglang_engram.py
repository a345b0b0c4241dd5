"""sglang's real Engram modules built from the synthetic V4.1 checkpoint (v41_checkpoint.py), on CPU.

`build_engram(sg, m, layer)` builds sglang's `Engram` for one layer and loads it
through sglang's own weight loaders, as its model loader does (default dtype
bf16); m is {"root": the folder holding ckpt/, "text": the checkpoint's
text_config}. Whatever hook the plugin has applied decides where the table lives.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["config", "shard_tensors", "dequant_wkv", "build_engram", "word_tokenizer"]


def config(text: dict):
    from transformers import PretrainedConfig

    return PretrainedConfig(**text)


def shard_tensors(root: Path, layer: int) -> dict:
    from safetensors.torch import load_file

    index = json.loads((root / "ckpt" / "model.safetensors.index.json").read_text())["weight_map"]
    name = index[f"layers.{layer}.engram.embed.weight"]
    p = f"layers.{layer}.engram."
    return {k[len(p):]: v for k, v in load_file(root / "ckpt" / name).items() if k.startswith(p)}


def dequant_wkv(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """fp8 e4m3 [O, I] with one ue8m0 scale per 32 x 32 block -> bf16 (exact: 4 significant bits)."""
    scale = torch.exp2(s.view(torch.uint8).float() - 127)
    full = scale.repeat_interleave(32, 0).repeat_interleave(32, 1)[: w.shape[0], : w.shape[1]]
    return (w.float() * full).to(torch.bfloat16)


def build_engram(sg, m, layer, dtype=torch.bfloat16):
    """(sglang's Engram for `layer`, loaded through sglang's own weight loaders, its EngramLayout)."""
    eng = sg[0]
    cfg = config(m["text"])
    layout = eng.EngramLayout.from_config(cfg)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as sglang's model loader sets it
    try:
        module = eng.Engram(cfg, layer, layout)
    finally:
        torch.set_default_dtype(before)
    t = shard_tensors(m["root"], layer)
    e = module.embed
    e.weight.weight_loader(e.weight, t["embed.weight"])
    e.scale.weight_loader(e.scale, t["embed.scale"])
    module.wkv.weight.weight_loader(module.wkv.weight, dequant_wkv(t["wkv.weight"], t["wkv.scale"]).to(dtype))
    with torch.no_grad():
        module.q_weight.copy_(t["q_weight"])
        module.k_weight.copy_(t["k_weight"])
    e.finish_load(f"layer {layer}")
    return module.eval(), layout


def word_tokenizer(root: Path):
    """A tokenizer of the checkpoint's vocabulary: 512 raw tokens, 500 once lowercased (the
    config's compressed vocabulary): t0..t499, T0..T11."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(500)} | {f"T{i}": 500 + i for i in range(12)}
    tok = Tokenizer(WordLevel(vocab, unk_token="t0"))
    tok.save(str(root / "tokenizer.json"))
    return PreTrainedTokenizerFast(tokenizer_object=tok)
