import fcntl
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tierstore.store import catalog as catalog_mod
from tierstore.store.catalog import BlockChecksums, Catalog, validate_table_name
from tierstore.errors import DataLoss, InvalidArgument, NotFound, TableNotFound, VersionNotFound
from tierstore.tiers.nvme.reader import SegmentReader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from segment_damage import flip_row_byte  # noqa: E402


def test_public_api():
    assert set(catalog_mod.__all__) == {"Catalog", "BlockChecksums", "TableVersion", "has_tables",
                                        "validate_table_name"}


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
        assert (tv1.number, tv2.number) == (1, 2)
        assert cat.current("t") == tv2
        assert cat.get("t", 1) == tv1
        assert [v.number for v in cat.versions("t")] == [1, 2]
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
        assert cat.current("t").number == 1
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
            code = ("from tierstore.store.catalog import Catalog\n"
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


def _tamper(data_dir, table, ver, changes):
    """Rewrite fields of a stored manifest (or its checksums, key 'checksums') behind the catalog's back."""
    import json
    import lmdb

    env = lmdb.open(str(data_dir / "catalog"), map_size=catalog_mod.MAP_SIZE, subdir=True)
    try:
        with env.begin(write=True) as txn:
            if "checksums" in changes:
                txn.put(catalog_mod._vkey(catalog_mod._SUM, table, ver), changes.pop("checksums"))
            key = catalog_mod._vkey(catalog_mod._VER, table, ver)
            d = json.loads(txn.get(key))
            d.update(changes)
            txn.put(key, json.dumps(d).encode())
    finally:
        env.close()


@pytest.mark.parametrize("changes,field", [
    (dict(row_bytes=32), "row_bytes = 32 but fp32 x 16 is 64 bytes"),
    (dict(rows=5000), "n_blocks"),
    (dict(block_rows=7), "n_blocks"),
    (dict(segment_rows=1), "segment_rows"),
    (dict(segment_rows=200), "segments: 1 segments of 200 rows"),
    (dict(segments=[]), "segments"),
    (dict(segments=["../../../etc/passwd"]), "not a path inside"),
    (dict(row_format="fp7"), "row_format"),
    (dict(rows="1000"), "rows"),
    (dict(version=2), "stored under 1"),
    (dict(checksums=b"\0" * 8), "checksums hold 1 entries"),
    (dict(checkpoint=["weight"]), "checkpoint = ['weight'] is not an object of weight / scale tensor records"),
    (dict(checkpoint={"weight": {"file": "s", "tensor": "w"}}), "a checkpoint tensor record has fields"),
    (dict(checkpoint={"scale": {"file": "s", "tensor": "w", "size": "8", "mtime_ns": 1}}), "size = '8' is not an "
                                                                                          "integer"),
])
def test_an_inconsistent_record_is_data_loss_naming_the_field(data_dir, make_table, cli, changes, field):
    from tierstore.errors import DataLoss

    make_table("t", rows=1000, row_bytes=64, block_rows=100)
    _tamper(data_dir, "t", 1, dict(changes))
    with Catalog(data_dir, readonly=True) as cat, pytest.raises(DataLoss, match="table 't' version 1") as e:
        cat.checksums("t", cat.get("t").number)
    assert field in str(e.value)
    code, _, err = cli("verify", "--data", data_dir)
    assert code == 1 and field in err and "Traceback" not in err


def test_data_dir_catalog_and_segments_are_private_even_under_umask_0(tmp_path, make_table):
    import stat

    data = tmp_path / "open" / "data"
    old = os.umask(0)
    try:
        from tierstore.ingest.writer import write_version

        write_version(data, "t", [np.zeros((10, 16), np.uint8)], rows=10, row_format="fp32", row_dim=4)
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
    for d in (data, data / "catalog", data / "tables", data / "tables" / "t", data / "tables" / "t" / "v1",
              data / "tmp"):
        assert mode(d) == 0o700, d
    for f in [data / "catalog" / "data.mdb", data / "catalog" / "lock.mdb", *(data / "tables" / "t" / "v1").iterdir()]:
        assert mode(f) == 0o600, f
    assert mode(tmp_path / "open") == 0o777  # a parent the user asked for keeps the umask


def _as_another_user():
    """argv prefix that runs a command as uid 0 without capabilities, so the
    file modes of another user's files apply (None where we cannot)."""
    import shutil

    if os.geteuid() != 0 or not shutil.which("setpriv"):
        return None
    prefix = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"]
    return prefix if subprocess.run(prefix + ["true"]).returncode == 0 else None


def test_another_users_catalog_is_read_without_its_lock_and_never_written(tmp_path, make_table, cli):
    prefix = _as_another_user()
    if prefix is None:
        pytest.skip("needs root and setpriv")
    make_table("t", rows=100)
    data = tmp_path / "data"
    np.save(tmp_path / "u.npy", np.zeros((4, 4), np.float32))
    for p in [tmp_path, *tmp_path.rglob("*")]:
        os.chown(p, 65534, 65534)  # nobody's, readable by all (a 0644 catalog as older versions made)
        p.chmod(0o755 if p.is_dir() else 0o644)
    run = lambda *a: subprocess.run(prefix + [sys.executable, "-m", "tierstore", *map(str, a)],  # noqa: E731
                                    capture_output=True, text=True, timeout=300, cwd="/")
    out = run("tables", "--data", data)
    assert out.returncode == 0 and "t " in out.stdout, out.stderr
    out = run("verify", "--data", data)
    assert out.returncode == 0 and "t v1: ok" in out.stdout, out.stderr
    out = run("ingest", tmp_path / "u.npy", "--data", data, "--table", "u", "--quiet")
    assert out.returncode == 2 and "not writable by this user" in out.stderr and "Traceback" not in out.stderr
    (data / "catalog" / "data.mdb").chmod(0o600)  # today's mode: nobody else reads it at all
    out = run("tables", "--data", data)
    assert out.returncode == 2 and "cannot read the catalog" in out.stderr and "Traceback" not in out.stderr


def test_serve_refuses_an_inconsistent_record_with_data_loss(data_dir, make_table, tmp_path):
    make_table("t", rows=1000, row_bytes=64, block_rows=100)
    _tamper(data_dir, "t", 1, dict(row_bytes=32))
    out = subprocess.run([sys.executable, "-m", "tierstore", "serve", "--data", str(data_dir), "--socket",
                          str(tmp_path / "s.sock"), "--dram-budget", "1MiB"], capture_output=True, text=True,
                         timeout=120, cwd="/")
    assert out.returncode == 1 and "row_bytes = 32 but fp32 x 16 is 64 bytes" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "s.sock").exists()


def test_block_checksums_read_from_the_catalog_are_its_array_and_verify_like_it(data_dir, make_table):
    """BlockChecksums holds nothing (nbytes 0) and indexes like Catalog.checksums' array; a reader
    given it verifies whole blocks (the block path) as with the array, and finds a damaged one."""
    tv, data = make_table("t", rows=3000, row_bytes=64, block_rows=16)
    with Catalog(data_dir, readonly=True) as cat:
        want = cat.checksums("t", tv.number)
    sums = BlockChecksums(data_dir, tv)
    try:
        assert sums.nbytes == 0 and sums.shape == want.shape and len(sums) == tv.n_blocks
        blocks = np.array([0, 7, tv.n_blocks - 1, 7])
        assert np.array_equal(sums[blocks], want[blocks]) and sums[blocks].dtype == np.uint64
        assert np.array_equal(sums[3:40], want[3:40]) and int(sums[5]) == int(want[5])
    finally:
        sums.close()
    with pytest.raises(ValueError, match="closed"):
        sums[0]
    with SegmentReader(data_dir, tv, BlockChecksums(data_dir, tv)) as r:
        assert np.array_equal(r.read_range(100, 900), data[100:1000]) and r.verify() == []
    flip_row_byte(data_dir, tv, 2 * 16)  # block 2's first row
    with SegmentReader(data_dir, tv, BlockChecksums(data_dir, tv)) as r:
        assert r.verify() == [2]


def test_block_checksums_cut_to_half_length_are_data_loss_never_an_index_error(data_dir, make_table):
    """A checksum record cut short behind the catalog's back (a cache-mode table reads it in
    place, BlockChecksums): every block read is refused with DataLoss naming the catalog,
    as Catalog.checksums refuses it, never an IndexError or a block checked against nothing."""
    tv, data = make_table("t", rows=3000, row_bytes=64, block_rows=16)
    with Catalog(data_dir, readonly=True) as cat:
        want = cat.checksums("t", tv.number)
    _tamper(data_dir, "t", 1, {"checksums": want[:tv.n_blocks // 2].astype("<u8").tobytes()})
    with SegmentReader(data_dir, tv, BlockChecksums(data_dir, tv)) as r:
        for first in (0, (tv.n_blocks - 1) * 16):  # a block the short record still holds, one it lost
            with pytest.raises(DataLoss, match=r"checksums hold 94 entries for 188 blocks; the catalog is corrupt"):
                r.read_range(first, 1)
        with pytest.raises(DataLoss, match="the catalog is corrupt"):
            r.verify()
