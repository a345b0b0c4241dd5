"""The mmap competitor of `bench cold`: np.memmap of a version's segment files
(MADV_RANDOM) in a child process, so its page faults and memory are its own
(and a memory cgroup can hold it alone)."""
from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import numpy as np

__all__ = ["MmapChild"]


def _mmap_worker(conn, paths, seg_rows, row_bytes, record_bytes, batches):
    import mmap as _mmap
    import resource

    maps = []
    for p in paths:
        m = np.memmap(p, dtype=np.uint8, mode="r").reshape(-1, record_bytes)
        m._mmap.madvise(_mmap.MADV_RANDOM)  # random gathers: no readaround
        maps.append(m[:, :row_bytes])  # each record's row (format 2 records end with its sum)

    def get(ids):
        if len(maps) == 1:
            return maps[0][ids]
        out = np.empty((ids.size, row_bytes), dtype=np.uint8)
        seg = ids // seg_rows
        for s in np.unique(seg).tolist():
            sel = seg == s
            out[sel] = maps[s][ids[sel] - s * seg_rows]
        return out

    conn.send("ready")
    while True:
        op, i = conn.recv()
        if op == "stop":
            break
        if op == "faults":  # major page faults so far: gathered rows that went to disk
            conn.send(resource.getrusage(resource.RUSAGE_SELF).ru_majflt)
            continue
        rows = get(batches[i])
        conn.send(rows.tobytes() if op == "rows" else rows.shape[0])


class MmapChild:
    def __init__(self, data_dir, version, batches):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        paths = [str(Path(data_dir) / s) for s in version.segments]
        self.proc = ctx.Process(target=_mmap_worker, args=(child, paths, version.segment_rows, version.row_bytes,
                                                           version.record_bytes, batches), daemon=True)
        self.proc.start()
        child.close()
        if self.conn.recv() != "ready":
            raise RuntimeError("mmap baseline process did not start")
        self.index = {id(b): i for i, b in enumerate(batches)}
        self.row_bytes = version.row_bytes

    def get(self, ids):
        self.conn.send(("get", self.index[id(ids)]))
        return self.conn.recv()

    def rows(self, ids):
        self.conn.send(("rows", self.index[id(ids)]))
        return np.frombuffer(self.conn.recv(), dtype=np.uint8).reshape(-1, self.row_bytes)

    def faults(self) -> int:
        self.conn.send(("faults", 0))
        return self.conn.recv()

    def close(self):
        try:
            self.conn.send(("stop", 0))
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
