"""tierstore.client: what model code imports.

Client (the sidecar), LocalTable (in-process table), NgramHasher (Engram
hashing), EngramLayer / attach_engram (the model side), HBMCache, and the
spec presets. Imports are lazy so `tierstore.client.spec` stays light.
"""
from importlib import import_module

_EXPORTS = {
    "Client": "sidecar", "StepPlan": "sidecar",
    "LocalTable": "local",
    "NgramHasher": "hasher", "DecodeState": "hasher",
    "EngramLayer": "layer", "V41EngramLayer": "v41_layer", "attach_engram": "attach", "engram_decode_step": "attach", "HBMCache": "hbm_cache",
    "EngramDemoModel": "demo_model",
    "EngramSpec": "spec", "preset": "spec", "PRESETS": "spec",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f"tierstore.client.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'tierstore.client' has no attribute {name!r}")
