"""Area 5b: open step-socket frames against a real sidecar. A frame holds the bytes that
arrived, never the length it declares; before HELLO nothing larger than a HELLO is read;
a frame begun must be whole within FRAME_TIMEOUT_S; and well-behaved clients are served
throughout."""
from __future__ import annotations

import array
import fcntl
import os
import socket
import termios
import time

import numpy as np
import pytest

from tierstore import errors
from tierstore.client.step_channel import StepChannel, raise_errors
from tierstore.proto.frames import (ERROR, HDR, HELLO, HELLO_REQ, MAGIC, PLAN, PROTOCOL_VERSION, SCRATCH, FrameReader,
                                    PlanItem, decode_error, step_socket_path)
from tierstore.sidecar.step_server import FRAME_TIMEOUT_S

ROWS = 50_000
CONNS, SENT, DECLARED = 16, 1 << 20, (64 << 20) - 64  # each connection: 1 MiB of a 64 MiB frame


def _connect(path, hello: bool) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(FRAME_TIMEOUT_S + 10)
    s.connect(str(path))
    if hello:
        s.sendall(HDR.pack(HELLO_REQ.size, HELLO) + HELLO_REQ.pack(MAGIC, PROTOCOL_VERSION, os.urandom(16)))
        assert FrameReader(s, 1 << 20).read(owned=True)[0] == HELLO
    return s


def _unread(s: socket.socket) -> int:
    """Bytes this unix socket sent that its peer has not read yet (SIOCOUTQ)."""
    out = array.array("i", [0])
    fcntl.ioctl(s.fileno(), termios.TIOCOUTQ, out)
    return out[0]


def _reply(s: socket.socket):
    """The error the sidecar answered with, or None when it closed without one (or never answered)."""
    try:
        op, body = FrameReader(s, 1 << 20).read(owned=True)
    except (EOFError, OSError):
        return None
    return decode_error(body, 0)[0] if op == ERROR else op


@pytest.mark.reliability
def test_open_frames_hold_what_arrived_not_what_they_declare(tmp_path, sidecars, rel):
    rel.write_table(tmp_path / "data", "t", ROWS, dim=16)
    sc = sidecars(tmp_path / "data", "64MiB")
    path, pid = step_socket_path(sc.socket), sc.proc.pid
    good = StepChannel(path, timeout=10).connect()
    socks = []
    try:
        ids = np.arange(0, ROWS, 5, dtype=np.int64)  # a frame over SCRATCH: a buffer beyond the base, budgeted
        assert raise_errors(good.submit([PlanItem("t", ids)]).result())[0].slots.size == ids.size
        rel.reset_peak_rss(pid)
        before = rel.proc_status(pid)["VmRSS"]
        # authenticated connections that declare 64 MiB and send 1 MiB of it
        t0 = time.monotonic()
        for _ in range(CONNS):
            s = _connect(path, hello=True)
            s.sendall(HDR.pack(DECLARED, PLAN) + bytes(SENT))
            socks.append(s)
        while any(_unread(s) for s in socks) and time.monotonic() < t0 + FRAME_TIMEOUT_S / 2:
            time.sleep(0.01)  # until the sidecar has read every byte sent
        assert not any(_unread(s) for s in socks), "the sidecar did not read the bytes it was sent"
        held = rel.proc_status(pid)["VmHWM"] - before
        # a frame buffer grows at most to twice what arrived, above the SCRATCH every reader has
        bound = CONNS * (SCRATCH + 2 * SENT) + (16 << 20)  # + what serving a few steps costs anyway
        assert held < bound, f"{CONNS} open frames of {SENT >> 20} MiB made the sidecar hold {held >> 20} MiB"
        # meanwhile a well-behaved client's steps, small and large, are served
        for n in (256, ids.size):
            assert raise_errors(good.submit([PlanItem("t", ids[:n])]).result())[0].slots.size == n
        # unauthenticated ones declaring as much are refused at the header, before any body is read
        for _ in range(CONNS):
            s = _connect(path, hello=False)
            s.sendall(HDR.pack(DECLARED, PLAN) + bytes(4096))
            err = _reply(s)
            assert type(err) is errors.InvalidArgument and "first frame must be HELLO" in str(err), err
            s.close()
        # ... and only for FRAME_TIMEOUT_S: then each is cut, with the reason
        for s in socks:
            err = _reply(s)
            assert type(err) is errors.Unavailable and "not whole" in str(err), err
        assert time.monotonic() - t0 < FRAME_TIMEOUT_S + 5
        assert raise_errors(good.submit([PlanItem("t", ids[:256])]).result())[0].slots.size == 256
    finally:
        for s in socks:
            s.close()
        good.close()
