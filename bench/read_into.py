"""Micro-benchmark of the cold tier alone: one step's misses into an arena.

    python -m tierstore.bench.read_into [--dir DIR] [--rows 1000000] [--misses 14000]

A table of `rows` x 256 B random rows is written once under DIR (a disk, not
tmpfs, for O_DIRECT) in each segment format: 2 (each record carries its row
sum) and 1 (rows alone, a row-sum file beside them). Each pass places `misses`
sorted unique ids into random slots of a `dest` arena of rows/10 slots, side by side:

  old-block    format 1 without its row sums: read_rows on the block path (4 KiB
               block per miss, xxh3 per block in a loop, scratch + copy) + dest[slots] = rows
  read_into-v1 a batch of misses through the read pipeline (MissBatch: submit, then
               finish) on format 1, page-cache mode (records read through the page
               cache, sums read from the row-sum file beside them)
  read_into    the same on format 2 (sums inside the records read)
  read_into-direct   format 2 with direct_io=True (O_DIRECT sector reads)
  mmap         dest[slots] = np.memmap(format 1 file)[ids]: no verification (the baseline)

Warm: page cache holds the file; passes repeat the same ids (medians of
rounds). Cold: before each pass the file is dropped from the page cache
(posix_fadvise DONTNEED) and every reader/map is opened anew; fresh ids each
round. Prints ms per pass, rows/s and each one's ratio to mmap from one run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np


def _table(d: Path, rows: int, segment_format: int, row_bytes: int = 256):
    from tierstore.store.catalog import Catalog
    from tierstore.ingest.writer import write_version

    src = f"bench-read-into rows={rows}"
    name = "t" if segment_format == 2 else "t1"
    try:
        with Catalog(d, readonly=True) as cat:
            v = cat.current(name)
            if v.source == src and v.segment_format == segment_format and (segment_format == 2 or v.row_sums):
                return v, cat.checksums(name, v.number)
    except (KeyError, FileNotFoundError):
        pass
    rng = np.random.default_rng(0)
    step = (16 << 20) // row_bytes
    chunks = (rng.integers(0, 256, size=(min(step, rows - a), row_bytes), dtype=np.uint8)
              for a in range(0, rows, step))
    v = write_version(d, name, chunks, rows=rows, row_format="fp32", row_dim=row_bytes // 4, source=src,
                      segment_format=segment_format)
    with Catalog(d, readonly=True) as cat:
        return v, cat.checksums(name, v.number)


def _competitors(d: Path, v, sums, v1, sums1):
    """name -> (open() -> state, run(state, ids, dest, slots), close(state))."""
    from tierstore.tiers.nvme.miss_batch import MissBatch
    from tierstore.tiers.nvme.reader import SegmentReader

    old = dataclasses.replace(v1, row_sums=None)
    read = lambda r, i, dst, s: MissBatch(r, i, dst, s).submit().finish()  # noqa: E731
    path = d / v1.segments[0]

    def mm_open():
        import mmap
        m = np.memmap(path, dtype=np.uint8, mode="r").reshape(-1, v.row_bytes)
        m._mmap.madvise(mmap.MADV_RANDOM)
        return m

    def mm_run(m, ids, dest, slots):
        dest[slots] = m[ids]

    return {
        "old-block": (lambda: SegmentReader(d, old, sums1), lambda r, i, dst, s: dst.__setitem__(s, r.read_rows(i)),
                      lambda r: r.close()),
        "read_into-v1": (lambda: SegmentReader(d, v1, sums1), read, lambda r: r.close()),
        "read_into": (lambda: SegmentReader(d, v, sums), read, lambda r: r.close()),
        "read_into-direct": (lambda: SegmentReader(d, v, sums, direct_io=True), read, lambda r: r.close()),
        "mmap": (mm_open, mm_run, lambda m: m._mmap.close()),
    }


def run(d: Path, rows: int, misses: int, rounds: int, cold_rounds: int, log=print) -> dict:
    from tierstore.bench.memory import drop_page_cache

    d.mkdir(parents=True, exist_ok=True)
    v, sums = _table(d, rows, 2)
    v1, sums1 = _table(d, rows, 1)
    paths = [d / s for s in v.segments + v1.segments]
    rng = np.random.default_rng(1)
    cap = max(misses, rows // 10)
    dest = np.zeros((cap, v.row_bytes), dtype=np.uint8)
    comps = _competitors(d, v, sums, v1, sums1)
    # the truth comes from pread: a live map would pin pages and defeat the cold passes
    from tierstore.tiers.nvme.reader import SegmentReader
    check = SegmentReader(d, dataclasses.replace(v1, row_sums=None), sums1)

    def ids_slots():
        ids = np.sort(rng.choice(rows, misses, replace=False)).astype(np.int64)
        return ids, rng.choice(cap, misses, replace=False)

    # warm: same ids every round, file in page cache
    ids, slots = ids_slots()
    states = {k: o() for k, (o, _, _) in comps.items()}
    warm = {k: [] for k in comps}
    for name, (_, fn, _) in comps.items():  # warm-up + check
        dest[:] = 0
        fn(states[name], ids, dest, slots)
        assert np.array_equal(dest[slots], check.read_rows(ids)), name
    check.close()
    for _ in range(rounds):
        for name, (_, fn, _) in comps.items():
            t = time.perf_counter()
            fn(states[name], ids, dest, slots)
            warm[name].append(time.perf_counter() - t)
    for name, (_, _, c) in comps.items():
        c(states[name])
    # cold: page cache dropped, everything reopened, fresh ids each round
    cold = {k: [] for k in comps}
    for _ in range(cold_rounds):
        ids, slots = ids_slots()
        for name, (o, fn, c) in comps.items():
            drop_page_cache(paths)
            st = o()
            t = time.perf_counter()
            fn(st, ids, dest, slots)
            cold[name].append(time.perf_counter() - t)
            c(st)
    res = {"rows": rows, "row_bytes": v.row_bytes, "misses": misses, "dir": str(d), "warm": {}, "cold": {}}
    for kind, times in (("warm", warm), ("cold", cold)):
        base = float(np.median(times["mmap"]))
        for name, t in times.items():
            med = float(np.median(t))
            res[kind][name] = {"ms": med * 1e3, "rows_per_s": misses / med, "x_mmap": base / med}
    for kind in ("warm", "cold"):
        log(f"{kind:4s} " + "  ".join(f"{n} {r['ms']:.2f} ms ({r['x_mmap']:.2f}x mmap)"
                                       for n, r in res[kind].items()))
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=Path("/var/tmp/tierstore-bench-read-into"))
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--misses", type=int, default=14_000)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--cold-rounds", type=int, default=3)
    p.add_argument("--json", type=Path, help="also write the results here")
    a = p.parse_args(argv)
    res = run(a.dir, a.rows, a.misses, a.rounds, a.cold_rounds)
    if a.json:
        a.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
