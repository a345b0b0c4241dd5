"""Persistent staging buffers: the Engram rows a captured CUDA graph reads, refilled before each replay.

A captured graph replays the reads it recorded, at the addresses it recorded:
rows staged into fresh tensors each step are invisible to it. So the rows of
batches a graph may run are staged into buffers allocated once, sized to the
largest captured batch: per staged layer, fp8 rows uint8 [capacity, dim] and
ue8m0 scales uint8 [capacity, dim / 32] on the device (what the graph reads)
and their pinned host twins (what the stager fills).

Invariants:
- The buffers are one allocation for the process's life: every fill writes the
  same storage (data_ptr never changes), so a graph captured at any size reads
  the current batch.
- Each layer's buffer carries the step it was filled for (`steps`): `fill(layer,
  n, write)` writes it and `publish(n, step)` stamps every layer filled since the
  last publish with `step` (`publish(..., layers=[k])`: layer k alone, so a
  step's later layers can be filled and published after its first, from another
  thread; each layer's state is its own). `rows(layer, n, step)`, the only read the stagers
  make, raises StagingError for a layer not filled for `step` (a fill skipped, a
  step that failed half way): a layer never reads zeros, or another step's rows,
  in place of its own.
- After `publish(n, step)`, device rows [0, n) of every layer filled for `step`
  are the batch's and rows [n, capacity) of those layers are zero: a graph captured
  at a padded size reads the batch, then zero rows for its padding (what the
  kernels write for them is 0).
- The copies (two a layer, of the rows that changed) run on the stager's side
  stream, one event records them, and the stream the forward is ordered after
  waits on it (`publish`). The buffers are refilled only for a batch whose tokens
  are all on the host, i.e. once the forward that read the last rows has sampled
  its tokens and finished (the stagers refuse a batch whose newest token is still
  on the device); the side stream also waits on the current stream, and the host
  buffers are rewritten only once the copies that read them are done.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from tierstore.client.engines import StagingError

__all__ = ["StagingBuffers"]


class StagingBuffers:
    """Per-layer persistent fp8 row and ue8m0 scale buffers of `capacity` rows of `dim`
    values (dim / block scales), on `device` with pinned host twins (on a CPU device the
    host buffers are the buffers). Filled layer by layer (`fill`), then published for a step
    (`publish`); read through `rows`, which holds each layer to the step it was filled for."""

    def __init__(self, layers: int, capacity: int, dim: int, block: int, device):
        import torch

        if capacity <= 0 or layers <= 0:
            raise ValueError(f"staging buffers of {layers} layers x {capacity} rows: both must be positive")
        self.layers, self.capacity, self.dim, self.block = layers, capacity, dim, block
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.host_weight = torch.zeros((layers, capacity, dim), dtype=torch.uint8, pin_memory=self.cuda)
        self.host_scale = torch.zeros((layers, capacity, dim // block), dtype=torch.uint8, pin_memory=self.cuda)
        if self.cuda:
            self.weight = torch.zeros_like(self.host_weight, device=self.device)
            self.scale = torch.zeros_like(self.host_scale, device=self.device)
        else:
            self.weight, self.scale = self.host_weight, self.host_scale
        self.filled = np.zeros(layers, dtype=np.int64)  # rows [filled[k], capacity) of layer k are zero
        self.steps = np.full(layers, -1, dtype=np.int64)  # the step each layer's rows were filled for
        self.copied: list = [None] * layers  # the event of each layer's last copies (CUDA)
        self._written: set[int] = set()  # layers filled since their last publish

    def fits(self, rows: int) -> bool:
        return rows <= self.capacity

    def fill(self, layer: int, n: int, write: Callable[[np.ndarray, np.ndarray], None]) -> None:
        """Layer `layer`'s pinned host rows [0, n) written by `write(weights [n, dim], scales
        [n, dim / block])` (numpy views), to be published with the batch's other layers
        (`publish(n, step)`). Waits for the previous copies (they read these buffers) first."""
        if not self.fits(n):
            raise ValueError(f"{n} staged rows do not fit the {self.capacity}-row staging buffers")
        self._copies_done(layer)
        self._written.discard(layer)
        write(self.host_weight[layer, :n].numpy(), self.host_scale[layer, :n].numpy())
        self._written.add(layer)

    def publish(self, n: int, step: int, stream=None, layers=None):
        """Every layer filled since the last publish (or those of `layers` that were) holds
        `step`'s rows [0, n): zero the rows past n that the last batch left, copy the changed
        prefix to the device on `stream` (the side stream), make the current stream wait for the
        copies, and stamp those layers with `step`. Returns (weights, scales, event): views
        [layers, n, ...] of the device buffers and the copies' event (None on CPU)."""
        import torch

        # a layer of `layers` not filled (its fill failed or was skipped) keeps its last step's stamp
        layers = sorted(self._written if layers is None else self._written.intersection(layers))
        stale = {}
        for k in layers:
            self._copies_done(k)
            stale[k] = int(max(self.filled[k], n))
            if self.filled[k] > n:
                self.host_weight[k, n:self.filled[k]] = 0
                self.host_scale[k, n:self.filled[k]] = 0
            self.filled[k] = n
        copied = None
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            stream.wait_stream(current)  # the forwards enqueued so far read the rows overwritten here
            with torch.cuda.stream(stream):
                for k in layers:  # each layer's prefix is contiguous: one DMA each
                    self.weight[k, :stale[k]].copy_(self.host_weight[k, :stale[k]], non_blocking=True)
                    self.scale[k, :stale[k]].copy_(self.host_scale[k, :stale[k]], non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(stream)
            current.wait_event(copied)
            for k in layers:
                self.copied[k] = copied
        self.steps[layers] = step
        self._written.difference_update(layers)
        return self.weight[:, :n], self.scale[:, :n], copied

    def _copies_done(self, layer: int) -> None:
        """Wait for the last copies that read layer `layer`'s host buffers (CUDA)."""
        if self.copied[layer] is not None:
            self.copied[layer].synchronize()
            self.copied[layer] = None

    def rows(self, layer: int, n: int, step: int):
        """(weights [n, dim], scales [n, dim / block]): views of layer `layer`'s device rows
        [0, n), which must have been filled for `step`; StagingError names the step they were
        filled for otherwise (never zeros or another step's rows in their place)."""
        filled = int(self.steps[layer])
        if filled != step:
            why = ("it was refilled for a later step before this step's forward read it (a step staged ahead of "
                   "the forward that reads the last one)" if filled > step else
                   "that step's fill of this layer did not happen (it failed, or the engine ran a forward tierstore "
                   "did not stage)")
            raise StagingError(
                f"tierstore's staging buffer of Engram layer slot {layer} holds the rows of step "
                f"{filled if filled >= 0 else 'none'}, and the forward of step {step} reads it: {why}; no rows are "
                f"served in place of the step's own")
        if not self.fits(n):
            raise ValueError(f"{n} rows read from the {self.capacity}-row staging buffers")
        return self.weight[layer, :n], self.scale[layer, :n]
