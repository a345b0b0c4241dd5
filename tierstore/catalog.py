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
import threading
import time
from contextlib import contextmanager
from dataclasses import MISSING, asdict, dataclass
from pathlib import Path

import lmdb
import numpy as np

from tierstore.errors import DataLoss, InvalidArgument, NotFound, TableNotFound, VersionNotFound

__all__ = ["Catalog", "TableVersion", "has_tables", "validate_table_name"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# The map is sparse: LMDB only grows the file as pages are used. 1 TiB of
# address space holds manifests and checksums for petabytes of rows.
MAP_SIZE = 1 << 40
LOCK_NAME = ".lock"


def validate_table_name(name: str) -> str:
    """Return `name` if it is a safe table name, else raise InvalidArgument.

    Names become directory names, so they must match
    ``[A-Za-z0-9][A-Za-z0-9_.-]{0,63}`` (no ``/``, no leading dot).
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidArgument(
            f"invalid table name {name!r}: use 1-64 characters from [A-Za-z0-9_.-], starting with a letter or digit")
    return name


@dataclass(frozen=True)
class TableVersion:
    """Manifest of one immutable table version.

    Rows are ``row_bytes`` bytes each, stored back to back; row i lives in
    segment ``i // segment_rows`` at byte ``(i % segment_rows) * row_bytes``.
    Checksums cover blocks of ``block_rows`` rows (the last block may be short).
    ``row_sums`` (versions written since per-row checksums exist, else None):
    ``{"file": name in the version directory, "algo": tierstore.tiers.rowsum.ALGO,
    "xxh3": xxh3-64 of that file}``; the file holds one little-endian uint64
    per row.
    """

    table: str
    version: int
    rows: int
    row_format: str
    row_dim: int
    row_bytes: int
    block_rows: int
    n_blocks: int
    segments: tuple[str, ...]  # paths relative to the data directory
    segment_rows: int
    spec: dict | None
    layer_id: int | None
    created_at: float
    source: str
    row_sums: dict | None = None

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def block_bytes(self) -> int:
        return self.block_rows * self.row_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["segments"] = list(self.segments)
        return d

    @classmethod
    def from_dict(cls, d: dict, table: str | None = None, version: int | None = None) -> "TableVersion":
        """A manifest from its stored record, checked for internal consistency:
        DataLoss naming table, version and field when any check fails (a record
        that disagrees with itself would serve half rows or read past a segment).
        `table`/`version`: the catalog key the record was stored under."""
        where = f"table {table!r} version {version}"
        if not isinstance(d, dict):
            raise DataLoss(f"catalog record of {where} is not a JSON object; the catalog is corrupt")
        if table is None or version is None:
            where = f"table {d.get('table', table)!r} version {d.get('version', version)}"
        bad = _record_problem(d, table, version)
        if bad:
            raise DataLoss(f"catalog record of {where} is inconsistent: {bad}; the catalog is corrupt "
                           f"(restore it or ingest the table again)")
        d = dict(d)
        d["segments"] = tuple(d["segments"])
        return cls(**d)


_INT_FIELDS = ("version", "rows", "row_dim", "row_bytes", "block_rows", "n_blocks", "segment_rows")


def _record_problem(d: dict, table: str | None, version: int | None) -> str | None:
    """What is wrong with a stored manifest record, or None."""
    from dataclasses import fields as dc_fields

    from tierstore.formats import RowFormat

    names = {f.name for f in dc_fields(TableVersion)}
    required = {f.name for f in dc_fields(TableVersion) if f.default is MISSING and f.default_factory is MISSING}
    if not required <= set(d) <= names:
        return f"fields {sorted(required - set(d))} missing, {sorted(set(d) - names)} unknown"
    for k in _INT_FIELDS:
        if not isinstance(d[k], int) or isinstance(d[k], bool) or d[k] < 1:
            return f"{k} = {d[k]!r} is not a positive integer"
    if table is not None and d["table"] != table:
        return f"table = {d['table']!r} but the record is stored under {table!r}"
    if version is not None and d["version"] != version:
        return f"version = {d['version']!r} but the record is stored under {version}"
    try:
        want = RowFormat.parse(d["row_format"]).row_bytes(d["row_dim"])
    except (ValueError, TypeError) as e:
        return f"row_format/row_dim: {e}"
    if d["row_bytes"] != want:
        return f"row_bytes = {d['row_bytes']} but {d['row_format']} x {d['row_dim']} is {want} bytes"
    if d["n_blocks"] != -(-d["rows"] // d["block_rows"]):
        return (f"n_blocks = {d['n_blocks']} but {d['rows']} rows in blocks of {d['block_rows']} "
                f"make {-(-d['rows'] // d['block_rows'])}")
    if d["segment_rows"] % d["block_rows"]:
        return f"segment_rows = {d['segment_rows']} is not a whole number of blocks of {d['block_rows']} rows"
    segs = d["segments"]
    if not isinstance(segs, list) or not all(isinstance(p, str) for p in segs):
        return "segments is not a list of paths"
    if len(segs) != -(-d["rows"] // d["segment_rows"]):
        return (f"segments: {len(segs)} segments of {d['segment_rows']} rows cannot hold exactly "
                f"{d['rows']} rows")
    for p in segs:
        if p.startswith("/") or ".." in Path(p).parts:
            return f"segments: {p!r} is not a path inside the data directory"
    return None


_CUR, _VER, _SUM = b"c/", b"v/", b"k/"


def _vkey(space: bytes, table: str, version: int) -> bytes:
    return space + table.encode() + b"\0" + struct.pack(">Q", version)


# LMDB forbids opening one environment twice in a process (closing either
# drops the other's locks), so Catalog objects share one handle per path.
_ENVS: dict[str, list] = {}
_ENVS_LOCK = threading.Lock()


def _acquire_env(path: Path, create: bool) -> lmdb.Environment:
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


def _release_env(env: lmdb.Environment) -> None:
    with _ENVS_LOCK:
        for key, entry in list(_ENVS.items()):
            if entry[0] is env:
                entry[1] -= 1
                if entry[1] == 0:
                    del _ENVS[key]
                    env.close()
                return


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
        self._env = _acquire_env(self.data_dir / "catalog", create=not readonly)
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
                raise DataLoss(f"catalog record of table {table!r} version {version} is inconsistent: checksums "
                               f"hold {len(raw) / 8:g} entries for {tv.n_blocks} blocks; the catalog is corrupt")
            return np.frombuffer(raw, dtype="<u8").copy()

    def _manifest(self, txn, table: str, version: int) -> TableVersion:
        raw = txn.get(_vkey(_VER, table, version))
        if raw is None:
            known = [v.version for v in self.versions(table)]  # TableNotFound when no versions
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
            _fsync_dir(final.parent)
            tv = TableVersion(table=table, version=version, created_at=time.time(),
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
            raise InvalidArgument(f"table {tv.table!r} version {tv.version}: {len(raw) // 8} checksums "
                                  f"for {tv.n_blocks} blocks")
        with self._env.begin(write=True) as txn:
            old = txn.get(_vkey(_SUM, tv.table, tv.version))
            if old is not None and old != raw:
                raise InvalidArgument(
                    f"table {tv.table!r} version {tv.version} in {self.data_dir} holds other rows than the one "
                    f"offered (checksums differ); serve it from another data directory")
            if old is None:
                txn.put(_vkey(_VER, tv.table, tv.version), json.dumps(tv.to_dict(), sort_keys=True).encode())
                txn.put(_vkey(_SUM, tv.table, tv.version), raw)
            if make_current:
                txn.put(_CUR + tv.table.encode(), struct.pack(">Q", tv.version))
        return old is None

    def set_current(self, table: str, version: int) -> TableVersion:
        """Make an existing version current (roll back or forward)."""
        self._check_writable()
        with self._env.begin(write=True) as txn:
            tv = self._manifest(txn, table, int(version))
            txn.put(_CUR + table.encode(), struct.pack(">Q", tv.version))
        return tv

    def collect_garbage(self, table: str, keep: int = 2, dry_run: bool = False) -> tuple[list[int], list[int]]:
        """Remove versions of `table` other than the current one and the `keep` newest,
        skipping any a running sidecar serves (it holds a shared flock on the version's
        directory). Returns (removed, skipped because served)."""
        self._check_writable()
        cur = self.current(table).version
        versions = [v.version for v in self.versions(table)]
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
            _release_env(self._env)
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


def _parse(raw: bytes, table: str, version: int) -> TableVersion:
    try:
        d = json.loads(raw)
    except ValueError:
        raise DataLoss(f"catalog record of table {table!r} version {version} is not JSON; the catalog is "
                       f"corrupt") from None
    return TableVersion.from_dict(d, table, version)


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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
