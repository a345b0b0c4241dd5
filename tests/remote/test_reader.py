"""RemoteReader: verified rows from Mooncake, and every fault as a typed error."""
from __future__ import annotations

import time

import numpy as np
import pytest

from tierstore.errors import ChecksumError, Unavailable
from tierstore.tiers.nvme import rowsum
from tierstore.tiers.remote.publish import block_keys, fetch_manifest, publish
from tierstore.tiers.remote.reader import RemoteReader
from tierstore.tiers.nvme.miss_batch import MissBatch


@pytest.fixture
def published(cluster, make_table, data_dir):
    """(store client, reader, rows) for a 3,000-row table published with 2 replicas."""
    tv, data = make_table("emb", rows=3000, row_bytes=64)
    store = cluster.connect()
    publish(store, data_dir, "emb", replicas=2)
    tv, sums = fetch_manifest(store, "emb")
    reader = RemoteReader(store, tv, sums, retry_s=6)
    yield store, reader, data
    store.close()


def test_rows_are_bit_exact_in_every_read(published):
    _, reader, data = published
    ids = np.random.default_rng(1).integers(0, len(data), 700)
    assert np.array_equal(reader.read_rows(ids), data[ids])
    assert np.array_equal(reader.read_range(5, 2990), data[5:2995])
    arena = np.zeros((100, 64), dtype=np.uint8)
    u = np.unique(ids)[:100]
    slots = np.random.default_rng(2).permutation(100)[:len(u)]
    MissBatch(reader, u, arena, slots).submit().finish()  # the read pipeline, as the engine runs it
    assert np.array_equal(arena[slots], data[u])
    assert reader.bytes_read > 0


def test_corrupt_object_is_data_loss_never_a_row(published):
    store, reader, data = published
    tv = reader.version
    bad = rowsum.records(data[:tv.block_rows], np.arange(tv.block_rows), rowsum.RowKey.of(tv.row_salt))
    bad[3, 7] ^= 1
    store.upsert(block_keys("emb", tv.number, [0])[0], bad.tobytes())
    with pytest.raises(ChecksumError, match=r"'emb' version 1: checksum mismatch in block 0"):
        reader.read_rows([1])
    assert np.array_equal(reader.read_rows([tv.block_rows]), data[[tv.block_rows]])  # other blocks serve


def test_block_with_no_replica_fails_exactly_its_rows(published):
    store, reader, data = published
    br = reader.block_rows
    store.remove(block_keys("emb", 1, [2])[0], True)
    for i in (2 * br, 3 * br - 1):
        with pytest.raises(ChecksumError, match="block 2 .*no replica left"):
            reader.read_rows([i])
    ok = np.r_[np.arange(0, 2 * br), np.arange(3 * br, len(data))]
    assert np.array_equal(reader.read_rows(ok), data[ok])


def test_killed_store_with_two_replicas_keeps_serving(published, cluster):
    _, reader, data = published
    cluster.kill_store(0)
    ids = np.arange(len(data))
    assert np.array_equal(reader.read_rows(ids), data)  # retried onto the live replica


def test_master_down_is_unavailable_within_bounded_time(published, cluster):
    _, reader, data = published
    reader.retry_s = 2
    cluster.stop_master()
    t0 = time.monotonic()
    with pytest.raises(Unavailable, match="master does not answer|no replica answers"):
        reader.read_rows([0, 1500])
    assert time.monotonic() - t0 < 10


@pytest.mark.reliability
def test_recovery_when_the_master_returns(published, cluster, data_dir):
    store, reader, data = published
    cluster.stop_master()
    cluster.start_master()  # same ports; a non-HA master comes back empty
    deadline = time.monotonic() + 30
    while True:  # store processes re-mount their segments on their next heartbeat
        try:
            _, done = publish(store, data_dir, "emb", replicas=2)
            break
        except Unavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    assert done
    assert np.array_equal(reader.read_rows(np.arange(len(data))), data)
