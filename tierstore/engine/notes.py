"""Access notes: the steps clients on the host served themselves (client/local_reads.py),
told to the sidecar after the fact (NOTE frames, sidecar/learner.py) and learned by a
cache-mode table as if they had been planned.

Notes(engine) is a CacheEngine's `notes`. A note is checked as it arrives (check: ids, step
ends, and the rows it carries, which trust admits or leaves out: tierstore/tiers/trust.py)
and learned later, off the steps' path (learn): the policy records each step (but another
client's copy of it: StepCopies) and the misses are promoted without a lease
(CacheEngine.promote), placed from the note's rows where it carries them, each verified.
Every hold of the table lock is one chunk of a note, taken as background work.
"""
from __future__ import annotations

import numpy as np

from tierstore import cpu_token
from tierstore.cache.step_copies import step_digest
from tierstore.errors import InvalidArgument
from tierstore.jit import distinct

__all__ = ["Notes", "NOTE_CHUNK_IDS", "NOTE_CHUNK_STEPS"]

# access notes are learned at most this many ids, and this many steps, per hold of the table
# lock and the CPU token (learn): a step costs the policy's work even when it has one id
NOTE_CHUNK_IDS = 16384
NOTE_CHUNK_STEPS = 16


class Notes:
    """The access notes of one cache-mode engine (`engine`, whose lock, slot table, policy,
    step copies and counters they use, and whose promote() reads the misses)."""

    def __init__(self, engine):
        self.engine = engine

    def access(self, ids: np.ndarray, ends: np.ndarray, row_ids: np.ndarray | None = None,
               rows: np.ndarray | None = None, source: bytes = b"", trusted: bool = True) -> int:
        """Steps a client on the host served itself (client/local_reads.py), told after the fact in
        batches: `ids` of consecutive steps, step k being ids[ends[k-1]:ends[k]], each step's
        ids distinct (the client dedupes; a repeat counts twice, as two accesses would). The
        policy learns each step as if it had been planned (hits touched), and the rows that
        missed are promoted without a lease, so the next steps find them resident: every
        miss while the arena has free slots (a free slot is always better than a disk
        read), and past that as planned misses are, unless PolicyConfig.read_admit_freq
        (a doorkeeper, off by default) asks a row seen before. row_ids, rows: rows the client read
        for its misses (int64 [n], uint8 [n, width], any order) in the table's carried form
        (tierstore/tiers/trust.py: rows, or format 2's records): a promoted miss among
        them is placed from those bytes, each verified in the same pass, instead of read
        from disk; one that does not match is read from disk instead and counted
        (note_rows_refused): no row that failed its check is ever placed. What trust does
        not admit from this sender (`trusted`: a peer of the sidecar's uid; in-process
        callers are the sidecar itself) is left out: those misses are read from disk,
        batched, like any miss. Never refused: when the arena is full of leased rows, the
        misses that do not fit are skipped. source: the client (its conn_id): a step
        another client sent already, the same batch read by another TP rank, is not learned
        again (StepCopies); its misses are still promoted. Returns rows promoted.
        InvalidArgument for bad ids, step ends or rows (nothing is learned then):
        check, then learn.

        Bookkeeping, off the steps' path: learned at most NOTE_CHUNK_IDS ids and
        NOTE_CHUNK_STEPS steps per hold of the lock and the CPU token, each hold taken as
        background work (cpu_token.background), so a plan waits for at most one chunk of
        a note, however many steps it has."""
        return self.learn(*self.check(ids, ends, row_ids, rows, trusted), source=source)

    def learn(self, ids: np.ndarray, ends: np.ndarray, row_ids: np.ndarray | None, rows: np.ndarray | None,
              source: bytes = b"") -> int:
        """access() of a note check() has passed (the learner checks a note as it arrives and
        learns it later): its rows, where given, admitted by trust."""
        e = self.engine
        if ids.size == 0 or not e.enter():
            return 0  # nothing to learn, or freed meanwhile (a version swap)
        try:
            carried = None
            if row_ids is not None and row_ids.size:
                with cpu_token.background():
                    have, first = np.unique(row_ids, return_index=True)  # sorted: _read_misses finds each id in them
                carried = (have, first.astype(np.int64, copy=False), rows)
            return self._learn_chunks(ids, ends, carried, source)
        finally:
            e.leave()

    def check(self, ids, ends, row_ids=None, rows=None, trusted: bool = False) -> tuple:
        """(ids, ends, row_ids, rows) of an access note, validated (access); InvalidArgument
        otherwise. row_ids and rows are None when the note carries no rows, or rows that
        trust does not admit from this sender (`trusted`: trust.peer_trusted), whose misses
        are then read from disk."""
        e = self.engine
        ids = e.check_ids(ids)
        ends = np.asarray(ends, dtype=np.int64).reshape(-1)
        if ends.size == 0 or ends[-1] != ids.size or ends[0] < 0 or np.any(np.diff(ends) < 0):
            raise InvalidArgument(f"table {e.table!r}: access note of {ids.size} ids needs non-decreasing step "
                                  f"ends that finish at {ids.size}, got {ends.size} ends")
        if rows is None or row_ids is None or not np.size(row_ids):
            return ids, ends, None, None
        row_ids = e.check_ids(row_ids)
        rows = np.asarray(rows)
        widths = {e.version.row_bytes, e.version.record_bytes}  # rows, or format 2's records
        if rows.dtype != np.uint8 or rows.ndim != 2 or rows.shape[0] != row_ids.size or rows.shape[1] not in widths:
            raise InvalidArgument(f"table {e.table!r}: an access note carries {row_ids.size} row ids and rows "
                                  f"{rows.dtype} {rows.shape}; rows must be uint8 [{row_ids.size}, "
                                  f"{e.version.row_bytes}] (or records [{row_ids.size}, "
                                  f"{e.version.record_bytes}])")
        if not e.reader.carried.admits(rows, trusted):
            return ids, ends, None, None
        return ids, ends, row_ids, rows

    def _learn_chunks(self, ids: np.ndarray, ends: np.ndarray, carried=None, source: bytes = b"") -> int:
        """access() after its checks, a few steps at a time: the lock and the CPU token are
        held for at most NOTE_CHUNK_STEPS steps of at most NOTE_CHUNK_IDS ids (or one longer
        step), as background work (planned steps of every worker wait on both)."""
        read, a = 0, 0
        while a < ends.size:
            start = int(ends[a - 1]) if a else 0
            b = int(np.searchsorted(ends, start + NOTE_CHUNK_IDS, side="right"))
            b = max(a + 1, min(a + NOTE_CHUNK_STEPS, b))
            with cpu_token.background():
                read += self._learn_steps(ids[start:int(ends[b - 1])], ends[a:b] - start, carried, source)
            a = b
        return read

    def _learn_steps(self, ids: np.ndarray, ends: np.ndarray, carried=None, source: bytes = b"") -> int:
        """Steps ids[ends[k-1]:ends[k]], each step's ids distinct (repeats across steps are
        further accesses): learned under the lock (but another client's copies), then the
        admitted misses promoted."""
        e = self.engine
        st, starts = e.slots, np.concatenate([[0], ends[:-1]]).tolist()
        digests = [step_digest(ids[a:b]) for a, b in zip(starts, ends.tolist())]
        with e.lock:
            learned = np.ones(ids.size, bool)
            for a, b, digest in zip(starts, ends.tolist(), digests):
                if b > a and not e.copies.first(digest, source):
                    learned[a:b] = False
                    e.counters.steps_copied += 1
                elif b > a:
                    e.policy.record(ids[a:b])
                    if e.recorder is not None:
                        e.recorder.record(e.table, ids[a:b], n_ids=e.rows)
            slots = st.find(ids)
            hit = slots >= 0
            hit_slots = slots[hit].astype(np.int64, copy=False)
            if hit_slots.size:
                e.policy.touch(slots[hit & learned].astype(np.int64, copy=False))
                if e.verifier is not None:  # rows clients read locally are re-verified too
                    e.verifier.sample(e, ids[hit], hit_slots)
            c = e.counters
            c.local_steps += ends.size
            c.hits += hit_slots.size
            c.misses += ids.size - hit_slots.size
            miss = self._admitted_misses(np.sort(distinct(ids[~hit])))  # sorted, for the cold tier
            room = max(0, e.capacity - 2 * st.n_pinned)  # leave room for planned steps
        # the client has just read these rows: their bytes (carried), or at least their pages
        return e.promote(miss[:room], carried=carried)

    def _admitted_misses(self, miss: np.ndarray) -> np.ndarray:
        """(lock held) The misses of noted steps to promote, order kept: all of them while the
        free slots take them; otherwise the doorkeeper's (PolicyConfig.read_admit_freq: seen
        before, this access included) and, while free slots are left, the others in id
        order. The filter applies only to rows that need a victim: a one-hit wonder never
        displaces a resident row, but never leaves a slot empty either. The free count is
        this moment's: a planned step taking slots before the promotion evicts for a few."""
        e = self.engine
        free, gate = e.slots.n_free, e.policy.config.read_admit_freq
        if gate <= 1 or miss.size <= free:
            return miss
        passed = e.policy.sketch.estimate(miss) >= gate
        spare = free - int(np.count_nonzero(passed))
        if spare > 0:
            passed |= np.cumsum(~passed) <= spare
        return miss[passed]
