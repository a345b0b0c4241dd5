"""Hot-set files: which rows a cache-mode arena held when its sidecar last
recorded them, hottest first, so the next start can promote them again.

One file per table version, `DATA/hot_sets/<table>.v<version>.hot` (0600, in a
0700 directory), written whole to a temp file, fsynced and renamed over the
old one: a reader sees the previous file or the new one, never half of one.

A hot set is a hint, never a source of rows: the sidecar reads and verifies
every row it promotes from the segment files. So a file that does not fit is
refused (HotSetMismatch: recorded for another table or version, or a table
made again under the same name; HotSetCorrupt: short, torn or flipped bits)
and the caller starts cold; nothing in it is trusted before its xxh3 matches.

Format (little-endian): HEADER (magic, format, id width, version, rows,
created_at of the version's manifest, ids n, table name's length), the name
(UTF-8), n ids (int32 when the table has < 2^31 rows, else int64), n counts
(uint8: the policy's frequency estimate of each id), then xxh3-64 of
everything before it.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import xxhash

from tierstore.store.data_dir import fsync_dir, private_dirs

__all__ = ["HotSet", "HotSetCorrupt", "HotSetMismatch", "hot_set_path", "save_hot_set", "load_hot_set"]

MAGIC = b"TSHOTSET"
FORMAT = 1
HEADER = struct.Struct("<8sIIQQdQI")
DIGEST = struct.Struct("<Q")
DIRECTORY = "hot_sets"


class HotSetCorrupt(ValueError):
    """The file is not a whole hot set (short, torn, bits flipped, not ours)."""


class HotSetMismatch(ValueError):
    """A whole hot set, recorded for another table or version."""


class HotSet:
    """ids (int64, hottest first, distinct, each in [0, rows)) and counts (uint8, one per id)."""

    __slots__ = ("ids", "counts")

    def __init__(self, ids: np.ndarray, counts: np.ndarray):
        self.ids, self.counts = ids, counts


def hot_set_path(data_dir, table: str, version: int) -> Path:
    return Path(data_dir) / DIRECTORY / f"{table}.v{int(version)}.hot"


def save_hot_set(data_dir, version, ids: np.ndarray, counts: np.ndarray) -> Path:
    """Write the hot set of `version` (a TableVersion) atomically; returns its path.
    Raises OSError (a read-only data directory, a full disk): the old file stays."""
    ids = np.asarray(ids, dtype=np.int64).ravel()
    counts = np.asarray(counts, dtype=np.uint8).ravel()
    if ids.shape != counts.shape:
        raise ValueError(f"a hot set needs one count per id, got {ids.size} ids and {counts.size} counts")
    width = 4 if version.rows < 2**31 else 8
    name = version.table.encode()
    body = b"".join([HEADER.pack(MAGIC, FORMAT, width, version.number, version.rows, version.created_at,
                                 ids.size, len(name)), name,
                     ids.astype(np.int32 if width == 4 else np.int64).astype(f"<i{width}").tobytes(),
                     counts.tobytes()])
    path = hot_set_path(data_dir, version.table, version.number)
    private_dirs(data_dir, DIRECTORY)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(body)
            f.write(DIGEST.pack(xxhash.xxh3_64_intdigest(body)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def load_hot_set(data_dir, version) -> HotSet | None:
    """The hot set recorded for `version`, or None when there is none.

    Raises HotSetCorrupt or HotSetMismatch (see the module docstring); OSError
    when the file is there but cannot be read."""
    path = hot_set_path(data_dir, version.table, version.number)
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        return None
    if len(blob) < HEADER.size + DIGEST.size:
        raise HotSetCorrupt(f"{path} is {len(blob)} bytes, shorter than a hot set's header")
    body, (digest,) = blob[:-DIGEST.size], DIGEST.unpack(blob[-DIGEST.size:])
    if xxhash.xxh3_64_intdigest(body) != digest:
        raise HotSetCorrupt(f"{path} fails its checksum (torn or damaged)")
    magic, fmt, width, v, rows, created, n, name_len = HEADER.unpack_from(body)
    if magic != MAGIC or fmt != FORMAT or width not in (4, 8):
        raise HotSetCorrupt(f"{path} is not a hot set of format {FORMAT}")
    if len(body) != HEADER.size + name_len + n * (width + 1):
        raise HotSetCorrupt(f"{path} holds {len(body)} bytes, not the {n} ids its header says")
    table = body[HEADER.size:HEADER.size + name_len].decode(errors="replace")
    if (table, v, rows, created) != (version.table, version.number, version.rows, version.created_at):
        raise HotSetMismatch(f"{path} was recorded for table {table!r} v{v} ({rows} rows, created {created:.0f}), "
                             f"not {version.table!r} v{version.number} ({version.rows} rows, created "
                             f"{version.created_at:.0f})")
    at = HEADER.size + name_len
    ids = np.frombuffer(body, dtype=f"<i{width}", count=n, offset=at).astype(np.int64)
    counts = np.frombuffer(body, dtype=np.uint8, count=n, offset=at + n * width).copy()
    if n and (ids.min() < 0 or ids.max() >= rows):
        raise HotSetCorrupt(f"{path} holds ids outside [0, {rows})")
    return HotSet(ids, counts)
