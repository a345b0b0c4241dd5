"""Files and locks of a data directory outside the catalog's LMDB: private
directories, the staging lock writers and cleanup share, directory fsync."""
from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path

__all__ = ["private_dirs", "staging_guard", "fsync_dir", "LOCK_NAME"]

LOCK_NAME = ".lock"  # a staging directory's flock: held while its writer lives


def private_dirs(data_dir: Path, *parts: str) -> Path:
    """mkdir -p data_dir/parts..., the data directory and everything tierstore
    makes in it 0700 (table names and sources are nobody else's business);
    parents of the data directory keep the umask. Returns the last directory."""
    path = Path(data_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    for part in ("", *parts):
        path = path / part if part else path
        if path.is_dir():
            continue
        try:
            path.mkdir(mode=0o700)
            os.chmod(path, 0o700)  # mkdir's mode passes through the umask, which may be wider
        except FileExistsError:
            pass
    return path


@contextmanager
def staging_guard(data_dir: Path, *, exclusive: bool):
    """flock on DATA/catalog/staging.lock: writers hold it shared while they create
    and lock a staging directory, cleanup holds it exclusive while it looks for dead ones."""
    fd = os.open(Path(data_dir) / "catalog" / "staging.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def _held(lock_path: Path) -> bool:
    """True when a live writer holds the staging directory's lock."""
    try:
        fd = os.open(lock_path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename or create in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
