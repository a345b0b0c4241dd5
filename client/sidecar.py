"""Client of a local tierstore sidecar.

    from tierstore.client import Client
    with Client("/run/tierstore.sock") as c:
        rows = c.lookup("l1", ids)                 # uint8 [n, row_bytes], read from the shared arena
        with c.plan("l1", ids) as step:            # async: returns at once
            ...                                    # run the first blocks meanwhile
            slots = step.slots()                   # int64 arena slot per id, leased to this step
            rows = step.rows()                     # gathered straight from the mapped arena

Row bytes never travel through gRPC on this path; `lookup(..., inline=True)`
fetches them inline (remote clients, debugging) and returns the same bytes.

Failures raise tierstore.errors types: IdOutOfRange / InvalidArgument (bad ids),
TableNotFound, ResourceExhausted (arena full of leased rows, request too big),
DataLoss (a corrupt cold block), Unavailable (no sidecar on the socket; the
call fails within `timeout` seconds instead of hanging).
"""
from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path

import grpc
import numpy as np

from tierstore import errors
from tierstore.client.arena_map import ArenaMaps, MappedArena, map_board, register_for_cuda, unregister_for_cuda
from tierstore.client.channel import RECONNECT_WAIT_S, open_channel, reconnected, to_error
from tierstore.client.fast_link import RELEASE_LINGER_S, FastLink
from tierstore.client.local_reads import LocalReads
from tierstore.client.step_plan import REPLANS, StepPlan, _FastReply, _InlineStep, distinct_ids
from tierstore.client.table_handle import TableHandle
from tierstore.fastpath import PlanItem
from tierstore.proto import tierstore_pb2 as pb
from tierstore.proto import tierstore_pb2_grpc as pb_grpc
from tierstore.tiers.base import check_ids

# Client is the one thing this module defines; the rest is re-exported from where it moved
__all__ = ["Client", "RECONNECT_WAIT_S", "RELEASE_LINGER_S", "REPLANS", "as_ids",
           "StepPlan", "TableHandle", "MappedArena", "register_for_cuda", "unregister_for_cuda", "to_error"]
_map_board, _distinct = map_board, distinct_ids  # their names before the split
_I8 = np.dtype("<i8")


def as_ids(ids) -> np.ndarray:
    """Flat little-endian int64 ids (no copy when they already are)."""
    if type(ids) is np.ndarray and ids.dtype == _I8 and ids.ndim == 1:
        return ids  # what a step loop passes: nothing to convert
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu":
        raise errors.InvalidArgument(f"ids must be integers, got dtype {arr.dtype}")
    return arr.reshape(-1).astype("<i8", copy=False)


class Client:
    """Connection to one sidecar: `Client(socket_path)` or `Client(target="host:port", token=...)`.

    timeout: seconds any call may take before it fails with Unavailable.
    token: the sidecar's shared token (--auth-token), sent on TCP.
    fast_path: plan over the sidecar's local fast path (`<socket>.fast`: one round
        trip of tens of µs per step, every table of a step in one request) when
        it is there; gRPC otherwise, and for everything else.
    root_certificates: PEM bytes of the CA (or self-signed certificate) that
        signed the sidecar's --tls-cert; the TCP channel then speaks TLS.

    A TCP client never maps an arena (it lives on the sidecar's host): its
    lookup() and plan().rows() fetch rows inline. Leases taken by this client
    belong to it (a random owner id): nobody else can release them.
    """

    def __init__(self, socket: str | Path | None = None, *, target: str | None = None, timeout: float = 30.0,
                 token: str | None = None, client_name: str = "", root_certificates: bytes | None = None,
                 fast_path: bool = True):
        if (socket is None) == (target is None):
            raise ValueError("give exactly one of socket=PATH or target=HOST:PORT")
        self.socket = Path(socket) if socket is not None else None
        self.target = f"unix:{socket}" if socket is not None else target
        self.local = socket is not None
        self.timeout = timeout
        self.client_name = client_name
        self.owner = os.urandom(16)
        self._request_ids = itertools.count(int.from_bytes(os.urandom(6), "little") << 16 | 1)
        self._metadata = (("x-tierstore-token", token),) if token else None  # server.TOKEN_HEADER
        self._channel = open_channel(self.target, root_certificates)
        self._stub = pb_grpc.TierstoreStub(self._channel)
        self._handles: dict[str, TableHandle] = {}
        self._lock = threading.Lock()
        self._maps = ArenaMaps(self._lock)
        self._ended: list[int] = []  # released leases, repeated on the next Plan (idempotent)
        self._inflight: list = []    # Release calls not yet answered; close() waits for them
        self._closed = False
        self._fast = FastLink(self.socket, self.owner, timeout, fast_path)

    # ---- plumbing -----------------------------------------------------------
    def _call(self, method: str, request, retry: bool = True):
        self._check_open()
        for attempt in (0, 1):
            try:
                return getattr(self._stub, method)(request, timeout=self.timeout, metadata=self._metadata)
            except grpc.RpcError as e:
                if attempt or not retry or e.code() != grpc.StatusCode.UNAVAILABLE or not self._reconnected():
                    raise to_error(e, self.target) from None
            except ValueError:  # grpc: "Cannot invoke RPC on closed channel!"
                raise errors.InvalidArgument(f"this Client of {self.target} is closed; make a new Client") from None

    def _reconnected(self) -> bool:
        return reconnected(self._channel, self.timeout)

    def _check_open(self) -> None:
        if self._closed:
            raise errors.InvalidArgument(f"this Client of {self.target} is closed; make a new Client")

    def _release_async(self, lease_id: int, fast: bool = False) -> None:
        if self._closed:
            return  # the lease ends by its TTL
        if fast and self._fast.release_later(lease_id):
            return
        fut = self._stub.Release.future(pb.ReleaseRequest(lease_ids=[lease_id], owner=self.owner),
                                        timeout=self.timeout, metadata=self._metadata)
        with self._lock:
            self._ended.append(lease_id)
            self._inflight = [f for f in self._inflight if not f.done()] + [fut]

    def handle(self, table: str) -> TableHandle:
        with self._lock:
            h = self._handles.get(table)
        if h is not None and h.stale:
            if h.local is not None:
                h.local.close()
            h = None  # its arena was retired: a version swap or a restart
        if h is None:
            h = TableHandle(self._call("DescribeTable", pb.DescribeTableRequest(table=table)), self)
            if self.local:
                # map now, not at first read: a sidecar restarting in between would swap the
                # file under this handle while its instance still names the old one
                h.mapped
            with self._lock:
                self._handles[table] = h
        return h

    def _refresh(self, table: str) -> TableHandle:
        with self._lock:
            self._handles.pop(table, None)
        return self.handle(table)

    def arena(self, path: str, slots: int, row_bytes: int, instance: str, leased: bool = False) -> MappedArena:
        """The mapped arena at `path` (mapped once per client; retired ones are let go).

        leased: the caller holds a lease in it, so a retired arena may still be read."""
        return self._maps.arena(path, slots, row_bytes, instance, leased)

    def _lease_alive(self, handle: TableHandle, lease_id: int) -> bool:
        return self._maps.lease_alive(handle.lease_board, handle.lease_board_entries, lease_id)

    # ---- public API ---------------------------------------------------------
    def tables(self) -> list[dict]:
        resp = self._call("ListTables", pb.ListTablesRequest())
        return [dict(table=t.table, version=t.version, rows=t.rows, row_format=t.row_format, row_dim=t.row_dim,
                     row_bytes=t.row_bytes, full_resident=t.arena.full_resident, arena_slots=t.arena.slots)
                for t in resp.tables]

    def table_info(self, table: str) -> dict:
        return self.handle(table).info()

    def plan(self, table: str, ids, ttl_s: float | None = None) -> StepPlan:
        """Lease `ids` of `table` for one step; returns at once (the RPC runs in the background).

        ids: any integer array (flattened; duplicates fine). For a full-resident
        table no RPC is made: slots are the ids, range-checked here, read from
        the arena that is current now (a retired one is let go first).
        ttl_s: the lease's lifetime (default: the sidecar's --lease-ttl; at most
            10 x that). A step that reads its rows after the lease ended gets
            them planned again, or StaleRows, never another step's rows.
        """
        self._check_open()
        arr = as_ids(ids)
        if not self.local:
            return _InlineStep(self, table, arr)
        h = self.handle(table)
        if h.full_resident:  # slot == id: no RPC, no packing
            return StepPlan(self, h, check_ids(arr, h.rows, table), None)
        fast = self._fast.client()
        if fast is None:
            return self._plan_grpc(table, arr, ttl_s)
        # plan_many of one table, without its dicts: this is the per-step path of a single-table loop
        send, inverse = distinct_ids(arr)
        pending = fast.submit([PlanItem(table, send, 0, int(ttl_s * 1000) if ttl_s else 0, next(self._request_ids))])
        return StepPlan(self, h, arr, _FastReply(pending, 0), inverse=inverse)

    def _plan_grpc(self, table: str, arr: np.ndarray, ttl_s: float | None) -> StepPlan:
        h = self.handle(table)
        send, inverse = distinct_ids(arr)
        with self._lock:
            ended, self._ended = self._ended, []
        req = pb.PlanRequest(table=table, ids=send.tobytes(), client=self.client_name,
                             ttl_ms=int(ttl_s * 1000) if ttl_s else 0, release=ended, owner=self.owner,
                             request_id=next(self._request_ids))
        fut = self._stub.Plan.future(req, timeout=self.timeout, metadata=self._metadata)
        return StepPlan(self, h, arr, fut, req, inverse)

    def plan_many(self, tables: dict, ttl_s: float | None = None) -> dict[str, StepPlan]:
        """plan() for every table of a step ({table: ids}) in one round trip on the fast
        path (one Plan RPC per cache-mode table over gRPC); returns {table: StepPlan}."""
        self._check_open()
        out, items, cached = {}, [], []
        for table, ids in tables.items():
            arr = as_ids(ids)
            if not self.local:
                out[table] = _InlineStep(self, table, arr)
                continue
            h = self.handle(table)
            if h.full_resident:
                out[table] = StepPlan(self, h, check_ids(arr, h.rows, table), None)
            else:
                send, inverse = distinct_ids(arr)
                items.append(PlanItem(table, send, 0, int(ttl_s * 1000) if ttl_s else 0, next(self._request_ids)))
                cached.append((h, arr, inverse))
        fast = self._fast.client() if items else None
        if fast is None:
            for it, (_, arr, _) in zip(items, cached):
                out[it.table] = self._plan_grpc(it.table, arr, ttl_s)
            return out
        pending = fast.submit(items)
        for k, (it, (h, arr, inverse)) in enumerate(zip(items, cached)):
            out[it.table] = StepPlan(self, h, arr, _FastReply(pending, k), inverse=inverse)
        return out

    def lookup(self, table: str, ids, inline: bool | None = None) -> np.ndarray:
        """Rows uint8 [n, row_bytes] for `ids`, bit-exact as stored; via the arena
        (local clients) or inline (TCP clients, or inline=True).

        A local client of a cache-mode table reads the step itself, no round trip
        (client/local_reads.py): resident rows from the arena, checked against the
        slot index's sequence numbers, misses from the segment files, verified; the
        sidecar learns the step afterwards. Where the sidecar does not offer that
        (--no-local-reads, --direct-io, ...) the step is planned and read."""
        if inline or (inline is None and not self.local):
            resp = self._call("Lookup", pb.LookupRequest(table=table, ids=as_ids(ids).tobytes()))
            return np.frombuffer(resp.rows, dtype=np.uint8).reshape(-1, resp.row_bytes)
        self._check_open()
        arr = as_ids(ids)
        h = self.handle(table)
        if h.index_path and not h.full_resident:  # cache mode: read it here (client/local_reads.py)
            local = self._local_reads(h)
            if local is not None:
                rows = local.read(check_ids(arr, h.rows, table))
                if rows is not None:
                    return rows
        with self.plan(table, arr) as step:
            return step.rows()

    def _local_reads(self, h: TableHandle) -> LocalReads | None:
        """The handle's LocalReads (made once), or None where it cannot be had: no fast
        path to send the steps' notes on, or an index that is gone (the next call
        describes the table again)."""
        if h.local is None:
            if self._fast.client() is None:
                h.index_path = ""  # plan every step of this handle
                return None
            try:
                h.local = LocalReads(self, h)
            except errors.StaleArena:
                return None
        return h.local

    def flush(self) -> None:
        """Send the steps local reads noted now, one-way (they go within a few ms by themselves)."""
        self._fast.flush_notes()

    def prefetch(self, table: str, ids, read: bool = True, steps: int | None = None) -> None:
        """Ask the sidecar to promote rows a queued request will read (no lease, returns
        at once): their disk reads overlap the time the request waits to run.

        read=False: only hint the rows already resident (the cache policy keeps them
        over others until the request runs) and read nothing; for requests more than
        a step or two from running, whose reads would evict rows sooner needed.
        steps: about how many steps until the request runs; its rows are kept that
        long (default: the sidecar's --policy default, 16). Say it when known: a hint
        that outlives its request keeps rows nobody reads."""
        self._check_open()
        if steps is not None and not 0 < int(steps) < 2**32:
            raise errors.InvalidArgument(f"prefetch steps must be a positive step count, got {steps}")
        req = pb.PrefetchRequest(table=table, ids=as_ids(ids).tobytes(), hint_only=not read, steps=int(steps or 0))
        fut = self._stub.Prefetch.future(req, timeout=self.timeout, metadata=self._metadata)
        with self._lock:  # held until answered: a collected future cancels its call
            self._inflight = [f for f in self._inflight if not f.done()] + [fut]

    def reload(self, table: str = "", version: int = 0) -> list[tuple[str, int, int]]:
        """Make the sidecar serve the catalog's current versions (or `table` at `version`)
        without a restart; returns [(table, old version, new version)] that changed."""
        resp = self._call("Reload", pb.ReloadRequest(table=table, version=version))
        return [(c.table, c.old_version, c.new_version) for c in resp.changed]

    def release(self, lease_ids) -> int:
        """End leases this client took now; returns how many were live (others' ids are ignored)."""
        lease_ids = [int(i) for i in lease_ids]
        n = self._fast.release(lease_ids)
        return n + self._call("Release", pb.ReleaseRequest(lease_ids=lease_ids, owner=self.owner)).released

    def stats(self) -> dict:
        resp = self._call("Stats", pb.StatsRequest())
        from google.protobuf.json_format import MessageToDict

        return MessageToDict(resp, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)

    def close(self) -> None:
        """Wait (bounded) for outstanding releases, then close the channel."""
        if self._closed:
            return
        with self._lock:
            inflight, self._inflight = self._inflight, []
        for fut in inflight:
            try:
                fut.result(timeout=min(self.timeout, 5.0))
            except (grpc.RpcError, grpc.FutureTimeoutError):
                pass  # the lease ends by its TTL instead
        self._closed = True
        self._fast.close()  # the sidecar ends this connection's leases
        self._channel.close()
        for h in self._handles.values():
            if h.local is not None:
                h.local.close()
        self._maps.drop()
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

