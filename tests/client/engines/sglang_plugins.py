"""sglang's own plugin loading, run by the sglang tests (shared by them).

`loaded(**env)` runs sglang's `load_plugins()` -- entry points of group
`sglang.srt.plugins` (tierstore's `plugin`, as pyproject.toml registers it),
then `HookRegistry.apply_hooks()` -- with `env` set, as every sglang process
runs it at start. load_plugins runs once a process; the tests run it once per
case, so its guard is lowered first. Hooks stay applied for the process (each
is a no-op without TIERSTORE_SGLANG_SOCKET); on exit `env` and the host-table
flags the plugin sets are removed.
"""
from __future__ import annotations

import contextlib
import os

HOST_TABLE_VARS = ("SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE", "SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT")


@contextlib.contextmanager
def loaded(**env):
    import sglang.srt.plugins as plugins

    before = {k: os.environ.get(k) for k in (*env, *HOST_TABLE_VARS)}
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        plugins._plugins_loaded = False
        plugins.load_plugins()
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
