"""Per-slot state is faulted in when it is made, not while serving (what a memory cgroup sees)."""
import subprocess
import sys
from pathlib import Path

import numpy as np

from tierstore.cache import prefault


def anon_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no RssAnon in /proc/self/status")


def test_zeros_are_resident_when_made_and_plain_zeros_are_not():
    n = 64 << 20
    before = anon_bytes()
    lazy = np.zeros(n, np.uint8)
    assert anon_bytes() - before < n // 4  # calloc: untouched pages, faulted in (and charged) later
    before = anon_bytes()
    eager = prefault.zeros(n, np.uint8)
    assert anon_bytes() - before > n * 0.9
    assert not eager.any() and eager.dtype == np.uint8 and eager.shape == (n,)
    del lazy


def test_resident_keeps_contents_and_leaves_views_alone():
    a = np.arange(3 << 20, dtype=np.int64)
    assert np.array_equal(prefault.resident(a), np.arange(3 << 20, dtype=np.int64))
    strided = a[::3]
    assert prefault.resident(strided) is strided and np.array_equal(strided, np.arange(0, 3 << 20, 3))


def test_a_cache_arenas_slot_state_is_resident_when_made():
    # in a fresh interpreter: memory earlier tests freed would be reused without new faults
    code = (
        "import numpy as np, tierstore.cache.slot_table as st, tierstore.cache.policy.s3fifo as pf\n"
        "def anon():\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith('RssAnon:'): return int(line.split()[1]) << 10\n"
        "cap = 1 << 20\n"
        "before = anon()\n"
        "slots = st.SlotTable(cap, 4 * cap)\n"
        "policy = pf.S3FIFOPolicy(cap, 4 * cap, slot_id=slots.id_of)\n"
        "print(anon() - before, slots.held_bytes + policy.held_bytes())\n")
    grown, held = map(int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                          timeout=120).stdout.split())
    assert grown > 0.95 * held > 16 * (1 << 20)  # all of it: map, ids, gen, pins, state, links, sketch
