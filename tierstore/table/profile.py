"""Offline frequency profiles: which Engram rows a token trace reads most.

Addresses depend on token ids only, so a profile computed from a sample of
real traffic predicts the hot rows of every layer before serving starts. The
sidecar seeds its cache policy with it (`tierstore serve --profile`) and a
worker seeds its HBM cache (`HBMCache.from_source(..., hot_ids=profile.hot(table))`).

File format (.npz): for each table T, arrays `T.ids` (int64, hottest first)
and `T.counts` (int64), plus `meta` (JSON: spec, tokens profiled, source).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tierstore.table.hasher import NgramHasher
from tierstore import bounded_json
from tierstore.table.spec import MAX_SPEC_JSON_BYTES, EngramSpec
from tierstore.errors import InvalidArgument

__all__ = ["Profile", "build_profile"]


@dataclass
class Profile:
    spec: EngramSpec
    ids: dict[str, np.ndarray] = field(default_factory=dict)     # table -> int64 ids, hottest first
    counts: dict[str, np.ndarray] = field(default_factory=dict)  # table -> int64 counts
    tokens: int = 0

    def hot(self, table: str, k: int | None = None) -> np.ndarray:
        if table not in self.ids:
            raise InvalidArgument(f"profile has no table {table!r}; it has {sorted(self.ids)}")
        return self.ids[table][:k]

    def save(self, path) -> Path:
        path = Path(path)
        arrays = {}
        for t in self.ids:
            arrays[f"{t}.ids"], arrays[f"{t}.counts"] = self.ids[t], self.counts[t]
        meta = json.dumps({"spec": self.spec.to_dict(), "tokens": self.tokens})
        np.savez_compressed(path, meta=np.frombuffer(meta.encode(), dtype=np.uint8), **arrays)
        return path if path.suffix == ".npz" else path.with_suffix(path.suffix + ".npz")

    @classmethod
    def load(cls, path) -> "Profile":
        try:
            z = np.load(path, allow_pickle=False)
            meta = bounded_json.loads(bytes(z["meta"]), max_bytes=MAX_SPEC_JSON_BYTES)
        except (OSError, KeyError, ValueError) as e:
            raise InvalidArgument(f"{path} is not a tierstore profile ({e}); make one with `tierstore profile`") from None
        prof = cls(EngramSpec.from_dict(meta["spec"]), tokens=int(meta["tokens"]))
        for key in z.files:
            if key.endswith(".ids"):
                t = key[:-4]
                prof.ids[t], prof.counts[t] = z[key], z[f"{t}.counts"]
        return prof


def build_profile(spec: EngramSpec, sequences, *, hasher: NgramHasher | None = None, top: int | None = None,
                  raw: bool = False) -> Profile:
    """Count row reads over `sequences` (iterable of int token-id arrays [T] or [B, T]).

    raw: ids are raw tokenizer ids, mapped through the hasher's compression map.
    top: keep only the `top` hottest rows per table (all when None).
    """
    hasher = hasher or NgramHasher(spec)
    totals: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    tokens = 0
    for seq in sequences:
        arr = np.asarray(seq)
        arr = arr.reshape(1, -1) if arr.ndim == 1 else arr
        if raw:
            arr = hasher.map_raw(arr)
        tokens += arr.size
        for layer, rows in hasher.hash_all(arr).items():
            u, c = np.unique(rows, return_counts=True)
            if layer in totals:  # merge with what earlier sequences counted
                pu, pc = totals[layer]
                allu = np.concatenate([pu, u])
                uu, inv = np.unique(allu, return_inverse=True)
                u, c = uu, np.bincount(inv, weights=np.concatenate([pc, c])).astype(np.int64)
            totals[layer] = (u, c)
    prof = Profile(spec, tokens=tokens)
    for layer, (u, c) in totals.items():
        order = np.lexsort((u, -c))[:top]  # hottest first, ties by id: deterministic
        t = spec.table_name(layer)
        prof.ids[t], prof.counts[t] = u[order], c[order]
    return prof
