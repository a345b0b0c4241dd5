"""Engines: one per served table version. The base (base.py) holds what both modes
share; FullEngine (full.py) serves a table held whole in the arena, CacheEngine
(cache.py) one whose arena caches a share of its rows. Beside serving, each engine
has its prefetch hints (hints.py) and its repairs (repair.py, with the bad-block
marks of bad_blocks.py); a cache-mode one its access notes (notes.py) and its hot
set (hot_set.py). The verifier
(verifier.py) re-checks served rows off the hot path. `make_engine` picks the mode.
"""
from tierstore.engine.base import Counters, Placement, TableEngine
from tierstore.engine.cache import CacheEngine
from tierstore.engine.full import FullEngine

__all__ = ["make_engine", "TableEngine", "FullEngine", "CacheEngine", "Placement", "Counters"]


def make_engine(version, reader, arena, *, leases, full: bool, recorder=None, **cache_mode) -> TableEngine:
    """The engine of one served version: FullEngine when the whole table sits in
    `arena` (slot == id), else CacheEngine with `cache_mode`'s arguments
    (policy_config, profile, index_path, instance; see CacheEngine)."""
    if full:
        if cache_mode:
            raise TypeError(f"a full-resident engine takes no cache-mode arguments, got {sorted(cache_mode)}")
        return FullEngine(version, reader, arena, leases=leases, recorder=recorder)
    return CacheEngine(version, reader, arena, leases=leases, recorder=recorder, **cache_mode)
