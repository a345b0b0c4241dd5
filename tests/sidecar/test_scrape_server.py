"""ScrapeServer (tierstore/sidecar/scrape_server.py), the metrics endpoint's HTTP server, in this
process: it answers GET and HEAD with what it renders, refuses the rest by status, holds at most
MAX_CONNECTIONS sockets (a new one closes the oldest still waiting for its request, so an
honest scrape is answered), closes a connection whose request does not come in time, and renders
at most once per RENDER_INTERVAL_S."""
from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request

import pytest

from tierstore.sidecar import scrape_server
from tierstore.sidecar.scrape_server import MAX_CONNECTIONS, ScrapeServer


@pytest.fixture
def server(free_port):
    """(ScrapeServer on 127.0.0.1, the Accept headers it rendered for), closed at teardown."""
    renders = []

    def render(accept):
        renders.append(accept)
        return b"tierstore_up 1\n", "text/plain; version=0.0.4; charset=utf-8"

    srv = ScrapeServer(render, free_port())
    srv.start()
    yield srv, renders
    srv.close()


def _exchange(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def _wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_a_scrape_gets_the_rendered_text_and_its_content_type(server):
    srv, renders = server
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=5) as r:
        assert r.status == 200 and r.read() == b"tierstore_up 1\n"
        assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert r.headers["Connection"] == "close"
    head = _exchange(srv.port, b"HEAD / HTTP/1.1\r\nAccept: application/openmetrics-text\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n")  # headers only
    assert b"Content-Length: 15\r\n" in head
    assert renders == ["", "application/openmetrics-text"]


@pytest.mark.parametrize("request_, status", [
    (b"POST /metrics HTTP/1.1\r\n\r\n", b"405 Method Not Allowed"),
    (b"GET\r\n\r\n", b"400 Bad Request"),
    (b"GET / HTTP/1.1\r\nX: " + b"a" * 9000 + b"\r\n\r\n", b"431 Request Header Fields Too Large"),
])
def test_a_bad_request_gets_its_status_and_nothing_rendered(server, request_, status):
    srv, renders = server
    assert _exchange(srv.port, request_).startswith(b"HTTP/1.1 " + status + b"\r\n")
    assert renders == []


def test_idle_connections_past_the_cap_hold_no_more_sockets_and_a_scrape_is_answered(server):
    srv, _ = server
    idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=5) for _ in range(3 * MAX_CONNECTIONS)]
    try:
        assert _wait_for(lambda: srv.connections == MAX_CONNECTIONS)
        time.sleep(0.2)
        assert srv.connections == MAX_CONNECTIONS
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/", timeout=5) as r:
            assert r.read() == b"tierstore_up 1\n"
        # the oldest were closed to make room: they read EOF
        assert all(s.recv(1) == b"" for s in idle[:2 * MAX_CONNECTIONS])
    finally:
        for s in idle:
            s.close()


def test_a_connection_whose_request_does_not_come_is_closed(server, monkeypatch):
    monkeypatch.setattr(scrape_server, "REQUEST_TIMEOUT_S", 0.3)
    srv, renders = server
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        t0 = time.monotonic()
        for b in b"GET / HTTP/1.1\r\n":  # a slowloris: a byte at a time, never the blank line
            try:
                s.sendall(bytes([b]))
            except OSError:
                break
            time.sleep(0.05)
        s.settimeout(5)
        try:
            assert s.recv(1) == b""
        except ConnectionResetError:
            pass
        assert time.monotonic() - t0 < 2
    assert _wait_for(lambda: srv.connections == 0) and renders == []


def test_a_flood_of_scrapes_renders_once_per_interval(server):
    srv, renders = server
    t0 = time.monotonic()
    for _ in range(50):
        assert _exchange(srv.port, b"GET / HTTP/1.1\r\n\r\n").endswith(b"tierstore_up 1\n")
    took = time.monotonic() - t0
    assert len(renders) <= 1 + int(took / scrape_server.RENDER_INTERVAL_S) + 1, (len(renders), took)
