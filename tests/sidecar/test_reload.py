"""Live version swap: `tierstore reload` while clients run steps."""
from __future__ import annotations

import time

import numpy as np
import pytest

from tierstore.client.client import Client
from tierstore.ingest.writer import write_version
from tierstore.sidecar.launcher import SidecarProcess

ROWS, DIM = 20_000, 16


def _write(d, seed: int) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, size=(ROWS, DIM * 4), dtype=np.uint8)
    write_version(d, "t", [data], rows=ROWS, row_format="fp32", row_dim=DIM)
    return data


def _wait_gone(sc: SidecarProcess, needle: str, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(needle in f.name for f in sc.arena_files()):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("budget", ["64MiB", "256KiB"], ids=["full", "cache"])
def test_reload_swaps_versions_between_steps_and_frees_the_old_arena(tmp_path, budget, cli):
    d = tmp_path / "data"
    v1 = _write(d, 1)
    ids = np.random.default_rng(0).integers(0, ROWS, 1500)
    with SidecarProcess(d, dram_budget=budget) as sc, Client(sc.socket) as c:
        assert np.array_equal(c.lookup("t", ids), v1[ids])
        running = c.plan("t", ids)          # a step planned before the swap...
        running.slots()
        v2 = _write(d, 2)                   # ingest while serving: the catalog moves on, the sidecar does not
        assert np.array_equal(c.lookup("t", ids), v1[ids])
        code, out, _ = cli("reload", "--socket", sc.socket)
        assert code == 0 and "t: v1 -> v2" in out
        assert np.array_equal(c.lookup("t", ids), v2[ids])      # the same Client switched
        assert np.array_equal(running.rows(), v1[ids])           # ...finishes on its version
        running.release()
        assert _wait_gone(sc, ".t.v1"), "the old version's arena was not freed after its last lease"
        # roll back, then forward again
        assert c.reload("t", 1) == [("t", 2, 1)]
        assert np.array_equal(c.lookup("t", ids), v1[ids])
        assert c.reload() == [("t", 1, 2)]
        assert np.array_equal(c.lookup("t", ids), v2[ids])
        assert c.reload() == []


def test_gc_keeps_what_a_sidecar_serves(tmp_path, cli):
    d = tmp_path / "data"
    v1 = _write(d, 1)
    for seed in (2, 3):
        _write(d, seed)
    with SidecarProcess(d, dram_budget="64MiB") as sc, Client(sc.socket) as c:
        assert c.reload("t", 1) == [("t", 3, 1)]   # serving v1 while v3 is current
        code, out, _ = cli("gc", "--data", d, "--keep", "0")
        assert code == 0 and "kept t v1" in out and "removed t v2" in out
        assert np.array_equal(c.lookup("t", np.arange(10)), v1[:10])
    code, out, _ = cli("gc", "--data", d, "--keep", "0")
    assert "removed t v1" in out
    code, out, _ = cli("tables", "--data", d, "--json")
    assert '"versions": [\n      3\n    ]' in out


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_restart_on_a_new_version_reaches_running_full_resident_clients(tmp_path, how):
    """11.2: full-resident clients make no RPC; after a restart on a new version their
    next step reads the new arena, never the old one (retired by the stop, or found
    stale by the successor after a kill)."""
    d = tmp_path / "data"
    v1 = _write(d, 1)
    sock = tmp_path / "s.sock"
    ids = np.arange(0, ROWS, 7)
    sc = SidecarProcess(d, socket=sock, dram_budget="64MiB").start()
    try:
        with Client(sock) as c:
            assert np.array_equal(c.lookup("t", ids), v1[ids])
            old = c.handle("t")._arena_path
            v2 = _write(d, 2)
            sc.stop() if how == "stop" else sc.kill()
            sc2 = SidecarProcess(d, socket=sock, dram_budget="64MiB").start()
            try:
                assert np.array_equal(c.lookup("t", ids), v2[ids])
                assert c.handle("t")._arena_path != old
                assert not any(f.name == old.rsplit("/", 1)[-1] for f in sc2.arena_files())
            finally:
                sc2.cleanup()
    finally:
        sc.cleanup()
