"""The compiled loops (tierstore/jit.py) agree with their numpy references."""
import numpy as np
import pytest

from tierstore import jit

from tierstore.cache import slot_map, slot_table as slots_mod
from tierstore.jit import first_outside, strictly_increasing
from tierstore.cache.slot_table import SlotTable


def _both(numpy_path, module, names, run):
    compiled = run()
    numpy_path(module, *names)
    return compiled, run()


@pytest.mark.parametrize("ids,n,want", [([], 5, -1), ([0, 4, 2], 5, -1), ([0, 5, -1], 5, 1), ([-3], 5, 0)])
def test_first_outside_names_the_first_bad_id(ids, n, want, numpy_path):
    got = _both(numpy_path, jit, ["_FIRST_OUTSIDE"], lambda: first_outside(np.array(ids, dtype=np.int64), n))
    assert got == (want, want)


@pytest.mark.parametrize("ids,want", [([], True), ([3], True), ([1, 2, 9], True), ([1, 1, 2], False), ([2, 1], False)])
def test_strictly_increasing(ids, want, numpy_path):
    got = _both(numpy_path, jit, ["_INCREASING"], lambda: strictly_increasing(np.array(ids, dtype=np.int64)))
    assert got == (want, want)


def test_slot_table_operations_match_the_reference(numpy_path):
    rng = np.random.default_rng(5)

    def run():
        st = SlotTable(64, 1000)
        out = []
        for step in range(40):
            ids = np.unique(rng.integers(0, 1000, 30))
            slots, hit, filling = st.find_pin(ids)
            miss = ids[slots < 0]
            new = st.take_free(miss.size)
            if new.size < miss.size:  # evict unpinned residents, as the engine's victims would
                old = np.flatnonzero((st.pins == 0) & (st.id_of >= 0))[:miss.size - new.size]
                st.unmap(old)
                new = np.concatenate([new, old])
            miss = miss[:new.size]
            st.assign(new, miss)
            st.pin(new, times=2)
            out.append((slots.copy(), filling, st.n_pinned, st.find(np.arange(1000)), st.is_filling(np.arange(64))))
            st.unpin(hit)
            st.unpin(new)
            st.unpin(new)
            st.ready(new)
        return out, st.pins.copy(), st.n_pinned

    state = rng.bit_generator.state
    compiled = run()
    rng.bit_generator.state = state
    numpy_path(slots_mod, "_PIN", "_FIND_PIN", "_TAKE", "_PUT")
    numpy_path(slot_map, "_FIND", "_INSERT", "_DELETE")
    reference = run()
    steps_c, pins_c, pinned_c = compiled
    steps_r, pins_r, pinned_r = reference
    assert pinned_c == pinned_r == 0 and np.array_equal(pins_c, pins_r) and not pins_c.any()
    for c, r in zip(steps_c, steps_r):
        assert np.array_equal(c[0], r[0]) and c[1:3] == r[1:3]
        assert np.array_equal(c[3], r[3]) and np.array_equal(c[4], r[4])
    assert steps_c[-1][4].any()
