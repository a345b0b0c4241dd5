"""Catalog.register_version: a version made elsewhere (a published manifest) recorded as is."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tierstore.store.catalog import Catalog
from tierstore.errors import InvalidArgument


def test_register_keeps_the_number_and_is_idempotent(make_table, data_dir, tmp_path):
    tv, _ = make_table("emb", rows=300, row_bytes=64)
    with Catalog(data_dir, readonly=True) as src:
        sums = src.checksums("emb", tv.number)
    other = tmp_path / "other"
    with Catalog(other) as cat:
        v7 = dataclasses.replace(tv, number=7)
        assert cat.register_version(v7, sums) is True
        assert cat.current("emb") == v7 and np.array_equal(cat.checksums("emb", 7), sums)
        assert cat.register_version(v7, sums) is False  # same rows: nothing recorded
        assert cat.register_version(dataclasses.replace(tv, number=3), sums, make_current=False) is True
        assert cat.current("emb").number == 7


def test_register_refuses_other_rows_under_a_taken_number(make_table, data_dir):
    tv, _ = make_table("emb", rows=300, row_bytes=64)
    with Catalog(data_dir) as cat:
        sums = cat.checksums("emb", tv.number)
        with pytest.raises(InvalidArgument, match="holds other rows"):
            cat.register_version(tv, sums + np.uint64(1))
        with pytest.raises(InvalidArgument, match="checksums"):
            cat.register_version(tv, sums[:-1])
        assert np.array_equal(cat.checksums("emb", tv.number), sums)
