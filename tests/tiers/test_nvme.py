import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tierstore.ingest import writer as ingest
from tierstore.store.catalog import Catalog
from tierstore.errors import ChecksumError, IdOutOfRange, InvalidArgument
from tierstore.tiers.nvme import blocks as block_path
from tierstore.tiers.nvme.blocks import default_block_rows
from tierstore.tiers.nvme.reader import SegmentReader

ROWS, RB, BR = 1000, 64, 7  # 143 blocks, the last one short (6 rows)


@pytest.fixture(params=[2, 1], ids=["format2", "format1"])
def table(data_dir, make_table, monkeypatch, request):
    """Every test here runs on both segment formats: records carrying their row sums
    (2, the default) and rows beside a row-sum file (1, older versions, still served)."""
    # small segments so reads cross segment files: 20 blocks per segment
    rec = RB + 8 if request.param == 2 else RB
    monkeypatch.setattr(ingest, "SEGMENT_BYTES", 20 * BR * rec)
    tv, data = make_table("t", rows=ROWS, row_bytes=RB, block_rows=BR, segment_format=request.param)
    with Catalog(data_dir, readonly=True) as cat:
        sums = cat.checksums("t", tv.number)
    reader = SegmentReader(data_dir, tv, sums)
    yield reader, tv, data
    reader.close()


def test_default_block_is_about_one_4_kib_page():
    assert default_block_rows(256) == 16
    assert default_block_rows(264) * 264 <= 4096 < (default_block_rows(264) + 1) * 264
    assert default_block_rows(1 << 20) == 1


def test_manifest_layout(table):
    _, tv, _ = table
    assert tv.n_blocks == 143 and tv.segment_rows == 140 and len(tv.segments) == 8
    assert tv.record_bytes == (RB + 8 if tv.segment_format == 2 else RB)


def test_read_rows_in_caller_order_with_duplicates(table):
    reader, _, data = table
    ids = np.array([999, 0, 5, 5, 998, 140, 139, 500, 0], dtype=np.int64)
    assert np.array_equal(reader.read_rows(ids), data[ids])


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint16, np.uint64])
def test_any_integer_dtype_and_shape(table, dtype):
    reader, _, data = table
    ids = np.array([[3, 700], [999, 3]], dtype=dtype)
    assert np.array_equal(reader.read_rows(ids), data[ids.reshape(-1).astype(np.int64)])


def test_out_buffer_is_filled_in_place(table):
    reader, _, data = table
    out = np.zeros((3, RB), dtype=np.uint8)
    got = reader.read_rows(np.array([10, 20, 30]), out=out)
    assert got is out and np.array_equal(out, data[[10, 20, 30]])
    with pytest.raises(InvalidArgument, match=r"shape \(3, 64\)"):
        reader.read_rows(np.array([10, 20, 30]), out=np.zeros((3, RB + 1), dtype=np.uint8))


def test_rows_are_read_once_each_not_their_blocks(table):
    reader, tv, _ = table
    before = reader.bytes_read
    reader.read_rows(np.array([0, 1, 2, 3, 3, 0]))
    assert reader.bytes_read - before == 4 * tv.record_bytes


def test_block_path_reads_each_block_once_and_neighbours_coalesce(table, data_dir):
    _, tv, _ = table
    if tv.segment_format == 2:
        pytest.skip("format 2 records always carry their row sums")
    old = dataclasses.replace(tv, row_sums=None)  # a version written before row checksums
    with Catalog(data_dir, readonly=True) as cat:
        reader = SegmentReader(data_dir, old, cat.checksums("t", 1))
    assert not reader.verifies_rows
    before = reader.bytes_read
    reader.read_rows(np.array([0, 1, 2, 3, 3, 0]))
    assert reader.bytes_read - before == BR * RB
    before = reader.bytes_read
    reader.read_rows(np.arange(0, 70))  # blocks 0..9: one pread
    assert reader.bytes_read - before == 10 * BR * RB
    reader.close()


def test_empty_request(table):
    reader, _, _ = table
    assert reader.read_rows(np.array([], dtype=np.int64)).shape == (0, RB)


def test_ids_out_of_range_name_table_rows_and_id(table):
    reader, _, _ = table
    with pytest.raises(IdOutOfRange, match=r"table 't' has 1000 rows; id 1000 is out of range"):
        reader.read_rows(np.array([1, 1000]))
    with pytest.raises(IdOutOfRange, match="id -1 is out of range"):
        reader.read_rows(np.array([-1]))
    with pytest.raises(IdOutOfRange):
        reader.read_rows(np.array([2 ** 64 - 1], dtype=np.uint64))
    with pytest.raises(InvalidArgument, match="must be integers, got dtype float64"):
        reader.read_rows(np.array([1.0, 2.0]))


def test_read_range_and_blocks(table):
    reader, _, data = table
    for start, n in [(0, ROWS), (3, 500), (140, 140), (995, 5), (999, 1), (10, 0)]:
        assert np.array_equal(reader.read_range(start, n), data[start:start + n])
    with pytest.raises(InvalidArgument, match="out of range"):
        reader.read_range(990, 11)
    seen = np.concatenate([rows.copy() for _, rows in reader.iter_blocks(50)])
    assert np.array_equal(seen, data)


def test_small_read_groups(table, monkeypatch):
    reader, _, data = table
    monkeypatch.setattr(block_path, "GROUP_BYTES", 3 * BR * RB)
    ids = np.random.default_rng(1).integers(0, ROWS, 400)
    assert np.array_equal(reader.read_rows(ids), data[ids])
    assert np.array_equal(reader.read_range(2, 990), data[2:992])


def _flip(data_dir, tv, row, byte=5):
    seg = row // tv.segment_rows
    path = data_dir / tv.segments[seg]
    raw = bytearray(path.read_bytes())
    raw[(row % tv.segment_rows) * tv.record_bytes + byte] ^= 0x01
    path.write_bytes(bytes(raw))


def test_flipped_bit_is_never_served(table, data_dir):
    reader, tv, data = table
    _flip(data_dir, tv, 300)  # block 42
    with pytest.raises(ChecksumError, match="table 't' version 1: checksum mismatch in block 42") as e:
        reader.read_rows(np.array([0, 300]))
    assert e.value.block == 42
    with pytest.raises(ChecksumError):
        reader.read_range(290, 20)
    ok = np.array([0, 293, 301, 999])  # other blocks still serve
    assert np.array_equal(reader.read_rows(ok), data[ok])
    assert reader.verify() == [42]



def test_a_block_that_fails_only_its_catalog_checksum_names_the_catalog(table, data_dir):
    """Rows as written under a damaged block checksum: the error names the catalog and its fix,
    not the rows; once a row of the block is damaged too, the block is blamed as before."""
    reader, tv, data = table
    sums = np.array(reader.checksums)
    sums[42] ^= 1
    with SegmentReader(data_dir, tv, sums) as r:
        with pytest.raises(ChecksumError, match="checksum mismatch in block 42 ") as e:
            r.read_range(290, 20)
        msg = str(e.value)
        assert e.value.block == 42 and "rows 294..300 passes its own row checksum" in msg, msg
        assert f"the block's checksum in the catalog ({data_dir}/catalog) is damaged, not the rows" in msg, msg
        assert f"`tierstore verify --data {data_dir}`" in msg and "re-ingest" in msg, msg
        assert np.array_equal(r.read_range(0, 294), data[:294])  # the other blocks still load
    _flip(data_dir, tv, 300)  # a row of that block damaged as well
    with SegmentReader(data_dir, tv, sums) as r:
        with pytest.raises(ChecksumError, match="checksum mismatch in block 42$"):
            r.read_range(290, 20)


def test_padded_records_blame_the_catalog_only_when_their_padding_is_as_written(data_dir, make_table):
    """Format 2 pads a 12-B row to 16 B before its sum. A damaged checksum of an intact block
    names the catalog; a flipped padding byte passes the row sum, yet the block is not as
    written, so that block is blamed, not the catalog."""
    tv, data = make_table("p", rows=50, row_bytes=12, block_rows=8)
    assert tv.record_bytes == 24
    with Catalog(data_dir, readonly=True) as cat:
        sums = cat.checksums("p", tv.number)
    sums[4] ^= 1 << 40
    path = data_dir / tv.segments[0]
    raw = bytearray(path.read_bytes())
    raw[20 * tv.record_bytes + 13] ^= 0x10  # row 20's padding: block 2
    path.write_bytes(bytes(raw))
    with SegmentReader(data_dir, tv, sums) as r:
        assert np.array_equal(r.read_rows(np.array([20])), data[[20]])  # the row itself is right
        with pytest.raises(ChecksumError, match="checksum mismatch in block 2$"):
            r.read_range(0, 50)
        with pytest.raises(ChecksumError, match=r"block 4 \(each of its rows 32..39 passes .* the catalog \("):
            r.read_range(24, 26)
        assert r.verify() == [2, 4]

def test_truncated_and_missing_segments(table, data_dir):
    reader, tv, _ = table
    last = data_dir / tv.segments[-1]  # rows 980..999, blocks 140..142
    last.write_bytes(last.read_bytes()[:tv.record_bytes * 8])  # keeps block 140 and 1 row of 141
    assert reader.verify() == [141, 142]
    with pytest.raises(ChecksumError, match="block 141.*truncated"):
        reader.read_rows(np.array([990]))
    (data_dir / tv.segments[0]).unlink()
    with Catalog(data_dir, readonly=True) as cat:
        fresh = SegmentReader(data_dir, tv, cat.checksums("t", 1))
    with pytest.raises(ChecksumError, match="block 0.*missing"):
        fresh.read_rows(np.array([0]))
    assert fresh.verify() == list(range(20)) + [141, 142]
    fresh.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, ROWS - 1), max_size=200))
def test_read_rows_matches_numpy_gather(table, ids):
    reader, _, data = table  # read-only, so sharing it across examples is sound
    ids = np.array(ids, dtype=np.int64)
    assert np.array_equal(reader.read_rows(ids), data[ids])


def test_a_flipped_row_sum_inside_a_record_is_data_loss(table, data_dir):
    """Format 2: the sum a record carries is checked like its row; a damaged sum is
    DATA_LOSS on every path (row read, range load, verify), never a row served unchecked."""
    reader, tv, data = table
    if tv.segment_format == 1:
        pytest.skip("format 1 keeps its row sums in a separate file")
    _flip(data_dir, tv, 300, byte=RB + 3)
    with pytest.raises(ChecksumError, match="block 42"):
        reader.read_rows(np.array([300]))
    with pytest.raises(ChecksumError, match="block 42"):
        reader.read_range(0, ROWS)
    assert reader.verify() == [42]
    assert np.array_equal(reader.read_rows(np.array([299, 301])), data[[299, 301]])


def test_a_reader_holds_nothing_per_row(table):
    """Format 2's sums are in the records, format 1's are read from the row-sum file beside the
    rows: what a reader holds is the block checksums, 8 B a block."""
    reader, tv, _ = table
    assert reader.verifies_rows and reader.row_sums_error is None
    assert sum(a.nbytes for a in reader.held_arrays()) == 8 * tv.n_blocks
    if tv.segment_format == 2:
        assert tv.record_bytes == RB + 8 and tv.block_bytes == BR * (RB + 8)
