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

Work off the steps' path (the learner's notes, prefetch hints, a warm start, online
verification) takes the token as `background()`, one bounded chunk at a time, and
only once no plan waits for it: a plan that asks while a chunk runs computes as soon
as that chunk ends, so it waits for at most one chunk of background work, never for
a sequence of them (a plain lock would let the thread that releases it take it again
before the woken plan runs). Background work waits while plans keep arriving: it is
bookkeeping, and the steps come first.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

__all__ = ["hold", "background", "waiting"]

_TOKEN = threading.Lock()
_depth = threading.local()  # n: this thread's nested holds; behind: the outermost is background()
_plans = threading.Condition(threading.Lock())  # guards _waiting; notified when it drops to 0
_waiting = 0  # plans blocked on the token now (background work takes it only at 0)


def _take(behind: bool) -> None:
    """The token, for a plan (at once when free) or for background work (once no plan waits)."""
    global _waiting
    if behind:
        while True:
            with _plans:
                while _waiting:
                    _plans.wait()
            _TOKEN.acquire()
            if not _waiting:
                return
            _TOKEN.release()  # a plan began waiting meanwhile: it goes first
    elif not _TOKEN.acquire(blocking=False):  # the common case: free, and no bookkeeping here
        with _plans:
            _waiting += 1
        try:
            _TOKEN.acquire()
        finally:
            with _plans:
                _waiting -= 1
                if not _waiting:
                    _plans.notify_all()


@contextmanager
def _held(behind: bool):
    d = getattr(_depth, "n", 0)
    if d == 0:
        _take(behind)
        _depth.behind = behind
    _depth.n = d + 1
    try:
        yield
    finally:
        _depth.n = d
        if d == 0:
            _TOKEN.release()


def hold():
    """Run the block as this process's one computing plan (nested: a no-op)."""
    return _held(False)


def background():
    """Run one bounded chunk of work off the steps' path as the computing thread, once no plan
    waits for the token (nested in a hold: a no-op). Keep the chunk short: a plan that asks
    meanwhile waits for the rest of it."""
    return _held(True)


@contextmanager
def waiting():
    """Give the token up while the block waits on I/O or another thread (if held); take it
    back as it was taken (background work after the plans waiting by then)."""
    d = getattr(_depth, "n", 0)
    if d == 0:
        yield
        return
    _depth.n = 0
    _TOKEN.release()
    try:
        yield
    finally:
        _take(_depth.behind)
        _depth.n = d
