"""Cache-policy benchmark: hit ratio of tierstore's policy against the classics.

Each trace (see tierstore.bench.traces) is replayed at cache sizes given as a
fraction of the table's rows through
- ours: tierstore.cache.policy.CachePolicy, driven step by step exactly as the engine
  drives it (record / touch / victims / admitted, the step's rows leased), and
  again with one step of lookahead (rows the next step reads are not evictable),
  and with a request queue of QUEUE_STEPS steps ("ours+queue16"): a serving
  engine's scheduler admits work that many steps before it runs and calls
  `Hints.prefetch(ids, read=False)` with its ids once, at admission
  (resident rows get `CachePolicy.expect`); "ours+queue16-read" also reads the
  missing rows in then (read=True), and those reads count as misses, so every
  ratio is "accesses not read from the cold tier" and compares with the
  references; "ours+queue16-rehint" hints every queued request again before
  every step, each with its remaining wait. A hint's rows are kept as both engines'
  plugins keep them (`step_reads.queued_hint`): until its request has run, or twice its
  wait when they were read in. "ours" is the same policy with no queue (N=0);
- lru-batched: the same harness with kind="lru" (what batching alone costs);
- LRU, LFU, ARC, S3-FIFO, W-TinyLFU and Belady's optimum from libCacheSim,
  fed the same accesses one by one (step order, each step's ids once);
- freq-oracle: a cache told every row's count over the whole trace in advance
  (freq_oracle_hit_ratio): what knowing how often rows come buys, where Belady knows when.
Hit ratio counts every access of the flattened trace, cold misses included.

One cohesive thing (a little over the house's 300 lines): the replay loop and the
references it is compared with.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np

from tierstore.bench.traces import (Trace, aws_docs_corpus, deepseek_text_trace, document_trace,
                                    python_docs_corpus, stdlib_docstrings_corpus, zipf_trace)
from tierstore.errors import InvalidArgument
from tierstore.cache.policy import PolicyConfig, make_policy
from tierstore.client.engines.step_reads import queued_hint

REFERENCES = ("LRU", "LFU", "ARC", "S3FIFO", "WTinyLFU", "Belady")
FREQ_ORACLE = "freq-oracle"
ORACLE_SHARES = (0.25, 0.5, 0.75, 1.0)  # the slots freq-oracle tries keeping its most frequent rows in
QUEUE_STEPS = 16  # ours+queue16: steps are admitted (prefetched) this many steps before they run
_ORACLE = np.dtype([("time", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")])


_TEXT_TRACES = {  # a real-text trace: (its corpus, None for text_trace's CPython reference topics; its name)
    "text": (None, None),
    "aws-docs": (aws_docs_corpus, "botocore data/*/service-2.json documentation (Apache-2.0)"),  # a second domain
    "docstrings": (stdlib_docstrings_corpus, "CPython Lib/**/*.py docstrings (PSF licence)"),  # a third, held out
    "mixed": (lambda: python_docs_corpus() + aws_docs_corpus() + stdlib_docstrings_corpus(),
              "text + aws-docs + docstrings, shuffled"),
}


def make_trace(kind, quick: bool = False, seed: int = 0) -> Trace:
    """A named trace: 'zipf0.8' / 'zipf1.0' / 'zipf1.2', 'documents', 'text' (CPython
    docs), 'aws-docs' (botocore's AWS API docs), 'docstrings' (the standard library's
    docstrings), 'mixed' (the three corpora's documents shuffled together, as a server's
    traffic mixes domains), a saved trace path, or a Trace
    (see traces.access_trace for a user's access log)."""
    return trace_recipe(kind, quick, seed)()


def trace_recipe(kind, quick: bool = False, seed: int = 0) -> Callable[[], Trace]:
    """What builds make_trace's `kind`, checked without building it, so that a run of several
    traces refuses a bad name before it replays any: InvalidArgument for a name it does not know."""
    if isinstance(kind, Trace):
        return lambda: kind
    n_ids, steps, batch = (1_000_000, 600, 500) if quick else (4_000_000, 2000, 2000)
    if kind.startswith("zipf") and not kind.endswith(".npy"):
        try:
            alpha = float(kind[4:] or 1.0)
        except ValueError:
            raise InvalidArgument(f"unknown trace {kind!r}: zipf<alpha> takes a number, e.g. zipf1.0") from None
        return lambda: zipf_trace(n_ids, alpha, steps, batch, seed)
    if kind == "documents":
        return lambda: document_trace(n_ids, steps, batch, seed=seed)
    if kind in _TEXT_TRACES:
        corpus, corpus_name = _TEXT_TRACES[kind]
        own = {"texts": corpus(), "corpus_name": corpus_name} if corpus else {}
        return lambda: deepseek_text_trace(seed=seed, name=kind, **own)
    if Path(kind).exists():
        return lambda: Trace.load(kind)
    raise InvalidArgument(f"unknown trace {kind!r}; use zipf<alpha>, documents, {', '.join(_TEXT_TRACES)} or a "
                          f"NAME.npy trace path")


def replay(trace: Trace, capacity: int, config: PolicyConfig | None = None, lookahead: int = 0,
           queue: int = 0, queue_read: bool = False, rehint: bool = False, profile=None) -> float:
    """Hit ratio of CachePolicy on `trace` with `capacity` slots, driven as the engine does.

    lookahead: steps whose ids are known ahead; their resident rows are not
        evicted while that leaves enough victims (an upper bound on hints).
    queue: steps admitted before they run; each step's ids are prefetched once,
        `queue` steps ahead, as Hints.prefetch(ids, read=queue_read) does,
        kept as long as the engines' plugins keep them (step_reads.queued_hint):
        resident rows get `expect`; with queue_read, missing rows are read in
        then, without a lease. Rows read by a prefetch count as misses, so the
        ratio is "accesses not read from the cold tier" with or without a queue.
    rehint: the scheduler hints every queued request again before every step
        (prefetch(ids, read=False, steps=its remaining wait): `queue` calls a
        step) instead of once, at admission.
    profile: (ids, counts) seeding the policy's sketch (CachePolicy.load_profile)."""
    sim = _Sim(trace, capacity, config, queue_read)
    if profile is not None:
        sim.policy.load_profile(*profile)
    for j in range(1, min(queue, trace.steps - 1) + 1):  # the queue at start
        sim.prefetch(trace.step(j), wait=j)
    for i in range(trace.steps):
        if rehint and queue:
            for d in range(1, min(queue, trace.steps - 1 - i) + 1):  # each queued request, its own wait
                sim.prefetch(trace.step(i + d), wait=d)
        elif queue and 0 < i + queue < trace.steps and i:
            sim.prefetch(trace.step(i + queue), wait=queue)
        nxt = None
        if lookahead and i + 1 < trace.steps:
            nxt = trace.ids[trace.bounds[i + 1]:trace.bounds[min(trace.steps, i + 1 + lookahead)]]
        sim.step(i, nxt)
    return 1.0 - sim.reads / max(1, trace.ids.size)


def replay_steps(steps: list, n_ids: int, capacity: int, config: PolicyConfig | None = None,
                 count_from: int = 0) -> float:
    """Hit ratio of `steps` (int64 id arrays, in the order a server saw them) through a
    `capacity`-slot arena driven as the engine drives it, counted as the sidecar counts:
    each step's distinct ids, from step `count_from` on. `bench cold` replays the steps
    it ran through PolicyConfig(kind="lru") to compare the sidecar with LRU."""
    uniq = [np.unique(s) for s in steps]
    bounds = np.concatenate([[0], np.cumsum([u.size for u in uniq])]).astype(np.int64)
    sim = _Sim(Trace("steps", np.concatenate(uniq), bounds, n_ids), capacity, config)
    reads = asked = 0
    for i in range(len(uniq)):
        before = sim.reads
        sim.step(i)
        if i >= count_from:
            reads += sim.reads - before
            asked += uniq[i].size
    return 1.0 - reads / max(1, asked)


class _Sim:
    """An arena of `capacity` slots driven through CachePolicy the way TableEngine drives it."""

    def __init__(self, trace: Trace, capacity: int, config: PolicyConfig | None, read: bool = False):
        self.trace, self.capacity, self.read = trace, capacity, read
        self.policy = make_policy(capacity, trace.n_ids, config)
        self.slot_of = np.full(trace.n_ids, -1, dtype=np.int64)
        self.held = np.full(capacity, -1, dtype=np.int64)
        self.used = self.reads = 0

    def _fill(self, miss: np.ndarray, leased: np.ndarray, protect: np.ndarray | None = None) -> None:
        fresh = np.arange(self.used, self.used + min(miss.size, self.capacity - self.used), dtype=np.int64)
        self.used += fresh.size
        k = miss.size - fresh.size
        if k:
            evictable = self.held >= 0
            evictable[leased] = False
            if protect is not None:
                evictable[protect] = False
                if np.count_nonzero(evictable) < k:  # lookahead is a hint, never a failure
                    evictable = self.held >= 0
                    evictable[leased] = False
            out = self.policy.victims(k, ~evictable)
            self.slot_of[self.held[out]] = -1
            fresh = np.concatenate([fresh, out])
        self.held[fresh] = miss
        self.slot_of[miss] = fresh
        self.reads += miss.size
        self.policy.admitted(fresh, miss)

    def step(self, i: int, nxt: np.ndarray | None = None) -> None:
        ids = self.trace.step(i)
        slots = self.slot_of[ids]
        hit = slots >= 0
        self.policy.record(ids)
        self.policy.touch(slots[hit])
        miss = ids[~hit]
        if miss.size > self.capacity:
            raise InvalidArgument(f"step {i} reads {miss.size} new rows but the cache has {self.capacity} slots")
        protect = None
        if nxt is not None:
            protect = self.slot_of[nxt]
            protect = protect[protect >= 0]
        self._fill(miss, slots[hit], protect)

    def prefetch(self, ids: np.ndarray, wait: int) -> None:
        """Hints.prefetch of a request that runs after `wait` steps: its rows hinted for as
        long as the engines' plugins hint them (step_reads.queued_hint, one step's run); with
        `read`, the missing ones read in."""
        slots = self.slot_of[ids]
        hit = slots >= 0
        self.policy.expect(slots[hit], ids[~hit], steps=queued_hint(wait, read=self.read)[1])
        if self.read and not hit.all():  # no more than the policy can keep until the request runs
            ahead = ids[~hit][: min(self.capacity, self.policy.protect_room())]
            self._fill(ahead, np.zeros(0, np.int64))  # between steps nothing is leased


def write_oracle_trace(trace: Trace, path: Path) -> Path:
    """libCacheSim's oracleGeneral binary format, with next-access times for Belady."""
    ids, n = trace.ids, trace.ids.size
    nxt = np.full(n, -1, dtype=np.int64)
    order = np.argsort(ids, kind="stable")
    same = ids[order[1:]] == ids[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    rec = np.zeros(n, dtype=_ORACLE)
    rec["time"] = np.repeat(np.arange(trace.steps, dtype=np.uint32), np.diff(trace.bounds))
    rec["id"] = ids.astype(np.uint64) + 1  # libCacheSim reserves id 0
    rec["size"] = 1
    rec["next"] = nxt
    rec.tofile(path)
    return path


def capacity_rows(trace: Trace, size: float) -> int:
    """Cache slots for `size`: a fraction of the table's rows when < 1, else a row count.

    A spatially sampled trace (meta "sample" = s) sees s of the rows, so its
    cache is s times smaller (SHARDS), for fractions and row counts alike."""
    if not size > 0:
        raise InvalidArgument(f"cache sizes must be > 0 (a fraction of rows < 1, or a row count), got {size}")
    if size >= 1 and size != int(size):
        raise InvalidArgument(f"a cache size >= 1 is a row count and must be whole, got {size}")
    rows = size * trace.n_ids if size < 1 else size
    return max(1, int(round(rows * float(trace.meta.get("sample", 1.0)))))


_TRACE: Trace | None = None  # the trace being replayed, for forked workers


def _references(args) -> dict[str, float]:
    return reference_hit_ratios(*args)


def _ours(capacity: int, kw: dict) -> float:
    return replay(_TRACE, capacity, **kw)


def _freq_oracle(capacity: int, work: Path) -> float:
    return freq_oracle_hit_ratio(_TRACE, capacity, work)


def _pool(jobs: int):
    # forked workers inherit the trace; a process that has loaded gRPC (`bench all` after the
    # lookup scenario, a test process) is not forked: gRPC's at-fork handler can block the fork
    if jobs == 1 or "fork" not in mp.get_all_start_methods() or "grpc" in sys.modules:
        return _Inline()
    return ProcessPoolExecutor(jobs, mp_context=mp.get_context("fork"))


def reference_hit_ratios(oracle_path: Path, capacity: int, names=REFERENCES) -> dict[str, float]:
    import libcachesim as lcs
    out = {}
    hashpower = int(np.clip(np.ceil(np.log2(2 * capacity + 1)), 12, 26))  # the default 2^24 buckets cost 0.5 s each
    for name in names:
        reader = lcs.TraceReader(str(oracle_path), lcs.TraceType.ORACLE_GENERAL_TRACE)
        miss, _ = getattr(lcs, name)(capacity, hashpower=hashpower).process_trace(reader)
        out[name] = 1.0 - miss
    return out


def freq_oracle_hit_ratio(trace: Trace, capacity: int, work: Path) -> float:
    """Hit ratio of a cache told each row's access count over the whole trace (not when the
    accesses come): the `k` most-counted rows are kept from their first access on, never
    evicted, and LRU runs over the other capacity - k slots; the best k of ORACLE_SHARES x
    capacity. A row's first access is a miss, as for every other policy. An online policy
    that keeps rows by frequency and recency has to learn the counts this one is given:
    where it stays near ARC, frequency adds little to recency. `work`: a scratch file's path
    (the LRU part is libCacheSim's, over an oracleGeneral file there; removed after)."""
    ids, counts = np.unique(trace.ids, return_counts=True)
    rank = np.argsort(-counts, kind="stable")
    step_of = np.repeat(np.arange(trace.steps), np.diff(trace.bounds))
    best = 0.0
    try:
        for share in ORACLE_SHARES:
            k = min(int(share * capacity), ids.size)
            kept = np.isin(trace.ids, ids[rank[:k]])
            hits = float(counts[rank[:k]].sum() - k)
            rest = ~kept
            if capacity - k > 0 and rest.any():
                bounds = np.searchsorted(step_of[rest], np.arange(trace.steps + 1))
                rest_trace = Trace(trace.name, trace.ids[rest], bounds, trace.n_ids)
                lru = reference_hit_ratios(write_oracle_trace(rest_trace, work), capacity - k, ("LRU",))["LRU"]
                hits += lru * rest.sum()
            best = max(best, hits / trace.ids.size)
    finally:
        work.unlink(missing_ok=True)
    return best


def run_cache_bench(trace_paths_or_kinds=("zipf1.0", "documents", "text", "aws-docs"), sizes=(0.001, 0.01, 0.1),
                    out_dir: str | Path = "bench-cache", seed: int = 0, quick: bool = False,
                    config: PolicyConfig | None = None, jobs: int | None = None, hbm_drift: bool = False,
                    log=None) -> dict:
    """Replay traces through every policy at each cache size.

    trace_paths_or_kinds: names for make_trace, saved trace paths, or Traces.
    sizes: fractions of the table's rows (< 1) or row counts (>= 1).
    jobs: processes replaying libCacheSim's references beside ours (default:
        the CPU count; one, in this process, once gRPC is loaded in it); each reference reads
        the same oracleGeneral file.
    Returns {"traces": {name: {"n_ids", "accesses", "rows": {size: slots},
    "hit_ratio": {policy: {size: ratio}}}}, ...} and writes cache.json and
    cache.png (hit ratio vs cache size, log x) to out_dir.
    A policy whose cache is smaller than one step's rows gets NaN (it cannot run).
    quick: smaller synthetic traces, no lru-batched ablation; about a minute on 2 cores.
    hbm_drift: add the HBM-tier cell (tierstore.bench.hbm): the adaptive HBM
        cache against static hot sets, per window of a drifting trace.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    jobs = max(1, jobs or os.cpu_count() or 1)
    results = {}
    for recipe in [trace_recipe(kind, quick, seed) for kind in trace_paths_or_kinds]:  # every name checked first
        trace = recipe()
        caps = {size: capacity_rows(trace, size) for size in sizes}
        oracle = write_oracle_trace(trace, out / f"{trace.name}.oracleGeneral.bin")
        ratios: dict[str, dict[float, float]] = {}
        max_step = int(np.diff(trace.bounds).max())
        q = QUEUE_STEPS
        ours = [("ours", {}), ("ours+lookahead", {"lookahead": 1}), (f"ours+queue{q}", {"queue": q})]
        if not quick and trace.meta.get("kind") != "access-log":  # ablations, for our traces only
            ours += [("lru-batched", {"config": PolicyConfig(kind="lru")}),
                     (f"ours+queue{q}-read", {"queue": q, "queue_read": True}),
                     (f"ours+queue{q}-rehint", {"queue": q, "rehint": True})]
        # every replay is one task of one pool; forked workers inherit the trace
        global _TRACE
        _TRACE = trace
        with _pool(jobs) as pool:
            tasks = {(size, name): pool.submit(_references, (oracle, caps[size], (name,)))
                     for size in sizes for name in REFERENCES}
            tasks.update({(size, name): pool.submit(_ours, caps[size], {"config": config, **kw})
                          for size in sizes for name, kw in ours if caps[size] >= max_step})
            tasks.update({(size, FREQ_ORACLE): pool.submit(_freq_oracle, caps[size],
                                                           out / f"{trace.name}.{i}.rest.oracleGeneral.bin")
                          for i, size in enumerate(sizes)})
            for size in sizes:
                for name, _ in ours:
                    ratios.setdefault(name, {})[size] = float("nan")  # cache smaller than a step
            for (size, name), fut in tasks.items():
                ratios.setdefault(name, {})[size] = fut.result()[name] if name in REFERENCES else fut.result()
        _TRACE = None
        oracle.unlink()
        results[trace.name] = {"n_ids": trace.n_ids, "accesses": int(trace.ids.size), "steps": trace.steps,
                               "rows": caps, "meta": trace.meta, "hit_ratio": ratios}
        if log:
            log(f"bench cache: {trace.name} ({trace.ids.size:,} accesses) done at {time.perf_counter() - t0:.0f} s")
    report = {"sizes": list(sizes), "seed": seed, "quick": quick, "jobs": jobs, "traces": results}
    if hbm_drift:
        from tierstore.bench.hbm import drift_trace, run_hbm_drift
        kw = dict(n_ids=200_000, steps=480, batch=1500, topic_steps=60) if quick else {}
        report["hbm_drift"] = run_hbm_drift(drift_trace(seed=seed, **kw))
    report["seconds"] = time.perf_counter() - t0
    (out / "cache.json").write_text(json.dumps(report, indent=1, default=float))
    plot(report, out / "cache.png")
    return report


class _Inline:
    """A one-process stand-in for ProcessPoolExecutor (jobs=1)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, *args):
        f = Future()
        f.set_result(fn(*args))
        return f


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    traces = report["traces"]
    fig, axes = plt.subplots(1, len(traces), figsize=(5 * len(traces), 4), squeeze=False)
    for ax, (name, res) in zip(axes[0], traces.items()):
        frac = {s: r / res["n_ids"] for s, r in res.get("rows", {}).items()}  # row counts plot as fractions
        ax.set_prop_cycle(color=plt.cm.tab20.colors)  # more policies than the default cycle's 10 colours
        for policy, by_size in res["hit_ratio"].items():
            xs = sorted(by_size, key=lambda x: frac.get(x, x))
            style = {"linewidth": 2.5} if policy.startswith("ours") else \
                {"linestyle": {"Belady": "--", FREQ_ORACLE: ":"}.get(policy, "-")}  # the two oracles
            ax.plot([frac.get(x, x) for x in xs], [by_size[x] for x in xs], marker="o", label=policy, **style)
        ax.set_xscale("log")
        ax.set_xlabel("cache size (fraction of table rows)")
        ax.set_ylabel("hit ratio")
        ax.set_title(f"{name} ({res['accesses']:,} accesses)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary(report: dict, size: float | None = None) -> str:
    """One line per trace: hit ratios at one cache size (default 0.01, else the middle one)."""
    lines = []
    sizes = report.get("sizes") or [0.01]
    size = size if size is not None else (0.01 if 0.01 in sizes else sizes[len(sizes) // 2])
    for name, res in report["traces"].items():
        hr = res["hit_ratio"]
        cells = " ".join(f"{p}={hr[p][size]:.3f}" for p in hr if size in hr[p])
        lines.append(f"{name} @ {size:g}: {cells}")
    if "hbm_drift" in report:
        from tierstore.bench.hbm import hbm_line
        lines.append(hbm_line(report["hbm_drift"]))
    return "\n".join(lines)
