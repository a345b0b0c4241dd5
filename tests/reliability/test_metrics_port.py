"""The metrics port (`--metrics-port`, 127.0.0.1): any user on the host can connect to it, so
idle and slowloris connections (hundreds, from another uid) must hold none of the file
descriptors the sidecar's clients need: while they are held, a connected client's plans keep
succeeding, a new client connects, and an honest scrape is answered."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest

from tierstore.client.client import Client

pytestmark = pytest.mark.reliability
NOBODY = 65534
ROWS = 4000

# n connections to 127.0.0.1:port held for `seconds`, each sending a request that never ends: even
# ones all but idle (a byte every 3 s), odd ones a slowloris (a byte every 0.2 s); one the server
# closes (or never took) is opened again, at most 250 a second. Prints
# {"open": now, "opened": in all, "closed": by the server} every 0.1 s.
ATTACK = r"""
import json, resource, selectors, socket, sys, time
port, n, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (n + 64, hard))  # its own soft limit (the test checked the hard one)
LINE = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100000
sel = selectors.DefaultSelector()
socks, up, sent, due = [None] * n, [False] * n, [0] * n, [0.0] * n
opened = closed = 0
end = time.monotonic() + seconds
next_print = next_connect = time.monotonic()


def drop(i):
    global closed
    closed += up[i]
    sel.unregister(socks[i])
    socks[i].close()
    socks[i], up[i] = None, False


while time.monotonic() < end:
    for i in range(n):
        if socks[i] is None and time.monotonic() >= next_connect:
            # paced: a burst past the server's listen backlog would wait in the kernel, not in it
            next_connect = max(next_connect + 0.004, time.monotonic() - 0.02)
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            socks[i], sent[i] = s, 0
            sel.register(s, selectors.EVENT_WRITE, i)
    now = time.monotonic()
    for i in range(n):
        if up[i] and now >= due[i]:  # a byte of a request that never ends (a connection the server
            due[i] = now + (0.2 if i % 2 else 3.0)  # never took answers it with a reset)
            try:
                sent[i] += socks[i].send(LINE[sent[i]:sent[i] + 1])
            except OSError:
                drop(i)
    for key, ev in sel.select(0.05):
        i = key.data
        if not up[i]:
            if socks[i].getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                drop(i)
                continue
            up[i], due[i] = True, time.monotonic()
            opened += 1
            sel.modify(socks[i], selectors.EVENT_READ, i)
            continue
        try:
            gone = not socks[i].recv(65536)
        except BlockingIOError:
            gone = False
        except OSError:
            gone = True
        if gone:
            drop(i)
    if time.monotonic() >= next_print:
        next_print = time.monotonic() + 0.1
        print(json.dumps(dict(open=sum(up), opened=opened, closed=closed)), flush=True)
"""


class Attack:
    """ATTACK run as `nobody` (the system python: ours may live where only root may enter), or as
    this user where we are not root (the port is open to every uid alike); `status` its last line."""

    def __init__(self, port: int, n: int, seconds: float):
        py = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else None
        kw = dict(user=NOBODY, group=NOBODY) if os.geteuid() == 0 and py else {}
        self.proc = subprocess.Popen([py or sys.executable, "-I", "-c", ATTACK, str(port), str(n), str(seconds)],
                                     cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
        self.status: dict = {}
        self._reader = threading.Thread(target=self._read)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.status = json.loads(line)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._reader.join(10)
        self.proc.stdout.close()
        self.proc.stderr.close()


def _fds(pid: int) -> int:
    """The sidecar's open sockets (what connections hold; its other fds, e.g. a read thread's
    io_uring opened on its first miss, come and go with its own work)."""
    held = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            held += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except FileNotFoundError:  # closed since listed
            pass
    return held


def _timed(fn) -> tuple[float, str]:
    """(seconds, "ok" or the error) of fn()."""
    t0 = time.monotonic()
    try:
        fn()
        return time.monotonic() - t0, "ok"
    except Exception as e:  # noqa: BLE001 - what a user would see is the finding
        return time.monotonic() - t0, repr(e)[:200]


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
    stop, failures, plans = threading.Event(), [], [0]

    def plan_loop():
        rng = np.random.default_rng(0)
        with Client(sc.socket, timeout=5) as c:
            while not stop.is_set():
                ids = rng.integers(0, ROWS, 64)
                try:
                    with c.plan("t", ids) as s:
                        assert np.array_equal(s.rows(), expected[ids])
                    plans[0] += 1
                except Exception as e:  # noqa: BLE001 - every failure is the finding
                    failures.append(repr(e))
                time.sleep(0.005)

    def new_client():
        with Client(sc.socket, timeout=5) as c:
            ids = np.array([0, 7, ROWS - 1])
            assert np.array_equal(c.lookup("t", ids), expected[ids])

    def scrape():
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "tierstore_plans_total" in text

    planner = threading.Thread(target=plan_loop)
    planner.start()
    attack = None
    try:
        while plans[0] == 0 and not failures:
            time.sleep(0.01)
        before = _fds(pid)
        attack = Attack(port, conns, 120)
        deadline = time.monotonic() + 15  # (a server out of fds takes no more)
        while attack.status.get("opened", 0) < conns and time.monotonic() < deadline:
            assert attack.proc.poll() is None, attack.proc.stderr.read()
            time.sleep(0.05)
        time.sleep(2.0)  # the attack held a while
        held = _fds(pid) - before
        joined, scraped = _timed(new_client), _timed(scrape)
        time.sleep(1.0)
        during = dict(attack.status)
        attack.stop()
        time.sleep(REQUEST_TIMEOUT_S + 0.5)
        after = _fds(pid) - before
    finally:
        stop.set()
        planner.join(30)
        if attack is not None:
            attack.stop()
    print(f"{conns} connections from another uid at soft fd limit {soft}: {during}; sidecar sockets +{held} "
          f"(+{after} after); {plans[0]} plans, {len(failures)} failed; a new client {joined[1]} in "
          f"{joined[0]:.2f} s, a scrape {scraped[1]} in {scraped[0]:.2f} s")
    assert not failures, f"{len(failures)} of {plans[0] + len(failures)} plans failed: {failures[:3]}"
    assert held <= MAX_CONNECTIONS + 2, f"the attack holds {held} of the sidecar's sockets"
    assert after <= 2, f"{after} sockets still held once the attack ended"
    assert joined[1] == "ok" and joined[0] < 2, joined
    assert scraped[1] == "ok" and scraped[0] < 2, scraped
