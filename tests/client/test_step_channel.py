"""StepChannel (client/step_channel.py): what one channel owns, seen from its user.

Served by a real StepServer over a real unix socket with bench/step_socket.py's
ModuloHandler (the transport's harness, the `serve` fixture, as in
tests/sidecar/test_step_server.py); the wire itself is tested there."""
from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from tierstore import errors
from tierstore.bench.step_socket import ModuloHandler
from tierstore.client.step_channel import NOTE_IDS, RECONNECT_WAIT_S, RELEASE_LINGER_S, StepChannel, raise_errors
from tierstore.proto.frames import PlanItem

MASK = (1 << 20) - 1  # ModuloHandler's slots: id & MASK


def ids_of(n, seed=0):
    return np.random.default_rng(seed).integers(0, 1 << 30, n, dtype=np.int64)


def _wait(cond, timeout: float = 30.0) -> bool:
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


def test_a_released_lease_goes_out_alone_when_no_step_follows(serve):
    srv, h = serve()
    with StepChannel(srv.path) as ch:
        [res] = raise_errors(ch.submit([PlanItem("l1", np.arange(8))]).result())
        assert list(h.leases) == [res.lease_id]
        t0 = time.monotonic()
        ch.release_later(res.lease_id)
        assert _wait(lambda: not h.leases), "the queued release never went out"
        assert time.monotonic() - t0 >= RELEASE_LINGER_S  # it waited for a request to carry it first
        assert not ch._queued


def test_a_closed_channel_queues_nothing_and_its_leases_end(serve):
    srv, h = serve()
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


def test_a_step_that_notes_its_reads_does_not_wait_on_a_busy_sidecar(serve):
    """Local reads note each step (ids, and the rows of its misses); a step loop must not stall
    while the sidecar is slow to take them: the channel's flusher sends them. Every noted id
    still arrives once the sidecar reads again."""
    srv, handler = serve(_SlowReader())
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


def test_release_later_rides_on_the_next_request(serve):
    srv, h = serve()
    with StepChannel(srv.path).connect() as c:
        first = raise_errors(c.submit([PlanItem("l1", ids_of(4)), PlanItem("l14", ids_of(4))]).result())
        c.release_later([first[0].lease_id])
        c.release_later(np.array([first[1].lease_id]))
        assert len(h.leases) == 2  # nothing sent yet
        nxt = raise_errors(c.submit([PlanItem("l1", ids_of(4))]).result())
        assert list(h.leases) == [nxt[0].lease_id]
        c.release_later(nxt[0].lease_id)  # one id, as an int
        assert c.release([]) == 1 and not h.leases
        with pytest.raises((OverflowError, ValueError)):
            c.release_later(-1)  # not a lease id: refused here, nothing queued
        assert c.release([]) == 0


def test_submit_overlaps_the_round_trip_and_results_come_in_any_order(serve):
    srv, h = serve()
    with StepChannel(srv.path).connect() as c:
        a, b = ids_of(300, 1), ids_of(40000, 2)
        first = c.submit([PlanItem("l1", a)])
        second = c.submit([PlanItem("l14", b)])  # collects first's reply before sending
        assert first.done() and not second.done()
        assert np.array_equal(raise_errors(second.result())[0].slots, b & MASK)
        assert np.array_equal(raise_errors(first.result())[0].slots, a & MASK)
        assert len(h.leases) == 2
        gone = c.submit([PlanItem("l1", a)])
    with pytest.raises(errors.Unavailable, match="closed"):
        gone.result()


def test_a_step_in_flight_across_a_restart_is_resent_to_the_new_sidecar(serve):
    srv, _ = serve()
    c = StepChannel(srv.path, timeout=5).connect()
    srv.stop()  # the sidecar dies with our connection open ...
    srv2, h2 = serve(ModuloHandler(instance="second"), path=srv.path)
    pending = c.submit([PlanItem("l1", ids_of(8))])  # ... the send fails or the reply never comes
    assert raise_errors(pending.result())[0].instance == "second" and len(h2.leases) == 1
    c.close()


def test_a_release_on_a_lost_connection_answers_at_once_and_a_plan_waits_once(serve):
    """The flusher's release is often the first send on a dead connection (its send fails):
    it must answer 0 without the reconnect wait, or a plan queued behind the channel's lock
    waits twice RECONNECT_WAIT_S before it learns the sidecar is gone."""
    srv, h = serve()
    c = StepChannel(srv.path, timeout=10).connect()
    raise_errors(c.submit([PlanItem("l1", ids_of(3))]).result())
    srv.stop()  # the sidecar dies with our connection open, and stays down
    t0 = time.monotonic()
    assert c.release([1, 2]) == 0  # the send fails: those leases ended with the connection
    assert time.monotonic() - t0 < RECONNECT_WAIT_S / 2
    t0 = time.monotonic()
    with pytest.raises(errors.Unavailable, match=str(srv.path)):
        c.submit([PlanItem("l1", ids_of(3))]).result()
    assert RECONNECT_WAIT_S * 0.9 < time.monotonic() - t0 < RECONNECT_WAIT_S * 1.5  # one wait, not two
    c.close()


def test_no_server_is_unavailable_naming_the_socket(sock_dir):
    with pytest.raises(errors.Unavailable, match=str(sock_dir / "none")):
        StepChannel(sock_dir / "none", timeout=1).connect()
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # accepts, never answers
    mute.bind(str(sock_dir / "mute"))
    mute.listen()
    t0 = time.monotonic()
    with pytest.raises(errors.Unavailable, match="mute"):
        StepChannel(sock_dir / "mute", timeout=0.3).connect()
    assert time.monotonic() - t0 < 10  # it gave up instead of hanging
    mute.close()


def test_the_client_reconnects_once_after_a_restart_and_reports_the_new_instance(serve):
    srv, h = serve()
    c = StepChannel(srv.path, timeout=5).connect()
    raise_errors(c.submit([PlanItem("l1", ids_of(3))]).result())
    srv.stop()
    srv2, h2 = serve(ModuloHandler(instance="second"), path=srv.path)
    c.release_later([1])  # rides on the resent request
    res = raise_errors(c.submit([PlanItem("l1", ids_of(3))]).result())
    assert res[0].instance == c.instance == "second" != h.instance()
    srv2.stop()
    with pytest.raises(errors.Unavailable, match=str(srv.path)):
        c.submit([PlanItem("l1", ids_of(3))]).result()
    c.close()
    with pytest.raises(errors.InvalidArgument, match="closed"):
        c.release([1])


def test_threads_share_one_client(serve):
    srv, _ = serve()
    failures = []
    with StepChannel(srv.path).connect() as c:
        def worker(seed):
            for i in range(30):
                ids = ids_of(64 + i, seed * 100 + i)
                res = raise_errors(c.submit([PlanItem("l1", ids)]).result())
                if not np.array_equal(res[0].slots, ids & MASK):
                    failures.append(seed)
                c.release([res[0].lease_id])

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not failures
