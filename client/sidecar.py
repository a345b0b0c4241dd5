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

import json
import threading
import warnings
from pathlib import Path

import grpc
import numpy as np

from tierstore import errors
from tierstore.config import MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES
from tierstore.proto import tierstore_pb2 as pb
from tierstore.proto import tierstore_pb2_grpc as pb_grpc
from tierstore.tiers.base import check_ids
from tierstore.tiers.dram import map_readonly

RECONNECT_WAIT_S = 2.0
_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
    grpc.StatusCode.DATA_LOSS: errors.DataLoss,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.Unavailable,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
}


def to_error(e: grpc.RpcError, target: str = "") -> errors.TierstoreError:
    """The tierstore error a status carries ("ClassName: message"), by name or by code."""
    detail = e.details() or ""
    name, _, msg = detail.partition(": ")
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.TierstoreError) and cls is not errors.ChecksumError:
        return cls(msg)
    if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and target:
        return errors.Unavailable(f"no tierstore sidecar answers at {target} (is `tierstore serve` running "
                                  f"there?): {e.code().name}: {detail}")
    return _BY_CODE.get(e.code(), errors.TierstoreError)(f"{e.code().name}: {detail}")


def as_ids(ids) -> np.ndarray:
    """Flat little-endian int64 ids (no copy when they already are)."""
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu":
        raise errors.InvalidArgument(f"ids must be integers, got dtype {arr.dtype}")
    return arr.reshape(-1).astype("<i8", copy=False)


# cudaHostRegister flags: Portable | Mapped | ReadOnly (our mapping is PROT_READ)
_CUDA_HOST_REGISTER_FLAGS = 0x01 | 0x02 | 0x08


def register_for_cuda(arr: np.ndarray) -> bool:
    """Page-lock a mapped arena so CUDA kernels read it over UVA (no staging copy).

    Returns False (with a warning) when the driver refuses, e.g. a GPU without
    read-only host registration: the layer then gathers on the host and copies.
    Not yet exercised on a GPU in CI (no device there).
    """
    import torch

    err = torch.cuda.cudart().cudaHostRegister(arr.ctypes.data, arr.nbytes, _CUDA_HOST_REGISTER_FLAGS)
    if int(err) != 0:
        warnings.warn(f"cudaHostRegister of the arena failed ({err}); CUDA gathers will copy through the host")
        return False
    return True


class TableHandle:
    """What a client knows about one served table, with its arena mapped read-only."""

    def __init__(self, info: pb.TableInfo):
        self.table, self.version, self.rows = info.table, info.version, info.rows
        self.row_format, self.row_dim, self.row_bytes = info.row_format, info.row_dim, info.row_bytes
        self.spec = json.loads(info.spec_json) if info.spec_json else None
        self.layer_id = None if info.layer_id < 0 else info.layer_id
        self.full_resident = info.arena.full_resident
        self._arena_path, self._arena_slots = info.arena.path, info.arena.slots
        self.instance = info.arena.instance
        self._arena_np = self._arena = None

    @property
    def arena_np(self) -> np.ndarray:
        if self._arena_np is None:
            # mapped on first use: a remote client that only uses inline lookups never maps
            self._arena_np = map_readonly(self._arena_path, self._arena_slots, self.row_bytes)
        return self._arena_np

    @property
    def arena(self) -> "torch.Tensor":
        if self._arena is None:
            import torch  # here: a numpy-only client does not pay torch's import

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only mapping: we never write through it
                self._arena = torch.from_numpy(self.arena_np)
            if torch.cuda.is_available():
                register_for_cuda(self.arena_np)
        return self._arena

    def info(self) -> dict:
        return dict(rows=self.rows, row_bytes=self.row_bytes, row_format=self.row_format, row_dim=self.row_dim,
                    spec=self.spec, version=self.version, layer_id=self.layer_id, full_resident=self.full_resident)


class StepPlan:
    """One step's lease on rows of one table (a tierstore.client.source.PlanHandle)."""

    def __init__(self, client: "Client", handle: TableHandle, ids: np.ndarray, future, request=None):
        self._client, self._handle, self._ids, self._future = client, handle, ids, future
        self._request = request
        self.table = handle.table
        self.lease_id = 0
        self._slots = None
        self.hits = self.misses = 0
        self._released = False
        self._error: errors.TierstoreError | None = None

    @property
    def arena(self) -> "torch.Tensor":
        """uint8 [arena_slots, row_bytes]: the shared arena, mapped read-only."""
        return self._handle.arena

    def slots(self, timeout: float | None = None) -> np.ndarray:
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
            resp = self._client._call("Plan", self._request, retry=False)  # the one retry
        if resp.instance != self._handle.instance:
            # the sidecar restarted since we mapped its arena: these slots index the new one
            self._handle = self._client._refresh(self.table)
            if resp.instance != self._handle.instance:  # and restarted again since this Plan
                raise errors.Unavailable(f"the sidecar restarted while planning a step of table "
                                         f"{self.table!r}; plan the step again")
        self.lease_id = resp.lease_id
        self.hits, self.misses = resp.hits, resp.misses
        self._slots = np.frombuffer(resp.slots, dtype="<i8")

    def rows(self, timeout: float | None = None) -> np.ndarray:
        """uint8 [n, row_bytes] gathered from the mapped arena, request order."""
        slots = self.slots(timeout)  # first: a restarted sidecar swaps the handle
        return self._handle.arena_np[slots]

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if self._future is not None:
            try:
                self.slots()
            except errors.TierstoreError:
                return
            if self.lease_id:
                self._client._release_async(self.lease_id)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


class Client:
    """Connection to one sidecar: `Client(socket_path)` or `Client(target="host:port", token=...)`.

    timeout: seconds any call may take before it fails with Unavailable.
    token: the sidecar's shared token (--auth-token), sent on TCP.
    root_certificates: PEM bytes of the CA (or self-signed certificate) that
        signed the sidecar's --tls-cert; the TCP channel then speaks TLS.
    """

    def __init__(self, socket: str | Path | None = None, *, target: str | None = None, timeout: float = 30.0,
                 token: str | None = None, client_name: str = "", root_certificates: bytes | None = None):
        if (socket is None) == (target is None):
            raise ValueError("give exactly one of socket=PATH or target=HOST:PORT")
        self.target = f"unix:{socket}" if socket is not None else target
        self.local = socket is not None
        self.timeout = timeout
        self.client_name = client_name
        self._metadata = (("x-tierstore-token", token),) if token else None  # server.TOKEN_HEADER
        self._channel = self._open_channel(root_certificates)
        self._stub = pb_grpc.TierstoreStub(self._channel)
        self._handles: dict[str, TableHandle] = {}
        self._lock = threading.Lock()
        self._ended: list[int] = []  # released leases, repeated on the next Plan (idempotent)
        self._inflight: list = []    # Release calls not yet answered; close() waits for them

    def _open_channel(self, root_certificates: bytes | None):
        options = [
            ("grpc.max_receive_message_length", MAX_RESPONSE_BYTES),
            ("grpc.max_send_message_length", MAX_REQUEST_BYTES),
            # a restarted sidecar is found again within ~0.5 s, not gRPC's default 1-120 s backoff
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 500),
        ]
        if root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            return grpc.secure_channel(self.target, creds, options=options)
        return grpc.insecure_channel(self.target, options=options)

    # ---- plumbing -----------------------------------------------------------
    def _call(self, method: str, request, retry: bool = True):
        for attempt in (0, 1):
            try:
                return getattr(self._stub, method)(request, timeout=self.timeout, metadata=self._metadata)
            except grpc.RpcError as e:
                if attempt or not retry or e.code() != grpc.StatusCode.UNAVAILABLE or not self._reconnected():
                    raise to_error(e, self.target) from None
            except ValueError:  # grpc: "Cannot invoke RPC on closed channel!"
                raise errors.InvalidArgument(f"this Client of {self.target} is closed; make a new Client") from None

    def _reconnected(self) -> bool:
        """After UNAVAILABLE: wait briefly for the sidecar to come back (one retry, bounded)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=min(self.timeout, RECONNECT_WAIT_S))
            return True
        except grpc.FutureTimeoutError:
            return False

    def _release_async(self, lease_id: int) -> None:
        fut = self._stub.Release.future(pb.ReleaseRequest(lease_ids=[lease_id]), timeout=self.timeout,
                                        metadata=self._metadata)
        with self._lock:
            self._ended.append(lease_id)
            self._inflight = [f for f in self._inflight if not f.done()] + [fut]

    def handle(self, table: str) -> TableHandle:
        with self._lock:
            h = self._handles.get(table)
        if h is None:
            h = TableHandle(self._call("DescribeTable", pb.DescribeTableRequest(table=table)))
            if self.local:
                # map now, not at first read: a sidecar restarting in between would swap the
                # file under this handle while its instance still names the old one
                h.arena_np
            with self._lock:
                self._handles[table] = h
        return h

    def _refresh(self, table: str) -> TableHandle:
        with self._lock:
            self._handles.pop(table, None)
        return self.handle(table)

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
        table no RPC is made: slots are the ids, range-checked here.
        """
        h = self.handle(table)
        arr = as_ids(ids)
        if h.full_resident:  # slot == id: no RPC, no packing
            return StepPlan(self, h, check_ids(arr, h.rows, table), None)
        with self._lock:
            ended, self._ended = self._ended, []
        req = pb.PlanRequest(table=table, version=h.version, ids=arr.tobytes(), client=self.client_name,
                             ttl_ms=int(ttl_s * 1000) if ttl_s else 0, release=ended)
        fut = self._stub.Plan.future(req, timeout=self.timeout, metadata=self._metadata)
        return StepPlan(self, h, arr, fut, req)

    def lookup(self, table: str, ids, inline: bool = False) -> np.ndarray:
        """Rows uint8 [n, row_bytes] for `ids`, bit-exact as stored; via the arena unless inline."""
        if inline:
            resp = self._call("Lookup", pb.LookupRequest(table=table, ids=as_ids(ids).tobytes()))
            return np.frombuffer(resp.rows, dtype=np.uint8).reshape(-1, resp.row_bytes)
        with self.plan(table, ids) as step:
            return step.rows()

    def release(self, lease_ids) -> int:
        return self._call("Release", pb.ReleaseRequest(lease_ids=list(lease_ids))).released

    def stats(self) -> dict:
        resp = self._call("Stats", pb.StatsRequest())
        from google.protobuf.json_format import MessageToDict

        return MessageToDict(resp, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)

    def close(self) -> None:
        """Wait (bounded) for outstanding releases, then close the channel."""
        with self._lock:
            inflight, self._inflight = self._inflight, []
        for fut in inflight:
            try:
                fut.result(timeout=min(self.timeout, 5.0))
            except (grpc.RpcError, grpc.FutureTimeoutError):
                pass  # the lease ends by its TTL instead
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
