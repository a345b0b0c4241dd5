"""ServedTables, the sidecar's state: which tables it serves, in which mode, from which arena,
and how it moves to another version while serving.

Budget: when every table fits the DRAM budget together, each is held whole
(full mode, slot == id). Otherwise each table gets a cache arena sized in
proportion to its bytes.

Live version swap (`reload`): the new version's engine is built aside (its
arena loaded and verified, or an empty cache arena), then swapped in with one
assignment; new plans get it at their next step. The old engine is *retired*:
its arena header says so (full-resident clients switch at their next step),
its running steps finish on it, and the reaper frees it once its last lease
has ended. A served version holds a shared flock on its directory so
`tierstore gc` never removes it.

One cohesive thing (a little over the house's 300 lines): building, swapping and freeing
engines share one lock and one budget.
"""
from __future__ import annotations

import fcntl
import logging
import os
import secrets
import stat
import threading
import time

import numpy as np

from tierstore.cache import slot_index
from tierstore.store.catalog import BlockChecksums, Catalog
from tierstore.sidecar.config import ServeConfig
from tierstore.engine import TableEngine, make_engine
from tierstore.errors import InvalidArgument, ResourceExhausted, TableNotFound, TierstoreError, VersionNotFound
from tierstore.cache.leases import LeaseTable
from tierstore.tiers.dram import Arena, huge_page_bytes, own_files, page_backing, retire_file, shm_free_bytes
from tierstore.tiers.nvme.reader import SegmentReader
from tierstore.engine.verifier import Verifier
from tierstore.sidecar.startup import StartUpFiles, pause, shm_tag
from tierstore.sidecar.warm_start import WarmStart

__all__ = ["ServedTables"]

log = logging.getLogger("tierstore.sidecar.served")
PREFETCH_QUEUE = 64  # prefetch requests waiting at most; more are dropped (they are hints)
PREFETCH_QUEUE_IDS = 1 << 22  # and their ids waiting at most (8 B each)
# ids in one prefetch hint at most: one queued request's rows (a step is tens of thousands);
# a longer one is refused, so no hint holds more than 8 MiB of the queue
MAX_HINT_IDS = 1 << 20
NOTE_QUEUE_IDS = 1 << 18  # ids of local reads' notes waiting for the learner; more are dropped (hints)
# bytes of rows those notes carry waiting for the learner; past it a note's rows are dropped (its ids
# are still learned, and the misses it promotes are read from disk)
NOTE_QUEUE_ROW_BYTES = 64 << 20
# The learner thread's nice value (Linux: per thread). With 4 local-read clients on this
# project's 2-vCPU VM, +5 let it learn ~20% of the steps (the rest dropped) and readers got
# the CPU: 1.38x and 1.50x one client's rows/s in two runs, against 0.99x and 1.48x at 0;
# hit ratio 0.651 either way (the policy learns as well from a sample of the steps).
LEARNER_NICE = 5


class ServedTables:
    def __init__(self, config: ServeConfig):
        self.config = config
        self.started = time.monotonic()
        self.instance = os.urandom(8).hex()  # clients remap arenas when this changes
        self.tag = shm_tag(config)
        self.engines: dict[str, TableEngine] = {}
        self._retired: list[TableEngine] = []
        self._swap_lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="lease-reaper", daemon=True)
        self.verifier = Verifier(config.verify_sample)
        self.catalog = self.leases = None
        self._profile = None
        self._served_fds: dict[int, int] = {}  # id(engine) -> fd holding the version dir's shared flock
        self._prefetcher = None
        self.recorder = None
        if config.record_trace:
            from tierstore.sidecar.trace_recorder import TraceRecorder
            self.recorder = TraceRecorder(config.record_trace)
        self._prefetch_pending = self._prefetch_ids = 0
        self._notes: list = []  # (engine, ids, ends, row_ids, rows) for the learner thread (note())
        self._notes_ids = self._notes_bytes = 0
        self._notes_cv = threading.Condition(threading.Lock())
        self._learner: threading.Thread | None = None
        self._mooncake = None  # one Mooncake client for every remote table (--remote)
        self.warm = WarmStart(config.data_dir, config.hot_set_interval_s, config.warm_start)
        # until start(), close() removes every shm file made since here (startup.py)
        self._made: StartUpFiles | None = StartUpFiles(config)
        try:
            stale = self._take_stale_files()
            self.leases = LeaseTable(config.max_leases, max_per_client=config.max_leases_per_client,
                                     client_share=config.max_client_share, contention_s=config.lease_ttl_s,
                                     board_path=self._new_name("leases"))
            pause("leases")
            self.catalog = Catalog(config.data_dir, readonly=True)
            self._open_tables(stale)
            pause("tables")
        except BaseException:
            self.close()
            raise

    # ---- names and stale files ---------------------------------------------
    def _new_name(self, what: str):
        return self.config.shm_dir / f"tierstore.{os.getuid()}.{self.tag}.{secrets.token_hex(6)}.{what}"

    def _take_stale_files(self) -> dict:
        """Retire and remove what an earlier sidecar of this identity left (killed, or
        --persist-arena); keep persisted full arenas to re-attach: {(table, version): path}."""
        keep = {}
        for path in own_files(self.config.shm_dir, self.tag):
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
                log.warning("ignoring %s: not a file this user made (planted by someone else?)", path)
                continue
            name = path.name
            if self.config.persist_arena and not name.endswith((".new", ".leases")):
                table, _, v = name.split(".", 4)[-1].rpartition(".v")
                if v.isdigit():
                    keep[(table, int(v))] = path
                    continue
            retire_file(path)
            path.unlink(missing_ok=True)
            log.info("removed stale %s", path)
        return keep

    # ---- tables --------------------------------------------------------------
    def _open_tables(self, stale: dict) -> None:
        cfg = self.config
        versions = [self.catalog.current(t) for t in self.catalog.tables()]
        if not versions:
            raise TableNotFound(f"no tables in {cfg.data_dir}; create one with `tierstore demo-table` or `tierstore ingest`")
        free = shm_free_bytes(cfg.shm_dir)
        if cfg.dram_budget > free:
            raise ResourceExhausted(
                f"--dram-budget {cfg.dram_budget / 2**20:.0f} MiB is more than {cfg.shm_dir} can hold "
                f"({free / 2**20:.0f} MiB free); lower the budget or enlarge {cfg.shm_dir}")
        self.backing = page_backing(cfg.shm_dir)
        (log.info if self.backing.huge else log.warning)("%s", self.backing.why)
        if cfg.profile is not None:
            from tierstore.table.profile import Profile
            self._profile = Profile.load(cfg.profile)
            self.warm.profile = self._profile
        for v in versions:
            self.engines[v.table] = self._build(v, versions, reuse=stale.pop((v.table, v.version), None))
        for path in stale.values():  # persisted arenas of versions no longer current
            retire_file(path)
            path.unlink(missing_ok=True)

    def _layout(self, v, versions) -> tuple[bool, int]:
        """(full, slots) for version v among the versions served together."""
        total = sum(x.rows * x.row_bytes for x in versions)
        if total <= self.config.dram_budget:
            return True, v.rows
        share = self.config.dram_budget * (v.rows * v.row_bytes) / total
        return False, int(min(v.rows, max(1, share // v.row_bytes)))

    def _split(self, v, full: bool) -> int:
        """The bytes of a row's weights when version v is served split-layout (--split-layout), else 0.

        Split arenas are what sglang's and vLLM's kernels address (weight + row * 256, the scales
        after all weights): fp8-e4m3-ue8m0 tables held whole only. A table named that cannot be is
        refused at start (or reload) with the fix; 'all' takes every fp8-e4m3-ue8m0 table."""
        chosen = self.config.split_layout
        if v.table not in chosen and not ("all" in chosen and v.row_format == "fp8-e4m3-ue8m0"):
            return 0
        if v.row_format != "fp8-e4m3-ue8m0":
            raise InvalidArgument(f"--split-layout {v.table}: the table is {v.row_format}; only fp8-e4m3-ue8m0 "
                                  f"tables (weights, then ue8m0 scales) have the engines' split layout")
        if not full:
            raise ResourceExhausted(
                f"--split-layout {v.table}: the table ({v.rows * v.row_bytes / 2**20:.0f} MiB) does not fit "
                f"--dram-budget {self.config.dram_budget / 2**20:.0f} MiB with the others, so it would be a cache; "
                f"a split arena is the whole table: raise --dram-budget, or serve it without --split-layout")
        return v.row_dim  # fp8: one byte per value, then row_dim / 32 scale bytes

    def _build(self, v, versions, reuse=None) -> TableEngine:
        """An engine for version v, its arena loaded and published (verified throughout)."""
        full, slots = self._layout(v, versions)
        split = self._split(v, full)
        checksums = self._checksums(v, full)
        reader = self._reader(v, checksums)
        path = reuse if (reuse is not None and full) else self._new_name(f"{v.table}.v{v.version}")
        try:
            arena = Arena(path, slots, v.row_bytes, reuse=reuse is not None and full, backing=self.backing,
                          split=split)
        except BaseException:
            reader.close()
            raise
        engine = None
        try:
            pause("arena")
            profile = None
            if not full and self._profile is not None and v.table in self._profile.ids:
                profile = (self._profile.ids[v.table], self._profile.counts[v.table])
            from tierstore.cache.policy import PolicyConfig
            index = None
            if not full and self.config.local_reads and slot_index.supported():
                index = self._new_name(f"{v.table}.v{v.version}.index")
            cache_mode = {} if full else dict(policy_config=PolicyConfig(kind=self.config.policy), profile=profile,
                                              index_path=index, instance=self.instance)
            engine = make_engine(v, reader, arena, leases=self.leases, full=full, recorder=self.recorder,
                                 **cache_mode)
            t0 = time.monotonic()
            if full and arena.reattached:
                bad = engine.verify_arena(checksums)
                log.info("table %s v%d: re-attached arena %s, %d bad blocks%s", v.table, v.version, arena.path,
                         len(bad), "; reloading from disk" if bad else "")
                if bad:
                    engine.load_full()
            elif full:
                engine.load_full()
            pause("loaded")
            arena.header.write(instance=self.instance, version=v.version, slots=slots, row_bytes=v.row_bytes,
                               full=full, table=v.table, split=split)
            arena.publish()
            self._hold_version(engine)
            pause("published")
        except BaseException:
            if engine is not None:
                engine.close()
            arena.close(unlink=True)
            reader.close()
            raise
        huge, mapped = huge_page_bytes(arena.path)
        log.info("table %s v%d: %s mode%s, %d slots x %d B (%.1f MiB, %.0f%% of it on %s pages) + %.1f MiB of "
                 "checksums, maps and policy, ready in %.2fs", v.table, v.version, "full" if full else "cache",
                 f" (split: {split} B weights, then scales)" if split else "", slots,
                 v.row_bytes, slots * v.row_bytes / 2**20, 100 * huge / max(mapped, 1),
                 f"{arena.backing.page >> 20} MiB" if arena.backing.huge else "huge", engine.metadata_bytes() / 2**20,
                 time.monotonic() - t0)
        return engine

    def _checksums(self, v, full: bool):
        """Version v's block checksums for its reader: the array (8 B a block) where blocks are
        read whole (full mode loads and checks every block; the remote tier fetches blocks), else,
        for a cache-mode table of segment format 2 on this host's disk, read from the catalog
        when the block path asks (BlockChecksums): its misses check the sums in the records."""
        local = all((self.config.data_dir / s).is_file() for s in v.segments)
        if full or v.segment_format < 2 or not local:
            return self.catalog.checksums(v.table, v.version)
        return BlockChecksums(self.config.data_dir, v)

    def _reader(self, v, checksums):
        """Local segments when this host has them; else, with --remote, the published copy."""
        if self.config.remote and not all((self.config.data_dir / s).is_file() for s in v.segments):
            from tierstore.tiers.remote.mooncake import connect
            from tierstore.tiers.remote.reader import RemoteReader
            if self._mooncake is None:
                self._mooncake = connect(self.config.remote, self.config.metadata)
            local = self._local_copy(v, checksums)
            log.info("table %s v%d: no local rows; reading from Mooncake %s%s", v.table, v.version,
                     self.config.remote, "" if local is None else
                     f", writing them back to {local.dir} ({local.n_present}/{v.n_blocks} blocks there)")
            return RemoteReader(self._mooncake, v, checksums, local=local)
        return SegmentReader(self.config.data_dir, v, checksums, **self._reader_options())

    def _local_copy(self, v, checksums):
        """Where blocks fetched from Mooncake are written back, or None when --data refuses it."""
        from tierstore.tiers.remote.local_copy import LocalCopy
        try:
            return LocalCopy(self.config.data_dir, v, checksums)
        except OSError as e:
            log.warning("table %s v%d: no write-back to %s (%s); every miss goes to Mooncake",
                        v.table, v.version, self.config.data_dir, e)
            return None

    def _reader_options(self) -> dict:
        return {"direct_io": True} if self.config.direct_io else {}

    def _hold_version(self, engine: TableEngine) -> None:
        """A shared flock on the version's directory: `tierstore gc` skips what is served."""
        vdir = self.config.data_dir / "tables" / engine.table / f"v{engine.version.version}"
        try:
            fd = os.open(vdir, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return
        fcntl.flock(fd, fcntl.LOCK_SH)
        self._served_fds[id(engine)] = fd

    def _free(self, engine: TableEngine) -> None:
        engine.close()
        engine.arena.close(unlink=not self.config.persist_arena or engine.retired)
        engine.reader.close()
        fd = self._served_fds.pop(id(engine), None)
        if fd is not None:
            os.close(fd)

    # ---- live version swap --------------------------------------------------
    def reload(self, table: str = "", version: int = 0) -> list[tuple[str, int, int]]:
        """Serve the catalog's current version of every table (or `table` at `version`).

        Returns [(table, old version or 0, new version)] of what changed. Raises
        TableNotFound / VersionNotFound / ResourceExhausted (no room for the new
        arena beside the old one); on any error the old versions keep serving.
        """
        with self._swap_lock:
            if table:
                targets = [self.catalog.get(table, version or None)]
            else:
                if version:
                    raise VersionNotFound("--version needs --table (versions are per table)")
                targets = [self.catalog.current(t) for t in self.catalog.tables()]
            changed = []
            for v in targets:
                old = self.engines.get(v.table)
                if old is not None and old.version.version == v.version:
                    continue
                served = [e.version for t, e in self.engines.items() if t != v.table] + [v]
                new = self._build(v, served)
                new.verifier = self.verifier if self.verifier.enabled else None
                self.engines[v.table] = new  # new plans get it from here on
                self.warm.add(new)
                if old is not None:
                    old.retired = True
                    old.arena.retire()
                    self._retired.append(old)
                changed.append((v.table, old.version.version if old else 0, v.version))
                log.info("table %s: now serving v%d (was %s)", v.table, v.version,
                         f"v{old.version.version}" if old else "not served")
            self.verifier.engines = list(self.engines.values())
            return changed

    def _free_retired(self) -> None:
        """Free retired engines whose last lease has ended."""
        if not self._retired:
            return
        with self._swap_lock:
            keep = []
            for eng in self._retired:
                if self.leases.count_for(eng) or not eng.try_free():
                    keep.append(eng)
                else:
                    self._free(eng)
                    log.info("table %s v%d: retired arena freed", eng.table, eng.version.version)
            self._retired = keep

    # ---- running -------------------------------------------------------------
    def start(self) -> None:
        """Serve: the reaper, verifier and warm start begin. Start-up is over: from here a
        stop keeps persisted arenas (--persist-arena) and close() removes only what it frees."""
        self._made = None
        self._reaper.start()
        for eng in self.engines.values():
            eng.verifier = self.verifier if self.verifier.enabled else None
        self.verifier.start(self.engines.values())
        self.warm.start(list(self.engines.values()), lambda: list(self.engines.values()))

    def _reap_loop(self) -> None:
        while not self._stop.wait(0.05):
            self.leases.reap()
            self._free_retired()

    def prefetch(self, engine: TableEngine, ids, read: bool = True, steps: int | None = None,
                 client: bytes = b"") -> int:
        """Promote ids in the background; read=False only hints them to the policy, for
        `steps` (TableEngine.prefetch). Returns the ids queued: all of them, or 0 when the
        queue already holds PREFETCH_QUEUE requests or PREFETCH_QUEUE_IDS ids (the hint is
        dropped) or the table is held whole (nothing to promote).

        Checked now, before anything is queued, so the caller hears of it: InvalidArgument
        for bad ids or steps, or a hint of more than MAX_HINT_IDS ids."""
        if ids.size > MAX_HINT_IDS:
            raise InvalidArgument(f"a prefetch hint of {ids.size} ids for table {engine.table!r}; at most "
                                  f"{MAX_HINT_IDS} ids a hint: hint the rows of one queued request")
        ids, steps = engine.check_prefetch(ids, steps)
        if engine.full or ids.size == 0:
            return 0
        with self._swap_lock:
            if self._prefetch_pending >= PREFETCH_QUEUE or self._prefetch_ids + ids.size > PREFETCH_QUEUE_IDS:
                return 0
            self._prefetch_pending += 1
            self._prefetch_ids += ids.size
            if self._prefetcher is None:
                from concurrent.futures import ThreadPoolExecutor
                self._prefetcher = ThreadPoolExecutor(2, thread_name_prefix="prefetch")
        self._prefetcher.submit(self._prefetch_one, engine, ids, read, steps, client)
        return ids.size

    def _prefetch_one(self, engine: TableEngine, ids, read: bool, steps: int, client: bytes) -> None:
        try:
            if not engine.retired:
                engine.prefetch(ids, read=read, steps=steps, conn_id=client)
        except Exception:  # noqa: BLE001 - a hint; a bad block surfaces when a step reads it
            log.debug("prefetch of %d ids in %s failed", ids.size, engine.table, exc_info=True)
        finally:
            with self._swap_lock:
                self._prefetch_pending -= 1
                self._prefetch_ids -= ids.size

    def note(self, engine: TableEngine, ids, ends, row_ids=None, rows=None, trusted: bool = False) -> bool:
        """Queue steps a local client read itself (TableEngine.note_access) for the learner
        thread, after checking them (InvalidArgument). False when NOTE_QUEUE_IDS ids already
        wait: the note is dropped, so while the sidecar is behind its policy learns from a
        sample of the steps, and no client ever waits for its bookkeeping. The rows a note
        carries are queued while NOTE_QUEUE_ROW_BYTES allows, else left out (the misses
        they were for are then read from disk if promoted): the queue holds at most that.

        trusted: the peer runs as the sidecar's uid (or root; step_server.peer_trusted). Only
        then are carried records (format 2 under O_DIRECT: each row with its own sum) kept:
        such a peer can write the segments and the arena itself, so a sum it sends guards
        against faults, not forgery. Rows checked against the sidecar's own sums are kept
        from anyone."""
        ids, ends, row_ids, rows = engine.check_note(ids, ends, row_ids, rows)
        if rows is not None and not trusted and rows.shape[1] != engine.version.row_bytes:
            row_ids = rows = None  # records from a peer of another uid: promoted from disk instead
        with self._notes_cv:
            if self._notes_ids and self._notes_ids + ids.size > NOTE_QUEUE_IDS:
                engine.counters.notes_dropped += ends.size
                return False
            if rows is not None and self._notes_bytes + rows.nbytes > NOTE_QUEUE_ROW_BYTES:
                row_ids = rows = None
            if rows is not None:  # copies, as for the ids: the request buffer is reused
                row_ids, rows = row_ids.copy(), rows.copy()
                self._notes_bytes += rows.nbytes
            self._notes.append((engine, ids.copy(), ends.copy(), row_ids, rows))
            self._notes_ids += ids.size
            if self._learner is None:
                self._learner = threading.Thread(target=self._learn_loop, name="learner", daemon=True)
                self._learner.start()
            self._notes_cv.notify()
        return True

    def _learn_loop(self) -> None:
        """Every queued note, all clients' notes of one engine in one note_access call."""
        try:  # bookkeeping yields to readers: on a busy host the policy learns from a sample
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LEARNER_NICE)
        except (AttributeError, OSError):
            pass
        while True:
            with self._notes_cv:
                while not self._notes and not self._stop.is_set():
                    self._notes_cv.wait()
                if self._stop.is_set():
                    return
                batch, self._notes, self._notes_ids, self._notes_bytes = self._notes, [], 0, 0
            groups: dict[int, tuple] = {}
            for eng, ids, ends, row_ids, rows in batch:
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
                    eng.note_access(np.concatenate(ids), np.concatenate(ends), *carried)
                except Exception:  # noqa: BLE001 - a hint; the next step's note may well work
                    log.exception("learning the local steps of table %s failed", eng.table)

    def engine(self, table: str, version: int = 0) -> TableEngine:
        try:
            eng = self.engines[table]
        except KeyError:
            # a hostile name may be megabytes: echo a bounded prefix (status details travel as a header)
            shown = repr(table) if len(table) <= 80 else f"{table[:64]!r}... ({len(table)} characters)"
            raise TableNotFound(f"no table {shown} is served; tables: {sorted(self.engines)}") from None
        if version and version != eng.version.version:
            for old in self._retired:  # a step pinned to the version it started on
                if old.table == table and old.version.version == version:
                    return old
            raise VersionNotFound(f"table {table!r} is served at version {eng.version.version}, not {version}")
        return eng

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
        self._stop.set()
        with self._notes_cv:
            self._notes_cv.notify_all()
        if self._learner is not None:
            self._learner.join(timeout=5)
        if self._reaper.is_alive():
            self._reaper.join(timeout=2)
        self.verifier.stop()
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True, cancel_futures=True)
        self.warm.stop(list(self.engines.values()))  # records the hot sets while the arenas still hold them
        for eng in list(self.engines.values()) + self._retired:
            self._free(eng)
        self.engines.clear()
        self._retired = []
        if self.leases is not None:
            self.leases.close()
        if self.catalog is not None:
            self.catalog.close()
        if self.recorder is not None:
            try:
                self.recorder.close()
            except (TierstoreError, OSError) as e:  # the stop still completes; say why the trace is missing
                log.error("--record-trace: trace not written: %s", e)
        if self._mooncake is not None:
            self._mooncake.close()
            self._mooncake = None


def _joined(arrays: list) -> np.ndarray:
    return np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
