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
                    client, the sidecar told each step after the fact
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
from pathlib import Path

import numpy as np
from tierstore.bench.cache import replay_steps
from tierstore.bench.lookup import (
    _Arena,
    check_same_rows,
    close_all,
    run_rounds,
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

__all__ = ["run_cold_bench", "direct_io_refusal", "stop_sidecar", "local_counts", "timed_pass",
           "MemoryCgroup", "drop_page_cache"]

UNITS = {"rows_per_s": "rows/s", "p50_ms": "ms per batch", "p99_ms": "ms per batch",
         "ratio_vs_dram": "x (rows/s over the all-DRAM sidecar's, median of per-round ratios)",
         "hit_ratio": "fraction of unique ids per Plan found in the DRAM arena", "bytes": "bytes"}


def run_cold_bench(data_dir, out_dir, *, table_bytes: int | None = None, budget_fraction: float = 0.25,
                   batch: int = 4096, dist: str = "zipf1.0", quick: bool = False, seed: int = 0,
                   rounds: int | None = None, rows_per_pass: int | None = None, slack_bytes: int = 32 << 20,
                   heap_bytes: int = 32 << 20, warmup_calls: int | None = None, warmup_arenas: float = 2.0,
                   disk_seconds: float | None = None, progress: bool = True,
                   log=print) -> dict:
    """Run the cold-tier scenario on a random table of `table_bytes` (default
    768 MiB, quick 160 MiB) kept in OUT/baselines/cold-data (written once);
    `disk_seconds` per disk probe (default 3, quick 0.3).

    data_dir is unused (the scenario needs a table of a chosen size) and kept
    for a uniform signature. Returns the scenario dict for results.json.
    """
    from tierstore.bench.lookup import _Lookup
    from tierstore.bench.workload import make_batches
    from tierstore.client.client import Client
    from tqdm import tqdm

    from tierstore.cache.policy import PolicyConfig
    from tierstore.sidecar.launcher import SidecarProcess

    table_bytes = table_bytes or ((160 if quick else 768) << 20)
    rounds = rounds or (3 if quick else 5)
    rows_per_pass = rows_per_pass or (16384 if quick else 65536)
    cache_dir = Path(out_dir) / "baselines" / "cold-data"
    log(f"cold: table of {table_bytes / 2**20:.0f} MiB in {cache_dir} (written once, then reused)")
    version = random_table(cache_dir, table_bytes, seed=seed, progress=progress)
    budget = int(version.nbytes * budget_fraction)
    seg_paths = [cache_dir / s for s in version.segments]
    calls = max(3, rows_per_pass // batch)
    cap_rows = budget // version.row_bytes
    # warm-up: `warmup_arenas` (default twice) the arena in ids, so each cache reaches its steady state
    # before it is timed
    warm_calls = max(calls, -(-int(warmup_arenas * cap_rows) // batch)) if warmup_calls is None else warmup_calls
    # fresh ids everywhere (cold start, warm-up, each round): a cold tier must see the distribution's tail
    stream = make_batches(dist, version.rows, batch, calls * (rounds + 1) + warm_calls, seed)
    ids, warm_ids = stream[:calls], stream[calls:calls + warm_calls]
    passes = [stream[calls + warm_calls + i * calls:calls + warm_calls + (i + 1) * calls] for i in range(rounds)]
    closers, memory, footprints = [], {}, {}
    no_direct = direct_io_refusal(seg_paths, version.row_bytes)
    disk_seconds = disk_seconds or (0.3 if quick else 3.0)
    log(f"cold: disk probe (io_uring O_DIRECT random 512-B reads, queue depths {DEPTHS}, {disk_seconds:g} s each)")
    disk = disk_limit(seg_paths, blocks=(512,), seconds=disk_seconds, seed=seed)
    top = best_iops(disk, 512)
    try:
        full = SidecarProcess(cache_dir, dram_budget=int(version.nbytes * 1.02) + (8 << 20)).start()
        closers.append(full.cleanup)
        dram = Client(full.socket)
        closers.append(dram.close)
        # planned steps (as below): no slot index in /dev/shm, whose pages the cgroup would count
        cold = SidecarProcess(cache_dir, dram_budget=budget, extra_args=["--no-local-reads"]).start()
        closers.append(cold.cleanup)
        cclient = Client(cold.socket)
        closers.append(cclient.close)
        cap = int(cclient.tables()[0]["arena_slots"])
        # local reads (the route a local Client.lookup takes), not in a cgroup: its clients map the slot index
        local = SidecarProcess(cache_dir, dram_budget=budget,
                               extra_args=["--direct-io"] if no_direct is None else []).start()
        closers.append(local.cleanup)
        lclient = Client(local.socket)
        closers.append(lclient.close)
        dclient = direct = None
        if no_direct is None:
            direct = SidecarProcess(cache_dir, dram_budget=budget, extra_args=["--direct-io", "--no-local-reads"]).start()
            closers.append(direct.cleanup)
            dclient = Client(direct.socket)
            closers.append(dclient.close)
        child = MmapChild(cache_dir, version, stream)
        closers.append(child.close)
        # A process's memory stays charged where it was allocated when the process moves
        # to a cgroup: the sidecar's arena and start-up heap are outside its cgroup, so it
        # is capped at `slack` of page cache plus `heap` for its heap to grow while serving
        # (~9 MB over 600 steps of the 768 MiB table: its per-slot state is faulted in at
        # start), and mmap at the budget plus the same slack.
        cg_side, cg_mmap = MemoryCgroup(slack_bytes + heap_bytes), MemoryCgroup(budget + slack_bytes)
        closers[:0] = [cg_side.close, cg_mmap.close]  # removed last, once their processes are gone
        cg_direct = MemoryCgroup(slack_bytes + heap_bytes) if direct is not None else None
        if cg_direct is not None:
            closers[:0] = [cg_direct.close]
        if cg_side.error is None and cg_mmap.error is None:
            cg_side.add(cold.proc.pid)
            cg_mmap.add(child.proc.pid)
            if cg_direct is not None and cg_direct.error is None:
                cg_direct.add(direct.proc.pid)
            memory = {"cgroup": cg_side.kind, "tierstore_local_bytes": "not capped (its clients map the slot index)",
                      "tierstore_cold_bytes": f"arena {budget} + cgroup {slack_bytes} page cache + {heap_bytes} heap",
                      "mmap_cold_bytes": f"cgroup {budget + slack_bytes}",
                      "note": "competitors run one after another, each from a dropped page cache: the pages "
                              "one holds are not hits for the next"}
        else:
            memory = {"cgroup": None, "reason": cg_side.error or cg_mmap.error,
                      "note": "page cache unbounded: after warm-up mmap-cold and tierstore misses are served "
                              "from DRAM page cache, not disk"}
        fns = {"dram": _Arena(dram, "cold").get, "tierstore-cold": _Arena(cclient, "cold", piece=max(1, cap // 2)).get,
               "mmap-cold": child.get, "tierstore-local": _Lookup(lclient, "cold").get}
        sides = {"tierstore-cold": (cold, cclient), "tierstore-local": (local, lclient)}
        if direct is not None:
            fns["tierstore-direct"] = _Arena(dclient, "cold", piece=max(1, cap // 2)).get
            sides["tierstore-direct"] = (direct, dclient)
        at_start = {n: proc_memory(p.proc.pid) for n, (p, _) in sides.items()}
        # rows checked against the full-resident arena (= the table, verified on load)
        table_rows = dram.handle("cold").arena_np
        # One competitor at a time, mmap last: page cache dropped; the cold-start pass, timed on
        # its own; a warm-up of fresh ids to the cache's steady state; the timed rounds (fresh
        # ids again); its rows checked; a sidecar is then stopped (pages a mapping holds
        # survive DONTNEED: they would be the next one's hits).
        cold_start, how, timings, stats, faults, fills, seen_local = {}, None, {}, {}, 0, {}, {}
        order = ("tierstore-local", "tierstore-direct", "tierstore-cold", "mmap-cold")
        for name in ["dram"] + [n for n in order if n in fns]:
            fill = _Fill(version.rows, cap, sides[name][1]) if name in sides else None
            if name != "dram":
                how = drop_page_cache(seg_paths)
                pinned = resident_bytes(seg_paths)  # mapped by an earlier competitor: not this one's
                cold_start[name] = timed_pass(fns[name], ids)
                if fill is not None:
                    fill.asked(ids)
                if name in sides:
                    footprints[name] = footprint(sides[name][0].proc.pid, seg_paths, budget, at_start[name], pinned)
            with tqdm(total=len(warm_ids) + rounds, desc=f"cold {name}", unit="step", disable=not progress,
                      leave=False) as bar:
                for b in warm_ids:
                    fns[name](b)
                    if fill is not None:
                        fill.step(b)
                    bar.update(1)
                if fill is not None:
                    fill.settle()
                s0 = sides[name][1].stats()["tables"][0] if name in sides else None
                l0 = local_counts(lclient, "cold") if name == "tierstore-local" else None
                f0 = child.faults() if name == "mmap-cold" else 0
                timings.update(run_rounds({name: fns[name]}, [], rounds, progress=bar.update, round_batches=passes))
                if name == "mmap-cold":
                    faults = child.faults() - f0
                if l0 is not None:
                    seen_local = {k: v - l0[k] for k, v in local_counts(lclient, "cold").items()}
                if name in sides:
                    for p in passes:
                        fill.asked(*p)
                    fill.settle()
                    fills[name] = fill.summary()
                    stats[name] = (s0, sides[name][1].stats()["tables"][0])
            check_same_rows(name, np.asarray((child.rows if name == "mmap-cold" else fns[name])(ids[0])),
                            table_rows[ids[0]])
            if name in sides:
                stop_sidecar(*sides[name])
        comps = summarize(timings, len(ids) * batch, ref="dram")
        for d in comps.values():
            d["ratio_vs_dram"] = d.pop("ratio_vs_ceiling")
        for n in sides:
            s0, s1 = stats[n]
            h, m = int(s1["hits"]) - int(s0["hits"]), int(s1["misses"]) - int(s0["misses"])
            comps[n]["hit_ratio"] = h / (h + m) if h + m else None
            comps[n]["misses_per_s"] = m / sum(timings[n]["pass_s"])
            comps[n]["bytes_read_from_segments"] = int(s1.get("bytes_read", 0)) - int(s0.get("bytes_read", 0))
            comps[n]["metadata_bytes"] = int(s1.get("metadata_bytes", 0))  # resident from start, beyond the arena
            comps[n]["arena_fill"] = fills[n]
            comps[n]["bytes_read_since_start"] = int(s1.get("bytes_read", 0))  # cold start and warm-up too
        if seen_local:  # as its client saw it: the sidecar learns local steps after the fact
            loc = comps["tierstore-local"]
            loc["sidecar_hit_ratio"], loc["hit_ratio"] = loc["hit_ratio"], (
                1 - seen_local["distinct_cold"] / max(1, seen_local["distinct_asked"]))
            loc["bytes_read_by_clients"] = seen_local["bytes_read"]
            loc["misses_per_s"] = seen_local["distinct_cold"] / sum(timings["tierstore-local"]["pass_s"])
        for n in ("tierstore-direct", "tierstore-local"):  # misses read with O_DIRECT (where allowed)
            if n in comps and top:
                comps[n]["misses_per_s_of_disk_best"] = comps[n]["misses_per_s"] / top["iops"]
            loc["notes_dropped"] = int(stats["tierstore-local"][1].get("notes_dropped", 0))
        # LRU on the same steps at the same capacity: every step each competitor ran, in order
        lru = replay_steps(list(ids) + list(warm_ids) + [b for p in passes for b in p], version.rows, cap,
                           PolicyConfig(kind="lru"), count_from=len(ids) + len(warm_ids))
        for d in comps.values():
            d["lru_hit_ratio"] = lru
        # rows gathered = unique ids per call (as the sidecars count), in the timed rounds
        gathered = sum(np.unique(b).size for p in passes for b in p)
        comps["mmap-cold"]["hit_ratio"] = max(0.0, 1 - faults / gathered)
        comps["mmap-cold"]["major_faults"] = faults
        if "tierstore-direct" in comps:
            comps["tierstore-direct"]["x_mmap"] = comps["tierstore-direct"]["rows_per_s"] / comps["mmap-cold"]["rows_per_s"]
        comps["tierstore-local"]["x_mmap"] = comps["tierstore-local"]["rows_per_s"] / comps["mmap-cold"]["rows_per_s"]
        comps["tierstore-cold"]["x_mmap"] = comps["tierstore-cold"]["rows_per_s"] / comps["mmap-cold"]["rows_per_s"]
        if cg_side.error is None and cg_mmap.error is None:
            memory["tierstore_cold_cgroup_peak_bytes"] = cg_side.peak()
            memory["mmap_cold_cgroup_peak_bytes"] = cg_mmap.peak()
            if cg_direct is not None and cg_direct.error is None:
                memory["tierstore_direct_cgroup_peak_bytes"] = cg_direct.peak()
    finally:
        close_all(closers)
    result = {"table_rows": version.rows, "row_bytes": version.row_bytes, "table_bytes": version.nbytes,
              "dram_budget_bytes": budget, "arena_slots": cap, "dist": dist, "batch": batch,
              "rows_per_pass": len(ids) * batch, "fresh_ids_every_pass": True, "rounds": rounds, "quick": quick, "units": UNITS,
              "warmup_ids": len(warm_ids) * batch, "order": "one competitor at a time, page cache dropped before each",
              "page_cache_drop": how, "memory_limits": memory, "cold_start": cold_start, "competitors": comps,
              "memory_footprint": footprints, "direct_io": no_direct or "on", "disk": disk,
              "disk_best_iops": top["iops"] if top else None, "disk_best_qd": top["qd"] if top else None}
    log(cold_line(result))
    return result


def direct_io_refusal(seg_paths, row_bytes: int) -> str | None:
    """None where the segments' filesystem takes O_DIRECT (tmpfs before Linux 6.6
    does not), else why not: competitors that need it are skipped with that reason."""
    from tierstore.tiers.nvme.direct_io import DirectFiles

    try:
        DirectFiles(list(seg_paths)[:1], row_bytes).close()
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
    """What the local-reads client served of `table`: distinct ids asked and read from disk, disk bytes."""
    local = client.handle(table).local
    cold = getattr(local, "_cold", None)
    return {"distinct_asked": local.distinct_asked if local else 0, "distinct_cold": local.distinct_cold if local else 0,
            "bytes_read": cold.bytes_read if cold is not None else 0}


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
