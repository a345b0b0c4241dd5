"""StepQueue: the steps an Engram layer has prepared, and the leases they hold.

A step's row ids are deduplicated and range-checked, split into HBM-cache hits
and the misses the RowSource is asked for, and queued until a forward
consumes it. A lease is released once the step's gather ran: at once on the
host, after the gather's CUDA event fired on a device. No tensor math here;
EngramLayer (client/model/layer.py) owns the parameters and the kernels.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from tierstore.errors import InvalidArgument, StaleRows
from tierstore.tiers.base import check_ids

__all__ = ["StepQueue", "StagedStep", "still_valid"]


def still_valid(handle) -> bool:
    """Whether a step's rows were still its own: its PlanHandle's valid() (None: every row
    came from the HBM cache, nothing was planned)."""
    return handle is None or handle.valid()


def _host_array(x) -> np.ndarray:
    if not isinstance(x, torch.Tensor):
        return np.asarray(x)
    x = x.detach().cpu()
    try:
        return x.numpy()
    except TypeError:  # bf16 / fp8 have no numpy dtype: a float array still says "must be integers"
        return x.float().numpy()


@dataclass
class StagedStep:
    shape: tuple[int, int]          # (B, L)
    inverse: torch.Tensor           # int64 [B*L*columns] -> index into unique ids
    unique: np.ndarray              # int64 [U]
    cache_slots: np.ndarray | None  # int64 [U], -1 = miss
    miss: np.ndarray | None         # bool [U] (None: everything misses)
    handle: object | None           # PlanHandle of the misses (None: all hits)
    continue_state: bool


class StepQueue:
    """Prepared steps of one layer's table (`n_rows` rows, `columns` row ids per position).

    The HBM cache is passed to each call, not held: a layer's cache may be swapped
    between steps. Counters (tokens, rows_read, rows_fetched) feed EngramLayer.stats().
    """

    def __init__(self, table: str, n_rows: int, columns: int, layer_id: int):
        self.table, self.n_rows, self.columns, self.layer_id = table, n_rows, columns, layer_id
        self.pending: deque[StagedStep] = deque()
        self.in_flight: list[tuple[object, object]] = []  # (handle, cuda event) awaiting release
        self.tokens = self.rows_read = self.rows_fetched = 0

    def stage(self, row_ids, cache=None, continue_state: bool = False) -> tuple[StagedStep, np.ndarray]:
        """Dedupe and range-check row ids [B, L, columns], split off the cache's hits;
        returns (step, the ids to plan with the source)."""
        ids = _host_array(row_ids)
        if ids.ndim != 3 or ids.shape[-1] != self.columns:
            raise InvalidArgument(
                f"row ids of layer {self.layer_id} must be [B, L, {self.columns}] (NgramHasher.hash), "
                f"got {tuple(ids.shape)}")
        flat = check_ids(ids, self.n_rows, self.table)
        uniq, inverse = torch.unique(torch.from_numpy(flat), return_inverse=True)  # sorted
        unique = uniq.numpy()
        cache_slots = miss = None
        ask = unique
        if cache is not None:
            cache_slots = cache.find(unique)
            miss = cache_slots < 0
            ask = unique[miss]
            counts = torch.bincount(inverse, minlength=unique.size).numpy()
            cache.observe(unique, counts)
        self.tokens += int(ids.shape[0] * ids.shape[1])
        self.rows_read, self.rows_fetched = self.rows_read + unique.size, self.rows_fetched + ask.size
        return StagedStep((int(ids.shape[0]), int(ids.shape[1])), inverse, unique, cache_slots, miss, None,
                           bool(continue_state)), ask

    def commit(self, step: StagedStep, handle, cache=None) -> None:
        """Queue a staged step with its plan handle; the cache's slots stay put until it is gathered."""
        step.handle = handle
        if cache is not None:
            cache.pins += 1
        self.pending.append(step)

    def slots(self, step: StagedStep) -> tuple[np.ndarray, object]:
        """(where each unique row is, the source's arena): HBM-cache slot s as s, arena slot a as -a-1."""
        slots = np.empty(step.unique.size, np.int64)
        arena = None
        if step.handle is not None:
            arena_slots = np.asarray(step.handle.slots(), dtype=np.int64)
            if step.miss is None:
                slots[:] = -arena_slots - 1
            else:
                slots[step.miss] = -arena_slots - 1
            arena = step.handle.arena
        if step.miss is not None:
            slots[~step.miss] = step.cache_slots[~step.miss]
        return slots, arena

    def finish(self, step: StagedStep, cache=None, on_device: bool = False) -> None:
        """The step's gather was issued (or it is dropped): unpin the cache, release the lease."""
        if cache is not None:
            cache.pins -= 1
        if step.handle is None:
            return
        if on_device:
            # the gather kernel may still be reading the arena: release once it ran
            ev = torch.cuda.Event()
            ev.record()
            self.in_flight.append((step.handle, ev))
            self.release_finished()
        else:
            step.handle.release()

    def release_finished(self, wait: bool = False) -> None:
        """Release leases whose gathers have run on the device (all of them if `wait`)."""
        keep, stale = [], None
        for handle, ev in self.in_flight:
            if wait:
                ev.synchronize()
            if wait or ev.query():
                if not still_valid(handle):
                    stale = handle.table
                handle.release()
            else:
                keep.append((handle, ev))
        self.in_flight = keep
        if stale is not None:
            raise StaleRows(f"EngramLayer {self.table!r}: a step's lease on table {stale!r} ended before its "
                            "gather ran on the device; its output is not to be used (raise --lease-ttl)")
