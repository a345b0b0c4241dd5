"""Which arena slots to evict: the DRAM cache policy, batched (one call per step).

`CachePolicy(capacity, n_ids, PolicyConfig(kind=...))` builds the registered
class of that kind: "tinylfu" (ours, tinylfu.py), "lru" and "random"
(references, reference.py). base.py holds the interface the engine drives.
"""
from tierstore.policy.base import REGISTRY, CachePolicy, NotEnoughEvictable
from tierstore.policy.config import KINDS, PolicyConfig
from tierstore.policy.reference import LRUPolicy, RandomPolicy
from tierstore.policy.tinylfu import TinyLFUPolicy

__all__ = ["CachePolicy", "PolicyConfig", "NotEnoughEvictable", "TinyLFUPolicy", "LRUPolicy", "RandomPolicy",
           "REGISTRY"]

REGISTRY.update({cls.kind: cls for cls in (TinyLFUPolicy, LRUPolicy, RandomPolicy)})
assert set(REGISTRY) == set(KINDS)
