"""One read of a step's rows for every staged Engram layer, and the hint of a queued request's
rows: the stagers' way to the client.

An engine's stager knows every layer's ids before the forward (they are hashes
of the step's tokens), so it asks for all its layers' rows at once, through
Client.lookup_many: under `serve --direct-io` a step's tables are then read
overlapped (one table's misses in flight while the next table's hits are
copied, one ring a table), where reading them layer by layer drains the device's
queue between layers (V4.1 has two Engram layers: bench large reads its two
tables this way too). The stagers read each layer into a RowScratch of its own
(client/row_scratch.py), reused step after step.
"""
from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from tierstore import errors
from tierstore.client.engines import StagingError

__all__ = ["read_step", "read_layers", "read_now", "check_behind", "prefetch_layers", "queued_hint", "BEHIND",
           "PREFETCH_TOKENS", "READ_AHEAD_STEPS"]

log = logging.getLogger("tierstore.client.engines")

READ_AHEAD_STEPS = 4  # a queued request expected to run within this many steps has its misses read now
PREFETCH_TOKENS = 8192  # tokens of a queued prompt hinted: about its first prefill chunk
# which of a step's later Engram layers a stager reads behind the forward (docs/decisions.md, "Later Engram
# layers read behind the forward"): those with misses to read (the default), every one, or none
BEHIND = ("misses", "always", "never")


def read_step(asks: list, outs: list | None = None) -> list[np.ndarray]:
    """Rows uint8 [len(ids), row_bytes] of each (client, table, ids) of `asks`, in order: in
    outs[i] where given (C-contiguous, lookup's `out`; returned as is), else fresh arrays.

    Each client's tables are read in one Client.lookup_many; layers that share a table
    are read as one ask (their ids joined) and split again (copied into their outs). Raises
    what lookup raises, its `table` attribute the table whose read raised it."""
    outs = outs or [None] * len(asks)
    out: list = [None] * len(asks)
    by_client: dict[int, tuple] = {}
    for i, (client, table, ids) in enumerate(asks):
        by_client.setdefault(id(client), (client, {}))[1].setdefault(table, []).append(i)
    for client, tables in by_client.values():
        joined = {t: np.concatenate([asks[i][2] for i in at]) if len(at) > 1 else asks[at[0]][2]
                  for t, at in tables.items()}
        into = {t: outs[at[0]] for t, at in tables.items() if len(at) == 1 and outs[at[0]] is not None}
        got = client.lookup_many(joined, out=into)
        for t, at in tables.items():
            lo = 0
            for i in at:
                n = asks[i][2].size
                out[i] = got[t][lo:lo + n] if len(at) > 1 else got[t]
                if len(at) > 1 and outs[i] is not None:
                    outs[i][...] = out[i]
                    out[i] = outs[i]
                lo += n
    return out


def read_layers(layers: list, ids: list, outs: list | None, *, failed: Callable[[list, Exception], str],
                moved: Callable[[object, int], str]) -> list[np.ndarray]:
    """read_step of ids[i] from staged layer layers[i] (its .client, .table and .version: the
    version its engine checked the checkpoint against), each checked to be served at that
    version. StagingError otherwise, before any row is used: failed(the layers whose read
    raised, the error) when a read fails (a tierstore error, or an OSError of the segment
    files), moved(layer, served version) when the sidecar serves another version."""
    try:
        got = read_step([(t.client, t.table, i) for t, i in zip(layers, ids)], outs)
        served = [t.client.handle(t.table).version for t in layers]
    except (errors.TierstoreError, OSError) as e:
        raise StagingError(failed([t for t in layers if t.table == getattr(e, "table", None)] or layers, e)) from e
    for t, v in zip(layers, served):
        if v != t.version:
            raise StagingError(moved(t, v))
    return got


def check_behind(behind: str) -> str:
    """`behind` if it is one of BEHIND; ValueError naming them otherwise."""
    if behind not in BEHIND:
        raise ValueError(f"behind={behind!r}: a stager reads its later Engram layers behind the forward by one of "
                         f"{', '.join(BEHIND)}")
    return behind


def read_now(behind: str, layers: list, ids: list) -> list[int]:
    """The layers (indices into `layers`, staged tables with a .probe: SlotProbe) whose ids[i] a
    stager reads before the forward: the first always; a later one unless `behind` is "always",
    or is "misses" and its probe finds ids the slot index does not hold (a read to hide). A
    later layer whose rows are all resident costs less read with the first, in one call, than a
    call of its own on another thread (docs/decisions.md, "Later Engram layers read behind the
    forward")."""
    if behind == "never":
        return list(range(len(layers)))
    if behind == "always":
        return [0]
    return [0] + [i for i in range(1, len(layers)) if layers[i].probe.misses(ids[i]) == 0]


class HostThread:
    """A stager's host thread: later Engram layers' fills run on it while the forward runs the
    layers before them (one worker, started on the first fill, so a stager that never reads
    behind starts none)."""

    def __init__(self):
        self._pool = None

    def submit(self, fn, *args):
        """fn(*args) on the host thread: its Future."""
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tierstore-stage")
        return self._pool.submit(fn, *args)

    def close(self, device_layers: dict) -> None:
        """Stop the thread (its fills already waited for) and close the stager's device layers
        (device_fill.DeviceLayer: their fill servers' threads)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        for layer in device_layers.values():
            layer.close()
        device_layers.clear()


def queued_hint(wait_steps: int, run_steps: int = 1, read: bool | None = None) -> tuple[bool, int]:
    """How the rows of a queued request are hinted: (read its misses now, steps the hint lasts).

    wait_steps: the steps expected to run before the request's first; run_steps: the steps its
    hinted tokens take (its prefill chunks); read: None for the rule, read now when it is
    expected within READ_AHEAD_STEPS. Hinted only, the rows are kept until its last chunk has
    run and no longer (wait_steps + run_steps). Callers estimate the earliest the request can
    run: a hint that ends before its request runs costs a little, one that outlives it a lot
    (the policy credits hinted rows, and kept past their use they crowd out main's:
    docs/decisions.md, "How long a hint lasts"). Read now, they cost a read that a lapsed hint
    would waste, so they are kept a wait and a step longer (2 x wait_steps + run_steps + 1)."""
    read = wait_steps <= READ_AHEAD_STEPS if read is None else read
    return read, (2 * wait_steps if read else wait_steps) + run_steps + int(read)


def prefetch_layers(layers: list, ids: list, wait_steps: int, run_steps: int, request) -> int:
    """Hint ids[i] (int64, repeats allowed) to cache-mode layer layers[i]'s sidecar (.client,
    .table) for a queued request expected to run after `wait_steps` steps, for `run_steps` steps
    (queued_hint: its misses read now when that is within READ_AHEAD_STEPS, else only its
    resident rows kept for it). Returns the distinct ids hinted. A hint: a sidecar error is
    logged (naming `request`), never raised into the engine's scheduler."""
    read, steps = queued_hint(wait_steps, run_steps)
    sent = 0
    for t, i in zip(layers, ids):
        uniq = np.unique(i)
        try:
            longest = t.client.handle(t.table).max_prefetch_steps or 4096
            t.client.prefetch(t.table, uniq, read=read, steps=max(1, min(longest, steps)))
        except errors.TierstoreError as e:
            log.warning("tierstore prefetch of request %s's rows of %s failed: %s", request, t.table, e)
            continue
        sent += uniq.size
    return sent
