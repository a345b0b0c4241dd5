"""Cache-mode DRAM state: which row each arena slot holds (slot_table), the slot
index local clients read through (slot_index), the leases that pin a step's
slots (leases), and which slot to evict (policy/).
"""
