"""A segment byte damaged on disk while a sidecar serves the table: no damaged row is
ever served (cache mode: the miss that reads it is DataLoss; full mode: the arena holds
the bytes checked at start), and `tierstore verify` finds the damaged block."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tierstore import errors
from tierstore.client.client import Client
from tierstore.sidecar.launcher import SidecarProcess
from tierstore.store.catalog import Catalog

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from segment_damage import flip_row_byte  # noqa: E402

pytestmark = pytest.mark.reliability
ROWS = 4000


@pytest.mark.parametrize("mode, budget", [("cache", "64KiB"), ("full", "16MiB")])
def test_a_row_damaged_while_serving_is_never_served_and_verify_finds_it(tmp_path, rel, mode, budget):
    d = tmp_path / "data"
    expected = rel.write_table(d, "t", ROWS, dim=16, seed=3)
    with Catalog(d, readonly=True) as cat:
        tv = cat.current("t")
    bad = ROWS - 7
    with SidecarProcess(d, dram_budget=budget) as sc, Client(sc.socket, timeout=10) as c:
        assert c.table_info("t")["full_resident"] == (mode == "full")
        assert np.array_equal(c.lookup("t", [0, 1, 2]), expected[[0, 1, 2]])
        flip_row_byte(d, tv, bad)
        if mode == "cache":
            with pytest.raises(errors.DataLoss, match=f"checksum mismatch in block {bad // tv.block_rows}"):
                c.lookup("t", [bad])
        else:
            assert np.array_equal(c.lookup("t", [bad]), expected[[bad]])
        ids = np.arange(0, ROWS - 2 * tv.block_rows, 97)
        assert np.array_equal(c.lookup("t", ids), expected[ids])
        assert sc.proc.poll() is None
    done = subprocess.run([sys.executable, "-m", "tierstore", "verify", "--data", str(d)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"block {bad // tv.block_rows}" in done.stdout + done.stderr
