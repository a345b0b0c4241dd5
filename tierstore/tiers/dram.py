"""The DRAM tier: a shared arena of rows in /dev/shm.

The sidecar owns the segment (created 0600, so only the serving user can map
it); clients map it read-only and gather rows from it directly. Pages are
reserved up front with posix_fallocate so an arena that does not fit in
/dev/shm fails at start with a clear message instead of a SIGBUS mid-step.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import stat
from pathlib import Path

import numpy as np

from tierstore.errors import ResourceExhausted


def arena_path(shm_dir: Path, owner: str, table: str, version: int) -> Path:
    """Stable per (sidecar identity, table, version): a restarted sidecar finds its arena again."""
    tag = hashlib.blake2b(owner.encode(), digest_size=6).hexdigest()
    return Path(shm_dir) / f"tierstore.{os.getuid()}.{tag}.{table}.v{version}"


def shm_free_bytes(shm_dir: Path) -> int:
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


class Arena:
    """`slots` rows of `row_bytes` bytes in one shared-memory file.

    `rows` is a writable uint8 view [slots, row_bytes] for the sidecar.
    """

    def __init__(self, path: Path, slots: int, row_bytes: int, *, reuse: bool = False):
        self.path = Path(path)
        self.slots, self.row_bytes = int(slots), int(row_bytes)
        self.size = self.slots * self.row_bytes
        self.reattached = False
        self._staging: Path | None = None
        fd = self._reopen() if reuse else None
        if fd is not None:
            self.reattached = True
        else:
            # built under a private name and renamed into place by publish(): a client
            # opening `path` meanwhile maps the previous complete arena, never a half-loaded one
            self._staging = self.path.with_name(f"{self.path.name}.new-{os.getpid()}")
            self._staging.unlink(missing_ok=True)
            fd = os.open(self._staging, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                os.fchmod(fd, 0o600)  # umask cannot widen it, but be explicit
                os.posix_fallocate(fd, 0, max(self.size, 1))
            except OSError as e:
                os.close(fd)
                self._staging.unlink(missing_ok=True)
                raise ResourceExhausted(
                    f"cannot reserve {self.size / 2**20:.1f} MiB for arena {self.path.name} in {self.path.parent} "
                    f"({e.strerror}); lower --dram-budget or enlarge /dev/shm") from None
        try:
            self._mmap = mmap.mmap(fd, max(self.size, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.rows = np.frombuffer(self._mmap, dtype=np.uint8, count=self.size).reshape(self.slots, self.row_bytes)

    def _reopen(self) -> int | None:
        """fd of a previous arena at `path` fit to re-attach, else None.

        O_NOFOLLOW and fstat on the fd: /dev/shm is world-writable, so a link
        planted there must never make the sidecar write rows into another file.
        """
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            return None
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o600 \
                and st.st_size == self.size:
            return fd
        os.close(fd)
        return None

    def publish(self) -> None:
        """Make a newly built arena visible at `path` (atomically replacing an old one)."""
        if self._staging is not None:
            os.replace(self._staging, self.path)
            self._staging = None

    def close(self, unlink: bool = True) -> None:
        self.rows = None
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with it
        if self._staging is not None:  # never published: `path` is not ours to remove
            self._staging.unlink(missing_ok=True)
        elif unlink:
            self.path.unlink(missing_ok=True)


def map_readonly(path: str | Path, slots: int, row_bytes: int) -> np.ndarray:
    """A client's read-only view of an arena: uint8 [slots, row_bytes]."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size < slots * row_bytes:
            raise ValueError(f"arena {path} holds {size} bytes, expected {slots * row_bytes}")
        mm = mmap.mmap(fd, max(slots * row_bytes, 1), mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    return np.frombuffer(mm, dtype=np.uint8, count=slots * row_bytes).reshape(slots, row_bytes)
