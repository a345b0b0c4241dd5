"""The TCP listener's gate: the shared token is checked on the call's metadata,
before its request message is read, and a caller gets a bounded time to send it.

A unary handler of gRPC's sync server holds a worker thread from the moment
the headers arrive until the whole message has been received; a caller that
sends headers and nothing else would pin it for good. So every unary call on
TCP is served by a stream-unary handler (the wire is the same): a caller
without the token is answered UNAUTHENTICATED at once, without a message ever
being read or allocated; one with the token (or a health probe) has
RECEIVE_TIMEOUT_S to deliver its message before the call is cancelled. Unix-socket callers never pass here:
they have their own server and worker pool (tierstore.sidecar.server).

Bytes before the check: gRPC's transport takes a stream's DATA frames before any
handler runs, as far as HTTP/2 flow control lets the caller send. With BDP probing
(gRPC's default) the windows grow with the link's throughput, to megabytes a
stream, so a refused caller still had much of its message read and held. The TCP
server therefore runs with PRE_AUTH_OPTIONS: a fixed stream window of
PRE_AUTH_WINDOW_BYTES, so a call holds at most that much until it is refused. An
accepted call loses nothing: once its handler reads the message, gRPC opens the
window to the message's declared size.

Connections before the check: any peer that reaches the port may open connections and never
finish their HTTP/2 (or TLS) handshake, or finish it and never call. gRPC's own defaults hold
each such connection (an fd) for 120 s, or for good once handshaken, so a few hundred of them
would take the file descriptors the sidecar's clients on the unix socket need. `tcp_options`
bounds them: at most `max_tcp_connections` at once (a quarter of the sidecar's fd limit, at
most 1,024: further ones are closed as they arrive), a handshake not done in
HANDSHAKE_TIMEOUT_S is closed, and a connection without a call for IDLE_TIMEOUT_S is closed
(a client's channel reconnects on its next call). A peer that fills the cap denies other TCP
callers while it holds it; it takes nothing from the unix socket's clients.
"""
from __future__ import annotations

import heapq
import hmac
import itertools
import threading
import time

import grpc

__all__ = ["TokenInterceptor", "TOKEN_HEADER", "RECEIVE_TIMEOUT_S", "OPEN_METHODS", "PRE_AUTH_WINDOW_BYTES",
           "PRE_AUTH_OPTIONS", "HANDSHAKE_TIMEOUT_S", "IDLE_TIMEOUT_S", "max_tcp_connections", "tcp_options"]

TOKEN_HEADER = "x-tierstore-token"
RECEIVE_TIMEOUT_S = 30.0  # 64 MiB (the request limit) at ~2 MB/s
PRE_AUTH_WINDOW_BYTES = 64 << 10  # HTTP/2's own default stream window
# options of the TCP server (see above): no window growth before a handler reads
PRE_AUTH_OPTIONS = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", PRE_AUTH_WINDOW_BYTES)]
HANDSHAKE_TIMEOUT_S = 10.0  # a TCP (and TLS) handshake unfinished by then is closed
IDLE_TIMEOUT_S = 300.0  # a TCP connection with no call for this long is closed


def max_tcp_connections(fd_limit: int | None = None) -> int:
    """The TCP connections the sidecar holds at once: a quarter of its soft fd limit (the
    rest for segments, arenas and the unix socket's clients), between 8 and 1,024."""
    if fd_limit is None:
        import resource

        fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if fd_limit == resource.RLIM_INFINITY:
            fd_limit = 1 << 20
    return max(8, min(1024, fd_limit // 4))


def tcp_options(fd_limit: int | None = None) -> list[tuple[str, int]]:
    """The TCP server's gRPC options: PRE_AUTH_OPTIONS and the connection bounds above."""
    return PRE_AUTH_OPTIONS + [("grpc.max_allowed_incoming_connections", max_tcp_connections(fd_limit)),
                               ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_TIMEOUT_S * 1000)),
                               ("grpc.max_connection_idle_ms", int(IDLE_TIMEOUT_S * 1000))]


# Load balancers probe health without the token; Health/Watch holds a worker
# for as long as the caller likes, so it needs the token like everything else.
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check"})


class TokenInterceptor(grpc.ServerInterceptor):
    """Every TCP call needs the token (bar OPEN_METHODS); every unary one gets
    `receive_timeout_s` to deliver its message."""

    def __init__(self, token: str, receive_timeout_s: float = RECEIVE_TIMEOUT_S):
        self._token = token.encode()
        self._watchdog = _Watchdog()
        self._timeout = receive_timeout_s
        self._deny = grpc.stream_unary_rpc_method_handler(_unauthenticated)

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method not in OPEN_METHODS:
            sent = ""
            for key, value in handler_call_details.invocation_metadata or ():
                if key == TOKEN_HEADER:
                    sent = value if isinstance(value, str) else ""
            if not hmac.compare_digest(sent.encode(), self._token):
                return self._deny
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        return grpc.stream_unary_rpc_method_handler(
            self._bounded(handler.unary_unary), request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)

    def _bounded(self, behavior):
        def serve(request_iterator, context):
            ticket = self._watchdog.arm(time.monotonic() + self._timeout, context)
            try:
                request = next(request_iterator, None)
            except grpc.RpcError:  # cancelled: by the watchdog or the caller
                return None
            finally:
                self._watchdog.disarm(ticket)
            if request is None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call ended without a request message")
            return behavior(request, context)
        return serve

    def close(self) -> None:
        self._watchdog.close()


def _unauthenticated(request_iterator, context):
    context.abort(grpc.StatusCode.UNAUTHENTICATED,
                  f"Unauthenticated: this sidecar needs the shared token in the {TOKEN_HEADER!r} metadata header")


class _Watchdog:
    """One thread that cancels calls whose message did not arrive in time
    (a timer thread per call would cost a thread start per RPC)."""

    def __init__(self):
        self._heap: list = []
        self._live: dict[int, object] = {}
        self._ids = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="receive-watchdog", daemon=True)
        self._thread.start()

    def arm(self, deadline: float, context) -> int:
        with self._cv:
            ticket = next(self._ids)
            self._live[ticket] = context
            heapq.heappush(self._heap, (deadline, ticket))
            if self._heap[0][1] == ticket:  # an earlier deadline than the one it sleeps for
                self._cv.notify()
            return ticket

    def disarm(self, ticket: int) -> None:
        with self._cv:
            self._live.pop(ticket, None)

    def _run(self) -> None:
        with self._cv:
            while not self._closed:
                now = time.monotonic()
                while self._heap and (self._heap[0][0] <= now or self._heap[0][1] not in self._live):
                    _, ticket = heapq.heappop(self._heap)
                    context = self._live.pop(ticket, None)
                    if context is not None:
                        context.cancel()  # wakes the handler blocked on the request iterator
                self._cv.wait(self._heap[0][0] - now if self._heap else None)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
