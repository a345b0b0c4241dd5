"""The sidecar behind the step socket: ServedSteps implements tierstore.sidecar.step_server's
StepHandler over the served tables (tierstore/sidecar/served.py)."""
from __future__ import annotations

import logging
import threading
import time

from tierstore.sidecar.config import ServeConfig
from tierstore.errors import TierstoreError
from tierstore.proto.frames import PlanResult
from tierstore.cache.leases import requested_ttl
from tierstore.sidecar.served import ServedTables

__all__ = ["ServedSteps", "NOTE_LOG_INTERVAL_S"]

log = logging.getLogger("tierstore.sidecar.step_server")
NOTE_LOG_INTERVAL_S = 10.0  # refused notes: at most one log line a table this often (each is counted)


class ServedSteps:
    """The sidecar behind the step socket (tierstore/sidecar/step_server.py): every table of a
    step in one request, releases riding along; leases belong to the connection's conn_id
    and end when it disconnects."""

    def __init__(self, served: ServedTables, cfg: ServeConfig, metrics):
        self.served, self.cfg, self.metrics = served, cfg, metrics
        self._observe = metrics.observer("StepPlan")
        self._served: dict[str, tuple] = {}  # table -> (engine, version, arena path, arena slots) last served
        self._refusals: dict[str, list] = {}  # table -> [time of its last log line, refusals since]
        self._refusals_lock = threading.Lock()

    def plan(self, conn_id: bytes, items, release) -> list:
        t0 = time.perf_counter()
        if len(release):
            self.served.leases.release(release, conn_id)
        out = []
        for it in items:
            try:
                eng = self.served.engine(it.table, it.version)
                ttl = requested_ttl(self.cfg.lease_ttl_s, it.ttl_ms) if it.ttl_ms else self.cfg.lease_ttl_s
                res = eng.plan(it.ids.copy(), ttl, conn_id, it.request_id)  # a copy: the buffer is reused
                served = self._served.get(it.table)
                if served is None or served[0] is not eng:  # str() of the arena's Path once, not per step
                    served = self._served[it.table] = (eng, eng.version.number, str(eng.arena.path), eng.arena.slots)
                expires = int((time.time() + res.expires_s) * 1000) if res.lease_id else 0
                out.append(PlanResult(res.lease_id, served[1], res.slots, res.hits, res.misses, res.unique, expires,
                                      "", served[2], served[3]))
            except TierstoreError as e:
                out.append(e)
        self._observe(time.perf_counter() - t0)
        return out

    def note(self, conn_id: bytes, items, trusted: bool = False) -> None:
        """Steps a client on the host read itself: the engine's policy learns them, misses are promoted
        (from the rows the note carries, verified, where it carries them). trusted: the peer has
        the sidecar's uid (Learner.note)."""
        for it in items:
            try:
                eng = self.served.engine(it.table, it.version)
            except TierstoreError:
                continue  # swapped out or gone: the client re-describes the table on its next step
            if eng.full or eng.retired:
                continue
            try:
                # checked now, learned by the sidecar's learner thread
                self.served.note(eng, it.ids, it.ends, it.row_ids, it.rows, trusted, conn_id)
            except TierstoreError as e:
                eng.counters.notes_refused += 1
                self._log_refusal(it.table, e)

    def _log_refusal(self, table: str, err: TierstoreError) -> None:
        """One line for a table's first refused note, then at most one every NOTE_LOG_INTERVAL_S
        saying how many were refused since: a client that sends bad notes in a loop is told
        about in Stats (notes_refused), not by a line per note."""
        now = time.monotonic()
        with self._refusals_lock:
            seen = self._refusals.get(table)
            if seen is None:
                self._refusals[table] = [now, 0]
            elif now - seen[0] < NOTE_LOG_INTERVAL_S:
                seen[1] += 1
                return
            else:
                since, n = now - seen[0], seen[1] + 1
                seen[:] = [now, 0]
        if seen is None:
            log.warning("access note from a client on the host for table %r refused: %s (further refusals are counted "
                        "in Stats notes_refused and logged at most every %g s)", table, err, NOTE_LOG_INTERVAL_S)
        else:
            log.warning("access notes from clients on the host for table %r: %d refused in the last %.0f s, "
                        "the latest: %s", table, n, since, err)

    def release(self, conn_id: bytes, lease_ids) -> int:
        return self.served.leases.release(lease_ids, conn_id)

    def disconnected(self, conn_id: bytes) -> None:
        self.served.leases.release_client(conn_id)

    def instance(self) -> str:
        return self.served.instance
