"""Prefetch hints: the rows a queued request will read, told once, at admission (the
scheduler's call: gRPC Prefetch, sidecar/prefetcher.py).

Hints(engine, config) is an engine's `hints`. A cache-mode table keeps a hint's rows in its
policy for the request's wait (CachePolicy.expect) and, with `read`, promotes the missing ones
now, without a lease (CacheEngine.promote). A full table reads nothing ahead (every row is
resident) but checks a hint by the same rules, the default PolicyConfig's, so a client's hint
is refused alike whatever the table's mode.
"""
from __future__ import annotations

import numpy as np

from tierstore import cpu_token
from tierstore.cache.policy.config import PolicyConfig

__all__ = ["Hints", "HINT_CHUNK_IDS"]

# prefetch hints are taken this many ids per hold of the table lock and the CPU token (background work)
HINT_CHUNK_IDS = 16384


class Hints:
    """The prefetch hints of one engine: checked by `config` (its policy's, or the default
    PolicyConfig for a full table), kept by its policy and read ahead in cache mode."""

    def __init__(self, engine, config: PolicyConfig):
        self.engine, self.config = engine, config

    @property
    def max_steps(self) -> int:
        """The longest hint check accepts (PolicyConfig.max_expect_steps)."""
        return self.config.max_expect_steps

    def check(self, ids, steps: int | None) -> tuple[np.ndarray, int]:
        """(ids, steps) of a prefetch, validated (steps None: the policy's default); InvalidArgument otherwise."""
        return self.engine.check_ids(ids), self.config.hint_steps(steps)

    def prefetch(self, ids: np.ndarray, read: bool = True, steps: int | None = None, conn_id: bytes = b"") -> int:
        """Rows a queued request will read: the scheduler calls this once, at admission.

        All are hinted to the policy for `steps` steps, about the request's wait
        (CachePolicy.expect: kept over others until then, resident now or
        admitted later; default PolicyConfig.expect_steps, at most
        max_expect_steps); with `read`, missing rows are promoted now, without a
        lease. Returns rows read (0 for a full table: every row is resident). Never
        refuses for lack of room: when the arena is full of leased rows, the ids that
        do not fit are skipped; a read that fails (a corrupt block, EIO) reads nothing
        and raises nothing here (CacheEngine.promote): the step that reads those rows
        reports it. InvalidArgument for bad ids or steps (check), before anything is
        hinted. Reading a deep queue ahead costs hit ratio in a small arena (`bench
        cache`: ours+queue16 against ours+queue16-read): pass read=False for
        requests more than a step or two from running. Hinting the whole queue
        again each step (read=False) protects more (ours+queue16-rehint).

        A hint costs O(its ids), whatever is pending, and at most
        HINT_CHUNK_IDS ids are hinted per hold of the table lock and the CPU
        token, taken as background work (cpu_token.background), so a plan waits
        for at most one chunk of a hint, never behind a long one; its first
        2 x capacity ids are used (more could not all be kept). conn_id: the hinting client's id;
        its pending ids are bounded per client (PolicyConfig.pending_client_share)."""
        e = self.engine
        ids, steps = self.check(ids, steps)
        if e.full:
            return 0
        ids = ids[:2 * e.capacity]
        if ids.size == 0 or not e.enter():
            return 0
        try:
            read_in = 0
            for a in range(0, ids.size, HINT_CHUNK_IDS):
                with cpu_token.background():
                    read_in += self._prefetch_unique(np.unique(ids[a:a + HINT_CHUNK_IDS]), read, steps, conn_id)
            return read_in
        finally:
            e.leave()

    def _prefetch_unique(self, uniq: np.ndarray, read: bool, steps: int, conn_id: bytes) -> int:
        e = self.engine
        with e.lock:
            slots = e.slots.find(uniq)
            miss = uniq[slots < 0]
            # kept for the request: resident rows, and missing ones once read in (here, or by another step)
            e.policy.expect(slots[slots >= 0].astype(np.int64, copy=False), miss, steps, conn_id)
            # read ahead no more than the policy can keep until then (free slots evict nothing:
            # fill them regardless), and leave room for steps
            ahead = max(e.policy.protect_room(), e.slots.n_free)
            room = max(0, min(e.capacity - 2 * e.slots.n_pinned, ahead)) if read else 0
        misses = e.promote(miss[:room])
        e.counters.prefetched += misses
        return misses
