"""Signals while `tierstore serve` starts: start-up is a transaction for shared memory.

Each trial runs a real sidecar over two tables with its own shm directory (--shm-dir, a
fresh directory in /dev/shm: "nothing left" is "the directory is empty"), stops it at a
named point of its start-up (TIERSTORE_STARTUP_PAUSE, tierstore/sidecar/startup.py) or
as its first slot index appears (inside a cache-mode engine's constructor: its kernels
load there), and signals it there, once or in a burst of SIGTERM and SIGINT. It must
exit as for the first signal (128 + signum, no traceback), its socket gone and its shm
directory empty. A slot index is hundreds of MB at the real size, an arena the budget.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tierstore.sidecar.startup import PAUSE_ENV

pytestmark = pytest.mark.reliability

TABLES = {"a": 20_000, "b": 40_000}  # x 128 B: 2.4 + 4.9 MiB
CACHE, CACHE_SMALL, FULL = "4MiB", "2MiB", "64MiB"  # both tables cache mode / both held whole
BURST_S = 0.3
START_S = 60.0


@pytest.fixture(scope="module")
def data(tmp_path_factory, rel):
    d = tmp_path_factory.mktemp("startup") / "data"
    for i, (name, rows) in enumerate(TABLES.items()):
        rel.write_table(d, name, rows, dim=32, fmt="fp32", seed=i)
    return d


@pytest.fixture
def shm_dir():
    d = Path(tempfile.mkdtemp(prefix="tierstore-startup-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _serve(data: Path, shm_dir: Path, tmp_path: Path, budget: str, pause: str | None):
    env = {k: v for k, v in os.environ.items() if k != PAUSE_ENV}
    if pause:
        env[PAUSE_ENV] = pause
    err = open(tmp_path / "stderr", "w+b")
    sock = tmp_path / "s.sock"
    proc = subprocess.Popen([sys.executable, "-m", "tierstore", "serve", "--data", str(data), "--socket", str(sock),
                             "--dram-budget", budget, "--shm-dir", str(shm_dir)],
                            stdout=subprocess.PIPE, stderr=err, env=env, cwd="/")
    return proc, err, sock


def _wait_until(proc, cond, what: str) -> None:
    deadline = time.monotonic() + START_S
    while not cond():
        assert proc.poll() is None, f"the sidecar exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} after {START_S}s"
        time.sleep(0.001)


def _signal(proc, burst: bool) -> set[int]:
    """SIGTERM, then (burst) SIGINT and SIGTERM in turn for BURST_S or until it exits; the
    exit statuses it may end with (128 + the first signal its handler takes: of two pending
    at once, Python takes the lower number first)."""
    proc.send_signal(signal.SIGTERM)
    end, sigs = time.monotonic() + BURST_S, [signal.SIGINT, signal.SIGTERM]
    while burst and time.monotonic() < end and proc.poll() is None:
        proc.send_signal(sigs[0])
        sigs.reverse()
        time.sleep(0.0005)
    return {128 + signal.SIGTERM, 128 + signal.SIGINT} if burst else {128 + signal.SIGTERM}


def _trial(data, shm_dir, tmp_path, budget, burst, pause=None, when=None):
    proc, err, sock = _serve(data, shm_dir, tmp_path, budget, pause)
    try:
        if pause:
            _wait_until(proc, lambda: b"start-up paused at " + pause.encode() in (tmp_path / "stderr").read_bytes(),
                        f"pause at {pause}")
        else:
            _wait_until(proc, when, "the moment to signal")
        statuses = _signal(proc, burst)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        err.seek(0)
        stderr = err.read().decode(errors="replace")
        err.close()
    left = sorted(p.name for p in shm_dir.iterdir())
    assert left == [], f"left in {shm_dir}: {left}\n{stderr[-3000:]}"
    assert "Traceback" not in stderr, stderr[-3000:]
    assert proc.returncode in statuses, f"exit {proc.returncode}\n{stderr[-3000:]}"
    assert b"serving" not in out and not sock.exists()


# every point once, bursts where the cleanup has most to do; each budget in turn
TRIALS = [("leases", FULL, False), ("arena", CACHE, False), ("loaded", FULL, False), ("published", CACHE_SMALL, False),
          ("tables", CACHE, False), ("bound", FULL, False), ("started", CACHE, False),
          ("arena", FULL, True), ("loaded", FULL, True), ("tables", CACHE_SMALL, True), ("started", FULL, True)]


@pytest.mark.parametrize("point,budget,burst", TRIALS,
                         ids=[f"{p}-{b}-{'burst' if x else 'single'}" for p, b, x in TRIALS])
def test_a_signal_at_a_point_of_start_up_leaves_nothing(data, shm_dir, tmp_path, point, budget, burst):
    """A signal (or a burst: a later signal must not cut the cleanup short) at a named point."""
    _trial(data, shm_dir, tmp_path, budget, burst, pause=point)


@pytest.mark.parametrize("burst", [False, True], ids=["single", "burst"])
def test_a_signal_while_a_cache_engine_is_built_leaves_no_slot_index(data, shm_dir, tmp_path, burst):
    """The slot index is made first in a cache-mode engine's constructor, which then loads the
    miss path's kernels: a signal there left the index behind (the engine never existed, so
    nothing closed it)."""
    _trial(data, shm_dir, tmp_path, CACHE, burst,
           when=lambda: any(p.name.endswith(".index") for p in shm_dir.iterdir()))
