"""`tierstore bench lookup`: rows/s and batch latency of every way to read rows.

Competitors, all reading the same table and the same id batches:
  ceiling      in-process gather from the whole table in the reader's own memory,
               compiled (numba; numpy's take where numba is missing) into a
               buffer allocated once per batch size: no allocation, no page fault
               of a fresh result per batch, nothing but the row copies
  arena        tierstore, full-resident sidecar: plan() + gather from the mapped arena
  arena-cache  tierstore, sidecar with a DRAM budget of 10% of the table (cache
               mode), read with Client.lookup: local reads (client/local_reads.py),
               resident rows copied from the arena, misses from the segment files,
               the steps told to the sidecar after the fact
  arena-cache-plan  the same, planned: a leased plan per batch over the step
               socket, then rows() (what a kernel reading the arena by slot needs)
  arena-cache-prefetch  lookup, each batch's ids handed to the sidecar one
               batch ahead (Client.prefetch)
  arena-huge   arena, its arena on huge pages (--huge-shm-dir: a tmpfs mounted
               huge=within_size; the sidecar runs with --arena-pages huge). `arena`
               gets what the host gives by default (tiers/pages.py): the config's
               `pages` says what each read through
  inline       tierstore Lookup RPC, rows inside the gRPC reply
  mmap, lmdb, redis   the baselines of bench/baselines.py

Every tierstore competitor but inline reads into a buffer it reuses
(RowScratch), as the ceiling does and as a step loop fills its staging buffer
(Client.lookup(out=), StepPlan.rows(out)): a fresh array per batch would add its
page faults and cold cache lines to every figure but the ceiling's.

The machine is shared and noisy, so competitors are interleaved: every round
runs one pass of each (the order rotates every round) and figures are medians
over rounds; ratios are taken per round against the ceiling's pass in the same
round, then the median. Every competitor's rows are checked byte for byte
against the ceiling on the first batch of every cell before anything is timed.
The timed rounds begin once arena-cache's sidecar has learned the warm-up pass
(bounded wait): they measure the steady state, and hit_ratio_timed says at
what hit ratio they ran.

The table: `--table-mib N` reads a random table of N MiB of 264-B rows (the V4.1
row) written once into OUT/baselines/lookup-data, past the CPU's TLB reach by
default (8 GiB: a 4 KiB-page gather then waits on page walks, which huge pages
remove); competitors that copy the whole table elsewhere (lmdb, redis) are left
out above 1 GiB unless named in `competitors`. Without it, a table of --data.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from tierstore.bench.workload import BenchOptions, parse_dist
from tierstore.client.row_scratch import RowScratch
from tierstore.errors import InvalidArgument, TierstoreError
from tierstore.jit import Kernel

__all__ = ["run_lookup_bench", "LookupOptions", "start_sidecar", "run_rounds", "check_same_rows", "summarize",
           "WrongRows", "CompiledGather", "UNITS", "COPY_LIMIT"]

UNITS = {"rows_per_s": "rows/s", "p50_ms": "ms per batch", "p99_ms": "ms per batch",
         "ratio_vs_ceiling": "x (rows/s over the in-process ceiling's rows/s, median of per-round ratios)",
         "cpu_ratio_vs_ceiling": "x (the ceiling's CPU time per pass over this competitor's, the reading thread's "
                                 "only, median of per-round ratios: what a loaded host's scheduling does not move; "
                                 "a competitor waiting on another process spends little of it)",
         "hit_ratio": "fraction of unique ids per Plan found in the DRAM arena",
         "hit_ratio_timed": "the same over the timed rounds only, counted by the client's local reads",
         "latency_quantiles_ms": "ms per batch at percentiles 0..100", "bytes": "bytes"}
QUANTILES = np.linspace(0, 100, 101)
# a benchmark's sidecar over the user's data directory starts cold and records no hot set: what
# it measures does not depend on what ran there before (a `make run` demo's hot set kept the
# arena-cache cell missing: docs/benchmarks.md), and the hot sets of the sidecar that serves
# that data stay as they were (a bench's synthetic ids would be its next warm start)
BENCH_SIDECAR_FLAGS = ("--no-warm-start", "--no-record-hot-sets")
COPY_LIMIT = 1 << 30  # above this, lmdb and redis (a whole second copy of the table) run only when asked


def _gather_loop(table, ids, out):
    for i in range(ids.shape[0]):
        r = ids[i]
        for j in range(table.shape[1]):
            out[i, j] = table[r, j]


_GATHER = Kernel(_gather_loop, nogil=True)


class CompiledGather:
    """The ceiling: rows `table[ids]` copied by a compiled loop into a buffer made once
    per batch size and reused (the returned array is that buffer: read it before the
    next call). Rows are copied as 8-byte words where the row width allows."""

    name = "ceiling"

    def __init__(self, table: np.ndarray):
        self.table, self.row_bytes = table, table.shape[1]
        self.words = table.view(np.uint64) if self.row_bytes % 8 == 0 and table.flags.c_contiguous else None
        self.kernel = _GATHER.compiled()
        self.kind = "numba" if self.kernel is not None else "numpy take (numba missing or TIERSTORE_NO_JIT=1)"
        self._out: dict[int, np.ndarray] = {}

    def get(self, ids: np.ndarray) -> np.ndarray:
        out = self._out.get(ids.size)
        if out is None:
            out = self._out[ids.size] = np.empty((ids.size, self.row_bytes), dtype=np.uint8)
        if self.kernel is None:
            np.take(self.table, ids, axis=0, out=out, mode="clip")
        elif self.words is not None:
            self.kernel(self.words, ids, out.view(np.uint64))
        else:
            self.kernel(self.table, ids, out)
        return out


class WrongRows(TierstoreError):
    """A competitor returned bytes that differ from the table: its numbers would be meaningless."""


def check_same_rows(name: str, got: np.ndarray, want: np.ndarray) -> None:
    if got.shape != want.shape or not np.array_equal(got, want):
        bad = "shape" if got.shape != want.shape else f"{int((got != want).any(axis=1).sum())} rows differ"
        raise WrongRows(f"benchmark competitor {name!r} returned wrong rows ({bad}: got {got.shape}, "
                        f"want {want.shape}); its figures would be meaningless, fix it before benchmarking")


def close_all(closers: list) -> None:
    """Run cleanup callbacks last-first; one failing must not leave the rest (processes, shm) behind."""
    for close in reversed(closers):
        try:
            close()
        except Exception:  # noqa: BLE001 - clean up the rest regardless
            pass


def run_rounds(fns: dict[str, Callable], batches: list, rounds: int, progress=None,
               before_pass: Callable | None = None, round_batches: list | None = None,
               after_warmup: Callable | None = None) -> dict[str, dict]:
    """One untimed warm-up pass of each competitor over `batches` (then `after_warmup()`),
    then `rounds` timed rounds of one pass each, order rotated per round; round r reads
    `round_batches[r]` when given (fresh ids), else `batches` again.
    Returns {name: {pass_s, lat_s, cpu_s}}: cpu_s is the calling thread's CPU time per pass."""
    names = list(fns)
    for name in names:  # warm-up: page faults, connections, caches, lazy imports
        for b in batches:
            fns[name](b)
    if after_warmup is not None:
        after_warmup()
    out = {n: {"pass_s": [], "lat_s": [], "cpu_s": []} for n in names}
    for r in range(rounds):
        k = r % len(names)
        order = names[k:] + names[:k]
        for name in order:
            if before_pass is not None:
                before_pass(name)
            fn, lat = fns[name], out[name]["lat_s"]
            c0, t0 = time.thread_time(), time.perf_counter()
            for b in (round_batches[r] if round_batches is not None else batches):
                t = time.perf_counter()
                fn(b)
                lat.append(time.perf_counter() - t)
            out[name]["pass_s"].append(time.perf_counter() - t0)
            out[name]["cpu_s"].append(time.thread_time() - c0)
        if progress is not None:
            progress(1)
    return out


def summarize(timings: dict[str, dict], rows_per_pass: int, ref: str = "ceiling") -> dict[str, dict]:
    res = {}
    for name, t in timings.items():
        passes, lat = np.asarray(t["pass_s"]), np.asarray(t["lat_s"]) * 1e3
        d = {"rows_per_s": float(rows_per_pass / np.median(passes)), "p50_ms": float(np.percentile(lat, 50)),
             "p99_ms": float(np.percentile(lat, 99)),
             "latency_quantiles_ms": np.percentile(lat, QUANTILES).round(5).tolist(), "passes": len(passes)}
        if ref in timings:
            d["ratio_vs_ceiling"] = float(np.median(np.asarray(timings[ref]["pass_s"]) / passes))
            if t.get("cpu_s") and timings[ref].get("cpu_s") and min(t["cpu_s"]) > 0:
                d["cpu_ratio_vs_ceiling"] = float(np.median(np.asarray(timings[ref]["cpu_s"]) / np.asarray(t["cpu_s"])))
        res[name] = d
    return res


class _Arena:
    """plan() + gather from the mapped arena into a reused buffer (RowScratch); in cache mode a
    batch is planned in pieces of at most half the arena (one step may not need more rows
    than fit)."""

    def __init__(self, client, table: str, piece: int | None = None):
        self.client, self.table, self.piece = client, table, piece
        self.out = RowScratch(client.handle(table).row_bytes)

    def get(self, ids):
        out, piece = self.out.take(ids.size), self.piece or ids.size
        for a in range(0, ids.size, piece):
            with self.client.plan(self.table, ids[a:a + piece]) as step:
                step.rows(out[a:a + piece])
        return out


class _Lookup:
    """Client.lookup into a reused buffer (RowScratch): rows copied out (local reads where the
    sidecar offers them)."""

    def __init__(self, client, table: str, piece: int | None = None):
        self.client, self.table = client, table
        self.out = RowScratch(client.handle(table).row_bytes)

    def get(self, ids):
        return self.client.lookup(self.table, ids, out=self.out.take(ids.size))


class _ReadAhead(_Lookup):
    """Client.lookup with the next batch's ids as `ahead` (known a step ahead, as a queued
    prefill's next chunk is): its misses read behind this batch's, the device's queue never
    drained between the calls. `stream`: every batch, in the order they are read."""

    def __init__(self, client, table: str, stream: list):
        super().__init__(client, table)
        self._next = {id(a): b for a, b in zip(stream, stream[1:])}

    def get(self, ids):
        return self.client.lookup(self.table, ids, out=self.out.take(ids.size), ahead=self._next.get(id(ids)))


class _Prefetching(_Lookup):
    """arena-cache with request-level prefetch: while batch k is read, batch k+1's ids
    have already been handed to the sidecar (as a scheduler would at admission)."""

    batches: list = []

    def get(self, ids):
        nxt = next((b for a, b in zip(self.batches, self.batches[1:]) if a is ids), None)
        if nxt is not None:
            self.client.prefetch(self.table, nxt)
        return super().get(ids)


class _Inline:
    def __init__(self, client, table: str, row_bytes: int):
        from tierstore.proto import MAX_RESPONSE_BYTES

        self.client, self.table = client, table
        self.piece = max(1, (MAX_RESPONSE_BYTES - (1 << 20)) // row_bytes)

    def get(self, ids):
        if ids.size <= self.piece:
            return self.client.lookup(self.table, ids, inline=True)
        return np.concatenate([self.client.lookup(self.table, ids[a:a + self.piece], inline=True)
                               for a in range(0, ids.size, self.piece)])


class _TimedHits:
    """arena-cache's hit ratio over the timed rounds only (the warm-up pass, which fills the
    arena, left out): distinct ids per step, as the sidecar counts them, from the client's
    local reads, counted from the first timed pass to the end of the cell."""

    def __init__(self, handle):
        self.handle, self.start = handle, None

    def _counts(self) -> tuple[int, int] | None:
        local = self.handle.local_reads if self.handle is not None else None
        return None if local is None else (local.distinct_asked, local.distinct_cold)

    def before_pass(self, name: str) -> None:
        if name == "arena-cache" and self.start is None:
            self.start = self._counts()

    def ratio(self) -> float | None:
        end = self._counts()
        if self.start is None or end is None or end[0] == self.start[0]:
            return None
        return 1.0 - (end[1] - self.start[1]) / (end[0] - self.start[0])


def _table_stats(client, table: str) -> dict:
    for t in client.stats().get("tables", []):
        if t.get("table") == table:
            return t
    return {}


def _learned_stats(client, table: str, wait_s: float = 10.0) -> dict:
    """The table's stats once the sidecar has learned (or dropped) every step this client
    read locally: local reads count hits and misses when the learner takes their notes,
    which a busy host runs behind the steps (bounded wait)."""
    client.flush()
    local = client.handle(table).local_reads
    sent = local.steps if local is not None else 0
    deadline = time.monotonic() + wait_s
    while True:
        st = _table_stats(client, table)
        if int(st.get("local_steps", 0)) + int(st.get("notes_dropped", 0)) >= sent or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


@dataclass(slots=True)
class LookupOptions(BenchOptions):
    """What `bench lookup` runs (module docstring); `tierstore bench lookup` builds it from
    the flags of the same names. Defaults of a field left unset: DEFAULTS (full run, --quick)."""

    table: str | None = None            # the table of data_dir to read (default: its first)
    table_bytes: int | None = None      # or a random table this large, in OUT/baselines/lookup-data
    batches: tuple | None = None        # ids per call: a cell each (batch, dist)
    dists: tuple | None = None          # how they are drawn (bench/workload.py)
    rounds: int | None = None           # timed interleaved rounds per cell
    rows_per_pass: int | None = None    # ids per pass (at least 3 batches)
    cache_fraction: float = 0.10        # arena-cache's DRAM budget, of every table's bytes
    competitors: tuple | None = None    # run only these (the ceiling always); default: all, lmdb and
                                        # redis only for tables up to COPY_LIMIT
    huge_shm_dir: str | None = None     # also run arena-huge, the full-resident arena in this directory
                                        # (huge pages where its mount gives them)

    DEFAULTS = {"batches": ((256, 4096, 32768, 65536), (4096, 32768)),
                "dists": (("zipf0.8", "zipf1.0", "zipf1.2", "uniform"), ("zipf1.0", "uniform")),
                "rounds": (5, 3), "rows_per_pass": (131072, 32768)}

    def validate(self) -> None:
        if self.table is not None and self.table_bytes is not None:
            raise InvalidArgument("bench lookup: --table reads a table of --data, --table-mib writes its own; "
                                  "pass one of them")
        self.batches, self.dists = tuple(self.batches), tuple(self.dists)
        self.competitors = tuple(self.competitors) if self.competitors else None
        if min(self.batches) < 1 or not 0 < self.cache_fraction <= 1:
            raise InvalidArgument(f"bench lookup: batches must be >= 1 ids and the cache fraction in (0, 1], got "
                                  f"{self.batches}, {self.cache_fraction}")
        for dist in self.dists:
            parse_dist(dist)


def run_lookup_bench(data_dir, out_dir, options: LookupOptions | None = None, log=print) -> dict:
    """Run the lookup scenario (module docstring) on `options.table` of `data_dir`, or
    on a random table of `options.table_bytes` in OUT/baselines/lookup-data.

    out_dir: where LMDB's copy of the table is built once (OUT/baselines).
    Raises WrongRows when any competitor returns bytes that differ from the table.
    Returns the scenario dict written to results.json.
    """
    from tqdm import tqdm

    o = options or LookupOptions()
    t = _open_table(data_dir, out_dir, o, log)
    version = t.version
    closers: list = []
    try:
        log(f"lookup: table {t.name!r} v{version.number}: {version.rows:,} rows x {version.row_bytes} B "
            f"({version.nbytes / 2**20:.1f} MiB)")
        comps = _Competitors(t, out_dir, o, closers, log)
        cells = []
        with tqdm(total=len(o.dists) * len(o.batches) * o.rounds, desc="lookup", unit="round",
                  **_bar_options(o.progress)) as bar:
            for dist in o.dists:
                for batch in o.batches:
                    cells.append(comps.cell(dist, batch, bar))
                    log(line_for(cells[-1]))
        comps.meta["pages"] = comps.pages()
    finally:
        close_all(closers)
    return {"table": t.name, "version": version.number, "rows": version.rows, "row_bytes": version.row_bytes,
            "table_bytes": version.nbytes, "rounds": o.rounds, "quick": o.quick, "units": UNITS,
            "competitors": list(comps.fns), "skipped": comps.skipped, "config": comps.meta, "cells": cells}


def start_sidecar(data_dir, closers: list, dram_budget, extra_args=()) -> tuple:
    """(SidecarProcess, Client): a sidecar serving `data_dir` (BENCH_SIDECAR_FLAGS) and a client
    of it, each stopped by `closers` (close_all: the client first)."""
    from tierstore.client.client import Client
    from tierstore.sidecar.launcher import SidecarProcess

    sidecar = SidecarProcess(data_dir, dram_budget=dram_budget, extra_args=[*BENCH_SIDECAR_FLAGS, *extra_args]).start()
    closers.append(sidecar.cleanup)
    client = Client(sidecar.socket)
    closers.append(client.close)
    return sidecar, client


@dataclass(frozen=True)
class _Table:
    """The table a lookup run reads: `name` of `data_dir` at its current `version`, and the
    bytes of every table there (a full-resident sidecar holds them all)."""

    data_dir: Path
    name: str
    version: object
    total_bytes: int


def _open_table(data_dir, out_dir, o: LookupOptions, log) -> _Table:
    from tierstore.store.catalog import Catalog

    table = o.table
    if o.table_bytes is not None:
        from tierstore.bench.random_table import random_table

        data_dir = Path(out_dir) / "baselines" / "lookup-data"
        log(f"lookup: random table of {o.table_bytes / 2**20:.0f} MiB in {data_dir} (written once, then reused)")
        table = random_table(data_dir, o.table_bytes, row_bytes=264, seed=o.seed, progress=o.progress,
                             name="lookup").table
    with Catalog(data_dir, readonly=True) as cat:
        names = cat.tables()
        table = table or names[0]
        return _Table(Path(data_dir), table, cat.current(table), sum(cat.current(n).nbytes for n in names))


def _bar_options(progress: bool) -> dict:
    return dict(file=None, disable=not progress, leave=False)


class _Competitors:
    """The competitors a lookup run asks for (the ceiling always), started, each stopped by
    `closers`: `fns[name](ids)` reads a batch, `meta` says how one is set up, `skipped`
    why one did not run; `cell` times them all on one (distribution, batch size)."""

    def __init__(self, t: _Table, out_dir, o: LookupOptions, closers: list, log):
        from tierstore.bench import baselines as bl

        self.t, self.o, self.fns, self.meta = t, o, {}, {}
        self.arena_clients: dict = {}  # arena, arena-huge: the clients whose maps pages() reads
        self.table_np = bl.load_table(t.data_dir, t.version)
        want, self.skipped = self._wanted()
        ceiling = CompiledGather(self.table_np)
        self.fns["ceiling"] = ceiling.get
        self.meta["ceiling"] = {"gather": ceiling.kind, "buffer": "allocated once per batch size, reused"}
        self.meta["buffers"] = "every tierstore competitor but inline reads into a buffer it reuses " \
                               "(RowScratch; Client.lookup(out=), StepPlan.rows(out))"
        self.cached = self._start_sidecars(want, closers)  # arena-cache's client, None when it does not run
        self._open_baselines(want, out_dir, closers, log)

    def _wanted(self) -> tuple[set, dict]:
        """The competitors to run and why any of the default ones is left out."""
        asked, version = self.o.competitors, self.t.version
        want = set(asked or ("ceiling", "arena", "arena-cache", "arena-cache-plan",
                             "arena-cache-prefetch", "inline", "mmap", "lmdb", "redis"))
        want.add("ceiling")
        skipped: dict[str, str] = {}
        if version.nbytes > COPY_LIMIT:
            for name in ("lmdb", "redis"):
                if name in want and name not in (asked or ()):
                    want.discard(name)
                    skipped[name] = (f"a second copy of a {version.nbytes / 2**30:.1f} GiB table; "
                                     f"name it in --competitors to run it")
        return want, skipped

    def _start_sidecars(self, want: set, closers: list):
        t, table, full_budget = self.t, self.t.name, int(self.t.total_bytes * 1.02) + (8 << 20)
        if "arena" in want or "inline" in want:
            _, client = start_sidecar(t.data_dir, closers, full_budget)
            if "arena" in want:
                self.fns["arena"] = _Arena(client, table).get
                self.arena_clients["arena"] = client
            if "inline" in want:
                self.fns["inline"] = _Inline(client, table, t.version.row_bytes).get
        if self.o.huge_shm_dir is not None and (self.o.competitors is None or "arena-huge" in want):
            huge, hclient = start_sidecar(t.data_dir, closers, full_budget,
                                          ["--shm-dir", self.o.huge_shm_dir, "--arena-pages", "huge"])
            self.fns["arena-huge"] = _Arena(hclient, table).get
            self.arena_clients["arena-huge"] = hclient
            self.meta["arena_huge"] = {"shm_dir": str(self.o.huge_shm_dir),
                                       "log": [ln for ln in huge.log().splitlines() if "pages" in ln][-3:]}
        if "arena-cache" not in want:
            return None
        budget = max(int(t.total_bytes * self.o.cache_fraction), 1 << 16)
        _, cclient = start_sidecar(t.data_dir, closers, budget)
        cap = int(next(i for i in cclient.tables() if i["table"] == table)["arena_slots"])
        self.meta["arena_cache"] = {"dram_budget_bytes": budget, "arena_slots": cap,
                                    "fraction_of_table": cap / t.version.rows, "plan_piece_ids": max(1, cap // 2)}
        self.fns["arena-cache"] = _Lookup(cclient, table).get
        # variants on sidecars of their own (a shared arena would hand one the other's warm rows)
        for name, kind in (("arena-cache-plan", _Arena), ("arena-cache-prefetch", _Prefetching)):
            if name in want:
                _, vclient = start_sidecar(t.data_dir, closers, budget)
                self.fns[name] = kind(vclient, table, piece=max(1, cap // 2)).get
        return cclient

    def pages(self) -> dict:
        """What arena and arena-huge read through, after the rounds: the page size their
        sidecar's Stats report, and of this process's (the client's) map of the arena, the
        bytes on huge pages and the bytes mapped (/proc/self/smaps)."""
        from tierstore.tiers.pages import huge_page_bytes

        out = {}
        for name, client in self.arena_clients.items():
            st = next(s for s in client.stats()["tables"] if s["table"] == self.t.name)
            huge, mapped = huge_page_bytes(client.handle(self.t.name)._arena_path)
            out[name] = {"page_bytes": int(st["arena_page_bytes"]), "client_huge_bytes": huge,
                         "client_mapped_bytes": mapped}
        return out

    def _open_baselines(self, want: set, out_dir, closers: list, log) -> None:
        from tqdm import tqdm

        from tierstore.bench import baselines as bl

        version, bar = self.t.version, _bar_options(self.o.progress)
        if "mmap" in want:
            mm = bl.MmapTable(self.t.data_dir, version)
            closers.append(mm.close)
            self.fns["mmap"] = mm.get
        if "lmdb" in want:
            with tqdm(total=version.rows, desc="build lmdb baseline", unit="row", **bar) as b:
                db = bl.LmdbTable(Path(out_dir) / "baselines", version, self.table_np, progress=b.update)
            closers.append(db.close)
            self.fns["lmdb"] = db.get
        if "redis" in want:
            why = bl.redis_available()
            if why is None:
                try:
                    with tqdm(total=version.rows, desc="load redis baseline", unit="row", **bar) as b:
                        rd = bl.RedisTable(self.table_np, progress=b.update)
                    closers.append(rd.close)
                    self.fns["redis"] = rd.get
                except RuntimeError as e:
                    why = str(e)
            if why is not None:
                self.skipped["redis"] = why
                log(f"lookup: redis skipped: {why}")

    def cell(self, dist: str, batch: int, bar) -> dict:
        """Every competitor's rows checked on the first batch, then `rounds` timed interleaved
        rounds (after arena-cache's sidecar has learned the warm-up pass): one cell."""
        table, cached, o = self.t.name, self.cached, self.o
        calls = max(3, o.rows_per_pass // batch)
        ids = _batches(dist, self.t.version.rows, batch, calls, o.seed)
        want_rows = self.table_np[ids[0]]
        _Prefetching.batches = list(ids)
        for name, fn in self.fns.items():
            check_same_rows(name, fn(ids[0]), want_rows)
        bar.set_description(f"lookup {dist} b={batch}")
        s0 = _learned_stats(cached, table) if cached is not None else None
        timed = _TimedHits(cached.handle(table) if s0 is not None else None)
        # the timed rounds start once the sidecar has learned the warm-up's local reads (and
        # promoted their misses): steady state, not the learner's lag on a busy host
        timings = run_rounds(self.fns, ids, o.rounds, progress=bar.update, before_pass=timed.before_pass,
                             after_warmup=(lambda: _learned_stats(cached, table)) if s0 is not None else None)
        cell = {"dist": dist, "batch": batch, "calls_per_pass": calls, "rows_per_pass": calls * batch,
                "competitors": summarize(timings, calls * batch)}
        if s0 is not None:
            s1 = _learned_stats(cached, table)
            h, m = int(s1.get("hits", 0)) - int(s0.get("hits", 0)), int(s1.get("misses", 0)) - int(s0.get("misses", 0))
            cell["competitors"]["arena-cache"]["hit_ratio"] = h / (h + m) if h + m else None
            cell["competitors"]["arena-cache"]["hit_ratio_timed"] = timed.ratio()
        return cell


def _batches(dist, rows, batch, calls, seed):
    from tierstore.bench.workload import make_batches
    return make_batches(dist, rows, batch, calls, seed)


def line_for(cell: dict) -> str:
    """`lookup zipf1.0 b=32768: arena 0.91x [cpu 0.95x], arena-cache 0.7x [cpu 0.8x] (hit 0.83, timed 0.99),
    inline 0.07x, ... of ceiling (N M rows/s)`: wall-clock ratios, the reading thread's CPU ratio for the
    local tierstore paths, arena-cache's hit ratio over the cell and over its timed rounds."""
    comps = cell["competitors"]
    parts = []
    for name, d in comps.items():
        if name == "ceiling":
            continue
        s = f"{name} {d['ratio_vs_ceiling']:.3g}x"
        if name.startswith("arena") and d.get("cpu_ratio_vs_ceiling") is not None:
            s += f" [cpu {d['cpu_ratio_vs_ceiling']:.3g}x]"
        if d.get("hit_ratio") is not None:
            s += f" (hit {d['hit_ratio']:.2f}"
            s += f", timed {d['hit_ratio_timed']:.2f})" if d.get("hit_ratio_timed") is not None else ")"
        parts.append(s)
    ceil = comps["ceiling"]["rows_per_s"]
    return f"lookup {cell['dist']} b={cell['batch']}: " + ", ".join(parts) + f" of ceiling ({ceil / 1e6:.1f} M rows/s)"
