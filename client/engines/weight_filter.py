"""An engine restart reads none of a checkpoint's Engram tables, bar the rows the check samples.

The seam, the same in both engines: the safetensors iterator their default loader calls
(sglang 0.5.23's `safetensors_weights_iterator` and
`buffered_multi_thread_safetensors_weights_iterator`, vLLM's
`safetensors_weights_iterator`). Each opens a shard with `safetensors.safe_open` (which
reads the header) and yields `get_tensor(name)`: a tensor over the shard's private file
mapping, of which nothing is read until it is touched. An Engram table tensor
(`...layers.L.engram.embed.weight` / `.scale`, known by its header name) then reaches the
plugin's loader, checks.CheckpointCheck, which touches only its sampled rows. But every
first touch of a page is a fault that the kernel serves with a read-around window (the
device's read_ahead_kb), so a sample spread over a large tensor read a window a row, most
of the tensor (docs/benchmarks.md, "Engine restart", has the figures).

`filtered(weights, ...)` is that iterator with the Engram tables taken out of the read
path: every tensor is yielded unchanged, in the engine's order (a non-Engram tensor is the
object the engine made, never touched here). An Engram table tensor's pages are advised
MADV_RANDOM before it is handed on, so a fault reads the faulting page only; and the check
queues the reads of its sampled rows' pages at once (`will_need`, MADV_WILLNEED) before it
touches them, so they are read in parallel, not one synchronous fault at a time. Under
verify "sample" a restart reads at most `sample_read_bound(...)` bytes of each such tensor
(the check's SAMPLE_ROWS rows, a row within at most ceil(row bytes / page) + 1 pages),
whatever the table's size. Under "all" the tensors are left as they are (the check reads
every row in order, and readahead is what makes that fast); under "off" nothing reads them.

The rows are still compared: a checkpoint whose sampled rows differ from the served table
is refused by CheckpointCheck (CheckpointMismatch) as before; only the bytes around them are
no longer read. The check also tells which shard a tensor is a view of (`mapped_file`) and
compares that shard's stat and header with what ingest recorded, which reads no row. Load settings that read whole shards before any tensor is yielded (sglang
--weight-loader-disable-mmap / --weight-loader-prefetch-checkpoints, vLLM
--safetensors-load-strategy eager / prefetch) still read the tables; the plugins' hooks name
them in a warning.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import re
from typing import TYPE_CHECKING, Iterable, Iterator

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["ENGRAM_TABLE", "is_engram_table", "filtered", "random_access", "sequential_access", "will_need",
           "sample_read_bound", "mapped_file"]

log = logging.getLogger("tierstore.client.engines.weight_filter")
# the checkpoint names of an Engram layer's table tensors, with whatever prefix the engine adds
ENGRAM_TABLE = re.compile(r"(?:^|\.)layers\.\d+\.engram\.embed\.(?:weight|scale)$")
PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def is_engram_table(name: str) -> bool:
    """Whether checkpoint tensor `name` is an Engram layer's table (embed.weight / embed.scale)."""
    return ENGRAM_TABLE.search(name) is not None


def filtered(weights: Iterable[tuple[str, "torch.Tensor"]], engine: str, sampled: bool,
             whole_shards: str | None = None) -> Iterator[tuple[str, "torch.Tensor"]]:
    """`weights` (an engine's safetensors iterator) with every tensor yielded as it came, in
    order; where the check samples rows (`sampled`: verify "sample") each Engram table tensor
    is random_access() first. whole_shards: the engine setting that reads every shard in full
    before yielding (None: none is on), named in a warning: with it the restart reads the
    tables anyway."""
    if whole_shards is not None:
        log.warning("tierstore: %s reads every checkpoint shard in full (%s), the Engram tables too: drop that "
                    "setting for a restart that reads only the checked rows of the tables", engine, whole_shards)
    return _advised(weights) if sampled else iter(weights)


def _advised(weights):
    for name, tensor in weights:
        if is_engram_table(name):
            random_access(tensor)
        yield name, tensor


def random_access(tensor: "torch.Tensor") -> None:
    """Advise the pages under `tensor` MADV_RANDOM: a fault on them reads that page, no
    read-around. Changes no byte; on memory that is not a file's mapping it is a hint
    without effect. Raises OSError if the kernel refuses the advice."""
    _advise(tensor, mmap.MADV_RANDOM, "MADV_RANDOM")


def sequential_access(tensor: "torch.Tensor") -> None:
    """Advise the pages under `tensor` MADV_SEQUENTIAL, undoing random_access, before the
    check reads the whole tensor in order (its digest): readahead makes that one fast read.
    A hint: on a device tensor, or refused, nothing is done and the read is only slower."""
    if tensor.device.type == "cpu":
        try:
            _advise(tensor, mmap.MADV_SEQUENTIAL, "MADV_SEQUENTIAL")
        except OSError:
            pass


def _advise(tensor: "torch.Tensor", advice: int, name: str) -> None:
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return
    start = tensor.data_ptr() // PAGE * PAGE
    length = tensor.data_ptr() + nbytes - start
    if _libc.madvise(start, length, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise({name}) of a checkpoint tensor's {nbytes} bytes")


def mapped_file(tensor: "torch.Tensor") -> tuple[str, int] | None:
    """(path, byte position) of the file whose mapping in this process holds `tensor`'s first
    byte (/proc/self/maps), as the engines' safetensors iterators hand tensors out; None for
    anything else: a tensor in memory of its own (a copy, an eager or prefetched load), on a
    device, or over a file that its path no longer names (deleted or replaced since it was
    mapped: another inode there, or none)."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return None
    ptr = tensor.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi:
                path = parts[5].rstrip("\n") if len(parts) > 5 else ""
                if not path.startswith("/") or int(parts[4]) == 0:
                    return None
                try:
                    ino = os.stat(path).st_ino
                except OSError:  # " (deleted)", or gone
                    return None
                return (path, int(parts[2], 16) + ptr - lo) if ino == int(parts[4]) else None
    return None


def will_need(rows: "torch.Tensor", ids: np.ndarray) -> None:
    """Start reading the pages under rows `ids` of uint8 [n, row_bytes] `rows` (MADV_WILLNEED:
    the kernel queues the reads and returns), so that the sampled check's faults, one page
    each under random_access(), wait on reads already in flight instead of issuing one at a
    time. Adjacent pages are one range; the kernel takes one range a call, so at most one
    call per sampled row (a bounded sample, once per tensor at load). A refused advice is
    ignored: the faults still read the rows."""
    if rows.device.type != "cpu" or len(ids) == 0:
        return
    row_bytes = rows.shape[1] * rows.element_size()
    first = (rows.data_ptr() + ids.astype(np.int64) * row_bytes) // PAGE
    last = (rows.data_ptr() + (ids.astype(np.int64) + 1) * row_bytes - 1) // PAGE
    new = np.flatnonzero(first[1:] > last[:-1] + 1) + 1  # ids are ascending: a gap starts a range
    starts, ends = first[np.r_[0, new]], last[np.r_[new - 1, len(ids) - 1]]
    for a, b in zip(starts.tolist(), ends.tolist()):
        _libc.madvise(a * PAGE, (b - a + 1) * PAGE, mmap.MADV_WILLNEED)


def sample_read_bound(rows: int, row_bytes: int, sample_rows: int) -> int:
    """The most bytes a check of `sample_rows` rows (checks.SAMPLE_ROWS under verify "sample")
    reads of a [rows, row_bytes] Engram tensor handed on by filtered(): each row within
    ceil(row_bytes / PAGE) + 1 pages, and never more than the tensor's pages."""
    sampled = min(rows, sample_rows) * (-(-row_bytes // PAGE) + 1) * PAGE
    return min(sampled, (-(-rows * row_bytes // PAGE) + 1) * PAGE)
