"""Cache-mode DRAM state, all of it O(slots): which row each arena slot holds
(slot_table), the id -> slot hash map (slot_map), the slot index clients on the host
read through (slot_index), the leases that pin a step's slots (leases), and
which slot to evict (policy/).
"""
