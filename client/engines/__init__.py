"""Engines served by tierstore: the serving stacks users already run, fed from the sidecar.

sglang.py: sglang 0.5.23's Engram host tables are tierstore's split arenas (a
general plugin of sglang, `tierstore sglang -- ARGS`); sglang_stager.py: its
tables larger than RAM, each batch's rows staged from the cache-mode sidecar
ahead of the forward. vllm_plugin.py: vLLM's; vllm_stager.py: its tables
larger than RAM, each lookup's rows read through the client. checks.py: the
versions and settings each plugin serves; seams.py: every name of each supported
engine version's code the plugins touch, checked when the engine loads them.
Nothing here forks or copies an engine; each module says which seam it uses.
"""
from tierstore import errors

__all__ = ["StagingError"]


class StagingError(errors.TierstoreError):
    """tierstore cannot stage an engine's Engram rows: a read failed, the table is now served at
    another version, or the engine runs in a way the stager does not serve (the message says how)."""

    GRPC_CODE = "FAILED_PRECONDITION"
