"""PendingHints: ids a queued request will read that are not resident yet (CachePolicy.expect).

Each is kept until the step its hint runs out, or until it is admitted: it is
then protected until that step instead (s3fifo.py). Bounded in all and per
client, and every call costs O(ids it is given), never O(ids pending): a hint
is a request anyone may send.

- The ids live in a hash table of 4-way buckets, 1.5x `limit` entries (a
  bucket overflows rarely; a hint is soft, so an id that finds no way is
  dropped). An entry is live while its end step is ahead (`until > now`): one
  whose hint ran out is free for the next id, nothing sweeps the table.
- Each client (the owner id it sends) holds one row of counts: how many of its
  entries end at each step, in a ring of max_steps + 1 rows (every live end
  lies in (now, now + max_steps], so the ring never wraps onto a live end).
  The step `now` begins by taking row `now % R` off the clients' live counts.
"""
from __future__ import annotations

import numpy as np

__all__ = ["PendingHints"]

WAYS = 4
_HASH = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: the top bits of id * 2^64/phi


class PendingHints:
    """Pending ids of one policy: at most `limit` live in all, `per_client` of one client's,
    `clients` clients at once; hints last at most `max_steps` steps.

    Invariants (kept by every call): an id has at most one live entry; `_live[c]` is
    the number of client c's live entries and equals `_ends[:, c].sum()`, an entry's
    count sitting in `_ends[until % R, owner]` exactly while `until > now`; and
    `_live.sum() <= limit`, `_live[c] <= per_client`.
    """

    def __init__(self, limit: int, per_client: int, clients: int, max_steps: int, n_ids: int = 2**63 - 1):
        """n_ids: the table's rows (ids are kept in 4 B below 2^31)."""
        self._id_dtype = np.int32 if n_ids <= 2**31 else np.int64
        self.limit, self.per_client, self.clients = max(1, int(limit)), max(1, int(per_client)), int(clients)
        self._ring = int(max_steps) + 1
        self._buckets_n = np.uint64(max(4, -(-3 * self.limit // (2 * WAYS))))  # 1.5x the limit in entries
        self._id = self._until = self._owner = self._ends = None  # allocated by the first add()
        self._live = np.zeros(self.clients, np.int64)
        self._keys: list = [None] * self.clients  # client index -> owner id
        self._index: dict[bytes, int] = {}        # owner id -> client index
        self.total = 0       # live entries in all
        self.dropped = 0     # ids hinted that found no room (a bound, a full bucket, no client row)

    def arrays(self) -> list[np.ndarray]:
        """The arrays it holds (for CachePolicy.held_bytes): the table only once a hint came."""
        return [a for a in (self._id, self._until, self._owner, self._ends, self._live) if a is not None]

    def _buckets(self, ids: np.ndarray) -> np.ndarray:
        """[n, WAYS] table positions of each id's bucket."""
        b = (((ids.astype(np.uint64) * _HASH) >> np.uint64(32)) * self._buckets_n) >> np.uint64(32)
        return b.astype(np.int64)[:, None] * WAYS + np.arange(WAYS)

    def take(self, ids: np.ndarray, now: int) -> np.ndarray:
        """The step each of distinct `ids` was pending until (0: not pending), no longer
        pending: they were admitted, and their protection carries the end (O(len(ids)))."""
        if not self.total:
            return np.zeros(ids.size, np.int64)
        pos = self._buckets(ids)
        until = self._until[pos]
        hit = (self._id[pos] == ids[:, None]) & (until > now)
        found = hit.any(axis=1)
        out = np.where(hit, until, 0).max(axis=1)
        if found.any():
            at = pos[found, hit[found].argmax(axis=1)]
            owner = self._owner[at].astype(np.int64)
            np.subtract.at(self._ends, (out[found] % self._ring, owner), 1)
            np.subtract.at(self._live, owner, 1)
            self.total -= at.size
            self._until[at] = 0
        return out

    def expire(self, now: int) -> None:
        """Step `now` began: the entries that end at it no longer count (O(clients))."""
        if self.total:
            row = self._ends[now % self._ring]
            self._live -= row
            self.total -= int(row.sum())
            row[:] = 0

    def add(self, ids: np.ndarray, until: int, client: bytes, now: int) -> int:
        """Keep distinct `ids` pending until step `until` (now < until <= now + max_steps) for
        `client`; returns how many of them are pending that long now (the rest are dropped)."""
        if ids.size == 0:
            return 0
        c = self._client(client)
        if c is None:
            self.dropped += ids.size
            return 0
        if self._id is None:
            n = int(self._buckets_n) * WAYS
            self._id, self._until = np.zeros(n, self._id_dtype), np.zeros(n, np.int64)
            self._owner = np.zeros(n, np.uint8)
            self._ends = np.zeros((self._ring, self.clients), np.int32)
        pos = self._buckets(ids)
        cur = self._until[pos]
        match = (self._id[pos] == ids[:, None]) & (cur > now)
        found = match.any(axis=1)
        at = pos[found, match[found].argmax(axis=1)]  # the live entry of an id already pending
        old, owner = self._until[at], self._owner[at].astype(np.int64)
        mine = owner == c
        # this client's own entries only move their end; another's, ending sooner, become this one's
        grow = mine & (old < until)
        np.subtract.at(self._ends[:, c], old[grow] % self._ring, 1)
        self._ends[until % self._ring, c] += int(grow.sum())
        self._until[at[grow]] = until
        take = ~mine & (old < until)
        room = self.per_client - int(self._live[c])
        take &= np.cumsum(take) <= room
        self._move(at[take], old[take], owner[take], c, until)
        room -= int(take.sum())
        kept = int(np.count_nonzero(mine | take | (old >= until)))  # pending at least that long now
        new = np.flatnonzero(~found)[:max(0, min(room, self.limit - self.total))]
        kept += self._place(ids[new], pos[new], until, c, now)
        self.dropped += ids.size - kept
        return kept

    def _move(self, at: np.ndarray, old: np.ndarray, owner: np.ndarray, c: int, until: int) -> None:
        """Live entries `at` of other clients become client c's, ending at `until`."""
        if at.size == 0:
            return
        np.subtract.at(self._ends, (old % self._ring, owner), 1)
        np.subtract.at(self._live, owner, 1)
        self._ends[until % self._ring, c] += at.size
        self._live[c] += at.size
        self._until[at], self._owner[at] = until, c

    def _place(self, ids: np.ndarray, pos: np.ndarray, until: int, c: int, now: int) -> int:
        """New entries: each id takes a free way of its bucket, one id a way (a round per way)."""
        placed = 0
        for _ in range(WAYS):
            if ids.size == 0:
                break
            free = self._until[pos] <= now
            has = free.any(axis=1)
            ids, pos, free = ids[has], pos[has], free[has]
            at = pos[np.arange(ids.size), free.argmax(axis=1)]
            at, first = np.unique(at, return_index=True)  # ids that picked the same way: the first wins
            self._id[at], self._until[at], self._owner[at] = ids[first], until, c
            placed += at.size
            lost = np.ones(ids.size, bool)
            lost[first] = False
            ids, pos = ids[lost], pos[lost]
        self._ends[until % self._ring, c] += placed
        self._live[c] += placed
        self.total += placed
        return placed

    def _client(self, client: bytes) -> int | None:
        """This client's row, a free one (no live entries) taken for a new client, or None."""
        c = self._index.get(client)
        if c is not None:
            return c
        idle = np.flatnonzero(self._live == 0)
        if idle.size == 0:
            return None
        c = int(idle[0])
        if self._keys[c] is not None:
            del self._index[self._keys[c]]
        self._keys[c], self._index[client] = client, c
        return c
