"""Write-back: blocks fetched from Mooncake become a local copy, off the request path,
and a complete copy is an ordinary local version."""
from __future__ import annotations

import time

import numpy as np
import pytest

from tierstore.store.catalog import Catalog
from tierstore.tiers.nvme import rowsum
from tierstore.tiers.remote.publish import fetch_manifest, import_manifest, publish
from tierstore.tiers.remote.local_copy import BITMAP_NAME, LocalCopy
from tierstore.tiers.nvme.reader import SegmentReader
from tierstore.tiers.remote.reader import RemoteReader
from tierstore.tiers.nvme.miss_batch import MissBatch


@pytest.fixture
def new_host(cluster, make_table, data_dir, tmp_path, request):
    """(store, manifest, checksums, host-b data dir, rows): a table published from data_dir,
    its manifest recorded on host b, which has no rows. Segment format 2 unless a test
    is parametrized with `new_host` = 1."""
    fmt = getattr(request, "param", 2)
    _, data = make_table("emb", rows=3000, row_bytes=64, chunk=1000, segment_format=fmt)
    store = cluster.connect()
    publish(store, data_dir, "emb")
    tv, sums = fetch_manifest(store, "emb")
    host_b = tmp_path / "host-b"
    import_manifest(host_b, tv, sums)
    yield store, tv, sums, host_b, data
    store.close()


def _wait(cond, timeout=30.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_fetched_blocks_are_read_locally_next_time(new_host):
    store, tv, sums, host_b, data = new_host
    reader = RemoteReader(store, tv, sums, copy=LocalCopy(host_b, tv, sums), fill=False)
    try:
        ids = np.arange(0, 1000, 7)
        assert np.array_equal(reader.read_rows(ids), data[ids])
        assert reader.writeback.drain()
        blocks = np.unique(ids // tv.block_rows)
        assert reader.copy.present[blocks].all() and reader.copy.n_present == blocks.size
        fetched = reader.bytes_read
        assert np.array_equal(reader.read_rows(ids), data[ids])
        assert reader.bytes_read == fetched and reader.copy_blocks_read == blocks.size  # all local
        assert not reader.copy.finished  # other blocks never asked for, no fill
    finally:
        reader.close()


@pytest.mark.parametrize("new_host", [2, 1], ids=["format2", "format1"], indirect=True)
def test_the_fill_completes_the_copy_into_an_ordinary_local_version(new_host):
    store, tv, sums, host_b, data = new_host
    reader = RemoteReader(store, tv, sums, copy=LocalCopy(host_b, tv, sums))
    try:
        _wait(lambda: reader.copy.finished)
        assert np.array_equal(reader.read_range(0, tv.rows), data)
        fetched, ids = reader.bytes_read, np.random.default_rng(5).permutation(tv.rows)[:500]
        assert np.array_equal(reader.read_rows(ids), data[ids])  # now the finished copy's row path
        arena = np.zeros((500, tv.row_bytes), np.uint8)
        MissBatch(reader, np.sort(ids), arena, np.arange(500)[::-1]).submit().finish()  # the engine's way
        assert np.array_equal(arena[::-1], data[np.sort(ids)]) and reader.bytes_read == fetched
    finally:
        reader.close()
    vdir = host_b / "tables" / "emb" / f"v{tv.number}"
    assert not (vdir / BITMAP_NAME).exists() and not list(vdir.glob("*.partial"))
    with Catalog(host_b, readonly=True) as cat, SegmentReader(host_b, cat.current("emb"), sums) as local:
        assert local.verifies_rows and local.version.segment_format == tv.segment_format
        assert local.row_sums_error is None  # format 1: rebuilt, match the manifest
        assert np.array_equal(local.read_rows(np.arange(tv.rows)), data)


def test_a_block_whose_local_bytes_are_bad_is_fetched_again(new_host):
    """As if a crash or the disk lost bytes a set bit names: never served, refetched."""
    store, tv, sums, host_b, data = new_host
    reader = RemoteReader(store, tv, sums, copy=LocalCopy(host_b, tv, sums), fill=False)
    reader.read_rows(np.arange(tv.block_rows * 2))
    assert reader.writeback.drain()
    reader.close()
    seg = host_b / f"{tv.segments[0]}.partial"
    raw = bytearray(seg.read_bytes())
    raw[5] ^= 0xFF  # block 0
    seg.write_bytes(bytes(raw))
    local = LocalCopy(host_b, tv, sums)
    assert local.present[:2].all()  # the bitmap survived the restart
    reader = RemoteReader(store, tv, sums, copy=local, fill=False)
    try:
        assert np.array_equal(reader.read_rows([0, tv.block_rows]), data[[0, tv.block_rows]])
        assert reader.copy_blocks_read == 1 and reader.bytes_read == tv.block_bytes  # block 0 came back
        assert reader.writeback.drain()
        assert local.present[0]
    finally:
        reader.close()
    assert bytes(seg.read_bytes()[:tv.block_bytes]) == rowsum.records(
        data[:tv.block_rows], np.arange(tv.block_rows), rowsum.RowKey.of(tv.row_salt)).tobytes()


def test_bits_are_set_only_after_the_bytes_are_written(new_host, monkeypatch):
    """A write that fails between data and bitmap leaves the block absent."""
    import os

    _, tv, sums, host_b, data = new_host
    local = LocalCopy(host_b, tv, sums)
    try:
        def no_sync(fd):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(os, "fdatasync", no_sync)
        with pytest.raises(OSError):
            block = rowsum.records(data[:tv.block_rows], np.arange(tv.block_rows),
                                   rowsum.RowKey.of(tv.row_salt))  # as on disk
            local.write_blocks(np.array([0]), block.reshape(1, -1))
        assert not local.present[0]
    finally:
        monkeypatch.undo()
        local.close()
    again = LocalCopy(host_b, tv, sums)
    try:
        assert not again.present[0]  # nor on disk
    finally:
        again.close()


def test_written_back_blocks_serve_while_the_master_is_down(new_host, cluster):
    from tierstore.errors import Unavailable

    store, tv, sums, host_b, data = new_host
    reader = RemoteReader(store, tv, sums, copy=LocalCopy(host_b, tv, sums), fill=False, retry_s=2)
    try:
        local = np.arange(tv.block_rows * 3)
        reader.read_rows(local)
        assert reader.writeback.drain()
        cluster.stop_master()
        assert np.array_equal(reader.read_rows(local), data[local])
        with pytest.raises(Unavailable):
            reader.read_rows([tv.rows - 1])
    finally:
        reader.close()


def test_blocks_that_all_fail_their_checksum_write_nothing(new_host):
    """Rows where records belong (or any bytes that do not match) are dropped, not written."""
    _, tv, sums, host_b, data = new_host
    local = LocalCopy(host_b, tv, sums)
    try:
        rows = np.zeros((1, tv.block_bytes), np.uint8)
        rows[0, :tv.block_rows * tv.row_bytes] = data[:tv.block_rows].reshape(-1)
        assert local.write_blocks(np.array([0]), rows) == 0 and not local.present[0]
    finally:
        local.close()
