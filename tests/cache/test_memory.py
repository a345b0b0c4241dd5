"""Cache mode's memory is O(slots): a cached table's slot table, id -> slot map and policy
state fit 32 B a slot, nothing per row (docs/architecture.md, memory beyond the arena)."""
from __future__ import annotations

import numpy as np

from tierstore.cache.policy import make_policy
from tierstore.cache.slot_index import SlotIndexFile
from tierstore.cache.slot_table import SlotTable

SLOTS, ROWS = 1 << 20, 64 << 20  # the users' ratio: an 8.1 M-slot arena over 64 M rows, scaled down


def _bytes_a_slot(st: SlotTable, policy) -> float:
    return (st.held_bytes + policy.held_bytes()) / st.capacity


def test_a_cached_tables_state_is_at_most_32_bytes_a_slot_whatever_its_rows(tmp_path):
    idx = SlotIndexFile(tmp_path / "t.index", SLOTS, ROWS)
    st = SlotTable(SLOTS, ROWS, idx)
    try:
        policy = make_policy(SLOTS, ROWS, slot_id=st.id_of)  # as CacheEngine builds them
        assert _bytes_a_slot(st, policy) <= 32
        # the same arena over 64 x fewer rows holds exactly as much: nothing is per row
        small = SlotTable(SLOTS, ROWS // 64)
        assert small.held_bytes + make_policy(SLOTS, ROWS // 64, slot_id=small.id_of).held_bytes() == \
            st.held_bytes + policy.held_bytes()
        # and serving changes none of it (the queues, hint ends and links are the arena's size)
        ids = np.unique(np.random.default_rng(0).integers(0, ROWS, 200_000))
        slots = st.take_free(ids.size)
        st.assign(slots, ids)
        st.ready(slots)
        policy.record(ids)
        policy.admitted(slots, ids)
        policy.expect(slots[:1000], steps=8)
        policy.victims(5000, st.pins)
        assert _bytes_a_slot(st, policy) <= 32
    finally:
        st.close()
