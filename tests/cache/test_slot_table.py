"""SlotTable: a slot's state read from id_of and gen, pins that saturate by refusing, and
check(): the table's invariants kept through any sequence of the engine's operations, and
each one named when it is broken."""
import numpy as np
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from tierstore.cache import slot_map as slot_map_mod, slot_table as slots_mod
from tierstore.cache.slot_table import PIN_MAX, Fill, PinsSaturated, SlotTable
from tierstore.errors import BrokenInvariant, ResourceExhausted


def _filled(ids):
    table = SlotTable(16, 1000)
    slots = table.take_free(len(ids))
    table.assign(slots, np.asarray(ids, np.int64))
    return table, slots


def test_a_slot_is_empty_filling_then_ready_and_empty_again():
    table, slots = _filled([5, 9])
    assert table.is_filling(slots).all() and not table.is_ready(slots).any()
    table.ready(slots)
    assert table.is_ready(slots).all() and not table.is_filling(slots).any()
    table.begin_write(slots[:1])  # a rewrite in place: not READY until it ends
    assert not table.is_ready(slots[:1]).any()
    table.end_write(slots[:1])
    table.unmap(slots)
    assert not table.is_ready(slots).any() and not table.is_filling(slots).any()
    free = table.take_free(16)
    assert not table.is_ready(free).any() and not table.is_filling(free).any()


@pytest.mark.parametrize("path", ["compiled", "numpy"])
def test_a_pin_past_the_most_a_slot_counts_is_refused_and_changes_nothing(path, numpy_path):
    if path == "numpy":
        numpy_path(slots_mod, "_PIN", "_FIND_PIN")
    table, slots = _filled([5, 9])
    table.ready(slots)
    table.pin(slots[:1], times=PIN_MAX - 1)
    got, hit, filling = table.find_pin(np.array([5, 9, 11]))  # slot of 5 reaches PIN_MAX
    assert filling == 0 and np.array_equal(hit, slots) and table.pins[slots[0]] == PIN_MAX
    before = (table.pins.copy(), table.n_pinned)
    with pytest.raises(PinsSaturated, match="release finished steps") as e:
        table.find_pin(np.array([5, 9]))
    assert isinstance(e.value, ResourceExhausted)  # the engine's lease refusal
    with pytest.raises(PinsSaturated):
        table.pin(slots)
    assert np.array_equal(table.pins, before[0]) and table.n_pinned == before[1], "a refused pin changed a count"
    table.unpin(slots[:1])  # one lease ends: the row is pinned again, no wrap to 0
    table.find_pin(np.array([5]))
    assert table.pins[slots[0]] == PIN_MAX and table.n_pinned == 2


# ---- check(): a state machine of the engine's operations, and each invariant broken by hand ----
CAP, ROWS = 20, 60
# deterministic (a seed from the test's name, no example database), short, no deadline on a loaded host
MACHINE = settings(max_examples=40, stateful_step_count=30, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.function_scoped_fixture])


class SlotTableMachine(RuleBasedStateMachine):
    """The slot table's public operations in the orders the engine makes them (its `_claim`,
    `_reserve`, `_complete`, `_drop_fill`, `CacheRepair.mark`, `CacheRepair.verify_rows`), one operation a rule,
    against a model of every slot; check() after each, given the fills in flight and the
    slots claimed off the free stack."""

    def __init__(self):
        super().__init__()
        self.table = SlotTable(CAP, ROWS)
        self.stack = list(range(CAP))[::-1]  # the free stack, its top last
        self.state = ["free"] * CAP          # free, claimed, filling, ready, writing, bad
        self.slot_of: dict[int, int] = {}    # id -> slot
        self.pins = np.zeros(CAP, np.int64)
        self.fills: list[Fill] = []
        self.steps: list[np.ndarray] = []    # slots a step pinned (one pin each), until it unpins
        self.gen = self.table.gen.copy()
        self.id_of = self.table.id_of.copy()

    def _become(self, slots, state: str) -> None:
        for s in np.asarray(slots).tolist():
            self.state[s] = state

    def _in(self, *states) -> list[int]:
        return [s for s in range(CAP) if self.state[s] in states]

    @staticmethod
    def _some(data, pool: list[int], most: int = CAP) -> np.ndarray:
        return np.array(data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=most, unique=True)), np.int64)

    @rule(k=st.integers(1, 6))
    def take_free(self, k):
        got = self.table.take_free(k)
        want = [self.stack.pop() for _ in range(min(k, len(self.stack)))]
        assert got.tolist() == want, "take_free pops the free stack, top first"
        self._become(want, "claimed")

    @precondition(lambda self: self._in("ready", "bad"))
    @rule(data=st.data())
    def evict(self, data):
        """A victim: a resident row nobody pins (the policy skips pinned slots)."""
        pool = [s for s in self._in("ready", "bad") if self.pins[s] == 0]
        if not pool:
            return
        slots = self._some(data, pool)
        self.table.unmap(slots)
        self.slot_of = {x: s for x, s in self.slot_of.items() if s not in slots}
        self._become(slots, "claimed")

    @precondition(lambda self: self._in("claimed"))
    @rule(data=st.data())
    def put_free(self, data):
        slots = self._some(data, self._in("claimed"))
        self.table.put_free(slots)
        self.stack += slots.tolist()
        self._become(slots, "free")

    @precondition(lambda self: self._in("claimed"))
    @rule(data=st.data())
    def assign(self, data):
        """A fill: claimed slots mapped to rows not resident, pinned by the fill."""
        slots = self._some(data, self._in("claimed"))
        ids = data.draw(st.lists(st.integers(0, ROWS - 1).filter(lambda x: x not in self.slot_of),
                                 min_size=slots.size, max_size=slots.size, unique=True))
        ids = np.array(ids, np.int64)
        self.table.assign(slots, ids)
        self.table.pin(slots)
        self.fills.append(Fill(len(self.fills) + 1, ids, slots))
        self.pins[slots] += 1
        for s, x in zip(slots.tolist(), ids.tolist()):
            self.slot_of[x], self.state[s] = s, "filling"

    @precondition(lambda self: self.fills)
    @rule(data=st.data(), ok=st.booleans())
    def finish_fill(self, data, ok):
        """Its rows read (READY, the fill's pin dropped), or its read failed (unmapped, the
        fill's pin dropped, freed; pins its steps hold stay until they release them)."""
        fill = self.fills.pop(data.draw(st.integers(0, len(self.fills) - 1)))
        if ok:
            self.table.ready(fill.slots)
            self.table.unpin(fill.slots)
        else:
            self.table.unmap(fill.slots)
            self.table.unpin(fill.slots)
            self.table.put_free(fill.slots)
            self.stack += fill.slots.tolist()
            for x in fill.ids.tolist():
                del self.slot_of[x]
        self.pins[fill.slots] -= 1
        self._become(fill.slots, "ready" if ok else "free")

    @rule(ids=st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=12, unique=True))
    def find_pin(self, ids):
        """A step: its resident rows pinned once."""
        ids = np.sort(np.array(ids, np.int64))
        slots, hit, filling = self.table.find_pin(ids)
        want = np.array([self.slot_of.get(x, -1) for x in ids.tolist()])
        assert slots.tolist() == want.tolist()
        assert sorted(hit.tolist()) == sorted(want[want >= 0].tolist())
        assert filling == sum(self.state[s] in ("filling", "writing", "bad") for s in want[want >= 0].tolist())
        self.pins[hit] += 1
        self.steps.append(hit.astype(np.int64))

    @precondition(lambda self: self.steps)
    @rule(data=st.data())
    def unpin(self, data):
        """A step's lease ends."""
        slots = self.steps.pop(data.draw(st.integers(0, len(self.steps) - 1)))
        self.table.unpin(slots)
        self.pins[slots] -= 1

    @precondition(lambda self: self._in("ready"))
    @rule(data=st.data())
    def begin_write(self, data):
        slots = self._some(data, self._in("ready"))
        self.table.begin_write(slots)
        self._become(slots, "writing")

    @precondition(lambda self: self._in("writing"))
    @rule()
    def end_write(self):
        slots = np.array(self._in("writing"), np.int64)
        self.table.end_write(slots)
        self._become(slots, "ready")

    @precondition(lambda self: self._in("ready"))
    @rule(data=st.data())
    def mark_bad(self, data):
        """A READY row of a cold block found bad: gen odd, as CacheRepair.mark does."""
        slots = self._some(data, self._in("ready"))
        self.table.gen[slots] |= np.uint32(1)
        self._become(slots, "bad")

    @invariant()
    def checked_and_as_modelled(self):
        table = self.table
        table.check(self.fills, self._in("claimed"))
        gen, id_of = table.gen.copy(), table.id_of.copy()
        assert table.n_free == len(self.stack) and table.pins.tolist() == self.pins.tolist()
        assert table.n_pinned == np.count_nonzero(self.pins)
        assert table.find(np.arange(ROWS)).tolist() == [self.slot_of.get(x, -1) for x in range(ROWS)]
        assert table.is_ready(np.arange(CAP)).tolist() == [s == "ready" for s in self.state]
        assert table.is_filling(np.arange(CAP)).tolist() == [s in ("filling", "writing", "bad") for s in self.state]
        # the seqlock: gen never goes back, and a slot whose gen stayed even holds the same row
        assert (gen >= self.gen).all()
        same = (gen == self.gen) & ((gen & 1) == 0)
        assert (id_of[same] == self.id_of[same]).all(), "a row changed under an even, unchanged gen"
        self.gen, self.id_of = gen, id_of


@pytest.mark.parametrize("path", ["compiled", "numpy"])
def test_the_slot_table_keeps_its_invariants_through_the_engines_operations(path, numpy_path):
    if path == "numpy":
        numpy_path(slots_mod, "_PIN", "_FIND_PIN", "_TAKE", "_PUT", "_STACK")
        numpy_path(slot_map_mod, "_FIND", "_INSERT", "_DELETE")
    run_state_machine_as_test(SlotTableMachine, settings=MACHINE)


def _resident(n_ready=3, n_filling=2):
    """A table with READY rows 0.. and a fill of the next rows in flight: (table, READY slots, fill)."""
    table = SlotTable(CAP, ROWS)
    ready = table.take_free(n_ready)
    table.assign(ready, np.arange(n_ready))
    table.ready(ready)
    new = table.take_free(n_filling)
    fill = Fill(7, np.arange(n_ready, n_ready + n_filling), new)
    table.assign(new, fill.ids)
    table.pin(new)
    table.check([fill])
    return table, ready, fill


def _empty_entry(table) -> int:
    return int(np.flatnonzero(table.map.table == np.iinfo(table.map.table.dtype).max)[0])


def _entry_of(table, slot) -> int:
    entries = table.map.table
    full = entries != np.iinfo(entries.dtype).max
    return int(np.flatnonzero(full & (entries & ((1 << table.map.slot_bits) - 1) == slot))[0])


def _gen_even(table, ready, fill):
    table.ready(table.take_free(1))  # ready() of a slot never assigned
    return "a slot holding no row has an odd gen", "slot 5"


def _id_past_rows(table, ready, fill):
    table.id_of[ready[1]] = ROWS
    return "every row id held is below the table's rows", f"slot {ready[1]}"


def _two_slots_one_id(table, ready, fill):
    table.id_of[ready[2]] = 0
    return "one slot per id", "id 0"


def _entry_past_capacity(table, ready, fill):
    e = _empty_entry(table)
    table.map.table[e] = CAP
    return "each map entry names a slot below capacity", f"entry {e}"


def _entry_to_empty_slot(table, ready, fill):
    e = _empty_entry(table)
    table.map.table[e] = 6
    return "each map entry names a slot holding a row", f"entry {e}"


def _two_entries_one_slot(table, ready, fill):
    table.map.table[_empty_entry(table)] = table.map.table[_entry_of(table, ready[0])]
    return "one map entry per slot", f"slot {ready[0]}"


def _entry_lost(table, ready, fill):
    table.map.table[_entry_of(table, ready[1])] = np.iinfo(table.map.table.dtype).max
    return "every row held is found by a probe from its home entry", "id 1"


def _freed_twice(table, ready, fill):
    table.unmap(ready[:1])
    table.put_free(ready[:1])
    table.put_free(ready[:1])
    return "the free stack is a chain of n_free slots from its top to its bottom", f"slot {ready[0]}"


def _stack_short(table, ready, fill):
    table.n_free += 1
    return "the free stack is a chain of n_free slots from its top to its bottom", "the bottom"


def _threads_off_the_stack(table, ready, fill):
    a, b = table.take_free(2)  # two claimed slots naming each other: a ring the top never reaches
    table.id_of[a], table.id_of[b] = -2 - b, -2 - a
    return "every slot threading the free stack is on it", f"slot {a}"


def _slot_lost(table, ready, fill):
    table.unmap(ready[:1])  # unmapped, then neither assigned nor put back
    return "an EMPTY slot off the free stack is claimed", f"slot {ready[0]}"


def _n_pinned_off(table, ready, fill):
    table.pins[ready[0]] = 1
    return "n_pinned counts the slots with pins", "n_pinned 2"


def _fill_ready(table, ready, fill):
    table.ready(fill.slots[1:])
    return "a fill's slots are FILLING with its ids", f"slot {fill.slots[1]}"


def _fill_unpinned(table, ready, fill):
    table.unpin(fill.slots[:1])
    return "a fill's slots are pinned (by the fill)", f"slot {fill.slots[0]}"


@pytest.mark.parametrize("corrupt", [_gen_even, _id_past_rows, _two_slots_one_id, _entry_past_capacity,
                                     _entry_to_empty_slot, _two_entries_one_slot, _entry_lost, _freed_twice,
                                     _stack_short, _threads_off_the_stack, _slot_lost, _n_pinned_off, _fill_ready,
                                     _fill_unpinned], ids=lambda f: f.__name__.strip("_"))
def test_check_names_each_broken_invariant_and_where(corrupt):
    table, ready, fill = _resident()
    invariant, at = corrupt(table, ready, fill)
    with pytest.raises(BrokenInvariant) as e:
        table.check([fill])
    assert (e.value.structure, e.value.invariant, e.value.at) == ("slot table", invariant, at)
    assert isinstance(e.value, AssertionError) and "a tierstore bug" in str(e.value)


def test_check_names_a_claimed_slot_on_the_free_stack_and_a_slot_in_two_fills():
    table, ready, fill = _resident()
    with pytest.raises(BrokenInvariant, match="a claimed slot is EMPTY and off the free stack, broken at slot 5"):
        table.check([fill], claimed=[5])
    with pytest.raises(BrokenInvariant, match=f"a slot is in one fill at most, broken at slot {fill.slots[0]}"):
        table.check([fill, Fill(8, fill.ids[:1], fill.slots[:1])])
