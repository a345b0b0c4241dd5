"""The simple alternatives tierstore is measured against, each configured the
way an engineer who knows it would run it (no strawmen):

- InProcessTable: the whole table in one numpy array in the reader's process;
  a gather is `table[ids]`. Nothing can be faster: the ceiling.
- MmapTable: np.memmap of the version's segment files, gathered with fancy
  indexing (what inference engines do today); warmed, so served from the page cache.
- LmdbTable: one key per row (8-byte big-endian id, so keys sort like ids),
  built once with append-mode putmulti; a batch is deduped and sorted, then read
  with one cursor getmulti inside one read transaction (readahead off: random reads).
- RedisTable: a private redis-server on a unix socket, persistence off
  (no RDB, no AOF), one binary key per row; a batch is deduped and fetched with
  MGETs of 4,096 keys sent in one pipeline (one round trip).

Each `get(ids)` returns uint8 [len(ids), row_bytes] in request order.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

__all__ = ["load_table", "InProcessTable", "MmapTable", "LmdbTable", "RedisTable", "redis_available"]


def _keys(ids: np.ndarray) -> list[bytes]:
    raw = np.ascontiguousarray(ids, dtype=">u8").tobytes()
    return [raw[i:i + 8] for i in range(0, len(raw), 8)]  # the per-key API is the baseline's own cost


def load_table(data_dir, version) -> np.ndarray:
    """The whole version as uint8 [rows, row_bytes], every block verified."""
    from tierstore.store.catalog import Catalog
    from tierstore.tiers.nvme.reader import SegmentReader

    with Catalog(data_dir, readonly=True) as cat:
        sums = cat.checksums(version.table, version.number)
    reader = SegmentReader(data_dir, version, sums)
    try:
        return reader.read_range(0, version.rows)
    finally:
        reader.close()


class InProcessTable:
    name = "ceiling"

    def __init__(self, table: np.ndarray):
        self.table = table

    def get(self, ids: np.ndarray) -> np.ndarray:
        return self.table[ids]

    def close(self) -> None:
        pass


class MmapTable:
    name = "mmap"

    def __init__(self, data_dir, version):
        self.seg_rows = version.segment_rows
        # each record's row (format 2 records end with the row's sum)
        self.maps = [np.memmap(Path(data_dir) / rel, dtype=np.uint8, mode="r").reshape(-1, version.record_bytes)
                     [:, :version.row_bytes] for rel in version.segments]
        self.row_bytes = version.row_bytes

    def get(self, ids: np.ndarray) -> np.ndarray:
        if len(self.maps) == 1:
            return self.maps[0][ids]
        out = np.empty((ids.size, self.row_bytes), dtype=np.uint8)
        seg = ids // self.seg_rows
        for s in np.unique(seg).tolist():  # one step per segment touched, not per id
            m = seg == s
            out[m] = self.maps[s][ids[m] - s * self.seg_rows]
        return out

    def close(self) -> None:
        for m in self.maps:
            m._mmap.close()
        self.maps = []


class LmdbTable:
    """Built once into `cache_dir` (reused while the table version is the same)."""

    name = "lmdb"

    def __init__(self, cache_dir, version, table: np.ndarray, progress=None):
        import lmdb

        self.row_bytes = version.row_bytes
        path = Path(cache_dir) / f"lmdb-{version.table}-v{version.number}"
        stamp = path / "tierstore-bench.json"
        want = {"table": version.table, "version": version.number, "rows": version.rows,
                "created_at": version.created_at}
        if not (stamp.exists() and json.loads(stamp.read_text()) == want):
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
            env = lmdb.open(str(path), map_size=max(1 << 30, table.nbytes * 3), writemap=True, sync=False,
                            metasync=False)
            step = 1 << 16
            for a in range(0, len(table), step):
                ids = np.arange(a, min(a + step, len(table)))
                with env.begin(write=True) as txn:
                    txn.cursor().putmulti(zip(_keys(ids), (r.tobytes() for r in table[a:a + len(ids)])),
                                          append=True)
                if progress:
                    progress(len(ids))
            env.sync(True)
            env.close()
            stamp.write_text(json.dumps(want))
        self.path = path
        self.env = lmdb.open(str(path), readonly=True, lock=False, readahead=False, max_readers=16)

    def get(self, ids: np.ndarray) -> np.ndarray:
        uniq, inv = np.unique(ids, return_inverse=True)
        with self.env.begin(buffers=False) as txn:
            pairs = txn.cursor().getmulti(_keys(uniq))
        if len(pairs) != uniq.size:
            raise KeyError(f"LMDB baseline at {self.path} lacks {uniq.size - len(pairs)} rows; delete it to rebuild")
        rows = np.frombuffer(b"".join(v for _, v in pairs), dtype=np.uint8).reshape(-1, self.row_bytes)
        return rows[inv.reshape(-1)]

    def close(self) -> None:
        self.env.close()


def redis_available() -> str | None:
    """None when a redis-server binary and the redis client exist, else why not."""
    if shutil.which("redis-server") is None:
        return "redis-server is not installed (apt-get install -y redis-server)"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "the redis Python client is not installed (pip install redis)"
    return None


class RedisTable:
    """A private redis-server (unix socket, persistence off) loaded with the table."""

    name = "redis"
    CHUNK = 4096

    def __init__(self, table: np.ndarray, progress=None, start_timeout: float = 20.0):
        import redis

        self.row_bytes = table.shape[1]
        self.tmp = Path(tempfile.mkdtemp(prefix="tierstore-redis-"))
        sock = self.tmp / "redis.sock"
        self.proc = subprocess.Popen(
            ["redis-server", "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700",
             "--save", "", "--appendonly", "no", "--dir", str(self.tmp), "--maxmemory", "0",
             "--protected-mode", "yes", "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=self.tmp)
        self.db = redis.Redis(unix_socket_path=str(sock), decode_responses=False)
        deadline = time.monotonic() + start_timeout
        while True:
            try:
                if sock.exists() and self.db.ping():
                    break
            except redis.exceptions.ConnectionError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.poll() is not None else "timeout"
                self.close()
                raise RuntimeError(f"redis-server did not start: {err}")
            time.sleep(0.02)
        step = 1 << 14
        for a in range(0, len(table), step):
            ids = np.arange(a, min(a + step, len(table)))
            self.db.mset(dict(zip(_keys(ids), (r.tobytes() for r in table[a:a + len(ids)]))))
            if progress:
                progress(len(ids))

    def get(self, ids: np.ndarray) -> np.ndarray:
        uniq, inv = np.unique(ids, return_inverse=True)
        keys = _keys(uniq)
        pipe = self.db.pipeline(transaction=False)
        for a in range(0, len(keys), self.CHUNK):
            pipe.mget(keys[a:a + self.CHUNK])
        vals = [v for chunk in pipe.execute() for v in chunk]
        if any(v is None for v in vals):
            raise KeyError("redis baseline lost rows (was the server restarted?)")
        rows = np.frombuffer(b"".join(vals), dtype=np.uint8).reshape(-1, self.row_bytes)
        return rows[inv.reshape(-1)]

    def close(self) -> None:
        try:
            self.db.close()
        except Exception:
            pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
