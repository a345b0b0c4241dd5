"""The contract between where rows live and the code that gathers them.

A RowSource answers `plan(table, ids)` with a PlanHandle: the arena slot of
every requested row, leased until the handle is released. The rows themselves
are read by the gather kernel straight from `handle.arena` (a uint8 tensor
[arena_rows, row_bytes] mapped from shared memory for the sidecar, the table
itself for an in-process source); no row bytes pass through the control path.

Two implementations: `tierstore.client.model.in_process_table.InProcessTable` (table
in process memory, slot == id) and `tierstore.client.client.Client` (the sidecar). A
source that plans one table at a time and has nothing to promote (InProcessTable, a
wrapper) subclasses RowSource for its plan_many and prefetch.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import torch

__all__ = ["RowSource", "PlanHandle"]


@runtime_checkable
class PlanHandle(Protocol):
    """One step's lease on the rows of one table."""

    table: str
    arena: torch.Tensor  # uint8 [arena_rows, row_bytes]; CPU (pinned/mapped) or device

    def slots(self) -> np.ndarray:
        """int64 arena slot of each requested id (same order); blocks until planned (at
        most the source's timeout).

        Raises tierstore.errors.ResourceExhausted when the arena is full of leased
        rows, IdOutOfRange / TableNotFound for bad input, Unavailable when the
        sidecar is gone."""

    def valid(self) -> bool:
        """After a gather: True when the rows read were still this step's own (its lease
        lived, its arena was current when the step began); always True where the rows
        never change under a step (InProcessTable)."""

    def replan(self) -> None:
        """Plan the same ids again after valid() said False (the lease ended)."""

    def release(self) -> None:
        """End the lease early (idempotent). Rows must not be read afterwards."""


@runtime_checkable
class RowSource(Protocol):
    """Where an Engram layer's rows live: what attach_engram and EngramLayer ask of it."""

    def plan(self, table: str, ids: np.ndarray) -> PlanHandle:
        """Start planning `ids` (int64, any shape, flattened) of `table`; returns at once."""

    def plan_many(self, tables: dict) -> dict:
        """plan() of every table of a step ({table: ids} -> {table: PlanHandle}), returning at
        once: the sidecar's Client sends them in one request. Here: one plan() each."""
        return {table: self.plan(table, ids) for table, ids in tables.items()}

    def prefetch(self, table: str, ids: np.ndarray, read: bool = True, steps: int | None = None) -> None:
        """Promote rows of `table` a queued request will read, without a lease (Client.prefetch
        says what read and steps ask). Here: nothing, every row is at hand."""

    def table_info(self, table: str) -> dict:
        """{'rows', 'row_bytes', 'row_format', 'row_dim', 'spec' (dict or None), 'version'}."""
