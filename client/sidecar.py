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
import json
import mmap
import os
import threading
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import numpy as np

from tierstore import errors
from tierstore.config import MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES
from tierstore.proto import tierstore_pb2 as pb
from tierstore.proto import tierstore_pb2_grpc as pb_grpc
from tierstore.tiers.base import check_ids
from tierstore.client.fastpath import FastPathClient
from tierstore.fastpath import PlanItem, PlanResult, fast_socket_path
from tierstore.leases import INDEX_MASK
from tierstore.tiers.dram import map_readonly
from tierstore.tiers.fused import unique_inverse

if TYPE_CHECKING:
    import torch

RECONNECT_WAIT_S = 2.0
_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
    grpc.StatusCode.DATA_LOSS: errors.DataLoss,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.Unavailable,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.ABORTED: errors.StaleRows,
}
# a gather whose lease ended meanwhile is planned again this many times, then StaleRows
REPLANS = 1
# a fast-path release waits this long for the next step's request to carry it
RELEASE_LINGER_S = 0.02


def to_error(e: grpc.RpcError, target: str = "") -> errors.TierstoreError:
    """The tierstore error a status carries: the class named in its trailing metadata
    (errors.ERROR_METADATA_KEY), else in its text ("ClassName: message", older sidecars), else by code."""
    detail = e.details() or ""
    name, _, msg = detail.partition(": ")
    named = dict(getattr(e, "trailing_metadata", lambda: None)() or ()).get(errors.ERROR_METADATA_KEY)
    if named:
        name, msg = named, detail.removeprefix(f"{named}: ")
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


def unregister_for_cuda(arr: np.ndarray) -> None:
    """Undo register_for_cuda before dropping a mapping (page-locked pages would stay pinned)."""
    import torch

    torch.cuda.cudart().cudaHostUnregister(arr.ctypes.data)


class MappedArena:
    """One arena file mapped read-only (numpy view, its header, a torch view on demand)."""

    def __init__(self, path: str, slots: int, row_bytes: int, instance: str | None, allow_retired: bool = False):
        self.path = path
        self.rows, self.header = map_readonly(path, slots, row_bytes, instance=instance, allow_retired=allow_retired)
        self._tensor = None
        self._registered = False

    @property
    def retired(self) -> bool:
        return self.header.retired

    @property
    def tensor(self) -> "torch.Tensor":
        if self._tensor is None:
            import torch  # here: a numpy-only client does not pay torch's import

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only mapping: we never write through it
                self._tensor = torch.from_numpy(self.rows)
            if torch.cuda.is_available():
                self._registered = register_for_cuda(self.rows)
        return self._tensor

    def drop(self) -> None:
        """Forget the mapping (its pages go when the last view does)."""
        if self._registered:
            unregister_for_cuda(self.rows)
            self._registered = False
        self._tensor = None


class TableHandle:
    """What a client knows about one served table; its arena is mapped on first use."""

    def __init__(self, info: pb.TableInfo, client: "Client | None" = None):
        self.table, self.version, self.rows = info.table, info.version, info.rows
        self.row_format, self.row_dim, self.row_bytes = info.row_format, info.row_dim, info.row_bytes
        self.spec = json.loads(info.spec_json) if info.spec_json else None
        self.layer_id = None if info.layer_id < 0 else info.layer_id
        self.full_resident = info.arena.full_resident
        self._arena_path, self._arena_slots = info.arena.path, info.arena.slots
        self.instance = info.arena.instance
        self.lease_board, self.lease_board_entries = info.arena.lease_board, info.arena.lease_board_entries
        self._client = client
        self._mapped: MappedArena | None = None

    @property
    def mapped(self) -> MappedArena:
        if self._mapped is None:
            # mapped on first use: a remote client that only uses inline lookups never maps
            self._mapped = (self._client.arena(self._arena_path, self._arena_slots, self.row_bytes, self.instance)
                            if self._client is not None else
                            MappedArena(self._arena_path, self._arena_slots, self.row_bytes, self.instance))
        return self._mapped

    @property
    def arena_np(self) -> np.ndarray:
        return self.mapped.rows

    @property
    def arena(self) -> "torch.Tensor":
        return self.mapped.tensor

    @property
    def stale(self) -> bool:
        """The arena was retired (version swap, restart): describe the table again."""
        return self._mapped is not None and self._mapped.retired

    def info(self) -> dict:
        return dict(rows=self.rows, row_bytes=self.row_bytes, row_format=self.row_format, row_dim=self.row_dim,
                    spec=self.spec, version=self.version, layer_id=self.layer_id, full_resident=self.full_resident)


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
            out = self._mapped.rows[slots]
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
        self._channel = self._open_channel(root_certificates)
        self._stub = pb_grpc.TierstoreStub(self._channel)
        self._handles: dict[str, TableHandle] = {}
        self._arenas: dict[str, MappedArena] = {}
        self._boards: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()
        self._ended: list[int] = []  # released leases, repeated on the next Plan (idempotent)
        self._inflight: list = []    # Release calls not yet answered; close() waits for them
        self._closed = False
        self._fast_wanted = fast_path and self.local
        self._fast: FastPathClient | None = None
        self._flusher, self._flush_event, self._flush_due = None, threading.Event(), 0.0

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
        """After UNAVAILABLE: wait briefly for the sidecar to come back (one retry, bounded)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=min(self.timeout, RECONNECT_WAIT_S))
            return True
        except grpc.FutureTimeoutError:
            return False

    def _check_open(self) -> None:
        if self._closed:
            raise errors.InvalidArgument(f"this Client of {self.target} is closed; make a new Client")

    def _release_async(self, lease_id: int, fast: bool = False) -> None:
        if self._closed:
            return  # the lease ends by its TTL
        if fast and self._fast is not None:
            self._fast.release_later([lease_id])  # rides on the next step's request...
            self._flusher_wake()                  # ...or goes alone if none comes soon
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
        with self._lock:
            m = self._arenas.get(path)
            if m is not None and (leased or not m.retired):
                return m
            for p in [p for p, x in self._arenas.items() if x.retired and p != path]:
                self._arenas.pop(p).drop()
        m = MappedArena(path, slots, row_bytes, instance, allow_retired=leased)
        with self._lock:
            self._arenas[path] = m
        return m

    def _lease_alive(self, handle: TableHandle, lease_id: int) -> bool:
        board = self._boards.get(handle.lease_board)
        if board is None:
            if not handle.lease_board:  # a sidecar without a board: trust the TTL
                return True
            board = _map_board(handle.lease_board, handle.lease_board_entries)
            self._boards = {handle.lease_board: board}  # one sidecar instance at a time
        return int(board[lease_id & INDEX_MASK]) == lease_id

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
        if self._fast_client() is not None:
            return self.plan_many({table: arr}, ttl_s)[table]
        return self._plan_grpc(table, arr, ttl_s)

    def _plan_grpc(self, table: str, arr: np.ndarray, ttl_s: float | None) -> StepPlan:
        h = self.handle(table)
        send, inverse = _distinct(arr)
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
        out, items, arrs, inverses = {}, [], {}, {}
        for table, ids in tables.items():
            arrs[table] = arr = as_ids(ids)
            if not self.local:
                out[table] = _InlineStep(self, table, arr)
                continue
            h = self.handle(table)
            if h.full_resident:
                out[table] = StepPlan(self, h, check_ids(arr, h.rows, table), None)
            else:
                send, inverses[table] = _distinct(arr)
                items.append(PlanItem(table, send, 0, int(ttl_s * 1000) if ttl_s else 0, next(self._request_ids)))
        fast = self._fast_client() if items else None
        if fast is None:
            for it in items:
                out[it.table] = self._plan_grpc(it.table, arrs[it.table], ttl_s)
            return out
        pending = fast.submit(items)
        for k, it in enumerate(items):
            out[it.table] = StepPlan(self, self.handle(it.table), arrs[it.table], _FastReply(pending, k),
                                     inverse=inverses[it.table])
        return out

    def _flusher_wake(self) -> None:
        """Releases queued on the fast path go out with the next request; a client that
        stops planning sends them after RELEASE_LINGER_S (a lease left until its TTL would
        hold its rows, and a retired arena, for nothing)."""
        self._flush_due = time.monotonic() + RELEASE_LINGER_S
        if self._flusher is None:
            self._flusher = threading.Thread(target=self._flush_loop, name="tierstore-release", daemon=True)
            self._flusher.start()
        self._flush_event.set()

    def _flush_loop(self) -> None:
        while not self._closed:
            self._flush_event.wait()
            self._flush_event.clear()
            while not self._closed and time.monotonic() < self._flush_due:
                time.sleep(max(0.0, self._flush_due - time.monotonic()))
            fast = self._fast
            if fast is not None and not self._closed and fast._queued:
                try:
                    fast.release([])
                except errors.TierstoreError:
                    pass  # the sidecar is gone: its leases went with it

    def _fast_client(self) -> "FastPathClient | None":
        """The fast-path connection, made on first use; None when the sidecar has none."""
        if not self._fast_wanted:
            return None
        if self._fast is None:
            with self._lock:
                if self._fast is None:
                    path = fast_socket_path(self.socket)
                    try:
                        self._fast = FastPathClient(path, owner=self.owner, timeout=self.timeout)
                    except errors.TierstoreError:
                        self._fast_wanted = False  # an older sidecar, or refused: gRPC it is
                        return None
        return self._fast

    def lookup(self, table: str, ids, inline: bool | None = None) -> np.ndarray:
        """Rows uint8 [n, row_bytes] for `ids`, bit-exact as stored; via the arena
        (local clients) or inline (TCP clients, or inline=True)."""
        if inline or (inline is None and not self.local):
            resp = self._call("Lookup", pb.LookupRequest(table=table, ids=as_ids(ids).tobytes()))
            return np.frombuffer(resp.rows, dtype=np.uint8).reshape(-1, resp.row_bytes)
        with self.plan(table, ids) as step:
            return step.rows()

    def prefetch(self, table: str, ids) -> None:
        """Ask the sidecar to promote rows a queued request will read (no lease, returns
        at once): their disk reads overlap the time the request waits to run."""
        self._check_open()
        fut = self._stub.Prefetch.future(pb.PrefetchRequest(table=table, ids=as_ids(ids).tobytes()),
                                         timeout=self.timeout, metadata=self._metadata)
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
        n = self._fast.release(lease_ids) if self._fast is not None else 0
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
        self._flush_event.set()
        if self._fast is not None:
            self._fast.close()  # the sidecar ends this connection's leases
            self._fast = None
        self._channel.close()
        for m in self._arenas.values():
            m.drop()
        self._arenas.clear()
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _distinct(arr: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(ids to ask the sidecar for, inverse or None): a step's ids deduplicated here,
    in the worker's own process, so the sidecar (one process for all workers) does
    not sort them and replies with one slot per distinct id."""
    if arr.size < 2 or bool((arr[1:] > arr[:-1]).all()):
        return arr, None
    return unique_inverse(arr)


def _map_board(path: str, entries: int) -> np.ndarray:
    """The sidecar's lease board, read-only."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        mm = mmap.mmap(fd, 8 * entries, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    return np.frombuffer(mm, dtype="<u8")
