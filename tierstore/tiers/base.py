"""The small interface every tier shares: fixed-size rows addressed by id.

`read_rows` is the one method a tier must provide; `check_ids`, `check_out`
and `gather_by_block` are the shared pieces tiers build it from. `ColdTier` is
what the engines call on the tier a version's rows are read from (the segment
files, the remote store): nothing else of a reader is looked up. `ShortRead` is
a read that could not judge the bytes (they were not all there).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tierstore.errors import ChecksumError, IdOutOfRange, InvalidArgument
from tierstore.tiers import trust
from tierstore.jit import first_outside

__all__ = ["ColdTier", "ShortRead", "Tier", "check_ids", "check_out", "gather_by_block"]


class ShortRead(ChecksumError):
    """A block whose bytes did not all come back: its file is missing or cut short (a `cp`
    over a segment truncates it first). DATA_LOSS to whoever asked (it travels as
    ChecksumError: tierstore.errors.wire_name), but no verdict on the bytes: once the file
    is whole again the same block may read and check (tierstore/engine/bad_blocks.py)."""


def check_ids(ids, rows: int, table: str = "") -> np.ndarray:
    """Validate row ids and return them as a flat int64 array: the one id check of
    the engines, the tiers, the policy and the client.

    Raises InvalidArgument for non-integer ids and IdOutOfRange (naming the
    table, its row count and the first bad id) for ids outside [0, rows).
    """
    name = f"table {table!r}" if table else "table"
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        if ids.size == 0 and ids.dtype.kind == "f":  # np.asarray([]) is float64
            return np.zeros(0, dtype=np.int64)
        raise InvalidArgument(f"row ids for {name} must be integers, got dtype {ids.dtype}")
    if ids.dtype.kind == "u" and ids.size and ids.max() > np.iinfo(np.int64).max:
        bad = int(ids.max())
        raise IdOutOfRange(f"{name} has {rows} rows; id {bad} is out of range")
    flat = ids.reshape(-1).astype(np.int64, copy=False)
    bad = first_outside(flat, rows)
    if bad >= 0:
        raise IdOutOfRange(f"{name} has {rows} rows; id {int(flat[bad])} is out of range")
    return flat


def check_out(out, n: int, row_bytes: int, table: str = "") -> np.ndarray:
    """Allocate or validate a caller's output buffer: C-contiguous uint8 [n, row_bytes]
    (InvalidArgument, naming `table` where given, otherwise)."""
    if out is None:
        return np.empty((n, row_bytes), dtype=np.uint8)
    if not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.shape != (n, row_bytes) \
            or not out.flags.c_contiguous or not out.flags.writeable:
        shape = getattr(out, "shape", None)
        dtype = getattr(out, "dtype", type(out).__name__)
        name = f" for table {table!r}" if table else ""
        raise InvalidArgument(f"out{name} must be a writable C-contiguous uint8 array of shape ({n}, {row_bytes}), "
                              f"got {dtype} {shape}")
    return out


def gather_by_block(flat: np.ndarray, block_rows: int, row_bytes: int, group: int, read_blocks, put) -> None:
    """Read the blocks holding rows `flat` (any order, duplicates fine) `group` blocks at a
    time and hand the rows on: read_blocks(sorted unique blocks, scratch uint8) fills
    block j at j * block_rows rows; put(sel, rows) stores rows for flat[sel]."""
    blocks = flat // block_rows
    ub = np.unique(blocks)
    pos = np.searchsorted(ub, blocks)
    order = np.argsort(pos, kind="stable")
    sorted_pos = pos[order]
    scratch = np.empty(min(len(ub), group) * block_rows * row_bytes, dtype=np.uint8)
    grid = scratch.reshape(-1, row_bytes)  # scratch as rows: block j, row r at j*block_rows + r
    for a in range(0, len(ub), group):
        b = min(a + group, len(ub))
        read_blocks(ub[a:b], scratch)
        lo, hi = np.searchsorted(sorted_pos, [a, b])
        sel = order[lo:hi]
        put(sel, grid[(sorted_pos[lo:hi] - a) * block_rows + flat[sel] % block_rows])


class Tier:
    """Rows of one table version held by one tier.

    Attributes: `table` (name, for messages), `rows` (row count), `row_bytes`.
    """

    table: str = "?"
    rows: int = 0
    row_bytes: int = 0

    def read_rows(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows `ids` (any integer array) as uint8 [len(ids), row_bytes], in the
        order given; written into `out` when given. Raises IdOutOfRange."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ColdTier(Tier):
    """The tier a served version's rows come from (tiers.nvme.SegmentReader, tiers.remote.
    RemoteReader): every row it returns is verified against the version's checksums.

    Attributes the engines and the sidecar read: `checksums` (uint64 [n_blocks], the block
    checksums), `bytes_read` (bytes read from the tier so far), `direct` (None unless
    misses bypass the page cache, O_DIRECT), `verifies_rows` (each row is checked against
    its own row sum; else rows verify by their block), `carried` (what a local client's
    note carries for the misses it read, and what the sidecar takes from whom:
    tierstore/tiers/trust.py), `cold_dir` (where a client on the host may read the misses
    itself). The defaults are a tier that offers none of it: a note carries nothing,
    nothing carried is placed."""

    checksums: np.ndarray
    bytes_read: int = 0
    direct = None
    verifies_rows: bool = False
    carried: trust.Carried = trust.NONE

    @property
    def cold_dir(self) -> Path | None:
        """The data directory whose segment files a client on the host may read this version's
        misses from itself, each row checked against its row sum; None where it may not
        (rows that verify only by block, rows not on this host)."""
        return None

    # ---- the read pipeline's stages (tiers/nvme/miss_batch.py): by default, read at submit ----
    def submit(self, batch, at: np.ndarray):
        """The submit stage: rows batch.ids[at] read, verified and written to
        batch.dest[batch.slots[at]]; yields the parts left in flight (by default none: the
        rows are read here, at once)."""
        if at.size:
            batch.dest[batch.slots[at]] = self.read_rows(batch.ids[at])
        yield from ()

    def finish(self, part) -> None:
        """The finish stage: a part's reads waited for."""

    def place(self, part, batch) -> tuple[int, str]:
        """The verify and place stage: (position of its first bad row or -1, why)."""
        return -1, ""

    def abandon(self, part) -> None:
        """A part that will not be placed: its reads waited for, its buffers given back."""

    def landed(self, part) -> bool:
        """Every read of a part done, asked without waiting (MissBatch.landed)."""
        return True

    def land(self, batch, share: float) -> None:
        """`share` of a batch's reads landed (MissBatch.land)."""

    def read_range(self, start: int, n: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows [start, start + n) as uint8 [n, row_bytes], verified; into `out` when given."""
        raise NotImplementedError

    def held_arrays(self) -> tuple[np.ndarray, ...]:
        """What the tier holds in DRAM to check rows (block checksums, format 1's row sums)."""
        return (self.checksums,)

    def place_carried(self, ids: np.ndarray, src: np.ndarray, row_at: np.ndarray, dest: np.ndarray,
                      slots: np.ndarray) -> int:
        """Write src[row_at[i]], row ids[i] as a client read it and carries it (`carried`), into
        dest[slots[i]], each verified. Returns the index of the first row that fails, or -1
        when all pass; a tier that carries nothing fails them all (0), so nothing unverified
        is ever placed."""
        return 0 if ids.size else -1
