"""Warm restarts (tierstore/sidecar/warm_start.py): a restarted cache-mode sidecar
promotes the hot set its predecessor recorded, in the background, while serving."""
from __future__ import annotations

import pytest

import shutil
import stat
import time

import numpy as np

from tierstore.client.client import Client
from tierstore.ingest.writer import write_version
from tierstore.sidecar.launcher import SidecarProcess
from tierstore.store.hot_set import hot_set_path

ROWS, ROW_BYTES, BUDGET = 50_000, 64, "1MiB"  # 16,384 slots
HOT = np.random.default_rng(7).choice(ROWS, 12_000, replace=False)


def _table(d, seed=0, table="t"):
    data = np.random.default_rng(seed).integers(0, 256, size=(ROWS, ROW_BYTES), dtype=np.uint8)
    write_version(d, table, [data], rows=ROWS, row_format="fp32", row_dim=ROW_BYTES // 4)
    return data


def _stats(c: Client, table="t") -> dict:
    return next(t for t in c.stats()["tables"] if t["table"] == table)


def _wait_warmed(c: Client, n: int, table="t", timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = int(_stats(c, table).get("warmed", 0))
        if got >= n:
            return got
        time.sleep(0.02)
    return got


def _serve_hot(d, *tables) -> None:
    """Serve, read HOT of t (and `tables`) three times in planned steps, stop: the hot sets
    are recorded at stop."""
    with SidecarProcess(d, dram_budget=f"{1 + len(tables)}MiB") as sc, Client(sc.socket) as c:
        for _ in range(3):
            for part in np.array_split(HOT, 4):
                for t in ("t", *tables):
                    with c.plan(t, part) as step:
                        step.rows()


def test_after_a_restart_the_first_steps_hit(tmp_path):
    d = tmp_path / "data"
    data = _table(d)
    _serve_hot(d)
    path = hot_set_path(d, "t", 1)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with SidecarProcess(d, dram_budget=BUDGET) as sc, Client(sc.socket) as c:
        assert _wait_warmed(c, HOT.size) == HOT.size
        with c.plan("t", HOT[:4000]) as step:
            assert np.array_equal(step.rows(), data[HOT[:4000]])
            assert step.hits == 4000 and step.misses == 0
        assert "warm start from its recorded hot set" in sc.log()
    with SidecarProcess(d, dram_budget=BUDGET, extra_args=["--no-warm-start"]) as sc, Client(sc.socket) as c:
        with c.plan("t", HOT[:4000]) as step:  # the same step, started cold
            step.rows()
            assert step.hits == 0
        assert int(_stats(c).get("warmed", 0)) == 0


def test_a_killed_sidecar_leaves_its_last_periodic_hot_set(tmp_path):
    d = tmp_path / "data"
    data = _table(d)
    path = hot_set_path(d, "t", 1)
    with SidecarProcess(d, dram_budget=BUDGET, extra_args=["--hot-set-interval", "0.2"]) as sc, \
            Client(sc.socket) as c:
        for part in np.array_split(HOT, 4):
            with c.plan("t", part) as step:
                step.rows()
        deadline = time.monotonic() + 10
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # a recording after the steps above
        sc.kill()  # no recording at stop
    assert path.exists()
    with SidecarProcess(d, dram_budget=BUDGET) as sc, Client(sc.socket) as c:
        assert _wait_warmed(c, HOT.size) == HOT.size
        with c.plan("t", HOT[-2000:]) as step:
            assert np.array_equal(step.rows(), data[HOT[-2000:]]) and step.hits == 2000


def test_a_hot_set_of_another_version_or_table_is_ignored_with_one_line(tmp_path):
    d = tmp_path / "data"
    _table(d)
    _serve_hot(d)
    v2 = _table(d, seed=1)  # a new version of t is current now; its rows differ
    _table(d, seed=2, table="u")
    shutil.copy(hot_set_path(d, "t", 1), hot_set_path(d, "t", 2))
    shutil.copy(hot_set_path(d, "t", 1), hot_set_path(d, "u", 1))
    with SidecarProcess(d, dram_budget="2MiB") as sc, Client(sc.socket) as c:
        with c.plan("t", HOT[:3000]) as step:
            assert np.array_equal(step.rows(), v2[HOT[:3000]])
        log = sc.log()
        assert log.count("ignoring a hot set") == 2 and "recorded for table 't' v1" in log
        assert int(_stats(c, "t").get("warmed", 0)) == 0 and int(_stats(c, "u").get("warmed", 0)) == 0


def test_a_damaged_hot_set_is_ignored_with_a_warning_and_rows_stay_exact(tmp_path):
    d = tmp_path / "data"
    data = {"t": _table(d), "u": _table(d, seed=1, table="u")}
    _serve_hot(d, "u")
    torn, flipped = (bytearray(hot_set_path(d, t, 1).read_bytes()) for t in ("t", "u"))
    del torn[len(torn) // 2:]
    flipped[len(flipped) // 3] ^= 0x10  # an id's bits
    hot_set_path(d, "t", 1).write_bytes(bytes(torn))
    hot_set_path(d, "u", 1).write_bytes(bytes(flipped))
    with SidecarProcess(d, dram_budget="2MiB") as sc, Client(sc.socket) as c:
        for t in ("t", "u"):
            with c.plan(t, HOT[:3000]) as step:
                assert np.array_equal(step.rows(), data[t][HOT[:3000]])
            assert int(_stats(c, t).get("warmed", 0)) == 0
        log = sc.log()
        assert log.count("ignoring a damaged hot set") == 2 and "WARNING" in log


@pytest.mark.slow
def test_a_plan_does_not_wait_for_the_warm_up(tmp_path):
    rows, row_bytes = 600_000, 64
    d = tmp_path / "data"
    data = np.random.default_rng(0).integers(0, 256, size=(rows, row_bytes), dtype=np.uint8)
    write_version(d, "t", [data], rows=rows, row_format="fp32", row_dim=row_bytes // 4)
    with SidecarProcess(d, dram_budget="24MiB") as sc, Client(sc.socket) as c:  # 393,216 slots
        cap = int(_stats(c)["capacity"])
        for part in np.array_split(np.arange(cap), 12):
            with c.plan("t", part) as step:
                step.rows()
    with SidecarProcess(d, dram_budget="24MiB") as sc, Client(sc.socket) as c:
        ids = np.arange(rows - 256, rows)  # rows the warm-up does not bring
        t0 = time.monotonic()
        with c.plan("t", ids) as step:
            assert np.array_equal(step.rows(), data[ids])
        took = time.monotonic() - t0
        warmed_then = int(_stats(c).get("warmed", 0))
        assert _wait_warmed(c, cap - 256, timeout=60) >= cap - 256
        assert warmed_then < cap - 256, "the warm-up was over before the first plan returned"
        assert took < 1.0


def test_serve_profile_is_a_warm_start_seed_too(tmp_path):
    from tierstore.table.profile import Profile
    from tierstore.table.spec import preset

    d = tmp_path / "data"
    data = _table(d)
    counts = np.arange(HOT.size, 0, -1, dtype=np.int64)  # HOT[0] hottest
    prof = Profile(preset("engram-paper-demo", 512), ids={"t": HOT}, counts={"t": counts}, tokens=1)
    path = prof.save(tmp_path / "hot.npz")
    with SidecarProcess(d, dram_budget=BUDGET, extra_args=["--profile", path]) as sc, Client(sc.socket) as c:
        assert _wait_warmed(c, HOT.size) == HOT.size
        with c.plan("t", HOT[-3000:]) as step:
            assert np.array_equal(step.rows(), data[HOT[-3000:]]) and step.hits == 3000
        assert "warm start from --profile" in sc.log()


def test_no_record_hot_sets_leaves_the_recorded_hot_set_as_it_was(tmp_path):
    """`serve --no-record-hot-sets` (a benchmark's sidecar over a user's data): other rows read,
    with a short interval and a clean stop, and the hot set the serving sidecar recorded is
    byte for byte what it was; the next plain start still warms from it."""
    d = tmp_path / "data"
    _table(d)
    _serve_hot(d)
    path = hot_set_path(d, "t", 1)
    before = path.read_bytes()
    other = np.setdiff1d(np.arange(ROWS), HOT)[:12_000]
    with SidecarProcess(d, dram_budget=BUDGET, extra_args=["--no-warm-start", "--no-record-hot-sets",
                                                           "--hot-set-interval", "0.1"]) as sc, \
            Client(sc.socket) as c:
        for _ in range(3):
            for part in np.array_split(other, 4):
                with c.plan("t", part) as step:
                    step.rows()
        time.sleep(0.5)  # past a few intervals
    assert path.read_bytes() == before
    with SidecarProcess(d, dram_budget=BUDGET) as sc, Client(sc.socket) as c:
        assert _wait_warmed(c, HOT.size) == HOT.size
