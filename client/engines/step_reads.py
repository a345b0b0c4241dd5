"""One read of a step's rows for every staged Engram layer: the stagers' way to the client.

An engine's stager knows every layer's ids before the forward (they are hashes
of the step's tokens), so it asks for all its layers' rows at once, through
Client.lookup_many: under `serve --direct-io` a step's tables are then read
overlapped (one table's misses in flight while the next table's hits are
copied, one ring a table), where reading them layer by layer drains the device's
queue between layers (V4.1 has two Engram layers: bench large reads its two
tables this way too). Each layer reads into a RowScratch of its own, reused step
after step: a fresh array per layer and step (a prefill's 100,000 distinct rows
are 26 MB) cost as much as reading the rows (docs/benchmarks.md: "A caller's
buffer").
"""
from __future__ import annotations

import threading

import numpy as np

__all__ = ["read_step", "RowScratch"]

# a step's rows above this stay a fresh array: a scratch keeps what its largest step needed
KEEP_BYTES = 256 << 20


class RowScratch:
    """One layer's buffer for a step's distinct rows, grown as steps need and reused by every
    step after (one per thread that reads: a buffer is never shared by two reads at once).

    take(n): uint8 [n + spare, width], its `spare` last rows zero (vLLM's stager reads a zero
    row for a padded head); the rows before them are the read's to fill, and valid until this
    thread's next take. A step larger than KEEP_BYTES gets a fresh array, not kept."""

    def __init__(self, width: int, spare: int = 0):
        self.width, self.spare = width, spare
        self._local = threading.local()

    def take(self, n: int) -> np.ndarray:
        need = n + self.spare
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.shape[0] < need:
            if need * self.width > KEEP_BYTES:
                return np.zeros((need, self.width), np.uint8)
            grown = min(max(need, 2 * (0 if buf is None else buf.shape[0])), KEEP_BYTES // self.width)
            buf = self._local.buf = np.empty((grown, self.width), np.uint8)
        view = buf[:need]
        view[n:] = 0
        return view


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
