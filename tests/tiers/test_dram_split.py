"""The split arena layout: all weights in id order, then all scales, read and written as interleaved rows."""
from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.errors import StaleArena
from tierstore.tiers.dram import HEADER_BYTES, Arena, map_readonly, map_split_readonly

ROW, W = 264, 256


@pytest.fixture
def arena_path(tmp_path):
    return tmp_path / f"tierstore.{os.getuid()}.test.split.t.v1"


def _arena(path, slots, split=W):
    a = Arena(path, slots, ROW, split=split)
    a.header.write(instance="i0", version=1, slots=slots, row_bytes=ROW, full=True, table="t", split=split)
    a.publish()
    return a


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 300), st.data())
def test_put_then_take_is_the_rows_and_the_file_holds_weights_then_scales(tmp_path_factory, slots, data):
    path = tmp_path_factory.mktemp("a") / f"tierstore.{os.getuid()}.test.split.t.v1"
    rows = np.random.default_rng(slots).integers(0, 256, (slots, ROW), dtype=np.uint8)
    a = _arena(path, slots)
    try:
        cut = data.draw(st.integers(0, slots))
        a.put(0, rows[:cut])
        a.put(cut, rows[cut:])
        ids = np.array(data.draw(st.lists(st.integers(0, slots - 1), max_size=50)), dtype=np.int64)
        assert np.array_equal(a.take(ids), rows[ids])
        assert np.array_equal(a.range(0, slots), rows)
        raw = np.fromfile(path, np.uint8)[HEADER_BYTES:HEADER_BYTES + slots * ROW]
        assert np.array_equal(raw[:slots * W].reshape(slots, W), rows[:, :W])
        assert np.array_equal(raw[slots * W:].reshape(slots, ROW - W), rows[:, W:])
    finally:
        a.close()


def test_a_client_maps_a_split_arena_only_as_split(arena_path):
    rows = np.random.default_rng(0).integers(0, 256, (40, ROW), dtype=np.uint8)
    a = _arena(arena_path, 40)
    try:
        a.put(0, rows)
        split, header = map_split_readonly(arena_path, 40, ROW, W, instance="i0")
        assert np.array_equal(split.weight, rows[:, :W]) and np.array_equal(split.scale, rows[:, W:])
        assert split.scale.ctypes.data == split.weight.ctypes.data + split.weight.nbytes  # one buffer
        assert not split.weight.flags.writeable
        with pytest.raises(StaleArena, match="split at 256 B, not interleaved"):
            map_readonly(arena_path, 40, ROW, instance="i0")
        with pytest.raises(StaleArena, match="not split at 128 B"):
            map_split_readonly(arena_path, 40, ROW, 128, instance="i0")
    finally:
        a.close()


def test_an_interleaved_arena_is_refused_as_split(arena_path):
    a = _arena(arena_path, 8, split=0)
    try:
        with pytest.raises(StaleArena, match="interleaved, not split at 256 B"):
            map_split_readonly(arena_path, 8, ROW, W)
    finally:
        a.close()


def test_reattaching_a_persisted_arena_in_the_other_layout_reloads_it(arena_path):
    a = _arena(arena_path, 8, split=0)
    a.close(unlink=False)
    try:
        assert Arena(arena_path, 8, ROW, reuse=True, split=0).reattached
        again = Arena(arena_path, 8, ROW, reuse=True, split=W)
        assert not again.reattached  # the bytes are interleaved: the sidecar loads the table again
        again.close(unlink=False)
    finally:
        arena_path.unlink(missing_ok=True)
