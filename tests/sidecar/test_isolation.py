"""Sidecars never share or borrow each other's arenas."""
from __future__ import annotations

import os
import socket as socketlib
import subprocess
import sys
import time

import numpy as np
import pytest

from tierstore import errors
from tierstore.client.client import Client
from tierstore.ingest.writer import write_version
from tierstore.sidecar.launcher import SidecarProcess


def _table(d, seed: int) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, size=(5000, 64), dtype=np.uint8)
    write_version(d, "t", [data], rows=5000, row_format="fp32", row_dim=16)
    return data


def _serve(cwd, data: str, sock: str, *extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tierstore", "serve", "--data", data, "--socket", sock,
                             "--dram-budget", "16MiB", *extra], cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)


def _wait(path, proc, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            try:
                with Client(path, timeout=2) as c:
                    c.tables()
                return
            except errors.Unavailable:
                pass
        assert proc.poll() is None, "sidecar exited"
        time.sleep(0.05)
    raise TimeoutError(path)


def test_two_sidecars_with_the_same_socket_name_in_different_dirs_keep_their_own_rows(tmp_path):
    """16.1: `--socket ts.sock` typed in projA/ and projB/, same table name and version."""
    rows = {}
    procs = []
    try:
        for name, seed in (("projA", 1), ("projB", 2)):
            proj = tmp_path / name
            proj.mkdir()
            rows[name] = _table(proj / "data", seed)
            procs.append(_serve(proj, "data", "ts.sock"))
            _wait(proj / "ts.sock", procs[-1])
        ids = np.arange(0, 5000, 3)
        for name in rows:
            with Client(tmp_path / name / "ts.sock") as c:
                assert np.array_equal(c.lookup("t", ids), rows[name][ids])
        procs[1].terminate()
        procs[1].wait(15)
        with Client(tmp_path / "projA" / "ts.sock") as c:  # B's stop takes nothing of A's
            assert np.array_equal(c.lookup("t", ids), rows["projA"][ids])
    finally:
        for p in procs:
            p.terminate()
            p.wait(15)


def test_a_tcp_client_never_maps_an_arena_on_its_own_host(tmp_path):
    """16.2: a remote client reads rows inline, even when a local sidecar serves a table
    of the same name and version; it cannot plan (plans lease slots of an arena only the
    sidecar's host can read)."""
    local_rows, remote_rows = _table(tmp_path / "local", 1), _table(tmp_path / "remote", 2)
    with socketlib.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with SidecarProcess(tmp_path / "local", dram_budget="16MiB") as near, \
            SidecarProcess(tmp_path / "remote", dram_budget="16MiB",
                           extra_args=["--listen", f"127.0.0.1:{port}", "--allow-tcp"],
                           env={"TIERSTORE_AUTH_TOKEN": "s3cret"}) as far:
        ids = np.arange(100)
        with Client(near.socket) as c:
            assert np.array_equal(c.lookup("t", ids), local_rows[ids])
        with Client(target=f"127.0.0.1:{port}", token="s3cret") as c:
            assert np.array_equal(c.lookup("t", ids), remote_rows[ids])
            with pytest.raises(errors.InvalidArgument, match="only a process on its host.*lookup"):
                c.plan("t", ids)  # a plan leases arena slots: refused, never read from the near arena
            assert c.release([1, 2]) == 0
        assert far.proc.poll() is None
