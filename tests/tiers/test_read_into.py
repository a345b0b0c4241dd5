"""The read pipeline on the NVMe tier (a MissBatch submitted and finished by SegmentReader's
stages): the miss path of the engine and of local reads (rows verified by their row
checksum, written straight into their slots), page-cache and O_DIRECT modes, on segment
format 2 (each record carries its row sum) and format 1 (a row-sum file)."""
import dataclasses
import os
import threading
import sys
from pathlib import Path

import numpy as np
import pytest

from tierstore.ingest import writer as ingest
from tierstore.store.catalog import Catalog
from tierstore.errors import ChecksumError, InvalidArgument
from tierstore.table.formats import RowFormat
from tierstore.ingest.writer import write_version
from tierstore.tiers.nvme.miss_batch import MissBatch
from tierstore.tiers.nvme.reader import SegmentReader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from segment_damage import flip_row_byte  # noqa: E402


@pytest.fixture(params=["page-cache", "direct", "direct-pread"])
def mode(request, tmp_path, odirect, monkeypatch):
    """Page cache, O_DIRECT (io_uring where there is one), or O_DIRECT one pread at a time."""
    if request.param.startswith("direct"):
        why = odirect(tmp_path)
        if why:
            pytest.skip(why)
    if request.param == "direct-pread":
        import threading

        from tierstore.tiers.nvme import direct_io, reader

        class NoRing(threading.local):  # every thread's ring, whoever asks: as where io_uring is refused
            ring, tried = None, True

        # the rings' state, not thread_ring itself: modules bind that name on import (reader.py does)
        monkeypatch.setattr(direct_io, "_RINGS", NoRing())
        assert reader.thread_ring() is None
    return request.param != "page-cache"


@pytest.fixture(params=[2, 1], ids=["format2", "format1"])
def seg(request):
    """The segment format a test's table is written in (both are served)."""
    return request.param


def _write(data_dir, name, data, fmt="fp32", dim=None, **kw):
    rows, rb = data.shape
    dim = dim or rb // 4
    return write_version(data_dir, name, (data[i:i + 97] for i in range(0, rows, 97)), rows=rows,
                         row_format=fmt, row_dim=dim, **kw)


def _read(r, ids, dest, slots, records=None):
    """Rows `ids` into dest[slots] through the read pipeline: a batch submitted, then finished."""
    MissBatch(r, ids, dest, slots, records).submit().finish()


def _reader(data_dir, tv, **kw):
    with Catalog(data_dir, readonly=True) as cat:
        return SegmentReader(data_dir, tv, cat.checksums(tv.table, tv.number), **kw)


# fp32 x 64 (256 B), bf16 x 64 (128 B), fp8-e4m3-ue8m0 x 256 (264 B: not a power of two,
# straddles 512-B sectors), fp16 x 3 (6 B: not whole words), fp32 x 33 (132 B)
WIDTHS = [("fp32", 64), ("bf16", 64), ("fp8-e4m3-ue8m0", 256), ("fp16", 3), ("fp32", 33)]


@pytest.mark.parametrize("fmt,dim", WIDTHS)
def test_misses_are_bit_exact_for_every_row_width(data_dir, monkeypatch, mode, fmt, dim, seg):
    rb = RowFormat.parse(fmt).row_bytes(dim)
    monkeypatch.setattr(ingest, "SEGMENT_BYTES", 3001 * rb // 4)  # several segments per table
    data = np.random.default_rng(dim).integers(0, 256, (3001, rb), dtype=np.uint8)
    tv = _write(data_dir, "w", data, fmt=fmt, dim=dim, segment_format=seg)
    assert len(tv.segments) > 2 and tv.segment_format == seg
    assert (tv.row_sums is None) if seg == 2 else tv.row_sums["algo"] == "fmix64-v2"
    rng = np.random.default_rng(0)
    with _reader(data_dir, tv, direct_io=mode) as r:
        for n in (1, 2, 50, 3001):
            ids = np.sort(rng.choice(3001, n, replace=False)).astype(np.int64)
            dest = np.zeros((4000, rb), dtype=np.uint8)
            slots = rng.choice(4000, n, replace=False)
            records = np.zeros((4000, r.carried_records(ids[:1], data[ids[:1]]).shape[1]), dtype=np.uint8)
            _read(r, ids, dest, slots, records)
            assert np.array_equal(dest[slots], data[ids])
            untouched = np.setdiff1d(np.arange(4000), slots)
            assert not dest[untouched].any()  # nothing written outside the given slots
            # the records a client carries on its note: as read (format 2, O_DIRECT) or made from
            # the rows, either way the ones carried_records makes, and only at the slots
            assert np.array_equal(records[slots], r.carried_records(ids, data[ids])), (n, r.carried.form)
            assert not records[untouched].any()
        assert np.array_equal(r.read_rows(np.array([3000, 0, 0, 17])), data[[3000, 0, 0, 17]])
        _read(r, np.zeros(0, np.int64), np.zeros((1, rb), np.uint8), np.zeros(0, np.int64))


def test_batches_of_four_threads_at_once(data_dir, make_table, mode, seg):
    tv, data = make_table("t", rows=20_000, row_bytes=256, segment_format=seg)
    dest = np.zeros((20_000, 256), dtype=np.uint8)
    errors = []

    def work(k, r):
        try:
            rng = np.random.default_rng(k)
            for _ in range(10):
                ids = np.sort(rng.choice(20_000, 1500, replace=False)).astype(np.int64)
                mine = np.arange(k * 5000, (k + 1) * 5000)  # each thread owns its slots
                slots = rng.choice(mine, ids.size, replace=False)
                _read(r, ids, dest, slots)
                assert np.array_equal(dest[slots], data[ids])
        except BaseException as e:  # surfaced below
            errors.append(e)

    with _reader(data_dir, tv, direct_io=mode) as r:
        threads = [threading.Thread(target=work, args=(k, r)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors[0]


def test_two_tables_started_together_finish_bit_exact_in_either_order(data_dir, make_table, mode, seg):
    """Two batches submitted: a step's two tables begun one after the other (under O_DIRECT through io_uring
    both in flight on this thread's ring at once, in several parts each), finished in either
    order: each table's rows, records as carried, and a flipped row raises for its table only,
    after which the other table's rows still land."""
    from tierstore.tiers.nvme import reader as reader_mod

    tables = [make_table(t, rows=20_000, row_bytes=256, segment_format=seg) for t in ("a", "b")]
    readers = [_reader(data_dir, tv, direct_io=mode) for tv, _ in tables]
    try:
        rng = np.random.default_rng(4)
        for order in ((0, 1), (1, 0)):
            ids = [np.sort(rng.choice(20_000, 9000, replace=False)).astype(np.int64) for _ in readers]
            dest = [np.zeros((9000, 256), dtype=np.uint8) for _ in readers]
            width = readers[0].carried_records(ids[0][:1], tables[0][1][ids[0][:1]]).shape[1]
            records = [np.zeros((9000, width), dtype=np.uint8) for _ in readers]
            old = reader_mod.RING_BYTES
            reader_mod.RING_BYTES = 1 << 20  # parts of ~1,000 rows: several in flight a table
            try:
                started = [MissBatch(r, i, d, np.arange(i.size), rec).submit()
                           for r, i, d, rec in zip(readers, ids, dest, records)]
            finally:
                reader_mod.RING_BYTES = old
            for k in order:
                started[k].finish()
            for r, (tv, data), i, d, rec in zip(readers, tables, ids, dest, records):
                assert np.array_equal(d, data[i]), f"table {tv.table} served other rows"
                assert np.array_equal(rec, r.carried_records(i, data[i]))
        _flip(data_dir, tables[0][0], 1234, byte=200)
        ids = np.array([5, 1234, 4000], dtype=np.int64)
        dest = [np.zeros((3, 256), dtype=np.uint8) for _ in readers]
        started = [MissBatch(r, ids, d, np.arange(3)).submit() for r, d in zip(readers, dest)]
        with pytest.raises(ChecksumError, match=r"table 'a'.*row 1234"):
            started[0].finish()
        started[1].finish()
        assert np.array_equal(dest[1], tables[1][1][ids])
    finally:
        for r in readers:
            r.close()


def _flip(data_dir, tv, row, byte):
    flip_row_byte(data_dir, tv, row, byte, mask=0x10)


def test_a_corrupt_byte_names_block_and_row_and_spares_every_good_row(data_dir, make_table, mode, seg):
    tv, data = make_table("t", rows=5000, row_bytes=256, block_rows=16, segment_format=seg)
    _flip(data_dir, tv, 1234, byte=200)
    with _reader(data_dir, tv, direct_io=mode) as r:
        dest = np.zeros((5000, 256), dtype=np.uint8)
        with pytest.raises(ChecksumError, match=r"table 't' version 1: checksum mismatch in block 77 "
                                                 r"\(row 1234\)") as e:
            _read(r, np.array([5, 1234, 4000]), dest, np.array([0, 1, 2]))
        assert e.value.block == 77 and e.value.row == 1234
        # the bad row's block-mates and every other row still serve, bit-exact
        good = np.setdiff1d(np.arange(5000), [1234])
        _read(r, good, dest, np.arange(good.size))
        assert np.array_equal(dest[:good.size], data[good])
        assert r.verify() == [77]


def test_old_version_without_row_sums_verifies_by_block(data_dir, make_table, mode):
    tv, data = make_table("t", rows=3000, row_bytes=64, block_rows=8, segment_format=1)
    old = dataclasses.replace(tv, row_sums=None)  # as written before row checksums existed
    with _reader(data_dir, old, direct_io=mode) as r:
        assert not r.verifies_rows
        ids = np.array([0, 9, 10, 2999])
        dest = np.zeros((10, 64), dtype=np.uint8)
        _read(r, ids, dest, np.array([9, 0, 5, 1]))
        assert np.array_equal(dest[[9, 0, 5, 1]], data[ids])
        _flip(data_dir, tv, 10, byte=3)
        with pytest.raises(ChecksumError, match="block 1"):
            _read(r, np.array([9]), dest, np.array([0]))  # row 9 shares row 10's block
        assert r.verify() == [1]


def test_a_corrupt_row_sum_file_falls_back_to_blocks(data_dir, make_table):
    tv, data = make_table("t", rows=2000, row_bytes=64, segment_format=1)
    path = data_dir / os.path.dirname(tv.segments[0]) / tv.row_sums["file"]
    raw = bytearray(path.read_bytes())
    raw[8] ^= 1
    path.write_bytes(bytes(raw))
    with _reader(data_dir, tv) as r:
        assert not r.verifies_rows and "row checksum file" in r.row_sums_error
        assert np.array_equal(r.read_rows(np.arange(2000)), data)  # still verified, by block


def test_a_truncated_segment_is_data_loss_not_a_crash(data_dir, make_table, mode, monkeypatch, seg):
    rec = 256 + 8 if seg == 2 else 256
    monkeypatch.setattr(ingest, "SEGMENT_BYTES", 64 * rec)
    tv, data = make_table("t", rows=1000, row_bytes=256, block_rows=16, segment_format=seg)
    with _reader(data_dir, tv, direct_io=mode) as r:
        r.read_rows(np.arange(1000))  # maps every segment while whole
        path = data_dir / tv.segments[1]  # rows 64..127
        os.truncate(path, 10 * rec + 100)
        dest = np.zeros((4, 256), dtype=np.uint8)
        with pytest.raises(ChecksumError, match=r"row 74: segment .*seg-00001.bin is truncated"):
            _read(r, np.array([64, 73, 74, 500]), dest, np.arange(4))
        _read(r, np.array([64, 73, 500]), dest, np.arange(3))
        assert np.array_equal(dest[:3], data[[64, 73, 500]])


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_fifo_or_directory_in_place_of_a_segment_is_data_loss_and_never_hangs(data_dir, make_table, kind,
                                                                                monkeypatch, seg):
    monkeypatch.setattr(ingest, "SEGMENT_BYTES", 64 * (256 + 8 if seg == 2 else 256))
    tv, _ = make_table("t", rows=300, row_bytes=256, block_rows=16, segment_format=seg)
    seg = data_dir / tv.segments[2]  # rows 128..191, blocks 8..11
    seg.unlink()
    os.mkfifo(seg) if kind == "fifo" else seg.mkdir()
    what = "a FIFO" if kind == "fifo" else "a directory"
    with _reader(data_dir, tv) as r:  # opening does not block on the FIFO
        assert r.verify() == [8, 9, 10, 11]
        with pytest.raises(ChecksumError, match=f"seg-00002.bin is not a regular file \\({what}\\)"):
            r.read_rows(np.array([130]))
        with pytest.raises(ChecksumError, match="row 140: segment .* is not a regular file"):
            _read(r, np.array([3, 140]), np.zeros((2, 256), np.uint8), np.arange(2))
        r.read_rows(np.array([0, 299]))  # other segments serve


def test_direct_io_on_a_filesystem_without_it_is_a_clear_error(odirect):
    shm = "/dev/shm"
    if not os.path.isdir(shm) or odirect(shm) is None:
        pytest.skip("no tmpfs that refuses O_DIRECT here")
    import tempfile
    d = tempfile.mkdtemp(prefix="tierstore-test-", dir=shm)
    try:
        data = np.random.default_rng(0).integers(0, 256, (100, 64), dtype=np.uint8)
        tv = _write(d, "t", data)
        with pytest.raises(InvalidArgument, match=r"--direct-io: the filesystem holding .*seg-00000.bin "
                                                  r"refuses O_DIRECT \(tmpfs does\)"):
            _reader(d, tv, direct_io=True)
        with _reader(d, tv) as r:  # page-cache mode is fine there
            assert np.array_equal(r.read_rows(np.arange(100)), data)
    finally:
        import shutil
        shutil.rmtree(d, ignore_errors=True)


def test_direct_io_refused_at_open_is_a_clear_error(data_dir, make_table, monkeypatch):
    # tmpfs takes O_DIRECT since Linux 6.6; inject the EINVAL older kernels and other filesystems give
    import errno

    from tierstore.tiers.nvme import direct_io
    tv, _ = make_table("t", rows=100, row_bytes=64)
    real_open = os.open

    def refuse(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(direct_io.os, "open", refuse)
    with pytest.raises(InvalidArgument, match="refuses O_DIRECT"):
        _reader(data_dir, tv, direct_io=True)


def test_verify_cli_reports_a_fifo_segment_and_returns(data_dir, make_table, cli, monkeypatch):
    monkeypatch.setattr(ingest, "SEGMENT_BYTES", 64 * 256)
    tv, _ = make_table("t", rows=300, row_bytes=256)
    seg = data_dir / tv.segments[1]
    seg.unlink()
    os.mkfifo(seg)
    code, out, err = cli("verify", "--data", data_dir)
    assert code == 1 and "block 4 is corrupt" in err and "seg-00001.bin" in err


_GROWTH = """
import sys
import numpy as np
from tierstore.store.catalog import Catalog
from tierstore.tiers.nvme.reader import SegmentReader
def anon():
    return int(next(ln for ln in open("/proc/self/status") if ln.startswith("RssAnon:")).split()[1]) << 10
with Catalog(sys.argv[1], readonly=True) as cat:
    tv = cat.current("t")
    sums = cat.checksums("t", tv.number)
warm = SegmentReader(sys.argv[1], tv, sums)
warm.read_rows(np.arange(0, tv.rows, 997))  # compiled kernels, pools, buffers
warm.close()
before = anon()
r = SegmentReader(sys.argv[1], tv, sums)
assert r.verifies_rows and r.row_sums_error is None
r.read_rows(np.arange(0, tv.rows, 997))
print(anon() - before)
"""


def test_a_reader_holds_nothing_per_row_in_either_format(data_dir, make_table, seg):
    """Format 2 keeps each row's sum in its record, format 1 in a row-sum file read beside
    the rows: a reader (sidecar or client) holds nothing per row, so its memory does not
    grow with the table's rows (8 B a row in every worker would be 3 GB per V4.1 layer)."""
    import subprocess

    rows = 1 << 21
    tv, data = make_table("t", rows=rows, row_bytes=8, segment_format=seg)
    has_file = any("rowsums" in p.name for p in (data_dir / os.path.dirname(tv.segments[0])).iterdir())
    assert has_file == (seg == 1)
    anon = int(subprocess.run([sys.executable, "-c", _GROWTH, str(data_dir)], check=True,
                              capture_output=True, text=True, timeout=120).stdout)
    assert anon < rows * 8 * 0.1
    with _reader(data_dir, tv) as r:
        ids = np.sort(np.random.default_rng(3).choice(rows, 5000, replace=False))
        dest = np.zeros((5000, 8), np.uint8)
        _read(r, ids, dest, np.arange(5000))
        assert np.array_equal(dest, data[ids])


def test_a_row_sum_file_that_shrinks_is_data_loss_not_a_crash(data_dir, make_table, mode):
    tv, data = make_table("t", rows=2000, row_bytes=64, segment_format=1)
    path = data_dir / os.path.dirname(tv.segments[0]) / tv.row_sums["file"]
    with _reader(data_dir, tv, direct_io=mode) as r:
        r.read_rows(np.arange(10))
        os.truncate(path, 100)  # the sums of rows 0..11 and half of row 12's
        with pytest.raises(ChecksumError, match=r"row 1500: the row checksum file .* is truncated"):
            _read(r, np.array([5, 1500]), np.zeros((2, 64), np.uint8), np.arange(2))
        _read(r, np.array([3, 11]), np.zeros((2, 64), np.uint8), np.arange(2))
        assert r.verify() == list(range(12 // tv.block_rows, tv.n_blocks))  # rows 12.. have no sum


def test_no_read_maps_a_segment_or_the_row_sum_file(data_dir, make_table, mode, seg):
    """A map touched past the end of a file cut short is SIGBUS for the whole process: every
    read (rows, rows carried by a client, ranges, blocks, verify) reads, and nothing of the
    table's files is ever mapped."""
    tv, data = make_table("t", rows=5000, row_bytes=64, segment_format=seg)
    ids = np.sort(np.random.default_rng(2).choice(5000, 700, replace=False))
    with _reader(data_dir, tv, direct_io=mode) as r:
        dest = np.zeros((5000, 64), dtype=np.uint8)
        _read(r, ids, dest, ids)
        assert np.array_equal(dest[ids], data[ids])
        assert np.array_equal(r.read_rows(ids[::-1]), data[ids[::-1]])
        assert r.place_rows(ids, data[ids], np.arange(ids.size), dest, ids) == -1
        assert np.array_equal(r.read_range(100, 900), data[100:1000]) and r.verify() == []
        maps = Path("/proc/self/maps").read_text()
    assert str(data_dir) not in maps


_CUT_WHILE_READ = """
import os, sys, threading, time
import numpy as np
from tierstore.errors import ChecksumError
from tierstore.store.catalog import Catalog
from tierstore.tiers.nvme.miss_batch import MissBatch
from tierstore.tiers.nvme.reader import SegmentReader
data_dir, direct = sys.argv[1], sys.argv[2] == "1"
with Catalog(data_dir, readonly=True) as cat:
    tv = cat.current("t")
    sums = cat.checksums("t", tv.number)
seg = os.path.join(data_dir, tv.segments[0])
paths = [seg] + ([os.path.join(os.path.dirname(seg), tv.row_sums["file"])] if tv.row_sums else [])
whole = [open(p, "rb").read() for p in paths]
expected = np.frombuffer(whole[0], np.uint8).reshape(-1, tv.record_bytes)[:, :tv.row_bytes]
r = SegmentReader(data_dir, tv, sums, direct_io=direct)
until = time.monotonic() + 1.0
def cut():  # to half, then to nothing, the bytes written back in place after each
    k = 0
    while time.monotonic() < until:
        for p, b in zip(paths, whole):
            os.truncate(p, len(b) // 2 if k % 2 else 0)
        time.sleep(0.003)
        for p, b in zip(paths, whole):
            with open(p, "r+b") as f:
                f.write(b)
        time.sleep(0.003)
        k += 1
cutter = threading.Thread(target=cut)
cutter.start()
rng = np.random.default_rng(0)
ok = lost = 0
while time.monotonic() < until:
    ids = np.sort(rng.choice(tv.rows, 400, replace=False))
    dest = np.zeros((400, tv.row_bytes), np.uint8)
    try:
        MissBatch(r, ids, dest, np.arange(400)).submit().finish()
        assert np.array_equal(dest, expected[ids]), "a wrong row"
        ok += 1
    except ChecksumError:
        lost += 1
    try:  # the sidecar placing rows a client read: the sums read from disk
        if r.place_rows(ids, expected[ids], np.arange(400), dest, np.arange(400)) < 0:
            assert np.array_equal(dest, expected[ids]), "a wrong row placed"
    except ChecksumError:
        lost += 1
cutter.join()
MissBatch(r, ids, dest, np.arange(400)).submit().finish()
assert np.array_equal(dest, expected[ids])
print(ok, lost)
"""


@pytest.mark.parametrize("how, seg", [("page-cache", 2), ("page-cache", 1), ("page-cache-pread", 2), ("direct", 2)])
def test_a_file_cut_short_and_restored_while_read_is_data_loss_never_sigbus(data_dir, make_table, odirect, how,
                                                                           seg):
    """A segment (and format 1's row-sum file) truncated and written back again and again
    while reads run: each read is its rows or DataLoss, nothing is ever placed wrong, the
    process lives (a map touched past the file's end would be SIGBUS) and reads serve
    once the bytes are back. page-cache-pread: without io_uring, the pool's preads."""
    import signal
    import subprocess

    make_table("t", rows=20_000, row_bytes=64, segment_format=seg)
    why = odirect(data_dir) if how == "direct" else None
    if why:
        pytest.skip(why)
    env = dict(os.environ, **({"TIERSTORE_IO_URING": "0"} if how == "page-cache-pread" else {}))
    done = subprocess.run([sys.executable, "-c", _CUT_WHILE_READ, str(data_dir), str(int(how == "direct"))],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, (f"ended {done.returncode} (SIGBUS is {-signal.SIGBUS}): "
                                  f"{done.stdout} {done.stderr[-2000:]}")
    ok, lost = map(int, done.stdout.split())
    assert ok and lost, (ok, lost)  # both happened: reads while whole and while cut


@pytest.mark.parametrize("fmt,dim", [("fp32", 64), ("fp16", 3)], ids=["256B", "6B"])
def test_place_rows_places_only_rows_that_match_their_row_sums(data_dir, fmt, dim, seg):
    """SegmentReader.place_rows (the sidecar promoting rows a client read): bit-exact rows
    into their slots, no disk read; the first row that does not match its row sum is
    named (format 2: the sums come from the records on disk, never from the sender); a
    version without row sums places nothing; a shrunk row-sum file or segment is DATA_LOSS."""
    width = RowFormat.parse(fmt).row_bytes(dim)
    data = np.random.default_rng(8).integers(0, 256, size=(1500, width), dtype=np.uint8)
    tv = _write(data_dir, "t", data, fmt=fmt, dim=dim, segment_format=seg)
    with _reader(data_dir, tv) as r:
        ids = np.array([3, 700, 1499, 42])
        src = data[ids[::-1]].copy()  # the caller's order: local indexes into it
        dest = np.zeros((8, width), dtype=np.uint8)
        assert r.place_rows(ids, src, np.arange(4)[::-1].copy(), dest, np.array([7, 0, 2, 5])) == -1
        assert np.array_equal(dest[[7, 0, 2, 5]], data[ids]) and r.bytes_read == 0
        src[1, -1] ^= 0x80  # row 1499's last byte, as sent
        assert r.place_rows(ids, src, np.arange(4)[::-1].copy(), dest, np.arange(4)) == 2
        with pytest.raises(ChecksumError, match="truncated"):
            shrink = tv.row_sums["file"] if seg == 1 else os.path.basename(tv.segments[-1])
            os.truncate(data_dir / os.path.dirname(tv.segments[0]) / shrink, 100)
            r.place_rows(ids, data[ids], np.arange(4), dest, np.arange(4))
    if seg == 1:
        with _reader(data_dir, dataclasses.replace(tv, row_sums=None)) as r:
            assert r.place_rows(ids, data[ids], np.arange(4), dest, np.arange(4)) == 0
