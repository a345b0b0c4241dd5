"""The hot set of a cache-mode table: its resident rows, hottest first, recorded while it
serves and promoted again when a sidecar starts (the warm start: sidecar/warm_start.py
saves and loads them, tierstore/store/hot_set.py is their file).

HotSet(engine) is a CacheEngine's `hot_set`. record() reads the slot table a chunk at a
time; warm() promotes into free slots only, without a lease (CacheEngine.promote), each
chunk as background work, so planned steps never wait for a warm-up.
"""
from __future__ import annotations

import numpy as np

from tierstore import cpu_token
from tierstore.errors import InvalidArgument

__all__ = ["HotSet", "WARM_CHUNK_ROWS", "HOT_SET_CHUNK_SLOTS"]

# a warm start promotes this many rows per step of its own (warm); a hot set is read this
# many slots per hold of the lock (record): planned steps wait on the lock and the CPU token
WARM_CHUNK_ROWS = 4096
HOT_SET_CHUNK_SLOTS = 1 << 16


class HotSet:
    """The hot set of one cache-mode engine (`engine`: its lock, slot table, policy and promote())."""

    def __init__(self, engine):
        self.engine = engine

    def record(self) -> tuple[np.ndarray, np.ndarray]:
        """The resident rows, hottest first: (ids int64, counts uint8), counts the policy's
        frequency estimates, ties in slot order. What a restart promotes again (warm).

        Read HOT_SET_CHUNK_SLOTS slots per hold of the lock, so planned steps wait at most
        one chunk; the rows resident throughout are all there, a row promoted or evicted
        meanwhile may or may not be (it is a hint)."""
        e = self.engine
        st = e.slots
        ids, counts = [], []
        for a in range(0, e.capacity, HOT_SET_CHUNK_SLOTS):
            with cpu_token.background(), e.lock:
                b = min(e.capacity, a + HOT_SET_CHUNK_SLOTS)
                got = st.id_of[a:b][st.is_ready(slice(a, b))].astype(np.int64)
                ids.append(got)
                counts.append(np.minimum(e.policy.sketch.estimate(got), 255).astype(np.uint8))
        ids, counts = np.concatenate(ids), np.concatenate(counts)
        order = np.argsort(-counts.astype(np.int16), kind="stable")
        return ids[order], counts[order]

    def warm(self, ids: np.ndarray, counts: np.ndarray | None = None, stop=None) -> int:
        """Promote `ids` (hottest first: a recorded record() or a profile's hot list) into
        free slots, WARM_CHUNK_ROWS at a time, without a lease; returns rows read.

        Only free slots are filled: a row a step brought in since the start is newer
        evidence than the hint and is not evicted for it (free slots are counted as each
        chunk starts; steps that take some meanwhile may cost a few rows); it ends once the
        arena is full, the ids run out, `stop` (a threading.Event) is set, or the engine
        is retired. `counts` (the recorded frequency estimates) seed the policy's sketch
        first, so the rows are kept as they were before the restart (main queue), not
        treated as one-hit wonders. Rows come from the cold tier, verified as any miss
        (a chunk whose read fails is skipped: a step reading those rows reports it).
        Planned steps never wait for the warm-up: each chunk holds the lock and the CPU
        token as background work (cpu_token.background), as a step's own promotion would,
        after the plans waiting for them. InvalidArgument for ids out of range."""
        e = self.engine
        ids = e.check_ids(ids)
        if counts is not None:
            counts = np.asarray(counts, dtype=np.int64).ravel()
            if counts.shape != ids.shape:
                raise InvalidArgument(f"table {e.table!r}: warm needs one count per id")
        read = a = 0
        while a < ids.size:
            if e.retired or (stop is not None and stop.is_set()):
                break
            with cpu_token.background():
                if not e.enter():
                    break
                try:
                    with e.lock:
                        room = e.slots.n_free
                        if room == 0:
                            break
                        chunk = ids[a:a + min(WARM_CHUNK_ROWS, room)]
                        if counts is not None:  # seeds, not accesses: no step toward halving
                            recorded = e.policy.sketch.recorded
                            e.policy.sketch.add(*_unique_max(chunk, counts[a:a + chunk.size]))
                            e.policy.sketch.recorded = recorded
                        miss = np.unique(chunk[e.slots.find(chunk) < 0])
                    got = e.promote(miss)
                finally:
                    e.leave()
            a += chunk.size
            read += got
            e.counters.warmed += got
        return read


def _unique_max(ids: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct ids (the sketch takes each once per call), each with its largest count."""
    order = np.lexsort((-counts, ids))
    ids, counts = ids[order], counts[order]
    first = np.ones(ids.size, dtype=bool)
    first[1:] = ids[1:] != ids[:-1]
    return ids[first], counts[first]
