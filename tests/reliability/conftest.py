"""Fixtures of the reliability suite: real sidecars, real client processes, and
the bookkeeping that proves each test left no process, socket or shm segment."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tierstore.table.formats import encode_rows
from tierstore.ingest.writer import write_version
from tierstore.sidecar.launcher import SidecarProcess

WORKER = Path(__file__).with_name("_worker.py")


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
                           mappers_of=mappers_of, my_shm_segments=my_shm_segments)
