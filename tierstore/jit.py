"""Compiled versions of the Plan path's small loops, with the numpy reference kept.

A Plan of a decode step (a few hundred ids) runs dozens of small array
operations: finding slots, pins, the sketch's conservative update, the policy's
hit marks. Each numpy call pays a fixed dispatch cost before it touches a byte,
and at a few hundred ids that cost, not the data, is most of a step's control
path. One compiled loop per operation pays it once (docs/decisions.md,
"Compiled Plan loops").

`Kernel(fn)` wraps a plain-Python loop written for numba. `.compiled()` is the
numba function (compiled on first use, cached on disk), or None where numba is
missing or TIERSTORE_NO_JIT=1: callers then run their numpy path, which is
also the reference the tests compare with. Kernels keep the GIL (nogil off): a
call is far shorter than a switch interval, and releasing it would let another
thread take it for one (cpu_token.py). Bulk kernels that run for milliseconds over a
whole chunk (ingest's row sums) ask for `Kernel(fn, nogil=True)` instead, so the
other stages of a pipeline run meanwhile.
"""
from __future__ import annotations

import os
import threading

import numpy as np

__all__ = ["Kernel", "inlined", "compiler_barrier", "enabled", "first_outside", "strictly_increasing", "distinct",
           "unique_inverse", "mix64"]

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


def inlined(fn):
    """A helper the compiled loops call: numba compiles it into its caller (register_jitable);
    it stays the plain function it was, so the interpreted loops call it as it is."""
    try:
        from numba.extending import register_jitable
    except ImportError:
        return fn
    return register_jitable(fn)


@inlined
def mix64(z):
    """splitmix64's finaliser of uint64 `z`: a uint64 array, or a scalar in a compiled loop
    (uint64 arithmetic wraps). Callers add their own step first (the golden gamma)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def compiler_barrier() -> None:
    """In a compiled loop: no load or store is moved across this point by the compiler (an
    empty asm statement that clobbers memory, `asm volatile("" ::: "memory")`); no
    instruction is emitted. The hardware's order is the caller's to rely on (x86-64
    keeps loads in program order: cache/slot_index.py's reader). Interpreted: a no-op,
    Python runs statements in order."""


_BARRIER_REGISTERED = False


def _register_barrier() -> None:
    """compiler_barrier's compiled form, registered before the first kernel compiles (numba
    is imported only then)."""
    global _BARRIER_REGISTERED
    if _BARRIER_REGISTERED:
        return
    _BARRIER_REGISTERED = True
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic, overload

    @intrinsic
    def _barrier(typingctx):
        def codegen(context, builder, signature, args):
            builder.asm(ir.FunctionType(ir.VoidType(), []), "", "~{memory}", [], True)
            return context.get_dummy_value()
        return types.void(), codegen

    @overload(compiler_barrier)
    def _compiled():
        return lambda: _barrier()


class Kernel:
    """A numba-compilable function, compiled lazily; `compiled()` is None without numba."""

    __slots__ = ("fn", "_jit", "_nogil")

    def __init__(self, fn, *, nogil: bool = False):
        self.fn, self._jit, self._nogil = fn, _UNSET, nogil

    def compiled(self):
        if self._jit is _UNSET:
            with _LOCK:
                if self._jit is _UNSET:
                    if enabled():
                        import numba
                        _register_barrier()
                        self._jit = numba.njit(cache=True, boundscheck=False, nogil=self._nogil)(self.fn)
                    else:
                        self._jit = None
        return self._jit


def _first_outside_loop(ids, n):
    for i in range(ids.shape[0]):
        if ids[i] < 0 or ids[i] >= n:
            return i
    return -1


_FIRST_OUTSIDE = Kernel(_first_outside_loop)


def first_outside(ids: np.ndarray, n: int) -> int:
    """Index of the first id outside [0, n), or -1: one pass, no temporaries (int64 ids)."""
    k = _FIRST_OUTSIDE.compiled()
    if k is not None and ids.dtype == np.int64:
        return int(k(ids, n))
    bad = (ids < 0) | (ids >= n)
    return int(np.argmax(bad)) if bad.any() else -1


def _increasing_loop(ids):
    for i in range(1, ids.shape[0]):
        if ids[i] <= ids[i - 1]:
            return False
    return True


_INCREASING = Kernel(_increasing_loop)


def strictly_increasing(ids: np.ndarray) -> bool:
    """ids sorted with no repeats (a step the client already deduplicated)."""
    k = _INCREASING.compiled()
    if k is not None and ids.dtype == np.int64 and ids.ndim == 1:
        return bool(k(ids))
    return ids.size < 2 or bool((ids[1:] > ids[:-1]).all())


def _distinct_loop(ids, table, out):
    mask, n = table.shape[0] - 1, 0
    for i in range(ids.shape[0]):
        x = ids[i]
        h = (np.uint64(x) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)
        j = np.int64(h) & mask
        while True:
            t = table[j]
            if t == x:
                break
            if t == -1:
                table[j] = x
                out[n] = x
                n += 1
                break
            j = (j + 1) & mask
    return n


_DISTINCT = Kernel(_distinct_loop)


def distinct(ids: np.ndarray) -> np.ndarray:
    """The distinct ids of non-negative int64 `ids`: in first-seen order when compiled
    (one hashed pass, O(n)), sorted by the numpy reference."""
    k = _DISTINCT.compiled()
    if k is None or ids.dtype != np.int64:
        return np.unique(ids)
    size = 1 << max(4, int(2 * ids.size - 1).bit_length())  # load <= 1/2
    out = np.empty_like(ids)
    return out[:k(ids, np.full(size, -1, dtype=np.int64), out)]


def _unique_inverse_loop(ids):
    """np.unique(ids, return_inverse=True) by hashing first: only the distinct
    ids are sorted (a Zipf step repeats its hot ids many times)."""
    n = ids.shape[0]
    size = 16
    while size < 2 * n:
        size <<= 1
    mask = size - 1
    table = np.full(size, -1, np.int64)  # open addressing: index into uniq
    uniq = np.empty(n, np.int64)
    inv = np.empty(n, np.int64)
    m = 0
    for i in range(n):
        x = ids[i]
        h = np.int64((np.uint64(x) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)) & mask
        while True:
            t = table[h]
            if t < 0:
                table[h] = m
                uniq[m] = x
                inv[i] = m
                m += 1
                break
            if uniq[t] == x:
                inv[i] = t
                break
            h = (h + 1) & mask
    u = uniq[:m]
    order = np.argsort(u)
    rank = np.empty(m, np.int64)
    for j in range(m):
        rank[order[j]] = j
    for i in range(n):
        inv[i] = rank[inv[i]]
    return u[order], inv


_UNIQUE = Kernel(_unique_inverse_loop)


def unique_inverse(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct ids, index of each id in them): np.unique(ids, return_inverse=True)."""
    k = _UNIQUE.compiled()
    if k is not None and ids.dtype == np.int64 and ids.ndim == 1:
        return k(ids)
    uniq, inv = np.unique(ids, return_inverse=True)
    return uniq, inv.reshape(-1)
