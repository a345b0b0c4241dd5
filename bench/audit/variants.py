"""What a path changes against the reference: compute dtype, thread count, environment, an HBM cache
in front of the source, rows re-encoded in another format."""
from __future__ import annotations

import os
from contextlib import contextmanager

import numpy as np
import torch

from tierstore.bench.audit.outputs import engram_layers

__all__ = ["threads", "env", "bf16_engram", "bf16_model", "add_hbm_cache", "reencoded_table"]

@contextmanager
def threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)

@contextmanager
def env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

def bf16_engram(model) -> None:
    for layer in engram_layers(model).values():
        layer.to(torch.bfloat16)
        layer.compute_dtype = torch.bfloat16

def bf16_model(model) -> None:
    model.to(torch.bfloat16)
    bf16_engram(model)

def add_hbm_cache(model, hot_ids):
    """Put an HBM cache (a CPU tensor here) seeded with half of `hot_ids(table)` before each layer's
    source; returns a callable that describes the hits."""
    from tierstore.client.model.hbm_cache import HBMCache

    caches = []
    for layer in engram_layers(model).values():
        hot = hot_ids(layer.table)
        cap = max(1, hot.size // 2)
        layer.hbm_cache = HBMCache.from_source(layer.source, layer.table, cap, "cpu", hot_ids=hot)
        caches.append(layer.hbm_cache)

    def note():
        hits = sum(c.hits for c in caches)
        total = max(1, hits + sum(c.misses for c in caches))
        return (f"HBM cache (CPU tensor) seeded with half of the rows read, hottest first: "
                f"{100 * hits / total:.0f}% of rows from the cache, the rest from the sidecar")
    return note

def reencoded_table(source, spec, stored, fmt: str):
    """An InProcessTable holding every table of `source` re-encoded from `stored` to `fmt`; also the largest
    change of a row value."""
    from tierstore.client.model.in_process_table import InProcessTable
    from tierstore.table.formats import decode_rows, encode_rows

    worst = 0.0
    table = InProcessTable(spec)
    for t in source.tables():
        values = decode_rows(source.rows(t).numpy(), stored, spec.row_dim)
        rows = encode_rows(values, fmt)
        worst = max(worst, float(np.abs(decode_rows(rows, fmt, spec.row_dim) - values).max()))
        table.add(t, rows, row_format=fmt, row_dim=spec.row_dim)
    return table, worst
