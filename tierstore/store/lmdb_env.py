"""One LMDB environment per catalog path in a process, shared by every Catalog object.

LMDB forbids opening one environment twice in a process (closing either drops
the other's locks), so Catalog objects share one handle per path, counted.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import lmdb

from tierstore.store.data_dir import private_dirs
from tierstore.errors import InvalidArgument, NotFound

__all__ = ["acquire_env", "release_env", "MAP_SIZE"]

# The map is sparse: LMDB only grows the file as pages are used. 1 TiB of
# address space holds manifests and checksums for petabytes of rows.
MAP_SIZE = 1 << 40
_ENVS: dict[str, list] = {}
_ENVS_LOCK = threading.Lock()


def acquire_env(path: Path, create: bool) -> lmdb.Environment:
    key = str(path.resolve())
    with _ENVS_LOCK:
        if key in _ENVS:
            _ENVS[key][1] += 1
            return _ENVS[key][0]
        if not (path / "data.mdb").exists():
            if not create:
                raise NotFound(f"no tierstore catalog in {path.parent}; create one with "
                               f"`tierstore ingest` or `tierstore demo-table`")
            private_dirs(path.parent, path.name)
        writable = os.access(path, os.W_OK)
        if create and not writable:
            raise InvalidArgument(f"the catalog in {path} is not writable by this user (uid {os.getuid()}): "
                                  f"run as its owner, or give another --data")
        try:
            env = lmdb.open(str(path), map_size=MAP_SIZE, max_dbs=0, lock=True, subdir=True, mode=0o600,
                            readonly=not writable)
        except lmdb.Error as e:
            if create:
                raise InvalidArgument(f"cannot open the catalog in {path} for writing: {e}") from None
            # another user's catalog: its lock file is not ours to write. Reading without
            # the lock is what LMDB does on a read-only file system; reads here are short.
            try:
                env = lmdb.open(str(path), map_size=MAP_SIZE, max_dbs=0, lock=False, subdir=True, readonly=True)
            except lmdb.Error as e2:
                raise InvalidArgument(f"cannot read the catalog in {path}: {e2}") from None
        _ENVS[key] = [env, 1]
        return env


def release_env(env: lmdb.Environment) -> None:
    with _ENVS_LOCK:
        for key, entry in list(_ENVS.items()):
            if entry[0] is env:
                entry[1] -= 1
                if entry[1] == 0:
                    del _ENVS[key]
                    env.close()
                return
