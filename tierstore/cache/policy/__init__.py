"""Which arena slots to evict: the DRAM cache policy, batched (one call per step).

`make_policy(capacity, n_ids, PolicyConfig(kind=...))` builds the policy of that
kind: "s3fifo" (ours: S3-FIFO's queues with a TinyLFU sketch, s3fifo.py), "lru"
and "random" (references, reference.py). base.py holds the interface the engine
drives; sketch.py the frequency sketch; config.py the validated knobs.
"""
from tierstore.cache.policy.base import CachePolicy, NotEnoughEvictable
from tierstore.cache.policy.config import KINDS, PolicyConfig
from tierstore.cache.policy.reference import LRUPolicy, RandomPolicy
from tierstore.cache.policy.s3fifo import S3FIFOPolicy

__all__ = ["make_policy", "CachePolicy", "PolicyConfig", "NotEnoughEvictable", "S3FIFOPolicy", "LRUPolicy",
           "RandomPolicy", "POLICIES"]

POLICIES: dict[str, type[CachePolicy]] = {cls.kind: cls for cls in (S3FIFOPolicy, LRUPolicy, RandomPolicy)}
assert set(POLICIES) == set(KINDS)


def make_policy(capacity: int, n_ids: int, config: PolicyConfig | None = None, slot_id=None) -> CachePolicy:
    """The policy `config.kind` names (PolicyConfig() when None: ours), over `capacity` slots
    of a table of `n_ids` rows; slot_id: the slot -> id map to share (the engine's slot table)."""
    config = config or PolicyConfig()
    return POLICIES[config.kind](capacity, n_ids, config, slot_id)
