"""Engines: one per served table version (base.py), full (full.py) or cache mode (cache.py)."""
from tierstore.engine.base import Counters, PlanResult, TableEngine
from tierstore.engine.cache import CacheEngine
from tierstore.engine.full import FullEngine

__all__ = ["TableEngine", "FullEngine", "CacheEngine", "PlanResult", "Counters"]
