"""The pages an arena gets: what the host offers, the choice, and what smaps says it got.

Random row gathers from an arena past the TLB's reach (a few MiB of 4 KiB pages)
spend most of their time walking page tables, and a GPU reading it over UVA
suffers more: vLLM keeps its own host Engram tables on 2 MB pages for this
reason. So arenas go on huge pages by default wherever the host gives them,
and on 4 KiB pages elsewhere with one warning that says what to change.

An arena is a named file that clients open by path, that outlives a worker and
that a restarted sidecar re-attaches (--persist-arena), so it needs a
filesystem that gives named files huge pages. Two do (arena_backing, in order):

1. `--shm-dir`'s own mount (default /dev/shm): a tmpfs mounted
   `huge=always|within_size` (transparent huge pages at allocation) or
   `huge=advise` (the sidecar asks with madvise and populates through its
   mapping), or any tmpfs while `shmem_enabled` is `force`.
2. Otherwise a hugetlbfs mount this user can create files in, with enough free
   pages in its pool (reserved, or overcommit) for the DRAM budget: arenas go
   there, the sidecar's small shared files stay in `--shm-dir`. Pool pages are
   never swapped and never split, and a file there takes whole pages.

Not used: memfd_create(MFD_HUGETLB), and shmem THP through `shmem_enabled` +
MADV_HUGEPAGE, which applies to the kernel's internal mount only (memfd, SysV
shm). Both give an unnamed file that dies with the last process holding it:
clients could not open it by path and a restarted sidecar could not re-attach it.

`--arena-pages` (ServeConfig.arena_pages) says how firmly: `auto` (the above,
else 4 KiB with the warning), `huge` (a start that cannot have huge pages fails
with the same words), `small` (4 KiB: no pool page taken, no madvise; a
`--shm-dir` mounted to hand out huge pages by itself is refused).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from tierstore.errors import InvalidArgument, ResourceExhausted

__all__ = ["MODES", "SMALL_PAGE", "MADV_HUGEPAGE", "MADV_POPULATE_WRITE", "PageBacking", "arena_backing",
           "hugetlbfs_mounts", "huge_page_bytes", "page_backing"]

MODES = ("auto", "huge", "small")
SMALL_PAGE = 4096
MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23  # Linux; mmap exposes the first only from 3.8 on some builds
_THP = Path("/sys/kernel/mm/transparent_hugepage")
_POOLS = Path("/sys/kernel/mm/hugepages")


@dataclass(frozen=True)
class PageBacking:
    """How the arenas of one sidecar are paged.

    page: the page size their files get (4096 unless huge); how: "hugetlbfs",
    "thp" (the mount allocates huge pages), "thp-advise" (asked per mapping) or
    "4k"; why: one line for the operator (what to set, when 4k); dir: where
    the arena files are made."""

    page: int
    how: str
    why: str
    dir: Path

    @property
    def huge(self) -> bool:
        return self.page > SMALL_PAGE


def _mounts() -> list[tuple[str, str, list[str]]]:
    """(mount point, filesystem type, super options) of every mount this process sees."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3:
            out.append((fields[4].replace("\\040", " "), tail[0], tail[2].split(",")))
    return out


def _mount_of(path: Path) -> tuple[str, list[str]]:
    """(filesystem type, super options) of the mount holding `path`."""
    target, best, found = str(Path(path).resolve()), -1, ("", [])
    for point, fstype, opts in _mounts():
        if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) > best:
            best, found = len(point), (fstype, opts)
    return found


def _meminfo_kib(key: str) -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _option(opts: list[str], key: str, default: str = "") -> str:
    return next((o.split("=", 1)[1] for o in opts if o.startswith(key + "=")), default)


def _hugetlbfs_page(opts: list[str]) -> int:
    size, units = _option(opts, "pagesize"), {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if size[:-1].isdigit() and size[-1:].upper() in units:
        return int(size[:-1]) * units[size[-1].upper()]
    return (_meminfo_kib("Hugepagesize") << 10) or (2 << 20)


def _shmem_enabled() -> str:
    """The bracketed choice of /sys/kernel/mm/transparent_hugepage/shmem_enabled ('' when absent)."""
    try:
        text = (_THP / "shmem_enabled").read_text()
    except OSError:
        return ""
    return text[text.find("[") + 1:text.find("]")] if "[" in text else ""


def _pool_free(page: int) -> tuple[int, int]:
    """(pages of size `page` a new file can take now, pages reserved in all) of the host's
    hugetlb pool: free and unreserved, plus what overcommit may still allocate."""
    def read(name: str) -> int:
        try:
            return int((_POOLS / f"hugepages-{page >> 10}kB" / name).read_text())
        except (OSError, ValueError):
            return 0

    free = read("free_hugepages") - read("resv_hugepages")
    spare = max(0, read("nr_overcommit_hugepages") - read("surplus_hugepages"))
    return max(0, free) + spare, read("nr_hugepages")


def hugetlbfs_mounts() -> list[tuple[Path, int, int, bool]]:
    """(mount point, page size, pages a new file there can take, writable by this user) of
    every hugetlbfs mount, smallest pages first: the pool's free pages, bounded by the
    mount's own size= limit when it has one."""
    out = []
    for point, fstype, opts in _mounts():
        if fstype != "hugetlbfs":
            continue
        page = _hugetlbfs_page(opts)
        free = _pool_free(page)[0]
        try:
            st = os.statvfs(point)
            if st.f_blocks:  # size= given: the mount's own limit (f_blocks is 0 without one)
                free = min(free, st.f_bavail)
        except OSError:
            continue
        out.append((Path(point), page, free, os.access(point, os.W_OK | os.X_OK)))
    return sorted(out, key=lambda m: m[1])


def page_backing(directory: Path) -> PageBacking:
    """The pages a file made in `directory` gets from its mount alone (dir = directory)."""
    directory = Path(directory)
    fstype, opts = _mount_of(directory)
    if fstype == "hugetlbfs":
        return PageBacking(_hugetlbfs_page(opts), "hugetlbfs", f"{directory} is hugetlbfs: arenas take its pool's "
                           f"pages", directory)
    huge, shmem = _option(opts, "huge", "never"), _shmem_enabled()
    thp = (_meminfo_kib("Hugepagesize") << 10) or (2 << 20)
    if fstype == "tmpfs" and shmem != "deny" and (huge in ("always", "within_size") or shmem == "force"):
        how = "shmem_enabled is force" if shmem == "force" else f"huge={huge}"
        return PageBacking(thp, "thp", f"{directory} is tmpfs, {how}: arenas get transparent huge pages", directory)
    if fstype == "tmpfs" and shmem != "deny" and huge == "advise":
        return PageBacking(thp, "thp-advise", f"{directory} is tmpfs huge=advise: each arena asks for huge pages",
                           directory)
    why = (f"{directory} is {fstype or 'an unknown filesystem'}" + (f" huge={huge}" if fstype == "tmpfs" else "")
           + (" and shmem_enabled is deny" if shmem == "deny" else ""))
    return PageBacking(SMALL_PAGE, "4k", why, directory)


def arena_backing(shm_dir: Path, need: int, mode: str = "auto") -> PageBacking:
    """Where a sidecar with `shm_dir` and a DRAM budget of `need` bytes makes its arenas, and
    on what pages (the module docstring; mode: one of MODES).

    Raises InvalidArgument for a hugetlbfs `shm_dir` (it holds the sidecar's small shared
    files too, which hugetlbfs cannot write) and for `small` where the shm_dir's mount
    gives huge pages by itself; ResourceExhausted for `huge` on a host that gives none.
    Either names the fix; nothing is made."""
    shm_dir = Path(shm_dir)
    if mode not in MODES:
        raise InvalidArgument(f"--arena-pages {mode!r}: one of {', '.join(MODES)}")
    home = page_backing(shm_dir)
    if home.how == "hugetlbfs":
        raise InvalidArgument(
            f"--shm-dir {shm_dir} is hugetlbfs, but it also holds the sidecar's lease board and slot indexes, "
            f"small files hugetlbfs cannot write: leave --shm-dir on a tmpfs (/dev/shm); the sidecar puts its "
            f"arenas on a hugetlbfs mount with free pages by itself")
    if mode == "small":
        if home.how == "thp":
            raise InvalidArgument(f"--arena-pages small: {home.why}, whatever the sidecar asks; point --shm-dir at "
                                  f"a tmpfs mounted without huge= (or huge=never/advise)")
        return PageBacking(SMALL_PAGE, "4k", f"--arena-pages small: arenas in {shm_dir} on 4 KiB pages", shm_dir)
    if home.huge:
        return home
    pools = hugetlbfs_mounts()
    for point, page, free, writable in pools:
        if writable and free * page >= need:
            return PageBacking(page, "hugetlbfs", f"arenas on {point} (hugetlbfs, {free} free {_size(page)} pages): "
                               f"{home.why}, left to the sidecar's small files", point)
    why = _no_huge_pages(home, pools, need)
    if mode == "huge":
        raise ResourceExhausted(f"--arena-pages huge, but this host gives arenas no huge pages: {why}")
    return PageBacking(SMALL_PAGE, "4k", f"arenas use 4 KiB pages: {why}. --arena-pages small keeps them without "
                       f"this warning", shm_dir)


def _no_huge_pages(home: PageBacking, pools: list, need: int) -> str:
    """Why a sidecar gets no huge pages: what it found and what the operator can change."""
    page = (_meminfo_kib("Hugepagesize") << 10) or (2 << 20)
    want = -(-need // page)
    if pools:
        found = "; ".join(f"hugetlbfs {p} has {free} free {_size(size)} pages"
                          + ("" if w else " and is not writable by this user") for p, size, free, w in pools)
    else:
        found = "no hugetlbfs is mounted"
    free, total = _pool_free(page)
    return (f"{home.why}; {found} (the budget needs {want} {_size(page)} pages). Random "
            f"row reads from a large arena, the GPU's over UVA above all, run faster on huge pages. As root: "
            f"`mount -o remount,huge=within_size {home.dir}` (transparent huge pages, nothing reserved), or reserve "
            f"pages with `sysctl vm.nr_hugepages={total + max(0, want - free)}` on a hugetlbfs mount the sidecar's "
            f"user can write (`mount -t hugetlbfs -o pagesize={page >> 20}M,uid={os.getuid()} none "
            f"/dev/hugepages`): the sidecar finds either by itself")


def _size(n: int) -> str:
    return f"{n >> 30} GiB" if n >= 1 << 30 else f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def huge_page_bytes(path: str | Path, pid: int | str = "self", max_age: float = 0.0) -> tuple[int, int]:
    """(bytes mapped on huge pages, bytes mapped) of process `pid`'s mappings of the file
    `path` (/proc/PID/smaps): what a page-size claim is checked against. Transparent huge
    pages count as ShmemPmdMapped/FilePmdMapped; hugetlbfs pages (KernelPageSize above
    4 KiB) as Shared_Hugetlb/Private_Hugetlb, which Rss leaves out.

    max_age: seconds a reading of the same pid's smaps may be reused (the kernel walks
    every mapping's page tables to write it; Stats asks for each table in turn)."""
    want, huge, total, at = str(path), 0, 0, 0
    try:
        text = _smaps(str(pid), max_age)
    except OSError:
        return 0, 0
    while (i := text.find(want, at)) >= 0:  # the file's name ends the first line of each of its mappings
        at = i + len(want)
        start, end = text.rfind("\n", 0, i) + 1, text.find("\n", i)
        end = len(text) if end < 0 else end
        head = text[start:end].rstrip()
        if not (head.endswith(" " + want) or head.endswith(f" {want} (deleted)")):
            continue  # a longer name holding this one
        stop = text.find("VmFlags:", end)  # each mapping's last line
        for line in text[end:len(text) if stop < 0 else stop].splitlines():
            key, _, rest = line.partition(":")
            if key in _COUNTED:
                kib = int(rest.split()[0]) << 10
                total += kib if key in _MAPPED else 0
                huge += kib if key in _HUGE else 0
        at = max(at, stop)
    return huge, total


_last_smaps: tuple[str, float, str] = ("", 0.0, "")  # (pid, when, text)


def _smaps(pid: str, max_age: float) -> str:
    global _last_smaps
    last_pid, when, text = _last_smaps
    now = time.monotonic()
    if last_pid != pid or now - when > max_age:
        text = Path(f"/proc/{pid}/smaps").read_text()
        _last_smaps = (pid, now, text)  # one tuple: a reader on another thread sees old or new, whole
    return text


_MAPPED = ("Rss", "Shared_Hugetlb", "Private_Hugetlb")
_HUGE = ("Shared_Hugetlb", "Private_Hugetlb", "ShmemPmdMapped", "FilePmdMapped")
_COUNTED = _MAPPED + _HUGE
