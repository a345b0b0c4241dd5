"""The sidecar's state: which tables it serves, in which mode, from which arena.

Budget: when every table fits the DRAM budget together, each is held whole
(full mode, slot == id). Otherwise each table gets a cache arena sized in
proportion to its bytes.
"""
from __future__ import annotations

import logging
import os
import threading
import time


from tierstore.catalog import Catalog
from tierstore.config import ServeConfig
from tierstore.engine import TableEngine
from tierstore.errors import ResourceExhausted, TableNotFound, VersionNotFound
from tierstore.leases import LeaseTable
from tierstore.tiers.dram import Arena, arena_path, shm_free_bytes
from tierstore.tiers.nvme import SegmentReader
from tierstore.verifier import Verifier

log = logging.getLogger("tierstore.sidecar")


class Sidecar:
    def __init__(self, config: ServeConfig):
        self.config = config
        self.started = time.monotonic()
        self.instance = os.urandom(8).hex()  # clients remap arenas when this changes
        self.leases = LeaseTable(config.max_leases)
        self.catalog = Catalog(config.data_dir, readonly=True)
        self.engines: dict[str, TableEngine] = {}
        self._stop = threading.Event()
        self.verifier = Verifier(config.verify_sample)
        self._reaper = threading.Thread(target=self._reap_loop, name="lease-reaper", daemon=True)
        try:
            self._open_tables()
        except BaseException:
            self.close()
            raise

    def _open_tables(self) -> None:
        cfg = self.config
        versions = [self.catalog.current(t) for t in self.catalog.tables()]
        if not versions:
            raise TableNotFound(f"no tables in {cfg.data_dir}; create one with `tierstore demo-table` or `tierstore ingest`")
        free = shm_free_bytes(cfg.shm_dir)
        if cfg.dram_budget > free:
            raise ResourceExhausted(
                f"--dram-budget {cfg.dram_budget / 2**20:.0f} MiB is more than {cfg.shm_dir} can hold "
                f"({free / 2**20:.0f} MiB free); lower the budget or enlarge {cfg.shm_dir}")
        total = sum(v.rows * v.row_bytes for v in versions)
        full = total <= cfg.dram_budget
        owner = str(cfg.socket or cfg.listen)
        profile = None
        if cfg.profile is not None:
            from tierstore.client.profile import Profile
            profile = Profile.load(cfg.profile)
        for v in versions:
            if full:
                slots = v.rows
            else:
                share = cfg.dram_budget * (v.rows * v.row_bytes) / total
                slots = int(min(v.rows, max(1, share // v.row_bytes)))
            checksums = self.catalog.checksums(v.table, v.version)
            reader = SegmentReader(cfg.data_dir, v, checksums, direct_io=cfg.direct_io)
            # only a full arena can be verified block by block; a cache arena starts empty
            arena = Arena(arena_path(cfg.shm_dir, owner, v.table, v.version), slots, v.row_bytes,
                          reuse=cfg.persist_arena and full)
            policy = None
            if not full:
                from tierstore.policy import CachePolicy, PolicyConfig
                policy = CachePolicy(slots, v.rows, PolicyConfig(kind=cfg.policy))
                if profile is not None and v.table in profile.ids:
                    policy.load_profile(profile.ids[v.table], profile.counts[v.table])
            engine = TableEngine(v, reader, arena, leases=self.leases, full=full, policy=policy)
            self.engines[v.table] = engine
            t0 = time.monotonic()
            if full and arena.reattached:
                bad = engine.verify_arena(checksums)
                log.info("table %s v%d: re-attached arena %s, %d bad blocks%s", v.table, v.version, arena.path,
                         len(bad), "; reloading from disk" if bad else "")
                if bad:
                    engine.load_full()
            elif full:
                engine.load_full()
            arena.publish()
            log.info("table %s v%d: %s mode, %d slots x %d B (%.1f MiB) ready in %.2fs",
                     v.table, v.version, "full" if full else "cache", slots, v.row_bytes,
                     slots * v.row_bytes / 2**20, time.monotonic() - t0)

    def start(self) -> None:
        self._reaper.start()
        for eng in self.engines.values():
            eng.verifier = self.verifier if self.verifier.enabled else None
        self.verifier.start(self.engines.values())

    def _reap_loop(self) -> None:
        while not self._stop.wait(0.05):
            self.leases.reap()

    def engine(self, table: str, version: int = 0) -> TableEngine:
        try:
            eng = self.engines[table]
        except KeyError:
            # a hostile name may be megabytes: echo a bounded prefix (status details travel as a header)
            shown = repr(table) if len(table) <= 80 else f"{table[:64]!r}... ({len(table)} characters)"
            raise TableNotFound(f"no table {shown} is served; tables: {sorted(self.engines)}") from None
        if version and version != eng.version.version:
            raise VersionNotFound(f"table {table!r} is served at version {eng.version.version}, not {version}")
        return eng

    def close(self) -> None:
        self._stop.set()
        self.verifier.stop()
        for eng in self.engines.values():
            eng.arena.close(unlink=not self.config.persist_arena)
            eng.reader.close()
        self.engines.clear()
        self.catalog.close()
