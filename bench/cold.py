"""`tierstore bench cold`: a table 4x larger than the DRAM budget, served from
the NVMe tier through the DRAM cache, against the all-DRAM case and a
memory-mapped file.

Competitors (same ids, same table, medians of rounds):
  dram              full-resident sidecar (the whole table in the arena)
  tierstore-cold    sidecar with a DRAM budget of 1/4 of the table (cache mode;
                    misses read through the page cache)
  tierstore-direct  the same with --direct-io (misses read with O_DIRECT: the
                    page cache holds none of the table); skipped, with the
                    reason, where the filesystem refuses O_DIRECT
  tierstore-local   the same (--direct-io where the filesystem allows it) read by
                    Client.lookup: local reads, misses read and verified by the
                    client, the sidecar told each step after the fact; each batch's
                    ids are known a batch ahead (lookup's `ahead`, as a queued
                    prefill's are): its misses read behind the batch before's
  mmap-cold         np.memmap of the segment files (MADV_RANDOM) in a child process

Hit ratios: the sidecars' (unique ids per Plan found in the arena); tierstore-local's
as its client saw them (distinct ids per step found in the arena); mmap's is
1 - major page faults / rows gathered (a gathered row whose page was resident).
Each is set beside LRU's on the same steps at the same capacity (`lru_hit_ratio`:
every step the competitors ran, replayed through PolicyConfig(kind="lru"), counted
over the timed rounds). Arena fill: after every warm-up step, the rows resident
against the distinct ids asked so far (`arena_fill`).
Misses against the disk: before the competitors run, the disk is probed
(bench/disk.py, as `bench large` does: 512-B O_DIRECT random reads at queue
depths 32 to 256); tierstore-direct's misses (read by its sidecar to promote
them) and tierstore-local's (read by its client) per second of the timed rounds
are reported against the best depth's IOPS (`misses_per_s_of_disk_best`).
Memory each cache-mode sidecar causes, measured after a pass from a dropped
page cache: its RSS (heap + arena + mapped files) and the segment files' pages
in the page cache (mincore), against --dram-budget.

Fair memory: when a memory cgroup can be made (v2 memory.max, else v1
memory.limit_in_bytes), mmap-cold runs in one capped at budget + slack, and the
cache-mode sidecar is moved into one capped at slack + a heap allowance once its
arena (= budget) is allocated, so both hold about the same DRAM for rows and the
rest comes from disk. Without a cgroup the page cache is unbounded and the
results say so.

Competitors run one after another, each from a dropped page cache (posix_fadvise
DONTNEED on the segment files): a cold-start pass, reported on its own; a
warm-up of fresh ids (twice the arena) to the cache's steady state; then the
timed rounds, fresh ids again. Run side by side, one competitor's page cache
would be the other's hits.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tierstore.bench.cache import replay_steps
from tierstore.bench.lookup import (
    _Arena,
    _ReadAhead,
    check_same_rows,
    close_all,
    run_rounds,
    start_sidecar,
    summarize,
)
from tierstore.bench.memory import (
    MemoryCgroup,
    drop_page_cache,
    footprint,
    proc_memory,
    resident_bytes,
)
from tierstore.bench.disk import DEPTHS, best_iops, disk_limit
from tierstore.bench.mmap_child import MmapChild
from tierstore.bench.random_table import random_table
from tierstore.bench.workload import BenchOptions, parse_dist
from tierstore.errors import InvalidArgument

__all__ = ["run_cold_bench", "ColdOptions", "direct_io_refusal", "stop_sidecar", "local_counts", "timed_pass",
           "MemoryCgroup", "drop_page_cache"]

UNITS = {"rows_per_s": "rows/s", "p50_ms": "ms per batch", "p99_ms": "ms per batch",
         "ratio_vs_dram": "x (rows/s over the all-DRAM sidecar's, median of per-round ratios)",
         "hit_ratio": "fraction of unique ids per Plan found in the DRAM arena", "bytes": "bytes"}


@dataclass(slots=True)
class ColdOptions(BenchOptions):
    """What `bench cold` runs (module docstring); `tierstore bench cold` builds it from the
    flags of the same names. Defaults of a field left unset: DEFAULTS (full run, --quick)."""

    table_bytes: int | None = None      # the random table, kept in OUT/baselines/cold-data
    budget_fraction: float = 0.25       # the cache-mode sidecars' DRAM budget, of the table's bytes
    batch: int = 4096                   # ids per call
    dist: str = "zipf1.0"               # how they are drawn (bench/workload.py)
    rounds: int | None = None           # timed rounds, each a pass of fresh ids
    rows_per_pass: int | None = None    # ids per pass (at least 3 batches)
    warmup_arenas: float = 2.0          # warm-up ids per competitor, in arena sizes
    warmup_calls: int | None = None     # the warm-up in calls instead, when given
    slack_bytes: int = 32 << 20         # page cache the memory cgroups allow ("Fair memory")
    heap_bytes: int = 32 << 20          # and the cache-mode sidecar's heap, in its cgroup
    disk_seconds: float | None = None   # per disk probe

    DEFAULTS = {"table_bytes": (768 << 20, 160 << 20), "rounds": (5, 3), "rows_per_pass": (65536, 16384),
                "disk_seconds": (3.0, 0.3)}

    def validate(self) -> None:
        if not 0 < self.budget_fraction <= 1:
            raise InvalidArgument(f"bench cold: --budget-fraction is a fraction of the table in (0, 1], "
                                  f"got {self.budget_fraction}")
        if self.batch < 1:
            raise InvalidArgument(f"bench cold: --batch must be >= 1 ids, got {self.batch}")
        parse_dist(self.dist)


def run_cold_bench(out_dir, options: ColdOptions | None = None, log=print) -> dict:
    """Run the cold-tier scenario (module docstring) on a random table of
    `options.table_bytes` in OUT/baselines/cold-data. Raises WrongRows when a
    competitor returns bytes that differ from the table. Returns the scenario dict
    for results.json."""
    o = options or ColdOptions()
    cache_dir = Path(out_dir) / "baselines" / "cold-data"
    log(f"cold: table of {o.table_bytes / 2**20:.0f} MiB in {cache_dir} (written once, then reused)")
    version = random_table(cache_dir, o.table_bytes, seed=o.seed, progress=o.progress)
    budget = int(version.nbytes * o.budget_fraction)
    seg_paths = [cache_dir / s for s in version.segments]
    steps = _Steps.draw(version, o, budget // version.row_bytes)
    no_direct = direct_io_refusal(seg_paths)
    log(f"cold: disk probe (io_uring O_DIRECT random 512-B reads, queue depths {DEPTHS}, {o.disk_seconds:g} s each)")
    disk = disk_limit(seg_paths, blocks=(512,), seconds=o.disk_seconds, seed=o.seed)
    top = best_iops(disk, 512)
    closers = []
    try:
        comps = _Competitors(cache_dir, version, budget, no_direct, steps.stream, closers)
        caps = _MemoryCaps(comps, budget, o.slack_bytes, o.heap_bytes, closers)
        at_start = {n: proc_memory(p.proc.pid) for n, (p, _) in comps.sides.items()}
        # One competitor at a time, mmap last: page cache dropped; the cold-start pass, timed on
        # its own; a warm-up of fresh ids to the cache's steady state; the timed rounds (fresh
        # ids again); its rows checked; a sidecar is then stopped (pages a mapping holds
        # survive DONTNEED: they would be the next one's hits).
        runs = {name: _measure(name, comps, steps, at_start, o.progress) for name in comps.order}
        figures = _figures(runs, comps, steps, o.batch, top)
        memory = caps.limits_and_peaks()
    finally:
        close_all(closers)
    result = {"table_rows": version.rows, "row_bytes": version.row_bytes, "table_bytes": version.nbytes,
              "dram_budget_bytes": budget, "arena_slots": comps.cap, "dist": o.dist, "batch": o.batch,
              "rows_per_pass": len(steps.ids) * o.batch, "fresh_ids_every_pass": True, "rounds": o.rounds,
              "quick": o.quick, "units": UNITS, "warmup_ids": len(steps.warm) * o.batch,
              "order": "one competitor at a time, page cache dropped before each",
              "page_cache_drop": runs["mmap-cold"]["page_cache_drop"], "memory_limits": memory,
              "cold_start": {n: r["cold_start"] for n, r in runs.items() if "cold_start" in r},
              "competitors": figures,
              "memory_footprint": {n: r["footprint"] for n, r in runs.items() if "footprint" in r},
              "direct_io": no_direct or "on", "disk": disk,
              "disk_best_iops": top["iops"] if top else None, "disk_best_qd": top["qd"] if top else None}
    log(cold_line(result))
    return result


@dataclass(frozen=True)
class _Steps:
    """A run's id batches, fresh everywhere (a cold tier must see the distribution's tail):
    `ids` the cold-start pass, `warm` the warm-up, `passes[r]` timed round r's; `stream`
    all of them in that order (the mmap child is handed it)."""

    stream: list
    ids: list
    warm: list
    passes: list

    @classmethod
    def draw(cls, version, o: ColdOptions, cap_rows: int) -> "_Steps":
        from tierstore.bench.workload import make_batches

        calls = max(3, o.rows_per_pass // o.batch)
        # warm-up: `warmup_arenas` (default twice) the arena in ids, so each cache reaches its steady
        # state before it is timed
        warm = max(calls, -(-int(o.warmup_arenas * cap_rows) // o.batch)) if o.warmup_calls is None else o.warmup_calls
        stream = make_batches(o.dist, version.rows, o.batch, calls * (o.rounds + 1) + warm, o.seed)
        return cls(stream, stream[:calls], stream[calls:calls + warm],
                   [stream[calls + warm + i * calls:calls + warm + (i + 1) * calls] for i in range(o.rounds)])

    @property
    def timed(self) -> list:
        return [b for p in self.passes for b in p]


class _Competitors:
    """The processes of one run, each stopped by `closers` (close_all, last first): the
    full-resident sidecar (`dram`, the reference), the cache-mode ones (tierstore-cold
    planned, tierstore-local read by local reads, tierstore-direct where the filesystem
    takes O_DIRECT) and the mmap child. `fns[name](ids)` reads a batch; `sides[name]` is a
    cache-mode sidecar and its client; `order` the order they run in."""

    def __init__(self, cache_dir, version, budget: int, no_direct: str | None, stream, closers: list):
        self.rows, self.budget = version.rows, budget
        self.seg_paths = [cache_dir / s for s in version.segments]
        _, self.dram = start_sidecar(cache_dir, closers, int(version.nbytes * 1.02) + (8 << 20))
        # planned steps (as below): no slot index in /dev/shm, whose pages the cgroup would count
        self.cold = start_sidecar(cache_dir, closers, budget, ["--no-local-reads"])
        self.cap = int(self.cold[1].tables()[0]["arena_slots"])
        piece = max(1, self.cap // 2)
        # local reads (the route a local Client.lookup takes), not in a cgroup: its clients map the slot index
        self.local = start_sidecar(cache_dir, closers, budget, ["--direct-io"] if no_direct is None else [])
        self.direct = None
        if no_direct is None:
            self.direct = start_sidecar(cache_dir, closers, budget, ["--direct-io", "--no-local-reads"])
        self.child = MmapChild(cache_dir, version, stream)
        closers.append(self.child.close)
        self.fns = {"dram": _Arena(self.dram, "cold").get, "tierstore-cold": _Arena(self.cold[1], "cold", piece).get,
                    "mmap-cold": self.child.get, "tierstore-local": _ReadAhead(self.local[1], "cold", stream).get}
        self.sides = {"tierstore-cold": self.cold, "tierstore-local": self.local}
        if self.direct is not None:
            self.fns["tierstore-direct"] = _Arena(self.direct[1], "cold", piece).get
            self.sides["tierstore-direct"] = self.direct
        self.order = ["dram"] + [n for n in ("tierstore-local", "tierstore-direct", "tierstore-cold", "mmap-cold")
                                 if n in self.fns]
        # rows checked against the full-resident arena (= the table, verified on load)
        self.table_rows = self.dram.handle("cold").arena_np


class _MemoryCaps:
    """Fair memory (module docstring): tierstore-cold's and tierstore-direct's sidecars each
    in a cgroup of slack + heap, the mmap child in one of budget + slack, where cgroups
    can be made; `limits_and_peaks()` is results.json's memory_limits."""

    def __init__(self, comps: _Competitors, budget: int, slack_bytes: int, heap_bytes: int, closers: list):
        # A process's memory stays charged where it was allocated when the process moves
        # to a cgroup: the sidecar's arena and start-up heap are outside its cgroup, so it
        # is capped at `slack` of page cache plus `heap` for its heap to grow while serving
        # (~9 MB over 600 steps of the 768 MiB table: its per-slot state is faulted in at
        # start), and mmap at the budget plus the same slack.
        self.side, self.mmap = MemoryCgroup(slack_bytes + heap_bytes), MemoryCgroup(budget + slack_bytes)
        closers[:0] = [self.side.close, self.mmap.close]  # removed last, once their processes are gone
        self.direct = MemoryCgroup(slack_bytes + heap_bytes) if comps.direct is not None else None
        if self.direct is not None:
            closers[:0] = [self.direct.close]
        self.on = self.side.error is None and self.mmap.error is None
        if self.on:
            self.side.add(comps.cold[0].proc.pid)
            self.mmap.add(comps.child.proc.pid)
            if self.direct is not None and self.direct.error is None:
                self.direct.add(comps.direct[0].proc.pid)
            self.limits = {"cgroup": self.side.kind,
                           "tierstore_local_bytes": "not capped (its clients map the slot index)",
                           "tierstore_cold_bytes": f"arena {budget} + cgroup {slack_bytes} page cache + "
                                                   f"{heap_bytes} heap",
                           "mmap_cold_bytes": f"cgroup {budget + slack_bytes}",
                           "note": "competitors run one after another, each from a dropped page cache: the pages "
                                   "one holds are not hits for the next"}
        else:
            self.limits = {"cgroup": None, "reason": self.side.error or self.mmap.error,
                           "note": "page cache unbounded: after warm-up mmap-cold and tierstore misses are served "
                                   "from DRAM page cache, not disk"}

    def limits_and_peaks(self) -> dict:
        if self.on:
            self.limits["tierstore_cold_cgroup_peak_bytes"] = self.side.peak()
            self.limits["mmap_cold_cgroup_peak_bytes"] = self.mmap.peak()
            if self.direct is not None and self.direct.error is None:
                self.limits["tierstore_direct_cgroup_peak_bytes"] = self.direct.peak()
        return self.limits


def _measure(name: str, comps: _Competitors, steps: _Steps, at_start: dict, progress: bool) -> dict:
    """One competitor's block: (all but dram) the page cache dropped and the cold-start pass;
    the warm-up; the timed rounds; its rows checked; a cache-mode sidecar stopped. Returns
    what it measured: timings, and where they apply page_cache_drop, cold_start,
    footprint, fill and stats (a cache-mode sidecar's), seen_local, faults (mmap's)."""
    from tqdm import tqdm

    fn, side = comps.fns[name], comps.sides.get(name)
    got = {}
    fill = _Fill(comps.rows, comps.cap, side[1]) if side else None
    if name != "dram":
        got["page_cache_drop"] = drop_page_cache(comps.seg_paths)
        pinned = resident_bytes(comps.seg_paths)  # mapped by an earlier competitor: not this one's
        got["cold_start"] = timed_pass(fn, steps.ids)
        if fill is not None:
            fill.asked(steps.ids)
        if side:
            got["footprint"] = footprint(side[0].proc.pid, comps.seg_paths, comps.budget, at_start[name], pinned)
    with tqdm(total=len(steps.warm) + len(steps.passes), desc=f"cold {name}", unit="step", disable=not progress,
              leave=False) as bar:
        for b in steps.warm:
            fn(b)
            if fill is not None:
                fill.step(b)
            bar.update(1)
        if fill is not None:
            fill.settle()
        s0 = side[1].stats()["tables"][0] if side else None
        l0 = local_counts(comps.local[1], "cold") if name == "tierstore-local" else None
        f0 = comps.child.faults() if name == "mmap-cold" else 0
        got["timings"] = run_rounds({name: fn}, [], len(steps.passes), progress=bar.update,
                                    round_batches=steps.passes)[name]
        if name == "mmap-cold":
            got["faults"] = comps.child.faults() - f0
        if l0 is not None:
            got["seen_local"] = {k: v - l0[k] for k, v in local_counts(comps.local[1], "cold").items()}
        if side:
            fill.asked(*steps.timed)
            fill.settle()
            got["fill"] = fill.summary()
            got["stats"] = (s0, side[1].stats()["tables"][0])
    check_same_rows(name, np.asarray((comps.child.rows if name == "mmap-cold" else fn)(steps.ids[0])),
                    comps.table_rows[steps.ids[0]])
    if side:
        stop_sidecar(*side)
    return got


def _figures(runs: dict, comps: _Competitors, steps: _Steps, batch: int, top: dict | None) -> dict:
    """results.json's competitors: rows/s and latency against dram's, the cache-mode
    sidecars' hit ratios, misses and arena fill, mmap's faults, LRU's hit ratio on the same
    steps at the same capacity, and each tierstore competitor against mmap-cold."""
    from tierstore.cache.policy import PolicyConfig

    timings = {n: r["timings"] for n, r in runs.items()}
    figs = summarize(timings, len(steps.ids) * batch, ref="dram")
    for d in figs.values():
        d["ratio_vs_dram"] = d.pop("ratio_vs_ceiling")
    for n in comps.sides:
        s0, s1 = runs[n]["stats"]
        h, m = int(s1["hits"]) - int(s0["hits"]), int(s1["misses"]) - int(s0["misses"])
        figs[n]["hit_ratio"] = h / (h + m) if h + m else None
        figs[n]["misses_per_s"] = m / sum(timings[n]["pass_s"])
        figs[n]["bytes_read_from_segments"] = int(s1.get("bytes_read", 0)) - int(s0.get("bytes_read", 0))
        figs[n]["metadata_bytes"] = int(s1.get("metadata_bytes", 0))  # resident from start, beyond the arena
        figs[n]["arena_fill"] = runs[n]["fill"]
        figs[n]["bytes_read_since_start"] = int(s1.get("bytes_read", 0))  # cold start and warm-up too
    seen = runs["tierstore-local"]["seen_local"]
    loc = figs["tierstore-local"]  # as its client saw it: the sidecar learns local steps after the fact
    loc["sidecar_hit_ratio"], loc["hit_ratio"] = loc["hit_ratio"], (
        1 - seen["distinct_cold"] / max(1, seen["distinct_asked"]))
    loc["bytes_read_by_clients"] = seen["bytes_read"]
    loc["misses_per_s"] = seen["distinct_cold"] / sum(timings["tierstore-local"]["pass_s"])
    loc["notes_dropped"] = int(runs["tierstore-local"]["stats"][1].get("notes_dropped", 0))
    for n in ("tierstore-direct", "tierstore-local"):  # misses read with O_DIRECT (where allowed)
        if n in figs and top:
            figs[n]["misses_per_s_of_disk_best"] = figs[n]["misses_per_s"] / top["iops"]
    # LRU on the same steps at the same capacity: every step each competitor ran, in order
    lru = replay_steps(list(steps.ids) + list(steps.warm) + steps.timed, comps.rows, comps.cap,
                       PolicyConfig(kind="lru"), count_from=len(steps.ids) + len(steps.warm))
    for d in figs.values():
        d["lru_hit_ratio"] = lru
    # rows gathered = unique ids per call (as the sidecars count), in the timed rounds
    gathered = sum(np.unique(b).size for b in steps.timed)
    mmap = figs["mmap-cold"]
    mmap["hit_ratio"] = max(0.0, 1 - runs["mmap-cold"]["faults"] / gathered)
    mmap["major_faults"] = runs["mmap-cold"]["faults"]
    for n in ("tierstore-direct", "tierstore-local", "tierstore-cold"):
        if n in figs:
            figs[n]["x_mmap"] = figs[n]["rows_per_s"] / mmap["rows_per_s"]
    return figs


def direct_io_refusal(seg_paths) -> str | None:
    """None where the segments' filesystem takes O_DIRECT (tmpfs before Linux 6.6
    does not), else why not: competitors that need it are skipped with that reason."""
    from tierstore.tiers.nvme.direct_io import DirectFiles

    try:
        DirectFiles(list(seg_paths)[:1]).close()
        return None
    except Exception as e:  # noqa: BLE001 - the reason is reported, the bench goes on without it
        return str(e)


def stop_sidecar(proc, client) -> None:
    """Stop a cache-mode sidecar after its block; a death during it (its memory
    cgroup killed it?) fails the bench with its log."""
    died = proc.proc.poll() is not None
    client.close()
    log = proc.log() if died else ""
    proc.cleanup()
    if died:
        raise RuntimeError(f"a cache-mode sidecar died during its block (killed by its memory cgroup?); "
                           f"rerun with a larger slack:\n{log}")


class _Fill:
    """Arena fill over steps: after each step, (distinct ids asked so far, rows resident),
    read from the sidecar's stats once its client's notes are sent (local reads)."""

    def __init__(self, rows: int, capacity: int, client):
        self.seen, self.capacity, self.client = np.zeros(rows, dtype=bool), capacity, client
        self.distinct, self.points = 0, []

    def asked(self, *batches) -> None:
        for b in batches:
            u = np.unique(b)
            new = u[~self.seen[u]]
            self.seen[new] = True
            self.distinct += new.size

    def step(self, ids) -> None:
        self.asked(ids)
        self.client.flush()
        self.points.append((self.distinct, int(self.client.stats()["tables"][0]["resident"])))

    def settle(self, timeout_s: float = 2.0) -> None:
        """One more point once the sidecar has learned every note sent (resident stops moving)."""
        self.client.flush()
        last, t0 = -1, time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            now = int(self.client.stats()["tables"][0]["resident"])
            if now == last:
                break
            last = now
            time.sleep(0.05)
        self.points.append((self.distinct, last))

    def summary(self) -> dict:
        pts = np.asarray(self.points, dtype=np.int64).reshape(-1, 2)
        fill = pts[:, 1] / self.capacity
        of_asked = pts[:, 1] / np.maximum(1, np.minimum(pts[:, 0], self.capacity))
        past = np.flatnonzero(pts[:, 0] >= self.capacity)
        keep = np.unique(np.linspace(0, len(pts) - 1, min(len(pts), 24)).astype(int))
        return {"capacity": self.capacity, "final_fill": float(fill[-1]),
                "fill_once_past_capacity": float(fill[past].min()) if past.size else None,
                "fill_of_asked_min": float(of_asked[len(of_asked) // 2:].min()),
                "points_distinct_asked_resident": pts[keep].tolist()}


def local_counts(client, table: str) -> dict:
    """What the local-reads client served of `table`: distinct ids asked and read from disk, disk bytes,
    the seconds its steps spent reading misses, and the client's (any of its tables reading
    misses, counted once where lookup_many overlaps them: Client.miss_clock), and the client's
    lookup_many calls that read their tables overlapped."""
    local = client.handle(table).local_reads
    cold = getattr(local, "_cold", None)
    return {"distinct_asked": local.distinct_asked if local else 0, "distinct_cold": local.distinct_cold if local else 0,
            "bytes_read": cold.bytes_read if cold is not None else 0,
            "cold_seconds": local.cold_seconds if local else 0.0, "client_miss_seconds": client.miss_clock.seconds,
            "overlapped_calls": client.overlapped}


def timed_pass(fn, batches, rows: int | None = None) -> dict:
    """fn over `batches` back to back: rows/s (`rows` gathered, default the ids of
    every batch), per-batch p50 / p99 in ms, and seconds."""
    lat = []
    t0 = time.perf_counter()
    for b in batches:
        t = time.perf_counter()
        fn(b)
        lat.append(time.perf_counter() - t)
    seconds = time.perf_counter() - t0
    lat_ms = np.asarray(lat) * 1e3
    rows = sum(b.size for b in batches) if rows is None else rows
    return {"rows_per_s": rows / seconds, "p50_ms": float(np.percentile(lat_ms, 50)),
            "p99_ms": float(np.percentile(lat_ms, 99)), "seconds": seconds, "steps": len(lat)}


def cold_line(r: dict) -> str:
    c = r["competitors"]
    hit = c["tierstore-cold"].get("hit_ratio")
    cg = (r.get("memory_limits") or {}).get("cgroup")
    return (f"cold {r['dist']} b={r['batch']} table {r['table_bytes'] / 2**20:.0f} MiB, budget "
            f"{r['dram_budget_bytes'] / 2**20:.0f} MiB ({'cgroup ' + cg if cg else 'no cgroup'}): "
            f"tierstore-cold {c['tierstore-cold']['ratio_vs_dram']:.3g}x dram (hit {hit if hit is None else round(hit, 2)}, "
            f"p99 {c['tierstore-cold']['p99_ms']:.2f} vs {c['dram']['p99_ms']:.2f} ms), "
            f"mmap-cold {c['mmap-cold']['ratio_vs_dram']:.3g}x (hit {round(c['mmap-cold']['hit_ratio'], 2)}, "
            f"p99 {c['mmap-cold']['p99_ms']:.2f} ms); "
            f"cold start {r['cold_start']['tierstore-cold']['rows_per_s'] / 1e3:.0f}k vs "
            f"{r['cold_start']['mmap-cold']['rows_per_s'] / 1e3:.0f}k rows/s" + _direct_part(r) + _local_part(r))


def _local_part(r: dict) -> str:
    d = r["competitors"].get("tierstore-local")
    if d is None:
        return ""
    f = d["arena_fill"]
    past = f["fill_once_past_capacity"]
    return (f"; tierstore-local {d['x_mmap']:.3g}x mmap, {d['rows_per_s'] / 1e3:.0f}k rows/s (hit "
            f"{d['hit_ratio']:.3f} vs LRU {d['lru_hit_ratio']:.3f} on the same steps; arena "
            f"{f['final_fill']:.1%} full, {'never past capacity' if past is None else f'{past:.1%} once past capacity'}"
            f", at least {f['fill_of_asked_min']:.1%} of the distinct rows asked; sidecar read "
            f"{d['bytes_read_from_segments'] / 2**20:.1f} MiB, clients {d['bytes_read_by_clients'] / 2**20:.1f} MiB"
            f"{_misses_part(r, d)})")


def _misses_part(r: dict, d: dict) -> str:
    if d.get("misses_per_s_of_disk_best") is None:
        return ""
    return (f"; misses {d['misses_per_s'] / 1e3:.1f}k/s = {d['misses_per_s_of_disk_best']:.2f} of the disk's "
            f"{r['disk_best_iops'] / 1e3:.0f}k IOPS at QD{r['disk_best_qd']}")


def _direct_part(r: dict) -> str:
    d = r["competitors"].get("tierstore-direct")
    if d is None:
        return f"; no tierstore-direct ({r.get('direct_io')})"
    fp = r.get("memory_footprint", {}).get("tierstore-direct", {})
    return (f"; tierstore-direct {d['ratio_vs_dram']:.3g}x dram = {d['x_mmap']:.3g}x mmap (hit "
            f"{round(d['hit_ratio'], 2)}, p99 {d['p99_ms']:.2f} ms, cold start "
            f"{r['cold_start']['tierstore-direct']['rows_per_s'] / 1e3:.0f}k rows/s, beyond its "
            f"{r['dram_budget_bytes'] / 2**20:.0f} MiB arena: {fp.get('over_budget', 0) / 2**20:.1f} MiB "
            f"(page cache {fp.get('segment_page_cache', 0) / 2**20:.1f} MiB) vs tierstore-cold "
            f"{r.get('memory_footprint', {}).get('tierstore-cold', {}).get('over_budget', 0) / 2**20:.1f} MiB, "
            f"and from start {d.get('metadata_bytes', 0) / 2**20:.1f} MiB of checksums, maps and policy = "
            f"{d.get('metadata_bytes', 0) / max(1, r['arena_slots']):.0f} B a slot{_misses_part(r, d)})")
