"""The step socket (tierstore/sidecar/step_server.py + client/step_channel.py) over a real unix socket.

The handler is bench/step_socket.py's ModuloHandler (slot = id & mask, leases in a
dict): the transport's harness, not a model of the engine."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierstore import errors
from tierstore.bench.step_socket import ChildServer, ModuloHandler
from tierstore.client.step_channel import StepChannel, raise_errors
from tierstore.proto.frames import PlanItem, PlanResult, step_socket_path
from tierstore.sidecar.step_server import StepServer
from tierstore.proto.frames import (ERROR, HDR, HELLO, HELLO_REQ, ITEM, MAGIC, MAX_RELEASE, NOTE, PLAN, PLAN_REQ,
                                PROTOCOL_VERSION, FrameReader, NoteItem, decode_error, encode_note,
                                parse_note)

MASK = (1 << 20) - 1


def ids_of(n, seed=0):
    return np.random.default_rng(seed).integers(0, 1 << 30, n, dtype=np.int64)


def raw_client(path, conn_id=None):
    """A socket past HELLO (or before it when conn_id is False), for speaking bytes by hand."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(path))
    if conn_id is not False:
        s.sendall(HDR.pack(HELLO_REQ.size, HELLO) + HELLO_REQ.pack(MAGIC, PROTOCOL_VERSION, conn_id or os.urandom(16)))
        assert FrameReader(s, 1 << 20).read(owned=True)[0] == HELLO
    return s


def read_reply(s):
    """(op, body) of the next frame, or None when the server closed the connection."""
    try:
        return FrameReader(s, 1 << 30).read(owned=True)
    except (EOFError, ConnectionError):
        return None


def test_plan_returns_slots_per_item_and_release_rides_along(serve):
    srv, h = serve()
    with StepChannel(srv.path).connect() as c:
        assert c.instance == h.instance()
        a, b = ids_of(256, 1), ids_of(1000, 2)
        res = raise_errors(c.submit([PlanItem("l1", a, ttl_ms=500, request_id=7),
                                     PlanItem("l14", b, version=3)]).result())
        assert [r.slots.tolist() for r in res] == [(a & MASK).tolist(), (b & MASK).tolist()]
        assert res[0].slots.dtype == np.dtype("<i8") and not res[0].slots.flags.writeable
        assert res[1].version == 3 and res[0].instance == h.instance() and res[0].hits == 256
        assert len(h.leases) == 2
        c.release_later([r.lease_id for r in res])
        res2 = raise_errors(c.submit([PlanItem("l1", a[:0])]).result())
        assert res2[0].slots.size == 0 and list(h.leases) == [res2[0].lease_id]  # the old two released first
        assert c.release([res2[0].lease_id, 12345]) == 1 and not h.leases
        assert c.release(np.arange(1, 3 * MAX_RELEASE, dtype=np.uint64)) == 0  # sent in pieces the server takes
        c.release_later(np.arange(1, 2 * MAX_RELEASE))  # more than a step may carry: it takes MAX_RELEASE ...
        assert raise_errors(c.submit([PlanItem("l1", a)]).result())[0].slots.size == a.size  # ... so none is refused
        assert c.release([]) == 0  # the rest go in RELEASE frames (no live lease among them)


def test_errors_come_back_per_item_as_the_same_class(serve):
    srv, _ = serve()
    with StepChannel(srv.path).connect() as c:
        res = c.submit([PlanItem("nope", ids_of(3)), PlanItem("l1", ids_of(3)),
                        PlanItem("l1", np.array([-1]))]).result()
        assert type(res[0]) is errors.TableNotFound and "nope" in str(res[0])
        assert res[1].slots.size == 3
        assert type(res[2]) is errors.IdOutOfRange
        with pytest.raises(errors.TableNotFound):
            raise_errors(res)
        with pytest.raises(errors.InvalidArgument, match="integers"):
            c.submit([PlanItem("l1", np.array([1.5]))]).result()


class Broken(ModuloHandler):
    def plan(self, conn_id, items, release):
        if items and items[0].table == "boom":
            raise RuntimeError("handler bug")
        if items and items[0].table == "odd":
            return [ValueError("not a tierstore error")]
        if items and items[0].table == "short":
            return [PlanResult(1, 1, np.zeros(1, np.int64))]
        return super().plan(conn_id, items, release)


def test_a_handler_bug_is_an_error_reply_and_the_connection_survives(serve):
    srv, _ = serve(Broken())
    with StepChannel(srv.path).connect() as c:
        with pytest.raises(errors.TierstoreError, match="internal error.*RuntimeError: handler bug"):
            c.submit([PlanItem("boom", ids_of(2))]).result()
        assert type(c.submit([PlanItem("odd", ids_of(2))]).result()[0]) is errors.TierstoreError
        assert "1 slots for 2 ids" in str(c.submit([PlanItem("short", ids_of(2))]).result()[0])
        assert raise_errors(c.submit([PlanItem("l1", ids_of(4))]).result())[0].slots.size == 4


def test_socket_is_0600_and_only_a_stale_one_is_replaced(serve, sock_dir):
    path = sock_dir / "s.sock.steps"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # a socket file nothing answers on
    srv, _ = serve(path=path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(errors.InvalidArgument, match="another process serves"):
        StepServer(path, ModuloHandler()).start()
    (sock_dir / "file").write_text("keep me")
    with pytest.raises(errors.InvalidArgument, match="not a socket"):
        StepServer(sock_dir / "file", ModuloHandler()).start()
    assert (sock_dir / "file").read_text() == "keep me"
    srv.stop()
    assert not path.exists()
    assert step_socket_path(Path("/run/t.sock")) == Path("/run/t.sock.steps")


def test_a_connection_that_never_says_hello_gives_its_slot_back(serve, monkeypatch):
    import tierstore.sidecar.step_server as fastpath

    monkeypatch.setattr(fastpath, "HELLO_TIMEOUT_S", 0.2)
    srv, h = serve(max_clients=1)
    s = raw_client(srv.path, conn_id=False)
    assert read_reply(s) is None  # closed by the server, without a word
    s.close()
    with StepChannel(srv.path).connect() as c:
        assert raise_errors(c.submit([PlanItem("l1", ids_of(3))]).result())[0].slots.size == 3
    assert not h.disconnects[:-1]  # no conn_id was ever announced for the silent one


def test_a_client_that_never_reads_its_replies_is_dropped(serve, monkeypatch):
    import tierstore.sidecar.step_server as fastpath

    monkeypatch.setattr(fastpath, "SEND_TIMEOUT_S", 1)
    srv, h = serve()
    s = raw_client(srv.path)
    ids = ids_of(16384).astype("<i8").tobytes()
    body = PLAN_REQ.pack(1, 0) + ITEM.pack(0, 0, 16384, 0, 2) + b"l1" + bytes(6) + ids
    s.settimeout(0.5)
    try:
        for _ in range(400):  # far more replies than any socket buffer holds
            s.sendall(HDR.pack(len(body), PLAN) + body)
    except TimeoutError:
        pass
    for _ in range(1000):
        if srv.clients == 0:
            break
        time.sleep(0.01)
    assert srv.clients == 0 and len(h.disconnects) == 1 and not h.leases
    s.close()


def test_max_clients_is_a_clear_refusal_and_a_freed_slot_is_reusable(serve):
    srv, _ = serve(max_clients=2)
    a, b = StepChannel(srv.path).connect(), StepChannel(srv.path).connect()
    with pytest.raises(errors.ResourceExhausted, match="max_clients=2"):
        StepChannel(srv.path).connect()
    a.close()
    for _ in range(200):  # the server notices the close on its own thread
        if srv.clients < 2:
            break
        time.sleep(0.01)
    with StepChannel(srv.path).connect() as c:
        assert raise_errors(c.submit([PlanItem("l1", ids_of(5))]).result())[0].slots.size == 5
    b.close()


def test_a_closed_connection_ends_its_owners_leases(serve):
    srv, h = serve()
    conn_id = os.urandom(16)
    keep = StepChannel(srv.path).connect()
    keep.submit([PlanItem("l1", ids_of(5))]).result()
    c = StepChannel(srv.path, conn_id=conn_id).connect()
    c.submit([PlanItem("l1", ids_of(5)), PlanItem("l14", ids_of(5))]).result()
    assert len(h.leases) == 3
    c.close()
    for _ in range(200):
        if conn_id in h.disconnects:
            break
        time.sleep(0.01)
    assert h.disconnects == [conn_id] and list(h.leases.values()) == [keep.conn_id]
    keep.close()


def test_hello_with_a_wrong_magic_or_version_is_refused_cleanly(serve):
    srv, _ = serve()
    for magic, version in ((b"HTTP", PROTOCOL_VERSION), (MAGIC, PROTOCOL_VERSION + 1)):
        s = raw_client(srv.path, conn_id=False)
        s.sendall(HDR.pack(HELLO_REQ.size, HELLO) + HELLO_REQ.pack(magic, version, os.urandom(16)))
        op, body = read_reply(s)
        err = decode_error(body, 0)[0]
        assert op == ERROR and type(err) is errors.InvalidArgument and "different tierstore versions" in str(err)
        assert read_reply(s) is None  # and the connection is closed
        s.close()
    with StepChannel(srv.path).connect() as c:
        with pytest.raises(errors.InvalidArgument, match="already connected"):
            StepChannel(srv.path, conn_id=c.conn_id).connect()  # one conn_id, one connection: leases are never shared


def test_a_frame_over_the_limit_is_refused_without_reading_it(serve):
    srv, _ = serve(max_request_bytes=4096)
    with StepChannel(srv.path).connect() as c:
        with pytest.raises(errors.ResourceExhausted, match="4096 B limit"):
            c.submit([PlanItem("l1", ids_of(1000))]).result()  # refused before sending
        assert raise_errors(c.submit([PlanItem("l1", ids_of(10))]).result())[0].slots.size == 10
    s = raw_client(srv.path)
    s.sendall(HDR.pack(1 << 31, PLAN))
    op, body = read_reply(s)
    assert op == ERROR and type(decode_error(body, 0)[0]) is errors.ResourceExhausted
    assert read_reply(s) is None
    s.close()


def plan_frame(n_ids: int, table: bytes = b"l1") -> bytes:
    """A whole PLAN frame (header included) of one item with n_ids ids."""
    body = PLAN_REQ.pack(1, 0) + ITEM.pack(0, 0, n_ids, 0, len(table)) + table + bytes(-len(table) % 8) + \
        ids_of(n_ids).astype("<i8").tobytes()
    return HDR.pack(len(body), PLAN) + body


def replied(s, wait: float) -> bool:
    """Whether the server has written to `s` (a reply, or its close) within `wait` seconds."""
    import select

    return bool(select.select([s], [], [], wait)[0])


def test_a_first_frame_other_than_hello_is_refused_at_its_header(serve):
    srv, _ = serve()
    s = raw_client(srv.path, conn_id=False)
    s.settimeout(3)
    s.sendall(HDR.pack(1 << 20, PLAN))  # declares 1 MiB; sends none of it
    op, body = read_reply(s)
    err = decode_error(body, 0)[0]
    assert op == ERROR and type(err) is errors.InvalidArgument and "first frame must be HELLO" in str(err)
    assert read_reply(s) is None
    s.close()


def test_a_frame_must_be_whole_in_time_and_the_wait_between_frames_is_free(serve, monkeypatch):
    import tierstore.sidecar.step_server as fastpath

    monkeypatch.setattr(fastpath, "FRAME_TIMEOUT_S", 0.5)
    srv, _ = serve()
    with StepChannel(srv.path).connect() as c:
        time.sleep(1.0)  # idle between steps, twice the frame deadline
        assert raise_errors(c.submit([PlanItem("l1", ids_of(3))]).result())[0].slots.size == 3
    s = raw_client(srv.path)
    frame, t0 = plan_frame(100), time.monotonic()
    for i in range(len(frame)):  # a byte at a time: each recv returns, the frame never completes in time
        s.sendall(frame[i:i + 1])
        if replied(s, 0.05) or time.monotonic() > t0 + 5:
            break
    op, body = read_reply(s)
    err = decode_error(body, 0)[0]
    assert op == ERROR and type(err) is errors.Unavailable and "not whole" in str(err), err
    assert time.monotonic() - t0 < 2.5 and read_reply(s) is None
    s.close()


class Slow(ModuloHandler):
    def plan(self, conn_id, items, release):
        if items and items[0].table == "slow":
            time.sleep(3)
            items[0].table = "l1"
        return super().plan(conn_id, items, release)


def test_receive_buffers_share_one_bound_and_small_steps_never_wait_for_it(serve, monkeypatch):
    import tierstore.sidecar.step_server as fastpath

    monkeypatch.setattr(fastpath, "FRAME_TIMEOUT_S", 1.0)  # also the longest wait for room
    srv, h = serve(Slow(), max_request_bytes=256 << 10, max_buffered_bytes=512 << 10)
    n = 32000  # a 250 KiB frame: 186 KiB of it beyond SCRATCH, so two fill the bound but a third does not fit
    a, b, c = raw_client(srv.path), raw_client(srv.path), raw_client(srv.path)
    frame = plan_frame(n)
    try:
        a.sendall(frame[:-100])
        b.sendall(frame[:-100])
        time.sleep(0.2)
        c.sendall(frame)  # whole, but no room for it: it waits
        with StepChannel(srv.path).connect() as good:
            assert raise_errors(good.submit([PlanItem("l1", ids_of(256))]).result())[0].slots.size == 256
        assert not replied(c, 0.3)
        a.sendall(frame[-100:])  # a's frame is whole and served: its room goes to c
        assert read_reply(a)[0] == PLAN and read_reply(c)[0] == PLAN
        for s in (a, c):  # two slow steps hold the bound while they are served ...
            s.sendall(plan_frame(n, b"slow"))
        time.sleep(0.2)
        d = raw_client(srv.path)
        d.sendall(frame)  # ... so d waits its FRAME_TIMEOUT_S, then is told why
        op, body = read_reply(d)
        err = decode_error(body, 0)[0]
        assert op == ERROR and type(err) is errors.ResourceExhausted and "bound across connections" in str(err)
        d.close()
        assert read_reply(a)[0] == PLAN and read_reply(c)[0] == PLAN
        err = decode_error(read_reply(b)[1], 0)[0]  # b never finished its frame: cut, not kept
        assert type(err) is errors.Unavailable
        e = raw_client(srv.path)
        e.sendall(frame)
        assert read_reply(e)[0] == PLAN  # the bound is free again
        e.close()
    finally:
        for s in (a, b, c):
            s.close()
    for _ in range(200):
        if srv.clients == 0:
            break
        time.sleep(0.01)
    assert srv.budget.held == 0  # every connection gave its room back


class Keeper(ModuloHandler):
    """Keeps the ids it was given past the call: the server must then not reuse that buffer."""

    kept: list = []

    def plan(self, conn_id, items, release):
        self.kept.append(items[0].ids)
        return super().plan(conn_id, items, release)


def test_ids_a_handler_keeps_are_not_overwritten_by_the_next_request(serve):
    srv, h = serve(Keeper())
    with StepChannel(srv.path).connect() as c:
        first, second = ids_of(100, 1), ids_of(100, 2)
        c.submit([PlanItem("l1", first)]).result()
        c.submit([PlanItem("l1", second)]).result()
    assert np.array_equal(h.kept[0], first) and np.array_equal(h.kept[1], second)


@settings(max_examples=60, deadline=None, database=None)
@given(n_ids=st.integers(0, 40), n_rows=st.integers(0, 12), row_bytes=st.sampled_from([8, 13, 264]),
       cut=st.integers(1, 64))
def test_access_frames_carry_rows_and_a_lie_about_them_is_refused(n_ids, n_rows, row_bytes, cut):
    """A NOTE item's rows round-trip bit-exact (any width, padded to 8); a frame cut
    short anywhere in them is InvalidArgument, never a view past the body."""
    rng = np.random.default_rng(n_ids * 100 + n_rows)
    ids = rng.integers(0, 1000, n_ids).astype(np.int64)
    row_ids = rng.integers(0, 1000, n_rows).astype(np.int64)
    rows = rng.integers(0, 256, (n_rows, row_bytes), dtype=np.uint8)
    items = [NoteItem("b", ids[:1], np.array([min(1, n_ids)], np.int64)),  # the rows' item last: cut into
             NoteItem("tbl", ids, np.array([n_ids], np.int64), 3, row_ids if n_rows else None,
                        rows if n_rows else None)]
    parts, size = encode_note(items)
    body = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    assert len(body) == size and size % 8 == 0
    got = parse_note(body)
    assert np.array_equal(got[1].ids, ids) and got[1].version == 3 and got[0].rows is None
    if n_rows:
        assert np.array_equal(got[1].row_ids, row_ids) and np.array_equal(got[1].rows, rows)
    else:
        assert got[1].rows is None and got[1].row_ids is None
    with pytest.raises(errors.InvalidArgument):
        parse_note(body[:-min(cut, len(body) - 1)])


def one_way_ok(body) -> bool:
    try:
        parse_note(body)
    except errors.InvalidArgument:
        return False
    return True


def frames():
    """Hostile frames: random ops and bytes, and PLANs whose declared sizes lie."""
    plan_body = st.builds(
        lambda n_items, n_rel, ver, n_ids, ttl, name_len, name, tail: (
            PLAN_REQ.pack(n_items, n_rel) + ITEM.pack(ver, 0, n_ids, ttl, name_len) + name + tail),
        st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1),
        st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**16 - 1),
        st.binary(max_size=40), st.binary(max_size=256))
    item = st.builds(
        lambda name, ids, lie, ver, ttl: (ITEM.pack(ver, 0, max(len(ids) + lie, 0), ttl, len(name)) + name
                                          + bytes(-len(name) % 8) + np.asarray(ids, "<i8").tobytes()),
        st.one_of(st.sampled_from([b"l1", b"l14", b""]), st.binary(max_size=12)),
        st.lists(st.integers(-2**63, 2**63 - 1), max_size=20), st.sampled_from([0, 0, 0, -1, 1, 1000]),
        st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1))
    nearly_valid = st.builds(lambda items, rel: PLAN_REQ.pack(len(items), len(rel)) + np.asarray(
        rel, "<u8").tobytes() + b"".join(items), st.lists(item, max_size=3), st.lists(st.integers(0, 2**64 - 1),
                                                                                      max_size=3))
    return st.one_of(
        st.tuples(st.just(PLAN), nearly_valid),
        st.tuples(st.integers(0, 255), st.binary(max_size=512)),
        st.tuples(st.just(PLAN), plan_body),
        st.tuples(st.sampled_from([HELLO, PLAN, 3, NOTE, 0x7F, 200]), st.binary(max_size=64)),
        st.tuples(st.just(NOTE), st.sampled_from([bytes(4), bytes(8), b""])))


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.lists(frames(), min_size=1, max_size=4), truncate=st.booleans())
def test_hostile_frames_never_break_the_server(fuzz_target, data, truncate):
    srv, good = fuzz_target
    s = raw_client(srv.path)
    try:
        for op, body in data:
            frame = HDR.pack(len(body), op) + body
            try:
                s.sendall(frame[:len(frame) // 2] if truncate else frame)
            except (BrokenPipeError, ConnectionResetError):
                break  # the server ended this connection after an earlier frame's ERROR
            if truncate:
                break
            if op == NOTE and one_way_ok(body):
                continue  # a well-formed NOTE is one-way: no reply
            reply = read_reply(s)
            if reply is None:
                break
            assert reply[0] in (ERROR, op)
            if reply[0] == ERROR:
                assert isinstance(decode_error(reply[1], 0)[0], errors.TierstoreError)
    finally:
        s.close()
    ids = ids_of(50)
    assert np.array_equal(raise_errors(good.submit([PlanItem("l1", ids)]).result())[0].slots, ids & MASK)


@pytest.fixture(scope="module")
def fuzz_target():
    d = Path(tempfile.mkdtemp(prefix="tsfp-", dir="/tmp"))
    srv = StepServer(d / "f.steps", ModuloHandler(), max_request_bytes=1 << 16, max_clients=64)
    srv.start()
    good = StepChannel(srv.path, timeout=10).connect()
    yield srv, good
    good.close()
    srv.stop()
    shutil.rmtree(d, ignore_errors=True)


def test_a_server_in_another_process(sock_dir):
    path = sock_dir / "child.steps"
    child = ChildServer(path)
    try:
        c = StepChannel(path, timeout=5).connect()
        ids = ids_of(32768)
        res = raise_errors(c.submit([PlanItem("l1", ids), PlanItem("l14", ids[:256])]).result())
        assert np.array_equal(res[0].slots, ids & MASK) and res[0].instance == child.instance
        assert child.leases()["leases"] == 2
        c.release([r.lease_id for r in res])
        assert child.leases()["leases"] == 0
        quick = StepChannel(path, timeout=0.5).connect()
        os.kill(child.proc.pid, signal.SIGSTOP)  # a hung sidecar: the call gives up after `timeout`
        while Path(f"/proc/{child.proc.pid}/stat").read_text().split(")")[-1].split()[0] != "T":
            time.sleep(0.01)
        try:
            with pytest.raises(errors.Unavailable, match="no reply within 0.5 s"):
                quick.submit([PlanItem("l1", ids[:4])]).result()
        finally:
            os.kill(child.proc.pid, signal.SIGCONT)
        quick.close()
        child.kill()  # a crashed sidecar: nothing answers, the client says so and names the socket
        with pytest.raises(errors.Unavailable, match="child.steps"):
            c.submit([PlanItem("l1", ids[:4])]).result()
        c.close()
    finally:
        child.kill()


def test_polling_readers_serve_the_same_replies(serve, monkeypatch):
    """TIERSTORE_SPIN_US: both sides poll before they block; replies are unchanged,
    including one that arrives after the poll gave up (a slow handler)."""
    monkeypatch.setenv("TIERSTORE_SPIN_US", "300")

    class Slow(ModuloHandler):
        def plan(self, conn_id, items, release):
            if items and items[0].request_id == 99:
                time.sleep(0.01)  # longer than the poll: the client blocks, then wakes
            return super().plan(conn_id, items, release)

    srv, h = serve(Slow())
    with StepChannel(srv.path).connect() as c:
        assert c._spin_s == pytest.approx(300e-6)
        for n in (1, 256, 5000):  # 5000 ids: over SPIN_MAX_REQUEST_BYTES, not polled for
            a = ids_of(n, n)
            res = raise_errors(c.submit([PlanItem("l1", a)]).result())
            assert res[0].slots.tolist() == (a & MASK).tolist()
        res = raise_errors(c.submit([PlanItem("l1", ids_of(8), request_id=99)]).result())
        assert res[0].slots.tolist() == (ids_of(8) & MASK).tolist()
