import numpy as np
import pytest

from tierstore.ingest import demo_table
from tierstore.store.catalog import Catalog
from tierstore.table.spec import preset
from tierstore.errors import InvalidArgument
from tierstore.table.formats import decode_rows
from tierstore.tiers.nvme.reader import SegmentReader

SCALE = 2048  # engram-paper-demo: ~5k rows per layer


def table_bytes(data_dir, name):
    with Catalog(data_dir, readonly=True) as cat:
        tv = cat.current(name)
        with SegmentReader(data_dir, tv, cat.checksums(name, tv.number)) as r:
            return tv, r.read_range(0, tv.rows)


def test_one_table_per_layer_with_the_preset_layout(data_dir):
    made = demo_table.make_demo_tables(data_dir, "engram-paper-demo", SCALE)
    spec = preset("engram-paper-demo", SCALE)
    assert [t.table for t in made] == ["l1", "l15"]
    for tv, layer in zip(made, (1, 15)):
        assert tv.rows == spec.rows(layer) and tv.layer_id == layer and tv.spec == spec.to_dict()
        assert (tv.row_format, tv.row_dim) == ("fp32", 64)
        _, rows = table_bytes(data_dir, tv.table)
        vals = rows.view(np.float32)
        assert np.array_equal(vals[100:200], demo_table.demo_values(spec, layer, 100, 200))
        assert abs(vals.mean()) < 0.05 and 0.95 < vals.std() < 1.05


def test_same_seed_same_bytes_whatever_the_chunking(tmp_path, monkeypatch):
    demo_table.make_demo_tables(tmp_path / "a", "engram-paper-demo", SCALE, seed=7)
    monkeypatch.setattr(demo_table, "_CHUNK_BYTES", 1)  # one 4096-row group per chunk
    demo_table.make_demo_tables(tmp_path / "b", "engram-paper-demo", SCALE, seed=7)
    demo_table.make_demo_tables(tmp_path / "c", "engram-paper-demo", SCALE, seed=8)
    a, b, c = (table_bytes(tmp_path / d, "l15")[1] for d in "abc")
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_fp8_rows_use_varied_block_scales(data_dir):
    made = demo_table.make_demo_tables(data_dir, "deepseek-v4.1-flash", 4_000_000, row_dim=64)
    tv = made[0]
    assert (tv.table, tv.row_format, tv.row_bytes) == ("l1", "fp8-e4m3-ue8m0", 66)
    _, rows = table_bytes(data_dir, "l1")
    assert len(np.unique(rows[:, 64:])) >= 3  # several ue8m0 exponents in use
    spec = demo_table.demo_spec("deepseek-v4.1-flash", 4_000_000, row_dim=64)
    want = demo_table.demo_values(spec, 1, 0, tv.rows)
    np.testing.assert_allclose(decode_rows(rows, "fp8-e4m3-ue8m0", 64), want, rtol=0.07, atol=0.02)


def test_bad_arguments(data_dir):
    with pytest.raises(InvalidArgument, match="unknown preset 'nope'"):
        demo_table.make_demo_tables(data_dir, "nope", 1)
    with pytest.raises(InvalidArgument, match="divisible by 32"):
        demo_table.make_demo_tables(data_dir, "engram-paper-demo", SCALE, row_format="fp8-e4m3-ue8m0", row_dim=40)
    with pytest.raises(InvalidArgument, match="leaves no rows"):
        demo_table.make_demo_tables(data_dir, "engram-paper-demo", 10 ** 9)


def test_cli_demo_tables_verify(data_dir, cli):
    code, out, _ = cli("demo-table", "--preset", "engram-paper-demo", "--scale", SCALE, "--data", data_dir,
                       "--format", "bf16", "--quiet")
    assert code == 0 and "l1 v1" in out and "bf16" in out
    code, out, _ = cli("tables", "--data", data_dir)
    assert code == 0 and "l15" in out
    code, out, _ = cli("verify", "--data", data_dir)
    assert code == 0 and "l1 v1: ok" in out
    tv, _ = table_bytes(data_dir, "l1")
    seg = data_dir / tv.segments[0]
    raw = bytearray(seg.read_bytes())
    raw[tv.block_bytes * 3 + 17] ^= 0x80
    seg.write_bytes(bytes(raw))
    code, out, err = cli("verify", "--data", data_dir, "--table", "l1")
    assert code == 1 and "l1 v1: block 3 is corrupt" in err and f"{tv.segments[0]} at byte {tv.block_bytes * 3}" in err
