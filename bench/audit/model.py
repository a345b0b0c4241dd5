"""The audited model: built from a factory (or the demo model), fed Zipf tokens, its plans recorded."""
from __future__ import annotations

import importlib

import numpy as np
import torch

from tierstore.client.model.source import RowSource
from tierstore.errors import InvalidArgument

__all__ = ["RecordingSource", "load_factory", "make_builder", "audit_tokens"]

class RecordingSource(RowSource):
    """A RowSource wrapper that remembers the ids each plan asked for (hot ids, step sizes)."""

    def __init__(self, source):
        self.source, self.asked = source, {}

    def plan(self, table, ids):
        self.asked.setdefault(table, []).append(np.asarray(ids, dtype=np.int64).reshape(-1).copy())
        return self.source.plan(table, ids)

    def table_info(self, table):
        return self.source.table_info(table)

    def largest_plan(self, table) -> int:
        """Distinct ids of the largest plan of `table`: the slots its lease holds."""
        return max((np.unique(a).size for a in self.asked.get(table, [])), default=0)

    def hot_ids(self, table) -> np.ndarray:
        """Ids asked for, most steps first (ties by id)."""
        if not self.asked.get(table):
            return np.zeros(0, np.int64)
        u, c = np.unique(np.concatenate(self.asked[table]), return_counts=True)
        return u[np.argsort(-c, kind="stable")]

def load_factory(module: str):
    """'pkg.mod:factory' -> the callable."""
    mod, _, name = module.partition(":")
    if not name:
        raise InvalidArgument(f"--module {module!r}: write it as package.module:factory")
    try:
        return getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise InvalidArgument(f"--module {module!r}: {e}; the factory must be importable") from None

def make_builder(data_dir, module: str | None, model_kwargs: dict):
    """source -> model in eval mode: the demo model (weights from model_kwargs['seed']) or a user factory."""
    if module:
        factory = load_factory(module)
        return lambda source: factory(source, **model_kwargs).eval()  # kwargs: e.g. --checkpoint DIR
    from tierstore.bench.e2e import spec_from_catalog
    from tierstore.client.model.demo_model import EngramDemoModel

    spec = spec_from_catalog(data_dir)
    return lambda source: EngramDemoModel(spec, source, **model_kwargs).eval()

def audit_tokens(vocab: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """Zipf-distributed token ids [batch, seq] (text-like repeats), fixed by `seed`."""
    g = torch.Generator().manual_seed(seed)
    p = torch.arange(1, vocab + 1, dtype=torch.float64) ** -1.1
    return torch.multinomial(p / p.sum(), batch * seq, replacement=True, generator=g).reshape(batch, seq)

