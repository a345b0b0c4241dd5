"""Id workloads for the storage benchmarks: Zipf or uniform over a table's rows, and
the options every scenario shares (BenchOptions: its size, the seed of its ids).

Hashed n-gram ids are Zipf-distributed by frequency but scattered over the row
space (the hash spreads neighbours apart), so ranks are mapped to ids through a
fixed random permutation: the hot rows are not a contiguous prefix that a page
cache or readahead would get for free.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

__all__ = ["parse_dist", "make_batches", "BenchOptions"]


@dataclass(slots=True)
class BenchOptions:
    """What every scenario's options dataclass shares (cold, lookup, large and warm subclass
    it; `tierstore bench` builds one from the flags whose dest is a field's name).

    A field the caller left unset (None or 0) takes its default from DEFAULTS, a
    (full run, --quick) pair a field; then `validate()` refuses what the scenario cannot
    run (InvalidArgument naming the flag), before anything is written or started."""

    quick: bool = False     # small sizes (about a minute)
    seed: int = 0           # of every id stream
    progress: bool = True   # progress bars on stderr

    DEFAULTS: ClassVar[dict] = {}

    def __post_init__(self):
        for name, (full, quick) in self.DEFAULTS.items():
            if not getattr(self, name):
                setattr(self, name, quick if self.quick else full)
        self.validate()

    def validate(self) -> None:
        """InvalidArgument for a value the scenario cannot run; nothing here."""


def parse_dist(text: str) -> float | None:
    """'zipf1.0' -> 1.0, 'uniform' -> None; ValueError naming the accepted forms."""
    t = text.strip().lower()
    if t == "uniform":
        return None
    if t.startswith("zipf"):
        try:
            alpha = float(t[4:])
        except ValueError:
            alpha = -1.0
        if alpha > 0:
            return alpha
    raise ValueError(f"unknown id distribution {text!r}; use 'uniform' or 'zipf<alpha>' such as zipf0.8, zipf1.2")


def make_batches(dist: str, rows: int, batch: int, n_batches: int, seed: int = 0,
                 hot_seed: int | None = None) -> list[np.ndarray]:
    """`n_batches` int64 arrays of `batch` ids in [0, rows), same seed same ids.

    hot_seed picks which ids are popular (the rank -> id permutation; default:
    `seed`). Workers of one model share it: the same n-grams are hot for all of
    them, only the samples differ.

    Zipf(alpha) over ranks 1..rows is sampled by inverting its exact CDF (valid
    for any alpha > 0, unlike numpy's zipf which needs alpha > 1).
    """
    alpha = parse_dist(dist)
    rng = np.random.default_rng([seed, rows, batch, int((alpha or 0) * 1000)])
    total = batch * n_batches
    if alpha is None:
        ids = rng.integers(0, rows, size=total, dtype=np.int64)
    else:
        cdf = np.cumsum(np.arange(1, rows + 1, dtype=np.float64) ** -alpha)
        cdf /= cdf[-1]
        ranks = np.minimum(np.searchsorted(cdf, rng.random(total)), rows - 1)
        perm = rng.permutation(rows) if hot_seed is None else np.random.default_rng([hot_seed, rows]).permutation(rows)
        ids = perm.astype(np.int64)[ranks]
    return list(ids.reshape(n_batches, batch))
