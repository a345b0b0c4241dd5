"""The slot-sized id -> slot map (tierstore/cache/slot_map.py): a dict under any sequence of
inserts and deletes, compiled and numpy alike, and a reader that races the writer's backward
shifts finds a row's own slot or nothing, never another row's."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tierstore.cache import slot_map
from tierstore.cache.slot_map import MAX_LOAD, SlotMap, map_size

CAP = 48


def _map(cap: int = CAP) -> tuple[SlotMap, np.ndarray]:
    id_of = np.full(cap, -1, dtype=np.int64)
    return SlotMap(SlotMap.empty_table(cap), id_of, cap), id_of


ops = st.lists(st.tuples(st.booleans(), st.integers(0, 2**40)), min_size=1, max_size=300)


@pytest.mark.parametrize("path", ["compiled", "numpy"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seq=ops, probe=st.lists(st.integers(0, 2**40), max_size=40))
def test_the_map_behaves_like_a_dict(path, numpy_path, seq, probe):
    if path == "numpy":
        numpy_path(slot_map, "_FIND", "_INSERT", "_DELETE")
    m, id_of = _map()
    ref: dict[int, int] = {}
    free = list(range(CAP))
    for add, x in seq:
        if add and free and x not in ref:  # the engine maps only missing ids, into free slots
            s = free.pop()
            id_of[s] = x
            m.insert(np.array([x]), np.array([s]))
            ref[x] = s
        elif ref:
            x = sorted(ref)[x % len(ref)]
            s = ref.pop(x)
            m.delete(np.array([x]), np.array([s]))
            id_of[s] = -1
            free.append(s)
    ask = np.array(list(ref) + probe, dtype=np.int64)
    assert m.find(ask).tolist() == [ref.get(int(x), -1) for x in ask]
    full = np.count_nonzero(m.table != np.iinfo(m.table.dtype).max)
    assert full == len(ref) <= MAX_LOAD * map_size(CAP)


class _Recording:
    """A table the interpreted writer loops store into, keeping a copy after every store:
    every state a reader racing them could see."""

    def __init__(self, table):
        self.a, self.seen = table, []
        self.shape, self.dtype = table.shape, table.dtype

    def __getitem__(self, i):
        return self.a[i]

    def __setitem__(self, i, v):
        self.a[i] = v
        self.seen.append(self.a.copy())


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(8, CAP))
def test_a_reader_racing_deletes_finds_the_own_slot_or_nothing(seed, n):
    rng = np.random.default_rng(seed)
    m, id_of = _map()
    ids = rng.choice(1 << 20, size=n, replace=False).astype(np.int64)
    slots = rng.permutation(CAP)[:n].astype(np.int64)
    id_of[slots] = ids
    m.insert(ids, slots)
    gone = rng.permutation(n)[:n // 2]
    rec = _Recording(m.table)
    with np.errstate(over="ignore"):
        slot_map._delete_loop(ids[gone], slots[gone], rec, id_of, *m._args)  # id_of keeps them, as unmap does
    assert rec.seen, "a delete stores"
    for table in rec.seen:
        got = SlotMap(table, id_of, CAP).find(ids)  # the compiled reader on a half-shifted table
        assert np.all((got == slots) | (got == -1)), "a reader found another row's slot"
    kept = np.setdiff1d(np.arange(n), gone)
    assert np.array_equal(m.find(ids[kept]), slots[kept]) and (m.find(ids[gone]) == -1).all()


def test_a_probe_ends_even_on_a_table_with_no_empty_entry():
    """A reader bounds its probe by the table's size, whatever it reads mid-write."""
    m, id_of = _map()
    m.table[:] = 0  # every entry full (slot 0, tag 0), a state no writer leaves
    id_of[0] = 7
    assert m.find(np.array([8, 9], dtype=np.int64)).tolist() == [-1, -1]
