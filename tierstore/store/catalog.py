"""The catalog: which tables exist, their immutable versions, and which is current.

Layout of a data directory::

    DATA/catalog/          LMDB environment (this module)
    DATA/tables/T/vN/      segment files of version N of table T (immutable)
    DATA/tmp/              versions being written; a crashed ingest leaves them here

LMDB keeps three key spaces in its main database (named databases would need
a write transaction to open, which a read-only sidecar must never take):
``c/`` table -> current version, ``v/`` table, version -> manifest JSON and
``k/`` table, version -> uint64 xxh3-64 per block. A new version becomes visible in one
write transaction that moves its directory into place and flips the pointer, so
readers see either the old version or the whole new one, never a mix.

Opening read-only is safe while another process writes (the sidecar does that):
each call reads in its own short read transaction and sees the latest commit.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import struct
import time
from pathlib import Path

import numpy as np

from tierstore import bounded_json
from tierstore.store.data_dir import LOCK_NAME, _held, fsync_dir, private_dirs, staging_guard
from tierstore.errors import DataLoss, InvalidArgument, NotFound, TableNotFound, VersionNotFound
from tierstore.store.lmdb_env import MAP_SIZE, acquire_env, release_env  # noqa: F401 (MAP_SIZE: tests, tools)
from tierstore.store.version import TableVersion, validate_table_name

__all__ = ["Catalog", "BlockChecksums", "TableVersion", "has_tables", "validate_table_name"]

_CUR, _VER, _SUM = b"c/", b"v/", b"k/"


def _vkey(space: bytes, table: str, version: int) -> bytes:
    return space + table.encode() + b"\0" + struct.pack(">Q", version)


class Catalog:
    """Tables, versions and checksums of one data directory.

    data_dir: the directory given as ``--data``; created when opened for writing.
    readonly: open for reading only (never creates, never cleans up). Raises
        NotFound when the directory holds no catalog.

    Opening for writing removes leftovers of killed writers (staging
    directories nobody holds a lock on, version directories never committed).
    """

    def __init__(self, data_dir, *, readonly: bool = False):
        self.data_dir = Path(data_dir)
        self.readonly = readonly
        self._env = acquire_env(self.data_dir / "catalog", create=not readonly)
        if not readonly and self._env.flags()["readonly"]:
            self.close()
            raise InvalidArgument(f"the catalog in {self.data_dir} is not writable by this user "
                                  f"(uid {os.getuid()}): run as its owner, or give another --data")
        if not readonly:
            self.clean_leftovers()

    # ---- reading -----------------------------------------------------------
    def tables(self) -> list[str]:
        """Names of all tables with a current version, sorted."""
        with self._env.begin() as txn:
            cur = txn.cursor()
            out = []
            if cur.set_range(_CUR):
                for k in cur.iternext(values=False):
                    if not k.startswith(_CUR):
                        break
                    out.append(k[len(_CUR):].decode())
            return out

    def current(self, table: str) -> TableVersion:
        """Manifest of the current version of `table`; TableNotFound if none."""
        validate_table_name(table)
        with self._env.begin() as txn:
            raw = txn.get(_CUR + table.encode())
            if raw is None:
                raise TableNotFound(f"no table {table!r} in {self.data_dir}; tables are {self.tables()}")
            return self._manifest(txn, table, struct.unpack(">Q", raw)[0])

    def get(self, table: str, version: int | None = None) -> TableVersion:
        """Manifest of `version` (default: current); VersionNotFound if it does not exist."""
        if version is None:
            return self.current(table)
        validate_table_name(table)
        with self._env.begin() as txn:
            return self._manifest(txn, table, int(version))

    def versions(self, table: str) -> list[TableVersion]:
        """Every committed version of `table`, oldest first; TableNotFound if none."""
        validate_table_name(table)
        prefix = _VER + table.encode() + b"\0"
        out = []
        with self._env.begin() as txn:
            cur = txn.cursor()
            if cur.set_range(prefix):
                for k, v in cur:
                    if not k.startswith(prefix):
                        break
                    out.append(_parse(v, table, struct.unpack(">Q", k[len(prefix):])[0]))
        if not out:
            raise TableNotFound(f"no table {table!r} in {self.data_dir}; tables are {self.tables()}")
        return out

    def checksums(self, table: str, version: int) -> np.ndarray:
        """xxh3-64 of every block of a version, uint64 [n_blocks]."""
        with self._env.begin() as txn:
            raw = txn.get(_vkey(_SUM, table, version))
            if raw is None:
                self._manifest(txn, table, version)  # raises the useful error
                raise VersionNotFound(f"table {table!r} version {version} has no checksums")
            tv = self._manifest(txn, table, version)
            if len(raw) != 8 * tv.n_blocks:
                raise self._cut_sums(table, version, len(raw), tv.n_blocks)
            return np.frombuffer(raw, dtype="<u8").copy()

    def block_checksums(self, table: str, version: int, index, n_blocks: int) -> np.ndarray:
        """checksums(table, version)[index] (an int, slice or int array), read in place from
        the catalog's map: only the entries asked are copied out (BlockChecksums). n_blocks:
        the version's block count (its manifest's); a record of another length is DataLoss,
        as in checksums()."""
        with self._env.begin(buffers=True) as txn:
            raw = txn.get(_vkey(_SUM, table, version))
            if raw is None:
                raise VersionNotFound(f"table {table!r} version {version} has no checksums in the catalog any more")
            if len(raw) != 8 * n_blocks:
                raise self._cut_sums(table, version, len(raw), n_blocks)
            out = np.frombuffer(raw, dtype="<u8")[index]
            return out.copy() if isinstance(out, np.ndarray) else out  # the buffer dies with the txn

    def _cut_sums(self, table: str, version: int, nbytes: int, n_blocks: int) -> DataLoss:
        """The error for a version's checksum record of `nbytes` that is not 8 B a block."""
        path = self.data_dir / "catalog"
        return DataLoss(f"catalog record of table {table!r} version {version} is inconsistent: checksums hold "
                        f"{nbytes / 8:g} entries for {n_blocks} blocks; the catalog is corrupt: restore {path} "
                        f"from a backup, or re-ingest or import the table")

    def _manifest(self, txn, table: str, version: int) -> TableVersion:
        raw = txn.get(_vkey(_VER, table, version))
        if raw is None:
            known = [v.number for v in self.versions(table)]  # TableNotFound when no versions
            raise VersionNotFound(f"table {table!r} has no version {version}; versions are {known}")
        return _parse(raw, table, version)

    # ---- writing -----------------------------------------------------------
    def commit_version(self, table: str, staged: Path, fields: dict, checksums: np.ndarray) -> TableVersion:
        """Move a fully written, fsynced staging directory into place as the next
        version of `table` and make it current, in one write transaction."""
        self._check_writable()
        validate_table_name(table)
        with self._env.begin(write=True) as txn:
            last = self._last_version(txn, table)
            version = last + 1
            final = self.data_dir / "tables" / table / f"v{version}"
            private_dirs(self.data_dir, "tables", table)
            if final.exists():  # an uncommitted leftover under the same number
                shutil.rmtree(final)
            segs = sorted(p.name for p in staged.iterdir() if p.name.startswith("seg-"))
            (staged / LOCK_NAME).unlink(missing_ok=True)
            os.rename(staged, final)
            fsync_dir(final.parent)
            tv = TableVersion(table=table, number=version, created_at=time.time(),
                              segments=tuple(f"tables/{table}/v{version}/{s}" for s in segs), **fields)
            txn.put(_vkey(_VER, table, version), json.dumps(tv.to_dict(), sort_keys=True).encode())
            txn.put(_vkey(_SUM, table, version), np.ascontiguousarray(checksums, dtype="<u8").tobytes())
            txn.put(_CUR + table.encode(), struct.pack(">Q", version))
        return tv

    def register_version(self, tv: TableVersion, checksums: np.ndarray, *, make_current: bool = True) -> bool:
        """Record a version made elsewhere (a published manifest: `tierstore fetch-manifest`,
        `serve --remote-table`) under its own number, its rows not necessarily here yet;
        make it current when `make_current`. One write transaction.

        Returns False when the catalog already holds that version with the same rows
        (nothing recorded; the pointer still moves when `make_current`). Raises
        InvalidArgument when it holds a different version under that number.
        """
        self._check_writable()
        validate_table_name(tv.table)
        raw = np.ascontiguousarray(checksums, dtype="<u8").tobytes()
        if len(raw) != 8 * tv.n_blocks:
            raise InvalidArgument(f"table {tv.table!r} version {tv.number}: {len(raw) // 8} checksums "
                                  f"for {tv.n_blocks} blocks")
        with self._env.begin(write=True) as txn:
            old = txn.get(_vkey(_SUM, tv.table, tv.number))
            if old is not None and old != raw:
                raise InvalidArgument(
                    f"table {tv.table!r} version {tv.number} in {self.data_dir} holds other rows than the one "
                    f"offered (checksums differ); serve it from another data directory")
            if old is None:
                txn.put(_vkey(_VER, tv.table, tv.number), json.dumps(tv.to_dict(), sort_keys=True).encode())
                txn.put(_vkey(_SUM, tv.table, tv.number), raw)
            if make_current:
                txn.put(_CUR + tv.table.encode(), struct.pack(">Q", tv.number))
        return old is None

    def set_current(self, table: str, version: int) -> TableVersion:
        """Make an existing version current (roll back or forward)."""
        self._check_writable()
        with self._env.begin(write=True) as txn:
            tv = self._manifest(txn, table, int(version))
            txn.put(_CUR + table.encode(), struct.pack(">Q", tv.number))
        return tv

    def collect_garbage(self, table: str, keep: int = 2, dry_run: bool = False) -> tuple[list[int], list[int]]:
        """Remove versions of `table` other than the current one and the `keep` newest,
        skipping any a running sidecar serves (it holds a shared flock on the version's
        directory). Returns (removed, skipped because served)."""
        self._check_writable()
        cur = self.current(table).number
        versions = [v.number for v in self.versions(table)]
        newest = set(sorted(versions)[-keep:]) if keep else set()
        removed, served = [], []
        for v in versions:
            if v >= cur or v in newest:  # never a number the next ingest could hand out again
                continue
            vdir = self.data_dir / "tables" / table / f"v{v}"
            fd = os.open(vdir, os.O_RDONLY | os.O_DIRECTORY) if vdir.is_dir() else None
            try:
                if fd is not None:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        served.append(v)
                        continue
                if not dry_run:
                    with self._env.begin(write=True) as txn:  # the record first: never a record without files
                        txn.delete(_vkey(_VER, table, v))
                        txn.delete(_vkey(_SUM, table, v))
                    shutil.rmtree(vdir, ignore_errors=True)
                removed.append(v)
            finally:
                if fd is not None:
                    os.close(fd)
        return removed, served

    def _last_version(self, txn, table: str) -> int:
        prefix = _VER + table.encode() + b"\0"
        cur = txn.cursor()
        # versions sort big-endian after the prefix: step back from just past the last one
        found = cur.prev() if cur.set_range(prefix + b"\xff" * 8) else cur.last()
        if found and cur.key().startswith(prefix):
            return struct.unpack(">Q", cur.key()[len(prefix):])[0]
        return 0

    def clean_leftovers(self) -> list[Path]:
        """Remove staging dirs of dead writers and version dirs never committed.

        Runs inside a write transaction so it never races a committing writer.
        """
        self._check_writable()
        removed = []
        tmp = self.data_dir / "tmp"
        with self._env.begin(write=True) as txn:
            if tmp.is_dir():
                with staging_guard(self.data_dir, exclusive=True):  # no writer is between mkdtemp and its flock
                    for d in sorted(tmp.glob("*")):
                        if d.is_dir() and not _held(d / LOCK_NAME):
                            shutil.rmtree(d, ignore_errors=True)
                            removed.append(d)
            for d in sorted((self.data_dir / "tables").glob("*/v*")):
                m = re.fullmatch(r"v(\d+)", d.name)
                if m and txn.get(_vkey(_VER, d.parent.name, int(m.group(1)))) is None:
                    shutil.rmtree(d, ignore_errors=True)
                    removed.append(d)
        return removed

    def _check_writable(self) -> None:
        if self.readonly:
            raise InvalidArgument(f"catalog in {self.data_dir} was opened read-only")

    def close(self) -> None:
        if self._env is not None:
            release_env(self._env)
            self._env = None

    def __enter__(self) -> "Catalog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def has_tables(data_dir) -> bool:
    """True when `data_dir` holds a catalog with at least one table."""
    try:
        with Catalog(data_dir, readonly=True) as cat:
            return bool(cat.tables())
    except NotFound:
        return False


MAX_RECORD_BYTES = 16 << 20  # a manifest is a few KB (its segment list and spec)


def _parse(raw: bytes, table: str, version: int) -> TableVersion:
    try:
        d = bounded_json.loads(raw, max_bytes=MAX_RECORD_BYTES)
    except ValueError as e:
        raise DataLoss(f"catalog record of table {table!r} version {version} is refused ({e}); the catalog is "
                       f"corrupt") from None
    return TableVersion.from_dict(d, table, version)


class BlockChecksums:
    """A version's block checksums, read from the catalog when a block is checked, not held
    in memory: at 64 M rows of 264 B in ~4 KiB blocks they are 34 MB a table, 4.4 B an arena
    slot at a 1/8 budget, and a segment format 2 miss never reads them (each record carries
    its row sum). What reads them is the block path: the scrub, `tierstore verify`, a table
    without row sums. Indexes like the uint64 [n_blocks] array Catalog.checksums returns
    (`sums[blocks]`, `.shape`); holds its own reference to the catalog's environment (one a
    process, shared) until close()."""

    nbytes = 0  # what it holds in memory (TableEngine.metadata_bytes)
    dtype = np.dtype(np.uint64)

    def __init__(self, data_dir, version: TableVersion):
        self.table, self.version = version.table, version.number
        self.shape = (version.n_blocks,)
        self._catalog: Catalog | None = Catalog(data_dir, readonly=True)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index) -> np.ndarray:
        if self._catalog is None:
            raise ValueError(f"the block checksums of table {self.table!r} v{self.version} are closed")
        return self._catalog.block_checksums(self.table, self.version, index, self.shape[0])

    def close(self) -> None:
        if self._catalog is not None:
            self._catalog.close()
            self._catalog = None
