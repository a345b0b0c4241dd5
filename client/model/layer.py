"""EngramLayer: hashed n-gram memory read from a RowSource, gated into the residual stream.

The math is the published paper demo's (deepseek-ai/Engram `engram_demo_v1`):

    e      = concat of the (N-1)*K rows of each position, dequantised   [T, columns*row_dim]
    g_m    = sum(RMSNorm_1m(key_m(e)) * RMSNorm_2m(h_m)) / sqrt(D)      per branch m
    g_m    = sign(g_m) * sqrt(max(|g_m|, 1e-6))
    u_m    = sigmoid(g_m) * value(e)                                     value shared by branches
    out    = h + u + ShortConv(u)      (conv, paper demo)   or   h + u   (no conv, V4.1)

ShortConv (client/model/short_conv.py) = per-branch RMSNorm, depthwise causal Conv1d
over all M*D channels (kernel `spec.kernel_size`, dilation `spec.max_ngram`), SiLU.
Row planning and lease bookkeeping are a StepQueue's (client/model/step_queue.py).

Two phases, so row planning overlaps the blocks before this one:

    layer.prepare(row_ids)   # [B, L, columns] from NgramHasher.hash; asks the source at once
    out = layer(h)           # [B, L, M, D]; collects slots, gathers, gates, releases the lease

`forward(h, row_ids)` does both at once. `attach_engram` (tierstore.client.model.attach)
calls `prepare` for every layer at model entry. Incremental decode: prepare the
new token's rows with `continue_state=True`; the conv then continues from the
last (kernel_size-1)*dilation inputs of the previous forward of the same batch,
so token-by-token decode equals prefill (within fp tolerance: the projections
run as [B, E] instead of [B*L, E] matmuls; the conv itself sums taps in a fixed
order and is the same arithmetic either way).

Parameter names follow the paper demo (`key_projs.{m}`, `value_proj`,
`norm1.{m}`, `norm2.{m}`, `short_conv.conv`, `short_conv.norms.{m}`), so its
state dict loads as is (`EngramLayer.from_state_dict` drops the embedding table,
which lives in the RowSource).
"""
from __future__ import annotations

import torch
from torch import nn

import tierstore.kernels as K
from tierstore.client.model.short_conv import CONV_EPS, ShortConv
from tierstore.client.model.speccheck import check_table_spec
from tierstore.client.model.step_queue import StagedStep as _Step, StepQueue, still_valid as _still_valid
from tierstore.errors import InvalidArgument, SpecMismatch, StaleRows
from tierstore.table.formats import RowFormat

__all__ = ["EngramLayer", "ShortConv", "GATE_EPS", "CONV_EPS"]

# nn.RMSNorm(eps=None) in the paper demo uses the dtype's machine epsilon
GATE_EPS = float(torch.finfo(torch.float32).eps)



class EngramLayer(nn.Module):
    """One Engram layer whose table is served by a RowSource.

    spec: the EngramSpec of the table; layer_id: which of spec.layer_ids.
    hidden_size / hc_mult: the backbone's D and number of hyper-connection
        branches M (default: the spec's).
    source: a RowSource (InProcessTable, sidecar Client) serving `table`
        (default spec.table_name(layer_id)).
    hbm_cache: optional HBMCache of this table's hot rows (hits skip the source).
    conv: use the ShortConv (default spec.use_conv).
    compute_dtype: dtype of the parameters and of the dequantised rows.

    Errors: IdOutOfRange for row ids outside the table, InvalidArgument for
    hidden states or row ids of the wrong shape and for forward without
    prepared rows, SpecMismatch for bad weights.
    """

    def __init__(self, spec, layer_id: int, hidden_size: int | None = None, hc_mult: int | None = None,
                 source=None, table: str | None = None, hbm_cache=None, conv: bool | None = None,
                 compute_dtype=torch.float32):
        super().__init__()
        self.spec, self.layer_id = spec, int(layer_id)
        self.table = table or spec.table_name(layer_id)
        self.n_rows = spec.rows(layer_id)
        self.hidden_size = int(hidden_size or spec.hidden_size)
        self.hc_mult = int(hc_mult or spec.hc_mult)
        if self.hidden_size <= 0 or self.hc_mult <= 0:
            raise InvalidArgument(f"hidden_size and hc_mult must be positive, got {self.hidden_size}, {self.hc_mult}")
        self.columns, self.row_dim = spec.columns, spec.row_dim
        self.row_format = RowFormat.parse(spec.row_format)
        self.source, self.hbm_cache = source, hbm_cache
        self.use_conv = spec.use_conv if conv is None else bool(conv)
        self.compute_dtype = compute_dtype
        if hbm_cache is not None and (hbm_cache.row_bytes != spec.row_bytes or hbm_cache.n_ids != self.n_rows):
            raise SpecMismatch(
                f"HBMCache holds {hbm_cache.n_ids} rows of {hbm_cache.row_bytes} B; table {self.table!r} has "
                f"{self.n_rows} rows of {spec.row_bytes} B")
        E, D, M = self.columns * self.row_dim, self.hidden_size, self.hc_mult
        self.value_proj = nn.Linear(E, D, dtype=compute_dtype)
        self.key_projs = nn.ModuleList([nn.Linear(E, D, dtype=compute_dtype) for _ in range(M)])
        self.norm1 = nn.ModuleList([nn.RMSNorm(D, eps=GATE_EPS, dtype=compute_dtype) for _ in range(M)])
        self.norm2 = nn.ModuleList([nn.RMSNorm(D, eps=GATE_EPS, dtype=compute_dtype) for _ in range(M)])
        self.short_conv = (ShortConv(D, M, spec.kernel_size, spec.max_ngram, dtype=compute_dtype)
                           if self.use_conv else None)
        self.planner = StepQueue(self.table, self.n_rows, self.columns, self.layer_id)
        self._pending = self.planner.pending  # prepared steps, oldest first
        self._checked_source = None  # the source whose table spec was checked against ours
        self._conv_state: torch.Tensor | None = None

    def extra_repr(self) -> str:
        return (f"layer={self.layer_id}, table={self.table!r}, rows={self.n_rows}, columns={self.columns}, "
                f"row_dim={self.row_dim}, hidden={self.hidden_size}, hc_mult={self.hc_mult}, conv={self.use_conv}")

    # ---- phase 1: plan -------------------------------------------------------
    def prepare(self, row_ids, continue_state: bool = False) -> None:
        """Dedupe this step's row ids and ask the source for the rows the HBM cache lacks.

        row_ids: int [B, L, columns] (NgramHasher.hash for this layer), numpy or tensor.
        continue_state: this step continues the previous forward's sequences
            (decode); the conv reads the carried state instead of zero padding.
        Steps queue up: each forward consumes the oldest prepared step."""
        step, ask = self.stage(row_ids, continue_state)
        self.commit(step, self.source.plan(self.table, ask) if ask.size else None)

    def stage(self, row_ids, continue_state: bool = False):
        """The first half of prepare(): dedupe and consult the HBM cache; returns (step, ids to
        plan). EngramAttachment plans every layer's ids in one request, then commit()s."""
        if self.source is None:
            raise InvalidArgument(f"EngramLayer {self.table!r} has no RowSource; pass source= when building it")
        if self._checked_source is not self.source:
            info = self.source.table_info(self.table)
            check_table_spec(self.spec, info.get("spec"), self.layer_id, self.table, info.get("rows"))
            self._checked_source = self.source
        return self.planner.stage(row_ids, self.hbm_cache, continue_state)

    def commit(self, step: _Step, handle) -> None:
        """The second half of prepare(): queue the staged step with its plan handle."""
        self.planner.commit(step, handle, self.hbm_cache)

    # ---- phase 2: gather + gate -------------------------------------------
    def forward(self, hidden_states: torch.Tensor, row_ids=None) -> torch.Tensor:
        """hidden_states [B, L, M, D] -> hidden_states + Engram output, same shape and dtype.

        row_ids: when given, `prepare(row_ids)` first (no overlap with earlier blocks)."""
        if row_ids is not None:
            self.prepare(row_ids)
        if not self._pending:
            raise InvalidArgument(
                f"EngramLayer {self.table!r}: no rows planned for this step; call layer.prepare(row_ids) "
                "before forward, pass row_ids=, or use tierstore.client.model.attach.attach_engram")
        step = self._pending.popleft()
        e = None
        try:
            h = self._check_hidden(hidden_states, step.shape)
            e = self._gather(step, h.device)
            if not e.is_cuda and not _still_valid(step.handle):
                # the lease ended before the gather did (a stalled step): plan and read again
                step.handle.replan()
                e = self._gather(step, h.device)
                if not _still_valid(step.handle):
                    raise StaleRows(f"EngramLayer {self.table!r}: the rows of this step were reassigned while "
                                    "it read them, twice; raise the sidecar's --lease-ttl")
        finally:
            self._finish_gather(step, on_device=e is not None and e.is_cuda)
        out = self._combine(h, e, step).to(hidden_states.dtype)
        if self.hbm_cache is not None and not self._pending:  # between steps: adapt (async copy on CUDA)
            self.hbm_cache.maybe_refresh(self.source, self.table)
        return out

    def _check_hidden(self, h: torch.Tensor, shape) -> torch.Tensor:
        want = (*shape, self.hc_mult, self.hidden_size)
        if not isinstance(h, torch.Tensor) or tuple(h.shape) != want:
            got = tuple(h.shape) if isinstance(h, torch.Tensor) else type(h).__name__
            raise InvalidArgument(
                f"EngramLayer {self.table!r}: hidden states must be [B, L, hc_mult, hidden] = {want} "
                f"to match the prepared row ids, got {got}")
        return h

    def _gather(self, step: _Step, device) -> torch.Tensor:
        """Dequantised rows of every position: [B*L, columns*row_dim]."""
        if step.unique.size == 0:  # an empty batch
            return torch.zeros(0, self.columns * self.row_dim, dtype=self.compute_dtype, device=device)
        cache = self.hbm_cache
        slots, arena = self.planner.slots(step)
        cache_rows = cache.rows if cache is not None else None
        if cache_rows is not None:
            dev = cache_rows.device
        elif arena.is_cuda or (torch.device(device).type == "cuda" and arena.is_pinned()):
            dev = device
        else:
            dev = arena.device  # plain host memory: gather on the host, then copy
        out = K.gather_rows(torch.from_numpy(slots).to(dev), cache_rows, arena, self.row_format, self.row_dim,
                            out_dtype=self.compute_dtype, inverse=step.inverse.to(dev))
        return out.reshape(step.shape[0] * step.shape[1], self.columns * self.row_dim).to(device)

    def _finish_gather(self, step: _Step, on_device: bool = False) -> None:
        self.planner.finish(step, self.hbm_cache, on_device)

    def release_finished(self, wait: bool = False) -> None:
        """Release leases whose gathers have run on the device (all of them if `wait`)."""
        self.planner.release_finished(wait)

    def _combine(self, h: torch.Tensor, e: torch.Tensor, step: _Step) -> torch.Tensor:
        B, L = step.shape
        M, D = self.hc_mult, self.hidden_size
        x = h.reshape(B * L, M, D).to(self.compute_dtype)
        keys = torch.stack([proj(e) for proj in self.key_projs], dim=1)      # [T, M, D]
        value = self.value_proj(e)                                           # [T, D]
        w_k = torch.stack([n.weight for n in self.norm1])
        w_h = torch.stack([n.weight for n in self.norm2])
        if self.short_conv is None:
            out = K.engram_gate(x, keys, value, w_h, w_k, eps=GATE_EPS, residual=True)
            return out.view(B, L, M, D)
        u = K.engram_gate(x, keys, value, w_h, w_k, eps=GATE_EPS, residual=False).view(B, L, M, D)
        state = None
        if step.continue_state:
            state = self._conv_state
            if state is None or state.shape[0] != B:
                raise InvalidArgument(
                    f"EngramLayer {self.table!r}: a decode step continues a batch of "
                    f"{None if state is None else state.shape[0]} sequences, got {B}; run a prefill "
                    "forward of this batch first (continue_state=False)")
        y, self._conv_state = self.short_conv(u, state)
        return (u + y) + x.view(B, L, M, D)

    # ---- state -------------------------------------------------------------
    def stats(self) -> dict:
        """Per-tier reads since construction, over the unique rows of each step.

        hbm_hit_ratio: share served by the HBM cache (0 without one); the rest
        came from the source (sidecar DRAM/NVMe, whose own hit ratios its
        metrics report). h2d_bytes_per_token: rows fetched from the source plus
        HBM refresh copies, in bytes per token planned."""
        c = self.hbm_cache.stats() if self.hbm_cache is not None else {}
        p = self.planner
        moved = p.rows_fetched * self.spec.row_bytes + c.get("refresh_bytes", 0)
        return {"tokens": p.tokens, "rows_read": p.rows_read, "rows_fetched": p.rows_fetched,
                "hbm_hit_ratio": 1 - p.rows_fetched / p.rows_read if p.rows_read else 0.0,
                "refresh_bytes": c.get("refresh_bytes", 0), "h2d_bytes": moved,
                "h2d_bytes_per_token": moved / p.tokens if p.tokens else 0.0}

    def drop_pending(self) -> None:
        """Drop prepared steps that no forward consumed, releasing their leases."""
        while self._pending:
            self._finish_gather(self._pending.popleft())

    def reset(self) -> None:
        """Drop prepared steps, wait for in-flight gathers, forget the decode state."""
        self.drop_pending()
        self.release_finished(wait=True)
        self._conv_state = None

    @property
    def conv_state(self) -> torch.Tensor | None:
        """[B, (kernel_size-1)*dilation, M*D] normed conv inputs carried to the next decode step."""
        return self._conv_state

    # ---- weights -----------------------------------------------------------
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load weights; SpecMismatch names every missing, unexpected or mis-shaped key."""
        own = self.state_dict()
        problems = []
        for k, v in own.items():
            if k not in state_dict:
                if strict:
                    problems.append(f"missing {k!r} {tuple(v.shape)}")
            elif tuple(state_dict[k].shape) != tuple(v.shape):
                problems.append(f"{k!r} has shape {tuple(state_dict[k].shape)}, expected {tuple(v.shape)}")
        extra = sorted(set(state_dict) - set(own))
        if strict and extra:
            problems.append(f"unexpected {extra}")
        if problems:
            raise SpecMismatch(
                f"EngramLayer {self.table!r} (columns*row_dim={self.columns * self.row_dim}, "
                f"hidden={self.hidden_size}, hc_mult={self.hc_mult}, conv={self.use_conv}): "
                + "; ".join(problems) + ". Check the spec and hidden_size/hc_mult match the checkpoint")
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    @classmethod
    def from_state_dict(cls, spec, layer_id: int, state_dict: dict, source=None, prefix: str = "",
                        **kw) -> "EngramLayer":
        """Build a layer from paper-demo weights (`prefix` e.g. "layers.1.engram.").

        hidden_size / hc_mult are read from the weights when not given; the
        embedding table (`multi_head_embedding.*`) is skipped: ingest it into the
        RowSource (`tierstore ingest`) instead."""
        sd = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        sd = {k: v for k, v in sd.items() if not k.startswith("multi_head_embedding.")}
        if "value_proj.weight" not in sd:
            raise SpecMismatch(f"no 'value_proj.weight' under prefix {prefix!r}; keys start with "
                               f"{sorted({k.split('.')[0] for k in state_dict})[:8]}")
        kw.setdefault("hidden_size", int(sd["value_proj.weight"].shape[0]))
        kw.setdefault("hc_mult", sum(1 for k in sd if k.startswith("key_projs.") and k.endswith(".weight")))
        kw.setdefault("conv", "short_conv.conv.weight" in sd)
        layer = cls(spec, layer_id, source=source, **kw)
        layer.load_state_dict(sd)
        return layer
