"""TinyLFU's two FIFO queues of slots, and the loops that walk them.

A queue is a flat buffer of (slot, ticket) entries between `head` and `tail`.
A slot's live entry is the one whose ticket matches the slot's current ticket
(`ticket[slot]`, with `where[slot]` naming its queue); moving a slot pushes a
new entry and leaves the old one stale, to be skipped when the head reaches it
or dropped when the buffer is compacted. So every operation costs O(entries
it touches), never O(arena).

The loops (`admit`, `scan`) are written once, for numba (tierstore/jit.py);
without numba the same Python functions would be far too slow per entry, so
`s3fifo.py` keeps its batched numpy path as the fallback and the reference.
"""
from __future__ import annotations

import numpy as np

from tierstore.cache import prefault
from tierstore.jit import Kernel

__all__ = ["SlotQueue", "FREE", "PROBATION", "MAIN", "ADMIT", "SCAN", "TICKET", "TICKET_MASK", "slot_dtype"]

FREE, PROBATION, MAIN = 0, 1, 2
# An entry's ticket is the policy clock mod 2^32 when it was pushed: tickets are only
# compared for equality (is this entry the slot's latest?), so 4 B do. A stale entry
# whose slot's clock came round to the same value 2^32 pushes later would pass for
# live only to be handled once at its old place: the first visit re-tickets the slot.
TICKET, TICKET_MASK = np.uint32, 0xFFFFFFFF


def slot_dtype(capacity: int):
    """int32 slots below 2^31 (every arena a host holds): queues cost 8 B an entry."""
    return np.int32 if capacity < 2**31 else np.int64


class SlotQueue:
    """FIFO of (slot, ticket) in a ring-free buffer; stale entries are skipped lazily."""

    def __init__(self, capacity: int):
        self.slot = prefault.resident(np.empty(2 * capacity + 1024, dtype=slot_dtype(capacity)))
        self.ticket = prefault.resident(np.empty(self.slot.size, dtype=TICKET))
        self.head = self.tail = 0

    def room(self, n: int, where: np.ndarray, ticket: np.ndarray, q: int) -> None:
        """Make space for n more entries at the tail (dropping stale ones, growing if need be)."""
        if self.tail + n <= self.slot.size:
            return
        s, t = self.slot[self.head:self.tail], self.ticket[self.head:self.tail]
        keep = (where[s] == q) & (ticket[s] == t)
        s, t = s[keep], t[keep]
        if s.size + n > self.slot.size:
            self.slot = np.empty(2 * (s.size + n), dtype=self.slot.dtype)
            self.ticket = np.empty(self.slot.size, dtype=TICKET)
        self.slot[:s.size], self.ticket[:s.size] = s, t
        self.head, self.tail = 0, s.size

    def push(self, slots: np.ndarray, tickets: np.ndarray) -> None:
        """Append entries (room() made space)."""
        n = slots.size
        self.slot[self.tail:self.tail + n] = slots
        self.ticket[self.tail:self.tail + n] = tickets
        self.tail += n

    def peek(self, m: int) -> tuple[np.ndarray, np.ndarray]:
        end = min(self.head + m, self.tail)
        return self.slot[self.head:end].astype(np.int64), self.ticket[self.head:end].copy()


def _admit_loop(slots, to_main, where, ticket, hits, count, ps, pt, ptail, ms, mt, mtail, clock):
    """Each slot leaves its old queue (if any) and enters main (to_main) or probation
    with no hits. Returns (probation tail, main tail, clock)."""
    for i in range(slots.shape[0]):
        s = slots[i]
        if where[s] != FREE:
            count[where[s]] -= 1
        hits[s] = 0
        if to_main[i]:
            ms[mtail], mt[mtail] = s, clock & TICKET_MASK
            mtail += 1
            where[s] = MAIN
        else:
            ps[ptail], pt[ptail] = s, clock & TICKET_MASK
            ptail += 1
            where[s] = PROBATION
        count[where[s]] += 1
        ticket[s] = clock & TICKET_MASK
        clock += 1
    return ptail, mtail, clock


def _scan_loop(q, need, chunk, head, out, where, ticket, hits, pins, until, step, count, ps, pt, ptail, ms, mt,
               mtail, clock):
    """Walk at most `chunk` entries of queue q from `head`, stopping at the `need`-th victim.

    A victim is a live, unpinned entry with no hits left; an entry hinted
    until a later step (until[s] > step) passes as a pinned one. Probation: an
    unpinned entry with hits was hit there and moves to main (hits reset); a
    pinned one goes back to the tail. Main: every live non-victim goes back to
    the tail, an unpinned one spending one hit (CLOCK). Stale entries are dropped.
    Returns (victims written to out, new head, probation tail, main tail, clock)."""
    qs, qt = (ps, pt) if q == PROBATION else (ms, mt)
    end = min(head + chunk, ptail if q == PROBATION else mtail)
    n = 0
    while head < end and n < need:
        s, t = qs[head], qt[head]
        head += 1
        if where[s] != q or ticket[s] != t:
            continue
        free = pins[s] == 0 and until[s] <= step
        if free and hits[s] == 0:
            out[n] = s
            n += 1
            where[s] = FREE
            count[q] -= 1
            continue
        if q == PROBATION and free:  # hit while on probation: promoted
            hits[s] = 0
            count[PROBATION] -= 1
            count[MAIN] += 1
            ms[mtail], mt[mtail] = s, clock & TICKET_MASK
            mtail += 1
            where[s] = MAIN
        elif q == PROBATION:  # leased: in use, so recent
            ps[ptail], pt[ptail] = s, clock & TICKET_MASK
            ptail += 1
        else:
            if free:
                hits[s] -= 1
            ms[mtail], mt[mtail] = s, clock & TICKET_MASK
            mtail += 1
        ticket[s] = clock & TICKET_MASK
        clock += 1
    return n, head, ptail, mtail, clock


ADMIT, SCAN = Kernel(_admit_loop), Kernel(_scan_loop)
