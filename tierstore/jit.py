"""Compiled versions of the Plan path's small loops, with the numpy reference kept.

A Plan of a decode step (a few hundred ids) runs ~40 array operations: slot
lookup, pins, the sketch's conservative update, the policy's hit marks. Each
numpy call costs 1-5 µs of overhead before it touches a byte, so a step's
control path costs more than its data. One compiled loop per operation does
the same work in well under a µs per hundred ids.

`Kernel(fn)` wraps a plain-Python loop written for numba. `.compiled()` is the
numba function (compiled on first use, cached on disk), or None where numba is
missing or TIERSTORE_NO_JIT=1: callers then run their numpy path, which is
also the reference the tests compare with. Kernels keep the GIL (nogil off): a
call is microseconds, and releasing it would let another thread take it for a
switch interval (cpu_token.py).
"""
from __future__ import annotations

import os
import threading

__all__ = ["Kernel", "enabled"]

_LOCK = threading.Lock()
_UNSET = object()


def enabled() -> bool:
    """numba is importable and not switched off (TIERSTORE_NO_JIT=1)."""
    if os.environ.get("TIERSTORE_NO_JIT") == "1":
        return False
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


class Kernel:
    """A numba-compilable function, compiled lazily; `compiled()` is None without numba."""

    __slots__ = ("fn", "_jit")

    def __init__(self, fn):
        self.fn, self._jit = fn, _UNSET

    def compiled(self):
        if self._jit is _UNSET:
            with _LOCK:
                if self._jit is _UNSET:
                    if enabled():
                        import numba
                        self._jit = numba.njit(cache=True, boundscheck=False)(self.fn)
                    else:
                        self._jit = None
        return self._jit
