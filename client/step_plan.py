"""StepPlan: one step's lease on rows of one table, as the client hands it to the layer.

A cache-mode step is planned over the step socket: its PLAN frame is sent at
once and the reply (a proto.frames.PlanResult per table) is read when the
slots are first needed; a full-resident step needs no message (slot == id).
One type from the wire to the caller: this handle holds the pending reply
itself. StepPlan is a tierstore.client.model.source.PlanHandle.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from tierstore import errors
from tierstore.client.arena_map import MappedArena
from tierstore.client.table_handle import TableHandle
from tierstore.jit import strictly_increasing, unique_inverse
from tierstore.tiers.base import check_out

if TYPE_CHECKING:
    import torch

    from tierstore.client.step_channel import PendingReply

__all__ = ["StepPlan", "Planner", "REPLANS", "distinct_ids"]

# a gather whose lease ended meanwhile is planned again this many times, then StaleRows
REPLANS = 1


class Planner(Protocol):
    """What a StepPlan asks of the client that planned it (tierstore.client.Client is the one)."""

    def plan(self, table: str, ids) -> "StepPlan":
        """Plan `ids` of `table` again (a lease that ended before its rows were read)."""

    def refresh(self, table: str) -> TableHandle:
        """Describe `table` again now (the reply named another sidecar instance)."""

    def arena(self, path: str, slots: int, row_bytes: int, instance: str, leased: bool = False,
              split: int = 0) -> MappedArena:
        """The arena a reply names, mapped (`leased`: readable though retired)."""

    def lease_alive(self, handle: TableHandle, lease_id: int) -> bool:
        """Whether the lease still lives (the shared lease board)."""

    def release_later(self, lease_id: int) -> None:
        """End the lease on the next request, or alone soon."""


class StepPlan:
    """One step's lease on rows of one table (a tierstore.client.model.source.PlanHandle).

    rows() gathers from the arena the sidecar named and then checks, on the
    shared lease board, that the lease still lived when the gather ended; if it
    did not (a stalled step outlived its TTL), the step is planned again once
    and read again, so rows() never returns another step's rows. A layer that
    gathers with its own kernel calls valid() after the gather.
    """

    def __init__(self, client: Planner, handle: TableHandle, ids: np.ndarray, pending: "PendingReply | None" = None,
                 index: int = 0, inverse: np.ndarray | None = None):
        """client: what planned it (a Planner); pending: the step socket's reply this table is
        item `index` of (None: full-resident, slot == id); inverse: the sidecar was asked for
        distinct ids, slot of ids[i] = reply[inverse[i]]."""
        self._client, self._handle, self._ids = client, handle, ids
        self._pending, self._index, self._inverse = pending, index, inverse
        self.table = handle.table
        self.lease_id = 0
        self.expires_unix_ms = 0
        self._slots = None
        self._mapped: MappedArena | None = None if pending is not None else handle.mapped
        self.hits = self.misses = 0
        self._released = False
        self._retried = False
        self._error: errors.TierstoreError | None = None

    @property
    def arena(self) -> "torch.Tensor":
        """uint8 [arena_slots, row_bytes]: the arena this step's slots index, mapped read-only."""
        self.slots()
        return self._mapped.tensor

    def slots(self) -> np.ndarray:
        """int64 arena slot of each id, in request order; waits for the reply (at most the
        client's timeout). Raises what the sidecar answered for this table."""
        if self._released:
            raise errors.StaleRows(f"step of table {self.table!r} was released; its slots may hold other rows now")
        if self._slots is None:
            if self._error is not None:  # a failed step fails again at once: no second wait on a dead sidecar
                raise self._error
            if self._pending is None:  # full-resident: slot == id, checked client-side
                self._slots = self._ids
            else:
                try:
                    self._resolve()
                except errors.TierstoreError as e:
                    self._error = e
                    raise
        return self._slots

    def _resolve(self) -> None:
        res = self._pending.result()[self._index]
        if isinstance(res, BaseException):
            raise res
        if res.instance != self._handle.instance:
            # the sidecar restarted since we described the table: refresh what we know of it
            self._handle = self._client.refresh(self.table)
        self.lease_id, self.expires_unix_ms = res.lease_id, res.expires_unix_ms
        try:
            self._mapped = self._client.arena(res.arena, res.arena_slots, self._handle.row_bytes, res.instance,
                                              leased=True)
        except errors.StaleArena:
            # freed already: the lease ended before we got here (it is dead, nothing to release)
            if self._retried:
                raise
            self._retried = True
            self.lease_id = 0
            self._take(self._client.plan(self.table, self._ids))
            return self._resolve()
        self.hits, self.misses = res.hits, res.misses
        self._slots = res.slots if self._inverse is None else res.slots[self._inverse]

    def _take(self, fresh: "StepPlan") -> None:
        """Hold `fresh`'s request from now on (a re-plan of the same ids)."""
        self._pending, self._index, self._handle = fresh._pending, fresh._index, fresh._handle
        self._mapped, self._inverse = fresh._mapped, fresh._inverse

    def valid(self) -> bool:
        """True while this step's rows are its own: its lease lives (cache mode), or
        its arena held them when the step began (full mode: they never change)."""
        if self._released or self._slots is None:
            return False
        if not self.lease_id:
            return True
        return self._client.lease_alive(self._handle, self.lease_id)

    def rows(self, out: np.ndarray | None = None) -> np.ndarray:
        """uint8 [n, row_bytes] gathered from the mapped arena, request order: into `out`
        where given (uint8 [n, row_bytes], C-contiguous, writable; tiers.base.check_out).

        Raises StaleRows when the rows could not be read while leased (after one re-plan)."""
        if out is not None:
            check_out(out, self._ids.size, self._handle.row_bytes, self.table)
        for attempt in range(REPLANS + 1):
            slots = self.slots()
            got = self._mapped.take(slots, out)
            if self.valid():
                return got
            if attempt < REPLANS:
                self.replan()
        raise errors.StaleRows(f"the lease of a step of table {self.table!r} ended before its rows were read "
                               f"(lease TTL, or a release); plan the step again, or raise --lease-ttl / ttl_s")

    def replan(self) -> None:
        """Plan the same ids again (the lease ended): this handle now holds the new lease."""
        if self._released:
            raise errors.StaleRows(f"step of table {self.table!r} was released; plan a new step")
        self._end_lease()
        self._take(self._client.plan(self.table, self._ids))
        self._slots, self._error, self.lease_id = None, None, 0

    def release(self) -> None:
        if self._released:
            return
        self._end_lease()
        self._released = True

    def _end_lease(self) -> None:
        if self._pending is None:
            return
        if self._slots is None and self._error is None:
            try:
                self.slots()  # the plan may still be in flight: its lease must be ended too
            except errors.TierstoreError:
                return
        if self.lease_id:
            self._client.release_later(self.lease_id)
            self.lease_id = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def distinct_ids(arr: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(ids to ask the sidecar for, inverse or None): a step's ids deduplicated here,
    in the worker's own process, so the sidecar (one process for all workers) does
    not sort them and replies with one slot per distinct id."""
    if strictly_increasing(arr):  # compiled: no temporaries
        return arr, None
    return unique_inverse(arr)
