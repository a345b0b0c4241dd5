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

__all__ = ["Arena", "ArenaHeader", "HEADER_BYTES", "arena_tag", "host_id", "map_file_readonly", "map_readonly",
           "own_files", "retire_file", "shm_free_bytes"]

HEADER_BYTES = 4096
_MAGIC = b"TSARENA1"
# magic, retired, full, instance (16 ascii), version, slots, row_bytes, host (16), table (64)
_LAYOUT = struct.Struct("<8sII16sQQI16s64s")


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
    """Files in shm_dir that a sidecar with this tag (and uid) created, live or stale."""
    return sorted(Path(shm_dir).glob(f"tierstore.{os.getuid()}.{tag}.*"))


def shm_free_bytes(shm_dir: Path) -> int:
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


class ArenaHeader:
    """The first page of an arena file, read and written in place."""

    def __init__(self, buf):
        self._buf = buf

    def write(self, *, instance: str, version: int, slots: int, row_bytes: int, full: bool, table: str) -> None:
        packed = _LAYOUT.pack(_MAGIC, 0, int(full), instance.encode()[:16], version, slots, row_bytes,
                              host_id(), table.encode()[:64])
        self._buf[:_LAYOUT.size] = np.frombuffer(packed, dtype=np.uint8)

    def read(self) -> dict:
        fields = _LAYOUT.unpack_from(self._buf.tobytes()[:_LAYOUT.size])
        magic, retired, full, inst, version, slots, row_bytes, host, table = fields
        return dict(magic=magic, retired=bool(retired), full=bool(full), instance=inst.rstrip(b"\0").decode(),
                    version=version, slots=slots, row_bytes=row_bytes, host=host, table=table.rstrip(b"\0").decode())

    @property
    def retired(self) -> bool:
        return self._buf[8] != 0

    def retire(self) -> None:
        self._buf[8] = 1

    def set_instance(self, instance: str) -> None:
        self._buf[16:32] = np.frombuffer(instance.encode()[:16].ljust(16, b"\0"), dtype=np.uint8)


class Arena:
    """`slots` rows of `row_bytes` bytes in one shared-memory file.

    `rows` is a writable uint8 view [slots, row_bytes] for the sidecar.
    New arenas are built under a private `.new` name and renamed into place by
    publish(); `reuse=True` re-opens the file at `path` instead (persisted
    arenas), or returns a fresh one when it does not fit.
    """

    def __init__(self, path: Path, slots: int, row_bytes: int, *, reuse: bool = False):
        self.path = Path(path)
        self.slots, self.row_bytes = int(slots), int(row_bytes)
        self.size = self.slots * self.row_bytes
        self.file_size = HEADER_BYTES + self.size
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
        whole = np.frombuffer(self._mmap, dtype=np.uint8)
        self.header = ArenaHeader(whole[:HEADER_BYTES])
        self.rows = whole[HEADER_BYTES:].reshape(self.slots, self.row_bytes)

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
        if self.rows is not None:
            self.header.retire()

    def close(self, unlink: bool = True) -> None:
        """Unmap; with unlink, retire and remove the file (clients' mappings stay valid)."""
        if unlink:
            self.retire()
        self.rows = self.header = None
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
    still mapping it switch at their next step; False when it is not an arena of ours."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size < HEADER_BYTES:
            return False
        if os.pread(fd, 8, 0) != _MAGIC:
            return False
        os.pwrite(fd, b"\x01", 8)
        return True
    finally:
        os.close(fd)


def map_file_readonly(path: str | Path, size: int, what: str, gone_because: str) -> mmap.mmap:
    """A read-only shared map of the first `size` bytes of the regular file at `path` (never
    through a link). StaleArena naming `what` when the file is gone (`gone_because`: why
    that happens), not a regular file, or smaller."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise StaleArena(f"{what} {path} does not exist on this host: {gone_because} "
                         "(describe the table again)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < size:
            raise StaleArena(f"{what} {path} holds {st.st_size} bytes, expected {size}; describe the table again")
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)


def map_readonly(path: str | Path, slots: int, row_bytes: int, *, instance: str | None = None,
                 allow_retired: bool = False):
    """A client's read-only view of an arena: (rows uint8 [slots, row_bytes], ArenaHeader).

    Raises StaleArena when the file is not the arena described (another host's
    path, another sidecar instance, already retired, or the wrong shape).
    allow_retired: a step holding a lease in a retired cache arena may still
    read it (its rows stay pinned until the lease ends).
    """
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
    if problem:
        raise StaleArena(f"arena {path} {problem}; describe the table again")
    return whole[HEADER_BYTES:].reshape(slots, row_bytes), header
