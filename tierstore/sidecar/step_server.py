"""The step socket, server side: one Plan (+ releases) per decode step, off gRPC.

A decode step's Plan must cost a small fraction of the step, and a Python gRPC
unary call costs far more than a framed exchange over a unix socket
(docs/decisions.md, "The step socket"). Local clients therefore also reach
the sidecar over a plain unix stream socket next to the gRPC one (`<grpc
socket>.steps`, 0600) with the binary framing of proto/frames.py. One thread per connection: a
blocking recv wakes exactly the thread that serves that client, with no poll
round in between (bench/step_socket.py measures it); connections are few (one per
worker process) and bounded by max_clients. gRPC stays the service API.

Wiring: the sidecar (Server.start, server.py) serves the step socket with its handler,
ServedSteps (served_steps.py), over the served tables:

    steps = StepServer(step_socket_path(config.socket), ServedSteps(served, config, metrics),
                       max_request_bytes=MAX_REQUEST_BYTES, max_clients=STEP_SOCKET_CLIENTS)
    steps.start()   ...   steps.stop()

A handler (StepHandler) answers each request of a connection, named by its conn_id:

    class ServedSteps:                                  # implements StepHandler
        def plan(self, conn_id, items, release):        # PLAN: the releases first, then every table
            self.served.leases.release(release, conn_id)
            out = []
            for it in items:
                try:
                    eng = self.served.engine(it.table, it.version)
                    res = eng.plan(it.ids.copy(), ttl, conn_id, it.request_id)  # the lease is conn_id's
                    out.append(PlanResult(res.lease_id, version, res.slots, res.hits, ...))
                except TierstoreError as e:
                    out.append(e)                       # this table's error; the others are served
            return out
        def release(self, conn_id, lease_ids):          # RELEASE
            return self.served.leases.release(lease_ids, conn_id)
        def note(self, conn_id, items, trusted):        # NOTE, one-way: the learner takes the steps
            ...
        def disconnected(self, conn_id):                # the connection closed: its leases end
            self.served.leases.release_client(conn_id)
        def instance(self):                             # HELLO's answer
            return self.served.instance

bench/step_socket.py's ModuloHandler is a complete handler without tables (slot = id & mask),
its leases kept per conn_id in an OwnedLeases.

One cohesive thing (a little over the house's 300 lines): the listener, its per-
connection threads and their protocol checks.
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import socket
import stat
import struct
import threading
import time
from pathlib import Path
from typing import Protocol

import numpy as np

from tierstore import errors
from tierstore.proto import MAX_REQUEST_BYTES
from tierstore.proto.frames import (COUNT, ERROR, HELLO, HELLO_REQ, HELLO_RESP, MAGIC, MAX_RELEASE, NOTE, PLAN,
                                PROTOCOL_VERSION, RELEASE, U64, FrameError, FrameReader, PlanItem, PlanResult,
                                encode_error, encode_plan_results, parse_note, parse_plan, send_frame,
                                spin_seconds)
from tierstore.sidecar.listeners import UNIX_PATH_MAX
from tierstore.tiers import trust

__all__ = ["StepServer", "StepHandler", "ReceiveBudget", "FRAME_TIMEOUT_S"]

log = logging.getLogger("tierstore.sidecar.step_server")
HELLO_TIMEOUT_S = 10.0      # a connection that never says HELLO gives its slot back
FRAME_TIMEOUT_S = 10.0      # a frame begun must be whole this long after its first byte; also the budget's wait
SEND_TIMEOUT_S = 60         # seconds a reply may wait for a client that does not read it


class StepHandler(Protocol):
    """What the sidecar implements. Methods are called from connection threads, concurrently.

    plan: release `release` first (lease ids this conn_id ended), then plan every item;
          return one PlanResult or TierstoreError per item, in order. Raising a
          TierstoreError fails the whole request. `items[i].ids` is valid during the call.
    release: end these leases of `conn_id`; return how many were live.
    disconnected: the conn_id's connection closed (any reason): end its leases.
    instance: the sidecar instance id (changes on restart; clients then remap arenas).
    note: steps the client read itself (proto.frames.NoteItem), a NOTE frame; never
          answered, so errors are the handler's to log (a handler with no policy ignores
          them). `items[i].ids` is valid during the call. trusted: the peer runs as the
          sidecar's uid or root (tierstore/tiers/trust.py: peer_trusted).
    """

    def plan(self, conn_id: bytes, items: list[PlanItem], release: list[int]) -> list: ...
    def release(self, conn_id: bytes, lease_ids: list[int]) -> int: ...
    def note(self, conn_id: bytes, items: list, trusted: bool) -> None: ...
    def disconnected(self, conn_id: bytes) -> None: ...
    def instance(self) -> str: ...


class ReceiveBudget:
    """The bytes all connections' receive buffers may hold beyond their SCRATCH base, together.

    Invariant: held <= limit. A reader reserves before its buffer grows past SCRATCH, as
    a frame's bytes arrive (proto.frames.FrameReader), so holding budget takes sending
    bytes, not declaring a length; it keeps it until its request is handled.
    Reservations are granted in arrival order, so a large frame waiting for room is not
    overtaken by later ones; a wait ends after `wait_s` with ResourceExhausted. Frames
    that fit in SCRATCH never wait, so small steps are served whoever holds the budget.
    Buffers kept between requests give theirs back while more than half is held
    (crowded), so at least half stays for frames in flight, and with limit >= 2 x the
    request limit a frame waits at most until frames ahead of it are whole, or cut at
    FRAME_TIMEOUT_S. Thread-safe."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0
        self._cv = threading.Condition()
        self._queue: collections.deque[int] = collections.deque()
        self._tickets = itertools.count()

    def reserve(self, nbytes: int, wait_s: float) -> None:
        """Take `nbytes`, waiting up to `wait_s` for room behind earlier waiters; ResourceExhausted then."""
        with self._cv:
            if not self._queue and self.held + nbytes <= self.limit:
                self.held += nbytes
                return
            ticket, deadline = next(self._tickets), time.monotonic() + wait_s
            self._queue.append(ticket)
            try:
                while self._queue[0] != ticket or self.held + nbytes > self.limit:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise errors.ResourceExhausted(
                            f"the step socket's receive buffers hold {self.held} B of their {self.limit} B bound "
                            f"across connections; a frame needing {nbytes} B more waited {wait_s:g} s for room: "
                            f"retry, split the step, or send bulk requests over the gRPC socket")
                    self._cv.wait(left)
                self.held += nbytes
            finally:
                self._queue.remove(ticket)
                self._cv.notify_all()  # the next in line may fit now

    def give_back(self, nbytes: int) -> None:
        """Return `nbytes` reserved (a buffer shrunk, or its request handled)."""
        with self._cv:
            self.held -= nbytes
            self._cv.notify_all()

    def crowded(self) -> bool:
        """More than half held: buffers between requests should give theirs back."""
        return self.held > self.limit // 2


class StepServer:
    """Serves `handler` on a unix socket at `path` (created 0600) until stop().

    What a connection can make it hold: before HELLO, nothing beyond a HELLO-sized
    buffer (a larger first frame is refused at its header); after it, what its frames'
    bytes fill (proto.frames.FrameReader), each frame for at most FRAME_TIMEOUT_S, and
    beyond SCRATCH a connection only from one ReceiveBudget of `max_buffered_bytes`
    (default 4 x max_request_bytes) shared by all."""

    def __init__(self, path: Path, handler: StepHandler, *, max_request_bytes: int = MAX_REQUEST_BYTES,
                 max_clients: int = 64, max_buffered_bytes: int | None = None):
        if max_buffered_bytes is None:
            max_buffered_bytes = 4 * max_request_bytes
        if max_request_bytes < 64 or max_clients < 1 or max_buffered_bytes < 2 * max_request_bytes:
            raise errors.InvalidArgument(f"step socket needs max_request_bytes >= 64, max_clients >= 1 and "
                                         f"max_buffered_bytes >= 2 x max_request_bytes, got {max_request_bytes}, "
                                         f"{max_clients} and {max_buffered_bytes}")
        self.path, self.handler = Path(path), handler
        self.max_request_bytes, self.max_clients = max_request_bytes, max_clients
        self.budget = ReceiveBudget(max_buffered_bytes)
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._conn_ids: set[bytes] = set()
        self._listener: socket.socket | None = None
        self._ino: int | None = None
        self._acceptor: threading.Thread | None = None
        self._stopping = False

    def start(self) -> None:
        self._listener = self._bind()
        self._acceptor = threading.Thread(target=self._accept_loop, name="steps-accept", daemon=True)
        self._acceptor.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Close the listener and every connection, join their threads, unlink the socket."""
        self._stopping = True
        if self._listener is not None:
            _shutdown(self._listener)
            self._listener.close()
        if self._acceptor is not None and self._acceptor.is_alive():  # not when a stop came mid-start
            self._acceptor.join(timeout)
        with self._lock:
            conns = list(self._conns.items())
        for sock, _ in conns:
            _shutdown(sock)  # wakes the thread's blocking recv
        for _, thread in conns:
            thread.join(timeout)
        if self._listener is not None:
            if self._ino is not None and _inode(self.path) == self._ino:
                self.path.unlink(missing_ok=True)
            self._listener = None

    @property
    def clients(self) -> int:
        with self._lock:
            return len(self._conns)

    # -- setup -----------------------------------------------------------------------------

    def _bind(self) -> socket.socket:
        path = self.path
        if len(os.fsencode(path)) > UNIX_PATH_MAX:
            raise errors.InvalidArgument(f"step-socket socket path {path} is longer than {UNIX_PATH_MAX} bytes; "
                                         f"use a shorter --socket path")
        if path.is_symlink() or path.exists():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise errors.InvalidArgument(f"{path} exists and is not a socket; remove it or use another --socket")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(1.0)
            try:
                probe.connect(str(path))
            except ConnectionRefusedError:
                path.unlink()  # stale: a dead sidecar's socket, nothing answers on it
            except FileNotFoundError:
                pass
            except OSError as e:
                raise errors.InvalidArgument(f"cannot tell whether {path} is in use ({e}); remove it or use "
                                             f"another --socket") from None
            else:
                raise errors.InvalidArgument(f"another process serves the step socket at {path}; stop it or use "
                                             f"another --socket")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is born 0600
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        self._ino = _inode(path)
        sock.listen(max(64, self.max_clients))
        sock.settimeout(0.5)  # lets the accept loop notice stop() even where shutdown does not wake it
        return sock

    def _accept_loop(self) -> None:
        while not self._stopping:
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._stopping:
                    return
                log.warning("step socket accept failed: %s", e)  # EMFILE and the like: keep serving the others
                threading.Event().wait(0.05)
                continue
            with self._lock:
                full = len(self._conns) >= self.max_clients
                if not full:
                    thread = threading.Thread(target=self._serve, args=(sock,), name="steps-conn", daemon=True)
                    self._conns[sock] = thread
            if full:
                self._refuse(sock)
                continue
            try:
                thread.start()
            except RuntimeError:  # no thread to be had: refuse this one, keep serving the rest
                with self._lock:
                    self._conns.pop(sock, None)
                self._refuse(sock)

    def _refuse(self, sock: socket.socket) -> None:
        err = errors.ResourceExhausted(f"the tierstore step socket at {self.path} already serves max_clients="
                                       f"{self.max_clients} connections; close idle clients, raise the limit, "
                                       f"or use the gRPC socket")
        try:
            sock.settimeout(1.0)
            send_frame(sock, ERROR, encode_error(err))
        except OSError:
            pass
        sock.close()

    # -- one connection ----------------------------------------------------------------------

    def _serve(self, sock: socket.socket) -> None:
        conn_id, trusted = None, trust.peer_trusted(sock)
        # HELLO-sized until HELLO: nobody unauthenticated makes the sidecar hold more
        reader = FrameReader(sock, HELLO_REQ.size, budget=self.budget, frame_timeout_s=FRAME_TIMEOUT_S)
        try:
            conn_id = self._hello(sock, reader)
            reader.limit = self.max_request_bytes
            reader.spin_s = spin_seconds()  # a decode loop's next request may come soon
            # a client that stops reading its replies frees its thread after SEND_TIMEOUT_S (kernel timer, no poll)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", SEND_TIMEOUT_S, 0))
            while True:
                op, body = reader.read()
                if op == NOTE:  # one-way: no reply; a malformed frame ends the connection (FrameError)
                    self._note(conn_id, body, trusted)
                    del body
                    reader.recycle()
                    continue
                try:
                    op, parts, size = self._dispatch(conn_id, op, body)
                except errors.TierstoreError as e:
                    op, parts, size = ERROR, encode_error(e), None
                except Exception as e:  # a handler bug must not end the connection, let alone the sidecar
                    log.exception("step socket handler failed")
                    op, parts, size = ERROR, encode_error(errors.TierstoreError(
                        f"internal error in the sidecar step socket: {type(e).__name__}: {e}")), None
                del body
                send_frame(sock, op, parts, size)
                del parts
                reader.recycle()
        except FrameError as e:
            try:
                send_frame(sock, ERROR, encode_error(e.err))
            except OSError:
                pass
        except (EOFError, OSError):
            pass  # the client went away (or stop() shut the socket)
        except Exception:
            log.exception("step socket connection failed")
        finally:
            # slot, leases and conn_id go back before the socket closes: a client that sees the close
            # (and reconnects at once) finds them free
            reader.close()
            with self._lock:
                self._conns.pop(sock, None)
            if conn_id is not None:
                try:
                    self.handler.disconnected(conn_id)
                except Exception:
                    log.exception("step socket disconnected() failed")
                with self._lock:
                    self._conn_ids.discard(conn_id)
            sock.close()

    def _hello(self, sock: socket.socket, reader: FrameReader) -> bytes:
        """The conn_id a HELLO names; the whole frame must arrive within HELLO_TIMEOUT_S of the accept,
        and one of another op or size is refused at its header, its body never read."""
        deadline = time.monotonic() + HELLO_TIMEOUT_S
        length, op = reader.header(deadline)
        if op != HELLO or length != HELLO_REQ.size:
            raise FrameError(errors.InvalidArgument(
                "not a tierstore step-socket client: the first frame must be HELLO; close and reconnect"))
        op, body = reader.read(deadline=deadline)
        magic, version, conn_id = HELLO_REQ.unpack_from(body)
        if magic != MAGIC or version != PROTOCOL_VERSION:
            raise FrameError(errors.InvalidArgument(
                f"step-socket protocol {magic!r} v{version} is not {MAGIC!r} v{PROTOCOL_VERSION}: client and sidecar "
                f"come from different tierstore versions; upgrade one of them"))
        with self._lock:
            if conn_id in self._conn_ids:
                raise FrameError(errors.InvalidArgument(
                    f"step-socket connection id {conn_id.hex()} is already connected; each connection needs its own conn id"))
            self._conn_ids.add(conn_id)
        instance = self.handler.instance().encode()
        send_frame(sock, HELLO, [HELLO_RESP.pack(MAGIC, PROTOCOL_VERSION, self.max_request_bytes), instance])
        return conn_id

    def _note(self, conn_id: bytes, body, trusted: bool) -> None:
        try:
            items = parse_note(body)
        except errors.TierstoreError as e:
            raise FrameError(e) from None
        try:
            self.handler.note(conn_id, items, trusted)
        except Exception:  # a hint: the connection keeps serving
            log.exception("step socket note() failed")

    def _dispatch(self, conn_id: bytes, op: int, body) -> tuple[int, list, int]:
        if op == PLAN:
            items, release = parse_plan(body)
            results = self.handler.plan(conn_id, items, release)
            if len(results) != len(items):
                raise errors.TierstoreError(f"internal error: the sidecar planned {len(results)} of "
                                            f"{len(items)} tables")
            for i, (it, r) in enumerate(zip(items, results)):  # one slot per id, or the client indexes garbage
                if isinstance(r, PlanResult) and (r.slots.size if type(r.slots) is np.ndarray else
                                                  np.size(r.slots)) != it.ids.size:
                    results[i] = errors.TierstoreError(f"internal error: the sidecar returned {np.size(r.slots)} "
                                                       f"slots for {it.ids.size} ids of table {it.table!r}")
            return (PLAN, *encode_plan_results(results))
        if op == RELEASE:
            if len(body) < COUNT.size or COUNT.unpack_from(body)[0] * 8 != len(body) - COUNT.size:
                raise errors.InvalidArgument(f"step-socket RELEASE body of {len(body)} B does not match its count")
            if len(body) - COUNT.size > MAX_RELEASE * 8:
                raise errors.InvalidArgument(f"step-socket RELEASE of more than {MAX_RELEASE} leases; split it")
            ids = np.frombuffer(body, "<u8", offset=COUNT.size).tolist()
            return RELEASE, [U64.pack(int(self.handler.release(conn_id, ids)))], U64.size
        if op == HELLO:
            raise errors.InvalidArgument("step-socket HELLO sent twice on one connection")
        raise errors.InvalidArgument(f"unknown step-socket op {op}; client and sidecar come from different "
                                     f"tierstore versions")


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _inode(path: Path) -> int | None:
    try:
        return path.lstat().st_ino
    except OSError:
        return None
