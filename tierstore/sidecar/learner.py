"""Learner: the steps clients on the host read themselves, learned by the sidecar off their path.

A client on the host (client/local_reads.py) reads resident rows without asking the
sidecar, then sends a note of what it read over the step socket. The note is
checked at once and queued; one thread ("learner") hands every queued note to
its engine's policy, all clients' notes of one engine in one note_access call.
The queue is bounded (NOTE_QUEUE_IDS ids, NOTE_QUEUE_ROW_BYTES of carried rows):
past it notes are dropped, so while the sidecar is behind its policy learns from
a sample of the steps and no client ever waits for its bookkeeping.
"""
from __future__ import annotations

import logging
import os
import threading

import numpy as np

from tierstore.engine import TableEngine

__all__ = ["Learner", "NOTE_QUEUE_IDS", "NOTE_QUEUE_ROW_BYTES", "LEARNER_NICE"]

log = logging.getLogger("tierstore.sidecar.served")
NOTE_QUEUE_IDS = 1 << 18  # ids of local reads' notes waiting for the learner; more are dropped (hints)
# bytes of rows those notes carry waiting for the learner; past it a note's rows are dropped (its ids
# are still learned, and the misses it promotes are read from disk)
NOTE_QUEUE_ROW_BYTES = 64 << 20
# The learner thread's nice value (Linux: per thread): on a host with fewer cores than local
# readers, bookkeeping yields the CPU to the readers and the policy learns from the notes it
# gets to (a sample of the steps learns about as well as all of them: docs/benchmarks.md)
LEARNER_NICE = 5


class Learner:
    """The bounded queue of local reads' notes and the thread (made at the first note) that learns them."""

    def __init__(self):
        self._notes: list = []  # (engine, ids, ends, row_ids, rows) waiting for the thread
        self._ids = self._bytes = 0
        self._cv = threading.Condition(threading.Lock())
        self._stop = False
        self._thread: threading.Thread | None = None

    def note(self, engine: TableEngine, ids, ends, row_ids=None, rows=None, trusted: bool = False,
             source: bytes = b"") -> bool:
        """Queue steps a client on the host read itself (TableEngine.note_access) for the learner
        thread, after checking them (InvalidArgument). False when NOTE_QUEUE_IDS ids already
        wait: the note is dropped, so while the sidecar is behind its policy learns from a
        sample of the steps, and no client ever waits for its bookkeeping. The rows a note
        carries are queued while NOTE_QUEUE_ROW_BYTES allows, else left out (the misses
        they were for are then read from disk if promoted): the queue holds at most that.

        trusted: the peer runs as the sidecar's uid (or root; step_server.peer_trusted). Only
        then are carried records (format 2: each row with its own sum) kept:
        such a peer can write the segments and the arena itself, so a sum it sends guards
        against faults, not forgery. Rows checked against the sidecar's own sums are kept
        from anyone. source: the client's conn_id (TableEngine.note_access: another client's
        copy of a step is not learned twice)."""
        ids, ends, row_ids, rows = engine.check_note(ids, ends, row_ids, rows)
        if rows is not None and not trusted and rows.shape[1] != engine.version.row_bytes:
            row_ids = rows = None  # records from a peer of another uid: promoted from disk instead
        with self._cv:
            if self._ids and self._ids + ids.size > NOTE_QUEUE_IDS:
                engine.counters.notes_dropped += ends.size
                return False
            if rows is not None and self._bytes + rows.nbytes > NOTE_QUEUE_ROW_BYTES:
                row_ids = rows = None
            if rows is not None:  # copies, as for the ids: the request buffer is reused
                row_ids, rows = row_ids.copy(), rows.copy()
                self._bytes += rows.nbytes
            self._notes.append((engine, source, ids.copy(), ends.copy(), row_ids, rows))
            self._ids += ids.size
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="learner", daemon=True)
                self._thread.start()
            self._cv.notify()
        return True

    def _loop(self) -> None:
        """Every queued note, each client's notes of one engine in one note_access call."""
        try:  # bookkeeping yields to readers: on a busy host the policy learns from a sample
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LEARNER_NICE)
        except (AttributeError, OSError):
            pass
        while True:
            with self._cv:
                while not self._notes and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                batch, self._notes, self._ids, self._bytes = self._notes, [], 0, 0
            groups: dict[tuple, tuple] = {}
            for eng, source, ids, ends, row_ids, rows in batch:
                g = groups.setdefault((id(eng), source), (eng, [], [], [], [], source))
                g[2].append(ends + sum(a.size for a in g[1]))
                g[1].append(ids)
                if rows is not None:
                    g[3].append(row_ids)
                    g[4].append(rows)
            for eng, ids, ends, row_ids, rows, source in groups.values():
                if eng.retired:
                    continue
                try:
                    carried = (_joined(row_ids), _joined(rows)) if rows else (None, None)
                    eng.note_access(np.concatenate(ids), np.concatenate(ends), *carried, source=source)
                except Exception:  # noqa: BLE001 - a hint; the next step's note may well work
                    log.exception("learning the local steps of table %s failed", eng.table)

    def stop(self) -> None:
        """End the thread after the batch it is learning; notes still queued are dropped."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)


def _joined(arrays: list) -> np.ndarray:
    return np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
