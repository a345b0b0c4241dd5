"""Hot-set files (tierstore/store/hot_set.py): written whole or not at all, read back
exactly, refused when damaged or recorded for another table or version."""
from __future__ import annotations

import dataclasses
import stat

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tierstore.store.hot_set import HotSetCorrupt, HotSetMismatch, hot_set_path, load_hot_set, save_hot_set


@pytest.fixture
def version(make_table):
    tv, _ = make_table("t", rows=5000, row_bytes=16)
    return tv


def test_a_hot_set_reads_back_exactly_and_only_its_owner_can_read_it(version, data_dir):
    ids = np.random.default_rng(0).choice(version.rows, 700, replace=False)
    counts = np.random.default_rng(1).integers(0, 16, 700).astype(np.uint8)
    path = save_hot_set(data_dir, version, ids, counts)
    assert path == hot_set_path(data_dir, "t", version.number)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    hot = load_hot_set(data_dir, version)
    assert np.array_equal(hot.ids, ids) and np.array_equal(hot.counts, counts)
    assert list(path.parent.iterdir()) == [path]  # no temp file left behind


def test_no_file_is_no_hot_set(version, data_dir):
    assert load_hot_set(data_dir, version) is None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 10_000), bit=st.integers(0, 7), flip=st.booleans())
def test_a_torn_or_flipped_file_is_refused(version, data_dir, cut, bit, flip):
    path = save_hot_set(data_dir, version, np.arange(100), np.full(100, 3, np.uint8))
    blob = bytearray(path.read_bytes())
    at = cut % len(blob)
    if flip:
        blob[at] ^= 1 << bit
    else:
        del blob[at:]
    path.write_bytes(bytes(blob))
    with pytest.raises(HotSetCorrupt):
        load_hot_set(data_dir, version)


@pytest.mark.parametrize("change", [dict(number=2), dict(table="u"), dict(rows=4999), dict(created_at=1.0)])
def test_a_hot_set_of_another_table_or_version_is_refused(version, data_dir, change):
    other = dataclasses.replace(version, **change)
    save_hot_set(data_dir, other, np.arange(10), np.ones(10, np.uint8))
    hot_set_path(data_dir, other.table, other.number).rename(hot_set_path(data_dir, "t", version.number))
    with pytest.raises(HotSetMismatch):
        load_hot_set(data_dir, version)
