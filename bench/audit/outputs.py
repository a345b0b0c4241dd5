"""What one run of a model computes (Outputs), how it is captured (execute) and compared (compare)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tierstore.errors import InvalidArgument

__all__ = ["Outputs", "engram_layers", "set_source", "execute", "compare"]

@dataclass
class Outputs:
    """What one run computed: {layer id: every Engram layer output, flat fp32}, logits fp32 [B, T+K, V]."""

    engram: dict[int, torch.Tensor]
    logits: torch.Tensor

    def equal(self, other: "Outputs") -> bool:
        return (self.engram.keys() == other.engram.keys() and torch.equal(self.logits, other.logits)
                and all(torch.equal(v, other.engram[k]) for k, v in self.engram.items()))

def engram_layers(model) -> dict:
    from tierstore.client.model.layer import EngramLayer

    layers = {m.layer_id: m for m in model.modules() if isinstance(m, EngramLayer)}
    if not layers:
        raise InvalidArgument(f"{type(model).__name__} has no EngramLayer modules; the audit compares "
                              "their outputs (attach them with tierstore.client.model.attach.attach_engram)")
    return dict(sorted(layers.items()))

def set_source(model, source) -> None:
    for layer in engram_layers(model).values():
        layer.reset()
        layer.source = source

@torch.no_grad()
def execute(model, ids: torch.Tensor, decode_ids: torch.Tensor | None = None, decode_tokens: int = 0):
    """Prefill `ids` [B, T], then decode (forced `decode_ids` [B, K], else `decode_tokens` greedy steps).

    Returns (Outputs, the decode tokens fed [B, K] or None)."""
    layers = engram_layers(model)
    got: dict[int, list] = {lid: [] for lid in layers}
    hooks = [layer.register_forward_hook(
        lambda mod, args, out, lid=lid: got[lid].append(out.detach().float().reshape(-1).cpu()))
        for lid, layer in layers.items()]
    device = next(model.parameters()).device
    try:
        can_decode = hasattr(model, "new_cache") and hasattr(model, "decode_step")
        cache = model.new_cache() if can_decode else None
        logits = model(ids.to(device), cache) if can_decode else model(ids.to(device))
        steps, fed = [logits.float().cpu()], []
        k = decode_ids.shape[1] if decode_ids is not None else decode_tokens
        nxt = logits[:, -1].argmax(-1)
        for j in range(k if can_decode else 0):
            if decode_ids is not None:
                nxt = decode_ids[:, j].to(device)
            fed.append(nxt.cpu())
            step = model.decode_step(nxt, cache)
            steps.append(step[:, None].float().cpu())
            nxt = step.argmax(-1)
    finally:
        for h in hooks:
            h.remove()
        for layer in layers.values():
            layer.reset()
    out = Outputs({lid: torch.cat(v) for lid, v in got.items()}, torch.cat(steps, dim=1))
    return out, (torch.stack(fed, dim=1) if fed else None)

def _errors(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    if x.shape != ref.shape:
        raise InvalidArgument(f"outputs of shape {tuple(x.shape)} do not match the reference {tuple(ref.shape)}")
    diff = (x - ref).abs()
    if not diff.numel():
        return 0.0, 0.0
    rms = float(ref.pow(2).mean().sqrt()) + 1e-30
    return float(diff.max()), float((diff / ref.abs().clamp_min(rms)).max())

def compare(out: Outputs, ref: Outputs) -> dict:
    """Error metrics of `out` against `ref` (max abs/rel over every Engram layer and the logits, top-1)."""
    e = [_errors(out.engram[k], v) for k, v in ref.engram.items()]
    la, lr = _errors(out.logits, ref.logits)
    top1 = float((out.logits.argmax(-1) == ref.logits.argmax(-1)).float().mean())
    return dict(bit_exact=out.equal(ref), engram_max_abs=max(a for a, _ in e), engram_max_rel=max(r for _, r in e),
                logits_max_abs=la, logits_max_rel=lr, top1_agree=top1)

