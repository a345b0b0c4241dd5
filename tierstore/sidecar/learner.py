"""Learner: the steps clients on the host read themselves, learned by the sidecar off their path.

A client on the host (client/local_reads.py) reads resident rows without asking the
sidecar, then sends a note of what it read over the step socket. The note is
checked at once and queued; one thread ("learner") hands the queued notes to their
engines' policies (Notes.access), which learn them as background work
(cpu_token.background): a plan waits for at most one chunk of a note.

Fair between clients (a client is one step-socket connection, its conn_id): each
client's notes wait in a queue of their own, and the thread takes the clients in
turn, at most NOTE_TURN_STEPS steps of at most NOTE_TURN_IDS ids of one client's
notes a turn (a note longer than that is split at a step), so a client that notes
faster than the others is learned at the pace they leave it, never ahead of them.

The queues together are bounded in steps (NOTE_QUEUE_STEPS: a step costs the policy's
work even when it has one id), in ids (NOTE_QUEUE_IDS) and in bytes of carried rows
(NOTE_QUEUE_ROW_BYTES). A client alone may fill them; when a note does not fit, room
is made at the expense of the client holding the most of the bound it overflows:
its oldest notes are dropped (for rows: left out, the ids still learned, the misses
read from disk if promoted), or the new note itself when its sender would hold the
most. So no client's notes keep another's out: each is sure of an equal share of
every bound, in steps and in ids. Past them notes are dropped, never waited for, so
while the sidecar is behind its policy learns from a sample of the steps and no
client ever waits for its bookkeeping. Each dropped step is counted on its table:
notes_dropped, and of those notes_over_share when its client held the most of the
queue while other clients' notes waited, or sent one note larger than the queue.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict, deque

import numpy as np

from tierstore.engine import TableEngine

__all__ = ["Learner", "NOTE_QUEUE_STEPS", "NOTE_QUEUE_IDS", "NOTE_QUEUE_ROW_BYTES", "NOTE_TURN_STEPS",
           "NOTE_TURN_IDS", "LEARNER_NICE"]

log = logging.getLogger("tierstore.sidecar.served")
NOTE_QUEUE_STEPS = 1 << 14  # steps of local reads' notes waiting for the learner, all clients together
NOTE_QUEUE_IDS = 1 << 18  # ids of those steps
# bytes of rows those notes carry waiting for the learner; past it a note's rows are left out (its ids
# are still learned, and the misses it promotes are read from disk)
NOTE_QUEUE_ROW_BYTES = 64 << 20
# one client's turn: at most this many of its queued steps, of at most this many ids, then the next client's
NOTE_TURN_STEPS = 64
NOTE_TURN_IDS = 1 << 14
# The learner thread's nice value (Linux: per thread): on a host with fewer cores than local
# readers, bookkeeping yields the CPU to the readers and the policy learns from the notes it
# gets to (a sample of the steps learns about as well as all of them: docs/decisions.md)
LEARNER_NICE = 5

STEPS, IDS, ROW_BYTES = 0, 1, 2  # what a note holds of each bound, in this order
BOUNDS = (NOTE_QUEUE_STEPS, NOTE_QUEUE_IDS, NOTE_QUEUE_ROW_BYTES)


class _Queue:
    """One client's notes waiting for the learner, oldest first (each [engine, ids, ends, row_ids,
    rows]), and what they hold of each bound (STEPS, IDS, ROW_BYTES)."""

    __slots__ = ("notes", "held")

    def __init__(self):
        self.notes: deque = deque()
        self.held = [0, 0, 0]


class Learner:
    """The clients' queues of local reads' notes and the thread (made at the first note) that learns them."""

    def __init__(self):
        self._queues: OrderedDict[bytes, _Queue] = OrderedDict()  # clients with notes waiting, in turn order
        self._held = [0, 0, 0]  # what all of them hold (STEPS, IDS, ROW_BYTES)
        self._cv = threading.Condition(threading.Lock())
        self._stop = False
        self._thread: threading.Thread | None = None

    def note(self, engine: TableEngine, ids, ends, row_ids=None, rows=None, trusted: bool = False,
             source: bytes = b"") -> bool:
        """Queue steps client `source` (its conn_id) read itself (Notes.access) for the
        learner thread, after checking them (InvalidArgument). False when the note is dropped:
        it does not fit the queue and its sender holds the most of it (module docstring), so
        while the sidecar is behind its policy learns from a sample of the steps, and no
        client ever waits for its bookkeeping. A note that would be dropped is dropped before
        it is checked: a client flooding the learner costs it no more than the note's size.
        The rows a note carries are queued while NOTE_QUEUE_ROW_BYTES allows (made the same
        way), else left out (the misses they were for are then read from disk if promoted).

        trusted: the peer runs as the sidecar's uid (or root; trust.peer_trusted): what its note
        may carry is trust's to say (tierstore/tiers/trust.py: records only from such a peer,
        rows checked against the sidecar's own sums from anyone), asked once, by the engine's
        Notes.check. source: also tells another client's copy of a step apart
        (Notes.access: it is not learned twice)."""
        size = [int(np.size(ends)), int(np.size(ids)), 0]
        with self._cv:
            if not self._room(engine, source, size, make=False):
                return False
        # rows trust does not admit from this sender are left out here (tierstore/tiers/trust.py)
        ids, ends, row_ids, rows = engine.notes.check(ids, ends, row_ids, rows, trusted)
        with self._cv:
            if not self._room(engine, source, size, make=True):
                return False
            if rows is not None and self._room(engine, source, [0, 0, rows.nbytes], make=True):
                row_ids, rows = row_ids.copy(), rows.copy()  # copies, as for the ids: the request buffer is reused
                size[ROW_BYTES] = rows.nbytes
            else:
                row_ids = rows = None
            q = self._queues.get(source)
            if q is None:
                q = self._queues[source] = _Queue()
            q.notes.append([engine, ids.copy(), ends.copy(), row_ids, rows])
            for d in (STEPS, IDS, ROW_BYTES):
                q.held[d] += size[d]
                self._held[d] += size[d]
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="learner", daemon=True)
                self._thread.start()
            self._cv.notify()
        return True

    def _room(self, engine: TableEngine, source: bytes, size: list, make: bool) -> bool:
        """(lock held) Whether a note of `size` from `source` fits every bound, once room is made
        at the expense of the client holding the most of each bound it overflows (make: the
        room is made; otherwise only asked whether the first such cut would spare the note).
        A note that does not fit is counted on `engine` as dropped (notes carrying rows: only
        the rows are left out, uncounted)."""
        mine = self._queues.get(source)
        others = {k: q for k, q in self._queues.items() if k != source}
        for d in (STEPS, IDS, ROW_BYTES):
            if size[d] > BOUNDS[d]:  # more than the whole queue holds: no client's share
                if d != ROW_BYTES:
                    self._dropped(engine, size[STEPS], over_share=True)
                return False
            while self._held[d] + size[d] > BOUNDS[d]:
                most = max(others, key=lambda k: others[k].held[d], default=None)
                if most is None or others[most].held[d] <= (mine.held[d] if mine else 0) + size[d]:
                    if d != ROW_BYTES:  # the sender would hold the most: its note goes
                        self._dropped(engine, size[STEPS], over_share=bool(others))
                    return False
                if not make:
                    break
                self._cut(others[most], d)
                if not others[most].notes:
                    del self._queues[most], others[most]
        return True

    def _cut(self, q: _Queue, d: int) -> None:
        """(lock held) The oldest of `q`'s notes dropped (counted over its client's share), or for
        ROW_BYTES the rows of its oldest note that carries some left out."""
        if d == ROW_BYTES:
            note = next(n for n in q.notes if n[4] is not None)
            self._give_back(q, (0, 0, note[4].nbytes))
            note[3] = note[4] = None
            return
        eng, ids, ends, _, rows = q.notes.popleft()
        self._give_back(q, (ends.size, ids.size, 0 if rows is None else rows.nbytes))
        self._dropped(eng, ends.size, over_share=True)

    def _give_back(self, q: _Queue, size) -> None:
        for d in (STEPS, IDS, ROW_BYTES):
            q.held[d] -= size[d]
            self._held[d] -= size[d]

    @staticmethod
    def _dropped(engine: TableEngine, steps: int, over_share: bool) -> None:
        if over_share:
            engine.counters.notes_over_share += steps
        else:
            engine.counters.notes_behind += steps

    def _turn(self, q: _Queue) -> list:
        """(lock held) The next client's turn: its oldest notes, at most NOTE_TURN_STEPS steps of
        at most NOTE_TURN_IDS ids (at least one step), a note past that split at a step (its
        rows go with both parts: each is found by its id)."""
        turn, steps, n_ids = [], 0, 0
        while q.notes and steps < NOTE_TURN_STEPS:
            note = q.notes[0]
            eng, ids, ends, row_ids, rows = note
            k = min(ends.size, NOTE_TURN_STEPS - steps, int(np.searchsorted(ends, NOTE_TURN_IDS - n_ids, "right")))
            if k == 0 and turn:
                break
            k = max(k, 1)
            cut = int(ends[k - 1])
            if k == ends.size:
                q.notes.popleft()
                self._give_back(q, (k, cut, 0 if rows is None else rows.nbytes))
                turn.append((eng, ids, ends, row_ids, rows))
            else:
                note[1], note[2] = ids[cut:], ends[k:] - cut
                self._give_back(q, (k, cut, 0))
                turn.append((eng, ids[:cut], ends[:k], row_ids, rows))
            steps, n_ids = steps + k, n_ids + cut
        return turn

    def _loop(self) -> None:
        """The clients in turn, each turn's notes of one engine in one Notes.learn call."""
        try:  # bookkeeping yields to readers: on a busy host the policy learns from a sample
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LEARNER_NICE)
        except (AttributeError, OSError):
            pass
        while True:
            with self._cv:
                while not self._queues and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                source, q = self._queues.popitem(last=False)
                turn = self._turn(q)
                if q.notes:
                    self._queues[source] = q  # the back of the line
            self._learn(source, turn)

    @staticmethod
    def _learn(source: bytes, turn: list) -> None:
        groups: dict[int, tuple] = {}
        for eng, ids, ends, row_ids, rows in turn:
            g = groups.setdefault(id(eng), (eng, [], [], [], []))
            g[2].append(ends + sum(a.size for a in g[1]))
            g[1].append(ids)
            if rows is not None:
                g[3].append(row_ids)
                g[4].append(rows)
        for eng, ids, ends, row_ids, rows in groups.values():
            if eng.retired:
                continue
            try:
                carried = (_joined(row_ids), _joined(rows)) if rows else (None, None)
                eng.notes.learn(_joined(ids), _joined(ends), *carried, source=source)
            except Exception:  # noqa: BLE001 - a hint; the next step's note may well work
                log.exception("learning the local steps of table %s failed", eng.table)

    def stop(self) -> None:
        """End the thread after the turn it is learning; notes still queued are dropped."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)


def _joined(arrays: list) -> np.ndarray:
    return np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
