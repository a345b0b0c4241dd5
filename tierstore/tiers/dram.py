"""The DRAM tier: a shared arena of rows in /dev/shm.

The sidecar owns the segment (created 0600, so only the serving user can map
it); clients map it read-only and gather rows from it directly. Pages are
reserved up front with posix_fallocate so an arena that does not fit in
/dev/shm fails at start with a clear message instead of a SIGBUS mid-step.

Every arena file starts with a one-page header that clients check per step
(a few bytes, no syscall): the sidecar instance that owns it, the table
version it holds, the host it lives on and a `retired` flag set before the
sidecar stops using it (version swap, shutdown, or a successor found it
stale). Rows start at HEADER_BYTES.

Two layouts of the rows after the header. Interleaved (the default): row i is
bytes [i * row_bytes, (i + 1) * row_bytes). Split (`split=W`, full-resident
fp8-e4m3-ue8m0 tables only): every row's first W bytes (its e4m3 weights) for
all rows in id order, then every row's remaining bytes (its ue8m0 scales) in id
order: byte for byte the host table sglang and vLLM keep (one buffer, weights
first), so an engine maps the arena in place of loading its own copy. The
header records W (0: interleaved), so a client never reads one layout as the
other. Either way the engine and `Client.lookup` see interleaved rows
(`SplitRows.take`).

Pages: an arena is made in the directory its PageBacking names
(tiers/pages.py): huge pages wherever the host gives them (by default), else
4 KiB. On hugetlbfs a file is whole huge pages and takes no write(): the file is
rounded up, and every map and unmap of it (the sidecar's, a client's, a retire)
covers whole pages, so an unmap never fails and leaves pool pages held.

Names are unpredictable (`tierstore.<uid>.<tag>.<random>.<table>.v<N>`):
`tag` is derived from the sidecar's resolved data directory and socket, so two
sidecars never share a file, and another local user can neither guess nor
pre-create the next name (/dev/shm is world-writable).
"""
from __future__ import annotations

import hashlib
import mmap
import os
import stat
import struct
from pathlib import Path

import numpy as np

from tierstore.errors import ResourceExhausted, StaleArena
from tierstore.tiers.pages import MADV_HUGEPAGE, MADV_POPULATE_WRITE, PageBacking, hugetlbfs_mounts, page_backing

__all__ = ["Arena", "ArenaHeader", "HEADER_BYTES", "SplitRows", "arena_tag", "host_id", "map_file_readonly",
           "map_readonly", "map_split_readonly", "own_files", "retire_file", "shm_free_bytes"]

HEADER_BYTES = 4096
_MAGIC = b"TSARENA1"
# magic, retired, full, instance (16 ascii), version, slots, row_bytes, host (16), table (64),
# split (bytes of a row's leading part stored for all rows first; 0: interleaved)
_LAYOUT = struct.Struct("<8sII16sQQI16s64sI")


def host_id() -> bytes:
    """16 bytes naming this boot of this host (an arena of another host never matches)."""
    try:
        return bytes.fromhex(Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", ""))[:16]
    except (OSError, ValueError):
        return hashlib.blake2b(os.uname().nodename.encode(), digest_size=16).digest()


def arena_tag(data_dir: Path, address: str) -> str:
    """Per sidecar identity: its resolved data directory and listening address."""
    key = f"{Path(data_dir).resolve()}\0{address}".encode()
    return hashlib.blake2b(key, digest_size=6).hexdigest()


def own_files(shm_dir: Path, tag: str) -> list[Path]:
    """Files that a sidecar with this tag (and uid) created, live or stale: in shm_dir and in
    every hugetlbfs mount, where its arenas may be (tiers/pages.py)."""
    dirs = dict.fromkeys([Path(shm_dir), *(m[0] for m in hugetlbfs_mounts())])
    return sorted(p for d in dirs for p in d.glob(f"tierstore.{os.getuid()}.{tag}.*"))


def _whole_pages(size: int, st: os.stat_result) -> int:
    """The length to map the first `size` bytes of the file `st` describes with: on hugetlbfs
    (st_blksize, its page, above 4 KiB) rounded up to whole pages, the file's own length
    at most; munmap fails on a part of a huge page, leaving the mapping and its pages held."""
    page = st.st_blksize if st.st_blksize > HEADER_BYTES else 1
    return min(-(-size // page) * page, max(st.st_size, size))


def shm_free_bytes(shm_dir: Path) -> int:
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


class ArenaHeader:
    """The first page of an arena file, read and written in place."""

    def __init__(self, buf):
        self._buf = buf

    def write(self, *, instance: str, version: int, slots: int, row_bytes: int, full: bool, table: str,
              split: int = 0) -> None:
        packed = _LAYOUT.pack(_MAGIC, 0, int(full), instance.encode()[:16], version, slots, row_bytes,
                              host_id(), table.encode()[:64], split)
        self._buf[:_LAYOUT.size] = np.frombuffer(packed, dtype=np.uint8)

    def read(self) -> dict:
        fields = _LAYOUT.unpack_from(self._buf.tobytes()[:_LAYOUT.size])
        magic, retired, full, inst, version, slots, row_bytes, host, table, split = fields
        return dict(magic=magic, retired=bool(retired), full=bool(full), instance=inst.rstrip(b"\0").decode(),
                    version=version, slots=slots, row_bytes=row_bytes, host=host, table=table.rstrip(b"\0").decode(),
                    split=split)

    @property
    def retired(self) -> bool:
        return self._buf[8] != 0

    def retire(self) -> None:
        self._buf[8] = 1


class SplitRows:
    """The rows of a split arena (see the module docstring): `weight` uint8 [slots, split]
    then `scale` uint8 [slots, row_bytes - split], two views of one mapping.

    take/put/range speak interleaved rows (the row format), so the engine, the
    verifier and lookups read a split table exactly as an interleaved one."""

    def __init__(self, data: np.ndarray, slots: int, row_bytes: int, split: int):
        if not 0 < split < row_bytes:
            raise ValueError(f"a split arena's leading part is 1..{row_bytes - 1} bytes of a row, got {split}")
        self.slots, self.row_bytes, self.split = slots, row_bytes, split
        self.weight = data[:slots * split].reshape(slots, split)
        self.scale = data[slots * split:slots * row_bytes].reshape(slots, row_bytes - split)
        # a row as one item of each part: take/put move whole rows, not bytes
        self._item = np.dtype([("w", f"V{split}"), ("s", f"V{row_bytes - split}")])

    def take(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Interleaved rows uint8 [n, row_bytes] of slots `ids` (checked by the caller)."""
        if out is None:
            out = np.empty((len(ids), self.row_bytes), np.uint8)
        items = out.view(self._item)[:, 0]
        items["w"] = self.weight.view(f"V{self.split}")[ids, 0]
        items["s"] = self.scale.view(f"V{self.row_bytes - self.split}")[ids, 0]
        return out

    def range(self, lo: int, hi: int) -> np.ndarray:
        """Interleaved rows [lo, hi) (a copy)."""
        out = np.empty((hi - lo, self.row_bytes), np.uint8)
        out[:, :self.split] = self.weight[lo:hi]
        out[:, self.split:] = self.scale[lo:hi]
        return out

    def put(self, lo: int, rows: np.ndarray) -> None:
        """Write interleaved rows uint8 [n, row_bytes] at slots [lo, lo + n)."""
        n = len(rows)
        self.weight[lo:lo + n] = rows[:, :self.split]
        self.scale[lo:lo + n] = rows[:, self.split:]


class Arena:
    """`slots` rows of `row_bytes` bytes in one shared-memory file.

    Interleaved (split=0): `rows` is a writable uint8 view [slots, row_bytes]
    for the sidecar. Split (split=W, full-resident tables only): `rows` is None
    and `split_rows` holds the weight and scale views (SplitRows); take, put
    and range read and write interleaved rows in either layout.
    New arenas are built under a private `.new` name and renamed into place by
    publish(); `reuse=True` re-opens the file at `path` instead (persisted
    arenas), or returns a fresh one when it does not fit.
    """

    def __init__(self, path: Path, slots: int, row_bytes: int, *, reuse: bool = False,
                 backing: PageBacking | None = None, split: int = 0):
        """backing: how this directory pages arenas (page_backing(path.parent) when None).
        split: 0 for interleaved rows, else the bytes of a row's weights (split layout)."""
        self.path = Path(path)
        self.slots, self.row_bytes = int(slots), int(row_bytes)
        self.split = int(split)
        self.size = self.slots * self.row_bytes
        self.backing = backing or page_backing(self.path.parent)
        page = self.backing.page if self.backing.how == "hugetlbfs" else 1  # hugetlbfs files are whole pages
        self.file_size = -(-(HEADER_BYTES + self.size) // page) * page
        self.reattached = False
        self._staging: Path | None = None
        fd = self._reopen() if reuse else None
        if fd is not None:
            self.reattached = True
        else:
            self._staging = self.path.with_name(self.path.name + ".new")
            try:
                # O_EXCL on an unpredictable name: never someone else's file, never a link
                fd = os.open(self._staging, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            except FileExistsError:
                raise ResourceExhausted(f"arena file {self._staging} already exists (another process made it); "
                                        "restart the sidecar to pick a new name") from None
            try:
                os.fchmod(fd, 0o600)  # umask cannot widen it, but be explicit
                if self.backing.how == "thp-advise":
                    os.ftruncate(fd, self.file_size)  # pages come from the populate below, huge as asked
                else:
                    os.posix_fallocate(fd, 0, self.file_size)
            except OSError as e:
                os.close(fd)
                self._staging.unlink(missing_ok=True)
                raise ResourceExhausted(
                    f"cannot reserve {self.size / 2**20:.1f} MiB for arena {self.path.name} in {self.path.parent} "
                    f"({e.strerror}); lower --dram-budget or enlarge {self.path.parent}") from None
            except BaseException:  # a signal while reserving: the file is ours to remove
                os.close(fd)
                self._staging.unlink(missing_ok=True)
                raise
        try:
            self._mmap = mmap.mmap(fd, self.file_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            if self._staging is not None:
                self._staging.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        if self.backing.how == "thp-advise" and not self.reattached:
            try:
                self._mmap.madvise(MADV_HUGEPAGE)
                self._mmap.madvise(MADV_POPULATE_WRITE)  # reserve now: a full tmpfs fails here, not mid-step
            except OSError as e:
                self._mmap.close()
                self._staging.unlink(missing_ok=True)
                raise ResourceExhausted(
                    f"cannot reserve {self.size / 2**20:.1f} MiB for arena {self.path.name} in {self.path.parent} "
                    f"({e.strerror}); lower --dram-budget or enlarge {self.path.parent}") from None
        whole = np.frombuffer(self._mmap, dtype=np.uint8)
        self.header = ArenaHeader(whole[:HEADER_BYTES])
        data = whole[HEADER_BYTES:HEADER_BYTES + self.size]
        self.split_rows = SplitRows(data, self.slots, self.row_bytes, self.split) if self.split else None
        self.rows = None if self.split else data.reshape(self.slots, self.row_bytes)
        if self.reattached and self.header.read()["split"] != self.split:
            self.reattached = False  # the other layout's bytes: the caller loads the table again

    def take(self, ids: np.ndarray) -> np.ndarray:
        """Interleaved rows uint8 [n, row_bytes] at slots `ids` (checked by the caller), a copy."""
        return self.split_rows.take(ids) if self.split else self.rows[ids]

    def range(self, lo: int, hi: int) -> np.ndarray:
        """Interleaved rows of slots [lo, hi): a view (interleaved) or a copy (split)."""
        return self.split_rows.range(lo, hi) if self.split else self.rows[lo:hi]

    def put(self, lo: int, rows: np.ndarray) -> None:
        """Write interleaved rows uint8 [n, row_bytes] at slots [lo, lo + n)."""
        if self.split:
            self.split_rows.put(lo, rows)
        else:
            self.rows[lo:lo + len(rows)] = rows

    def _reopen(self) -> int | None:
        """fd of a previous arena at `path` fit to re-attach, else None.

        O_NOFOLLOW and fstat on the fd: /dev/shm is world-writable, so a link
        planted there must never make the sidecar write rows into another file.
        """
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o600 \
                and st.st_size == self.file_size:
            return fd
        os.close(fd)
        return None

    def publish(self) -> None:
        """Make a newly built arena visible at `path`."""
        if self._staging is not None:
            os.replace(self._staging, self.path)
            self._staging = None

    def retire(self) -> None:
        """Tell every client mapping this arena to stop reading it (they re-describe the table)."""
        if self.header is not None:
            self.header.retire()

    def close(self, unlink: bool = True) -> None:
        """Unmap; with unlink, retire and remove the file (clients' mappings stay valid)."""
        if unlink:
            self.retire()
        self.rows = self.split_rows = self.header = None
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with it
        if self._staging is not None:  # never published: `path` is not ours to remove
            self._staging.unlink(missing_ok=True)
        elif unlink:
            self.path.unlink(missing_ok=True)


def retire_file(path: Path) -> bool:
    """Set the retired flag of a stale arena file of ours (a killed sidecar's), so clients
    still mapping it switch at their next step; False when it is not an arena of ours.
    Through a map, not pwrite: hugetlbfs takes no write()."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size < HEADER_BYTES:
            return False
        with mmap.mmap(fd, _whole_pages(HEADER_BYTES, st), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
            if m[:len(_MAGIC)] != _MAGIC:
                return False
            m[8] = 1
        return True
    finally:
        os.close(fd)


def map_file_readonly(path: str | Path, size: int, what: str, gone_because: str) -> mmap.mmap:
    """A read-only shared map of the first `size` bytes of the regular file at `path` (never
    through a link; on hugetlbfs whole pages, so it may be longer: _whole_pages). StaleArena
    naming `what` when the file is gone (`gone_because`: why that happens), not a regular
    file, or smaller."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise StaleArena(f"{what} {path} does not exist on this host: {gone_because} "
                         "(describe the table again)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < size:
            raise StaleArena(f"{what} {path} holds {st.st_size} bytes, expected {size}; describe the table again")
        return mmap.mmap(fd, _whole_pages(size, st), mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)


def _map_checked(path: str | Path, slots: int, row_bytes: int, split: int, instance: str | None,
                 allow_retired: bool) -> tuple[np.ndarray, ArenaHeader]:
    """(the arena's row bytes, flat uint8, and its header), read-only, checked against what
    was described: StaleArena otherwise."""
    mm = map_file_readonly(path, HEADER_BYTES + slots * row_bytes, "arena",
                           "the sidecar is on another host (use inline lookups) or it has restarted")
    whole = np.frombuffer(mm, dtype=np.uint8)
    header = ArenaHeader(whole[:HEADER_BYTES])
    h = header.read()
    problem = None
    if h["magic"] != _MAGIC:
        problem = "is not a tierstore arena"
    elif h["host"] != host_id():
        problem = "belongs to another host (a remote sidecar's path): use inline lookups"
    elif instance is not None and h["instance"] != instance:
        problem = f"belongs to sidecar instance {h['instance']}, not {instance}"
    elif h["retired"] and not allow_retired:
        problem = "is retired"
    elif (h["slots"], h["row_bytes"]) != (slots, row_bytes):
        problem = f"holds {h['slots']} x {h['row_bytes']} B rows, not {slots} x {row_bytes}"
    elif h["split"] != split:
        problem = (f"is laid out {'split at ' + str(h['split']) + ' B' if h['split'] else 'interleaved'}, not "
                   f"{'split at ' + str(split) + ' B' if split else 'interleaved'}")
    if problem:
        raise StaleArena(f"arena {path} {problem}; describe the table again")
    return whole[HEADER_BYTES:HEADER_BYTES + slots * row_bytes], header


def map_readonly(path: str | Path, slots: int, row_bytes: int, *, instance: str | None = None,
                 allow_retired: bool = False):
    """A client's read-only view of an interleaved arena: (rows uint8 [slots, row_bytes], ArenaHeader).

    Raises StaleArena when the file is not the arena described (another host's
    path, another sidecar instance, already retired, split, or the wrong shape).
    allow_retired: a step holding a lease in a retired cache arena may still
    read it (its rows stay pinned until the lease ends).
    """
    data, header = _map_checked(path, slots, row_bytes, 0, instance, allow_retired)
    return data.reshape(slots, row_bytes), header


def map_split_readonly(path: str | Path, slots: int, row_bytes: int, split: int, *,
                       instance: str | None = None) -> tuple[SplitRows, ArenaHeader]:
    """A client's read-only view of a split arena: (SplitRows, ArenaHeader); StaleArena as
    map_readonly, and when the file is not split at `split` bytes."""
    data, header = _map_checked(path, slots, row_bytes, split, instance, False)
    return SplitRows(data, slots, row_bytes, split), header
