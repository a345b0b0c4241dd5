"""The compiled miss-path kernels (tiers/nvme/verified_copy.py) against the numpy reference:
same rows placed, same corrupt row named, same dedupe."""
from __future__ import annotations

import mmap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore import jit
from tierstore.tiers.nvme import verified_copy as fused

from tierstore.tiers.nvme import rowsum

pytestmark = pytest.mark.skipif(not fused.kernels(), reason="numba is not installed: only the numpy path runs")
KEY = rowsum.RowKey.of(0x0123456789ABCDEF)  # a version's salt (fmix64-v2)
KEYS = [rowsum.RowKey.of(None), KEY]  # and a version written before salts (fmix64-v1)


def _table(rows: int, row_bytes: int, seed: int = 0, key: rowsum.RowKey = KEY):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, row_bytes), dtype=np.uint8)
    return data, rowsum.row_sums(data, np.arange(rows), key)


@pytest.mark.parametrize("key", KEYS, ids=lambda k: k.algo)
@pytest.mark.parametrize("row_bytes", [8, 64, 256, 264, 100])
def test_placed_rows_are_the_source_rows_and_verify(row_bytes, key):
    data, sums = _table(3000, row_bytes, key=key)
    rng = np.random.default_rng(1)
    ids = np.sort(rng.choice(3000, 700, replace=False)).astype(np.int64)
    slots = rng.choice(5000, 700, replace=False).astype(np.int64)
    dest = np.zeros((5000, row_bytes), dtype=np.uint8)
    assert fused.place_verified(data, ids, ids, dest, slots, sums, key) == -1
    assert np.array_equal(dest[slots], data[ids])
    untouched = np.setdiff1d(np.arange(5000), slots)
    assert not dest[untouched].any()


@pytest.mark.parametrize("row_bytes", [64, 264])
def test_a_flipped_bit_names_its_row(row_bytes):
    data, sums = _table(2000, row_bytes)
    ids = np.arange(100, 600, dtype=np.int64)
    bad = data.copy()
    bad[345, row_bytes - 1] ^= 0x10
    dest = np.zeros((1000, row_bytes), dtype=np.uint8)
    assert fused.place_verified(bad, ids, ids, dest, np.arange(500), sums, KEY) == 345 - 100
    # the row's bytes under another id's sum (a misplaced row) fail too, and under another version's key
    assert fused.place_verified(data, ids, ids + 1, dest, np.arange(500), sums, KEY) == 0
    assert fused.place_verified(data, ids, ids, dest, np.arange(500), sums, rowsum.RowKey.of(1)) == 0


def test_rows_from_a_read_only_memory_map(tmp_path):
    data, sums = _table(4096, 256)
    path = tmp_path / "seg"
    path.write_bytes(data.tobytes())
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    view = np.frombuffer(mm, dtype=np.uint8).reshape(4096, 256)
    ids = np.array([0, 17, 4095, 2048], dtype=np.int64)
    dest = np.zeros((4, 256), dtype=np.uint8)
    assert fused.place_verified(view, ids, ids, dest, np.arange(4), sums, KEY) == -1
    assert np.array_equal(dest, data[ids])
    del view
    mm.close()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**40), max_size=300), st.booleans())
def test_dedupe_matches_numpy(values, repeat):
    ids = np.array(values * (3 if repeat else 1), dtype=np.int64)
    uniq, inv = jit.unique_inverse(ids)
    want_u, want_inv = np.unique(ids, return_inverse=True)
    assert np.array_equal(uniq, want_u)
    assert np.array_equal(inv, want_inv.reshape(-1))


# ---- segment format 2: records carrying their row sums (place_records) ----

@pytest.mark.parametrize("key", KEYS, ids=lambda k: k.algo)
@pytest.mark.parametrize("row_bytes", [8, 64, 256, 264, 6, 132])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
def test_records_place_their_rows_and_verify_against_the_sum_they_carry(row_bytes, compiled, key, monkeypatch):
    """Compiled and numpy paths agree: rows out of records bit-exact, nothing outside
    the slots written, the first record whose row or sum was damaged named, and a
    genuine record of another version (another salt) refused."""
    if not compiled:
        monkeypatch.setattr(fused, "_RECORDS", jit.Kernel(fused._records_loop))
        monkeypatch.setattr(fused._RECORDS, "_jit", None)
    data, _ = _table(3000, row_bytes)
    recs = rowsum.records(data, np.arange(3000), key)
    assert recs.shape == (3000, -(-row_bytes // 8) * 8 + 8) and not recs[:, row_bytes:-8].any()
    assert np.array_equal(recs[:, -8:].copy().view("<u8").reshape(-1), rowsum.row_sums(data, np.arange(3000), key))
    rng = np.random.default_rng(1)
    ids = np.sort(rng.choice(3000, 700, replace=False)).astype(np.int64)
    slots = rng.choice(5000, 700, replace=False).astype(np.int64)
    dest = np.zeros((5000, row_bytes), dtype=np.uint8)
    assert fused.place_records(recs, ids, ids, dest, slots, key) == -1
    assert np.array_equal(dest[slots], data[ids])
    assert not dest[np.setdiff1d(np.arange(5000), slots)].any()
    for byte in (0, row_bytes - 1, recs.shape[1] - 1):  # the row's first and last byte, the sum's last
        bad = recs.copy()
        bad[ids[345], byte] ^= 0x10
        assert fused.place_records(bad, ids, ids, dest, slots, key) == 345
    assert fused.place_records(recs, ids, ids + 1, dest, slots, key) == 0  # a misplaced record fails too
    other = rowsum.records(data, np.arange(3000), rowsum.RowKey.of(0xFEED))  # the same rows, another version
    assert fused.place_records(other, ids, ids, dest, slots, key) == 0


def test_records_from_a_read_only_memory_map(tmp_path):
    data, _ = _table(4096, 264)
    path = tmp_path / "seg"
    path.write_bytes(rowsum.records(data, np.arange(4096), KEY).tobytes())
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    view = np.frombuffer(mm, dtype=np.uint8).reshape(4096, 272)
    ids = np.array([0, 17, 4095, 2048], dtype=np.int64)
    dest = np.zeros((4, 264), dtype=np.uint8)
    assert fused.place_records(view, ids, ids, dest, np.arange(4), KEY) == -1
    assert np.array_equal(dest, data[ids])
    del view
    mm.close()


def test_sums_gathered_elsewhere_are_found_by_position():
    """place_verified's `at`: sums of the rows in hand (format 2's place_rows gathers them
    from the records on disk), each row still checked under its own id."""
    data, sums = _table(1000, 64)
    ids = np.array([900, 3, 512], dtype=np.int64)
    dest = np.zeros((3, 64), dtype=np.uint8)
    assert fused.place_verified(data, ids, ids, dest, np.arange(3), sums[ids], KEY, np.arange(3)) == -1
    assert np.array_equal(dest, data[ids])
    assert fused.place_verified(data, ids, ids, dest, np.arange(3), sums[ids][::-1].copy(), KEY, np.arange(3)) == 0
