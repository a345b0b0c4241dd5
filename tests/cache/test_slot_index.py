"""The shared slot index (tierstore/cache/slot_index.py) and the local reader's passes over it
(client/local_reads.py): a row is used only if its slot held it, READY, for the whole copy."""
from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from tierstore import errors, jit
from tierstore.client import local_reads
from tierstore.cache.slot_index import SlotIndexFile, map_index
from tierstore.cache.slot_table import Fill, SlotTable
from tierstore.errors import BrokenInvariant

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
    assert st.gen[slots[1]] & 1 and st.id_of[slots[1]] == -1 and st.find([6])[0] == -1


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
    s = st.find([42])[0]
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


# ---- check(): the index published and retired as the engine does, read by a client's mapping ----
M_CAP, M_ROWS = 12, 48
# deterministic (a seed from the test's name, no example database), short, no deadline on a loaded host
MACHINE = settings(max_examples=30, stateful_step_count=25, deadline=None, derandomize=True, database=None)


def _row(ids) -> np.ndarray:
    """The bytes of rows `ids`: each byte its id (ids < 256)."""
    return np.repeat(np.asarray(ids, np.uint8)[:, None], WIDTH, axis=1)


class SlotIndexMachine(RuleBasedStateMachine):
    """The sidecar's side publishes rows into the shared index (a fill: slots claimed, free ones
    first and then victims; mapped; written; READY), retires them (evicted for a fill, or the
    fill failed), rewrites READY rows in place and marks rows of a bad block, each stage its
    own rule as the engine's lock holds go; a client maps the same file read-only. After each
    rule check() holds, and the client's probe and seqlock read keep exactly the READY rows,
    each its own bytes: a row being filled or rewritten, or marked bad, is a miss."""

    folder = None  # a tmp_path, set by the test

    def __init__(self):
        super().__init__()
        self.path = self.folder / f"m{time.monotonic_ns()}.index"
        self.st = SlotTable(M_CAP, M_ROWS, SlotIndexFile(self.path, M_CAP, M_ROWS, "inst0"))
        self.arena = np.zeros((M_CAP, WIDTH), np.uint8)
        self.gen, self.id_of, self.map = map_index(self.path, M_CAP, M_ROWS, "inst0")
        self.ready: dict[int, int] = {}  # READY rows: id -> slot
        self.fills: list[Fill] = []
        self.writing: list[int] = []     # slots being rewritten in place
        self.bad: dict[int, int] = {}    # rows of a bad block: id -> slot

    def teardown(self):
        self.gen = self.id_of = self.map = None
        self.st.close()

    @rule(data=st.data(), n=st.integers(1, 5))
    def fill(self, data, n):
        """Stage 1 (lock held): claim n slots (free first, then victims among READY and bad rows
        nobody is writing), map the missing ids to them; the fill writes half of each row."""
        resident = set(self.ready) | set(self.bad) | {int(x) for f in self.fills for x in f.ids}
        ids = data.draw(st.lists(st.integers(0, M_ROWS - 1).filter(lambda x: x not in resident), min_size=n,
                                 max_size=n, unique=True))
        got = self.st.take_free(n)
        victims = {x: s for x, s in (self.ready | self.bad).items() if s not in self.writing}
        need = min(n - got.size, len(victims))
        if need:
            out = data.draw(st.lists(st.sampled_from(sorted(victims)), min_size=need, max_size=need, unique=True))
            gone = np.array([victims[x] for x in out], np.int64)
            self.st.unmap(gone)
            for x in out:
                (self.ready if x in self.ready else self.bad).pop(x)
            got = np.concatenate([got, gone])
        if not got.size:
            return
        ids = np.array(ids[:got.size], np.int64)  # as many as there were slots to claim
        self.st.assign(got, ids)
        self.st.pin(got)
        self.arena[got, :WIDTH // 2] = _row(ids)[:, :WIDTH // 2]
        self.fills.append(Fill(len(self.fills) + 1, ids, got))

    @precondition(lambda self: self.fills)
    @rule(data=st.data(), ok=st.booleans())
    def finish(self, data, ok):
        """Stage 3 (lock held): the fill's rows are whole and READY; or its read failed and its
        slots go back to the free stack, unmapped."""
        fill = self.fills.pop(data.draw(st.integers(0, len(self.fills) - 1)))
        if ok:
            self.arena[fill.slots] = _row(fill.ids)
            self.st.ready(fill.slots)
            self.ready |= dict(zip(fill.ids.tolist(), fill.slots.tolist()))
        else:
            self.st.unmap(fill.slots)
            self.st.put_free(fill.slots)
        self.st.unpin(fill.slots)

    @precondition(lambda self: set(self.ready.values()) - set(self.writing))
    @rule(data=st.data())
    def begin_rewrite(self, data):
        """A repair in place (CacheRepair.verify_rows): gen odd, then other bytes for a while."""
        s = data.draw(st.sampled_from(sorted(set(self.ready.values()) - set(self.writing))))
        self.st.begin_write(np.array([s]))
        self.arena[s] = 255
        self.writing.append(s)

    @precondition(lambda self: self.writing)
    @rule()
    def end_rewrite(self):
        slots = np.array(self.writing, np.int64)
        self.arena[slots] = _row(self.st.id_of[slots])
        self.st.end_write(slots)
        self.writing = []

    @precondition(lambda self: set(self.ready.values()) - set(self.writing))
    @rule(data=st.data())
    def mark_bad(self, data):
        """A READY row of a cold block found bad: gen odd (CacheRepair.mark), mapped still."""
        x = data.draw(st.sampled_from(sorted(x for x, s in self.ready.items() if s not in self.writing)))
        self.st.gen[self.ready[x]] |= np.uint32(1)
        self.bad[x] = self.ready.pop(x)

    @invariant()
    def a_client_reads_exactly_the_ready_rows(self):
        self.st.check(self.fills)
        ids = np.arange(M_ROWS, dtype=np.int64)
        slots = self.map.find(ids)
        held = self.ready | self.bad | {int(x): int(s) for f in self.fills for x, s in zip(f.ids, f.slots)}
        assert slots.tolist() == [held.get(x, -1) for x in range(M_ROWS)], "the client's probe is not the index"
        out = np.zeros((M_ROWS, WIDTH), np.uint8)
        where, kept = local_reads._read_hits(ids, slots, self.gen, self.id_of, self.arena, out,
                                             local_reads._seen_bitmap(M_CAP))
        want = sorted(x for x, s in self.ready.items() if s not in self.writing)
        assert sorted(kept.tolist()) == want, "a client kept a row not READY, or missed a READY one"
        hit = np.setdiff1d(ids, ids[where])
        assert np.array_equal(out[hit], _row(hit)), "a client kept another row's bytes"


@pytest.mark.parametrize("path", ["compiled", "numpy"])
def test_a_client_reads_the_ready_rows_of_an_index_published_and_retired_as_the_engine_does(tmp_path, path,
                                                                                              numpy_path):
    if path == "numpy":
        numpy_path(local_reads, "_READ")
    SlotIndexMachine.folder = tmp_path
    run_state_machine_as_test(SlotIndexMachine, settings=MACHINE)
    assert not list(tmp_path.iterdir()), "an index file was left behind"


def _header(path, offset: int, value: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(value)


@pytest.mark.parametrize("offset, value", [(0, b"TSINDEX2"), (16, (CAP + 1).to_bytes(8, "little")),
                                           (24, (ROWS * 2).to_bytes(8, "little")), (32, b"inst1")],
                         ids=["format", "slots", "rows", "instance"])
def test_check_names_a_header_that_does_not_describe_the_file(table, offset, value):
    st_, arena, path = table
    _fill(st_, arena, [1, 2])
    st_.index.check()
    _header(path, offset, value)
    with pytest.raises(BrokenInvariant) as e:
        st_.check()
    assert (e.value.structure, e.value.invariant, e.value.at) == ("slot index", "the header describes the file",
                                                                 "the header")


def test_check_names_a_broken_invariant_of_the_index_as_a_client_sees_it(table):
    """The index's own arrays: an EMPTY slot gen even, through the writer's file."""
    st_, arena, path = table
    slots = _fill(st_, arena, [1, 2])
    st_.unmap(slots[:1])
    st_.put_free(slots[:1])
    st_.gen[slots[0]] = 4
    with pytest.raises(BrokenInvariant, match=f"slot index: a slot holding no row has an odd gen, broken at slot "
                                              f"{slots[0]} "):
        st_.index.check()
