"""The sidecar's plans compute one at a time, and wait side by side.

Plans arrive on many threads (one per step-socket connection, the gRPC workers,
the prefetch pool) that share one GIL. A plan is Python and numpy dotted with
GIL releases (a numpy pass, a stat, a lock); with several plans runnable, each
release hands the GIL to another plan and the first then waits up to a switch
interval (sys.getswitchinterval()) to get it back, so a plan that computes for
less than one interval is stretched over several of them, and more clients serve
fewer rows in all (docs/decisions.md, "Plans compute one at a time").

So a plan holds this token while it computes and gives it up only where it
waits for something outside the process (reads in flight on the device, the
remote store, another plan's fill): a plan waiting on the disk never holds up
the plans whose rows are in DRAM. Re-entrant per thread; never held while a
thread waits for the token's holder.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

__all__ = ["hold", "waiting"]

_TOKEN = threading.Lock()
_depth = threading.local()


@contextmanager
def hold():
    """Run the block as this process's one computing plan (nested: a no-op)."""
    d = getattr(_depth, "n", 0)
    if d == 0:
        _TOKEN.acquire()
    _depth.n = d + 1
    try:
        yield
    finally:
        _depth.n = d
        if d == 0:
            _TOKEN.release()


@contextmanager
def waiting():
    """Give the token up while the block waits on I/O or another thread (if held)."""
    d = getattr(_depth, "n", 0)
    if d == 0:
        yield
        return
    _depth.n = 0
    _TOKEN.release()
    try:
        yield
    finally:
        _TOKEN.acquire()
        _depth.n = d
