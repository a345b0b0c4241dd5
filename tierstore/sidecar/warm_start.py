"""WarmStart: a cache-mode arena that starts where the last sidecar left off.

The sidecar records each cache-mode table's hot set (its resident rows, hottest
first: HotSet.record) to the data directory every `hot_set_interval_s`
and when it stops (tierstore/store/hot_set.py: per table version, written
atomically). A start promotes the recorded set in the background, hottest first,
into free slots only (HotSet.warm); without one, the `--profile` hot list
of the table is the seed. Serving does not wait: the sidecar says SERVING before
the warm-up begins, and plans, local reads and the learner run beside it.

`--no-record-hot-sets` records nothing (a benchmark's sidecar over a user's data
directory leaves the hot sets of the sidecar that serves it as they were).

A hot set recorded for another table or version is ignored with one log line, a
damaged one with a warning: the table starts cold, never wrong (every promoted
row is read and verified from the segment files like any miss).

One thread ("warm-start", nice +5 as the learner: readers get the CPU first)
warms the tables in order, then records every interval until the sidecar stops.
"""
from __future__ import annotations

import logging
import os
import threading
import time

from tierstore.store.hot_set import HotSetCorrupt, HotSetMismatch, load_hot_set, save_hot_set

__all__ = ["WarmStart"]

log = logging.getLogger("tierstore.sidecar.warm_start")
WARM_NICE = 5


class WarmStart:
    def __init__(self, data_dir, interval_s: float, warm: bool = True, profile=None, record: bool = True):
        """interval_s: seconds between recordings (0: only at stop); warm: promote the seed
        at start (--no-warm-start: record only); profile: a tierstore.table.profile.Profile;
        record: write hot sets at all (--no-record-hot-sets: never)."""
        self.data_dir, self.interval_s, self.warm, self.profile = data_dir, interval_s, warm, profile
        self.recording = record
        self._stop = threading.Event()
        self._todo: list = []  # engines to warm, in order
        self._cv = threading.Condition()
        self._warming: set[int] = set()  # id(engine) queued or warming: its old file is kept
        self._thread: threading.Thread | None = None
        self._unwritable: set[int] = set()  # engines whose hot set could not be written (warned once)

    def start(self, engines, current) -> None:
        """Warm `engines` (those of cache mode) in the background, then record `current()`'s
        engines every interval."""
        for eng in engines:
            self.add(eng)
        self._current = current
        self._thread = threading.Thread(target=self._loop, name="warm-start", daemon=True)
        self._thread.start()

    def add(self, engine) -> None:
        """Queue a newly served engine (a start, a reload) for its warm-up."""
        if engine.full or not self.warm:
            return
        with self._cv:
            self._todo.append(engine)
            self._warming.add(id(engine))
            self._cv.notify()

    def stop(self, engines) -> None:
        """Stop warming, then record the hot set of each engine (the sidecar is stopping).
        A sidecar that never started serving records nothing: its empty arenas would
        replace the hot sets the next start needs."""
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        if self._thread is None:
            return
        self._thread.join(timeout=30)
        self.record(engines)

    def record(self, engines) -> None:
        """Write each cache-mode engine's hot set; one whose warm-up has not finished keeps
        its old file (a half-warmed arena would record less than it was given)."""
        if not self.recording:
            return
        for eng in engines:
            if eng.full or eng.retired or id(eng) in self._warming:
                continue
            try:
                ids, counts = eng.hot_set.record()
                save_hot_set(self.data_dir, eng.version, ids, counts)
            except OSError as e:
                if id(eng) not in self._unwritable:
                    self._unwritable.add(id(eng))
                    log.warning("table %s v%d: cannot record its hot set in %s (%s); the next start is cold",
                                eng.table, eng.version.number, self.data_dir, e)

    def _loop(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WARM_NICE)
        except (AttributeError, OSError):
            pass
        next_record = time.monotonic() + self.interval_s
        while not self._stop.is_set():
            with self._cv:
                eng = self._todo.pop(0) if self._todo else None
            if eng is not None:
                try:
                    self._warm(eng)
                except Exception:  # noqa: BLE001 - a hint: the table serves cold instead
                    log.exception("table %s v%d: warm start failed; serving cold", eng.table, eng.version.number)
                finally:
                    self._warming.discard(id(eng))
                continue
            if self.interval_s and time.monotonic() >= next_record:
                self.record(list(self._current()))
                next_record = time.monotonic() + self.interval_s
            with self._cv:
                if not self._todo and not self._stop.is_set():
                    wait = (next_record - time.monotonic()) if self.interval_s else None
                    self._cv.wait(None if wait is None else max(0.0, wait))

    def _warm(self, eng) -> None:
        v = eng.version
        counts, source = None, None
        try:
            hot = load_hot_set(self.data_dir, v)
        except HotSetMismatch as e:
            log.info("table %s v%d: ignoring a hot set: %s", v.table, v.number, e)
            hot = None
        except (HotSetCorrupt, OSError) as e:
            log.warning("table %s v%d: ignoring a damaged hot set: %s", v.table, v.number, e)
            hot = None
        if hot is not None:
            ids, counts, source = hot.ids, hot.counts, "its recorded hot set"
        elif self.profile is not None and v.table in self.profile.ids:
            ids, source = self.profile.hot(v.table, eng.capacity), "--profile"  # the sketch has its counts
        if source is None or eng.retired:
            return
        t0 = time.monotonic()
        n = eng.hot_set.warm(ids[:eng.capacity], None if counts is None else counts[:eng.capacity], self._stop)
        log.info("table %s v%d: warm start from %s: %d of %d rows promoted in %.2fs", v.table, v.number,
                 source, n, min(ids.size, eng.capacity), time.monotonic() - t0)
