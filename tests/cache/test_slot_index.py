"""The shared slot index (tierstore/cache/slot_index.py) and the local reader's passes over it
(client/local_reads.py): a row is used only if its slot held it, READY, for the whole copy."""
from __future__ import annotations

import numpy as np
import pytest

from tierstore import errors, jit
from tierstore.client import local_reads
from tierstore.cache.slot_index import SlotIndexFile, map_index
from tierstore.cache.slot_table import SlotTable

CAP, ROWS, WIDTH = 64, 1000, 16


@pytest.fixture
def table(tmp_path):
    idx = SlotIndexFile(tmp_path / "x.index", CAP, ROWS, "inst0")
    st = SlotTable(CAP, ROWS, idx)
    arena = np.zeros((CAP, WIDTH), dtype=np.uint8)
    yield st, arena, tmp_path / "x.index"
    st.close()


def _fill(st: SlotTable, arena: np.ndarray, ids) -> np.ndarray:
    ids = np.asarray(ids, dtype=np.int64)
    slots = st.take_free(ids.size)
    st.assign(slots, ids)
    arena[slots] = ids[:, None].astype(np.uint8)  # a row is its id (mod 256)
    st.ready(slots)
    return slots


def _read(st: SlotTable, arena: np.ndarray, ids, between=None):
    """The reader's three passes; `between(phase)` runs writer code after pass 1 or 2."""
    ids = np.asarray(ids, dtype=np.int64)
    out = np.zeros((ids.size, WIDTH), dtype=np.uint8)
    slots, gens = np.empty(ids.size, np.int64), np.empty(ids.size, np.uint32)
    local_reads._probe(ids, st.map, st.gen, slots, gens)
    if between:
        between(1)
    local_reads._copy(ids, slots, gens, st.id_of, arena, out)
    if between:
        between(2)
    missing = local_reads._confirm(slots, gens, st.gen)
    return out, (gens & 1) == 1, missing


def test_gen_is_even_only_while_a_slot_holds_a_ready_row(table):
    st, arena, _ = table
    assert (st.gen & 1).all()  # empty
    slots = _fill(st, arena, [5, 6, 7])
    assert not (st.gen[slots] & 1).any()
    st.begin_write(slots[:1])
    assert st.gen[slots[0]] & 1
    st.end_write(slots[:1])
    assert not st.gen[slots[0]] & 1
    st.unmap(slots[1:2])
    assert st.gen[slots[1]] & 1 and st.id_of[slots[1]] == -1 and st.lookup([6])[0] == -1


@pytest.mark.parametrize("path", ["compiled", "numpy"])
def test_resident_rows_are_read_and_the_rest_are_misses(table, path, numpy_path):
    st, arena, _ = table
    if path == "numpy":
        numpy_path(local_reads, "_PROBE", "_COPY", "_CONFIRM")
    _fill(st, arena, [10, 20, 30])
    out, miss, n = _read(st, arena, [10, 11, 30, 10, 999])
    assert n == 2 and miss.tolist() == [False, True, False, False, True]
    assert (out[~miss, 0] == [10, 30, 10]).all()


@pytest.mark.parametrize("path", ["compiled", "numpy"])
@pytest.mark.parametrize("phase", [1, 2])
def test_a_row_evicted_and_refilled_during_the_read_is_a_miss(table, path, phase, numpy_path):
    """The slot of id 10 is given to id 74 between two of the reader's passes."""
    st, arena, _ = table
    if path == "numpy":
        numpy_path(local_reads, "_PROBE", "_COPY", "_CONFIRM")
    slots = _fill(st, arena, [10, 20])

    def evict_and_refill(at):
        if at == phase:
            st.unmap(slots[:1])
            st.assign(slots[:1], np.array([74]))
            arena[slots[0]] = 74
            st.ready(slots[:1])

    out, miss, n = _read(st, arena, [10, 20], between=evict_and_refill)
    assert miss.tolist() == [True, False] and n == 1
    assert out[1, 0] == 20
    out, miss, n = _read(st, arena, [74])  # and the new row is read as its own
    assert n == 0 and out[0, 0] == 74


def test_a_row_being_written_is_a_miss(table):
    st, arena, _ = table
    slots = _fill(st, arena, [3])
    st.begin_write(slots)
    assert _read(st, arena, [3])[2] == 1
    st.end_write(slots)
    assert _read(st, arena, [3])[2] == 0


def test_a_client_maps_the_index_read_only_and_checks_it(table):
    st, arena, path = table
    _fill(st, arena, [42])
    gen, id_of, slot_map = map_index(path, CAP, ROWS, "inst0")
    s = st.lookup([42])[0]
    assert slot_map.find([42])[0] == s and id_of[s] == 42 and gen[s] % 2 == 0
    with pytest.raises(ValueError):
        slot_map.table[0] = 0  # read-only
    for args in ((CAP + 1, ROWS, "inst0"), (CAP, ROWS, "other")):
        with pytest.raises(errors.StaleArena):
            map_index(path, *args)
    with pytest.raises(errors.StaleArena):
        map_index(path.with_name("gone.index"), CAP, ROWS)


def test_the_index_file_is_removed_on_close(tmp_path):
    idx = SlotIndexFile(tmp_path / "y.index", 8, 100)
    assert (tmp_path / "y.index").stat().st_mode & 0o777 == 0o600
    idx.close()
    assert not (tmp_path / "y.index").exists()


@pytest.mark.skipif(not jit.enabled(), reason="numba is not installed")
def test_distinct_keeps_first_seen_order_and_matches_numpy():
    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 300, 5000):
        ids = rng.integers(0, 400, n).astype(np.int64)
        got = jit.distinct(ids)
        assert np.array_equal(np.sort(got), np.unique(ids))
        first = np.sort(np.unique(ids, return_index=True)[1])
        assert np.array_equal(got, ids[first])


def test_an_index_of_another_format_version_is_refused_with_the_reason(table):
    """Format 1 kept a per-row slot_of; a client reading it as the slot map would look rows
    up in the wrong array: it is refused, saying the two sides are different releases."""
    st, arena, path = table
    with open(path, "r+b") as f:
        f.write(b"TSINDEX1")
    with pytest.raises(errors.StaleArena, match="format version 1; this client reads version 3"):
        map_index(path, CAP, ROWS, "inst0")
