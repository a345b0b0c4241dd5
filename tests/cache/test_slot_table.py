"""SlotTable: a slot's state read from id_of and gen, and pins that saturate by refusing."""
import numpy as np
import pytest

from tierstore.cache import slot_table as slots_mod
from tierstore.cache.slot_table import PIN_MAX, PinsSaturated, SlotTable
from tierstore.errors import ResourceExhausted


def _filled(ids):
    st = SlotTable(16, 1000)
    slots = st.take_free(len(ids))
    st.assign(slots, np.asarray(ids, np.int64))
    return st, slots


def test_a_slot_is_empty_filling_then_ready_and_empty_again():
    st, slots = _filled([5, 9])
    assert st.is_filling(slots).all() and not st.is_ready(slots).any()
    st.ready(slots)
    assert st.is_ready(slots).all() and not st.is_filling(slots).any()
    st.begin_write(slots[:1])  # a rewrite in place: not READY until it ends
    assert not st.is_ready(slots[:1]).any()
    st.end_write(slots[:1])
    st.unmap(slots)
    assert not st.is_ready(slots).any() and not st.is_filling(slots).any()
    free = st.take_free(16)
    assert not st.is_ready(free).any() and not st.is_filling(free).any()


@pytest.mark.parametrize("path", ["compiled", "numpy"])
def test_a_pin_past_the_most_a_slot_counts_is_refused_and_changes_nothing(path, numpy_path):
    if path == "numpy":
        numpy_path(slots_mod, "_PIN", "_LOOKUP_PIN")
    st, slots = _filled([5, 9])
    st.ready(slots)
    st.pin(slots[:1], times=PIN_MAX - 1)
    got, hit, filling = st.lookup_pin(np.array([5, 9, 11]))  # slot of 5 reaches PIN_MAX
    assert filling == 0 and np.array_equal(hit, slots) and st.pins[slots[0]] == PIN_MAX
    before = (st.pins.copy(), st.n_pinned)
    with pytest.raises(PinsSaturated, match="release finished steps") as e:
        st.lookup_pin(np.array([5, 9]))
    assert isinstance(e.value, ResourceExhausted)  # the engine's lease refusal
    with pytest.raises(PinsSaturated):
        st.pin(slots)
    assert np.array_equal(st.pins, before[0]) and st.n_pinned == before[1], "a refused pin changed a count"
    st.unpin(slots[:1])  # one lease ends: the row is pinned again, no wrap to 0
    st.lookup_pin(np.array([5]))
    assert st.pins[slots[0]] == PIN_MAX and st.n_pinned == 2
