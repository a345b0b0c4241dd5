"""Cold blocks online verification could not pass, and the re-check that lifts them.

The verifier thread (verifier.py) reads the cold blocks of rows an engine serves, off the
hot path. A read that fails is judged by how it failed (judge), never by the failure alone:
- CORRUPT: the block's bytes all came back and fail their checksum. A verdict: the block is
  marked, and a Plan or lookup of any of its rows is DATA_LOSS (refuse: a ChecksumError
  naming the table, the version, the block and the row asked), even for a row still
  resident in DRAM.
- UNREADABLE: the read came back short (tiers.base.ShortRead: the segment file is missing or
  cut short; a `cp` over it truncates it first) or failed (OSError: EIO). No verdict: the
  block is a suspect and serves as before (its resident rows were verified as they were
  placed; a miss of its rows is read, and fails or passes, on its own).
- OK: it reads and checks now (what failed a moment ago was transient).
Each verifier pass re-checks the marked and suspect blocks judged before it began (due: at
most RECHECK_BLOCKS a pass, those judged longest ago first): one that reads and checks is lifted and serves
again (the cut restored, the file put back from a backup), one that reads whole and fails
is marked, one still unreadable stays as it was. So nothing a transient cut did stays
refused once the bytes are back, and a real mismatch is DATA_LOSS for as long as the bytes
on disk are wrong.
"""
from __future__ import annotations

import logging
import threading
import time

import numpy as np

from tierstore.errors import ChecksumError
from tierstore.tiers.base import ShortRead

__all__ = ["BadBlocks", "OK", "CORRUPT", "UNREADABLE", "RECHECK_BLOCKS"]

log = logging.getLogger("tierstore.engine.bad_blocks")

OK, CORRUPT, UNREADABLE = "ok", "corrupt", "unreadable"
# blocks re-checked per verifier pass (each one block read): a disk full of bad blocks costs the
# pass a bounded read, the rest wait for later passes
RECHECK_BLOCKS = 64


class BadBlocks:
    """The marked and suspect cold blocks of one engine's version.

    `marked` (int64, sorted) is replaced whole, never changed in place, so the hot path reads
    it without a lock (refuse); the verifier thread judges and re-checks, under this object's
    lock for the bookkeeping only (never across a read)."""

    def __init__(self, version):
        self.version = version
        self.marked = np.zeros(0, dtype=np.int64)
        self._checked: dict[int, float] = {}  # every marked or suspect block: when it was last judged
        self._lock = threading.Lock()
        self._suspect_logged = False

    @property
    def waiting(self) -> int:
        """Blocks marked or suspect (re-checked on later passes)."""
        return len(self._checked)

    def refuse(self, ids: np.ndarray) -> None:
        """DATA_LOSS (ChecksumError naming table, version, block and row) when any of `ids` lies
        in a marked block: never a silent wrong row, even one resident in DRAM."""
        marked = self.marked
        if not marked.size:
            return
        v = self.version
        hit = np.isin(ids // v.block_rows, marked)
        if hit.any():
            row = int(ids[np.argmax(hit)])
            raise ChecksumError(v.table, v.number, row // v.block_rows,
                                f"row {row}: found by online verification; put the segment file back from a "
                                f"backup, or re-ingest or import a good copy", row=row)

    def judge(self, reader, block: int) -> tuple[str, np.ndarray | None, str]:
        """Read `block` whole from the cold tier `reader` (ColdTier.read_range, verified):
        (OK, its rows, "") or (CORRUPT | UNREADABLE, None, why)."""
        v = self.version
        lo = block * v.block_rows
        try:
            return OK, reader.read_range(lo, min(v.block_rows, v.rows - lo)), ""
        except (ShortRead, OSError) as e:
            return UNREADABLE, None, str(e)
        except ChecksumError as e:
            return CORRUPT, None, str(e)

    def mark(self, block: int) -> bool:
        """A verdict: `block` refused from now on (until a re-check lifts it). Whether it is newly marked."""
        with self._lock:
            self._checked[block] = time.monotonic()
            if block in self.marked:
                return False
            self.marked = np.union1d(self.marked, [block])
            return True

    def suspect(self, block: int) -> None:
        """No verdict: `block` could not be read whole; re-checked on later passes, served meanwhile."""
        with self._lock:
            self._checked[block] = time.monotonic()
        if not self._suspect_logged:
            self._suspect_logged = True
            log.warning("online verification: table %r version %d block %d could not be read whole (its segment "
                        "file is cut short or failing); served as before and re-checked", self.version.table,
                        self.version.number, block)

    def lift(self, block: int) -> bool:
        """`block` read and checked: no longer marked or suspect. Whether it was marked."""
        with self._lock:
            self._checked.pop(block, None)
            was = block in self.marked
            if was:
                self.marked = self.marked[self.marked != block]
        if was:
            log.warning("online verification: table %r version %d block %d reads and checks again: served again",
                        self.version.table, self.version.number, block)
        return was

    def due(self, before: float) -> list[int]:
        """The marked and suspect blocks to re-check this pass: those last judged before
        `before` (time.monotonic: the pass's start, so a block judged in this pass waits for
        the next), at most RECHECK_BLOCKS, those judged longest ago first."""
        with self._lock:
            checked = {b: t for b, t in self._checked.items() if t < before}
        return sorted(checked, key=checked.__getitem__)[:RECHECK_BLOCKS]
