"""Area 7: access. Only the serving user reaches a table: the socket and every
shm segment are 0600 (whatever the umask), another local user can neither
connect, map an arena nor read a segment, a link planted in /dev/shm never
redirects the sidecar's writes, and TCP needs --allow-tcp, the shared token and
(when certificates are given) TLS."""
from __future__ import annotations

import json
import os
import socket as socketlib
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from tierstore import errors
from tierstore.client.client import Client
from tierstore.tiers.dram import arena_tag

NOBODY = 65534
ROWS = 3000


@pytest.fixture
def open_dir():
    """A world-searchable directory (0755) outside tmp_path's private parents, removed after."""
    import shutil

    d = Path(tempfile.mkdtemp(prefix="tierstore-access-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


PROBE = """
import json, os, socket, sys
paths = json.loads(sys.argv[1])
out = {}
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(paths["socket"]); out["socket"] = "connected"
except OSError as e:
    out["socket"] = e.errno
for k in ("arena", "segment", "catalog"):
    try:
        os.close(os.open(paths[k], os.O_RDONLY if k != "catalog" else os.O_RDWR)); out[k] = "opened"
    except OSError as e:
        out[k] = e.errno
print(json.dumps(out))
"""


def _another_user_reaches_nothing(sc, vdir, data):
    """As `nobody` (we are root): connect to the socket, open the arena, a segment, the catalog."""
    paths = dict(socket=str(sc.socket), arena=str(sc.arena_files()[0]), segment=str(next(vdir.glob("seg-*"))),
                 catalog=str(data / "catalog" / "data.mdb"))
    # a system python: ours may live under a home only root can enter
    py = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.path.exists(p)), None)
    if py is None:
        return  # no system python for the other user
    out = subprocess.run([py, "-I", "-c", PROBE, json.dumps(paths)], user=NOBODY, group=NOBODY,
                         capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    import errno
    assert got == dict(socket=errno.EACCES, arena=errno.EACCES, segment=errno.EACCES, catalog=errno.EACCES), got
    with Client(sc.socket) as c:  # while the owner is served
        assert c.lookup("t", [1]).shape == (1, 64)


def test_everything_is_private_even_under_umask_0(open_dir, sidecars, rel):
    old = os.umask(0)
    try:
        rel.write_table(open_dir / "data", "t", ROWS, dim=16)
        full = sidecars(open_dir / "data", "64MiB", socket=open_dir / "full.sock")
    finally:
        os.umask(old)
    for sc in (full,):  # cache-mode arenas come from the same Arena code path
        assert stat.S_IMODE(os.stat(sc.socket).st_mode) == 0o600
        segs = sc.arena_files()
        assert len(segs) == 1
        for f in segs:
            st = os.lstat(f)
            assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
    vdir = open_dir / "data" / "tables" / "t" / "v1"
    assert stat.S_IMODE(os.stat(vdir).st_mode) == 0o700  # segment files sit behind a private directory
    if os.geteuid() == 0:
        _another_user_reaches_nothing(full, vdir, open_dir / "data")


CUT_PROBE = """
import json, os, sys
out = {}
for p in json.loads(sys.argv[1]):
    try:
        os.truncate(p, 0)
        out[p] = "cut"
    except OSError as e:
        out[p] = e.errno
print(json.dumps(out))
"""


def test_no_other_user_can_cut_short_a_file_the_sidecar_maps_for_its_clients(open_dir, sidecars, rel):
    """Every shm file a cache-mode sidecar under --direct-io makes for its clients to map (the
    arena, the slot index, the lease board, the miss flights) is 0600 and its uid's, whatever the
    umask: cutting one short (a map touched past its end is SIGBUS) takes that uid or root, who
    can already write the rows every client reads and signal every process (docs/operations.md,
    the threat model); as another user truncate is refused, file by file."""
    import errno

    old = os.umask(0)
    try:
        rel.write_table(open_dir / "data", "t", ROWS, dim=16)
        try:
            sc = sidecars(open_dir / "data", "64KiB", "--direct-io", socket=open_dir / "cache.sock")
        except Exception as e:  # noqa: BLE001 - a filesystem without O_DIRECT
            pytest.skip(f"--direct-io refused here: {e}")
    finally:
        os.umask(old)
    with Client(sc.socket) as c:
        assert not c.table_info("t")["full_resident"]
    files = sc.shm_files()
    kinds = {("flights" if f.name.endswith(".flights") else "index" if f.name.endswith(".index") else
              "leases" if f.name.endswith(".leases") else "arena") for f in files}
    assert kinds == {"arena", "index", "leases", "flights"}, files
    for f in files:
        st = os.lstat(f)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid(), f
    if os.geteuid() != 0:
        return  # another user's attempt needs root to make
    py = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.path.exists(p)), None)
    if py is None:
        return  # no system python for the other user
    out = subprocess.run([py, "-I", "-c", CUT_PROBE, json.dumps([str(f) for f in files])], user=NOBODY,
                         group=NOBODY, capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    assert set(json.loads(out.stdout).values()) == {errno.EACCES}, out.stdout
    assert all(os.stat(f).st_size > 0 for f in files)
    with Client(sc.socket) as c:
        assert c.lookup("t", [1, 2]).shape == (2, 64)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to plant a link owned by another user")
def test_a_link_planted_in_dev_shm_never_redirects_arena_writes(tmp_path, sidecars, rel):
    expected = rel.write_table(tmp_path / "data", "t", ROWS, dim=16)
    sock = tmp_path / "s.sock"
    # names carry random bits now; plant a link where a persisted arena of this sidecar would be found
    tag = arena_tag(tmp_path / "data", str(sock.resolve()))
    path = Path("/dev/shm") / f"tierstore.{os.getuid()}.{tag}.000000000000.t.v1"
    victim = tmp_path / "victim"
    victim.write_bytes(b"\xab" * expected.nbytes)  # the serving user's file, the arena's exact size
    victim.chmod(0o600)
    path.symlink_to(victim)
    os.lchown(path, NOBODY, NOBODY)  # as another user would leave it in the sticky, world-writable /dev/shm
    try:
        sc = sidecars(tmp_path / "data", "64MiB", "--persist-arena", socket=sock)
        assert victim.read_bytes() == b"\xab" * expected.nbytes, "the sidecar wrote through a planted link"
        assert path.is_symlink()  # another user's link: left alone, never followed
        with Client(sc.socket) as c:
            assert np.array_equal(c.lookup("t", np.arange(ROWS)), expected)
    finally:
        if path.is_symlink():
            path.unlink()


def _free_port() -> int:
    with socketlib.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _self_signed(d: Path, name: str) -> tuple[Path, Path]:
    cert, key = d / f"{name}.crt", d / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


@pytest.mark.reliability  # the default run has tests/sidecar's --allow-tcp check
def test_tcp_needs_allow_tcp_and_a_token(tmp_path, rel):
    rel.write_table(tmp_path / "data", "t", 100, dim=16)
    base = [sys.executable, "-m", "tierstore", "serve", "--data", str(tmp_path / "data"), "--socket",
            str(tmp_path / "s.sock"), "--listen", f"127.0.0.1:{_free_port()}"]
    for extra, needs in (([], "--allow-tcp"), (["--allow-tcp"], "shared token")):
        out = subprocess.run(base + extra, capture_output=True, text=True, timeout=60, cwd=tmp_path,
                             env={k: v for k, v in os.environ.items() if k != "TIERSTORE_AUTH_TOKEN"})
        assert out.returncode != 0 and needs in out.stderr, out.stderr
    assert not (tmp_path / "s.sock").exists()


@pytest.mark.skipif(not any((Path(p) / "openssl").exists() for p in os.environ.get("PATH", "").split(":")),
                    reason="needs openssl to make a certificate")
def test_tls_with_token_serves_rows_and_nothing_else_does(tmp_path, sidecars, rel):
    expected = rel.write_table(tmp_path / "data", "t", ROWS, dim=16)
    cert, key = _self_signed(tmp_path, "server")
    other, _ = _self_signed(tmp_path, "other")
    port = _free_port()
    sidecars(tmp_path / "data", "64MiB", "--listen", f"127.0.0.1:{port}", "--allow-tcp", "--auth-token", "s3cret",
             "--tls-cert", cert, "--tls-key", key)
    target, root = f"localhost:{port}", cert.read_bytes()
    with Client(target=target, token="s3cret", root_certificates=root, timeout=10) as c:
        ids = np.array([0, 17, ROWS - 1])
        assert np.array_equal(c.lookup("t", ids, inline=True), expected[ids])
        assert c.tables()[0]["rows"] == ROWS
    with Client(target=target, root_certificates=root, timeout=5) as c, pytest.raises(errors.Unauthenticated):
        c.lookup("t", [1], inline=True)
    with Client(target=target, token="wrong", root_certificates=root, timeout=5) as c, \
            pytest.raises(errors.Unauthenticated):
        c.tables()
    # a server it cannot verify, or plain text to a TLS port: no connection, and no hang
    with Client(target=target, token="s3cret", root_certificates=other.read_bytes(), timeout=1) as c, \
            pytest.raises(errors.Unavailable):
        c.tables()
    with Client(target=target, token="s3cret", timeout=1) as c, pytest.raises(errors.Unavailable):
        c.tables()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to leave files owned by another user")
def test_files_another_user_plants_under_our_names_neither_stop_nor_fool_the_sidecar(tmp_path, sidecars, rel):
    """16.8: arena names carry random bits, so the next one cannot be pre-created; files
    another user leaves under this sidecar's prefix are left alone, never opened."""
    expected = rel.write_table(tmp_path / "data", "t", ROWS, dim=16)
    sock = tmp_path / "s.sock"
    tag = arena_tag(tmp_path / "data", str(sock.resolve()))
    planted = [Path("/dev/shm") / f"tierstore.{os.getuid()}.{tag}.{i:012x}.t.v1" for i in range(3)]
    for p in planted:
        p.write_bytes(b"\0" * 64)
        os.chown(p, NOBODY, NOBODY)
    try:
        sc = sidecars(tmp_path / "data", "64MiB", "--persist-arena", socket=sock)
        with Client(sc.socket) as c:
            assert np.array_equal(c.lookup("t", np.arange(ROWS)), expected)
        assert all(p.exists() and p.stat().st_uid == NOBODY for p in planted)
    finally:
        for p in planted:
            p.unlink(missing_ok=True)


def _stuck_calls(target: str, n: int, token: str | None, method: str = "/tierstore.v1.Tierstore/ListTables"):
    """n TCP calls that send their headers and then never a message (a slowloris)."""
    import threading

    import grpc

    release = threading.Event()

    def never():
        release.wait()
        yield from ()

    ch = grpc.insecure_channel(target)
    call = ch.stream_unary(method, request_serializer=lambda b: b,
                           response_deserializer=lambda b: b)
    md = (("x-tierstore-token", token),) if token else None
    return [call.future(never(), metadata=md, timeout=120) for _ in range(n)], release, ch


def test_unauthenticated_slowloris_on_tcp_blocks_nobody(tmp_path, sidecars, rel):
    import grpc

    expected = rel.write_table(tmp_path / "data", "t", ROWS, dim=16)
    port = _free_port()
    sc = sidecars(tmp_path / "data", "64MiB", "--listen", f"127.0.0.1:{port}", "--allow-tcp", "--auth-token",
                  "s3cret", "--workers", "2", "--receive-timeout", "1")
    ids = np.array([0, 5, ROWS - 1])
    stuck, release, ch = _stuck_calls(f"127.0.0.1:{port}", 8, token=None)
    authed, release2, ch2 = _stuck_calls(f"127.0.0.1:{port}", 4, token="s3cret")
    probes, release3, ch3 = _stuck_calls(f"127.0.0.1:{port}", 2, None, "/grpc.health.v1.Health/Check")
    try:
        # no token: refused on the metadata, before any message, so no worker waits for one
        for f in stuck:
            assert f.exception(timeout=10).code() == grpc.StatusCode.UNAUTHENTICATED
        # with the token, every TCP worker is held, but the unix socket has its own
        with Client(sc.socket, timeout=5) as c:
            assert np.array_equal(c.lookup("t", ids, inline=True), expected[ids])
        # ... and the wait for a message is bounded: TCP serves again after --receive-timeout
        for f in authed + probes:  # health probes need no token, but get the same bound
            assert f.exception(timeout=30).code() == grpc.StatusCode.CANCELLED
        with Client(target=f"127.0.0.1:{port}", token="s3cret", timeout=5) as c:
            assert np.array_equal(c.lookup("t", ids, inline=True), expected[ids])
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{port}") as hc:
            stub = health_pb2_grpc.HealthStub(hc)
            assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1  # SERVING
            with pytest.raises(grpc.RpcError) as e:  # Watch would hold a worker: token only
                next(stub.Watch(health_pb2.HealthCheckRequest(), timeout=5))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        for r, c in ((release, ch), (release2, ch2), (release3, ch3)):
            r.set()
            c.close()


class _CountingRelay:
    """A TCP relay to `port` that counts the bytes it forwards towards it: what the
    sidecar's flow control let a caller send. Closed (threads joined) by close()."""

    def __init__(self, port: int):
        import threading

        self.port, self.sent, self._lock = port, 0, threading.Lock()
        self._listener = socketlib.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._socks: list = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socketlib.create_connection(("127.0.0.1", self.port))
            self._socks += [client, upstream]
            for a, b, counted in ((client, upstream, True), (upstream, client, False)):
                t = threading.Thread(target=self._pump, args=(a, b, counted), daemon=True)
                self._threads.append(t)
                t.start()

    def _pump(self, a, b, counted: bool) -> None:
        try:
            while data := a.recv(1 << 16):
                b.sendall(data)
                if counted:
                    with self._lock:
                        self.sent += len(data)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socketlib.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        for s in [self._listener] + self._socks:  # shutdown, not close, wakes a blocked accept or recv
            try:
                s.shutdown(socketlib.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(10)
        for s in [self._listener] + self._socks:
            s.close()


@pytest.mark.reliability
def test_oversized_unauthenticated_requests_are_refused_before_they_are_read(tmp_path, sidecars, rel):
    """A TCP call without the token is refused on its headers, and until then its stream
    may carry PRE_AUTH_WINDOW_BYTES: the sidecar lets in and holds that much per refused
    call, whatever size its message declares."""
    import grpc

    from tierstore.sidecar.auth import PRE_AUTH_WINDOW_BYTES
    from tierstore.proto import tierstore_pb2 as pb

    n, size = 8, 64 << 20
    rel.write_table(tmp_path / "data", "t", ROWS, dim=16)
    port = _free_port()
    sc = sidecars(tmp_path / "data", "64MiB", "--listen", f"127.0.0.1:{port}", "--allow-tcp", "--auth-token", "s3cret")
    relay = _CountingRelay(port)
    big = pb.LookupRequest(table="t", ids=b"\0" * (size - 4096))
    try:
        with grpc.insecure_channel(relay.address, options=[("grpc.max_send_message_length", 80 << 20)]) as ch:
            call = ch.unary_unary("/tierstore.v1.Tierstore/Lookup",
                                  request_serializer=pb.LookupRequest.SerializeToString,
                                  response_deserializer=pb.LookupResponse.FromString)
            small = pb.LookupRequest(table="t", ids=b"\0" * 8)  # the connection and its threads, first
            assert call.future(small, timeout=60).exception(timeout=60).code() == grpc.StatusCode.UNAUTHENTICATED
            rel.reset_peak_rss(sc.proc.pid)
            before, sent = rel.proc_status(sc.proc.pid)["VmRSS"], relay.sent
            futs = [call.future(big, timeout=60) for _ in range(n)]
            for f in futs:
                assert f.exception(timeout=60).code() == grpc.StatusCode.UNAUTHENTICATED
            let_in = relay.sent - sent
            peak = rel.proc_status(sc.proc.pid)["VmHWM"] - before
    finally:
        relay.close()
    window = n * PRE_AUTH_WINDOW_BYTES
    # each call's headers and its DATA frames' 9 B headers come on top of its window
    assert let_in <= window + n * 4096, f"the sidecar let in {let_in >> 10} KiB for {n} refused {size >> 20} MiB calls"
    # beyond those bytes, what serving any 8 calls costs: threads, call state, allocator slack
    slack = size // 4
    assert peak < window + slack, f"the sidecar's RSS peaked {peak >> 20} MiB higher for {n} refused calls"
