"""StepChannel (client/step_channel.py): what one channel owns, seen from its user.

Served by a real StepServer over a real unix socket with bench/step_socket.py's
ModuloHandler (the transport's harness, as in tests/sidecar/test_step_server.py);
the wire itself is tested there."""
from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tierstore import errors
from tierstore.bench.step_socket import ModuloHandler
from tierstore.client.step_channel import NOTE_IDS, RELEASE_LINGER_S, StepChannel, raise_errors
from tierstore.proto.frames import PlanItem
from tierstore.sidecar.step_server import StepServer


@pytest.fixture
def served():
    d = Path(tempfile.mkdtemp(prefix="tsch-", dir="/tmp"))  # unix socket paths must stay under 108 bytes
    handler = ModuloHandler()
    srv = StepServer(d / "s.sock.steps", handler, max_clients=8)
    srv.start()
    yield srv, handler
    srv.stop()
    shutil.rmtree(d, ignore_errors=True)


def _wait(cond, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.005)
    return cond()


def test_a_channel_connects_on_first_use_and_says_where_nobody_answers(tmp_path):
    ch = StepChannel(tmp_path / "none.steps", timeout=1)  # nothing sent, nothing refused yet
    try:
        assert ch.release([1, 2]) == 0  # no connection made: no lease of this channel exists
        ch.release_later([3])  # likewise nothing to queue
        assert not ch._queued
        with pytest.raises(errors.Unavailable, match="none.steps"):
            ch.connect()
        with pytest.raises(errors.Unavailable, match="none.steps"):
            ch.submit([PlanItem("l1", np.arange(4))])
    finally:
        ch.close()
    with pytest.raises(errors.InvalidArgument, match="closed"):
        ch.connect()


def test_a_released_lease_goes_out_alone_when_no_step_follows(served):
    srv, h = served
    with StepChannel(srv.path) as ch:
        [res] = raise_errors(ch.submit([PlanItem("l1", np.arange(8))]).result())
        assert list(h.leases) == [res.lease_id]
        t0 = time.monotonic()
        ch.release_later(res.lease_id)
        assert _wait(lambda: not h.leases), "the queued release never went out"
        assert time.monotonic() - t0 >= RELEASE_LINGER_S  # it waited for a request to carry it first
        assert not ch._queued


def test_a_closed_channel_queues_nothing_and_its_leases_end(served):
    srv, h = served
    ch = StepChannel(srv.path).connect()
    raise_errors(ch.submit([PlanItem("l1", np.arange(8)), PlanItem("l14", np.arange(8))]).result())
    assert len(h.leases) == 2
    ch.close()
    assert _wait(lambda: not h.leases)  # the sidecar ends a closed owner's leases
    ch.release_later([1, 2])
    assert not ch._queued
    with pytest.raises(errors.InvalidArgument, match="closed"):
        ch.release([1])


class _SlowReader(ModuloHandler):
    """A sidecar busy elsewhere: it takes one NOTE frame and then reads nothing until `go`."""

    def __init__(self):
        super().__init__()
        self.go, self.ids = threading.Event(), 0

    def note(self, conn_id, items, trusted):
        self.go.wait(30)
        self.ids += sum(it.ids.size for it in items)


def test_a_step_that_notes_its_reads_does_not_wait_on_a_busy_sidecar(tmp_path):
    """Local reads note each step (ids, and the rows of its misses); a step loop must not stall
    while the sidecar is slow to take them: the channel's flusher sends them. Every noted id
    still arrives once the sidecar reads again."""
    d = Path(tempfile.mkdtemp(prefix="tsch-", dir="/tmp"))
    handler = _SlowReader()
    srv = StepServer(d / "s.sock.steps", handler, max_clients=8)
    srv.start()
    ch = StepChannel(srv.path).connect()
    try:
        ids = np.arange(NOTE_IDS, dtype=np.int64)  # each note is due at once
        rows = np.zeros((NOTE_IDS, 512), dtype=np.uint8)  # 4 MiB a note: more than the socket buffers hold

        def three_steps():
            for _ in range(3):
                ch.note("l1", 1, ids, ids, rows)

        steps = threading.Thread(target=three_steps, daemon=True)
        steps.start()
        steps.join(10)
        assert not steps.is_alive(), "a step waited on the sidecar to read its note"
        handler.go.set()
        assert _wait(lambda: handler.ids == 3 * NOTE_IDS, 10), handler.ids
    finally:
        handler.go.set()
        ch.close()
        srv.stop()
        shutil.rmtree(d, ignore_errors=True)
