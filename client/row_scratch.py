"""RowScratch: a buffer of rows reused read after read, for Client.lookup(out=).

A read into a fresh array pays that array's page faults and cold cache lines every
step, about as much as reading the rows (docs/decisions.md, "A caller's buffer");
a step loop reads into one buffer instead, as a gather kernel's staging buffer is
reused. The engines' stagers keep one per staged layer.
"""
from __future__ import annotations

import numpy as np

from tierstore.tiers.nvme.direct_io import _Scratch, thread_buffer

__all__ = ["RowScratch"]

# a step's rows above this stay a fresh array: a scratch keeps what its largest step needed
KEEP_BYTES = 256 << 20


class RowScratch:
    """Rows of `width` bytes read into one buffer, grown as reads need and reused by every read
    after: one per thread that reads (direct_io.thread_buffer), so two reads never share it.

    take(n): uint8 [n + spare, width], its `spare` last rows zero (vLLM's stager reads a zero
    row for a padded head); the rows before them are the read's to fill, and valid until this
    thread's next take. A read larger than KEEP_BYTES gets a fresh array, not kept."""

    def __init__(self, width: int, spare: int = 0):
        self.width, self.spare = width, spare
        self._local = _Scratch()

    def take(self, n: int) -> np.ndarray:
        need = n + self.spare
        nbytes = need * self.width
        if nbytes > KEEP_BYTES:
            return np.zeros((need, self.width), np.uint8)
        view = thread_buffer(self._local, nbytes)[:nbytes].reshape(need, self.width)
        view[n:] = 0
        return view
