"""tierstore.client: what model code imports.

Talking to a sidecar: Client (client.py), the StepPlan a plan returns
(step_plan.py) and RowScratch, a buffer lookup(out=) reads into step after step
(row_scratch.py). The model side (model/): EngramLayer, V41EngramLayer,
attach_engram, HBMCache, InProcessTable (a table held in process) and the demo
model. Hashing and specs are the table's (tierstore.table: NgramHasher,
EngramSpec, preset), listed here because model code needs them with the rest.
Imports are lazy so `import tierstore.client` stays light.
"""
from importlib import import_module

_EXPORTS = {
    "Client": "tierstore.client.client", "StepPlan": "tierstore.client.step_plan",
    "SplitTable": "tierstore.client.split_table", "RowScratch": "tierstore.client.row_scratch",
    "InProcessTable": "tierstore.client.model.in_process_table", "EngramLayer": "tierstore.client.model.layer",
    "V41EngramLayer": "tierstore.client.model.v41_layer", "attach_engram": "tierstore.client.model.attach",
    "engram_decode_step": "tierstore.client.model.attach", "HBMCache": "tierstore.client.model.hbm_cache",
    "EngramDemoModel": "tierstore.client.model.demo_model",
    "NgramHasher": "tierstore.table.hasher", "DecodeState": "tierstore.table.hasher",
    "EngramSpec": "tierstore.table.spec", "preset": "tierstore.table.spec", "PRESETS": "tierstore.table.spec",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tierstore.client' has no attribute {name!r}")
