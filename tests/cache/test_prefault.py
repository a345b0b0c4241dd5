"""Per-slot state is faulted in when it is made, not while serving (what a memory cgroup sees)."""
import subprocess
import sys

import numpy as np

from tierstore.cache import prefault


def test_zeros_are_resident_when_made_and_plain_zeros_are_not():
    # in a fresh interpreter: a test process's heap may hold pages earlier tests freed, which
    # an allocation reuses without a fault (seen under pytest-xdist: RssAnon did not move)
    code = (
        "import numpy as np\n"
        "from tierstore.cache import prefault\n"
        "def anon():\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith('RssAnon:'): return int(line.split()[1]) << 10\n"
        "n = 64 << 20\n"
        "before = anon(); lazy = np.zeros(n, np.uint8); grew_lazy = anon() - before\n"
        "before = anon(); eager = prefault.zeros(n, np.uint8); grew_eager = anon() - before\n"
        "assert not eager.any() and eager.dtype == np.uint8 and eager.shape == (n,)\n"
        "print(n, grew_lazy, grew_eager)\n")
    n, grew_lazy, grew_eager = map(int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                       check=True, timeout=120).stdout.split())
    assert grew_lazy < n // 4  # calloc: untouched pages, faulted in (and charged) later
    assert grew_eager > n * 0.9


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
