"""`tierstore bench warm`: the hit ratio after a restart, with and without the
warm start, against the steady state before it.

One run, one table (the random table `bench cold` writes, 4x the DRAM budget),
one id stream (Zipf over a fixed random permutation of the rows, as hashed
n-grams are spread): a cache-mode sidecar serves `steady_steps` planned steps
until its hit ratio is steady, then stops (recording its hot set). The same
stream's next `after_steps` steps are then served twice, each by a sidecar
started from a dropped page cache:
  cold  `--no-warm-start`: the arena starts empty, as before warm restarts;
  warm  the default: the recorded hot set is promoted in the background.
Both begin their steps the moment the sidecar says SERVING; steps run back to
back, so the warm-up gets no idle time (a model's steps leave it more). The hit
ratio of a step is the Plan's (unique ids found in the arena); reported per
window of `window` steps, with the steady state (the mean of the last
`window * 5` steps before the stop) and the first window within 0.05 of it.
"""
from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tierstore.bench.workload import BenchOptions, parse_dist
from tierstore.errors import InvalidArgument

__all__ = ["run_warm_bench", "WarmOptions", "warm_line"]

UNITS = {"hit_ratio": "fraction of unique ids per Plan found in the DRAM arena", "steps": "planned steps",
         "warm_up_s": "seconds from SERVING until the warm-up promoted its last row"}
TOLERANCE = 0.05


@dataclass(slots=True)
class WarmOptions(BenchOptions):
    """What `bench warm` runs (module docstring); `tierstore bench warm` builds it from the
    flags of the same names. Defaults of a field left unset: DEFAULTS (full run, --quick)."""

    table_bytes: int | None = None      # the random table, in OUT/baselines/cold-data
    budget_fraction: float = 0.25       # the sidecar's DRAM budget, of the table's bytes
    batch: int = 4096                   # ids per step
    dist: str = "zipf1.0"               # how they are drawn (bench/workload.py)
    steady_steps: int | None = None     # steps before the restart
    after_steps: int | None = None      # steps after each restart
    window: int = 10                    # steps per reported hit ratio

    DEFAULTS = {"table_bytes": (256 << 20, 64 << 20), "steady_steps": (300, 150), "after_steps": (150, 80)}

    def validate(self) -> None:
        if not 0 < self.budget_fraction <= 1 or self.batch < 1 or self.window < 1:
            raise InvalidArgument(f"bench warm: the budget fraction must be in (0, 1], the batch and the window "
                                  f">= 1, got {self.budget_fraction}, {self.batch}, {self.window}")
        parse_dist(self.dist)


def run_warm_bench(out_dir, options: WarmOptions | None = None, log=print) -> dict:
    """Run the scenario (module docstring) on a random table of `options.table_bytes` in
    OUT/baselines/cold-data; returns its results.json entry."""
    from tierstore.bench.memory import drop_page_cache
    from tierstore.bench.random_table import random_table
    from tierstore.bench.workload import make_batches
    from tierstore.client.client import Client

    from tierstore.sidecar.launcher import SidecarProcess
    from tierstore.store.hot_set import hot_set_path

    o = options or WarmOptions()
    cache_dir = Path(out_dir) / "baselines" / "cold-data"
    log(f"warm: table of {o.table_bytes / 2**20:.0f} MiB in {cache_dir} (written once, then reused)")
    version = random_table(cache_dir, o.table_bytes, seed=o.seed, progress=o.progress)
    budget = int(version.nbytes * o.budget_fraction)
    segments = [cache_dir / s for s in version.segments]
    stream = make_batches(o.dist, version.rows, o.batch, o.steady_steps + o.after_steps, o.seed)
    before, after = stream[:o.steady_steps], stream[o.steady_steps:]
    hot = hot_set_path(cache_dir, version.table, version.number)
    hot.unlink(missing_ok=True)  # an earlier run's: the first sidecar starts cold
    kept = Path(out_dir) / "baselines" / "warm-hot-set"
    # the hot set is recorded at stop only: the figures show what a stop leaves
    flags = ["--hot-set-interval", "0"]

    def serve(steps, extra, name):
        drop_page_cache(segments)
        t0 = time.monotonic()
        with SidecarProcess(cache_dir, dram_budget=budget, extra_args=[*flags, *extra]) as sc, \
                Client(sc.socket) as c:
            started = time.monotonic() - t0
            ratios, done_at = _steps(c, version.table, steps, o.progress, name)
            stats = next(t for t in c.stats()["tables"] if t["table"] == version.table)
            warmed = int(stats.get("warmed", 0))
            cap = int(stats["capacity"])
        return {"hit_ratio_per_step": ratios, "start_s": started, "warmed_rows": warmed, "arena_slots": cap,
                "warm_up_done_step": done_at(warmed) if warmed else None}

    first = serve(before, ["--no-warm-start"], "warm: to steady state")
    shutil.copyfile(hot, kept)
    steady = float(np.mean(first["hit_ratio_per_step"][-o.window * 5:]))
    cold = serve(after, ["--no-warm-start"], "warm: cold restart")
    shutil.copyfile(kept, hot)  # the cold run recorded its own at its stop: the warm one starts from the first's
    warm = serve(after, [], "warm: warm restart")
    kept.unlink(missing_ok=True)
    runs = {"cold": cold, "warm": warm}
    for r in runs.values():
        r["hit_ratio_per_window"] = _windows(r["hit_ratio_per_step"], o.window)
        r["within_tolerance_from_step"] = _settled(r["hit_ratio_per_window"], steady, o.window)
        step50 = r["hit_ratio_per_step"][40:50]
        r["hit_ratio_steps_41_50"] = float(np.mean(step50)) if step50 else None
    result = {"table_rows": version.rows, "row_bytes": version.row_bytes, "table_bytes": version.nbytes,
              "dram_budget_bytes": budget, "arena_slots": first["arena_slots"], "dist": o.dist, "batch": o.batch,
              "steady_steps": o.steady_steps, "after_steps": o.after_steps, "window": o.window,
              "tolerance": TOLERANCE, "steady_hit_ratio": steady,
              "steady_run_hit_ratio_per_window": _windows(first["hit_ratio_per_step"], o.window),
              "restarts": runs, "page_cache": "dropped before each sidecar starts (posix_fadvise DONTNEED)",
              "units": UNITS, "quick": o.quick}
    result["summary"] = warm_line(result)
    log(result["summary"])
    return result


def _steps(c, table: str, steps, progress: bool, name: str):
    """Plan each step back to back; (hit ratio per step, step at which `warmed` rows were in)."""
    from tqdm import tqdm

    ratios, warmed = [], []
    for ids in tqdm(steps, desc=name, unit="step", disable=not progress, leave=False):
        with c.plan(table, ids) as step:
            step.slots()
            ratios.append(step.hits / max(1, step.hits + step.misses))
        if len(ratios) % 5 == 0:  # how far the warm-up has come (one Stats call per 5 steps)
            warmed.append((len(ratios), int(next(t for t in c.stats()["tables"] if t["table"] == table)
                                            .get("warmed", 0))))

    def done_at(total: int) -> int | None:
        return next((s for s, w in warmed if w >= total), None)

    return ratios, done_at


def _windows(ratios, window: int) -> list[float]:
    return [float(np.mean(ratios[a:a + window])) for a in range(0, len(ratios), window)]


def _settled(windows, steady: float, window: int) -> int | None:
    """The last step of the first window within TOLERANCE of `steady` (None: never)."""
    return next(((i + 1) * window for i, h in enumerate(windows) if h >= steady - TOLERANCE), None)


def warm_line(r: dict) -> str:
    w, c = r["restarts"]["warm"], r["restarts"]["cold"]

    def part(x):
        at, h50 = x["within_tolerance_from_step"], x["hit_ratio_steps_41_50"]
        return (f"first {r['window']} steps {x['hit_ratio_per_window'][0]:.3f}, steps 41-50 "
                f"{'n/a' if h50 is None else format(h50, '.3f')}, within {r['tolerance']} of steady "
                f"{'from step ' + str(at) if at else 'never in ' + str(r['after_steps']) + ' steps'}")

    return (f"warm {r['dist']} b={r['batch']} table {r['table_bytes'] / 2**20:.0f} MiB, budget "
            f"{r['dram_budget_bytes'] / 2**20:.0f} MiB: steady hit {r['steady_hit_ratio']:.3f}; warm restart "
            f"{part(w)} ({w['warmed_rows']} rows warmed, done by step {w['warm_up_done_step']}); cold restart {part(c)}")
