"""BadBlocks: a cold block online verification could not read whole is no verdict, a block whose
bytes fail is refused, and every mark or suspect is re-checked until its bytes check again.
Real table, reader and arena; the segment file cut and put back as an operator's `cp` does."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from tierstore.cache.leases import LeaseTable
from tierstore.engine import make_engine
from tierstore.engine.verifier import Verifier
from tierstore.errors import ChecksumError
from tierstore.store.catalog import Catalog
from tierstore.tiers.dram import Arena
from tierstore.tiers.nvme.reader import SegmentReader


@pytest.fixture
def cached(cache_engines, data_dir, step):
    """(engine, its table's rows, the segment file, a block, the block's rows resident in the arena)."""
    eng, data = cache_engines(2000, 512)
    block = 3
    br = eng.version.block_rows
    ids = np.arange(block * br, block * br + 5)
    step(eng, ids)  # promoted: resident and verified
    return eng, data, data_dir / eng.version.segments[0], block, ids


def _pass(eng, ids) -> None:
    """One verifier pass that samples every one of `ids` (their slots as the engine holds them)."""
    v = Verifier(1.0)
    v.engines = [eng]
    v.sample(eng, ids, eng.slots.find(ids).astype(np.int64))
    v.run_once()


def test_a_segment_cut_short_is_no_verdict_and_its_block_is_rechecked_until_whole(cached):
    eng, data, seg, block, ids = cached
    whole = seg.read_bytes()
    seg.write_bytes(whole[:block * eng.version.block_bytes])  # cut short before the block (cp truncates first)
    _pass(eng, ids)
    vc = eng.verify_counters
    assert vc.unreadable == 1 and vc.mismatches["nvme"] == 0
    assert eng.bad_blocks.marked.size == 0 and eng.bad_blocks.waiting == 1  # a suspect, not refused
    assert np.array_equal(eng.lookup(ids), data[ids])  # the resident rows, verified as placed, still serve
    _pass(eng, ids[:0])  # still cut: re-checked, still a suspect
    assert eng.bad_blocks.waiting == 1 and eng.bad_blocks.marked.size == 0
    seg.write_bytes(whole)  # put back
    _pass(eng, ids[:0])
    assert eng.bad_blocks.waiting == 0 and eng.bad_blocks.marked.size == 0
    with eng.lock:
        eng.slots.check()


def test_bytes_that_fail_are_refused_naming_the_row_until_put_back(cached):
    eng, data, seg, block, ids = cached
    v = eng.version
    whole = seg.read_bytes()
    victim = int(ids[2])
    flipped = bytearray(whole)
    flipped[victim * v.record_bytes + 1] ^= 0x10
    seg.write_bytes(bytes(flipped))
    _pass(eng, ids)
    assert eng.bad_blocks.marked.tolist() == [block] and eng.verify_counters.mismatches["nvme"] == ids.size
    with pytest.raises(ChecksumError, match=f"version {v.number}: checksum mismatch in block {block} "
                                            f"\\(row {ids[0]}") as e:
        eng.lookup(ids)  # refused though resident
    assert (e.value.table, e.value.block, e.value.row) == (v.table, block, int(ids[0]))
    slots = eng.slots.find(ids).astype(np.int64)
    assert not eng.slots.is_ready(slots).any()  # gen odd: a local reader misses them too
    _pass(eng, ids[:0])  # re-checked, the bytes still wrong: marked still, counted once
    assert eng.bad_blocks.marked.tolist() == [block] and eng.verify_counters.mismatches["nvme"] == ids.size
    seg.write_bytes(whole)  # a good copy put back
    _pass(eng, ids[:0])
    assert eng.bad_blocks.marked.size == 0 and eng.bad_blocks.waiting == 0 and eng.verify_counters.lifted == 1
    assert eng.slots.is_ready(slots).all()  # served again from the arena, the right bytes
    assert np.array_equal(eng.lookup(ids), data[ids])
    with eng.lock:
        eng.slots.check()


def test_a_full_table_scrub_takes_a_short_read_for_no_verdict(make_table, data_dir):
    tv, data = make_table("f", rows=1500, row_bytes=64)
    with Catalog(data_dir, readonly=True) as cat:
        sums = cat.checksums("f", tv.number)
    cold = SegmentReader(data_dir, tv, sums)
    arena = Arena(Path("/dev/shm") / f"tierstore-test-bad-blocks.{time.monotonic_ns()}", tv.rows, tv.row_bytes)
    try:
        eng = make_engine(tv, cold, arena, leases=LeaseTable(8), full=True)
        eng.load_full()
        seg = data_dir / tv.segments[0]
        whole = seg.read_bytes()
        seg.write_bytes(b"")
        assert eng.repair.scrub_blocks(np.array([0, 4])) == []
        assert eng.bad_blocks.marked.size == 0 and eng.bad_blocks.waiting == 2
        assert np.array_equal(eng.lookup(np.arange(tv.rows)), data)
        seg.write_bytes(whole)
        assert eng.repair.recheck(time.monotonic()) == [] and eng.bad_blocks.waiting == 0
    finally:
        arena.close(unlink=True)
        cold.close()
