"""The TCP listener (`--listen`): any peer that reaches the port can open connections before it
shows the token, so connections that never finish their handshake (hundreds, from another uid)
must hold at most the listener's share of the sidecar's file descriptors, and nothing once they
stop: while they are held, the unix socket's clients plan on and new ones connect; once they
stop, a TCP client with the token is served."""
from __future__ import annotations

import resource
import time
from concurrent import futures

import grpc
import numpy as np
import pytest

from tierstore.client.client import Client

pytestmark = pytest.mark.reliability
ROWS = 4000
TOKEN = "s3cret"


@pytest.mark.parametrize("conns,soft", [(300, 256), (1100, 1024)])
def test_unfinished_tcp_handshakes_take_nothing_the_unix_clients_need(tmp_path, sidecars, rel, free_port, conns,
                                                                       soft):
    """`conns` connections (more than the sidecar's soft fd limit `soft` allows) dribbling
    HTTP/2's preface and never finishing it: the sidecar holds at most max_tcp_connections of
    them (a quarter of its fd limit), a unix client connected before plans on without a
    failure, a new unix client connects and reads its rows; once they stop, none is held
    after the handshake timeout, and a TCP client with the token reads its rows."""
    from tierstore.sidecar.auth import HANDSHAKE_TIMEOUT_S, max_tcp_connections

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < conns + 64:
        pytest.skip(f"the attack needs {conns + 64} fds; the hard limit is {hard}")
    expected = rel.write_table(tmp_path / "data", "t", ROWS, dim=16)
    port = free_port()
    mine = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, mine[1]))  # the sidecar starts with this soft limit
    try:
        sc = sidecars(tmp_path / "data", "128KiB", "--listen", f"127.0.0.1:{port}", "--allow-tcp",
                      "--auth-token", TOKEN)  # a cache: plans take leases
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, mine)
    pid, cap = sc.proc.pid, max_tcp_connections(soft)
    assert resource.prlimit(pid, resource.RLIMIT_NOFILE)[0] == soft
    def new_client():
        rel.rows_served(sc.socket, expected, [0, 7, ROWS - 1])

    def tcp_client():
        with Client(target=f"127.0.0.1:{port}", token=TOKEN, timeout=10) as c:
            ids = np.array([1, 8, ROWS - 2])
            assert np.array_equal(c.lookup("t", ids), expected[ids])

    attack = None
    with rel.Planner(sc.socket, expected) as planner:
        try:
            before = rel.sockets_of(pid)
            attack = rel.SlowPeers(port, conns, 120, rel.HTTP2_PREFACE)
            attack.hold(conns)
            held = rel.sockets_of(pid) - before
            joined = rel.timed(new_client)
            during = dict(attack.status)
            attack.stop()
            time.sleep(HANDSHAKE_TIMEOUT_S + 1.0)
            after = rel.sockets_of(pid) - before
            served = rel.timed(tcp_client)
        finally:
            if attack is not None:
                attack.stop()
    plans, failures = planner.plans, planner.failures
    print(f"{conns} unfinished TCP handshakes from another uid at soft fd limit {soft} (cap {cap}): {during}; "
          f"sidecar sockets +{held} (+{after} after); {plans} plans, {len(failures)} failed; a new client "
          f"{joined[1]} in {joined[0]:.2f} s; then a TCP client {served[1]} in {served[0]:.2f} s")
    assert not failures, f"{len(failures)} of {plans + len(failures)} plans failed: {failures[:3]}"
    assert held <= cap + 2, f"the attack holds {held} of the sidecar's sockets (cap {cap})"
    assert after <= 2, f"{after} sockets still held once the attack ended"
    assert joined[1] == "ok" and joined[0] < 2, joined
    assert served[1] == "ok", served


def test_the_tcp_options_bound_connections_by_the_fd_limit():
    from tierstore.sidecar.auth import max_tcp_connections, tcp_options

    assert [max_tcp_connections(n) for n in (16, 256, 1024, 65536)] == [8, 64, 256, 1024]
    opts = dict(tcp_options(256))
    assert opts["grpc.max_allowed_incoming_connections"] == 64
    assert opts["grpc.server_handshake_timeout_ms"] > 0 and opts["grpc.max_connection_idle_ms"] > 0
    server = grpc.server(futures.ThreadPoolExecutor(1), options=tcp_options(256))  # gRPC takes every option
    server.add_insecure_port("127.0.0.1:0")
    server.start()
    server.stop(None)
