"""The metrics port (`--metrics-port`, 127.0.0.1): any user on the host can connect to it, so
idle and slowloris connections (hundreds, from another uid) must hold none of the file
descriptors the sidecar's clients need: while they are held, a connected client's plans keep
succeeding, a new client connects, and an honest scrape is answered."""
from __future__ import annotations

import resource
import time
import urllib.request

import pytest


pytestmark = pytest.mark.reliability
ROWS = 4000


@pytest.mark.parametrize("conns,soft", [(300, 256), (1100, 1024)])
def test_idle_and_slowloris_connections_to_the_metrics_port_take_nothing_clients_need(
        tmp_path, sidecars, rel, free_port, conns, soft):
    """`conns` connections (more than the sidecar's soft fd limit `soft` allows: 256 in a small
    container, 1024 the common default), all but idle or a slowloris, from another uid: a client
    connected before plans on without a failure, a new client connects and reads its rows, an
    honest scrape is answered, each at once; the attack holds at most MAX_CONNECTIONS of the
    sidecar's fds while it lasts, and none once it ends."""
    from tierstore.sidecar.scrape_server import MAX_CONNECTIONS, REQUEST_TIMEOUT_S

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < conns + 64:
        pytest.skip(f"the attack needs {conns + 64} fds; the hard limit is {hard}")
    expected = rel.write_table(tmp_path / "data", "t", ROWS, dim=16)
    port = free_port()
    sc = sidecars(tmp_path / "data", "128KiB", "--metrics-port", port)  # a cache: plans take leases
    pid = sc.proc.pid
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, resource.prlimit(pid, resource.RLIMIT_NOFILE)[1]))
    def new_client():
        rel.rows_served(sc.socket, expected, [0, 7, ROWS - 1])

    def scrape():
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "tierstore_plans_total" in text

    attack = None
    with rel.Planner(sc.socket, expected) as planner:
        try:
            before = rel.sockets_of(pid)
            attack = rel.SlowPeers(port, conns, 120)
            attack.hold(conns)
            held = rel.sockets_of(pid) - before
            joined, scraped = rel.timed(new_client), rel.timed(scrape)
            time.sleep(1.0)
            during = dict(attack.status)
            attack.stop()
            time.sleep(REQUEST_TIMEOUT_S + 0.5)
            after = rel.sockets_of(pid) - before
        finally:
            if attack is not None:
                attack.stop()
    plans, failures = planner.plans, planner.failures
    print(f"{conns} connections from another uid at soft fd limit {soft}: {during}; sidecar sockets +{held} "
          f"(+{after} after); {plans} plans, {len(failures)} failed; a new client {joined[1]} in "
          f"{joined[0]:.2f} s, a scrape {scraped[1]} in {scraped[0]:.2f} s")
    assert not failures, f"{len(failures)} of {plans + len(failures)} plans failed: {failures[:3]}"
    assert held <= MAX_CONNECTIONS + 2, f"the attack holds {held} of the sidecar's sockets"
    assert after <= 2, f"{after} sockets still held once the attack ended"
    assert joined[1] == "ok" and joined[0] < 2, joined
    assert scraped[1] == "ok" and scraped[0] < 2, scraped
