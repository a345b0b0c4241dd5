"""Hashing throughput: tierstore's NgramHasher against plain numpy, side by side.

`plain_numpy_hash` is the straightforward implementation of the formula that a
reader of DESIGN.md §2 would write (np.pad shifts, a loop over orders and
heads, `%`); it is the competitor, and a second implementation to check ours by.
"""
from __future__ import annotations

import time

import numpy as np

from tierstore.table.hasher import NgramHasher
from tierstore.table.spec import EngramSpec
from tierstore.table.spec import preset as get_preset

__all__ = ["plain_numpy_hash", "run_hash_bench"]


def plain_numpy_hash(spec: EngramSpec, ids: np.ndarray, layer_id: int, pad: int | None = None) -> np.ndarray:
    """Row ids int64 [B, T, columns] for compressed ids [B, T], no tricks."""
    pad = spec.pad_id if pad is None else pad
    m, primes, offsets = spec.multipliers(layer_id), spec.primes(layer_id), spec.offsets(layer_id)
    ids = np.asarray(ids, dtype=np.int64)
    B, T = ids.shape
    shifted = [ids] + [np.pad(ids, ((0, 0), (i, 0)), constant_values=pad)[:, :T]
                       for i in range(1, spec.max_ngram)]
    out = np.empty((B, T, spec.columns), np.int64)
    c = 0
    for n in range(2, spec.max_ngram + 1):
        mix = shifted[0] * m[0]
        for i in range(1, n):
            mix = mix ^ (shifted[i] * m[i])
        for _ in range(spec.n_heads):
            out[..., c] = mix % primes[c] + offsets[c]
            c += 1
    return out


def _best_of(fn, repeats: int) -> float:
    fn()  # warm-up: page faults, thread start
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run_hash_bench(batch: int = 64, seq: int = 4096, preset: str = "deepseek-v4.1-flash",
                   repeats: int = 5, seed: int = 0, layer_id: int | None = None,
                   threads: int = 1) -> dict:
    """Hash a random [batch, seq] batch of compressed ids for one layer, both ways.

    Timings are best-of-`repeats` after one warm-up, interleaved per repeat so
    both see the same machine load. Returns tokens/s of each, their ratio
    (tierstore / plain; > 1 means tierstore is faster) and whether outputs agree.
    `tierstore_reuse_out` times the hasher filling a preallocated output, as a
    model does step after step.
    """
    spec = get_preset(preset)
    layer = spec.layer_ids[0] if layer_id is None else layer_id
    ids = np.random.default_rng(seed).integers(0, spec.compressed_vocab_size, size=(batch, seq), dtype=np.int64)
    hasher = NgramHasher(spec, threads=threads)
    out = np.empty((batch, seq, spec.columns), np.int64)
    try:
        same = bool(np.array_equal(hasher.hash(ids, layer), plain_numpy_hash(spec, ids, layer)))
        times = {"plain_numpy": [], "tierstore": [], "tierstore_reuse_out": []}
        runs = {"plain_numpy": lambda: plain_numpy_hash(spec, ids, layer),
                "tierstore": lambda: hasher.hash(ids, layer),
                "tierstore_reuse_out": lambda: hasher.hash(ids, layer, out=out)}
        for _ in range(repeats):
            for name, fn in runs.items():
                times[name].append(_best_of(fn, 1))
    finally:
        hasher.close()
    tokens = batch * seq
    result = {"preset": preset, "layer": layer, "batch": batch, "seq": seq, "columns": spec.columns,
              "threads": threads, "repeats": repeats, "outputs_equal": same}
    for name, ts in times.items():
        result[f"{name}_s"] = min(ts)
        result[f"{name}_tokens_per_s"] = tokens / min(ts)
    result["speedup"] = result["tierstore_tokens_per_s"] / result["plain_numpy_tokens_per_s"]
    result["speedup_reuse_out"] = result["tierstore_reuse_out_tokens_per_s"] / result["plain_numpy_tokens_per_s"]
    return result


if __name__ == "__main__":
    import json
    print(json.dumps(run_hash_bench(), indent=1))
