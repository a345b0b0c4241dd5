"""Cache mode's memory is O(slots): a cached table's slot table, id -> slot map and policy state,
hint table included, fit 31 B a slot, nothing per row (docs/architecture.md, memory beyond the arena)."""
from __future__ import annotations

import numpy as np

from tierstore.cache.policy import make_policy
from tierstore.cache.slot_index import SlotIndexFile
from tierstore.cache.slot_table import SlotTable

# the scale users run: a 64 M-row table of 264-B rows with 2 GiB of arena (8.13 M slots); at
# this size the hint table's fixed part (its ring of end counts, ~1 MiB) weighs what it does there
SLOTS, ROWS = (2 << 30) // 264, 64 << 20
BOUND = 31  # B a slot (30.8 with a hint): 12% of a 264-B row is 31.7; pins keep two bytes (slot_table.py)
SKETCH = 8  # B a slot of it for frequency (PolicyConfig.sketch_width x sketch_depth four-bit counters)


def _bytes_a_slot(st: SlotTable, policy) -> float:
    return (st.held_bytes + policy.held_bytes()) / st.capacity


def test_a_cached_tables_state_is_at_most_31_bytes_a_slot_with_hints_whatever_its_rows(tmp_path):
    idx = SlotIndexFile(tmp_path / "t.index", SLOTS, ROWS)
    st = SlotTable(SLOTS, ROWS, idx)
    try:
        policy = make_policy(SLOTS, ROWS, slot_id=st.id_of)  # as CacheEngine builds them
        assert _bytes_a_slot(st, policy) <= BOUND
        assert policy.sketch.nbytes <= SKETCH * SLOTS + 64  # rounded up to a whole 64-B block
        # the same arena over 64 x fewer rows holds exactly as much: nothing is per row
        small = SlotTable(SLOTS, ROWS // 64)
        assert small.held_bytes + make_policy(SLOTS, ROWS // 64, slot_id=small.id_of).held_bytes() == \
            st.held_bytes + policy.held_bytes()
        del small
        # and serving changes none of it, a prefetch hint of ids not resident included (its table
        # is made by the first such hint, at its full size)
        ids = np.unique(np.random.default_rng(0).integers(0, ROWS, 200_000))
        slots = st.take_free(ids.size)
        st.assign(slots, ids)
        st.ready(slots)
        policy.record(ids)
        policy.admitted(slots, ids)
        policy.expect(slots[:1000], steps=8)
        policy.expect(np.zeros(0, np.int64), ids=np.setdiff1d(np.arange(10_000), ids), steps=64, conn_id=b"w")
        assert policy._pending.total > 0, "the hint left nothing pending"
        policy.victims(5000, st.pins)
        assert _bytes_a_slot(st, policy) <= BOUND
    finally:
        st.close()
