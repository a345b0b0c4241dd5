"""HBM tier on a drifting trace: the adaptive HBMCache against static hot sets chosen offline.

A trace's steps drive `tierstore.client.model.hbm_cache.HBMCache` exactly as
EngramLayer does (lookup, observe, maybe_refresh after the step), over a
stand-in row source that serves zero rows (the hit ratio does not depend on
the bytes). Per window of steps it reports the HBM hit ratio (unique rows of a
step found in HBM) of
- adaptive: the cache, starting empty, refreshed by default settings;
- static: the `capacity` ids read in most steps over the whole trace;
- static-window: the `capacity` ids read in most steps of that window (an
  offline oracle per window, chosen on the very reads it is scored on);
- static-prev: the `capacity` ids read in most steps of the window before
  (a hot set profiled offline from recent traffic, scored out of sample);
- with `profile` > 0, the first share of the steps is held out as "other text
  of the same domain": its hot set is what `tierstore profile` would give
  (static-profile, scored out of sample), it seeds a second adaptive cache
  (adaptive-seeded, what `HBMCache.from_source(hot_ids=...)` does), and only
  the remaining steps are scored;
and the refresh traffic (rows and bytes copied host -> device per step, and
bytes per token when the trace says how many tokens a step reads).
"""
from __future__ import annotations

import numpy as np
import torch

from tierstore.bench.traces import Trace, _Zipf, dedupe_steps
from tierstore.errors import InvalidArgument


def drift_trace(n_ids: int = 1_000_000, steps: int = 2000, batch: int = 4000, topic_steps: int = 250,
                common: float = 0.5, alpha: float = 1.0, seed: int = 0) -> Trace:
    """Zipf reads whose topic drifts: a share `common` from one global Zipf, the rest
    from a topic's own Zipf; the topic slides to the next one over `topic_steps` steps."""
    if not 0 <= common <= 1 or topic_steps < 1 or steps < 1 or batch < 1:
        raise InvalidArgument("drift_trace: common in [0, 1], topic_steps, steps, batch >= 1")
    rng = np.random.default_rng(seed)
    glob = _Zipf(n_ids, alpha, rng)
    n_topics = steps // topic_steps + 2
    topic = _Zipf(n_ids, alpha, rng)  # one shape; each topic permutes its ids
    perms = [rng.permutation(n_ids).astype(np.int64) for _ in range(n_topics)]
    step_of = np.repeat(np.arange(steps, dtype=np.int64), batch)
    x = step_of / topic_steps
    t = np.floor(x).astype(np.int64) + (rng.random(step_of.size) < x - np.floor(x))  # slide a -> a+1
    ranks = np.searchsorted(topic.cdf, rng.random(step_of.size), side="right").clip(max=n_ids - 1)
    topical = np.empty(step_of.size, dtype=np.int64)
    for k in range(n_topics):  # a loop over topics, not ids
        m = t == k
        topical[m] = perms[k][ranks[m]]
    ids = np.where(rng.random(step_of.size) < common, glob.ids(rng.random(step_of.size)), topical)
    ids, bounds = dedupe_steps(ids, step_of)
    return Trace("drift", ids, bounds, n_ids, {"kind": "drift", "topic_steps": topic_steps, "common": common,
                                               "batch": batch, "seed": seed})


class _ZeroSource:
    """RowSource stand-in for the simulation: every row reads as zeros."""

    class _Handle:
        def __init__(self, n, row_bytes):
            self.arena = torch.zeros(max(1, n), row_bytes, dtype=torch.uint8)
            self._n = n

        def slots(self):
            return np.arange(self._n, dtype=np.int64)

        def release(self):
            pass

    def __init__(self, row_bytes: int):
        self.row_bytes = row_bytes

    def plan(self, table, ids):
        return self._Handle(len(ids), self.row_bytes)


def _top_presence(trace: Trace, lo: int, hi: int, k: int) -> np.ndarray:
    ids = trace.ids[trace.bounds[lo]:trace.bounds[hi]]
    cnt = np.bincount(ids, minlength=trace.n_ids)
    k = min(k, int(np.count_nonzero(cnt)))
    return np.argpartition(-cnt, k - 1)[:k] if k else np.zeros(0, np.int64)


def run_hbm_drift(trace: Trace | None = None, capacity: float = 0.02, window: int | None = None,
                  row_bytes: int = 256, profile: float = 0.0, **cache_kw) -> dict:
    """Per-window HBM hit ratios of the adaptive cache vs static hot sets (see module doc).

    capacity: HBM rows as a fraction of the table (< 1) or a row count.
    window: steps per reported window (default: the trace's topic_steps, else steps / 8).
    profile: share of the steps held out as an offline profile (0: none).
    cache_kw: HBMCache settings (refresh_every, refresh_bytes, half_life)."""
    from tierstore.client.model.hbm_cache import HBMCache

    trace = trace or drift_trace()
    cap = int(capacity * trace.n_ids) if capacity < 1 else int(capacity)
    first = int(profile * trace.steps)
    if not 0 <= profile < 1 or (profile and not 0 < first < trace.steps):
        raise InvalidArgument(f"profile must be a share of the steps in [0, 1), got {profile}")
    window = int(window or trace.meta.get("topic_steps") or max(1, (trace.steps - first) // 8))
    cache = HBMCache(cap, row_bytes, "cpu", trace.n_ids, table="t", **cache_kw)
    src = _ZeroSource(row_bytes)
    caches = {"adaptive": cache}
    prof = np.zeros(trace.n_ids, dtype=bool)
    if first:
        hot = _top_presence(trace, 0, first, cap)
        hot = hot[np.argsort(-np.bincount(trace.ids[:trace.bounds[first]], minlength=trace.n_ids)[hot],
                             kind="stable")]
        prof[hot] = True
        seeded = caches["adaptive_seeded"] = HBMCache(cap, row_bytes, "cpu", trace.n_ids, table="t", **cache_kw)
        seeded.seed(hot, np.zeros((hot.size, row_bytes), np.uint8))
    glob = np.zeros(trace.n_ids, dtype=bool)
    glob[_top_presence(trace, first, trace.steps, cap)] = True
    # tokens a step reads (text traces: streams x tokens_per_step), for bytes per token
    tokens = int(trace.meta.get("streams", 0)) * int(trace.meta.get("tokens_per_step", 0))
    rows = []
    prev = np.zeros(trace.n_ids, dtype=bool)
    for lo in range(first, trace.steps, window):
        hi = min(trace.steps, lo + window)
        local = np.zeros(trace.n_ids, dtype=bool)
        local[_top_presence(trace, lo, hi, cap)] = True
        ids = trace.ids[trace.bounds[lo]:trace.bounds[hi]]
        before = {k: (c.hits, c.misses, c.refresh_rows) for k, c in caches.items()}
        for i in range(lo, hi):
            step = trace.step(i)
            for c in caches.values():
                c.find(step)
                c.observe(step)
                c.maybe_refresh(src)
        n = max(1, ids.size)
        row = {"steps": [lo, hi], "static": float(glob[ids].sum() / n), "static_window": float(local[ids].sum() / n),
               "static_prev": float(prev[ids].sum() / n)}
        if first:
            row["static_profile"] = float(prof[ids].sum() / n)
        for k, c in caches.items():
            h0, m0, r0 = before[k]
            row[k] = (c.hits - h0) / max(1, c.hits - h0 + c.misses - m0)
            moved = c.refresh_rows - r0
            sfx = "" if k == "adaptive" else "_seeded"
            row["refresh_rows_per_step" + sfx] = moved / (hi - lo)
            row["refresh_bytes_per_step" + sfx] = moved * row_bytes / (hi - lo)
            if tokens:
                row["refresh_bytes_per_token" + sfx] = moved * row_bytes / ((hi - lo) * tokens)
        rows.append(row)
        prev = local
    warm = rows[1:] or rows
    out = {"trace": trace.name, "accesses": int(trace.ids.size), "capacity_rows": cap, "window_steps": window,
           "profile_steps": first, "tokens_per_step": tokens,
           "settings": {"refresh_every": cache.refresh_every, "refresh_bytes": cache.refresh_bytes,
                        "half_life": cache.half_life, "row_bytes": row_bytes},
           "windows": rows,
           "worst_gap_vs_static": max(r["static"] - r["adaptive"] for r in warm),
           "worst_gap_vs_static_window": max(r["static_window"] - r["adaptive"] for r in warm),
           "worst_gap_vs_static_prev": max(r["static_prev"] - r["adaptive"] for r in warm)}
    if first:
        out["worst_gap_seeded_vs_static"] = max(r["static"] - r["adaptive_seeded"] for r in rows)
        out["worst_gap_seeded_vs_static_profile"] = max(r["static_profile"] - r["adaptive_seeded"] for r in rows)
    return out


def hbm_line(res: dict) -> str:
    w = res["windows"][1:] or res["windows"]
    mean = lambda k: float(np.mean([r[k] for r in w]))  # noqa: E731
    return (f"hbm {res['trace']} @ {res['capacity_rows']:,} rows (windows after the first): adaptive "
            f"{mean('adaptive'):.3f}, static {mean('static'):.3f}, previous window's {mean('static_prev'):.3f}, "
            f"this window's (in-sample) {mean('static_window'):.3f}; worst gap vs static "
            f"{res['worst_gap_vs_static']:+.3f}, vs previous {res['worst_gap_vs_static_prev']:+.3f}, "
            f"vs in-sample {res['worst_gap_vs_static_window']:+.3f}; "
            f"refresh {mean('refresh_bytes_per_step') / 2**20:.2f} MiB/step"
            + (f" ({mean('refresh_bytes_per_token'):.0f} B/token)" if res.get("tokens_per_step") else "")
            + (f"; seeded from a held-out profile: {mean('adaptive_seeded'):.3f} against the profile's static "
               f"{mean('static_profile'):.3f}" if res.get("profile_steps") else ""))
