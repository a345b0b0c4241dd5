"""Shared fixtures. Keep this small: fixtures used by one test file live there; these are
used in more than one folder (a test moves with the code it tests, its fixtures stay here)."""
from __future__ import annotations

import shutil
import socket as socketlib
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import numpy as np
import pytest


@pytest.fixture
def data_dir(tmp_path):
    """An empty tierstore data directory, removed with tmp_path."""
    return tmp_path / "data"


@pytest.fixture
def make_table(data_dir):
    """make_table(name, rows, row_bytes=..., seed=0, **write_version kwargs) -> (TableVersion, rows uint8).

    Writes random uint8 rows as an fp32 table (row_bytes must be a multiple of 4)
    and returns its manifest and the exact bytes written.
    """
    from tierstore.ingest.writer import write_version

    def make(name="t", rows=1000, row_bytes=64, seed=0, chunk=333, **kw):
        data = np.random.default_rng(seed).integers(0, 256, size=(rows, row_bytes), dtype=np.uint8)
        tv = write_version(data_dir, name, (data[i:i + chunk] for i in range(0, rows, chunk)), rows=rows,
                           row_format="fp32", row_dim=row_bytes // 4, **kw)
        return tv, data

    return make


@pytest.fixture
def tmpfs(tmp_path):
    """tmpfs(huge) -> a fresh tmpfs of 256 MiB mounted with huge=`huge` (never, always,
    within_size, advise), unmounted afterwards; skipped without root, as `mount` needs it."""
    import os

    if os.geteuid() != 0:
        pytest.skip("mounting a filesystem needs root")
    mounted = []

    def mount(huge: str):
        point = tmp_path / f"shm-{huge}"
        point.mkdir(mode=0o700)
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size=256m,mode=0700,huge={huge}", "tmpfs", str(point)],
                              capture_output=True, text=True)
        if proc.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


@pytest.fixture
def cache_engines(make_table, data_dir):
    """cache_engines(rows, slots, reader=SegmentReader) -> (a fresh cache-mode engine of `slots`
    slots over table t of `rows` x 64 B, those rows): in process over a real table, arena and
    reader. The table is written on the first call; every engine's arena and reader are closed
    after the test."""
    import time

    from tierstore.cache.leases import LeaseTable
    from tierstore.engine import make_engine
    from tierstore.store.catalog import Catalog
    from tierstore.tiers.dram import Arena
    from tierstore.tiers.nvme.reader import SegmentReader

    made, table = [], {}

    def make(rows: int, slots: int, reader=SegmentReader):
        if not table:
            tv, data = make_table("t", rows=rows, row_bytes=64)
            with Catalog(data_dir, readonly=True) as cat:
                table.update(tv=tv, data=data, sums=cat.checksums("t", tv.number))
        tv = table["tv"]
        cold = reader(data_dir, tv, table["sums"])
        arena = Arena(Path("/dev/shm") / f"tierstore-test-engine.{time.monotonic_ns()}", slots, tv.row_bytes)
        made.append((arena, cold))
        return make_engine(tv, cold, arena, leases=LeaseTable(64), full=False), table["data"]

    yield make
    for arena, cold in made:
        arena.close(unlink=True)
        cold.close()


@pytest.fixture
def cli(capsys):
    """cli(*argv) -> (exit code, stdout, stderr) of the `tierstore` command, run in-process."""
    from tierstore.cli import main

    def run(*argv):
        code = main([str(a) for a in argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


# the child sets its own file-size limit (write() then fails with EFBIG, as on a full disk) and
# runs `python -m tierstore`
_FULL_DISK = """import resource, runpy, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
sys.argv = ["tierstore", *sys.argv[2:]]
runpy.run_module("tierstore", run_name="__main__", alter_sys=True)
"""


@pytest.fixture
def tierstore_full_disk():
    """run(limit, *args, **kw): `python -m tierstore ARGS` whose files may not grow past `limit`
    bytes (None: no limit), as subprocess.run (output captured as text, 120 s timeout unless
    kw says otherwise). The limit is set by the child interpreter on itself, never by a
    preexec_fn: that forks this process, and once a test before has made a gRPC channel, gRPC's
    at-fork handler can block the fork forever (a whole `make test` hung in one such test)."""
    def run(limit, *args, **kw):
        kw = {"capture_output": True, "text": True, "timeout": 120, **kw}
        argv = ["-m", "tierstore"] if limit is None else ["-c", _FULL_DISK, str(int(limit))]
        return subprocess.run([sys.executable, *argv, *map(str, args)], **kw)
    return run


@pytest.fixture
def numpy_path(monkeypatch):
    """numpy_path(module, *kernels): those tierstore.jit.Kernel globals of `module` act
    as if numba were missing, so the code under test takes its numpy reference path."""
    from tierstore import jit

    if not jit.enabled():
        pytest.skip("numba is not installed: only the numpy path exists")

    class Off:
        def compiled(self):
            return None

    def off(module, *names):
        for name in names:
            monkeypatch.setattr(module, name, Off())
    return off


@pytest.fixture
def free_port():
    """free_port() -> a TCP port on 127.0.0.1 nobody listens on now."""
    def pick() -> int:
        with socketlib.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    return pick


@pytest.fixture
def metric():
    """metric(port, name, tier) -> the value of counter `name` (its _total line) for `tier`."""
    def read(port, name, tier) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        line = next(ln for ln in text.splitlines() if ln.startswith(f"{name}_total{{") and f'tier="{tier}"' in ln)
        return float(line.rsplit(" ", 1)[1])
    return read


@pytest.fixture
def sock_dir():
    """A fresh directory for unix sockets, removed at teardown."""
    d = Path(tempfile.mkdtemp(prefix="tsfp-", dir="/tmp"))  # unix socket paths must stay under 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def serve(sock_dir):
    """serve(handler=None, path=None, **kw) -> (StepServer, handler): a step socket in this process,
    served by bench/step_socket.py's ModuloHandler unless `handler` is given; stopped at teardown."""
    from tierstore.bench.step_socket import ModuloHandler
    from tierstore.sidecar.step_server import StepServer

    started = []

    def start(handler=None, path=None, **kw):
        handler = handler or ModuloHandler()
        srv = StepServer(path or sock_dir / "s.sock.steps", handler, **{"max_clients": 8, **kw})
        srv.start()
        started.append(srv)
        return srv, handler

    yield start
    for srv in started:
        srv.stop()


LEASE_ROWS, LEASE_DIM = 200_000, 32


@pytest.fixture(scope="session")
def lease_table(tmp_path_factory):
    """(data dir, rows uint8): table "t" of LEASE_ROWS fp32 rows of LEASE_DIM, for the lease tests."""
    from tierstore.ingest.writer import write_version

    d = tmp_path_factory.mktemp("data")
    data = np.random.default_rng(3).integers(0, 256, size=(LEASE_ROWS, LEASE_DIM * 4), dtype=np.uint8)
    write_version(d, "t", [data], rows=LEASE_ROWS, row_format="fp32", row_dim=LEASE_DIM)
    return d, data


@pytest.fixture(scope="module")
def lease_sidecar(lease_table):
    """(SidecarProcess, rows) serving lease_table in cache mode with short leases."""
    from tierstore.sidecar.launcher import SidecarProcess

    d, data = lease_table
    # 1 MiB of 128-B rows = 8,192 slots; leases live one second
    with SidecarProcess(d, dram_budget="1MiB", extra_args=["--lease-ttl", "1"]) as sc:
        yield sc, data


@pytest.fixture
def lease_traffic():
    """lease_traffic(client, steps, n, seed): another client's steps of n distinct random rows of
    lease_table, each planned and released, so they reuse the arena's slots."""
    def traffic(c, steps: int, n: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(steps):
            with c.plan("t", rng.choice(LEASE_ROWS, n, replace=False)) as s:
                s.slots()
    return traffic
