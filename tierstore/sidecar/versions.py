"""ServedVersions: which engine serves each table, and the live version swap.

Live version swap (`reload`): the new version's engine is built aside (its
arena loaded and verified, or an empty cache arena), then swapped in with one
assignment; new plans get it at their next step. The old engine is *retired*:
its arena header says so (full-resident clients switch at their next step),
its running steps finish on it, and free_retired (the lease reaper's) frees it
once its last lease has ended.

Building, swapping and freeing share one lock and one budget: a reload sizes
the new arena among the versions served beside it, and nothing is freed while
a swap is half done.
"""
from __future__ import annotations

import logging
import threading

from tierstore.engine import TableEngine
from tierstore.errors import TableNotFound, VersionNotFound
from tierstore.sidecar.builder import EngineBuilder

__all__ = ["ServedVersions"]

log = logging.getLogger("tierstore.sidecar.served")


class ServedVersions:
    """The engine serving each table's current version (`engines`, table -> engine) and the
    retired ones still finishing steps. Every engine that starts serving is wired to the
    verifier here (_serve), at start-up and on a reload alike."""

    def __init__(self, builder: EngineBuilder, catalog, leases, verifier, warm):
        self.builder, self.catalog, self.leases, self.verifier, self.warm = builder, catalog, leases, verifier, warm
        self.engines: dict[str, TableEngine] = {}
        self._retired: list[TableEngine] = []
        self._lock = threading.Lock()

    def open(self, stale: dict) -> None:
        """Serve the catalog's current version of every table (TableNotFound when there is none),
        re-attaching the persisted arenas in `stale` ({(table, version): path}) and removing
        those of versions no longer current."""
        versions = [self.catalog.current(t) for t in self.catalog.tables()]
        if not versions:
            raise TableNotFound(f"no tables in {self.builder.config.data_dir}; create one with "
                                f"`tierstore demo-table` or `tierstore ingest`")
        self.builder.prepare(self.catalog, self.leases)
        for v in versions:
            self._serve(self.builder.build(v, versions, reuse=stale.pop((v.table, v.number), None)))
        for path in stale.values():  # persisted arenas of versions no longer current
            self.builder.remove_stale(path)

    def _serve(self, engine: TableEngine) -> None:
        """New plans of engine's table get it from here on; the verifier samples its rows (when on)
        and scrubs it (full mode)."""
        engine.verifier = self.verifier if self.verifier.enabled else None
        self.engines[engine.table] = engine
        self.verifier.engines = list(self.engines.values())

    def reload(self, table: str = "", version: int = 0) -> list[tuple[str, int, int]]:
        """Serve the catalog's current version of every table (or `table` at `version`).

        Returns [(table, old version or 0, new version)] of what changed. Raises
        TableNotFound / VersionNotFound / ResourceExhausted (no room for the new
        arena beside the old one); on any error the old versions keep serving.
        """
        with self._lock:
            if table:
                targets = [self.catalog.get(table, version or None)]
            else:
                if version:
                    raise VersionNotFound("--version needs --table (versions are per table)")
                targets = [self.catalog.current(t) for t in self.catalog.tables()]
            changed = []
            for v in targets:
                old = self.engines.get(v.table)
                if old is not None and old.version.number == v.number:
                    continue
                served = [e.version for t, e in self.engines.items() if t != v.table] + [v]
                new = self.builder.build(v, served)
                self._serve(new)
                self.warm.add(new)
                if old is not None:
                    old.retired = True
                    old.arena.retire()
                    self._retired.append(old)
                changed.append((v.table, old.version.number if old else 0, v.number))
                log.info("table %s: now serving v%d (was %s)", v.table, v.number,
                         f"v{old.version.number}" if old else "not served")
            return changed

    def engine(self, table: str, version: int = 0) -> TableEngine:
        """The engine serving `table`, or the retired one of `version` a running step is pinned to.
        TableNotFound / VersionNotFound otherwise."""
        try:
            eng = self.engines[table]
        except KeyError:
            # a hostile name may be megabytes: echo a bounded prefix (status details travel as a header)
            shown = repr(table) if len(table) <= 80 else f"{table[:64]!r}... ({len(table)} characters)"
            raise TableNotFound(f"no table {shown} is served; tables: {sorted(self.engines)}") from None
        if version and version != eng.version.number:
            for old in self._retired:  # a step pinned to the version it started on
                if old.table == table and old.version.number == version:
                    return old
            raise VersionNotFound(f"table {table!r} is served at version {eng.version.number}, not {version}")
        return eng

    def free_retired(self) -> None:
        """Free retired engines whose last lease has ended."""
        if not self._retired:
            return
        with self._lock:
            keep = []
            for eng in self._retired:
                if self.leases.count_for(eng) or not eng.try_free():
                    keep.append(eng)
                else:
                    self.builder.free(eng)
                    log.info("table %s v%d: retired arena freed", eng.table, eng.version.number)
            self._retired = keep

    def close(self) -> None:
        """Free every engine, current and retired (the threads that use them have stopped)."""
        for eng in list(self.engines.values()) + self._retired:
            self.builder.free(eng)
        self.engines.clear()
        self._retired = []
