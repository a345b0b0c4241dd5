"""StepChannel: one client's step socket (`<socket>.steps`) and everything that rides on it.

    from tierstore.client.step_channel import StepChannel, raise_errors
    from tierstore.proto.frames import PlanItem
    with StepChannel("/run/tierstore.sock.steps") as ch:
        step = ch.submit([PlanItem("l1", ids1), PlanItem("l14", ids14)])
        ...                                # the round trip overlaps the caller's work
        l1, l14 = raise_errors(step.result())
        slots = l1.slots                   # int64, one per id, read-only view of the reply (no copy)
        ch.release_later([l1.lease_id, l14.lease_id])   # ends them on the next request, no round trip

The channel owns the transport state, and nothing else touches it: the socket
(connected on first use, reconnecting once by itself), the one request in
flight (a PendingReply), the queue of released leases and the flusher thread.
One release path: a released lease is queued (release_later) to ride on the
next step's PLAN frame; a client that stops planning sends the queue in a
RELEASE frame after RELEASE_LINGER_S, from the flusher, and release() sends it
now, with the leases it is given, for a caller that needs the count.

Steps a client read itself (client/local_reads.py) are noted here and sent in batches, one-way, by
the flusher: every NOTE_EVERY_S or NOTE_IDS ids while steps run, and after the
last; a step sends them itself only when NOTE_BACKLOG_IDS ids wait while an earlier
note is still being sent (a prefill step's ids, past that bound on their own, go
with the flusher while the step reads on). A note carries the rows its steps read
from disk (format 2: records, each row with its sum), up to
NOTE_ROW_BYTES a frame, so the sidecar promotes them without reading them again
(it verifies each first); rows past that bound go without their bytes (the
sidecar reads the ones it promotes). The frame goes out as a scatter list: the
rows are not copied into it.

Each PlanResult carries `instance`: when it differs from the one whose arena you
mapped, the sidecar restarted (the channel reconnected as a new conn_id) and the
slots index the new arena: remap it. Errors of one table come back as that
item's entry (a tierstore.errors instance, same class as the server raised);
use raise_errors(results) to raise the first. Whole-request failures raise.

Failure modes: Unavailable (no sidecar on the socket, or no reply within
`timeout` seconds; the message names the socket), ResourceExhausted (request
over the sidecar's size limit, or max_clients reached), InvalidArgument (bad
items, protocol mismatch, a closed channel). Thread-safe: calls take turns on
the one connection; use one channel per thread for parallel steps.
"""
from __future__ import annotations

import os
import socket
import struct
import threading
import time
from pathlib import Path

import numpy as np

from tierstore import errors
from tierstore.proto.frames import (COUNT, ERROR, HDR, HELLO, HELLO_REQ, HELLO_RESP, ITEM, MAGIC, MAX_NAME,
                                MAX_RELEASE, NOTE, PLAN, PLAN_REQ, PROTOCOL_VERSION, RELEASE, RES_OK, U64, FrameError,
                                FrameReader, IOV_CAP, NoteItem, PlanItem, PlanResult, decode_error, encode_note,
                                frame_views, pad8, send_frame, send_rest, spin_seconds)

__all__ = ["StepChannel", "PendingReply", "raise_errors", "RECONNECT_WAIT_S", "RELEASE_LINGER_S"]

RECONNECT_WAIT_S = 2.0   # how long a call waits for a restarting sidecar before Unavailable
RENOTE_S = 0.1           # a lost connection is tried again by notes at most this often
SPIN_MAX_REQUEST_BYTES = 32 << 10  # 4k ids: beyond, a blocking read's wake-up is small against the plan's work
# a release waits this long for the next step's request to carry it
RELEASE_LINGER_S = 0.02
# local reads' notes go out at least this often while steps run, or once this many ids wait
NOTE_EVERY_S, NOTE_IDS = 0.002, 1 << 13
# bytes of rows one note carries at most (and at most half the sidecar's request limit)
NOTE_ROW_BYTES = 32 << 20
NOTE_BACKLOG_IDS = 4 * NOTE_IDS  # noted ids waiting on a note in flight before a step sends them itself
_PAD = bytes(8)
_I8 = np.dtype("<i8")
_NO_LEASES = np.empty(0, "<u8")
_NAMES: dict[str, bytes] = {}


def raise_errors(results: list) -> list[PlanResult]:
    """The results, or the first item's error raised."""
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


class PendingReply:
    """A request sent by StepChannel.submit; result() returns its reply (or raises).

    Settled once, by the channel that sent it: when its reply is read (the caller's
    result(), or the channel's next request, which collects it first) or the channel
    closes."""

    __slots__ = ("channel", "op", "parts", "size", "n_items", "error", "_value", "_error", "_done")

    def __init__(self, channel: "StepChannel", op: int, parts: list, size: int, n_items: int):
        self.channel, self.op, self.parts, self.size, self.n_items = channel, op, parts, size, n_items
        self.error = None  # a send that failed: resend after reconnecting
        self._value = self._error = None
        self._done = False

    def settle(self, value=None, error=None) -> None:
        """The channel's: the reply is `value`, or the request failed with `error`."""
        self._value, self._error, self._done, self.parts = value, error, True, None

    def done(self) -> bool:
        """Whether the reply has been read (a later call on the client reads it)."""
        return self._done

    def result(self):
        """The reply: a list with one PlanResult or error per item (PLAN), the released count (RELEASE)."""
        if not self._done:
            self.channel.collect(self)
        if self._error is not None:
            raise self._error
        return self._value


class StepChannel:
    """The step socket at `path` (the sidecar's `<socket>.steps`) of one client.

    conn_id: 16 bytes naming the first connection's leases (random when None); the
           sidecar ends a conn_id's leases when its connection closes, and a
           reconnect takes a fresh conn_id.
    timeout: seconds a call may wait for the sidecar before Unavailable.

    Nothing is sent until the first call: connect() makes the connection now
    (the handshake), a request or a note makes it when none was made yet.
    """

    def __init__(self, path, conn_id: bytes | None = None, timeout: float = 30.0):
        if conn_id is not None and (not isinstance(conn_id, bytes) or len(conn_id) != 16):
            raise errors.InvalidArgument(f"step-socket conn_id must be 16 bytes, got {conn_id!r}")
        if not timeout > 0:
            raise errors.InvalidArgument(f"timeout must be positive seconds, got {timeout}")
        self.path, self.timeout = Path(path), float(timeout)
        self.conn_id, self.instance, self.max_request_bytes = conn_id or os.urandom(16), "", 0
        self._sock: socket.socket | None = None
        self._inflight: PendingReply | None = None
        self._queued: list[int] = []  # release_later's lease ids, sent with the next request
        self._queue_lock = threading.Lock()
        self._lock = threading.Lock()
        self._closed = False
        self._connected = False  # a handshake has succeeded: later connections take a fresh conn_id
        self._retry_at = 0.0  # when a note may next try to reconnect (_reconnect)
        self._spin_s = spin_seconds()
        self._flusher, self._flush_event, self._flush_due = None, threading.Event(), 0.0
        # (table, version) -> (id arrays, sizes, row-id arrays, row arrays)
        self._notes: dict[tuple[str, int], tuple[list, list, list, list]] = {}
        self._note_ids, self._note_since, self._note_bytes = 0, 0.0, 0
        self._notes_lock = threading.Lock()
        self._flushing = 0  # notes being sent now (flush_notes, by the flusher or a step)

    # -- public calls ----------------------------------------------------------------------

    def connect(self) -> "StepChannel":
        """Make the connection now if none was made yet (a no-op after: the next request
        makes a lost one again); returns self. Raises Unavailable (no sidecar answers on
        the step socket), ResourceExhausted (it serves its maximum of connections, or
        this conn_id's already), InvalidArgument (another protocol, a closed channel)."""
        with self._lock:
            self._check_open()
            if not self._connected:
                self._connect(self.conn_id, wait=0.0)
        return self

    def submit(self, items: list[PlanItem]) -> PendingReply:
        """Send the step's PLAN now, with up to MAX_RELEASE queued releases, and return at
        once; `.result()` waits for the reply.

        Overlaps the round trip with the caller's work. One request is in flight
        per client: the next call first collects this reply (kept for its
        result()). Keep `ids` unchanged until result(): a reconnect resends them.
        Bad items raise here (InvalidArgument, ResourceExhausted); a lost sidecar
        raises Unavailable here or from result()."""
        items = list(items)
        parts, size = [None, None], PLAN_REQ.size
        for i, it in enumerate(items):
            ids = it.ids
            if type(ids) is not np.ndarray or ids.dtype != _I8 or not ids.flags.c_contiguous:
                ids = np.asarray(ids)
                if ids.dtype.kind not in "iu":
                    raise errors.InvalidArgument(f"plan item {i} ({it.table!r}): ids must be integers, "
                                                 f"got {ids.dtype}")
                ids = np.ascontiguousarray(ids.ravel(), dtype=_I8)
            name = _NAMES.get(it.table)
            if name is None:
                name = it.table.encode("utf-8")
                if len(_NAMES) < 1024:  # a step loop's few tables, encoded once
                    _NAMES[it.table] = name
            if len(name) > MAX_NAME:
                raise errors.InvalidArgument(f"plan item {i}: table name of {len(name)} B is over {MAX_NAME} B")
            try:
                head = ITEM.pack(it.version, it.request_id, ids.size, it.ttl_ms, len(name))
            except struct.error as e:
                raise errors.InvalidArgument(f"plan item {i} ({it.table!r}): version, request_id, ttl_ms or the "
                                             f"id count is out of range: {e}") from None
            parts += [head, name, _PAD[:pad8(len(name))], ids]
            size += ITEM.size + len(name) + pad8(len(name)) + ids.nbytes
        rel, queued = self._take_queued()
        parts[:2] = PLAN_REQ.pack(len(items), rel.size), rel
        try:
            return self._submit(PendingReply(self, PLAN, parts, size + rel.nbytes, len(items)))
        except BaseException:
            self.release_later(queued)  # not sent: they ride on the next request instead
            raise

    def release_later(self, lease_ids) -> None:
        """Queue leases to end on this channel's next request (no round trip of their own),
        or in a RELEASE frame of their own after RELEASE_LINGER_S when none comes.

        For a StepPlan's release() in a step loop: the next step's PLAN carries them.
        A channel that closes needs no flush: the sidecar ends a closed conn_id's leases,
        so after close() (or before any connection: no lease exists) this does nothing.
        lease_ids: an array or list of ids, or one id (an int); OverflowError or
        ValueError for what is not a lease id, nothing queued."""
        if type(lease_ids) is int and 0 <= lease_ids < 1 << 64:  # a StepPlan's one lease, every step
            more = [lease_ids]
        elif type(lease_ids) is list and all(type(i) is int and 0 <= i < 1 << 64 for i in lease_ids):
            more = lease_ids  # a step's lease ids as a list: no array round trip (extend copies them)
        else:
            more = [int(i) for i in np.asarray(lease_ids, dtype=np.uint64).ravel()]
        if self._closed or not self._connected or not more:
            return
        with self._queue_lock:
            self._queued.extend(more)
        self._flusher_wake()

    def _take_queued(self) -> tuple[np.ndarray, list[int]]:
        """The first MAX_RELEASE queued lease ids, off the queue (as sent, and as a list to queue
        again if the send fails); the rest wait for the next request."""
        with self._queue_lock:
            if not self._queued:
                return _NO_LEASES, []
            queued, self._queued = self._queued[:MAX_RELEASE], self._queued[MAX_RELEASE:]
        return np.array(queued, dtype="<u8"), queued

    def release(self, lease_ids=()) -> int:
        """End these leases and every one queued by release_later now, in RELEASE frames (the
        flusher's send of the queue); returns how many were live (0 before any connection:
        no lease of this channel exists; 0 once the connection is lost, without waiting for
        a sidecar: its leases ended with it. So the flusher never holds the channel through a
        restarting sidecar's wait, which a plan would then queue behind)."""
        if not self._connected:
            self._check_open()
            return 0
        ids = np.ascontiguousarray(lease_ids, dtype="<u8").ravel()
        with self._queue_lock:
            ids, self._queued = np.concatenate([ids, np.asarray(self._queued, dtype="<u8")]), []
        released = 0
        for at in range(0, max(ids.size, 1), MAX_RELEASE):
            part = ids[at:at + MAX_RELEASE]
            released += self._submit(PendingReply(self, RELEASE, [COUNT.pack(part.size), part],
                                                 COUNT.size + part.nbytes, 0)).result()
        return released

    def note(self, table: str, version: int, ids: np.ndarray, row_ids: np.ndarray | None = None,
             rows: np.ndarray | None = None) -> None:
        """A step of `table` this client read itself (int64 ids, kept as given: do not
        change them); sent with others, one-way, soon (see the module docstring).
        row_ids, rows: the rows of its misses as read from disk (int64 [n], uint8
        [n, row_bytes], kept as given too), carried while the note has room."""
        now = time.monotonic()
        with self._notes_lock:
            buf = self._notes.get((table, version))
            if buf is None:
                buf = self._notes[(table, version)] = ([], [], [], [])
            buf[0].append(ids)
            buf[1].append(ids.size)
            if rows is not None and rows.size and self._note_bytes + rows.nbytes <= NOTE_ROW_BYTES:
                buf[2].append(row_ids)
                buf[3].append(rows)
                self._note_bytes += rows.nbytes
            if not self._note_ids:
                self._note_since = now
            self._note_ids += ids.size
            due = self._note_ids >= NOTE_IDS or now - self._note_since >= NOTE_EVERY_S
            behind = self._behind()
        if behind:  # the flusher cannot keep up: this step pays for the send itself
            self.flush_notes()
        else:  # the flusher sends them, so the step does not wait on the socket
            self._flusher_wake(now if due else None)

    def _behind(self) -> bool:
        """The flusher cannot keep up: NOTE_BACKLOG_IDS ids wait while an earlier note is still
        being sent (under _notes_lock). One step's ids over the bound with the flusher idle are its
        to send: the step goes on to its next reads while the flusher waits on the socket."""
        return self._note_ids >= NOTE_BACKLOG_IDS and self._flushing > 0

    def flush_notes(self) -> None:
        """Send the noted steps now (dropped when no connection can be had: they are hints)."""
        with self._notes_lock:
            notes, self._notes, self._note_ids, self._note_bytes = self._notes, {}, 0, 0
            if not notes or self._closed:
                return
            self._flushing += 1
        try:
            self._send_noted(notes)
        finally:
            with self._notes_lock:
                self._flushing -= 1

    def _send_noted(self, notes: dict) -> None:
        items = [NoteItem(t, _joined(arrs), np.cumsum(sizes, dtype=np.int64), v,
                            _joined(row_ids) if row_ids else None, _joined(rows) if rows else None)
                 for (t, v), (arrs, sizes, row_ids, rows) in notes.items()]
        try:
            self.connect()
            if sum(it.rows.nbytes for it in items if it.rows is not None) > self.max_request_bytes // 2:
                for it in items:  # a sidecar with a small request limit: the ids still go
                    it.row_ids = it.rows = None
            self.send_notes(items)
        except errors.TierstoreError:
            pass

    def send_notes(self, items: list) -> bool:
        """Tell the sidecar about steps this client read itself (proto.frames.NoteItem list):
        one frame, no reply, no round trip. A hint, and lossy: when the sidecar is behind
        (its socket buffer is full) the note is dropped rather than this step made to
        wait, so N clients never run at the pace of the sidecar's bookkeeping. Returns
        whether it was sent; the request in flight, if any, is unaffected."""
        parts, size = encode_note(items)
        views = frame_views(NOTE, parts)  # a scatter list: the rows are not copied into one frame
        with self._lock:
            if self._closed or size > self.max_request_bytes or (self._sock is None and not self._reconnect()):
                return False
            try:
                sent = self._sock.sendmsg(views[:IOV_CAP], [], socket.MSG_DONTWAIT)
            except BlockingIOError:
                return False
            except OSError:
                self._drop()  # the reply read of the request in flight reconnects
                return False
            try:  # a frame begun must be finished, or the stream is out of step
                send_rest(self._sock, views, sent)
            except OSError:  # including a send timeout (EAGAIN): the stream is cut mid-frame
                self._drop()
                return False
        return True

    def _reconnect(self) -> bool:
        """For a client that only sends notes: connect again (a new conn_id), at most every
        RENOTE_S, and only with no request in flight (its reply read reconnects and resends)."""
        now = time.monotonic()
        if self._inflight is not None or now < self._retry_at:
            return False
        self._retry_at = now + RENOTE_S
        try:
            self._connect(os.urandom(16) if self._connected else self.conn_id, wait=0.0)
        except errors.TierstoreError:
            return False
        return True

    def collect(self, reply: PendingReply) -> None:
        """Read `reply` (this channel's request in flight) unless it is settled already:
        PendingReply.result() waits here."""
        with self._lock:
            if not reply.done():
                self._finish(reply)

    def close(self) -> None:
        """Send what is noted, stop the flusher and close the connection (the sidecar ends its
        leases); a reply still in flight fails with Unavailable."""
        self.flush_notes()
        with self._lock:
            if self._inflight is not None:
                self._inflight.settle(error=errors.Unavailable(f"step-socket client of {self.path} was closed"))
                self._inflight = None
            self._closed = True
            self._drop()
        self._flush_event.set()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the flusher: queued releases and notes that no request carries ------------------------

    def _flusher_wake(self, due: float | None = None) -> None:
        """Queued releases go out with the next request; a client that stops planning sends
        them after RELEASE_LINGER_S (a lease left until its TTL would hold its rows, and a
        retired arena, for nothing). due: send what is queued at this time instead (notes
        that are due: the flusher, not the step that noted them, waits on the socket)."""
        self._flush_due = time.monotonic() + RELEASE_LINGER_S if due is None else due
        if self._flusher is None:
            self._flusher = threading.Thread(target=self._flush_loop, name="tierstore-release", daemon=True)
            self._flusher.start()
        if not self._flush_event.is_set():  # a set costs a lock and a notify; once per wait is enough
            self._flush_event.set()

    def _flush_loop(self) -> None:
        while not self._closed:
            self._flush_event.wait()
            # the event stays set while this loop runs, so a step loop's releases skip the set;
            # it is cleared before the queue is looked at, so a release is never left unseen
            while not self._closed:
                while not self._closed and time.monotonic() < self._flush_due:
                    time.sleep(max(0.0, self._flush_due - time.monotonic()))
                if self._queued and not self._closed:
                    try:
                        self.release()
                    except errors.TierstoreError:
                        pass  # the sidecar is gone: its leases went with it
                if self._note_ids and not self._closed:
                    self.flush_notes()
                self._flush_event.clear()
                if not self._queued and not self._note_ids:
                    break

    # -- connection --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise errors.InvalidArgument(f"step-socket client of {self.path} is closed")

    def _unavailable(self, why) -> errors.Unavailable:
        return errors.Unavailable(f"no tierstore sidecar step socket answers at {self.path} (is `tierstore serve` "
                                  f"running there?): {why}")

    def _connect(self, conn_id: bytes, wait: float) -> None:
        deadline = time.monotonic() + wait
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(str(self.path))
                break
            except (FileNotFoundError, ConnectionRefusedError) as e:
                sock.close()
                if time.monotonic() >= deadline:
                    raise self._unavailable(e) from None
                time.sleep(0.02)  # a restarting sidecar: its socket comes back within `wait`
            except OSError as e:
                sock.close()
                raise self._unavailable(e) from None
        # kernel timeouts on a blocking socket: Python's own timeout polls before every send and recv
        sock.settimeout(None)
        tv = struct.pack("ll", int(self.timeout), int(self.timeout % 1 * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        reader = FrameReader(sock, 1 << 20)
        try:
            try:
                send_frame(sock, HELLO, [HELLO_REQ.pack(MAGIC, PROTOCOL_VERSION, conn_id)])
            except OSError:
                pass  # a refusal (max_clients) may already wait to be read
            op, body = reader.read(owned=True)
        except (EOFError, OSError, FrameError) as e:
            sock.close()
            raise self._unavailable(f"the handshake failed: {e}") from None
        if op == ERROR:
            sock.close()
            raise decode_error(body, 0)[0]
        magic, version, limit = HELLO_RESP.unpack_from(body) if len(body) >= HELLO_RESP.size else (b"", 0, 0)
        if op != HELLO or magic != MAGIC or version != PROTOCOL_VERSION:
            sock.close()
            raise errors.InvalidArgument(f"{self.path} does not speak tierstore step-socket v{PROTOCOL_VERSION} "
                                         f"(got {magic!r} v{version}); client and sidecar versions differ")
        self.instance = body[HELLO_RESP.size:].decode("utf-8", "replace")
        self.conn_id, self.max_request_bytes, self._connected = conn_id, limit, True
        reader.limit = 2 * limit + (1 << 20)  # a reply carries one slot per id plus small headers
        self._sock, self._reader = sock, reader

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _submit(self, req: PendingReply) -> PendingReply:
        with self._lock:
            self._check_open()
            # one wait for a restarting sidecar per call, however many reconnects it makes (the
            # reply in flight, then this request): Unavailable within RECONNECT_WAIT_S, not twice that
            deadline = time.monotonic() + min(self.timeout, RECONNECT_WAIT_S)
            if self._inflight is not None:
                self._finish(self._inflight, deadline)  # one in flight: a reply never waits behind our next send
            if not self._connected:  # the first use
                self._connect(self.conn_id, wait=0.0)
            elif self._sock is None and req.op == RELEASE:
                req.settle(value=0)  # the leases ended with the connection they belonged to: no wait
                return req
            elif self._sock is None:  # the last call lost the connection: reconnect once, as a new conn_id
                self._connect(os.urandom(16), wait=max(0.0, deadline - time.monotonic()))
            if req.size > self.max_request_bytes:
                raise errors.ResourceExhausted(f"step-socket request of {req.size} B exceeds the sidecar's "
                                               f"{self.max_request_bytes} B limit; split the step")
            self._inflight = req
            try:
                send_frame(self._sock, req.op, req.parts, req.size)
            except OSError as e:
                self._drop()
                req.error = e  # the reply read in _finish reconnects and resends once
        return req

    def _finish(self, req: PendingReply, deadline: float | None = None) -> None:
        """Read req's reply (it is the one in flight); on a lost connection reconnect once (until
        `deadline`, default RECONNECT_WAIT_S from now) and resend."""
        self._inflight = None
        if deadline is None:
            deadline = time.monotonic() + min(self.timeout, RECONNECT_WAIT_S)
        if req.op == RELEASE and (self._sock is None or req.error is not None):
            self._drop()  # its send failed: the sidecar ended the lost connection's leases with it,
            req.settle(value=0)  # so no reconnect, and no wait that a plan would queue behind
            return
        for attempt in (0, 1):
            try:
                if self._sock is None or req.error is not None:
                    if attempt == 0 and req.error is None:
                        raise EOFError("connection lost")
                    self._drop()
                    self._connect(os.urandom(16), wait=max(0.0, deadline - time.monotonic()))
                    req.error = None
                    send_frame(self._sock, req.op, req.parts, req.size)
                # a small step's reply is polled for; a big one's plan takes ms and may use
                # the sidecar's read threads, which a polling client would take a core from
                self._reader.spin_s = self._spin_s if req.size <= SPIN_MAX_REQUEST_BYTES else 0.0
                op, body = self._reader.read(owned=True)
                break
            except (TimeoutError, BlockingIOError):  # SO_RCVTIMEO/SO_SNDTIMEO ran out
                self._drop()
                req.settle(error=self._unavailable(f"no reply within {self.timeout:g} s"))
                return
            except errors.TierstoreError as e:  # the reconnect failed
                req.settle(error=e)
                return
            except (EOFError, OSError, FrameError) as e:
                self._drop()
                req.error = e
                if req.op == RELEASE:  # a new connection could release nothing: the sidecar ended
                    req.settle(value=0)  # the lost one's leases with it; no reconnect, no wait
                    return
                if attempt:
                    req.settle(error=self._unavailable(e))
                    return
            except BaseException:  # interrupted mid-frame: the stream is out of step, start afresh
                self._drop()
                req.settle(error=self._unavailable("the call was interrupted"))
                raise
        if op == ERROR:
            req.settle(error=decode_error(body, 0)[0])
        elif op != req.op:
            req.settle(error=errors.TierstoreError(f"step socket at {self.path} answered op {op} to op {req.op}"))
        else:
            try:
                req.settle(value=self._parse_plan(body, req.n_items) if op == PLAN else U64.unpack_from(body)[0])
            except errors.TierstoreError as e:
                req.settle(error=e)

    def _parse_plan(self, body: bytes, n_items: int) -> list:
        (n,), off, out = COUNT.unpack_from(body), COUNT.size, []
        if n != n_items:
            raise errors.TierstoreError(f"step socket at {self.path} answered {n} of {n_items} plan items")
        for _ in range(n):
            if body[off] == 0:
                _, n_slots, lease_id, version, expires, hits, misses, unique, alen, aslots = \
                    RES_OK.unpack_from(body, off)
                off += RES_OK.size
                slots = np.frombuffer(body, _I8, n_slots, off)
                off += 8 * n_slots
                arena = bytes(body[off:off + alen]).decode("utf-8", "replace")
                off += alen + pad8(alen)
                out.append(PlanResult(lease_id, version, slots, hits, misses, unique, expires, self.instance,
                                      arena, aslots))
            else:
                err, off = decode_error(body, off)
                out.append(err)
        return out


def _joined(arrays: list) -> np.ndarray:
    return np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
