"""TinyLFU's two FIFO queues of slots, as lists linked through the slots, and the
loops that walk them.

Each queue is a singly linked FIFO threaded through one array of the arena's
size, `nxt[slot]` (the slot behind it, -1 at the tail), with a head and a tail
per queue: 4 B a slot for both queues, no entry buffers, no tickets, nothing
to compact. Every operation costs O(entries it touches), never O(arena).

`entry[slot]`, one byte, names a slot's queue (its low bits: PROBATION, MAIN or
FREE) and holds its CLOCK hits (its top five bits, HIT a hit: at most
MAX_HITS). A singly linked list cannot unlink a slot from its middle, so a slot
the policy forgets while it is linked stays linked as a *ghost* (its queue with
the GHOST bit): a walk that reaches a ghost drops it (it is then FREE), and a
ghost admitted again before that is revived where it lies (`admit`). The
engine forgets slots that it had just admitted (a refused lease, a failed
fill), so a revived slot sits where a fresh push would, near the tail; the one
other forget, of victims chosen by a pass over the pins when the queue heads
give none (s3fifo.py), is rare.
`counts` are the live entries of each queue, `linked` the entries its list
holds (live and ghosts): a walk visits at most that many, so it never meets
an entry it pushed itself.

A hint protects a slot until the end step `until[slot]`, kept mod 2^16: it is
live while 0 < (until - now) mod 2^16 <= the longest hint (PolicyConfig's
max_expect_steps, at most MAX_EXPECT_STEPS = 2^15). A value whose end passed
would read live again 2^16 - that many steps later, so s3fifo.py rewrites the
ended ones of 1/SWEEP_STEPS of the arena every step (each within 2^14 steps);
pending.py keeps the ends of ids not resident yet the same way.

The loops (`admit`, `scan`) are written once, for numba (tierstore/jit.py);
without numba the same Python functions run interpreted (they are the
reference the compiled ones are tested against, and the fallback).
"""
from __future__ import annotations

import numpy as np

from tierstore.cache.policy.config import MAX_HITS
from tierstore.jit import Kernel, inlined

__all__ = ["FREE", "PROBATION", "MAIN", "GHOST", "TO_PROBATION", "TO_MAIN", "FIRST_OUT", "ADMIT", "SCAN", "FORGET", "slot_dtype", "hinted", "UNTIL",
           "SWEEP_STEPS", "HIT", "ENTRY", "live", "hits_of", "with_hits"]

FREE, PROBATION, MAIN = 0, 1, 2
_QUEUE = 3  # an entry's queue bits
GHOST = 4  # with a queue: forgotten, still linked in it
_WHERE = _QUEUE | GHOST
HIT = 8  # one CLOCK hit, above them
_HITS = 0xFF ^ _WHERE
ENTRY = np.uint8
UNTIL = np.uint16  # hint ends, mod 2^16
SWEEP_STEPS = 1 << 14  # every until is rewritten (if ended) once per this many steps
# where `admit` puts a free slot (int8 codes): probation's tail, main's tail, or probation's
# head, first out at the next walk (a row its class says is unlikely to come back)
TO_PROBATION, TO_MAIN, FIRST_OUT = 0, 1, 2


def slot_dtype(capacity: int):
    """int32 slots below 2^31 (every arena a host holds): the links cost 4 B a slot."""
    return np.int32 if capacity < 2**31 else np.int64


def live(entry: np.ndarray) -> np.ndarray:
    """Which entries are in a queue (not FREE, not a ghost)."""
    w = entry & _WHERE
    return (w == PROBATION) | (w == MAIN)


def hits_of(entry: np.ndarray) -> np.ndarray:
    """The CLOCK hits of entries."""
    return entry // HIT


def with_hits(entry: np.ndarray, hits) -> np.ndarray:
    """The entries with their hits set to `hits` (<= MAX_HITS), queues kept."""
    return ((entry & _WHERE) | (np.asarray(hits, ENTRY) * ENTRY(HIT))).astype(ENTRY)


def hinted(until: np.ndarray, step: int, longest: int) -> np.ndarray:
    """Which of `until` (hint ends mod 2^16) are still ahead of `step`."""
    d = (until.astype(np.int64) - step) & 0xFFFF
    return (d != 0) & (d <= longest)


@inlined
def _push(q, s, nxt, heads, tails, linked):
    """Link slot s at queue q's tail."""
    nxt[s] = -1
    if tails[q] >= 0:
        nxt[tails[q]] = s
    else:
        heads[q] = s
    tails[q] = s
    linked[q] += 1


def _admit_loop(slots, where, entry, counts, linked, nxt, heads, tails):
    """Each slot enters, with no hits, where where[i] says (TO_PROBATION, TO_MAIN: a
    queue's tail; FIRST_OUT: probation's head); a linked one (a ghost, or live) stays
    where it lies, live in that queue, and a main one there is owed promotion (a hit
    while on probation)."""
    for i in range(slots.shape[0]):
        s = slots[i]
        w = entry[s] & _WHERE
        h = 0
        if w == FREE:
            q = MAIN if where[i] == TO_MAIN else PROBATION
            if where[i] == FIRST_OUT and heads[q] >= 0:
                nxt[s] = heads[q]
                heads[q] = s
                linked[q] += 1
            else:
                _push(q, s, nxt, heads, tails, linked)
        else:
            q = w & _QUEUE
            if w == q:  # live
                counts[q] -= 1
            if where[i] == TO_MAIN and q == PROBATION:
                h = 1
        entry[s] = q | (h * HIT)
        counts[q] += 1


def _forget_loop(slots, entry, counts):
    """Live slots become ghosts of their queue (FREE ones stay FREE)."""
    for i in range(slots.shape[0]):
        s = slots[i]
        w = entry[s] & _WHERE
        if w == PROBATION or w == MAIN:
            counts[w] -= 1
            entry[s] |= GHOST


def _scan_loop(q, need, chunk, out, entry, pins, until, step, longest, counts, linked, nxt, heads, tails):
    """Walk at most `chunk` entries of queue q from its head (and at most those it holds
    now), stopping at the `need`-th victim.

    A victim is a live, unpinned entry with no hits left; an entry hinted
    until a later step passes as a pinned one. Probation: an unpinned entry
    with hits was hit there and moves to main (hits reset); a pinned one goes
    back to the tail. Main: every live non-victim goes back to the tail, an
    unpinned one spending one hit (CLOCK). Ghosts are dropped.
    Returns (victims written to out, entries walked)."""
    n = walked = 0
    end = min(chunk, linked[q])
    while walked < end and n < need:
        s = heads[q]
        heads[q] = nxt[s]
        if heads[q] < 0:
            tails[q] = -1
        linked[q] -= 1
        walked += 1
        e = entry[s]
        if (e & _WHERE) != q:  # a ghost
            entry[s] = e & _HITS  # FREE, hits kept
            continue
        d = (np.int64(until[s]) - step) & 0xFFFF
        free = pins[s] == 0 and (d == 0 or d > longest)
        if free and e < HIT:  # no hits
            out[n] = s
            n += 1
            entry[s] = FREE
            counts[q] -= 1
            continue
        if q == PROBATION and free:  # hit while on probation: promoted, hits reset
            entry[s] = MAIN
            counts[PROBATION] -= 1
            counts[MAIN] += 1
            _push(MAIN, s, nxt, heads, tails, linked)
        elif q == PROBATION:  # leased: in use, so recent
            _push(PROBATION, s, nxt, heads, tails, linked)
        else:
            if free:
                entry[s] = e - HIT  # one hit spent
            _push(MAIN, s, nxt, heads, tails, linked)
    return n, walked


ADMIT, FORGET, SCAN = Kernel(_admit_loop), Kernel(_forget_loop), Kernel(_scan_loop)
