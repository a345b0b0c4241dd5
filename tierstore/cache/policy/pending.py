"""PendingHints: ids a queued request will read that are not resident yet (CachePolicy.expect).

Each is kept until the step its hint runs out, or until it is admitted: it is
then protected until that step instead (s3fifo.py). Bounded in all and per
client, and every call costs O(ids it is given), never O(ids pending): a hint
is a request anyone may send.

- The ids live in a hash table of 4-way buckets, 1.5x `limit` entries (a
  bucket overflows rarely; a hint is soft, so an id that finds no way is
  dropped): id 4 B, end step 2 B, client index 1 B, 7 B an entry. An entry is live
  while its end step is ahead; one whose hint ran out is free for the next id.
  Ends are kept mod 2^16 like the slots' (queues.py: live while 0 < (until -
  now) mod 2^16 <= max_steps), so expire() also rewrites the ended ends of
  1/SWEEP_STEPS of the table each step to "ended a step ago": none comes
  round to read live again.
- Each client (by the conn_id it sends) holds one row of counts: how many of its
  entries end at each step, in a ring of max_steps + 1 rows (every live end
  lies in (now, now + max_steps], so the ring never wraps onto a live end).
  The step `now` begins by taking row `now % R` off the clients' live counts.
"""
from __future__ import annotations

import numpy as np

from tierstore.cache.policy.queues import SWEEP_STEPS, UNTIL, hinted

__all__ = ["PendingHints"]

WAYS = 4
_HASH = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: the top bits of id * 2^64/phi


class PendingHints:
    """Pending ids of one policy: at most `limit` live in all, `per_client` of one client's,
    `clients` clients at once; hints last at most `max_steps` steps.

    Invariants (kept by every call): an id has at most one live entry; `_live[c]` is
    the number of client c's live entries and equals `_ends[:, c].sum()`, an entry's
    count sitting in `_ends[end % R, _client_of[entry]]` exactly while it is live (its end, `end`,
    ahead of now); and `_live.sum() <= limit`, `_live[c] <= per_client`.
    """

    def __init__(self, limit: int, per_client: int, clients: int, max_steps: int, n_ids: int = 2**63 - 1):
        """n_ids: the table's rows (ids are kept in 4 B below 2^31)."""
        self._id_dtype = np.int32 if n_ids <= 2**31 else np.int64
        self.limit, self.per_client, self.clients = max(1, int(limit)), max(1, int(per_client)), int(clients)
        self.longest = int(max_steps)
        self._ring = self.longest + 1
        self._sweep = 0  # where the next step's sweep of ended ends starts
        self._buckets_n = np.uint64(max(4, -(-3 * self.limit // (2 * WAYS))))  # 1.5x the limit in entries
        self._id = self._until = self._client_of = self._ends = None  # allocated by the first add()
        self._live = np.zeros(self.clients, np.int64)
        self._conn_ids: list = [None] * self.clients  # client index -> conn_id
        self._client_index: dict[bytes, int] = {}     # conn_id -> client index
        self.total = 0       # live entries in all
        self.dropped = 0     # ids hinted that found no room (a bound, a full bucket, no client row)

    def arrays(self) -> list[np.ndarray]:
        """The arrays it holds (for CachePolicy.held_bytes): the table only once a hint came."""
        return [a for a in (self._id, self._until, self._client_of, self._ends, self._live) if a is not None]

    def _buckets(self, ids: np.ndarray) -> np.ndarray:
        """[n, WAYS] table positions of each id's bucket."""
        b = (((ids.astype(np.uint64) * _HASH) >> np.uint64(32)) * self._buckets_n) >> np.uint64(32)
        return b.astype(np.int64)[:, None] * WAYS + np.arange(WAYS)

    def live(self, now: int) -> np.ndarray:
        """Which entries of the table are live at step `now` (tests; O(table))."""
        return hinted(self._until, now, self.longest) if self._until is not None else np.zeros(0, bool)

    def _ends_of(self, pos: np.ndarray, now: int) -> np.ndarray:
        """The end step of the entries at `pos` (int64; 0 where not live)."""
        d = (self._until[pos].astype(np.int64) - now) & 0xFFFF
        return np.where((d != 0) & (d <= self.longest), now + d, 0)

    def take(self, ids: np.ndarray, now: int) -> np.ndarray:
        """The step each of distinct `ids` was pending until (0: not pending), no longer
        pending: they were admitted, and their protection carries the end (O(len(ids)))."""
        if not self.total:
            return np.zeros(ids.size, np.int64)
        pos = self._buckets(ids)
        until = self._ends_of(pos, now)
        hit = (self._id[pos] == ids[:, None]) & (until > 0)
        found = hit.any(axis=1)
        out = np.where(hit, until, 0).max(axis=1)
        if found.any():
            at = pos[found, hit[found].argmax(axis=1)]
            client_of = self._client_of[at].astype(np.int64)
            np.subtract.at(self._ends, (out[found] % self._ring, client_of), 1)
            np.subtract.at(self._live, client_of, 1)
            self.total -= at.size
            self._until[at] = (now - 1) & 0xFFFF
        return out

    def expire(self, now: int) -> None:
        """Step `now` began: the entries that end at it no longer count (O(clients)), and
        the next 1/SWEEP_STEPS of the table's ended ends read "ended a step ago"."""
        if self.total:
            row = self._ends[now % self._ring]
            self._live -= row
            self.total -= int(row.sum())
            row[:] = 0
        if self._until is not None:
            n = self._until.size
            a = self._sweep
            b = min(n, a + -(-n // SWEEP_STEPS))
            part = self._until[a:b]
            part[~hinted(part, now, self.longest)] = (now - 1) & 0xFFFF
            self._sweep = 0 if b == n else b

    def add(self, ids: np.ndarray, until: int, conn_id: bytes, now: int) -> int:
        """Keep distinct `ids` pending until step `until` (now < until <= now + max_steps) for
        the client `conn_id`; returns how many of them are pending that long now (the rest are dropped)."""
        if ids.size == 0:
            return 0
        c = self._index_of(conn_id)
        if c is None:
            self.dropped += ids.size
            return 0
        if self._id is None:
            n = int(self._buckets_n) * WAYS
            self._id, self._client_of = np.zeros(n, self._id_dtype), np.zeros(n, np.uint8)
            self._until = np.full(n, (now - 1) & 0xFFFF, UNTIL)  # every entry ended a step ago
            self._ends = np.zeros((self._ring, self.clients), np.int32)
        pos = self._buckets(ids)
        cur = self._ends_of(pos, now)
        match = (self._id[pos] == ids[:, None]) & (cur > 0)
        found = match.any(axis=1)
        at = pos[found, match[found].argmax(axis=1)]  # the live entry of an id already pending
        old, client_of = self._ends_of(at, now), self._client_of[at].astype(np.int64)
        mine = client_of == c
        # this client's own entries only move their end; another's, ending sooner, become this one's
        grow = mine & (old < until)
        np.subtract.at(self._ends[:, c], old[grow] % self._ring, 1)
        self._ends[until % self._ring, c] += int(grow.sum())
        self._until[at[grow]] = until & 0xFFFF
        take = ~mine & (old < until)
        room = self.per_client - int(self._live[c])
        take &= np.cumsum(take) <= room
        self._move(at[take], old[take], client_of[take], c, until)
        room -= int(take.sum())
        kept = int(np.count_nonzero(mine | take | (old >= until)))  # pending at least that long now
        new = np.flatnonzero(~found)[:max(0, min(room, self.limit - self.total))]
        kept += self._place(ids[new], pos[new], until, c, now)
        self.dropped += ids.size - kept
        return kept

    def _move(self, at: np.ndarray, old: np.ndarray, client_of: np.ndarray, c: int, until: int) -> None:
        """Live entries `at` of other clients become client c's, ending at `until`."""
        if at.size == 0:
            return
        np.subtract.at(self._ends, (old % self._ring, client_of), 1)
        np.subtract.at(self._live, client_of, 1)
        self._ends[until % self._ring, c] += at.size
        self._live[c] += at.size
        self._until[at], self._client_of[at] = until & 0xFFFF, c

    def _place(self, ids: np.ndarray, pos: np.ndarray, until: int, c: int, now: int) -> int:
        """New entries: each id takes a free way of its bucket, one id a way (a round per way)."""
        placed = 0
        for _ in range(WAYS):
            if ids.size == 0:
                break
            free = ~hinted(self._until[pos], now, self.longest)
            has = free.any(axis=1)
            ids, pos, free = ids[has], pos[has], free[has]
            at = pos[np.arange(ids.size), free.argmax(axis=1)]
            at, first = np.unique(at, return_index=True)  # ids that picked the same way: the first wins
            self._id[at], self._until[at], self._client_of[at] = ids[first], until & 0xFFFF, c
            placed += at.size
            lost = np.ones(ids.size, bool)
            lost[first] = False
            ids, pos = ids[lost], pos[lost]
        self._ends[until % self._ring, c] += placed
        self._live[c] += placed
        self.total += placed
        return placed

    def _index_of(self, conn_id: bytes) -> int | None:
        """The index of client `conn_id`, a free one (no live entries) taken for a new client, or None."""
        c = self._client_index.get(conn_id)
        if c is not None:
            return c
        idle = np.flatnonzero(self._live == 0)
        if idle.size == 0:
            return None
        c = int(idle[0])
        if self._conn_ids[c] is not None:
            del self._client_index[self._conn_ids[c]]
        self._conn_ids[c], self._client_index[conn_id] = conn_id, c
        return c
