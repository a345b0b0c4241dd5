"""Arenas on huge pages wherever the directory's mount gives them; 4 KiB and one line saying what to set elsewhere.

The mounts are real: a tmpfs mounted here with each `huge=` option (needs root,
as `mount` does; skipped otherwise), a sidecar serving into it and this process
mapping the arena as a client does, its page sizes read from /proc/self/smaps.
"""
from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest

from tierstore.client.client import Client
from tierstore.sidecar.launcher import SidecarProcess
from tierstore.tiers.dram import Arena, huge_page_bytes, page_backing


@pytest.fixture
def tmpfs(tmp_path):
    """tmpfs(huge) -> a fresh tmpfs of 256 MiB mounted with huge=`huge`, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = []

    def mount(huge: str):
        point = tmp_path / f"shm-{huge}"
        point.mkdir(mode=0o700)
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size=256m,mode=0700,huge={huge}", "tmpfs", str(point)],
                              capture_output=True, text=True)
        if proc.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


def _huge_pages_granted(point) -> bool:
    """Whether the kernel hands this tmpfs huge pages now (memory can be too fragmented to)."""
    a = Arena(point / "probe", 4096, 1024)
    a.publish()
    try:
        a.rows[:] = 1
        return huge_page_bytes(a.path)[0] > 0
    finally:
        a.close()


def test_the_mount_decides_the_pages(tmpfs, tmp_path):
    assert page_backing(tmpfs("within_size")).how == "thp"
    assert page_backing(tmpfs("always")).how == "thp"
    assert page_backing(tmpfs("advise")).how == "thp-advise"
    plain = page_backing(tmpfs("never"))
    assert plain.how == "4k" and plain.page == 4096
    assert "huge=within_size" in plain.why and "hugetlbfs" in plain.why  # what to set, in the one line


@pytest.mark.parametrize("huge", ["within_size", "advise"])
def test_a_served_arena_is_on_huge_pages_in_the_sidecar_and_in_its_clients(tmpfs, make_table, data_dir, huge):
    point = tmpfs(huge)
    if not _huge_pages_granted(point):
        pytest.skip("the kernel grants no huge pages now (fragmented memory)")
    _, rows = make_table("t", rows=48 * 1024, row_bytes=256)  # 12 MiB: six huge pages
    with SidecarProcess(data_dir, dram_budget="64MiB", extra_args=["--shm-dir", point]) as sc, \
            Client(sc.socket) as c:
        ids = np.random.default_rng(3).integers(0, rows.shape[0], 5000)
        assert np.array_equal(c.lookup("t", ids), rows[ids])
        h = c.handle("t")
        assert h.full_resident and str(h._arena_path).startswith(str(point))
        huge_bytes, mapped = huge_page_bytes(h._arena_path)
        assert mapped >= rows.nbytes and huge_bytes >= rows.nbytes // 2, (huge_bytes, mapped)
        assert "% of it on 2 MiB pages" in sc.log() and "use 4 KiB pages" not in sc.log()


def test_without_huge_pages_the_sidecar_says_what_to_set(tmpfs, make_table, data_dir):
    point = tmpfs("never")
    _, rows = make_table("t", rows=4096, row_bytes=256)
    with SidecarProcess(data_dir, dram_budget="16MiB", extra_args=["--shm-dir", point]) as sc, \
            Client(sc.socket) as c:
        assert np.array_equal(c.lookup("t", [0, 4095]), rows[[0, 4095]])
        assert huge_page_bytes(c.handle("t")._arena_path)[0] == 0
        warned = [line for line in sc.log().splitlines() if "use 4 KiB pages" in line]
        assert len(warned) == 1 and "WARNING" in warned[0] and "huge=within_size" in warned[0]
