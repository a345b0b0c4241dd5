"""A shared-memory file the sidecar makes for its clients to map (slot indexes, miss flights,
the lease board): created exclusively, reserved in full, mapped read-write."""
from __future__ import annotations

import mmap
import os
from pathlib import Path

from tierstore.errors import ResourceExhausted

__all__ = ["create_shm_file"]


def create_shm_file(path: Path, size: int, what: str) -> mmap.mmap:
    """Make `path` (mode 0600; O_EXCL and O_NOFOLLOW on an unpredictable name: never someone
    else's file, never a link), reserve all `size` bytes (zeros) and map it shared read-write.

    A filesystem too small is ResourceExhausted naming `what` and the fix; on any failure,
    a signal included, the file is removed, so a failed start-up leaves nothing behind."""
    path = Path(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # umask cannot widen it, but be explicit
        os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        path.unlink(missing_ok=True)
        raise ResourceExhausted(f"cannot reserve {size / 2**20:.1f} MiB for {what} {path.name} in {path.parent} "
                                f"({e.strerror}); lower --dram-budget or enlarge {path.parent}") from None
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
