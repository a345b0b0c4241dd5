"""A block's checksum record changed in the LMDB catalog while a sidecar serves the table
(cache mode: its misses read the records' row sums, never the catalog's block sums; full
mode: the arena was checked at start and the scrub holds the sums it loaded): every row
is served right, none refused, and `tierstore verify` exits 1 naming the catalog's
checksum of that block as the damage, not the rows. Damaged before a full-mode start
(a flipped bit, or the record cut short), the sidecar exits 1 with an error that names
the catalog, the table's version and the fix, not a corrupt block."""
from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from tierstore.client.client import Client
from tierstore.sidecar.launcher import SidecarProcess
from tierstore.store import catalog as catalog_mod
from tierstore.store.catalog import Catalog
from tierstore.store.lmdb_env import acquire_env, release_env

pytestmark = pytest.mark.reliability
ROWS = 4000


def _damage_checksum(data_dir, table: str, version: int, block: int, cut: bool = False) -> None:
    """Flip a bit of one block's checksum in the catalog (cut: keep only the record's first
    half instead), as another writer of it would."""
    env = acquire_env(data_dir / "catalog", create=False)  # this process's handle (a client may hold it)
    try:
        with env.begin(write=True) as txn:
            key = catalog_mod._vkey(catalog_mod._SUM, table, version)
            sums = np.frombuffer(txn.get(key), "<u8").copy()
            sums[block] ^= 1
            txn.put(key, sums[:sums.size // 2].tobytes() if cut else sums.tobytes())
    finally:
        release_env(env)


@pytest.mark.parametrize("mode, budget", [("cache", "64KiB"), ("full", "16MiB")])
def test_a_checksum_changed_in_the_catalog_while_serving_serves_every_row_and_verify_names_it(
        tmp_path, rel, mode, budget):
    d = tmp_path / "data"
    expected = rel.write_table(d, "t", ROWS, dim=16, seed=3)
    with Catalog(d, readonly=True) as cat:
        tv = cat.current("t")
    assert tv.segment_format == 2
    block = (ROWS - 7) // tv.block_rows
    rows = np.arange(block * tv.block_rows, min((block + 1) * tv.block_rows, ROWS))
    # every served row re-checked by the verifier (full mode: every block scrubbed each pass)
    with SidecarProcess(d, dram_budget=budget, extra_args=["--verify-sample", "1"]) as sc, \
            Client(sc.socket, timeout=10) as c:
        assert c.table_info("t")["full_resident"] == (mode == "full")
        assert np.array_equal(c.lookup("t", [0, 1, 2]), expected[[0, 1, 2]])
        _damage_checksum(d, "t", tv.number, block)
        deadline = time.monotonic() + 3.0  # several verifier passes
        while time.monotonic() < deadline:
            assert np.array_equal(c.lookup("t", rows), expected[rows])
            time.sleep(0.2)
        for a in range(0, ROWS, 500):  # the whole table, read again (cache mode: from disk)
            ids = np.arange(a, min(a + 500, ROWS))
            assert np.array_equal(c.lookup("t", ids), expected[ids])
        assert sc.proc.poll() is None
        assert "online verification" not in sc.log(), sc.log()  # no block marked bad, no row "repaired"
    done = subprocess.run([sys.executable, "-m", "tierstore", "verify", "--data", str(d)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"block {block}'s checksum in the catalog ({d}/catalog)" in done.stderr, done.stderr
    assert "the catalog is damaged, not the rows" in done.stderr and "Traceback" not in done.stderr
    assert "blocks corrupt" not in done.stderr, "the rows were blamed for the catalog's damage"


@pytest.mark.parametrize("damage", ["flipped", "cut"])
def test_a_full_mode_start_over_a_damaged_checksum_record_names_the_catalog_and_the_fix(tmp_path, rel, damage):
    d = tmp_path / "data"
    rel.write_table(d, "t", ROWS, dim=16, seed=3)
    with Catalog(d, readonly=True) as cat:
        tv = cat.current("t")
    block = (ROWS - 7) // tv.block_rows
    _damage_checksum(d, "t", tv.number, block, cut=damage == "cut")
    sc = SidecarProcess(d, dram_budget="16MiB")  # the whole table fits: full mode, every block checked at start
    try:
        with pytest.raises(RuntimeError, match="sidecar exited with code 1"):
            sc.start()
        log, catalog = sc.log(), sc.data_dir / "catalog"
        if damage == "flipped":
            assert f"tierstore serve: error: table 't' version {tv.number}: checksum mismatch in block {block} (" \
                in log, log
            assert f"the block's checksum in the catalog ({catalog}) is damaged, not the rows" in log, log
            assert f"`tierstore verify --data {sc.data_dir}`" in log, log
        else:
            assert f"tierstore serve: error: catalog record of table 't' version {tv.number} is inconsistent" \
                in log, log
        assert f"restore {catalog} from a backup, or re-ingest or import the table" in log, log
        assert "Traceback" not in log and not sc.arena_files() and not sc.socket.exists(), log
    finally:
        sc.cleanup()
