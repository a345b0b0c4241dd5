import numpy as np
import pytest

from tierstore.catalog import Catalog
from tierstore.errors import ChecksumError, DataLoss
from tierstore.portable import export_table, import_table
from tierstore.tiers.nvme import SegmentReader


def current_rows(data_dir, table):
    with Catalog(data_dir, readonly=True) as cat:
        tv = cat.current(table)
        with SegmentReader(data_dir, tv, cat.checksums(table, tv.version)) as r:
            return tv, r.read_range(0, tv.rows)


def test_round_trip_is_bit_exact(tmp_path, data_dir, make_table):
    tv, data = make_table("t", rows=3001, block_rows=10)
    make_table("t", rows=5, seed=9)  # a newer version; export the older one
    out = tmp_path / "t.tst"
    assert export_table(data_dir, "t", out, version=1).version == 1
    other = tmp_path / "other"
    got = import_table(out, other)
    assert (got.table, got.version, got.rows, got.block_rows, got.row_format) == ("t", 1, 3001, 10, "fp32")
    assert np.array_equal(current_rows(other, "t")[1], data)
    renamed = import_table(out, data_dir, "copy")
    assert renamed.table == "copy" and "import t.tst (t v1" in renamed.source
    assert np.array_equal(current_rows(data_dir, "copy")[1], data)


def test_truncated_or_corrupt_file_imports_nothing(tmp_path, data_dir, make_table):
    make_table("t", rows=20000, row_bytes=64)
    out = tmp_path / "t.tst"
    export_table(data_dir, "t", out)
    raw = out.read_bytes()
    dest = tmp_path / "dest"
    old_tv, old = current_rows(data_dir, "t")
    (tmp_path / "cut.tst").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DataLoss, match="truncated|corrupt"):
        import_table(tmp_path / "cut.tst", data_dir)
    flipped = bytearray(raw)
    flipped[len(raw) // 2] ^= 0x10
    (tmp_path / "flip.tst").write_bytes(bytes(flipped))
    with pytest.raises(DataLoss):
        import_table(tmp_path / "flip.tst", dest)
    (tmp_path / "junk.tst").write_bytes(b"\x28\xb5\x2f\xfd" + b"\0" * 50)
    with pytest.raises(DataLoss):
        import_table(tmp_path / "junk.tst", dest)
    got_tv, rows = current_rows(data_dir, "t")
    assert got_tv == old_tv and np.array_equal(rows, old)
    with Catalog(dest) as cat:
        assert cat.tables() == []
    assert list((data_dir / "tmp").iterdir()) == []


def test_corrupt_table_is_never_exported(tmp_path, data_dir, make_table):
    tv, _ = make_table("t", rows=500, block_rows=10)
    seg = data_dir / tv.segments[0]
    raw = bytearray(seg.read_bytes())
    raw[64 * 123] ^= 1  # row 123 -> block 12
    seg.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match="block 12"):
        export_table(data_dir, "t", tmp_path / "t.tst")
    assert list(tmp_path.glob("*.tst*")) == []


def test_cli_export_import(tmp_path, data_dir, make_table, cli):
    _, data = make_table("t", rows=100)
    code, out, _ = cli("export", "--data", data_dir, "--table", "t", "--out", tmp_path / "t.tst", "--quiet")
    assert code == 0 and "t v1" in out
    code, out, _ = cli("import", tmp_path / "t.tst", "--data", tmp_path / "b", "--table", "u", "--quiet")
    assert code == 0 and "u v1: 100 rows" in out
    assert np.array_equal(current_rows(tmp_path / "b", "u")[1], data)
    code, _, err = cli("export", "--data", data_dir, "--table", "zz", "--out", tmp_path / "z.tst")
    assert code == 2 and "no table 'zz'" in err
