"""A bounded pipeline: items from a source through stages, each stage in its own thread.

Ingest reads, checksums, writes and reads back a table's chunks. One after
another, each waits for the others; in a pipeline chunk k is read while k-1 is
hashed, k-2 written and k-3 read back, so the slowest stage sets the pace. The
stages spend their time in code that releases the GIL (pread/pwrite, numpy
copies, compiled row sums, xxh3 of whole buffers), so threads overlap.

Invariants:
- Items leave every stage in the order the source made them.
- At most `in_flight` items are out at once, from the source asked for one
  until the caller asks for the next after it: memory is bounded, and a source
  may reuse a buffer `in_flight` items later (a ring of that many).
- The first exception in any thread (the source, a stage) stops every thread
  and is raised in the caller's thread, unchanged; `close()` (also on leaving
  the `with`) returns only once every thread has stopped, so nothing touches
  the caller's files after it.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Iterable, Iterator

__all__ = ["Pipeline"]

_END = object()
_POLL_S = 0.05  # how often a blocked thread looks for a stop


class Pipeline:
    """`for out in Pipeline(source, [f, g], in_flight=4): ...` yields g(f(item))
    for each item of `source`, in order; f and g run in threads of their own,
    as does the iteration of `source`."""

    def __init__(self, source: Iterable, stages: list[Callable], *, in_flight: int, name: str = "pipeline"):
        if in_flight < 1:
            raise ValueError(f"in_flight must be >= 1, got {in_flight}")
        self._slots = threading.Semaphore(in_flight)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._queues = [queue.Queue(maxsize=1) for _ in range(len(stages) + 1)]
        self._threads = [threading.Thread(target=self._pull, args=(iter(source), self._queues[0]),
                                          name=f"{name}-source", daemon=True)]
        for i, fn in enumerate(stages):
            self._threads.append(threading.Thread(target=self._run, args=(fn, self._queues[i], self._queues[i + 1]),
                                                  name=f"{name}-{getattr(fn, '__name__', i)}", daemon=True))
        for t in self._threads:
            t.start()

    # ---- threads -----------------------------------------------------------
    def _fail(self, e: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = e
        self._stop.set()

    def _put(self, q: queue.Queue, item) -> bool:
        while not self._stop.is_set():
            try:
                q.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                pass
        return False

    def _get(self, q: queue.Queue):
        while not self._stop.is_set():
            try:
                return q.get(timeout=_POLL_S)
            except queue.Empty:
                pass
        return _END

    def _pull(self, it: Iterator, out: queue.Queue) -> None:
        try:
            while not self._stop.is_set():
                if not self._slots.acquire(timeout=_POLL_S):
                    continue
                try:
                    item = next(it)
                except StopIteration:
                    self._put(out, _END)
                    return
                if not self._put(out, item):
                    return
        except BaseException as e:  # the caller sees it, whatever it is
            self._fail(e)

    def _run(self, fn: Callable, inq: queue.Queue, out: queue.Queue) -> None:
        try:
            while True:
                item = self._get(inq)
                if item is _END:
                    self._put(out, _END)
                    return
                if not self._put(out, fn(item)):
                    return
        except BaseException as e:
            self._fail(e)

    # ---- the caller --------------------------------------------------------
    def __iter__(self):
        last = self._queues[-1]
        while True:
            item = self._get(last)
            if self._error is not None:
                self.close()
                raise self._error
            if item is _END:
                self.close()
                return
            yield item
            self._slots.release()  # the caller is done with it

    def close(self) -> None:
        """Stop every thread and wait for it (a stage in a syscall finishes that call)."""
        self._stop.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
