"""PNG plots of the benchmark results (matplotlib, Agg: no display needed)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["plot_lookup", "plot_cold", "plot_e2e"]


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _cdf(ax, comps: dict, title: str) -> None:
    pct = np.linspace(0, 1, 101)
    for name, d in comps.items():
        q = d.get("latency_quantiles_ms")
        if q:
            ax.plot(q, pct, label=name)
    ax.set_xscale("log")
    from matplotlib.ticker import LogLocator, NullFormatter
    ax.xaxis.set_major_locator(LogLocator(base=10))
    ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels overlap on narrow decades
    ax.set_xlabel("batch latency (ms, log)")
    ax.set_ylabel("fraction of batches")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def plot_lookup(result: dict, path) -> Path:
    """Throughput bars per distribution, a latency CDF of the headline cell, and
    the cache-mode hit ratio per batch size."""
    plt = _plt()
    cells = result["cells"]
    dists = list(dict.fromkeys(c["dist"] for c in cells))
    batches = sorted({c["batch"] for c in cells})
    names = result["competitors"]
    n = len(dists) + 2
    ncols = min(3, n)
    nrows = -(-n // ncols)
    fig, grid = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 4.2 * nrows), squeeze=False)
    axes = list(grid.ravel())
    for extra in axes[n:]:
        extra.set_visible(False)
    axes = axes[:n]
    width = 0.8 / len(names)
    for ax, dist in zip(axes, dists):
        for j, name in enumerate(names):
            ys = [next((c["competitors"][name]["rows_per_s"] for c in cells
                        if c["dist"] == dist and c["batch"] == b and name in c["competitors"]), 0) for b in batches]
            ax.bar(np.arange(len(batches)) + j * width, ys, width, label=name)
        ax.set_xticks(np.arange(len(batches)) + 0.4 - width / 2, [str(b) for b in batches])
        ax.set_yscale("log")
        ax.set_xlabel("batch (ids per call)")
        ax.set_ylabel("throughput (rows/s, log)")
        ax.set_title(f"lookup, ids {dist}")
        ax.grid(True, axis="y", which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    head = headline(cells)
    _cdf(axes[len(dists)], head["competitors"], f"latency CDF, {head['dist']} b={head['batch']}")
    ax = axes[-1]
    for dist in dists:
        pts = [(c["batch"], c["competitors"]["arena-cache"].get("hit_ratio")) for c in cells
               if c["dist"] == dist and "arena-cache" in c["competitors"]]
        pts = [(b, h) for b, h in pts if h is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=dist)
    ax.set_xscale("log")
    ax.set_ylim(0, 1)
    ax.set_xlabel("batch (ids per call, log)")
    ax.set_ylabel("hit ratio (unique ids found in DRAM)")
    ax.set_title("arena-cache hit ratio (budget 10% of table)")
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_cold(result: dict, path) -> Path:
    """Steady-state and cold-start throughput bars, and the steady latency CDF."""
    plt = _plt()
    comps = result["competitors"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4.2))
    names = list(comps)
    steady = [comps[n]["rows_per_s"] for n in names]
    cold = [result["cold_start"].get(n, {}).get("rows_per_s", 0) for n in names]
    x = np.arange(len(names))
    a1.bar(x - 0.2, steady, 0.4, label="steady (after warm-up)")
    a1.bar(x + 0.2, cold, 0.4, label="cold start (page cache dropped)")
    a1.set_xticks(x, names)
    a1.set_yscale("log")
    a1.set_ylabel("throughput (rows/s, log)")
    a1.set_title(f"cold tier: table {result['table_bytes'] / 2**20:.0f} MiB, "
                 f"budget {result['dram_budget_bytes'] / 2**20:.0f} MiB")
    a1.grid(True, axis="y", which="both", alpha=0.3)
    a1.legend(fontsize=7)
    _cdf(a2, comps, f"steady latency CDF, {result['dist']} b={result['batch']}")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def headline(cells: list) -> dict:
    """The cell the one-line summary quotes: zipf1.0 at the batch nearest 32768."""
    pool = [c for c in cells if c["dist"] == "zipf1.0"] or cells
    return min(pool, key=lambda c: abs(np.log2(c["batch"]) - 15))


def plot_e2e(result: dict, path) -> Path:
    """Bars of the demo model's tokens/s per serving path, penalty vs in-process labelled."""
    plt = _plt()
    tps, pen = result["tokens_per_s"], result["penalty_pct"]
    names = list(tps)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    bars = ax.bar(names, [tps[n] for n in names], color=["#555"] + ["#3a7"] * (len(names) - 1))
    for b, n in zip(bars, names):
        ax.annotate(f"{pen[n]:+.1f}%", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                    fontsize=8)
    ax.set_ylabel("tokens/s (prefill + decode)")
    ax.set_title(f"e2e: demo model, batch {result['batch']} x {result['seq']} + {result['decode_tokens']} decode")
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
