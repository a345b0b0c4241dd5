"""Client of a tierstore sidecar.

    from tierstore.client import Client
    with Client("/run/tierstore.sock") as c:           # a worker on the sidecar's host
        rows = c.lookup("l1", ids)                     # uint8 [n, row_bytes], read from the shared arena
        with c.plan("l1", ids) as step:                # returns at once
            ...                                        # run the first blocks meanwhile
            slots = step.slots()                       # int64 arena slot per id, leased to this step
            rows = step.rows()                         # gathered straight from the mapped arena

One route per operation and transport (docs/architecture.md):
- lookup: a TCP client, or `lookup(..., inline=True)`, gets the rows inline over
  gRPC; a client on the sidecar's host (`on_host`) reads them by its table
  handle's one route, chosen when the handle is made (TableHandle.begin): the
  mapped arena (full-resident), local reads (cache mode: the slot index, misses
  from the segment files), or a planned copy (cache mode under `serve
  --no-local-reads`).
- plan and release: the step socket (`<socket>.steps`, client/step_channel.py:
  StepChannel), clients on the sidecar's host only. A full-resident table needs
  no message at all: slot == id.
- describe, prefetch, reload, stats: gRPC.

Failures raise tierstore.errors types: IdOutOfRange / InvalidArgument (bad ids),
TableNotFound, ResourceExhausted (arena full of leased rows, request too big),
DataLoss (a corrupt cold block), Unavailable (no sidecar on the socket; the
call fails within `timeout` seconds instead of hanging).
"""
from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import grpc
import numpy as np

from tierstore import errors
from tierstore.client.arena_map import ArenaMaps, MappedArena
from tierstore.client.channel import open_channel, reconnected, to_error
from tierstore.client.local_reads import BusyClock
from tierstore.client.split_table import SplitTable
from tierstore.client.step_channel import StepChannel
from tierstore.client.step_plan import StepPlan, distinct_ids
from tierstore.client.table_handle import TableHandle
from tierstore.proto import tierstore_pb2 as pb
from tierstore.proto import tierstore_pb2_grpc as pb_grpc
from tierstore.proto.frames import PlanItem, step_socket_path
from tierstore.tiers.base import check_ids, check_out
from tierstore.tiers.nvme.miss_batch import MissBatch

__all__ = ["Client", "as_ids"]
_I8 = np.dtype("<i8")
# lookup_many begins table k of a step once this share of table k-1's reads has landed, where
# the first table's read is to take LOOKUP_STAGGER_FROM_S or more (its ids at the last
# overlapped call's seconds an id): each table's note leaves about half a table's read before
# the next step probes it (the sidecar promotes a prefill table's misses in ~25 ms; begun
# together, the next step probed before they landed: docs/decisions.md). Tables read in
# less are begun at once: a decode step's notes are learned in 2-3 ms and cost no hits begun
# at once, where a stagger cost it 2-10% of its rows/s
LOOKUP_STAGGER, LOOKUP_STAGGER_FROM_S = 0.5, 0.1


def as_ids(ids) -> np.ndarray:
    """Flat little-endian int64 ids (no copy when they already are)."""
    if type(ids) is np.ndarray and ids.dtype == _I8 and ids.ndim == 1:
        return ids  # what a step loop passes: nothing to convert
    try:
        arr = np.asarray(ids)
    except (ValueError, TypeError) as e:  # ragged nesting
        raise errors.InvalidArgument(f"ids must be integers in one flat sequence ({e})") from None
    if arr.dtype.kind not in "iu":
        raise errors.InvalidArgument(f"ids must be integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:  # not wrapped to < 0
        raise errors.IdOutOfRange(f"id {int(arr.max())} is beyond int64; row ids are 0..rows-1")
    return arr.reshape(-1).astype("<i8", copy=False)


def _ttl_ms(ttl_s: float | None) -> int:
    return int(ttl_s * 1000) if ttl_s else 0


class Client:
    """Connection to one sidecar: `Client(socket_path)` or `Client(target="host:port", token=...)`.

    timeout: seconds any call may take before it fails with Unavailable.
    token: the sidecar's shared token (--auth-token), sent on TCP.
    root_certificates: PEM bytes of the CA (or self-signed certificate) that
        signed the sidecar's --tls-cert; the TCP channel then speaks TLS.

    on_host: True for Client(socket): this process is on the sidecar's host and maps
    its arenas (plan(), local reads). False for a TCP client, which never maps one:
    lookup() fetches rows inline and plan() is refused. Leases taken by this client
    belong to its step channel (`step_channel`, client/step_channel.py; None on TCP):
    nobody else can release them, and they end when it closes.
    """

    def __init__(self, socket: str | Path | None = None, *, target: str | None = None, timeout: float = 30.0,
                 token: str | None = None, root_certificates: bytes | None = None):
        if (socket is None) == (target is None):
            raise ValueError("give exactly one of socket=PATH or target=HOST:PORT")
        self.socket = Path(socket) if socket is not None else None
        self.target = f"unix:{socket}" if socket is not None else target
        self.on_host = socket is not None
        self.timeout = timeout
        self._request_ids = itertools.count(int.from_bytes(os.urandom(6), "little") << 16 | 1)
        self._metadata = (("x-tierstore-token", token),) if token else None  # sidecar.auth.TOKEN_HEADER
        self._channel = open_channel(self.target, root_certificates)
        self._stub = pb_grpc.TierstoreStub(self._channel)
        self._handles: dict[str, TableHandle] = {}
        self._lock = threading.Lock()
        self._maps = ArenaMaps(self._lock)
        self._inflight: list = []  # Prefetch calls not yet answered; close() waits for them
        self._conn_id = os.urandom(16)  # tells this client's prefetch hints apart (PrefetchRequest.owner on the wire)
        self._closed = False
        self._id_seconds = 0.0  # lookup_many's last overlapped call: its seconds over its ids
        self.overlapped = 0  # lookup_many calls that read their tables overlapped (the others: in turn)
        # wall seconds any of this client's tables spent in its miss path (local reads), overlaps once
        self.miss_clock = BusyClock()
        self.step_channel = StepChannel(step_socket_path(self.socket), timeout=timeout) if self.on_host else None

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

    def _check_on_host(self, what: str) -> None:
        if not self.on_host:
            raise errors.InvalidArgument(
                f"{what} leases slots of the sidecar's shared arena, which only a process on its host can "
                f"read; a client of {self.target} reads rows with lookup()")

    def handle(self, table: str) -> TableHandle:
        with self._lock:
            h = self._handles.get(table)
        if h is not None and h.stale:
            h.close()
            h = None  # its arena was retired: a version swap or a restart
        if h is None:
            h = TableHandle(self._call("DescribeTable", pb.DescribeTableRequest(table=table)), self)
            if self.on_host:
                # map now, not at first read: a sidecar restarting in between would swap the
                # file under this handle while its instance still names the old one
                h.mapped
            with self._lock:
                self._handles[table] = h
        return h

    # ---- what a StepPlan asks of the client that planned it (step_plan.Planner) ----
    def refresh(self, table: str) -> TableHandle:
        """Describe `table` again now, whatever this client knew of it (a StepPlan whose reply
        names another sidecar instance: the sidecar restarted). Raises as handle() does."""
        with self._lock:
            self._handles.pop(table, None)
        return self.handle(table)

    def arena(self, path: str, slots: int, row_bytes: int, instance: str, leased: bool = False,
              split: int = 0) -> MappedArena:
        """The mapped arena at `path` (mapped once per client; retired ones are let go).

        leased: the caller holds a lease in it, so a retired arena may still be read.
        split: a split-layout arena's weight bytes per row (0: interleaved)."""
        return self._maps.arena(path, slots, row_bytes, instance, leased, split)

    def lease_alive(self, handle: TableHandle, lease_id: int) -> bool:
        """Whether lease `lease_id` of a step of `handle`'s table still lives, read from the
        sidecar's shared lease board (True where the sidecar keeps none: its TTL holds)."""
        return self._maps.lease_alive(handle.lease_board, handle.lease_board_entries, lease_id)

    def release_later(self, lease_id: int) -> None:
        """End a lease this client took on its next step's PLAN frame, or alone soon
        (StepChannel.release_later); nothing after close(): the leases ended with it."""
        if self.step_channel is not None:
            self.step_channel.release_later(lease_id)

    # ---- public API ---------------------------------------------------------
    def tables(self) -> list[dict]:
        resp = self._call("ListTables", pb.ListTablesRequest())
        return [dict(table=t.table, version=t.version, rows=t.rows, row_format=t.row_format, row_dim=t.row_dim,
                     row_bytes=t.row_bytes, full_resident=t.arena.full_resident, arena_slots=t.arena.slots)
                for t in resp.tables]

    def table_info(self, table: str) -> dict:
        return self.handle(table).info()

    def plan(self, table: str, ids, ttl_s: float | None = None) -> StepPlan:
        """Lease `ids` of `table` for one step; returns at once (the plan runs meanwhile).

        ids: any integer array (flattened; duplicates fine). For a full-resident
        table no message is sent: slots are the ids, range-checked here, read from
        the arena that is current now (a retired one is let go first). A cache-mode
        table's ids are deduplicated here and sent in one PLAN frame.
        ttl_s: the lease's lifetime (default: the sidecar's --lease-ttl; at most
            10 x that). A step that reads its rows after the lease ended gets
            them planned again, or StaleRows, never another step's rows.
        Raises InvalidArgument on a TCP client (plan needs the sidecar's host).
        """
        return self.plan_many({table: ids}, ttl_s)[table]

    def plan_many(self, tables: dict, ttl_s: float | None = None) -> dict[str, StepPlan]:
        """plan() for every table of a step ({table: ids}): the cache-mode tables in one
        PLAN frame, one round trip; returns {table: StepPlan}. The one route of a plan."""
        self._check_open()
        self._check_on_host("plan()")
        out, items, asked = {}, [], []
        for table, ids in tables.items():
            arr = as_ids(ids)
            h = self.handle(table)
            if h.full_resident:  # slot == id: no message, no packing
                out[table] = StepPlan(self, h, check_ids(arr, h.rows, table))
            else:
                send, inverse = distinct_ids(arr)
                items.append(PlanItem(table, send, 0, _ttl_ms(ttl_s), next(self._request_ids)))
                asked.append((h, arr, inverse))
        if items:
            pending = self.step_channel.submit(items)
            for k, (it, (h, arr, inverse)) in enumerate(zip(items, asked)):
                out[it.table] = StepPlan(self, h, arr, pending, k, inverse)
        return out

    def lookup(self, table: str, ids, inline: bool | None = None, out: np.ndarray | None = None,
               ahead=None) -> np.ndarray:
        """Rows uint8 [n, row_bytes] for `ids`, bit-exact as stored.

        A TCP client, or inline=True, gets the rows inline over gRPC. A client on
        the sidecar's host reads them itself, by the route its table's handle chose
        (TableHandle.begin): a full-resident table straight from the mapped arena;
        a cache-mode table through the slot index (client/local_reads.py), no
        round trip, the sidecar learning the step afterwards; where the sidecar
        offers no local reads (--no-local-reads), a planned and copied step.
        out: a buffer to read the rows into and return (uint8 [n, row_bytes], C-contiguous,
            writable; a step loop reuses one: RowScratch.take(n)): a fresh array each call
            costs its page faults and cold cache lines (client/row_scratch.py).
            Checked before anything is read (an unfit one is refused untouched); after
            another error its contents are undefined.
        ahead: the ids of this thread's next lookup of the table, where known (a queued
            prefill's next chunk): on the local-reads route their misses are read behind
            this call's and kept in flight across the calls, so the device's queue does not
            drain between them, and the next call copies those rows instead of reading them
            (a hint: rows it does not use are let go, and another thread's lookup does not
            see them; checked like `ids`, before anything is read).
        Raises IdOutOfRange / InvalidArgument (bad ids, an unfit `out`), TableNotFound,
        and what TableHandle.begin and its batch's finish raise."""
        after = self._ahead(table, ahead)
        if inline or not self.on_host:
            arr = as_ids(ids)
            if out is not None:
                check_out(out, arr.size, self.handle(table).row_bytes, table)
            resp = self._call("Lookup", pb.LookupRequest(table=table, ids=arr.tobytes()))
            rows = np.frombuffer(resp.rows, dtype=np.uint8).reshape(-1, resp.row_bytes)
            if out is None:
                return rows
            out[...] = rows
            return out
        return self._begin(table, ids, out, after).finish()

    def _ahead(self, table: str, ids) -> np.ndarray | None:
        """A lookup's `ahead` ids checked (IdOutOfRange, InvalidArgument), or None."""
        if ids is None:
            return None
        self._check_open()
        arr = as_ids(ids)
        check_ids(arr, self.handle(table).rows, table)
        return arr

    def _begin(self, table: str, ids, out: np.ndarray | None = None, ahead: np.ndarray | None = None) -> MissBatch:
        """TableHandle.begin of checked `ids` (and `out`; `ahead`, checked) on this host: lookup
        finishes it at once, lookup_many a step's tables once all are begun."""
        self._check_open()
        arr = as_ids(ids)
        h = self.handle(table)
        check_ids(arr, h.rows, table)
        if out is not None:
            check_out(out, arr.size, h.row_bytes, table)
        return h.begin(arr, out, ahead)

    def lookup_many(self, tables: dict, inline: bool | None = None, out: dict | None = None,
                    ahead: dict | None = None) -> dict[str, np.ndarray]:
        """lookup() for every table of a step ({table: ids}): {table: rows}, in the dict's order.

        On the sidecar's host, with every table's misses read with O_DIRECT (`serve
        --direct-io`), the tables are read overlapped, in this thread: each table begun in
        turn (TableHandle.begin: its hits copied, its misses' reads submitted to this
        thread's io_uring), then each ended in turn (its reads waited for, verified and
        placed, its step noted to the sidecar). One ring holds every table's reads, so the
        device's queue does not drain between tables: it reads one table's misses while the
        next one's hits are copied, and the next one's while the first one's are placed (the
        ids are known before the forward: an engine with two Engram layers reads both
        layers' rows in one call). One thread does it all, so overlapping takes no core from
        anything. Where the first table's read is to take LOOKUP_STAGGER_FROM_S or more (its
        ids at the last call's time an id), table k is begun once LOOKUP_STAGGER of table
        k-1's reads have landed, so each table's note leaves about half a table's read
        before the next step probes that table: the sidecar promotes a prefill table's
        misses ~25 ms after its note, and with steps back to back and every table begun at
        once the next step probed first (prefill hit -0.004 at the 1/6-scale table). Through
        the page cache the tables are read in turn (a begin reads there). A TCP client, or
        inline=True, asks for the tables in turn. out: {table: buffer}, lookup's `out` for any
        of the tables. ahead: {table: ids}, lookup's `ahead` for any of the tables (the next
        step's misses in flight across the calls, every table's), all checked before any
        table is read. Raises what lookup raises, after every table begun has ended (the
        first error in the dict's order), its `table` attribute the table whose read raised
        it (an engine names the layer); InvalidArgument when `tables`, `out` or `ahead` is
        not a mapping."""
        for what, m in (("{table: ids}", tables), ("out={table: buffer}", {} if out is None else out),
                        ("ahead={table: ids}", {} if ahead is None else ahead)):
            if not isinstance(m, Mapping):
                raise errors.InvalidArgument(f"lookup_many takes {what}, got {type(m).__name__}")
        outs, aheads = out or {}, ahead or {}
        for what, m in (("out", outs), ("ahead", aheads)):
            extra = [t for t in m if t not in tables]
            if extra:
                raise errors.InvalidArgument(f"lookup_many's {what} names table(s) {extra} that the step does not read")
        checked = {}
        for t, a in aheads.items():  # every table's `ahead` checked before any table is read
            try:
                checked[t] = self._ahead(t, a)
            except BaseException as e:
                e.table = t
                raise
        items = list(tables.items())
        if inline or not self.on_host or len(items) < 2 or not self._all_direct(items):
            got = {}
            for t, ids in items:
                try:
                    got[t] = self.lookup(t, ids, inline, outs.get(t), checked.get(t))
                except BaseException as e:
                    e.table = t
                    raise
            return got
        self.overlapped += 1
        t0 = time.perf_counter()
        stagger = LOOKUP_STAGGER > 0 and self._id_seconds * np.size(items[0][1]) >= LOOKUP_STAGGER_FROM_S
        begun, failed = [], []
        for k, (t, ids) in enumerate(items):
            try:
                if stagger and begun:  # the last table's reads part landed first (its note leaves earlier)
                    begun[-1][2].land(LOOKUP_STAGGER)
                begun.append((k, t, self._begin(t, ids, outs.get(t), checked.get(t))))
            except BaseException as e:  # the tables begun are still finished: their reads are in flight
                e.table = t
                failed.append((k, e))
        got = {}
        for k, t, b in begun:
            try:
                got[t] = b.finish()
            except BaseException as e:
                e.table = t
                failed.append((k, e))
        self._id_seconds = (time.perf_counter() - t0) / max(1, sum(np.size(ids) for _, ids in items))
        if failed:
            raise min(failed, key=lambda f: f[0])[1]
        return {t: got[t] for t, _ in items}

    def _all_direct(self, items: list) -> bool:
        """Every table of the step reads its misses with O_DIRECT (the sidecar's --direct-io)."""
        try:
            return all(self.handle(t).cold_direct for t, _ in items)
        except errors.TierstoreError:
            return False  # read in turn: lookup raises it, in the dict's order

    def split_table(self, table: str) -> SplitTable:
        """The split-layout table `table` mapped read-only for an engine (client/split_table.py):
        `.weight` uint8 [rows, row_dim] then `.scale` uint8 [rows, row_dim // 32], byte for
        byte the host table sglang and vLLM keep; `.tensors()`, `.register_cuda()`, `.close()`.

        The SplitTable outlives this client (its own mapping, shared per process); close it.
        Raises InvalidArgument when the table is not served split-layout (the message
        names the `serve --split-layout` flag) or on a TCP client (the arena is on the
        sidecar's host); TableNotFound, Unavailable as describe does."""
        self._check_open()
        if not self.on_host:
            raise errors.InvalidArgument(f"split_table() maps the sidecar's shared arena, which only a process on "
                                         f"its host can read; a client of {self.target} reads rows with lookup()")
        return SplitTable(self.handle(table))

    def flush(self) -> None:
        """Send the steps local reads noted now, one-way (they go within a few ms by themselves)."""
        if self.step_channel is not None:
            self.step_channel.flush_notes()

    def prefetch(self, table: str, ids, read: bool = True, steps: int | None = None) -> None:
        """Ask the sidecar to promote rows a queued request will read (no lease, returns
        at once): their disk reads overlap the time the request waits to run.

        read=False: only hint the rows already resident (the cache policy keeps them
        over others until the request runs) and read nothing; for requests more than
        a step or two from running, whose reads would evict rows sooner needed.
        steps: about how many steps until the request runs; its rows are kept that
        long (default: the sidecar's --policy default, 16), at most the sidecar's
        longest hint (TableHandle.max_prefetch_steps, 4096 by default): more raises
        InvalidArgument, as the sidecar would refuse it. Say it when known: a hint
        that outlives its request keeps rows nobody reads; one that waits longer
        can be sent again. Ids not resident yet are kept pending within a bound per
        client and per table; past it the rest of a hint is dropped (it is a hint)."""
        self._check_open()
        if steps is not None:
            longest = self.handle(table).max_prefetch_steps or 2**32 - 1
            if not 0 < int(steps) <= longest:
                raise errors.InvalidArgument(f"prefetch steps must be a step count in 1..{longest} (this sidecar's "
                                             f"longest hint), got {steps}; hint the request again if it waits longer")
        req = pb.PrefetchRequest(table=table, ids=as_ids(ids).tobytes(), hint_only=not read, steps=int(steps or 0),
                                 owner=self._conn_id)
        fut = self._stub.Prefetch.future(req, timeout=self.timeout, metadata=self._metadata)
        with self._lock:  # held until answered: a collected future cancels its call
            self._inflight = [f for f in self._inflight if not f.done()] + [fut]

    def reload(self, table: str = "", version: int = 0) -> list[tuple[str, int, int]]:
        """Make the sidecar serve the catalog's current versions (or `table` at `version`)
        without a restart; returns [(table, old version, new version)] that changed."""
        resp = self._call("Reload", pb.ReloadRequest(table=table, version=version))
        return [(c.table, c.old_version, c.new_version) for c in resp.changed]

    def release(self, lease_ids) -> int:
        """End leases this client took now; returns how many were live (others' ids are
        ignored: a client ends only its own). A TCP client holds none: 0.

        A step loop releases its StepPlan instead (StepPlan.release), which queues the
        lease for the next step's request at no cost of its own. This call waits for the
        sidecar, for a caller that must know the leases ended, and how many did; it takes
        the same path as that queue: StepChannel.release sends these ids with every queued
        one in the RELEASE frame the channel's flusher sends the queue in."""
        self._check_open()
        if not self.on_host:
            return 0
        return self.step_channel.release([int(i) for i in lease_ids])

    def stats(self) -> dict:
        resp = self._call("Stats", pb.StatsRequest())
        from google.protobuf.json_format import MessageToDict

        return MessageToDict(resp, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)

    def close(self) -> None:
        """Send queued notes and releases, wait (bounded) for prefetches, close the connections."""
        if self._closed:
            return
        with self._lock:
            inflight, self._inflight = self._inflight, []
        for fut in inflight:
            try:
                fut.result(timeout=min(self.timeout, 5.0))
            except (grpc.RpcError, grpc.FutureTimeoutError):
                pass  # a hint: nothing depends on it
        self._closed = True
        if self.step_channel is not None:
            self.step_channel.close()  # the sidecar ends this connection's leases
        self._channel.close()
        for h in self._handles.values():
            h.close()
        self._maps.drop()
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
