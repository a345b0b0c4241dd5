"""Hit rates per id class: a learned prior of how likely a row of one part of the table is
to be read again.

An Engram layer's table concatenates its (order n, head) sub-tables at offsets
(tierstore/table/spec.py), so a row id says which sub-table the row is in, and
low orders recur far more than high ones (a 2-gram comes back where a 4-gram
is read once). A generic policy treats every miss alike; this one splits the
ids into `bins` equal ranges (classes: about a sub-table each when there are
more bins than sub-tables, and harmless on a table with no such layout, whose
classes all read alike) and keeps, per class, the accesses and hits of the
recent steps, each step's counts weighing `decay` times the last's.

`weak(ids, ratio)` says which ids belong to a class hit less than `ratio` times
the whole table's rate: the policy asks such a miss for one more sketch count
before it enters the main queue directly, and sends one of a class weaker still,
seen for the first time, out first (s3fifo.py). State: two float arrays
of `bins`, whatever the table's size; every call is O(its ids), vectorised.
"""
from __future__ import annotations

import numpy as np

__all__ = ["ClassHitRates"]


class ClassHitRates:
    """Recent accesses and hits of each of `bins` equal id ranges of a table of `n_ids` rows."""

    def __init__(self, n_ids: int, bins: int, decay: float):
        self.bins = max(1, min(int(bins), int(n_ids)))
        self.n_ids, self.decay = int(n_ids), float(decay)
        self.accesses = np.zeros(self.bins)
        self.hits = np.zeros(self.bins)

    def classes(self, ids: np.ndarray) -> np.ndarray:
        """The class of each id (its range of the table), int64."""
        return ids.astype(np.int64) * self.bins // self.n_ids

    def accessed(self, ids: np.ndarray) -> None:
        """One step's ids (the step before weighs `decay` less from now on)."""
        self.accesses *= self.decay
        self.hits *= self.decay
        self.accesses += np.bincount(self.classes(ids), minlength=self.bins)

    def hit(self, ids: np.ndarray) -> None:
        """Ids of this step that were resident (negative ones, free slots, are skipped)."""
        ids = ids[ids >= 0]
        if ids.size:
            self.hits += np.bincount(self.classes(ids), minlength=self.bins)

    def weak(self, ids: np.ndarray, ratio: float) -> np.ndarray:
        """Which ids' classes are hit less than `ratio` times the table's rate (none before
        any hit is seen)."""
        total = self.accesses.sum()
        if not total:
            return np.zeros(ids.size, bool)
        rate = self.hits / np.maximum(self.accesses, 1e-12)
        return (rate < ratio * self.hits.sum() / total)[self.classes(ids)]

    def arrays(self) -> list[np.ndarray]:
        return [self.accesses, self.hits]
