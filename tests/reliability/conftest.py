"""Fixtures of the reliability suite: real sidecars, real client processes, and
the bookkeeping that proves each test left no process, socket or shm segment."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tierstore.table.formats import encode_rows
from tierstore.ingest.writer import write_version
from tierstore.client.client import Client
from tierstore.sidecar.launcher import SidecarProcess

WORKER = Path(__file__).with_name("_worker.py")
NOBODY = 65534


def write_table(data_dir: Path, name: str, rows: int, dim: int = 32, fmt: str = "fp32", seed: int = 0,
                **kw) -> np.ndarray:
    """Write one table version of random values; return the exact bytes on disk."""
    vals = np.random.default_rng(seed).standard_normal((rows, dim)).astype(np.float32)
    packed = encode_rows(vals, fmt)
    write_version(data_dir, name, [packed[i:i + 50_000] for i in range(0, rows, 50_000)], rows=rows,
                  row_format=fmt, row_dim=dim, **kw)
    return packed


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM (its peak) / RssAnon / RssShmem of a process in bytes (from /proc/PID/status)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, val = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssShmem", "RssFile"):
                out[key] = int(val.split()[0]) * 1024
    return out


def reset_peak_rss(pid: int) -> None:
    """Start VmHWM afresh at the current RSS (clear_refs 5), so a later peak is this test's own."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def mappers_of(path: Path, pids) -> list[int]:
    """Which of `pids` still map the file `path`."""
    hits = []
    for pid in pids:
        try:
            if str(path) in Path(f"/proc/{pid}/maps").read_text():
                hits.append(pid)
        except OSError:
            pass
    return hits


def my_shm_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob(f"tierstore.{os.getuid()}.*")}


class Workers:
    """Client processes running _worker.py; every one is killed at teardown."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []

    def spawn(self, mode: str, **args) -> subprocess.Popen:
        i = len(self.procs)
        args.setdefault("status", str(self.tmp / f"w{i}.json"))
        argv = [sys.executable, str(WORKER), mode, json.dumps(args)]
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=self.tmp)
        p.status_path = Path(args["status"])
        self.procs.append(p)
        return p

    @staticmethod
    def status(p) -> dict:
        try:
            return json.loads(p.status_path.read_text())
        except (OSError, ValueError):
            return {}

    def wait_for(self, cond, procs=None, timeout: float = 60.0, what: str = "workers") -> None:
        procs = self.procs if procs is None else procs
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(cond(self.status(p)) for p in procs):
                return
            for p in procs:
                if p.poll() is not None and not cond(self.status(p)):
                    raise AssertionError(f"worker exited {p.returncode}: {p.stdout.read().decode()} "
                                         f"{p.stderr.read().decode()[-3000:]}")
            time.sleep(0.05)
        raise AssertionError(f"{what} not there after {timeout}s: {[self.status(p) for p in procs]}")

    def finish(self, timeout: float = 60.0) -> list[dict]:
        """Wait for every worker; return their final reports (asserting none crashed)."""
        out = []
        for p in self.procs:
            so, se = p.communicate(timeout=timeout)
            assert p.returncode == 0, f"worker failed ({p.returncode}): {so.decode()} {se.decode()[-3000:]}"
            out.append(json.loads(so.decode().strip().splitlines()[-1]))
        return out

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait()
            for s in (p.stdout, p.stderr):
                s.close()
            p.status_path.unlink(missing_ok=True)


# ---- slow peers: many connections to a TCP port that never finish a request ----------------------
# n connections to 127.0.0.1:port held for `seconds`, each dribbling `line` (hex) and never ending
# it: even ones all but idle (a byte every 3 s), odd ones a slowloris (a byte every 0.2 s); one the
# server closes (or never took) is opened again, at most 250 a second. Prints
# {"open": now, "opened": in all, "closed": by the server} every 0.1 s.
SLOW_PEERS = r"""
import json, resource, selectors, socket, sys, time
port, n, seconds, line = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), bytes.fromhex(sys.argv[4])
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (n + 64, hard))  # its own soft limit (the test checked the hard one)
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
        if up[i] and now >= due[i] and sent[i] < len(line):  # a byte of a request that never ends (a
            due[i] = now + (0.2 if i % 2 else 3.0)  # connection the server never took answers with a reset)
            try:
                sent[i] += socks[i].send(line[sent[i]:sent[i] + 1])
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
HTTP_REQUEST = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 4096  # longer than any test dribbles: never ends
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # what a gRPC client sends first, then its SETTINGS


class SlowPeers:
    """SLOW_PEERS run as `nobody` (the system python: ours may live where only root may enter), or
    as this user where we are not root (a TCP port is open to every uid alike); `status` its last
    line."""

    def __init__(self, port: int, n: int, seconds: float, line: bytes = HTTP_REQUEST):
        py = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else None
        kw = dict(user=NOBODY, group=NOBODY) if os.geteuid() == 0 and py else {}
        self.proc = subprocess.Popen([py or sys.executable, "-I", "-c", SLOW_PEERS, str(port), str(n), str(seconds),
                                      line.hex()],
                                     cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
        self.status: dict = {}
        self._reader = threading.Thread(target=self._read)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.status = json.loads(line)

    def hold(self, n: int, seconds: float = 2.0) -> None:
        """Wait until `n` connections are open (15 s at most: a server out of fds takes no more),
        then hold them `seconds`."""
        deadline = time.monotonic() + 15
        while self.status.get("opened", 0) < n and time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stderr.read()
            time.sleep(0.05)
        time.sleep(seconds)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._reader.join(10)
        self.proc.stdout.close()
        self.proc.stderr.close()


def sockets_of(pid: int) -> int:
    """A process's open sockets (what connections hold; its other fds, e.g. a read thread's
    io_uring opened on its first miss, come and go with its own work)."""
    held = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            held += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except FileNotFoundError:  # closed since listed
            pass
    return held


def timed(fn) -> tuple[float, str]:
    """(seconds, "ok" or the error) of fn()."""
    t0 = time.monotonic()
    try:
        fn()
        return time.monotonic() - t0, "ok"
    except Exception as e:  # noqa: BLE001 - what a user would see is the finding
        return time.monotonic() - t0, repr(e)[:200]


class Planner:
    """A thread planning 64 random ids of table "t" every 5 ms through its own client, each
    plan's rows checked against `expected`: `plans` done, `failures` (each repr) seen. A
    with-block starts it and returns once its first plan is done (or failed); leaving stops it."""

    def __init__(self, socket, expected: np.ndarray):
        self.socket, self.expected = socket, expected
        self.plans, self.failures = 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        rng = np.random.default_rng(0)
        with Client(self.socket, timeout=5) as c:
            while not self._stop.is_set():
                ids = rng.integers(0, self.expected.shape[0], 64)
                try:
                    with c.plan("t", ids) as s:
                        assert np.array_equal(s.rows(), self.expected[ids])
                    self.plans += 1
                except Exception as e:  # noqa: BLE001 - every failure is the finding
                    self.failures.append(repr(e))
                time.sleep(0.005)

    def __enter__(self):
        self._thread.start()
        while self.plans == 0 and not self.failures:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)


def rows_served(socket, expected: np.ndarray, ids, **client) -> None:
    """A new client (Client(socket, **client)) looks `ids` of table "t" up and gets `expected`'s rows."""
    ids = np.asarray(ids)
    with Client(socket, **{"timeout": 5, **client}) as c:
        assert np.array_equal(c.lookup("t", ids), expected[ids])


@pytest.fixture
def workers(tmp_path):
    w = Workers(tmp_path)
    yield w
    w.kill_all()


@pytest.fixture
def sidecars():
    """sidecars(data, budget, *extra, socket=None) -> a started SidecarProcess, cleaned up at teardown
    (and asserted to leave no shm segment behind)."""
    made: list[SidecarProcess] = []

    def start(data, budget="64MiB", *extra, socket=None, env=None, wait=True):
        sc = SidecarProcess(data, socket=socket, dram_budget=budget, extra_args=[str(e) for e in extra], env=env)
        made.append(sc)
        return sc.start() if wait else sc

    yield start
    for sc in reversed(made):
        sc.cleanup()
    leaked = [f for sc in made for f in sc.arena_files()] + [sc.socket for sc in made if sc.socket.exists()]
    assert not leaked, f"left behind: {leaked}"


@pytest.fixture(scope="session")
def rel():
    """The helpers above, for test modules (importlib mode cannot import conftest)."""
    from types import SimpleNamespace

    return SimpleNamespace(write_table=write_table, proc_status=proc_status, reset_peak_rss=reset_peak_rss,
                           mappers_of=mappers_of, my_shm_segments=my_shm_segments, SlowPeers=SlowPeers,
                           sockets_of=sockets_of, timed=timed, Planner=Planner, rows_served=rows_served,
                           HTTP_REQUEST=HTTP_REQUEST,
                           HTTP2_PREFACE=HTTP2_PREFACE)
