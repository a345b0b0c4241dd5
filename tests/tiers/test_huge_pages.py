"""Arenas on huge pages by default wherever the host gives them; 4 KiB and one line saying what to set elsewhere.

The mounts and pages are real, and need root (as `mount` does; skipped otherwise):
- a tmpfs mounted here with each `huge=` option (tests/conftest.py), given to the sidecar as --shm-dir;
- a hugetlbfs mount the sidecar finds by itself, made in a private mount namespace
  (`unshare --mount`: no other process on the host sees it, and it goes with the
  namespace), its pages from the host's 2 MiB pool, which the `pool` fixture lets
  allocate a few pages on demand (vm.nr_overcommit_hugepages, restored after).
Sidecars serve into them and a client maps the arena as an engine does; page
sizes are read from /proc/PID/smaps, and what the sidecar reports (Stats, its
start-up lines) must match them.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tierstore.client.client import Client
from tierstore.ingest.writer import write_version
from tierstore.sidecar.launcher import SidecarProcess
from tierstore.tiers.dram import Arena
from tierstore.tiers.pages import arena_backing, huge_page_bytes, hugetlbfs_mounts, page_backing

HUGE = 2 << 20
POOL = Path("/proc/sys/vm/nr_overcommit_hugepages")
POOL_PAGES = 64  # 128 MiB at most, allocated only while a namespace's arenas hold them


def _root_or_skip() -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a filesystem needs root")


def _table(data_dir: Path, rows: int, row_bytes: int = 256, seed: int = 0) -> np.ndarray:
    """A version of table "t" of random fp32 rows in data_dir; its bytes."""
    data = np.random.default_rng(seed).integers(0, 256, size=(rows, row_bytes), dtype=np.uint8)
    write_version(data_dir, "t", (data[i:i + 8192] for i in range(0, rows, 8192)), rows=rows, row_format="fp32",
                  row_dim=row_bytes // 4)
    return data


def _reported(sc: SidecarProcess, c: Client) -> tuple[int, int, int, int]:
    """(page size, bytes on huge pages) that the sidecar's Stats report for table "t", and
    (bytes on huge pages, bytes mapped) of its arena in the sidecar process's smaps."""
    st = next(t for t in c.stats()["tables"] if t["table"] == "t")
    return (int(st["arena_page_bytes"]), int(st["arena_huge_bytes"]),
            *huge_page_bytes(c.handle("t")._arena_path, sc.proc.pid))


def _huge_pages_granted(point) -> bool:
    """Whether the kernel hands this tmpfs huge pages now (memory can be too fragmented to)."""
    a = Arena(point / "probe", 4096, 1024)
    a.publish()
    try:
        a.rows[:] = 1
        return huge_page_bytes(a.path)[0] > 0
    finally:
        a.close()


def _no_usable_hugetlbfs() -> None:
    """Skip where this host has a hugetlbfs mount with free pages: a sidecar would use it."""
    usable = [str(m[0]) for m in hugetlbfs_mounts() if m[2] and m[3]]
    if usable:
        pytest.skip(f"this host's hugetlbfs {', '.join(usable)} has free pages: arenas go there")


# ---- tmpfs: --shm-dir's own mount ---------------------------------------------------------

def test_the_mount_decides_the_pages(tmpfs, tmp_path):
    assert page_backing(tmpfs("within_size")).how == "thp"
    assert page_backing(tmpfs("always")).how == "thp"
    assert page_backing(tmpfs("advise")).how == "thp-advise"
    plain = page_backing(tmpfs("never"))
    assert plain.how == "4k" and plain.page == 4096


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
        page, reported, in_smaps, _ = _reported(sc, c)
        assert page == HUGE and reported == in_smaps >= rows.nbytes // 2
        assert "% of it on 2 MiB pages" in sc.log() and "use 4 KiB pages" not in sc.log()


def test_without_huge_pages_the_sidecar_says_what_to_set(tmpfs, make_table, data_dir):
    _no_usable_hugetlbfs()
    point = tmpfs("never")
    _, rows = make_table("t", rows=4096, row_bytes=256)
    with SidecarProcess(data_dir, dram_budget="16MiB", extra_args=["--shm-dir", point]) as sc, \
            Client(sc.socket) as c:
        assert np.array_equal(c.lookup("t", [0, 4095]), rows[[0, 4095]])
        assert huge_page_bytes(c.handle("t")._arena_path)[0] == 0
        page, reported, in_smaps, mapped = _reported(sc, c)
        assert (page, reported, in_smaps) == (4096, 0, 0) and mapped >= rows.nbytes
        warned = [line for line in sc.log().splitlines() if "use 4 KiB pages" in line]
        assert len(warned) == 1 and "WARNING" in warned[0]
        # what it found, and both fixes, with the numbers for this budget
        assert f"{point} is tmpfs huge=never" in warned[0] and "no hugetlbfs is mounted" in warned[0]
        assert f"remount,huge=within_size {point}" in warned[0] and "vm.nr_hugepages=8" in warned[0]


def test_arena_pages_huge_refuses_to_start_without_them(tmpfs, make_table, data_dir):
    _no_usable_hugetlbfs()
    point = tmpfs("never")
    make_table("t", rows=4096, row_bytes=256)
    sc = SidecarProcess(data_dir, dram_budget="16MiB", extra_args=["--shm-dir", point, "--arena-pages", "huge"])
    try:
        with pytest.raises(RuntimeError, match="--arena-pages huge, but this host gives arenas no huge pages"):
            sc.start()
        assert "huge=within_size" in sc.log() and "vm.nr_hugepages" in sc.log()
        assert list(point.iterdir()) == []  # nothing made
    finally:
        sc.cleanup()


def test_arena_pages_small_asks_for_none(tmpfs, make_table, data_dir):
    advise, always = tmpfs("advise"), tmpfs("always")
    _, rows = make_table("t", rows=48 * 1024, row_bytes=256)
    with SidecarProcess(data_dir, dram_budget="64MiB", extra_args=["--shm-dir", advise, "--arena-pages", "small"]) \
            as sc, Client(sc.socket) as c:
        assert np.array_equal(c.lookup("t", [5, 7]), rows[[5, 7]])
        assert _reported(sc, c)[:3] == (4096, 0, 0)  # no madvise: the advise mount gives none
        assert "use 4 KiB pages" not in sc.log()
    with pytest.raises(ValueError, match="--arena-pages small: .* is tmpfs, huge=always"):
        arena_backing(always, 64 << 20, "small")


# ---- hugetlbfs, found by the sidecar, in a private mount namespace ---------------------------

@pytest.fixture
def pool():
    """Lets the host's 2 MiB pool allocate POOL_PAGES more pages on demand while the test runs."""
    _root_or_skip()
    try:
        before = int(POOL.read_text())
        POOL.write_text(str(before + POOL_PAGES))
    except OSError as e:
        pytest.skip(f"cannot let the hugetlb pool grow ({POOL}: {e.strerror})")
    try:
        yield
    finally:
        POOL.write_text(str(before))


def _in_namespace(fn, tmp_path: Path, **kw) -> None:
    """Run this module's `fn(root=tmp_path, **kw)` in a child process in a private mount
    namespace; its asserts fail the test with the child's output."""
    code = f"import json, runpy, sys; runpy.run_path({__file__!r})[{fn.__name__!r}](**json.loads(sys.argv[1]))"
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", code,
                           json.dumps(dict(root=str(tmp_path), **kw))], capture_output=True, text=True, timeout=300)
    if proc.returncode and "unshare failed" in proc.stderr:
        pytest.skip(f"no private mount namespace here: {proc.stderr.strip()}")
    if proc.returncode == 3 and "SKIP:" in proc.stdout:
        pytest.skip(proc.stdout.split("SKIP:", 1)[1].strip())
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-6000:])


def _mount(root: Path, pool_mib: int) -> tuple[Path, Path]:
    """(a plain tmpfs for --shm-dir, a hugetlbfs of 2 MiB pages limited to pool_mib MiB) under root."""
    shm, huge = root / "shm", root / "huge"
    for point, how in ((shm, "tmpfs -o size=64m,mode=0700,huge=never"),
                       (huge, f"hugetlbfs -o pagesize=2M,size={pool_mib}M,mode=0700")):
        point.mkdir()
        fstype, opts = how.split(" -o ")
        subprocess.run(["mount", "-t", fstype, "-o", opts, "none", str(point)], check=True)
    return shm, huge


def _pages_used(huge: Path) -> int:
    st = os.statvfs(huge)
    return st.f_blocks - st.f_bfree


def ns_default_arenas_go_on_hugetlbfs(root: str) -> None:
    root = Path(root)
    shm, huge = _mount(root, 64)
    probe = huge / "probe"  # the pool may be unable to grow now (fragmented memory)
    fd = os.open(probe, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, HUGE)
    except OSError as e:
        print(f"SKIP: the pool gives no 2 MiB page now ({e.strerror})")
        sys.exit(3)
    finally:
        os.close(fd)
        probe.unlink()
    rows = _table(root / "data", 48 * 1024)  # 12 MiB
    with SidecarProcess(root / "data", dram_budget="24MiB", extra_args=["--shm-dir", shm]) as sc, \
            Client(sc.socket) as c:
        ids = np.random.default_rng(3).integers(0, rows.shape[0], 5000)
        assert np.array_equal(c.lookup("t", ids), rows[ids])
        old = Path(c.handle("t")._arena_path)
        assert old.parent == huge and not [p for p in shm.iterdir() if p.name.endswith(".t.v1")]
        huge_bytes, mapped = huge_page_bytes(old)  # this process, a client: all of it on 2 MiB pages
        assert huge_bytes == mapped >= rows.nbytes, (huge_bytes, mapped)
        page, reported, in_smaps, _ = _reported(sc, c)
        assert page == HUGE and reported == in_smaps >= rows.nbytes
        assert f"arenas on {huge} (hugetlbfs" in sc.log() and "% of it on 2 MiB pages" in sc.log()
        assert "100% of it on 2 MiB pages" in sc.log() and "WARNING" not in sc.log()
        # a live swap: the new arena beside the old, the old let go by the sidecar and the client
        rows2 = _table(root / "data", 48 * 1024, seed=1)
        c.reload("t")
        assert np.array_equal(c.lookup("t", ids), rows2[ids])
        assert Path(c.handle("t")._arena_path).parent == huge
    gc.collect()
    # every page back: no map of a file left behind, in the sidecar or in this client (an unmap
    # of part of a huge page fails, and its pages stay held)
    assert _pages_used(huge) == 0 and not list(huge.iterdir())


def ns_a_killed_sidecars_arena_is_retired_and_removed(root: str) -> None:
    root = Path(root)
    shm, huge = _mount(root, 64)
    rows = _table(root / "data", 4096)
    sock = root / "s.sock"
    first = SidecarProcess(root / "data", sock, dram_budget="8MiB", extra_args=["--shm-dir", shm])
    try:
        with first, Client(first.socket) as c:
            assert np.array_equal(c.lookup("t", [1, 2]), rows[[1, 2]])
            mapped, old = c.handle("t").mapped, Path(c.handle("t")._arena_path)
            assert old.parent == huge and not mapped.retired
            first.kill()
            with SidecarProcess(root / "data", sock, dram_budget="8MiB", extra_args=["--shm-dir", shm]) as second:
                assert mapped.retired  # the new sidecar told the old one's client, through its map
                assert not old.exists() and "removed stale" in second.log()
                with Client(second.socket) as c2:
                    assert np.array_equal(c2.lookup("t", [3]), rows[[3]])
    finally:
        first.cleanup()


def ns_a_pool_too_small_leaves_4k_pages_and_says_so(root: str) -> None:
    root = Path(root)
    shm, huge = _mount(root, 4)  # two pages
    rows = _table(root / "data", 16384)  # 4 MiB: its file is two pages and a header
    with SidecarProcess(root / "data", dram_budget="16MiB", extra_args=["--shm-dir", shm]) as sc, \
            Client(sc.socket) as c:
        assert np.array_equal(c.lookup("t", [0, 16383]), rows[[0, 16383]])
        assert Path(c.handle("t")._arena_path).parent == shm
        assert _reported(sc, c)[:3] == (4096, 0, 0)
        warned = [line for line in sc.log().splitlines() if "use 4 KiB pages" in line]
        assert len(warned) == 1 and f"hugetlbfs {huge} has 2 free 2 MiB pages" in warned[0], sc.log()
        assert "the budget needs 8 2 MiB pages" in warned[0] and "vm.nr_hugepages=" in warned[0]
    # the budget fits, one arena does not (a header past whole pages): it alone goes on 4 KiB pages
    with SidecarProcess(root / "data", dram_budget="4MiB", extra_args=["--shm-dir", shm]) as sc, \
            Client(sc.socket) as c:
        assert np.array_equal(c.lookup("t", [0, 16383]), rows[[0, 16383]])
        assert Path(c.handle("t")._arena_path).parent == shm
        assert "this arena goes on 4 KiB pages" in sc.log() and "reserve more pages" in sc.log()
    assert _pages_used(huge) == 0 and not list(huge.iterdir())


def ns_shm_dir_on_hugetlbfs_is_refused(root: str) -> None:
    root = Path(root)
    _, huge = _mount(root, 8)
    _table(root / "data", 1024)
    sc = SidecarProcess(root / "data", dram_budget="4MiB", extra_args=["--shm-dir", huge])
    try:
        try:
            sc.start()
            raise AssertionError("a sidecar started with --shm-dir on hugetlbfs")
        except RuntimeError:
            pass
        assert f"--shm-dir {huge} is hugetlbfs" in sc.log() and "leave --shm-dir on a tmpfs" in sc.log()
        assert not list(huge.iterdir())
    finally:
        sc.cleanup()


@pytest.mark.parametrize("case", [ns_default_arenas_go_on_hugetlbfs, ns_a_killed_sidecars_arena_is_retired_and_removed,
                                  ns_a_pool_too_small_leaves_4k_pages_and_says_so, ns_shm_dir_on_hugetlbfs_is_refused],
                         ids=lambda f: f.__name__[3:])
def test_hugetlbfs(pool, tmp_path, case):
    _in_namespace(case, tmp_path)
