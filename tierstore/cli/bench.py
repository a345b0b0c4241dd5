"""`tierstore bench`: storage benchmarks against simple alternatives.

    tierstore bench lookup --data DIR --out OUT [--table T | --table-mib 8192] [--batches ...] [--dists ...] [--quick]
    tierstore bench cold   --data DIR --out OUT [--quick]
    tierstore bench large  --data DIR --out OUT [--table-gib 8] [--row-format F] [--dram-budget 1GiB] [--quick]
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
    tierstore bench all    --data DIR --out OUT [--quick]
    tierstore bench report OUT

Every scenario adds its figures (with units, machine, commit, seed, command
line) to OUT/results.json, writes OUT/<scenario>.png and prints a one-line
summary; progress bars go to stderr. Ratios compare competitors measured side
by side in interleaved rounds of the same run.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

__all__ = ["add_arguments", "run", "ensure_data", "SCENARIOS"]

SCENARIOS = ("lookup", "cold", "cache", "hash", "e2e", "scale", "concurrency")
DEMO_PRESET, DEMO_SCALE = "engram-paper-demo", 64


def _csv(kind):
    def parse(text):
        try:
            return tuple(kind(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None
    return parse


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="scenario", metavar="SCENARIO")
    lk = sub.add_parser("lookup", help="rows/s and latency: tierstore paths vs numpy, mmap, LMDB, Redis")
    _common(lk)
    lk.add_argument("--table", help="table of --data to read (default: the first; with --quick and no --table-mib)")
    lk.add_argument("--table-mib", type=int, help="read a random table of this many MiB of 264-B rows instead, "
                    "written once into OUT/baselines/lookup-data (default 8192, past TLB reach; --quick, "
                    "--table and `bench all` read a table of --data)")
    lk.add_argument("--batches", type=_csv(int), help="ids per call, e.g. 256,4096,32768,65536")
    lk.add_argument("--dists", type=_csv(str), help="id distributions, e.g. zipf0.8,zipf1.0,zipf1.2,uniform")
    lk.add_argument("--rounds", type=int, help="timed interleaved rounds per cell (default 5, quick 3)")
    lk.add_argument("--competitors", type=_csv(str), help="run only these, e.g. arena,arena-huge (the ceiling always)")
    lk.add_argument("--huge-shm-dir", help="also run arena-huge: a full-resident sidecar whose arenas live in DIR "
                                          "(a tmpfs mounted huge=within_size, or hugetlbfs): huge pages vs arena's")
    cold = sub.add_parser("cold", help="table 4x the DRAM budget: NVMe tier vs all-DRAM vs a cold mmap")
    _common(cold)
    cold.add_argument("--table-mib", type=int, help="size of the cold table (default 768, quick 160)")
    cold.add_argument("--batch", type=int, default=4096, help="ids per call (default 4096)")
    cold.add_argument("--dist", default="zipf1.0", help="id distribution (default zipf1.0)")
    cold.add_argument("--budget-fraction", type=float, default=0.25,
                      help="DRAM budget as a fraction of the table (default 0.25)")
    cold.add_argument("--warmup-arenas", type=float, default=2.0,
                      help="warm-up ids per competitor, in arena sizes (default 2)")
    lg = sub.add_parser("large", help="a V4.1-layout table at the size users run: real-text prefill and decode "
                        "steps, cold start and steady state, tierstore vs memmap (capped at tierstore's memory), "
                        "against the disk's own random-read IOPS")
    _common(lg)
    lg.add_argument("--table-gib", type=float, help="table size in GiB, both layers (default 8, quick 1/16; "
                    "34 is the 1/6-scale V4.1 layout); written once into --data with demo-table, then reused")
    lg.add_argument("--row-format", choices=["fp32", "bf16", "fp16", "fp8-e4m3-ue8m0"],
                    help="row format (default fp8-e4m3-ue8m0: 264-B rows, V4.1's)")
    lg.add_argument("--dram-budget", type=_size, help="the sidecar's DRAM budget for both tables, e.g. 4GiB "
                    "(default 1/8 of the table)")
    lg.add_argument("--prefill-steps", type=int, help="prefill steps of 4,096 tokens per measured phase "
                    "(default 30, quick 2)")
    lg.add_argument("--decode-steps", type=int, help="decode steps of 128 streams per measured phase "
                    "(default 300, quick 8)")
    lg.add_argument("--warmup-steps", type=int, help="untimed prefill steps of other text before the steady "
                    "state (default 100, quick 2)")
    lg.add_argument("--disk-seconds", type=float, help="seconds per disk probe (default 3, quick 0.3)")
    wm = sub.add_parser("warm", help="hit ratio per step after a restart, warm start vs cold, against the "
                        "steady state before it")
    _common(wm, data=False)
    wm.add_argument("--table-mib", type=int, help="size of the table (default 256, quick 64)")
    wm.add_argument("--batch", type=int, default=4096, help="ids per step (default 4096)")
    wm.add_argument("--dist", default="zipf1.0", help="id distribution (default zipf1.0)")
    wm.add_argument("--steady-steps", type=int, help="steps before the restart (default 300, quick 150)")
    wm.add_argument("--after-steps", type=int, help="steps after each restart (default 150, quick 80)")
    cache = sub.add_parser("cache", help="cache-policy hit ratios on synthetic and real-text traces")
    _common(cache, data=False)
    cache.add_argument("--trace", action="append", metavar="FILE",
                       help="replay your own access log: .npy of int64 row ids in access order (repeatable)")
    cache.add_argument("--step-ids", type=int, metavar="N",
                       help="cut --trace into steps of N accesses (default: FILE.steps.npy of step lengths)")
    cache.add_argument("--sizes", type=_csv(float), metavar="S,...",
                       help="cache sizes: fractions of the table's rows (< 1) or row counts (default 0.001,0.01,0.1)")
    cache.add_argument("--rows", type=int, help="rows in the traced table (default FILE.json n_ids, else max id + 1)")
    cache.add_argument("--jobs", type=int, help="processes for the reference policies (default: CPU count)")
    hsh = sub.add_parser("hash", help="n-gram hashing throughput vs a plain numpy implementation")
    _common(hsh, data=False)
    hsh.add_argument("--preset", default="deepseek-v4.1-flash")
    e2e = sub.add_parser("e2e", help="model forward pass fed by the sidecar vs an in-process table")
    _common(e2e)
    sc = sub.add_parser("scale", help="Plan time against a full cache-mode arena of 0.5 M vs 16 M slots")
    _common(sc, data=False)
    sc.add_argument("--large", type=int, help="slots of the large arena (default 16,000,000; quick 4,000,000)")
    cc = sub.add_parser("concurrency", help="aggregate rows/s of N client processes on one cache-mode table vs one")
    _common(cc)
    cc.add_argument("--clients", type=int, default=4, help="worker processes (default 4)")
    rm = sub.add_parser("remote", help="cache-mode misses from local NVMe vs Mooncake Store (TCP) vs "
                        "Mooncake's EngramStore.lookup, and a new host's write-back warm-up")
    _common(rm, data=False)
    rm.add_argument("--rows", type=int, help="rows of the fp32 x 64 test table (default 200,000; quick 20,000)")
    rm.add_argument("--batch", type=int, default=4096, help="unique ids per call (default 4096)")
    rm.add_argument("--rounds", type=int, help="timed interleaved rounds (default 30; quick 5)")
    al = sub.add_parser("all", help="every scenario (make bench: < 10 minutes on 2 cores)")
    _common(al)
    en = sub.add_parser("engines", help="sglang's Engram on CPU: its own host table vs tierstore's split arena "
                        "vs tierstore cache mode at 25%% of rows through the row stager (step time, bit-exactness, "
                        "hit ratio, start-up)")
    _common(en, data=False)
    en.add_argument("--vocab", type=int, help="engram vocab size: rows are ~24x it (default 200000, quick 20000)")
    en.add_argument("--tokens", type=int, default=512, help="tokens per extend batch (default 512; in cache mode "
                    "over 4 requests, each extend followed by 8 decode steps, quick 3)")
    rep = sub.add_parser("report", help="print the tables of OUT/results.json again")
    rep.add_argument("out", help="output directory of an earlier run")
    p.set_defaults(_parser=p)


def run(args) -> int:
    if not getattr(args, "scenario", None):
        args._parser.print_help()
        return 2
    if args.scenario == "report":
        from tierstore.bench.report import format_report
        from tierstore.bench.results import load_results

        print(format_report(load_results(args.out)))
        return 0
    names = SCENARIOS if args.scenario == "all" else (args.scenario,)
    failed = 0
    for name in names:
        code = _run_one(name, args)
        failed += code != 0
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


def _optional(module: str, attr: str, owner: str):
    """The function, or None when the module is not built yet."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name in (module, module.rsplit(".", 1)[0]):
            return None
        raise
    return getattr(mod, attr, None)


def _run_one(name: str, args) -> int:
    from tierstore.bench.results import write_scenario

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    quick, seed, progress = args.quick, args.seed, args.progress
    lookup_mib = None
    if name == "lookup":  # a table past TLB reach unless a quick run, a --data table or `bench all` asks otherwise
        lookup_mib = getattr(args, "table_mib", None) or (
            None if quick or args.scenario == "all" or getattr(args, "table", None) else 8192)
    if name in ("e2e", "concurrency") or (name == "lookup" and lookup_mib is None):
        ensure_data(args.data)  # cold, large and lookup --table-mib write their own tables of a chosen size
    if name == "lookup":
        from tierstore.bench.lookup import line_for, run_lookup_bench
        from tierstore.bench.plots import headline, plot_lookup

        kw = {}
        if getattr(args, "batches", None):
            kw["batches"] = args.batches
        elif quick:
            kw["batches"] = (4096, 32768)
        if getattr(args, "competitors", None):
            kw["competitors"] = tuple(args.competitors)
        if getattr(args, "huge_shm_dir", None):
            kw["huge_shm_dir"] = args.huge_shm_dir
        if getattr(args, "dists", None):
            kw["dists"] = args.dists
        elif quick:
            kw["dists"] = ("zipf1.0", "uniform")
        res = run_lookup_bench(args.data, out, table=getattr(args, "table", None), quick=quick, seed=seed,
                               rounds=getattr(args, "rounds", None), progress=progress, log=_log,
                               table_bytes=lookup_mib << 20 if lookup_mib else None, **kw)
        res["summary"] = line_for(headline(res["cells"]))
        plot_lookup(res, out / "lookup.png")
    elif name == "cold":
        from tierstore.bench.cold import cold_line, run_cold_bench
        from tierstore.bench.plots import plot_cold

        mib = getattr(args, "table_mib", None)
        res = run_cold_bench(args.data, out, table_bytes=(mib << 20) if mib else None,
                             batch=getattr(args, "batch", 4096), dist=getattr(args, "dist", "zipf1.0"),
                             budget_fraction=args.budget_fraction, warmup_arenas=args.warmup_arenas,
                             quick=quick, seed=seed, progress=progress, log=_log)
        res["summary"] = cold_line(res)
        plot_cold(res, out / "cold.png")
    elif name == "large":
        from tierstore.bench.large import run_large_bench

        res = run_large_bench(args.data, out, table_gib=args.table_gib, row_format=args.row_format,
                              dram_budget=args.dram_budget,
                              prefill_steps=args.prefill_steps, decode_steps=args.decode_steps,
                              warmup_steps=args.warmup_steps, disk_seconds=args.disk_seconds, quick=quick,
                              seed=seed, progress=progress, log=_log)
    elif name == "warm":
        from tierstore.bench.warm import run_warm_bench

        mib = getattr(args, "table_mib", None)
        res = run_warm_bench(out, table_bytes=(mib << 20) if mib else None, batch=args.batch, dist=args.dist,
                             steady_steps=args.steady_steps, after_steps=args.after_steps, quick=quick,
                             seed=seed, progress=progress, log=_log)
    elif name == "cache":
        fn = _optional("tierstore.bench.cache", "run_cache_bench", "cache")
        if fn is None:
            return _missing(name, "tierstore.bench.cache.run_cache_bench", out, seed, started)
        from tierstore.bench import cache as cache_mod

        kw = {"sizes": args.sizes} if getattr(args, "sizes", None) else {}
        kw["hbm_drift"] = not getattr(args, "trace", None)  # the HBM-tier cell runs with the built-in traces
        if getattr(args, "trace", None):
            from tierstore.bench.traces import access_trace

            kw["trace_paths_or_kinds"] = [access_trace(t, args.step_ids, args.rows) for t in args.trace]
        res = fn(out_dir=out, seed=seed, quick=quick, jobs=getattr(args, "jobs", None), log=_log, **kw)
        res["summary"] = cache_mod.summary(res).replace("\n", " | ")
    elif name == "hash":
        fn = _optional("tierstore.bench.hash", "run_hash_bench", "hash")
        if fn is None:
            return _missing(name, "tierstore.bench.hash.run_hash_bench", out, seed, started)
        res = fn(seed=seed, preset=getattr(args, "preset", "deepseek-v4.1-flash"),
                 **({"batch": 8, "seq": 4096, "repeats": 3} if quick else {}))
        res["summary"] = (f"hash {res['preset']} [{res['batch']}x{res['seq']}]: tierstore "
                          f"{res['speedup']:.2f}x plain numpy ({res['tierstore_tokens_per_s'] / 1e6:.2f} M tokens/s), "
                          f"outputs equal: {res['outputs_equal']}")
        res["units"] = {"*_tokens_per_s": "tokens/s", "*_s": "s", "speedup": "x"}
    elif name == "concurrency":
        from tierstore.bench.concurrency import run_concurrency_bench

        res = run_concurrency_bench(args.data, clients=getattr(args, "clients", 4), seed=seed,
                                    seconds=2.0 if quick else 4.0, rounds=2 if quick else 3, log=_log)
    elif name == "remote":
        from tierstore.bench.remote import format_remote, run_bench
        from tierstore.tiers.remote.mooncake import missing_reason

        why = missing_reason()
        if why:
            write_scenario(out, name, {"skipped": why}, seed=seed, started=started)
            print(f"remote: skipped: {why}", flush=True)
            return 1
        res = run_bench(out, rows=args.rows or (20_000 if quick else 200_000), batch=args.batch,
                        rounds=args.rounds or (5 if quick else 30), seed=seed, write=False)
        print("\n".join(format_remote(res)), flush=True)
    elif name == "engines":
        from tierstore.bench.engines import engines_line, run_engines_bench

        res = run_engines_bench(out, vocab=args.vocab, tokens=args.tokens, quick=quick, seed=seed, log=_log)
        res["summary"] = engines_line(res)
    elif name == "scale":
        from tierstore.bench.scale import run_scale_bench

        res = run_scale_bench(out, quick=quick, seed=seed, large=getattr(args, "large", None), log=_log)
    else:  # e2e
        fn = _optional("tierstore.bench.e2e", "run_e2e_bench", "e2e")
        if fn is None:
            return _missing(name, "tierstore.bench.e2e.run_e2e_bench", out, seed, started)
        res = fn(data_dir=args.data, out_dir=out, quick=quick, seed=seed)
    write_scenario(out, name, res, seed=seed, started=started)
    print(res.get("summary") or f"{name}: done, see {out / 'results.json'}", flush=True)
    return 0


def _missing(name: str, what: str, out: Path, seed: int, started: float) -> int:
    from tierstore.bench.results import write_scenario

    msg = f"{what} is not available in this build yet; scenario skipped"
    write_scenario(out, name, {"skipped": msg}, seed=seed, started=started)
    print(f"{name}: skipped: {msg}", flush=True)
    return 0
