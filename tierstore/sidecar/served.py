"""ServedTables, the sidecar's state: the one object its transports (server.py, served_steps.py)
talk to. It composes one part per job:

    builder.py     EngineBuilder     sizing, building and freeing engines, stale shm files
    versions.py    ServedVersions    which engine serves each table; the live version swap
    reaper.py      LeaseReaper       expired leases ended, retired versions freed (a thread)
    prefetcher.py  Prefetcher        prefetch hints on a bounded queue (a thread pool)
    learner.py     Learner           local reads' notes, a bounded queue per client (a thread)
    warm_start.py  WarmStart         hot sets recorded and promoted (a thread)

and the lease table, the catalog and the verifier they share.
"""
from __future__ import annotations

import os
import time

from tierstore.cache.leases import LeaseTable
from tierstore.engine import TableEngine
from tierstore.engine.verifier import Verifier
from tierstore.sidecar.builder import EngineBuilder
from tierstore.sidecar.config import ServeConfig
from tierstore.sidecar.learner import Learner
from tierstore.sidecar.prefetcher import Prefetcher
from tierstore.sidecar.reaper import LeaseReaper
from tierstore.sidecar.startup import StartUpFiles, pause
from tierstore.sidecar.versions import ServedVersions
from tierstore.sidecar.warm_start import WarmStart
from tierstore.store.catalog import Catalog

__all__ = ["ServedTables"]


class ServedTables:
    """The tables one sidecar serves, from construction to close().

    Construction is start-up: stale shm files of this sidecar's identity are removed, the
    lease board is made and every table's current version is built (its arena loaded and
    published). A start-up that raises, or is ended by a signal, removes every shm file it
    made, persisted or not (StartUpFiles), and re-raises. start() begins serving: the
    reaper, verifier and warm start threads run, and from then on close() keeps persisted
    arenas (--persist-arena) and removes only what it frees.

    While serving: engine() names the engine a step of a table (at a version) runs on,
    reload() swaps versions live, prefetch() and note() queue hints and local reads'
    notes (each checked at once: InvalidArgument), and the lease table (`leases`) is the
    transports' for releases. engines: table -> the engine serving its current version.
    Safe to call from any number of RPC and step-socket threads.

    close() stops every thread before it frees anything: the learner, the reaper, the
    verifier and the prefetch pool, then warm start (recording the hot sets while the
    arenas still hold them); then every engine, current and retired, is freed; then the
    lease board, the catalog, the trace (--record-trace) and the Mooncake client close.
    """

    def __init__(self, config: ServeConfig):
        self.config = config
        self.started = time.monotonic()
        self.instance = os.urandom(8).hex()  # clients remap arenas when this changes
        self.verifier = Verifier(config.verify_sample)
        self.catalog = self.leases = self.versions = None
        self.prefetcher, self.learner = Prefetcher(), Learner()
        self.builder = EngineBuilder(config, self.instance)
        self.warm = WarmStart(config.data_dir, config.hot_set_interval_s, config.warm_start,
                              record=config.record_hot_sets)
        # until start(), close() removes every shm file made since here (startup.py)
        self._made: StartUpFiles | None = StartUpFiles(config)
        self.reaper = None
        try:
            stale = self.builder.take_stale_files()
            self.leases = LeaseTable(config.max_leases, max_per_client=config.max_leases_per_client,
                                     client_share=config.max_client_share, contention_s=config.lease_ttl_s,
                                     board_path=self.builder.new_name("leases"))
            pause(config, "leases")
            self.catalog = Catalog(config.data_dir, readonly=True)
            self.versions = ServedVersions(self.builder, self.catalog, self.leases, self.verifier, self.warm)
            self.reaper = LeaseReaper(self.leases, self.versions)
            self.versions.open(stale)
            self.warm.profile = self.builder.profile
            pause(config, "tables")
        except BaseException:
            self.close()
            raise

    @property
    def engines(self) -> dict[str, TableEngine]:
        """table -> the engine serving its current version (ServedVersions.engines)."""
        return self.versions.engines if self.versions is not None else {}

    def start(self) -> None:
        """Serve: the reaper, verifier and warm start begin. Start-up is over: from here a
        stop keeps persisted arenas (--persist-arena) and close() removes only what it frees."""
        self._made = None
        self.reaper.start()
        self.verifier.start()
        self.warm.start(list(self.engines.values()), lambda: list(self.engines.values()))

    def engine(self, table: str, version: int = 0) -> TableEngine:
        """The engine a step of `table` runs on (ServedVersions.engine)."""
        return self.versions.engine(table, version)

    def reload(self, table: str = "", version: int = 0) -> list[tuple[str, int, int]]:
        """Swap to the catalog's current versions, or `table` at `version` (ServedVersions.reload)."""
        return self.versions.reload(table, version)

    def prefetch(self, engine: TableEngine, ids, read: bool = True, steps: int | None = None,
                 conn_id: bytes = b"") -> int:
        """Queue a prefetch hint; the ids queued, 0 when dropped (Prefetcher.submit)."""
        return self.prefetcher.submit(engine, ids, read, steps, conn_id)

    def note(self, engine: TableEngine, ids, ends, row_ids=None, rows=None, trusted: bool = False,
             source: bytes = b"") -> bool:
        """Queue a client on the host's steps for the learner; False when dropped (Learner.note)."""
        return self.learner.note(engine, ids, ends, row_ids, rows, trusted, source)

    def close(self) -> None:
        """Stop every thread and free every engine. Before start() (a start-up that failed or
        was signalled) also remove every shm file made since the constructor began, persisted
        or not, half-built ones included (StartUpFiles), even when freeing raised."""
        try:
            self._close()
        finally:
            if self._made is not None:
                self._made.remove()

    def _close(self) -> None:
        self.learner.stop()
        if self.reaper is not None:
            self.reaper.stop()
        self.verifier.stop()
        self.prefetcher.stop()
        self.warm.stop(list(self.engines.values()))  # records the hot sets while the arenas still hold them
        if self.versions is not None:
            self.versions.close()
        if self.leases is not None:
            self.leases.close()
        if self.catalog is not None:
            self.catalog.close()
        self.builder.close()
