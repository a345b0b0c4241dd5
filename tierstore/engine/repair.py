"""Online verification's work on one engine: what the verifier thread (verifier.py) asks of
it, off the hot path.

An engine's `repair` is a CacheRepair or a FullRepair:
- CacheRepair.verify_rows: sampled served rows re-read from the cold tier (their block
  checked) and their arena copy compared with it, repaired in place where it differs;
- FullRepair.scrub_blocks: arena blocks hashed against the catalog, and repaired from the
  cold tier where they differ;
- Repair.recheck (both): the blocks marked bad or suspect re-checked each pass.
A cold read that fails is judged (judge, bad_blocks.py): bytes read whole that fail mark
the block, which the engine then refuses (BadBlocks.refuse); a short read or EIO is no
verdict. A cache-mode mark also makes the block's resident rows gen odd, so a local reader
misses them; a lift rewrites them from the verified block and makes them READY again.
"""
from __future__ import annotations

import numpy as np
import xxhash

from tierstore.engine.bad_blocks import CORRUPT, UNREADABLE
from tierstore.errors import ChecksumError

__all__ = ["Repair", "CacheRepair", "FullRepair"]


class Repair:
    """What both modes do: judge a cold block whose read failed, mark and lift blocks, and
    re-check the marked and suspect ones. Finds are (tier, block, slot or row or None, detail),
    which the verifier logs (the first per table and tier)."""

    def __init__(self, engine):
        self.engine = engine

    def judge(self, block: int, found: list, n_rows: int) -> np.ndarray | None:
        """Read cold `block` whole (BadBlocks.judge) after a read of it failed: its verified rows
        when it reads and checks; else None, and the block marked (CORRUPT: `n_rows` counted
        mismatched and the find added to `found`, when newly marked) or a suspect
        (UNREADABLE: a short read or EIO is no verdict)."""
        e = self.engine
        verdict, rows, why = e.bad_blocks.judge(e.reader, block)
        if verdict == CORRUPT and self.mark(block):
            e.verify_counters.mismatches["nvme"] += n_rows
            found.append(("nvme", block, None, why))
        elif verdict == UNREADABLE:
            e.bad_blocks.suspect(block)
            e.verify_counters.unreadable += 1
        return rows

    def recheck(self, before: float) -> list[tuple]:
        """Each verifier pass: the marked and suspect blocks judged before `before` (the pass's
        start, time.monotonic: BadBlocks.due) judged again; one that reads and checks is lifted
        and serves again (lift), one whose bytes fail is marked. Returns the new finds."""
        found: list = []
        for block in self.engine.bad_blocks.due(before):
            rows = self.judge(block, found, 0)
            if rows is not None:
                self.lift(block, rows)
        return found

    def mark(self, block: int) -> bool:
        """Refuse `block` from now on (BadBlocks.mark); whether it is newly marked."""
        return self.engine.bad_blocks.mark(block)

    def lift(self, block: int, rows: np.ndarray) -> None:
        """`block` (its verified rows `rows`) serves again."""
        if self.engine.bad_blocks.lift(block):
            self.engine.verify_counters.lifted += 1


class CacheRepair(Repair):
    """A cache-mode engine's: sampled rows verified, their arena copies repaired in place."""

    def mark(self, block: int) -> bool:
        """A bad cold block is refused from now on (Repair.mark); its resident rows' gen goes
        odd too, so a local reader (which does not ask the sidecar) misses them, reads the
        block and gets DATA_LOSS as a Plan does. They stay mapped (a running step may hold a
        lease on them) until evicted, or until a re-check lifts the mark (lift)."""
        if not super().mark(block):
            return False
        e = self.engine
        with e.lock:
            slots = self._block_slots(block)
            e.slots.gen[slots[slots >= 0]] |= np.uint32(1)
        return True

    def lift(self, block: int, rows: np.ndarray) -> None:
        """A marked block that reads and checks again serves again: its resident rows that the
        mark left gen odd (mapped, no fill in flight holds them) get its verified `rows`
        written over them and gen even again, as a repair in place ends; then the mark goes."""
        e = self.engine
        with e.lock:
            slots = self._block_slots(block)
            held = np.flatnonzero(slots >= 0)
            s = slots[held]
            filling = e.filling_slots()
            left = ((e.slots.gen[s] & 1) == 1) & ~np.isin(s, filling)
            s, held = s[left], held[left]
            if s.size:
                e.arena.rows[s] = rows[held]
                e.slots.end_write(s)
        super().lift(block, rows)

    def _block_slots(self, block: int) -> np.ndarray:
        """(lock held) The slot of each row of `block`, -1 where it is not resident."""
        e = self.engine
        br = e.version.block_rows
        return e.slots.find(np.arange(block * br, min((block + 1) * br, e.rows), dtype=np.int64))

    def verify_rows(self, ids: np.ndarray, slots: np.ndarray) -> list[tuple]:
        """Check sampled served rows: their cold block's checksum, and the arena copy
        against the verified disk copy (repaired in place when it differs). A failed read is
        judged block by block (judge): a short read or EIO is no verdict."""
        e = self.engine
        found, vc, br = [], e.verify_counters, e.version.block_rows
        vc.checked["nvme"] += ids.size
        try:
            disk = e.reader.read_rows(ids)  # one batched, verified read: the common case
        except (ChecksumError, OSError):
            disk, ok = np.empty((ids.size, e.version.row_bytes), np.uint8), np.ones(ids.size, bool)
            blocks = ids // br
            for b in np.unique(blocks).tolist():  # pinpoint every bad block of the sample
                sel = blocks == b
                rows = self.judge(b, found, int(sel.sum()))
                if rows is None:
                    ok &= ~sel
                else:
                    disk[sel] = rows[ids[sel] - b * br]
            ids, slots, disk = ids[ok], slots[ok], disk[ok]
        with e.lock:
            st = e.slots
            still = (st.id_of[slots] == ids) & st.is_ready(slots)  # a slot may hold another row by now
            s, d = slots[still], disk[still]
            bad = np.any(e.arena.rows[s] != d, axis=1)
            vc.checked["dram"] += int(s.size)
            if bad.any():
                st.begin_write(s[bad])  # local readers reject what they copy meanwhile
                e.arena.rows[s[bad]] = d[bad]
                st.end_write(s[bad])
                vc.mismatches["dram"] += int(bad.sum())
                block = int(ids[still][bad][0] // br)
                found.append(("dram", block, int(s[bad][0]),
                              f"{int(bad.sum())} arena rows differed from the verified disk copy; repaired"))
        return found


class FullRepair(Repair):
    """A full-mode engine's: the arena scrubbed block by block against the catalog."""

    def scrub_blocks(self, blocks: np.ndarray) -> list[tuple]:
        """Hash arena blocks against the catalog, read the same cold blocks (verified); repair
        an arena block from disk, mark a corrupt cold block bad (a cold block that reads short
        is no verdict: judge)."""
        e = self.engine
        found, vc, br = [], e.verify_counters, e.version.block_rows
        sums = e.reader.checksums
        for b in np.sort(blocks).tolist():
            lo, hi = b * br, min((b + 1) * br, e.rows)
            vc.checked["nvme"] += hi - lo
            disk = self.judge(b, found, hi - lo)
            vc.checked["dram"] += hi - lo
            held = e.arena.range(lo, hi)
            if xxhash.xxh3_64_intdigest(e.stored(lo, hi, held)) == int(sums[b]) or disk is None:
                continue
            diff = np.any(held != disk, axis=1)
            e.arena.put(lo, disk)
            vc.mismatches["dram"] += int(diff.sum())
            found.append(("dram", b, lo + int(np.argmax(diff)), f"{int(diff.sum())} arena rows repaired from disk"))
        return found
