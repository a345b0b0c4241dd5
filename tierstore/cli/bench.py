"""`tierstore bench`: storage benchmarks against simple alternatives.

    tierstore bench lookup --data DIR --out OUT [--table T | --table-mib 8192] [--batches ...] [--dists ...] [--quick]
    tierstore bench cold   --data DIR --out OUT [--quick]
    tierstore bench large  --data DIR --out OUT [--table-gib 8] [--row-format F] [--dram-budget 1GiB] [--quick]
                           [--competitors tierstore-direct,tierstore-cached,mmap,mmap-capped]
                           (a V4.1-layout table past TLB reach: the disk's IOPS, tierstore vs memmap capped)
    tierstore bench warm   --out OUT [--quick]          (hit ratio after a restart: warm start vs cold)
    tierstore bench cache  --out OUT [--quick]          (cache-policy simulation)
    tierstore bench cache  --out OUT --trace FILE.npy [--step-ids N] [--sizes 0.005,0.01,50000] [--rows N]
    tierstore bench hash   --out OUT [--quick]          (hashing vs plain numpy)
    tierstore bench e2e    --data DIR --out OUT [--quick]
    tierstore bench scale  --out OUT [--quick]          (Plan cost vs arena size)
    tierstore bench concurrency --data DIR --out OUT    (N worker processes on one cache-mode table)
    tierstore bench remote --out OUT [--quick]          (misses from NVMe vs Mooncake vs EngramStore; warm-up)
    tierstore bench engines --out OUT [--quick]         (sglang's Engram: own host table vs tierstore's arena
                           vs tierstore cache mode at 25% of rows, the row stager, real-text ids)
    tierstore bench all    --data DIR --out OUT [--quick] [--<scenario>-<option> ...]
    tierstore bench report OUT

Every scenario adds its figures (with units, machine, commit, seed, command
line) to OUT/results.json, writes OUT/<scenario>.png and prints a one-line
summary; progress bars go to stderr. Ratios compare competitors measured side
by side in interleaved rounds of the same run.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Callable, NamedTuple

__all__ = ["add_arguments", "run", "ensure_data", "scenario_args", "SCENARIOS"]

SCENARIOS = ("lookup", "cold", "cache", "hash", "e2e", "scale", "concurrency")
DEMO_PRESET, DEMO_SCALE = "engram-paper-demo", 64


def _csv(kind):
    def parse(text):
        try:
            return tuple(kind(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None
    return parse


def _count(text):
    """A whole number >= 0."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return n


def _size(text):
    from tierstore.sidecar.config import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _common(p, data=True):
    if data:
        p.add_argument("--data", required=True, help="tierstore data directory (a demo table is created if empty)")
    p.add_argument("--out", required=True, help="output directory: results.json, PNG plots, baseline builds")
    p.add_argument("--quick", action="store_true", help="small sizes (about a minute)")
    p.add_argument("--seed", type=int, default=0, help="seed of every id stream (default 0)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def _lookup(add):
    add("--table", help="table of --data to read (default: the first; with --quick and no --table-mib)")
    add("--table-mib", type=int, help="read a random table of this many MiB of 264-B rows instead, "
        "written once into OUT/baselines/lookup-data (default 8192, past TLB reach; --quick, "
        "--table and `bench all` read a table of --data)")
    add("--batches", type=_csv(int), help="ids per call, e.g. 256,4096,32768,65536")
    add("--dists", type=_csv(str), help="id distributions, e.g. zipf0.8,zipf1.0,zipf1.2,uniform")
    add("--rounds", type=int, help="timed interleaved rounds per cell (default 5, quick 3)")
    add("--competitors", type=_csv(str), help="run only these, e.g. arena,arena-huge (the ceiling always)")
    add("--huge-shm-dir", help="also run arena-huge: a full-resident sidecar whose arenas live in DIR "
        "(a tmpfs mounted huge=within_size; --arena-pages huge): huge pages vs arena's")


def _run_lookup(args, out: Path, suite: bool) -> dict:
    from tierstore.bench.lookup import LookupOptions, line_for, run_lookup_bench
    from tierstore.bench.plots import headline, plot_lookup

    # a table past TLB reach unless a quick run, a --data table or `bench all` asks otherwise
    mib = args.table_mib or (None if args.quick or suite or args.table else 8192)
    if mib is None:
        ensure_data(args.data)  # --table-mib writes a table of its own
    res = run_lookup_bench(args.data, out, _options(LookupOptions, args, table_bytes=_mib(mib)), log=_log)
    res["summary"] = line_for(headline(res["cells"]))
    plot_lookup(res, out / "lookup.png")
    return res


def _cold(add):
    add("--table-mib", type=int, help="size of the cold table (default 768, quick 160)")
    add("--batch", type=int, default=4096, help="ids per call (default 4096)")
    add("--dist", default="zipf1.0", help="id distribution (default zipf1.0)")
    add("--budget-fraction", type=float, default=0.25, help="DRAM budget as a fraction of the table (default 0.25)")
    add("--warmup-arenas", type=float, default=2.0, help="warm-up ids per competitor, in arena sizes (default 2)")
    add("--disk-seconds", type=float, help="seconds per disk probe (default 3, quick 0.3)")


def _run_cold(args, out: Path, suite: bool) -> dict:
    from tierstore.bench.cold import ColdOptions, cold_line, run_cold_bench
    from tierstore.bench.plots import plot_cold

    res = run_cold_bench(out, _options(ColdOptions, args, table_bytes=_mib(args.table_mib)), log=_log)
    res["summary"] = cold_line(res)
    plot_cold(res, out / "cold.png")
    return res


def _large(add):
    add("--table-gib", type=float, help="table size in GiB, both layers (default 8, quick 1/16; "
        "34 is the 1/6-scale V4.1 layout); written once into --data with demo-table, then reused")
    add("--row-format", choices=["fp32", "bf16", "fp16", "fp8-e4m3-ue8m0"],
        help="row format (default fp8-e4m3-ue8m0: 264-B rows, V4.1's)")
    add("--dram-budget", type=_size, help="the sidecar's DRAM budget for both tables, e.g. 4GiB "
        "(default 1/8 of the table)")
    add("--prefill-steps", type=int, help="prefill steps of 4,096 tokens per measured phase (default 30, quick 2)")
    add("--decode-steps", type=int, help="decode steps of 128 streams per measured phase (default 300, quick 8)")
    add("--warmup-steps", type=int, help="untimed prefill steps of other text before the steady "
        "state (default 100, quick 2)")
    add("--disk-seconds", type=float, help="seconds per disk probe (default 3, quick 0.3)")
    add("--forward-ms", type=float, help="untimed milliseconds between steps, as an engine's forward runs "
        "between them (default 0: steps back to back, the sidecar's one-way learning racing the next probe)")
    add("--competitors", help="comma-separated, of tierstore-direct, tierstore-cached, mmap, mmap-capped "
        "(default all; mmap-capped needs a tierstore one: it is capped at its footprint)")


def _run_large(args, out: Path, suite: bool) -> dict:
    from tierstore.bench.large import LargeOptions, run_large_bench

    return run_large_bench(args.data, out, _options(LargeOptions, args), log=_log)


def _warm(add):
    add("--table-mib", type=int, help="size of the table (default 256, quick 64)")
    add("--batch", type=int, default=4096, help="ids per step (default 4096)")
    add("--dist", default="zipf1.0", help="id distribution (default zipf1.0)")
    add("--steady-steps", type=int, help="steps before the restart (default 300, quick 150)")
    add("--after-steps", type=int, help="steps after each restart (default 150, quick 80)")


def _run_warm(args, out: Path, suite: bool) -> dict:
    from tierstore.bench.warm import WarmOptions, run_warm_bench

    return run_warm_bench(out, _options(WarmOptions, args, table_bytes=_mib(args.table_mib)), log=_log)


def _cache(add):
    add("--trace", action="append", metavar="FILE",
        help="replay your own access log: .npy of int64 row ids in access order (repeatable)")
    add("--traces", type=_csv(str), metavar="KIND,...", help="built-in traces to replay when no --trace: zipf<alpha>, "
        "documents, text, aws-docs, docstrings, mixed (default zipf1.0,documents,text,aws-docs)")
    add("--step-ids", type=int, metavar="N",
        help="cut --trace into steps of N accesses (default: FILE.steps.npy of step lengths)")
    add("--sizes", type=_csv(float), metavar="S,...",
        help="cache sizes: fractions of the table's rows (< 1) or row counts (default 0.001,0.01,0.1)")
    add("--rows", type=int, help="rows in the traced table (default FILE.json n_ids, else max id + 1)")
    add("--jobs", type=int, help="processes for the reference policies (default: CPU count)")
    add("--no-hbm-drift", dest="hbm_drift", action="store_false",
        help="leave out the HBM-tier cell (it runs with the built-in traces)")


def _run_cache(args, out: Path, suite: bool) -> dict:
    from tierstore.bench.cache import run_cache_bench, summary

    kw = {"sizes": args.sizes} if args.sizes else {}
    kw["hbm_drift"] = args.hbm_drift and not args.trace  # the HBM-tier cell runs with the built-in traces
    if args.traces and not args.trace:
        kw["trace_paths_or_kinds"] = args.traces
    if args.trace:
        from tierstore.bench.traces import access_trace

        kw["trace_paths_or_kinds"] = [access_trace(t, args.step_ids, args.rows) for t in args.trace]
    res = run_cache_bench(out_dir=out, seed=args.seed, quick=args.quick, jobs=args.jobs, log=_log, **kw)
    res["summary"] = summary(res).replace("\n", " | ")
    return res


def _hash(add):
    add("--preset", default="deepseek-v4.1-flash")


def _run_hash(args, out: Path, suite: bool) -> dict:
    from tierstore.bench.hash import run_hash_bench

    res = run_hash_bench(seed=args.seed, preset=args.preset,
                         **({"batch": 8, "seq": 4096, "repeats": 3} if args.quick else {}))
    res["summary"] = (f"hash {res['preset']} [{res['batch']}x{res['seq']}]: tierstore "
                      f"{res['speedup']:.2f}x plain numpy ({res['tierstore_tokens_per_s'] / 1e6:.2f} M tokens/s), "
                      f"outputs equal: {res['outputs_equal']}")
    res["units"] = {"*_tokens_per_s": "tokens/s", "*_s": "s", "speedup": "x"}
    return res


def _e2e(add):
    add("--rounds", type=int, help="timed rounds per source, after one warm-up (default 5, quick 2)")


def _run_e2e(args, out: Path, suite: bool) -> dict:
    from tierstore.bench.e2e import run_e2e_bench

    ensure_data(args.data)
    return run_e2e_bench(data_dir=args.data, out_dir=out, quick=args.quick, seed=args.seed, rounds=args.rounds)


def _scale(add):
    add("--large", type=int, help="slots of the large arena (default 16,000,000; quick 4,000,000)")
    add("--small", type=int, help="slots of the small arena (default 500,000)")
    add("--rounds", type=int, help="timed rounds per arena (default 30, quick 15)")


def _run_scale(args, out: Path, suite: bool) -> dict:
    from tierstore.bench.scale import run_scale_bench

    return run_scale_bench(out, quick=args.quick, seed=args.seed, large=args.large, small=args.small or 500_000,
                           rounds=args.rounds, log=_log)


def _concurrency(add):
    add("--clients", type=int, default=4, help="worker processes (default 4)")
    add("--seconds", type=float, help="seconds per timed run (default 4, quick 2)")
    add("--batch", type=int, default=4096, help="ids per step (default 4096)")
    add("--rounds", type=int, help="rounds, alternating 1 and N clients (default 3, quick 2)")


def _run_concurrency(args, out: Path, suite: bool) -> dict:
    from tierstore.bench.concurrency import run_concurrency_bench

    ensure_data(args.data)
    return run_concurrency_bench(args.data, clients=args.clients, seed=args.seed, batch=args.batch,
                                 seconds=args.seconds or (2.0 if args.quick else 4.0),
                                 rounds=args.rounds or (2 if args.quick else 3), log=_log)


def _remote(add):
    add("--rows", type=int, help="rows of the fp32 x 64 test table (default 200,000; quick 20,000)")
    add("--batch", type=int, default=4096, help="unique ids per call (default 4096)")
    add("--rounds", type=int, help="timed interleaved rounds (default 30; quick 5)")


def _run_remote(args, out: Path, suite: bool) -> dict:
    from tierstore.bench.remote import format_remote, run_bench
    from tierstore.tiers.remote.mooncake import missing_reason

    why = missing_reason()
    if why:
        raise _Skipped(why)
    res = run_bench(out, rows=args.rows or (20_000 if args.quick else 200_000), batch=args.batch,
                    rounds=args.rounds or (5 if args.quick else 30), seed=args.seed, write=False)
    print("\n".join(format_remote(res)), flush=True)
    return res


def _engines(add):
    add("--vocab", type=int, help="engram vocab size: rows are ~24x it (default 200000, quick 20000)")
    add("--tokens", type=int, default=512, help="tokens per extend batch (default 512; in cache mode "
        "over 4 requests, each extend followed by 8 decode steps, quick 3)")
    add("--warmup-tokens", type=_count, help="cache mode: tokens of the text staged before the timed rounds, "
        "other documents than the rounds', no forward (default 65536, quick 8192; 0: the cache starts empty)")


def _run_engines(args, out: Path, suite: bool) -> dict:
    from tierstore.bench.engines import engines_line, run_engines_bench

    res = run_engines_bench(out, vocab=args.vocab, tokens=args.tokens, warmup_tokens=args.warmup_tokens,
                            quick=args.quick, seed=args.seed, log=_log)
    res["summary"] = engines_line(res)
    return res


class _Scenario(NamedTuple):
    help: str
    data: bool  # whether it reads --data
    options: Callable  # options(add): its flags, for its own parser and for `bench all`'s --<scenario>-<option>
    run: Callable  # run(args, out, suite) -> the results.json entry; raises _Skipped where it cannot run


# the one definition of every scenario: its flags and how they map onto its run (for a scenario
# with an options dataclass, by name: each flag's dest is one of its fields)
_SCENARIOS = {
    "lookup": _Scenario("rows/s and latency: tierstore paths vs numpy, mmap, LMDB, Redis", True, _lookup,
                        _run_lookup),
    "cold": _Scenario("table 4x the DRAM budget: NVMe tier vs all-DRAM vs a cold mmap", True, _cold, _run_cold),
    "large": _Scenario("a V4.1-layout table at the size users run: real-text prefill and decode steps, cold start "
                       "and steady state, tierstore vs memmap (capped at tierstore's memory), against the disk's "
                       "own random-read IOPS", True, _large, _run_large),
    "warm": _Scenario("hit ratio per step after a restart, warm start vs cold, against the steady state before it",
                      False, _warm, _run_warm),
    "cache": _Scenario("cache-policy hit ratios on synthetic and real-text traces", False, _cache, _run_cache),
    "hash": _Scenario("n-gram hashing throughput vs a plain numpy implementation", False, _hash, _run_hash),
    "e2e": _Scenario("model forward pass fed by the sidecar vs an in-process table", True, _e2e, _run_e2e),
    "scale": _Scenario("Plan time against a full cache-mode arena of 0.5 M vs 16 M slots", False, _scale,
                       _run_scale),
    "concurrency": _Scenario("aggregate rows/s of N client processes on one cache-mode table vs one", True,
                             _concurrency, _run_concurrency),
    "remote": _Scenario("cache-mode misses from local NVMe vs Mooncake Store (TCP) vs Mooncake's "
                        "EngramStore.lookup, and a new host's write-back warm-up", False, _remote, _run_remote),
    "engines": _Scenario("sglang's Engram on CPU: its own host table vs tierstore's split arena vs tierstore cache "
                         "mode at 25%% of rows through the row stager (step time, bit-exactness, hit ratio, "
                         "start-up)", False, _engines, _run_engines),
}


def _prefixed(group, scenario: str):
    """`add` for `bench all`: --<scenario>-<option>, stored as '<scenario>.<dest>' only when given."""
    def add(flag, **kw):
        dest = kw.pop("dest", flag[2:].replace("-", "_"))
        kw.pop("default", None)
        if kw.get("action", "append") == "append":
            kw.setdefault("metavar", flag[2:].upper().replace("-", "_"))
        group.add_argument(f"--{scenario}-{flag[2:]}", dest=f"{scenario}.{dest}", default=argparse.SUPPRESS, **kw)
    return add


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="scenario", metavar="SCENARIO")
    parsers = {}
    for name, scenario in _SCENARIOS.items():
        parsers[name] = sp = sub.add_parser(name, help=scenario.help)
        _common(sp, scenario.data)
        scenario.options(sp.add_argument)
    al = sub.add_parser("all", help="every scenario of SCENARIOS (make bench: < 10 minutes on 2 cores); "
                        "a scenario's options are --<scenario>-<option>, e.g. --cold-table-mib 4")
    _common(al)
    for name in SCENARIOS:
        _SCENARIOS[name].options(_prefixed(al.add_argument_group(f"{name} options"), name))
    rep = sub.add_parser("report", help="print the tables of OUT/results.json again")
    rep.add_argument("out", help="output directory of an earlier run")
    p.set_defaults(_parser=p, _scenario_parsers=parsers)


def scenario_args(name: str, args, parsers) -> argparse.Namespace:
    """The namespace `tierstore bench <name>` would parse for one scenario of `bench all`:
    its parser's defaults, the common options of `args` and its --<name>-<option>s."""
    argv = ["--out", str(args.out), "--seed", str(args.seed)]
    argv += ["--data", str(args.data)] if _SCENARIOS[name].data else []
    argv += ["--quick"] if args.quick else []
    argv += [] if args.progress else ["--no-progress"]
    ns = parsers[name].parse_args(argv)
    for key, value in vars(args).items():
        if key.startswith(name + "."):
            setattr(ns, key[len(name) + 1:], value)
    ns.scenario, ns.data = name, args.data
    return ns


def run(args) -> int:
    if not getattr(args, "scenario", None):
        args._parser.print_help()
        return 2
    if args.scenario == "report":
        from tierstore.bench.report import format_report
        from tierstore.bench.results import load_results

        print(format_report(load_results(args.out)))
        return 0
    if args.scenario != "all":
        return _run_one(args.scenario, args, suite=False)
    failed = 0
    for name in SCENARIOS:
        failed += _run_one(name, scenario_args(name, args, args._scenario_parsers), suite=True) != 0
    return 1 if failed else 0


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ensure_data(data_dir) -> None:
    """Create the demo tables in `data_dir` when it holds no catalog yet."""
    if (Path(data_dir) / "catalog" / "data.mdb").exists():
        return
    from tierstore.ingest.demo_table import make_demo_tables

    _log(f"bench: no tables in {data_dir}; creating the demo tables "
         f"(tierstore demo-table --preset {DEMO_PRESET} --scale {DEMO_SCALE} --data {data_dir})")
    make_demo_tables(data_dir, DEMO_PRESET, DEMO_SCALE, progress=True)


def _run_one(name: str, args, suite: bool) -> int:
    """Run scenario `name` on its own parsed arguments, add its entry to OUT/results.json and
    print its summary line; suite: one of `bench all`."""
    from tierstore.bench.results import write_scenario

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    try:
        res = _SCENARIOS[name].run(args, out, suite)
    except _Skipped as e:
        write_scenario(out, name, {"skipped": e.reason}, seed=args.seed, started=started)
        print(f"{name}: skipped: {e.reason}", flush=True)
        return 1
    write_scenario(out, name, res, seed=args.seed, started=started)
    print(res.get("summary") or f"{name}: done, see {out / 'results.json'}", flush=True)
    return 0


class _Skipped(Exception):
    """A scenario that cannot run on this machine; `reason` says why (results.json keeps it)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _options(cls, args, **given):
    """The scenario's options dataclass from its parsed flags: every flag whose dest is one
    of its fields, and `given` (a flag in other units, e.g. --table-mib as table_bytes)."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names and k not in given}, **given)


def _mib(mib: int | None) -> int | None:
    return mib << 20 if mib else None
