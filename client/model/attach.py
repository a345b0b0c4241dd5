"""Attach Engram layers to an existing model with hooks, without editing its code.

At model entry a forward pre-hook hashes the token ids for every Engram layer
at once (NgramHasher.hash_all), dedupes them and issues one plan per layer to
the RowSource, before the first block runs; a forward pre-hook on each chosen
block then collects the rows and replaces the block's input hidden states h
by `h + Engram(h)`, as the paper demo does at the top of its block.

Example::

    from tierstore.client.model.attach import attach_engram, engram_decode_step
    from tierstore.client.model.in_process_table import InProcessTable
    from tierstore.table.spec import preset

    spec = preset("engram-paper-demo", scale=64)
    source = InProcessTable.synthetic(spec)              # or tierstore.client.client.Client(...)
    eng = attach_engram(model, spec, source, {1: "blocks.1", 15: model.blocks[3]},
                        hidden_size=256)
    eng.layers[1].load_state_dict(weights_1)         # Engram weights (paper-demo key names)
    logits = model(ids)                              # ids [B, T]: Engram rows planned at entry
    logits = engram_decode_step(eng, next_ids, kv_cache=cache)   # one token per sequence

What the model must look like: its first positional argument (or keyword
`ids_arg`) is the token ids [B, T]; each chosen block's first positional
argument (or keyword `hidden_arg`) is the hidden state [B, T, M, D], or
[B, T, D] when hc_mult == 1. The Engram layer is registered as submodule
`engram` of its block, so `model.to(device)` moves it and `model.state_dict()`
saves it. Token ids are raw tokenizer ids when the hasher has a compression
map, compressed ids otherwise.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tierstore.table.hasher import DecodeState, NgramHasher
from tierstore.client.model.layer import EngramLayer
from tierstore.errors import InvalidArgument

__all__ = ["EngramAttachment", "attach_engram", "engram_decode_step"]


class EngramAttachment:
    """Handle on the hooks of `attach_engram`: its layers, hasher and decode state.

    layers: {layer_id: EngramLayer}; blocks: {layer_id: the block it runs in}.
    decode_state: the hasher's DecodeState after the last full forward (the
        history `engram_decode_step` continues from).
    """

    def __init__(self, model: nn.Module, hasher: NgramHasher, layers: dict, blocks: dict,
                 ids_arg: str, hidden_arg: str):
        self.model, self.hasher, self.layers, self.blocks = model, hasher, layers, blocks
        self.ids_arg, self.hidden_arg = ids_arg, hidden_arg
        self.decode_state: DecodeState | None = None
        self._prepared = False  # engram_decode_step planned this forward already
        self._hooks = []

    # ---- hashing -----------------------------------------------------------
    def compress(self, ids) -> np.ndarray:
        arr = ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
        return self.hasher.map_raw(arr) if self.hasher.compression_map is not None else arr

    def prepare(self, ids) -> None:
        """Hash ids [B, T] for every layer and plan their rows (what the entry hook does)."""
        ids = self.compress(ids)
        if ids.ndim != 2:
            raise InvalidArgument(f"token ids must be [B, T], got shape {tuple(ids.shape)}")
        rows = self.hasher.hash_all(ids)
        for layer in self.layers.values():
            layer.drop_pending()  # leftovers of a forward that raised
        self._prepare_all({lid: rows[lid] for lid in self.layers}, continue_state=False)
        self.decode_state = self.hasher.state_from_prefix(ids)

    def prefetch(self, ids, read: bool = True, steps: int | None = None) -> int:
        """Request admission: hash a queued request's token ids [B, T] (or [T]) and ask the
        source to promote their rows now, without a lease, so its cold reads overlap the
        time the request waits to run. Returns the ids asked for (an in-process table,
        every row at hand, ignores them: RowSource.prefetch). read=False: only hint the
        rows the source holds already, read none; steps: about how many steps until the
        request runs, the rows are kept that long (Client.prefetch)."""
        ids = self.compress(ids)
        ids = ids.reshape(1, -1) if ids.ndim == 1 else ids
        if ids.ndim != 2:
            raise InvalidArgument(f"token ids must be [B, T] or [T], got shape {tuple(ids.shape)}")
        rows = self.hasher.hash_all(ids)
        asked = 0
        for lid, layer in self.layers.items():
            uniq = np.unique(rows[lid])
            if layer.hbm_cache is not None:
                uniq = uniq[layer.hbm_cache.find(uniq, count=False) < 0]  # rows the HBM tier holds need no DRAM slot
            layer.source.prefetch(layer.table, uniq, read=read, steps=steps)
            asked += uniq.size
        return asked

    def prepare_decode(self, new_ids) -> None:
        """Hash one new token per sequence from the carried state; plan with continue_state."""
        if self.decode_state is None:
            raise InvalidArgument("engram_decode_step needs a prefill forward of the batch first")
        new = self.compress(new_ids).reshape(-1)
        rows = self.hasher.step(self.decode_state, new, layers=list(self.layers))
        for layer in self.layers.values():
            layer.drop_pending()
        self._prepare_all({lid: rows[lid][:, None, :] for lid in self.layers}, continue_state=True)

    def _prepare_all(self, rows: dict, continue_state: bool) -> None:
        """Stage every layer, then plan them: one plan_many of each source's tables (the
        sidecar's: one step-socket round trip per step)."""
        staged = {lid: self.layers[lid].stage(r, continue_state) for lid, r in rows.items()}
        by_source: dict[int, list] = {}
        for lid, (step, ask) in staged.items():
            by_source.setdefault(id(self.layers[lid].source), []).append(lid)
        for lids in by_source.values():
            source = self.layers[lids[0]].source
            asking = [lid for lid in lids if staged[lid][1].size]
            tables = [self.layers[lid].table for lid in asking]
            if len(set(tables)) == len(tables):  # one handle per table
                got = source.plan_many({t: staged[lid][1] for t, lid in zip(tables, asking)}) if asking else {}
                handles = {lid: got[t] for t, lid in zip(tables, asking)}
            else:
                handles = {lid: source.plan(t, staged[lid][1]) for t, lid in zip(tables, asking)}
            for lid in lids:
                self.layers[lid].commit(staged[lid][0], handles.get(lid))

    def stats(self) -> dict:
        """{layer_id: EngramLayer.stats()} plus "all": reads and host -> device bytes summed."""
        per = {lid: layer.stats() for lid, layer in self.layers.items()}
        tot = {k: sum(s[k] for s in per.values()) for k in ("rows_read", "rows_fetched", "refresh_bytes", "h2d_bytes")}
        tokens = max((s["tokens"] for s in per.values()), default=0)  # every layer reads every token
        tot.update(tokens=tokens, hbm_hit_ratio=1 - tot["rows_fetched"] / tot["rows_read"] if tot["rows_read"] else 0.0,
                   h2d_bytes_per_token=tot["h2d_bytes"] / tokens if tokens else 0.0)
        return {**per, "all": tot}

    # ---- hooks -------------------------------------------------------------
    def _model_pre(self, module, args, kwargs):
        if self._prepared:
            self._prepared = False
            return None
        ids = kwargs[self.ids_arg] if self.ids_arg in kwargs else (args[0] if args else None)
        if ids is None:
            raise InvalidArgument(f"attach_engram: the model was called without token ids "
                                  f"(first positional argument or {self.ids_arg}=)")
        self.prepare(ids)
        return None

    def _model_post(self, module, args, kwargs, output):
        for layer in self.layers.values():
            layer.release_finished()
        return None

    def _block_pre(self, layer: EngramLayer):
        def hook(module, args, kwargs):
            by_kw = self.hidden_arg in kwargs
            h = kwargs[self.hidden_arg] if by_kw else args[0]
            flat = h.ndim == 3
            if flat and layer.hc_mult != 1:
                raise InvalidArgument(f"block of Engram layer {layer.layer_id} gets hidden states "
                                      f"{tuple(h.shape)}; with hc_mult={layer.hc_mult} they must be [B, T, M, D]")
            out = layer(h.unsqueeze(2) if flat else h)
            out = out.squeeze(2) if flat else out
            if by_kw:
                return args, {**kwargs, self.hidden_arg: out}
            return (out, *args[1:]), kwargs
        return hook

    def detach(self) -> None:
        """Remove the hooks and the `engram` submodules; the model is as before."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for lid, block in self.blocks.items():
            self.layers[lid].reset()
            if getattr(block, "engram", None) is self.layers[lid]:
                del block.engram


def attach_engram(model: nn.Module, spec, source, layers: dict, hasher: NgramHasher | None = None,
                  hbm_cache=None, *, engram_layers: dict | None = None, hidden_size: int | None = None,
                  hc_mult: int | None = None, ids_arg: str = "input_ids",
                  hidden_arg: str = "hidden_states") -> EngramAttachment:
    """Insert an EngramLayer at the start of each chosen block of `model`.

    layers: {layer_id: block module or its dotted path in the model}, one entry
        per Engram layer of `spec` to use (a subset of spec.layer_ids).
    hasher: NgramHasher (default NgramHasher(spec), no compression map).
    hbm_cache: one HBMCache (single layer) or {layer_id: HBMCache}.
    engram_layers: prebuilt {layer_id: EngramLayer} (weights loaded); default:
        fresh layers from spec, hidden_size, hc_mult (the spec's when None).
    Returns an EngramAttachment; `.detach()` undoes everything.
    Raises KeyError for a layer id not in the spec or a path not in the model,
    InvalidArgument for a block that already has an `engram` attribute.
    """
    hasher = hasher or NgramHasher(spec)
    if hbm_cache is not None and not isinstance(hbm_cache, dict):
        if len(layers) != 1:
            raise InvalidArgument("one HBMCache serves one table; pass {layer_id: HBMCache} for several layers")
        hbm_cache = {next(iter(layers)): hbm_cache}
    hbm_cache = hbm_cache or {}
    built, blocks = {}, {}
    for lid, where in layers.items():
        spec.table_name(lid)  # KeyError naming the spec's layers
        block = model.get_submodule(where) if isinstance(where, str) else where
        if hasattr(block, "engram"):
            raise InvalidArgument(f"block for Engram layer {lid} already has an 'engram' attribute")
        layer = (engram_layers or {}).get(lid) or EngramLayer(
            spec, lid, hidden_size, hc_mult, source=source, hbm_cache=hbm_cache.get(lid))
        if layer.source is None:
            layer.source = source
        block.add_module("engram", layer)
        built[lid], blocks[lid] = layer, block
    att = EngramAttachment(model, hasher, built, blocks, ids_arg, hidden_arg)
    att._hooks.append(model.register_forward_pre_hook(att._model_pre, with_kwargs=True))
    att._hooks.append(model.register_forward_hook(att._model_post, with_kwargs=True))
    for lid, block in blocks.items():
        att._hooks.append(block.register_forward_pre_hook(att._block_pre(built[lid]), with_kwargs=True))
    return att


def engram_decode_step(attachment: EngramAttachment, new_ids, *args, **kwargs):
    """One decode step: hash one new token per sequence, plan its rows, run the model.

    new_ids: int [B] (or [B, 1]), continuing the sequences of the last full
    forward (or decode step); the model is called as model(new_ids[:, None],
    *args, **kwargs), so pass its own decode arguments (KV cache) through.
    Each Engram layer's conv continues from its carried state, so the outputs
    equal a full forward over the whole sequence (fp tolerance)."""
    new = new_ids if isinstance(new_ids, torch.Tensor) else torch.as_tensor(np.asarray(new_ids))
    new = new.reshape(-1, 1)
    attachment.prepare_decode(new)
    attachment._prepared = True
    try:
        return attachment.model(new, *args, **kwargs)
    finally:
        attachment._prepared = False
