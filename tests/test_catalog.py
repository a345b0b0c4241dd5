import fcntl
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tierstore import catalog as catalog_mod
from tierstore.catalog import Catalog, validate_table_name
from tierstore.errors import InvalidArgument, NotFound, TableNotFound, VersionNotFound
from tierstore.tiers.nvme import SegmentReader


def test_public_api():
    assert set(catalog_mod.__all__) == {"Catalog", "TableVersion", "has_tables", "validate_table_name"}


@pytest.mark.parametrize("name", ["l1", "l15", "A", "x" * 64, "t_1.v-2", "0abc"])
def test_good_table_names(name):
    assert validate_table_name(name) == name


@pytest.mark.parametrize("name", ["../x", "..", ".", ".hidden", "a/b", "", "x" * 65, "a\0b", "a b", "-x", "_x"])
def test_bad_table_names_are_rejected(name):
    with pytest.raises(InvalidArgument, match="invalid table name"):
        validate_table_name(name)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=70))
def test_accepted_names_are_single_safe_path_components(name):
    try:
        validate_table_name(name)
    except InvalidArgument:
        return
    assert "/" not in name and "\0" not in name and not name.startswith(".") and 1 <= len(name) <= 64


def test_versions_and_current_pointer(data_dir, make_table):
    tv1, _ = make_table("t", rows=100, seed=1)
    tv2, d2 = make_table("t", rows=120, seed=2)
    with Catalog(data_dir, readonly=True) as cat:
        assert cat.tables() == ["t"]
        assert (tv1.version, tv2.version) == (1, 2)
        assert cat.current("t") == tv2
        assert cat.get("t", 1) == tv1
        assert [v.version for v in cat.versions("t")] == [1, 2]
        sums = cat.checksums("t", 2)
        assert sums.dtype == np.uint64 and sums.shape == (tv2.n_blocks,)
        with pytest.raises(VersionNotFound, match=r"table 't' has no version 7; versions are \[1, 2\]"):
            cat.get("t", 7)
        with pytest.raises(TableNotFound, match=r"no table 'nope'.*tables are \['t'\]"):
            cat.current("nope")
        with pytest.raises(InvalidArgument):
            cat.current("../t")
    with Catalog(data_dir) as cat:
        cat.set_current("t", 1)
        assert cat.current("t").version == 1
        with SegmentReader(data_dir, cat.current("t"), cat.checksums("t", 1)) as r:
            assert r.rows == 100


def test_readonly_catalog_needs_an_existing_one(tmp_path):
    with pytest.raises(NotFound, match="no tierstore catalog"):
        Catalog(tmp_path / "missing", readonly=True)
    assert not (tmp_path / "missing").exists()


def test_readonly_sees_later_commits(data_dir, make_table):
    make_table("a", rows=10)
    with Catalog(data_dir, readonly=True) as ro:
        assert ro.tables() == ["a"]
        make_table("b", rows=10)
        assert ro.tables() == ["a", "b"]
        with pytest.raises(InvalidArgument, match="read-only"):
            ro.set_current("a", 1)


def test_another_process_reads_while_a_write_transaction_is_open(data_dir, make_table):
    make_table("t", rows=10)
    with Catalog(data_dir) as cat:
        txn = cat._env.begin(write=True)  # as an ingest does while it commits
        try:
            code = ("from tierstore.catalog import Catalog\n"
                    f"c = Catalog({str(data_dir)!r}, readonly=True); print(c.tables(), c.current('t').rows)")
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        finally:
            txn.abort()
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['t'] 10"


def test_write_open_cleans_leftovers_of_dead_writers(data_dir, make_table):
    make_table("t", rows=10)
    dead = data_dir / "tmp" / "t.dead"
    dead.mkdir()
    (dead / "seg-00000.bin").write_bytes(b"x" * 100)
    (dead / ".lock").touch()
    alive = data_dir / "tmp" / "t.alive"
    alive.mkdir()
    fd = os.open(alive / ".lock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    uncommitted = data_dir / "tables" / "t" / "v9"
    uncommitted.mkdir()
    try:
        with Catalog(data_dir):
            pass
        assert not dead.exists() and not uncommitted.exists()
        assert alive.exists(), "a live writer's staging directory must survive"
        assert (data_dir / "tables" / "t" / "v1").exists()
    finally:
        os.close(fd)
