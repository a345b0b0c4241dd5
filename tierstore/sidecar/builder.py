"""EngineBuilder: how the sidecar sizes, builds and frees the engine of a table version.

Budget: when every table fits the DRAM budget together, each is held whole
(full mode, slot == id). Otherwise each table gets a cache arena sized in
proportion to its bytes.

Every file a sidecar makes in its shm directory is named
tierstore.<uid>.<tag>.<token>.<what> (new_name; startup.py relies on it). Files of
the same tag an earlier sidecar left (killed, or --persist-arena) are retired and
removed as this one starts, except persisted full arenas, which build() re-attaches
after verifying every block.

A built engine's arena is loaded (full mode), verified and published, and its
version directory holds a shared flock until free(), so `tierstore gc` never
removes a version that is served.
"""
from __future__ import annotations

import fcntl
import logging
import os
import secrets
import stat
import time
from pathlib import Path

from tierstore.cache import slot_index
from tierstore.store.catalog import BlockChecksums
from tierstore.sidecar.config import ServeConfig
from tierstore.engine import TableEngine, make_engine
from tierstore.errors import InvalidArgument, ResourceExhausted, TierstoreError
from tierstore.tiers.dram import Arena, own_files, retire_file, shm_free_bytes
from tierstore.tiers.pages import SMALL_PAGE, PageBacking, arena_backing, huge_page_bytes
from tierstore.tiers.nvme.reader import SegmentReader
from tierstore.sidecar.startup import pause, shm_tag

__all__ = ["EngineBuilder"]

log = logging.getLogger("tierstore.sidecar.served")


class EngineBuilder:
    """Builds the engines of one sidecar and frees them.

    Use: take_stale_files() first, prepare() once the catalog and lease table exist,
    then build() per version served (at start-up and on every reload) and free() each
    engine once nothing uses it; close() last. instance: the sidecar's instance id,
    written into every arena header (clients remap arenas when it changes)."""

    def __init__(self, config: ServeConfig, instance: str):
        self.config = config
        self.instance = instance
        self.tag = shm_tag(config)
        self.catalog = self.leases = self.backing = self.profile = None
        self._served_fds: dict[int, int] = {}  # id(engine) -> fd holding the version dir's shared flock
        self._mooncake = None  # one Mooncake client for every remote table (--remote)
        self.recorder = None
        if config.record_trace:
            from tierstore.sidecar.trace_recorder import TraceRecorder
            self.recorder = TraceRecorder(config.record_trace)

    # ---- names and stale files ---------------------------------------------
    def new_name(self, what: str, directory: Path | None = None) -> Path:
        """A fresh shm path of this sidecar's tag for `what` (an arena, an index, the lease board),
        in `directory` (an arena's: its PageBacking's) or the shm directory."""
        name = f"tierstore.{os.getuid()}.{self.tag}.{secrets.token_hex(6)}.{what}"
        return (directory or self.config.shm_dir) / name

    def take_stale_files(self) -> dict:
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
            self.remove_stale(path)
            log.info("removed stale %s", path)
        return keep

    @staticmethod
    def remove_stale(path: Path) -> None:
        """Retire (a client still mapping it switches away) and remove a file start-up will not use."""
        retire_file(path)
        path.unlink(missing_ok=True)

    # ---- sizing ----------------------------------------------------------------
    def prepare(self, catalog, leases) -> None:
        """Choose where the arenas live and on what pages (tiers/pages.arena_backing: the
        errors of --arena-pages), check the DRAM budget against a tmpfs that holds them
        (ResourceExhausted; a hugetlbfs pool was checked by the choice) and load --profile;
        catalog and leases serve every build."""
        cfg = self.config
        self.catalog, self.leases = catalog, leases
        self.backing = arena_backing(cfg.shm_dir, cfg.dram_budget, cfg.arena_pages)
        if self.backing.how != "hugetlbfs":
            free = shm_free_bytes(cfg.shm_dir)
            if cfg.dram_budget > free:
                raise ResourceExhausted(
                    f"--dram-budget {cfg.dram_budget / 2**20:.0f} MiB is more than {cfg.shm_dir} can hold "
                    f"({free / 2**20:.0f} MiB free); lower the budget or enlarge {cfg.shm_dir}")
        quiet = self.backing.huge or cfg.arena_pages == "small"
        (log.info if quiet else log.warning)("%s", self.backing.why)
        if cfg.profile is not None:
            from tierstore.table.profile import Profile
            self.profile = Profile.load(cfg.profile)

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

    # ---- building ----------------------------------------------------------------
    def build(self, v, versions, reuse=None) -> TableEngine:
        """An engine for version v, sized among `versions` (those served together), its arena
        loaded and published (verified throughout); reuse: a persisted arena of v to re-attach.
        On any error nothing it made is left (the arena is unlinked, the reader closed)."""
        full, slots = self._layout(v, versions)
        split = self._split(v, full)
        if reuse is not None and Path(reuse).parent != self.backing.dir:
            log.info("table %s v%d: not re-attaching %s: arenas now live in %s", v.table, v.number, reuse,
                     self.backing.dir)
            self.remove_stale(reuse)
            reuse = None
        checksums = self._checksums(v, full)
        reader = self._reader(v, checksums)
        try:
            arena = self._arena(v, slots, split, reuse if full else None)
        except BaseException:
            reader.close()
            raise
        engine = None
        try:
            pause(self.config, "arena")
            profile = None
            if not full and self.profile is not None and v.table in self.profile.ids:
                profile = (self.profile.ids[v.table], self.profile.counts[v.table])
            from tierstore.cache.policy import PolicyConfig
            index = None
            if not full and self.config.local_reads and slot_index.supported():
                index = self.new_name(f"{v.table}.v{v.number}.index")
            cache_mode = {} if full else dict(policy_config=PolicyConfig(kind=self.config.policy), profile=profile,
                                              index_path=index, instance=self.instance)
            engine = make_engine(v, reader, arena, leases=self.leases, full=full, recorder=self.recorder,
                                 **cache_mode)
            t0 = time.monotonic()
            if full and arena.reattached:
                bad = engine.verify_arena(checksums)
                log.info("table %s v%d: re-attached arena %s, %d bad blocks%s", v.table, v.number, arena.path,
                         len(bad), "; reloading from disk" if bad else "")
                if bad:
                    engine.load_full()
            elif full:
                engine.load_full()
            pause(self.config, "loaded")
            arena.header.write(instance=self.instance, version=v.number, slots=slots, row_bytes=v.row_bytes,
                               full=full, table=v.table, split=split)
            arena.publish()
            self._hold_version(engine)
            pause(self.config, "published")
        except BaseException:
            if engine is not None:
                engine.close()
            arena.close(unlink=True)
            reader.close()
            raise
        huge, mapped = huge_page_bytes(arena.path)
        log.info("table %s v%d: %s mode%s, %d slots x %d B (%.1f MiB in %s, %.0f%% of it on %s pages by "
                 "/proc/self/smaps) + %.1f MiB of checksums, maps and policy, ready in %.2fs", v.table, v.number,
                 "full" if full else "cache", f" (split: {split} B weights, then scales)" if split else "", slots,
                 v.row_bytes, slots * v.row_bytes / 2**20, arena.path.parent, 100 * huge / max(mapped, 1),
                 f"{arena.backing.page >> 20} MiB" if arena.backing.huge else "huge", engine.metadata_bytes() / 2**20,
                 time.monotonic() - t0)
        return engine

    def _arena(self, v, slots: int, split: int, reuse: Path | None) -> Arena:
        """Version v's arena: `reuse` re-attached, else a new one where the backing says. Under
        --arena-pages auto, an arena the hugetlbfs pool has no pages left for (another process
        took them, or a reload's new arena beside the old) goes on 4 KiB pages in the shm
        directory, with a warning; otherwise ResourceExhausted naming the fix."""
        backing = self.backing
        path = reuse or self.new_name(f"{v.table}.v{v.number}", backing.dir)
        try:
            return Arena(path, slots, v.row_bytes, reuse=reuse is not None, backing=backing, split=split)
        except ResourceExhausted as e:
            if backing.how != "hugetlbfs" or self.config.arena_pages != "auto" or reuse is not None:
                raise
            small = PageBacking(SMALL_PAGE, "4k", f"{backing.dir} has no pages left for it", self.config.shm_dir)
            log.warning("table %s v%d: %s; this arena goes on 4 KiB pages in %s: reserve more pages "
                        "(vm.nr_hugepages; a live reload needs the old arena's beside the new)", v.table, v.number,
                        e, small.dir)
            return Arena(self.new_name(f"{v.table}.v{v.number}", small.dir), slots, v.row_bytes, backing=small,
                         split=split)

    def _checksums(self, v, full: bool):
        """Version v's block checksums for its reader: the array (8 B a block) where blocks are
        read whole (full mode loads and checks every block; the remote tier fetches blocks), else,
        for a cache-mode table of segment format 2 on this host's disk, read from the catalog
        when the block path asks (BlockChecksums): its misses check the sums in the records."""
        if full or v.segment_format < 2 or not self._segments_on_disk(v):
            return self.catalog.checksums(v.table, v.number)
        return BlockChecksums(self.config.data_dir, v)

    def _segments_on_disk(self, v) -> bool:
        """True when this host's data directory holds every segment file of version v."""
        return all((self.config.data_dir / s).is_file() for s in v.segments)

    def _reader(self, v, checksums):
        """Local segments when this host has them; else, with --remote, the published copy."""
        if self.config.remote and not self._segments_on_disk(v):
            from tierstore.tiers.remote.mooncake import connect
            from tierstore.tiers.remote.reader import RemoteReader
            if self._mooncake is None:
                self._mooncake = connect(self.config.remote, self.config.metadata)
            copy = self._local_copy(v, checksums)
            log.info("table %s v%d: no local rows; reading from Mooncake %s%s", v.table, v.number,
                     self.config.remote, "" if copy is None else
                     f", writing them back to {copy.dir} ({copy.n_present}/{v.n_blocks} blocks there)")
            return RemoteReader(self._mooncake, v, checksums, copy=copy)
        return SegmentReader(self.config.data_dir, v, checksums, **self._reader_options())

    def _local_copy(self, v, checksums):
        """Where blocks fetched from Mooncake are written back, or None when --data refuses it."""
        from tierstore.tiers.remote.local_copy import LocalCopy
        try:
            return LocalCopy(self.config.data_dir, v, checksums)
        except OSError as e:
            log.warning("table %s v%d: no write-back to %s (%s); every miss goes to Mooncake",
                        v.table, v.number, self.config.data_dir, e)
            return None

    def _reader_options(self) -> dict:
        return {"direct_io": True} if self.config.direct_io else {}

    def _hold_version(self, engine: TableEngine) -> None:
        """A shared flock on the version's directory: `tierstore gc` skips what is served."""
        vdir = self.config.data_dir / "tables" / engine.table / f"v{engine.version.number}"
        try:
            fd = os.open(vdir, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return
        fcntl.flock(fd, fcntl.LOCK_SH)
        self._served_fds[id(engine)] = fd

    # ---- freeing -------------------------------------------------------------------
    def free(self, engine: TableEngine) -> None:
        """Close the engine, its arena (unlinked unless --persist-arena keeps a current one) and
        its reader, and let `tierstore gc` have its version again."""
        engine.close()
        engine.arena.close(unlink=not self.config.persist_arena or engine.retired)
        engine.reader.close()
        fd = self._served_fds.pop(id(engine), None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """After every engine is freed: write the trace (--record-trace) and close Mooncake."""
        if self.recorder is not None:
            try:
                self.recorder.close()
            except (TierstoreError, OSError) as e:  # the stop still completes; say why the trace is missing
                log.error("--record-trace: trace not written: %s", e)
        if self._mooncake is not None:
            self._mooncake.close()
            self._mooncake = None
