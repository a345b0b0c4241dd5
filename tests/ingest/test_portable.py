import numpy as np
import pytest

from tierstore.store.catalog import Catalog
from tierstore.errors import ChecksumError, DataLoss
from tierstore.ingest.portable import export_table, import_table
from tierstore.tiers.nvme.reader import SegmentReader


def current_rows(data_dir, table):
    with Catalog(data_dir, readonly=True) as cat:
        tv = cat.current(table)
        with SegmentReader(data_dir, tv, cat.checksums(table, tv.number)) as r:
            return tv, r.read_range(0, tv.rows)


@pytest.mark.parametrize("exported", [2, 1], ids=["from-format2", "from-format1"])
def test_round_trip_is_bit_exact(tmp_path, data_dir, make_table, exported):
    """An export of either segment format imports as the current format (2), its rows
    checked against the exported block checksums on the way in."""
    tv, data = make_table("t", rows=3001, block_rows=10, segment_format=exported)
    make_table("t", rows=5, seed=9)  # a newer version; export the older one
    out = tmp_path / "t.tst"
    assert export_table(data_dir, "t", out, version=1).number == 1
    other = tmp_path / "other"
    got = import_table(out, other)
    assert (got.table, got.number, got.rows, got.block_rows, got.row_format) == ("t", 1, 3001, 10, "fp32")
    assert got.segment_format == 2 and got.row_sums is None
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
    raw[tv.record_bytes * 123] ^= 1  # row 123 -> block 12
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


def _hostile(path, header, body=b"", hlen=None):
    """A zstd portable file with any header (bytes, or an object dumped as JSON)."""
    import json
    import struct

    import zstandard

    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(zstandard.ZstdCompressor().compress(
        b"TSTABLE1" + struct.pack("<I", len(raw) if hlen is None else hlen) + raw + body))
    return path


def _good_manifest(tmp_path, make_table):
    import json

    make_table("t", rows=100)
    out = tmp_path / "t.tst"
    export_table(tmp_path / "data", "t", out)
    import zstandard

    raw = zstandard.ZstdDecompressor().stream_reader(open(out, "rb")).read()
    n = int.from_bytes(raw[8:12], "little")
    return json.loads(raw[12:12 + n])


@pytest.mark.parametrize("case,message", [
    ("huge_hlen", "claims a 4294967295-byte header"),
    ("whitespace", "claims a 2097152-byte header"),
    ("list", "not an object"),
    ("no_rows", "['rows'] missing"),
    ("str_rows", "rows = '100' is not a positive integer"),
    ("n_blocks_2_26", "n_blocks = 67108864 but"),
    ("n_blocks_1e18", "n_blocks = 1000000000000000000 but"),
    ("rows_1e18", "over 1 PiB"),
    ("claims_2_26_blocks", "truncated"),
    ("bad_format", "row_format"),
    ("sums_str", "checksums_xxh3"),
    ("spec_list", "spec is not an object"),
    ("nested", "JSON nested 200001 levels deep, over the limit of 64"),
    ("nested_spec", "JSON nested 100002 levels deep, over the limit of 64"),
    ("nan_sums", "NaN is not a JSON number"),
])
def test_hostile_exports_are_clear_errors(tmp_path, data_dir, make_table, cli, case, message):
    import json

    good = _good_manifest(tmp_path, make_table)
    m = good["manifest"]
    f = tmp_path / "h.tst"
    if case == "huge_hlen":
        _hostile(f, b" " * 16, hlen=2**32 - 1)
    elif case == "whitespace":
        _hostile(f, b" " * (2 << 20))
    elif case == "list":
        _hostile(f, [1, 2, 3])
    elif case == "no_rows":
        m.pop("rows")
        _hostile(f, good)
    elif case == "claims_2_26_blocks":  # consistent, but the file ends long before 512 MiB of checksums
        m.update(rows=2**26, block_rows=1, n_blocks=2**26, segment_rows=2**26)
        _hostile(f, good, b"\0" * 1000)
    elif case == "nested":
        _hostile(f, b'{"manifest": ' + b"[" * 200_000 + b"]" * 200_000 + b"}")
    elif case == "nested_spec":
        _hostile(f, json.dumps(good).replace('"spec": null', '"spec": ' + '{"a": ' * 100_000 + "1" + "}" * 100_000)
                 .encode())
    elif case == "nan_sums":
        _hostile(f, json.dumps({**good, "checksums_xxh3": float("nan")}).encode())
    elif case == "sums_str":
        good["checksums_xxh3"] = "x"
        _hostile(f, good)
    else:
        m.update({"str_rows": dict(rows="100"), "n_blocks_2_26": dict(n_blocks=2**26),
                  "n_blocks_1e18": dict(n_blocks=10**18),
                  "rows_1e18": dict(rows=10**18, block_rows=1, n_blocks=10**18, segment_rows=10**18),
                  "bad_format": dict(row_format=["fp32"]), "spec_list": dict(spec=[1])}[case])
        _hostile(f, good)
    with pytest.raises(DataLoss, match="h.tst") as e:
        import_table(f, tmp_path / "dest")
    assert message in str(e.value)
    code, _, err = cli("import", f, "--data", tmp_path / "dest", "--quiet")
    assert code == 1 and message in err and "Traceback" not in err
    assert not (tmp_path / "dest" / "tables").exists() or not any((tmp_path / "dest" / "tables").rglob("seg-*"))


def test_rows_that_miss_a_format_1_exports_checksums_commit_nothing(data_dir, make_table):
    """Import of a format 1 export writes format 2: the exported checksums are checked
    over the incoming rows as format 1 laid them out, and one that differs is DataLoss."""
    from tierstore.ingest.writer import ExpectedBlocks, write_version

    tv, data = make_table("t", rows=300, block_rows=10, segment_format=1)
    with Catalog(data_dir, readonly=True) as cat:
        sums = cat.checksums("t", tv.number).copy()
    kw = dict(rows=300, row_format="fp32", row_dim=16, block_rows=10)
    assert write_version(data_dir, "ok", [data], expected=ExpectedBlocks(sums, segment_format=1),
                         **kw).segment_format == 2
    sums[7] ^= 1
    with pytest.raises(DataLoss, match="block 7 of the incoming rows"):
        write_version(data_dir, "bad", [data], expected=ExpectedBlocks(sums, segment_format=1), **kw)
    with Catalog(data_dir, readonly=True) as cat:
        assert "bad" not in cat.tables()
