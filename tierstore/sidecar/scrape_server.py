"""The metrics endpoint's HTTP server (`--metrics-port`): one thread, one request per
connection, and a bound on everything a connection can hold.

The port listens on 127.0.0.1, where every user of the host can connect, so nothing a
connection does may take what the sidecar's clients need (file descriptors above all: a
sidecar out of them refuses new clients). Invariants:

- At most MAX_CONNECTIONS accepted sockets at once, plus the listener and a wake-up pair:
  the fds the endpoint holds, whatever connects.
- A connection whose request head has not arrived REQUEST_TIMEOUT_S after its accept is
  closed (an idle connection, or a slowloris sending a byte at a time); one whose reply is not
  all sent REPLY_TIMEOUT_S after its request is closed (a client that never reads).
- At the cap, a new connection closes the oldest one still waiting for its request, and its
  own request is read at once: an honest scrape (its request sent with its connection) is
  answered while idle connections hold every other place.
- Each reply is rendered at most once per RENDER_INTERVAL_S for each Accept header, so a
  flood of complete requests costs the sidecar a bounded share of its CPU, not a render each
  (a second scrape within the interval shows the counters of the first).

Why not prometheus_client's own server (start_http_server): it takes a thread and an fd per
connection with no timeout and no cap, and a cap bolted onto its blocking accept would leave
an honest scrape queued behind idle connections. The text is still prometheus_client's:
`render` (Metrics.render) uses its encoders, chosen by the request's Accept header.
"""
from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from typing import Callable

__all__ = ["ScrapeServer", "MAX_CONNECTIONS", "REQUEST_TIMEOUT_S", "REPLY_TIMEOUT_S", "RENDER_INTERVAL_S"]

log = logging.getLogger("tierstore.sidecar.scrape_server")

MAX_CONNECTIONS = 16  # a scraper opens one at a time; a few scrapers and probes fit
REQUEST_TIMEOUT_S = 2.0  # a scraper on this host sends its request as it connects
REPLY_TIMEOUT_S = 10.0
RENDER_INTERVAL_S = 0.5  # well under any scrape interval
MAX_HEAD_BYTES = 8192
_PAUSE_S = 0.1  # accept refused by the kernel (the process is out of fds): retry after this
_WAKE = object()


class _Connection:
    __slots__ = ("sock", "deadline", "head", "reply")

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.deadline = sock, deadline
        self.head = bytearray()
        self.reply: memoryview | None = None  # set once the request head is in


class ScrapeServer:
    """Serves `render(accept_header) -> (body, content_type)` over HTTP on addr:port (the module
    docstring). The constructor binds (OSError when the port is taken); start() serves in one
    daemon thread; close() stops it and closes every socket."""

    def __init__(self, render: Callable[[str], tuple[bytes, str]], port: int, addr: str = "127.0.0.1"):
        self._render = render
        self._rendered: dict[str, tuple[float, bytes, str]] = {}  # accept header -> (when, body, type)
        self._listener = socket.create_server((addr, port), backlog=64)
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._conns: dict[socket.socket, _Connection] = {}  # in accept order: the oldest first
        self._resume_at: float | None = None  # accepting paused until then
        self._warned = 0.0
        self._thread = threading.Thread(target=self._run, name="metrics-http", daemon=True)

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    @property
    def connections(self) -> int:
        """Accepted sockets held now (at most MAX_CONNECTIONS)."""
        return len(self._conns)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():
            self._wake_w.send(b"x")
            self._thread.join(10)
        for sock in list(self._conns):
            sock.close()
        self._conns.clear()
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()
        self._sel.close()

    # -- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            now = time.monotonic()
            due = [c.deadline for c in self._conns.values()]
            if self._resume_at is not None:
                due.append(self._resume_at)
            for key, _ in self._sel.select(max(0.0, min(due) - now) if due else None):
                if key.data is _WAKE:
                    return
                if key.data is None:
                    self._accept()
                elif key.data.sock in self._conns:  # not closed earlier in this round
                    self._step(key.data)
            now = time.monotonic()
            for conn in [c for c in self._conns.values() if c.deadline <= now]:
                self._drop(conn)
            if self._resume_at is not None and now >= self._resume_at:
                self._resume_at = None
                self._sel.register(self._listener, selectors.EVENT_READ, None)

    def _accept(self) -> None:
        for _ in range(MAX_CONNECTIONS):  # a burst of connects is taken a bounded number at a time
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as e:  # EMFILE / ENFILE: others hold the fds; do not spin on the listener
                now = time.monotonic()
                if now - self._warned > 60:
                    self._warned = now
                    log.warning("metrics endpoint cannot accept connections (%s); retrying", e.strerror)
                self._sel.unregister(self._listener)
                self._resume_at = now + _PAUSE_S
                return
            if len(self._conns) >= MAX_CONNECTIONS:
                waiting = next((c for c in self._conns.values() if c.reply is None), None)
                if waiting is None:  # every place is sending a reply: this one waits for none
                    sock.close()
                    continue
                self._drop(waiting)
            sock.setblocking(False)
            conn = _Connection(sock, time.monotonic() + REQUEST_TIMEOUT_S)
            self._conns[sock] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)
            self._step(conn)  # a scraper's request is usually in already

    def _step(self, conn: _Connection) -> None:
        """Read what has come of the request head, or send what the socket takes of the reply."""
        try:
            if conn.reply is None:
                data = conn.sock.recv(MAX_HEAD_BYTES)
                if not data:
                    return self._drop(conn)
                conn.head += data
                end = conn.head.find(b"\r\n\r\n")
                if end < 0 and len(conn.head) < MAX_HEAD_BYTES:
                    return
                conn.reply = memoryview(self._answer(bytes(conn.head[:end]) if end >= 0 else None))
                conn.deadline = time.monotonic() + REPLY_TIMEOUT_S
                self._sel.modify(conn.sock, selectors.EVENT_WRITE, conn)
            conn.reply = conn.reply[conn.sock.send(conn.reply):]
            if not conn.reply:
                conn.sock.shutdown(socket.SHUT_WR)
                self._drop(conn)
        except BlockingIOError:
            pass
        except OSError:  # reset by the peer
            self._drop(conn)

    def _drop(self, conn: _Connection) -> None:
        self._sel.unregister(conn.sock)
        del self._conns[conn.sock]
        conn.sock.close()

    # -- HTTP ------------------------------------------------------------------------------------

    def _answer(self, head: bytes | None) -> bytes:
        """The whole reply to a request head (None: longer than MAX_HEAD_BYTES)."""
        if head is None:
            return _reply("431 Request Header Fields Too Large")
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return _reply("400 Bad Request")
        if parts[0] not in (b"GET", b"HEAD"):
            return _reply("405 Method Not Allowed", extra="Allow: GET, HEAD\r\n")
        accept = next((ln.split(b":", 1)[1].strip().decode("latin-1") for ln in lines[1:]
                       if ln[:7].lower() == b"accept:"), "")
        try:
            body, content_type = self._rendering(accept)
        except Exception:  # a collector's bug: this scrape fails, the endpoint serves on
            log.exception("metrics endpoint could not render the metrics")
            return _reply("500 Internal Server Error")
        return _reply("200 OK", body, content_type, with_body=parts[0] == b"GET")

    def _rendering(self, accept: str) -> tuple[bytes, str]:
        now = time.monotonic()
        hit = self._rendered.get(accept)
        if hit is None or now - hit[0] >= RENDER_INTERVAL_S:
            if len(self._rendered) >= 8:  # Accept headers are the caller's: keep a few
                self._rendered.clear()
            hit = self._rendered[accept] = (now, *self._render(accept))
        return hit[1], hit[2]


def _reply(status: str, body: bytes = b"", content_type: str = "text/plain; charset=utf-8", extra: str = "",
           with_body: bool = True) -> bytes:
    if not body and status != "200 OK":
        body = f"{status}\n".encode()
    head = (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n{extra}"
            f"Connection: close\r\n\r\n").encode("latin-1")
    return head + body if with_body else head
