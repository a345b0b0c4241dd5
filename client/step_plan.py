"""A step's lease on rows of one table, as the sidecar client hands it to the layer.

StepPlan: a plan over gRPC or the local fast path; its rows are read from the
mapped arena. _InlineStep: the same interface for a client on another host
(rows come inline). Both are tierstore.client.source.PlanHandle.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import grpc
import numpy as np

from tierstore import errors
from tierstore.client.arena_map import MappedArena
from tierstore.client.channel import to_error
from tierstore.client.table_handle import TableHandle
from tierstore.fastpath import PlanResult
from tierstore.jit import strictly_increasing
from tierstore.tiers.fused import unique_inverse

if TYPE_CHECKING:
    import torch

    from tierstore.client.sidecar import Client

__all__ = ["StepPlan", "REPLANS", "distinct_ids"]

# a gather whose lease ended meanwhile is planned again this many times, then StaleRows
REPLANS = 1


class StepPlan:
    """One step's lease on rows of one table (a tierstore.client.source.PlanHandle).

    rows() gathers from the arena the sidecar named and then checks, on the
    shared lease board, that the lease still lived when the gather ended; if it
    did not (a stalled step outlived its TTL), the step is planned again once
    and read again, so rows() never returns another step's rows. A layer that
    gathers with its own kernel calls valid() after the gather.
    """

    def __init__(self, client: "Client", handle: TableHandle, ids: np.ndarray, future, request=None,
                 inverse: np.ndarray | None = None):
        self._client, self._handle, self._ids, self._future = client, handle, ids, future
        self._request = request
        self._inverse = inverse  # the sidecar was asked for distinct ids: slot of ids[i] = reply[inverse[i]]
        self.table = handle.table
        self.lease_id = 0
        self.expires_unix_ms = 0
        self._slots = None
        self._mapped: MappedArena | None = None if future is not None else handle.mapped
        self.hits = self.misses = 0
        self._released = False
        self._retried = False
        self._fast = False
        self._error: errors.TierstoreError | None = None

    @property
    def arena(self) -> "torch.Tensor":
        """uint8 [arena_slots, row_bytes]: the arena this step's slots index, mapped read-only."""
        self.slots()
        return self._mapped.tensor

    def slots(self, timeout: float | None = None) -> np.ndarray:
        if self._released:
            raise errors.StaleRows(f"step of table {self.table!r} was released; its slots may hold other rows now")
        if self._slots is None:
            if self._error is not None:  # a failed step fails again at once: no second wait on a dead sidecar
                raise self._error
            if self._future is None:  # full-resident: slot == id, checked client-side
                self._slots = self._ids
            else:
                try:
                    self._resolve(timeout)
                except errors.TierstoreError as e:
                    self._error = e
                    raise
        return self._slots

    def _resolve(self, timeout: float | None) -> None:
        try:
            resp = self._future.result(timeout=timeout)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or not self._client._reconnected():
                raise to_error(e, self._client.target) from None
            resp = self._client._call("Plan", self._request, retry=False)  # the one retry (same request id)
        if isinstance(resp, PlanResult):  # the local fast path
            slots, self._fast = resp.slots, True
        else:
            slots, self._fast = np.frombuffer(resp.slots, dtype="<i8"), False
        if resp.instance != self._handle.instance:
            # the sidecar restarted since we described the table: refresh what we know of it
            self._handle = self._client._refresh(self.table)
        self.lease_id, self.expires_unix_ms = resp.lease_id, resp.expires_unix_ms
        try:
            self._mapped = self._client.arena(resp.arena, resp.arena_slots, self._handle.row_bytes, resp.instance,
                                              leased=True)
        except errors.StaleArena:
            # freed already: the lease ended before we got here (it is dead, nothing to release)
            if self._retried:
                raise
            self._retried = True
            fresh = self._client.plan(self.table, self._ids)
            self._future, self._request, self._handle = fresh._future, fresh._request, fresh._handle
            self._inverse = fresh._inverse
            return self._resolve(timeout)
        self.hits, self.misses = resp.hits, resp.misses
        self._slots = slots if self._inverse is None else slots[self._inverse]

    def valid(self) -> bool:
        """True while this step's rows are its own: its lease lives (cache mode), or
        its arena held them when the step began (full mode: they never change)."""
        if self._released or self._slots is None:
            return False
        if not self.lease_id:
            return True
        return self._client._lease_alive(self._handle, self.lease_id)

    def rows(self, timeout: float | None = None) -> np.ndarray:
        """uint8 [n, row_bytes] gathered from the mapped arena, request order.

        Raises StaleRows when the rows could not be read while leased (after one re-plan)."""
        for attempt in range(REPLANS + 1):
            slots = self.slots(timeout)
            out = np.take(self._mapped.rows, slots, axis=0)  # rows[slots], ~40% cheaper for small steps
            if self.valid():
                return out
            if attempt < REPLANS:
                self.replan()
        raise errors.StaleRows(f"the lease of a step of table {self.table!r} ended before its rows were read "
                               f"(lease TTL, or a release); plan the step again, or raise --lease-ttl / ttl_s")

    def replan(self) -> None:
        """Plan the same ids again (the lease ended): this handle now holds the new lease."""
        if self._released:
            raise errors.StaleRows(f"step of table {self.table!r} was released; plan a new step")
        self._end_lease()
        fresh = self._client.plan(self.table, self._ids)
        self._future, self._request, self._handle = fresh._future, fresh._request, fresh._handle
        self._mapped, self._slots, self._error, self.lease_id = fresh._mapped, None, None, 0
        self._inverse = fresh._inverse

    def release(self) -> None:
        if self._released:
            return
        self._end_lease()
        self._released = True

    def _end_lease(self) -> None:
        if self._future is None:
            return
        if self._slots is None and self._error is None:
            try:
                self.slots()  # the Plan may still be in flight: its lease must be ended too
            except errors.TierstoreError:
                return
        if self.lease_id:
            self._client._release_async(self.lease_id, fast=self._fast)
            self.lease_id = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


class _FastReply:
    """One item of a fast-path request, awaited like a gRPC future."""

    __slots__ = ("pending", "index")

    def __init__(self, pending, index: int):
        self.pending, self.index = pending, index

    def result(self, timeout: float | None = None):
        r = self.pending.result()[self.index]
        if isinstance(r, BaseException):
            raise r
        return r


class _InlineStep:
    """A step of a client whose sidecar is on another host: rows come inline."""

    def __init__(self, client: "Client", table: str, ids: np.ndarray):
        self._client, self.table, self._ids = client, table, ids
        self.lease_id = self.hits = self.misses = 0

    @property
    def arena(self):
        raise errors.InvalidArgument(f"the sidecar of {self._client.target} is not on this host: its arena "
                                     "cannot be mapped; read rows with step.rows() or lookup()")

    def slots(self, timeout: float | None = None) -> np.ndarray:
        return self.arena

    def valid(self) -> bool:
        return True

    def rows(self, timeout: float | None = None) -> np.ndarray:
        return self._client.lookup(self.table, self._ids, inline=True)

    def release(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass



def distinct_ids(arr: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(ids to ask the sidecar for, inverse or None): a step's ids deduplicated here,
    in the worker's own process, so the sidecar (one process for all workers) does
    not sort them and replies with one slot per distinct id."""
    if strictly_increasing(arr):  # compiled: no temporaries
        return arr, None
    return unique_inverse(arr)
