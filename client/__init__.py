"""tierstore.client: what model code imports.

Client (the sidecar), LocalTable (in-process table), NgramHasher (Engram
hashing), EngramLayer / attach_engram (the model side), HBMCache, and the
spec presets (EngramSpec, NgramHasher live in the core: tierstore.spec,
tierstore.hasher). Imports are lazy so `import tierstore.client` stays light.
"""
from importlib import import_module

_EXPORTS = {
    "Client": "sidecar", "StepPlan": "step_plan",
    "LocalTable": "local",
    "NgramHasher": "tierstore.hasher", "DecodeState": "tierstore.hasher",
    "EngramLayer": "layer", "V41EngramLayer": "v41_layer", "attach_engram": "attach", "engram_decode_step": "attach", "HBMCache": "hbm_cache",
    "EngramDemoModel": "demo_model",
    "EngramSpec": "tierstore.spec", "preset": "tierstore.spec", "PRESETS": "tierstore.spec",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        mod = _EXPORTS[name]
        return getattr(import_module(mod if "." in mod else f"tierstore.client.{mod}"), name)
    raise AttributeError(f"module 'tierstore.client' has no attribute {name!r}")
