"""The shared slot index (tierstore/cache/slot_index.py) and the local reader's passes over it
(client/local_reads.py): a row is used only if its slot held it, READY, for the whole copy."""
from __future__ import annotations

import subprocess
import sys
import time

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
    """The reader's probe, then its seqlock read; `between()` runs writer code in between."""
    ids = np.asarray(ids, dtype=np.int64)
    out = np.zeros((ids.size, WIDTH), dtype=np.uint8)
    slots = st.map.find(ids)
    if between:
        between()
    seen = local_reads._seen_bitmap(CAP)
    where, kept = local_reads._read_hits(ids, slots, st.gen, st.id_of, arena, out, seen)
    miss = np.zeros(ids.size, bool)
    miss[where] = True
    assert np.array_equal(np.sort(kept), np.unique(ids[~miss])) and not seen.any()
    return out, miss, where.size


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
        numpy_path(local_reads, "_READ")
    _fill(st, arena, [10, 20, 30])
    out, miss, n = _read(st, arena, [10, 11, 30, 10, 999])
    assert n == 2 and miss.tolist() == [False, True, False, False, True]
    assert (out[~miss, 0] == [10, 30, 10]).all()


@pytest.mark.parametrize("path", ["compiled", "numpy"])
def test_a_row_evicted_and_refilled_after_the_probe_is_a_miss(table, path, numpy_path):
    """The slot of id 10 is given to id 74 between the probe and the copy."""
    st, arena, _ = table
    if path == "numpy":
        numpy_path(local_reads, "_READ")
    slots = _fill(st, arena, [10, 20])

    def evict_and_refill():
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


# A writer process (the sidecar's side: SlotTable over a SlotIndexFile, a shared arena file) that
# evicts and refills slots, and rewrites rows in place, for as long as `stop` does not exist. A
# row of id x is WIDTH // 8 words equal to x; while a slot is being written it holds another id's
# words for a while (a refill writes its row in two halves; a rewrite passes through id + ROWS).
_WRITER = """
import os, sys, time
import numpy as np
from tierstore.cache.slot_index import SlotIndexFile
from tierstore.cache.slot_table import SlotTable

index, arena_path, stop, cap, rows, width = sys.argv[1:7]
cap, rows, width = int(cap), int(rows), int(width)
st = SlotTable(cap, rows, SlotIndexFile(index, cap, rows, "inst0"))
words = np.memmap(arena_path, dtype=np.uint64, mode="r+", shape=(cap, width // 8))
rng = np.random.default_rng(1)
slots = st.take_free(cap)
held = rng.permutation(rows)[:cap].astype(np.int64)
st.assign(slots, held)
words[slots] = held[:, None]
st.ready(slots)
print("ready", flush=True)
half, deadline = width // 16, time.monotonic() + 60


def hold():  # a torn row stays in place long enough for a read to copy it
    t = time.perf_counter() + 50e-6
    while time.perf_counter() < t:
        pass


while not os.path.exists(stop) and time.monotonic() < deadline:
    s = rng.choice(cap, int(rng.integers(1, 9)), replace=False)
    if rng.random() < 0.5:  # evict, refill with rows not resident
        free = np.setdiff1d(np.arange(rows), st.id_of[st.id_of >= 0])
        new = rng.choice(free, s.size, replace=False).astype(np.int64)
        st.unmap(s)
        st.assign(s, new)
        words[s, :half] = new[:, None]
        hold()
        words[s, half:] = new[:, None]
        st.ready(s)
    else:  # rewrite in place, through another id's words
        ids = st.id_of[s].astype(np.int64)
        st.begin_write(s)
        words[s] = (ids + rows)[:, None]
        hold()
        words[s] = ids[:, None]
        st.end_write(s)
st.close()
"""


@pytest.fixture
def writer(tmp_path):
    """(index path, the arena's words mapped read-only, stop()) of a running writer process."""
    cap, rows, width = 256, 512, 64
    index, arena_path, stop = tmp_path / "w.index", tmp_path / "w.arena", tmp_path / "stop"
    np.zeros((cap, width), np.uint8).tofile(arena_path)
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, index, arena_path, stop, str(cap), str(rows), str(width)],
                            stdout=subprocess.PIPE, text=True)

    def halt():
        stop.touch()
        proc.wait(timeout=30)

    try:
        assert proc.stdout.readline().strip() == "ready"
        yield index, np.memmap(arena_path, dtype=np.uint64, mode="r", shape=(cap, width // 8)), halt
    finally:
        stop.touch()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


@pytest.mark.parametrize("path", ["compiled", "numpy"])
def test_rows_read_while_a_writer_process_rewrites_them_are_whole_and_their_own(writer, path, numpy_path):
    """Against a real writer process evicting, refilling and rewriting slots under the reads: every
    row the reader keeps is exactly its id's (none torn, none another id's), rows caught mid-write
    go to the miss path, and once the writer stops the compiled read and the numpy reference agree
    position for position."""
    index, words, halt = writer
    cap, rows = words.shape[0], 512
    gen, id_of, slot_map = map_index(index, cap, rows, "inst0")
    if path == "numpy":
        numpy_path(local_reads, "_READ")
    rng = np.random.default_rng(2)
    seen = local_reads._seen_bitmap(cap)
    rows_kept = caught = 0
    deadline = time.monotonic() + 20
    while (rows_kept < 100_000 or caught < 100) and time.monotonic() < deadline:
        ids = rng.integers(0, rows, 4096).astype(np.int64)
        out = np.zeros((ids.size, words.shape[1]), np.uint64)
        slots = slot_map.find(ids)
        where, kept = local_reads._read_hits(ids, slots, gen, id_of, words, out, seen)
        hit = np.ones(ids.size, bool)
        hit[where] = False
        wrong = hit & (out != ids[:, None]).any(axis=1)
        assert not wrong.any(), f"kept rows that are not their id's: ids {ids[wrong][:5]}, rows {out[wrong][:5, :4]}"
        assert np.array_equal(np.sort(kept), np.unique(ids[hit])) and not seen.any()
        rows_kept += int(hit.sum())
        caught += int(np.count_nonzero(slots[where] >= 0))  # found by the probe, then refused
    assert rows_kept >= 100_000 and caught >= 100, \
        f"the reads did not race the writer ({rows_kept} rows kept, {caught} refused)"
    halt()
    if path == "numpy" or not jit.enabled():
        return
    ids = rng.integers(0, rows, 4096).astype(np.int64)
    got = [np.zeros((ids.size, words.shape[1]), np.uint64) for _ in range(2)]
    where, kept = local_reads._read_hits(ids, slot_map.find(ids), gen, id_of, words, got[0], seen)
    numpy_path(local_reads, "_READ")
    ref, ref_kept = local_reads._read_hits(ids, slot_map.find(ids), gen, id_of, words, got[1], seen)
    hit = np.ones(ids.size, bool)
    hit[where] = False
    assert np.array_equal(where, ref) and 0 < where.size < ids.size
    assert np.array_equal(np.sort(kept), ref_kept)
    assert np.array_equal(got[0][hit], got[1][hit]) and (got[0][hit] == ids[hit, None]).all()
