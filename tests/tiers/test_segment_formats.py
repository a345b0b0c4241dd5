"""Both segment formats served side by side by a real sidecar: format 2 (each record
carries its row sum, what writers write) and format 1 (rows alone, a row-sum file
beside them, as older versions were written): bit-exact rows in full and cache
mode, planned and read locally, DATA_LOSS for a damaged row, and the memory each
costs beyond the arena."""
from __future__ import annotations

import numpy as np
import pytest

from tierstore import errors
from tierstore.client.client import Client
from tierstore.ingest.writer import write_version
from tierstore.sidecar.launcher import SidecarProcess
from tierstore.store.catalog import Catalog

ROWS, WIDTH = 20_000, 64


def _write(d, seg: int) -> tuple[object, np.ndarray]:
    data = np.random.default_rng(seg).integers(0, 256, size=(ROWS, WIDTH), dtype=np.uint8)
    tv = write_version(d, "t", [data[:7001], data[7001:]], rows=ROWS, row_format="fp32", row_dim=WIDTH // 4,
                       segment_format=seg)
    return tv, data


def _stats(c: Client) -> dict:
    return next(t for t in c.stats()["tables"] if t["table"] == "t")


@pytest.mark.parametrize("seg", [2, 1], ids=["format2", "format1"])
def test_full_mode_serves_either_format_and_holds_only_block_checksums(tmp_path, seg):
    d = tmp_path / "data"
    tv, data = _write(d, seg)
    files = {p.name for p in (d / tv.segments[0]).parent.iterdir()}
    assert ("rowsums.u64" in files) == (seg == 1)
    with SidecarProcess(d, dram_budget="64MiB") as sc, Client(sc.socket) as c:
        assert c.table_info("t")["full_resident"]
        ids = np.random.default_rng(3).integers(0, ROWS, 3000)
        assert np.array_equal(c.lookup("t", ids), data[ids])
        assert np.array_equal(c.lookup("t", ids, inline=True), data[ids])
        # beyond the arena: block checksums (format 1's row sums are read from their file, not held)
        assert int(_stats(c)["metadata_bytes"]) == 8 * tv.n_blocks


@pytest.mark.parametrize("seg", [2, 1], ids=["format2", "format1"])
def test_cache_mode_serves_either_format_planned_and_read_locally(tmp_path, seg):
    d = tmp_path / "data"
    tv, data = _write(d, seg)
    with SidecarProcess(d, dram_budget="256KiB") as sc, Client(sc.socket) as c:
        assert not c.table_info("t")["full_resident"]
        rng = np.random.default_rng(4)
        for _ in range(4):
            ids = rng.integers(0, ROWS, 500)
            with c.plan("t", ids) as step:
                assert np.array_equal(step.rows(), data[ids])
            other = rng.integers(0, ROWS, 500)  # local reads: misses from the segments
            assert np.array_equal(c.lookup("t", other), data[other])
        local = c.handle("t").local_reads
        assert local is not None and local.rows_cold > 0
        reader = local._reader()
        assert reader.verifies_rows and reader.row_sums_error is None
        assert int(_stats(c)["bytes_read"]) > 0


@pytest.mark.parametrize("seg", [2, 1], ids=["format2", "format1"])
def test_a_damaged_record_is_data_loss_in_either_format(tmp_path, seg):
    d = tmp_path / "data"
    tv, data = _write(d, seg)
    bad = 12_345
    path = d / tv.segments[bad // tv.segment_rows]
    raw = bytearray(path.read_bytes())
    raw[(bad % tv.segment_rows) * tv.record_bytes + 9] ^= 0x04
    path.write_bytes(bytes(raw))
    with SidecarProcess(d, dram_budget="256KiB") as sc, Client(sc.socket) as c:
        pat = f"checksum mismatch in block {bad // tv.block_rows}"
        with pytest.raises(errors.DataLoss, match=pat):
            c.lookup("t", [bad], inline=True)
        with pytest.raises(errors.DataLoss, match=pat):
            c.lookup("t", [1, bad])
        assert np.array_equal(c.lookup("t", [1, bad + tv.block_rows]), data[[1, bad + tv.block_rows]])
    with Catalog(d, readonly=True) as cat:
        assert cat.current("t").segment_format == seg


@pytest.mark.parametrize("seg", [2, 1], ids=["format2", "format1"])
def test_a_full_arena_is_checked_against_block_checksums_of_either_format(tmp_path, seg):
    """A re-attached full arena is checked against the catalog's block checksums, which
    cover the bytes on disk (format 2: records): an intact arena has no bad block, a
    changed row names its block, and the online scrub repairs it from disk."""
    import time
    from pathlib import Path

    from tierstore.cache.leases import LeaseTable
    from tierstore.engine import make_engine
    from tierstore.tiers.dram import Arena
    from tierstore.tiers.nvme.reader import SegmentReader

    d = tmp_path / "data"
    tv, data = _write(d, seg)
    with Catalog(d, readonly=True) as cat:
        sums = cat.checksums("t", tv.number)
    arena = Arena(Path("/dev/shm") / f"tierstore-test-formats.{time.monotonic_ns()}", ROWS, WIDTH)
    cold = SegmentReader(d, tv, sums)
    try:
        eng = make_engine(tv, cold, arena, leases=LeaseTable(8), full=True)
        eng.load_full()
        assert np.array_equal(arena.rows, data) and eng.verify_arena(sums) == []
        arena.rows[5000, 3] ^= 1
        blk = 5000 // tv.block_rows
        assert eng.verify_arena(sums) == [blk]
        found = eng.repair.scrub_blocks(np.array([blk, blk + 1]))
        assert [(tier, b) for tier, b, *_ in found] == [("dram", blk)] and np.array_equal(arena.rows, data)
    finally:
        arena.close(unlink=True)
        cold.close()


@pytest.mark.parametrize("seg", [2, 1], ids=["format2", "format1"])
def test_verify_cli_checks_every_block_and_row_of_either_format(tmp_path, cli, seg):
    d = tmp_path / "data"
    tv, _ = _write(d, seg)
    code, out, _ = cli("verify", "--data", d)
    assert code == 0 and f"segment format {seg}" in out
    bad = 777
    path = d / tv.segments[0]
    raw = bytearray(path.read_bytes())
    raw[bad * tv.record_bytes + tv.record_bytes - 1] ^= 0x01  # format 2: the sum's last byte
    path.write_bytes(bytes(raw))
    code, _, err = cli("verify", "--data", d)
    blk = bad // tv.block_rows
    assert code == 1 and f"block {blk} is corrupt" in err and f"at byte {blk * tv.block_bytes}" in err
