"""V41EngramLayer: DeepSeek-V4.1's Engram layer, rows from a RowSource, weights from the checkpoint.

V4.1 differs from the paper demo (client/model/layer.py): no short conv and no
separate key/value projections. One fused fp8 projection `wkv` (32x32 ue8m0
block scales) turns the 24 looked-up rows of a position into one key per
hyper-connection copy and one value shared by all copies:

    e        = the position's (N-1)*K rows, dequantised, concatenated     [T, E]
    kv       = e @ dequant(wkv)^T                                          [T, (M+1)*D]
    key_m    = kv[:, m*D:(m+1)*D]   (m < M);   value = kv[:, M*D:]
    g_m      = sum(h_m * q_m * k_m * key_m) * rsqrt(mean(h_m^2)+eps) * rsqrt(mean(key_m^2)+eps) / sqrt(D)
    gate_m   = sigmoid(sign(g_m) * sqrt(max(|g_m|, 1e-6)))      0 at dead (image-token) positions
    out_m    = h_m + gate_m * value

with q/k = `q_weight`/`k_weight` BF16 [M, D] and eps = config.rms_norm_eps
(1e-20). This is tierstore.kernels.engram_gate with w_h = q_weight and
w_k = k_weight, so the Triton gate kernel runs it on a GPU. Sources of the
math are pinned in tests/client/model/test_v41_layer.py.

Planning, leases, the HBM cache and the gather are the demo layer's
(EngramLayer.prepare / forward); this class swaps in the V4.1 parameters and
combine step. Parameter names are the checkpoint's under `layers.{L}.engram.`:
`wkv.weight` (F8_E4M3), `wkv.scale` (ue8m0 bytes), `q_weight`, `k_weight`.
"""
from __future__ import annotations

from collections import deque

import numpy as np
import torch
from torch import nn

import tierstore.kernels as K
from tierstore.client.model.layer import EngramLayer
from tierstore.errors import InvalidArgument
from tierstore.table.formats import FP8_BLOCK, UE8M0_BIAS

__all__ = ["V41EngramLayer", "dequant_block_fp8"]

DEFAULT_EPS = 1e-6


def dequant_block_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """fp8 e4m3 [O, I] with ue8m0 bytes [ceil(O/32), ceil(I/32)] -> `dtype` [O, I]."""
    O, I = weight.shape
    exp = scale.view(torch.uint8).to(torch.float32) - UE8M0_BIAS
    s = torch.exp2(exp).repeat_interleave(FP8_BLOCK, 0)[:O].repeat_interleave(FP8_BLOCK, 1)[:, :I]
    return (weight.to(torch.float32) * s.to(weight.device)).to(dtype)


class V41EngramLayer(EngramLayer):
    """One DeepSeek-V4.1 Engram layer whose table is served by a RowSource.

    spec: EngramSpec with hidden_size, hc_mult and rms_norm_eps set (e.g.
        spec_from_config(DIR)); layer_id: one of spec.layer_ids.
    source / table / hbm_cache / compute_dtype: as EngramLayer.
    Use `from_checkpoint(DIR, layer_id, source=...)` to load the weights.

    forward(h [B, L, M, D], row_ids=None, dead=None): `dead` (bool [B, L],
    image-token positions) shuts their gate, so those positions pass through
    unchanged. With the prepare/forward split give it to `prepare`.
    """

    def __init__(self, spec, layer_id: int, source=None, table: str | None = None, hbm_cache=None,
                 compute_dtype=torch.float32):
        if spec.hidden_size <= 0 or spec.hc_mult <= 0:
            raise InvalidArgument(f"spec {spec.name!r} has no hidden_size/hc_mult; build it with "
                                  "spec_from_config(checkpoint_dir)")
        # the demo layer's planning state with throwaway 1-wide projections, then V4.1's parameters
        super().__init__(spec, layer_id, hidden_size=1, hc_mult=1, source=source, table=table,
                         hbm_cache=hbm_cache, conv=False, compute_dtype=compute_dtype)
        del self.value_proj, self.key_projs, self.norm1, self.norm2
        self.hidden_size, self.hc_mult = int(spec.hidden_size), int(spec.hc_mult)
        self.eps = float(spec.rms_norm_eps if spec.rms_norm_eps is not None else DEFAULT_EPS)
        D, M, E = self.hidden_size, self.hc_mult, self.columns * self.row_dim
        O = (M + 1) * D
        self.wkv = nn.Module()
        self.wkv.register_buffer("weight", torch.zeros(O, E, dtype=torch.float8_e4m3fn))
        self.wkv.register_buffer("scale", torch.full((-(-O // FP8_BLOCK), -(-E // FP8_BLOCK)), UE8M0_BIAS,
                                                     dtype=torch.uint8))
        self.q_weight = nn.Parameter(torch.ones(M, D, dtype=torch.bfloat16), requires_grad=False)
        self.k_weight = nn.Parameter(torch.ones(M, D, dtype=torch.bfloat16), requires_grad=False)
        self._dead: deque = deque()
        self._cur_dead = None
        self._w_cache: tuple | None = None

    def extra_repr(self) -> str:
        return (f"layer={self.layer_id}, table={self.table!r}, rows={self.n_rows}, columns={self.columns}, "
                f"row_dim={self.row_dim}, hidden={self.hidden_size}, hc_mult={self.hc_mult}, eps={self.eps:g}")

    # ---- steps: the dead mask travels with its prepared step ---------------
    def prepare(self, row_ids, continue_state: bool = False, dead=None) -> None:
        """As EngramLayer.prepare; `dead` bool [B, L] marks image-token positions (gate 0)."""
        mask = None
        if dead is not None:
            mask = torch.as_tensor(np.asarray(dead) if not isinstance(dead, torch.Tensor) else dead)
            if mask.dtype != torch.bool:
                raise InvalidArgument(f"dead must be a bool mask [B, L], got {mask.dtype}")
        self._next_dead = mask
        try:
            super().prepare(row_ids, continue_state)
        finally:
            self._next_dead = None
        shape = self._pending[-1].shape
        if mask is not None and tuple(mask.shape) != shape:
            self._finish_gather(self._pending.pop())
            self._dead.pop()
            raise InvalidArgument(f"dead mask must be [B, L] = {list(shape)} like the row ids, got {list(mask.shape)}")

    def commit(self, step, handle) -> None:
        """As EngramLayer.commit; the step's dead mask (from prepare, else none) queues beside it."""
        super().commit(step, handle)
        mask = getattr(self, "_next_dead", None)
        self._dead.append(mask if mask is not None and bool(mask.any()) else None)

    def forward(self, hidden_states: torch.Tensor, row_ids=None, dead=None) -> torch.Tensor:
        """hidden_states [B, L, M, D] -> h + gate * value, same shape and dtype."""
        if row_ids is not None:
            self.prepare(row_ids, dead=dead)
        elif dead is not None:
            raise InvalidArgument("give dead= to prepare() together with its row ids")
        self._cur_dead = self._dead.popleft() if self._dead else None
        try:
            return super().forward(hidden_states)
        finally:
            self._cur_dead = None

    def drop_pending(self) -> None:
        super().drop_pending()
        self._dead.clear()

    # ---- math ----------------------------------------------------------------
    def wkv_dequantized(self) -> torch.Tensor:
        """dequant(wkv) [(M+1)*D, E] in compute dtype (cached until the weights change)."""
        w, s = self.wkv.weight, self.wkv.scale
        key = (w.data_ptr(), w._version, s.data_ptr(), s._version, w.device)
        if self._w_cache is None or self._w_cache[0] != key:
            self._w_cache = (key, dequant_block_fp8(w, s, self.compute_dtype))
        return self._w_cache[1]

    def _combine(self, h: torch.Tensor, e: torch.Tensor, step) -> torch.Tensor:
        B, L = step.shape
        M, D = self.hc_mult, self.hidden_size
        x = h.reshape(B * L, M, D).to(self.compute_dtype)
        kv = e.to(self.compute_dtype) @ self.wkv_dequantized().to(x.device).T   # [T, (M+1)*D]
        keys = kv[:, : M * D].view(B * L, M, D)
        value = kv[:, M * D:]
        out = K.engram_gate(x, keys, value, self.q_weight.to(x), self.k_weight.to(x), eps=self.eps, residual=True)
        if self._cur_dead is not None:  # gate 0: h passes through bit-exact
            out = torch.where(self._cur_dead.to(x.device).reshape(B * L, 1, 1), x, out)
        return out.view(B, L, M, D)

    # ---- weights -------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, ckpt_dir, layer_id: int, source=None, *, prefix: str = "",
                        table: str | None = None, **kw) -> "V41EngramLayer":
        """Build layer `layer_id` from a checkpoint directory (config.json + index + shards).

        Reads only the small tensors (wkv, wkv.scale, q/k weights); the table
        itself is served by `source` as table `{prefix}l{layer_id}` (`l1`: what
        `tierstore ingest-checkpoint` names it). Raises SpecMismatch naming the
        file and tensor for a malformed checkpoint."""
        from tierstore.table.checkpoint import Checkpoint

        ck = Checkpoint(ckpt_dir)
        t = ck.engram_tensors(int(layer_id))
        layer = cls(ck.spec, int(layer_id), source=source, table=table or ck.table_name(int(layer_id), prefix), **kw)
        with torch.no_grad():
            layer.wkv.weight.copy_(t["wkv"].torch())
            layer.wkv.scale.copy_(torch.from_numpy(t["wkv_scale"].read()))
            layer.q_weight.copy_(t["q_weight"].torch())
            layer.k_weight.copy_(t["k_weight"].torch())
        return layer
