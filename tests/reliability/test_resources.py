"""Area 4: a full disk during ingest fails cleanly with the old version serving;
a DRAM budget that /dev/shm cannot hold is refused at start with a clear message."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tierstore.store.catalog import Catalog
from tierstore.client.client import Client
from tierstore.tiers.dram import HEADER_BYTES
from tierstore.tiers.nvme.reader import SegmentReader


@pytest.fixture
def small_fs(tmp_path):
    """An 8 MiB filesystem: a tmpfs mounted for the test when we are root, else None."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0:
        yield None
        return
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        yield None
        return
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_ingest_into_a_full_filesystem_keeps_the_old_version(tmp_path, small_fs, sidecars, rel, tierstore_full_disk):
    data = (small_fs or tmp_path) / "data"
    old = rel.write_table(data, "t", 8000, dim=32, seed=1)  # 1 MB
    big = np.random.default_rng(2).standard_normal((100_000, 32)).astype(np.float32)  # 12.8 MB
    np.save(tmp_path / "big.npy", big)
    out = tierstore_full_disk(None if small_fs else 6 << 20, "ingest", tmp_path / "big.npy", "--data", data,
                              "--table", "t", "--quiet", cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    assert "disk full while writing table 't'" in out.stderr and "current version is unchanged" in out.stderr
    assert "Traceback" not in out.stderr
    with Catalog(data, readonly=True) as cat:
        tv = cat.current("t")
        assert tv.number == 1
        with SegmentReader(data, tv, cat.checksums("t", 1)) as r:
            assert r.verify() == []
    assert list((data / "tmp").iterdir()) == []
    sc = sidecars(data, "64MiB")
    with Client(sc.socket) as c:
        assert np.array_equal(c.lookup("t", np.arange(8000)), old)


def test_dram_budget_over_dev_shm_is_refused_at_start(tmp_path, sidecars, rel):
    data = tmp_path / "data"
    rel.write_table(data, "t", 1000, dim=32)
    sc = sidecars(data, "64TiB", wait=False)
    with pytest.raises(RuntimeError, match="exited with code") as e:
        sc.start()
    assert sc.proc.returncode != 0
    assert "--dram-budget 67108864 MiB is more than /dev/shm can hold" in str(e.value)
    assert "lower the budget or enlarge /dev/shm" in str(e.value)
    assert not sc.arena_files() and not sc.socket.exists()


def test_budget_over_a_small_shm_dir_is_refused_and_one_that_fits_serves(tmp_path, small_fs, sidecars, rel):
    if small_fs is None:
        pytest.skip("needs root to mount an 8 MiB tmpfs")
    data = tmp_path / "data"
    expected = rel.write_table(data, "t", 20_000, dim=32)  # 2.56 MB
    env = {"TIERSTORE_SHM_DIR": str(small_fs)}
    sc = sidecars(data, "16MiB", env=env, wait=False)
    with pytest.raises(RuntimeError, match=f"more than {small_fs} can hold"):
        sc.start()
    sc = sidecars(data, "6MiB", env=env)
    segs = [p for p in Path(small_fs).iterdir() if not p.name.endswith(".leases")]
    assert len(segs) == 1 and segs[0].stat().st_size == HEADER_BYTES + expected.nbytes
    with Client(sc.socket) as c:
        ids = np.arange(0, 20_000, 7)
        assert np.array_equal(c.lookup("t", ids), expected[ids])
    sc.stop()
    assert list(Path(small_fs).iterdir()) == []
