"""ShortConv: the paper demo's short convolution over an Engram layer's gated output.

Per-branch RMSNorm, depthwise causal Conv1d over all M*D channels (kernel
`spec.kernel_size`, dilation `spec.max_ngram`, no bias), SiLU. V4.1 has none.
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

__all__ = ["ShortConv", "CONV_EPS"]

CONV_EPS = 1e-5


class ShortConv(nn.Module):
    """Per-branch RMSNorm -> depthwise causal dilated Conv1d over M*D channels -> SiLU.

    Taps are summed explicitly (kernel_size shifted multiply-adds) so a decode
    step with a carried state does exactly the prefill arithmetic."""

    def __init__(self, hidden_size: int, hc_mult: int, kernel_size: int, dilation: int,
                 eps: float = CONV_EPS, dtype=torch.float32):
        super().__init__()
        c = hidden_size * hc_mult
        self.hc_mult, self.hidden_size, self.kernel_size, self.dilation = hc_mult, hidden_size, kernel_size, dilation
        self.conv = nn.Conv1d(c, c, kernel_size, groups=c, bias=False, dilation=dilation, dtype=dtype)
        self.norms = nn.ModuleList([nn.RMSNorm(hidden_size, eps=eps, dtype=dtype) for _ in range(hc_mult)])

    @property
    def taps(self) -> int:
        """Past inputs the conv reads: (kernel_size - 1) * dilation."""
        return (self.kernel_size - 1) * self.dilation

    def forward(self, u: torch.Tensor, state: torch.Tensor | None = None):
        """u [B, L, M, D]; state [B, taps, M*D] (normed past inputs) or None (zeros).

        Returns (y [B, L, M, D], new_state [B, taps, M*D])."""
        B, L, M, D = u.shape
        x = torch.cat([self.norms[m](u[:, :, m]) for m in range(M)], dim=-1)  # [B, L, M*D]
        if state is None:
            state = x.new_zeros(B, self.taps, M * D)
        xp = torch.cat([state.to(x.dtype), x], dim=1)
        w = self.conv.weight[:, 0, :]  # [C, K]
        y = xp[:, 0:L] * w[:, 0]
        for k in range(1, self.kernel_size):
            s = k * self.dilation
            y = y + xp[:, s:s + L] * w[:, k]
        return F.silu(y).view(B, L, M, D), xp[:, xp.shape[1] - self.taps:]
