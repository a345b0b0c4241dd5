"""`tierstore bench scale`: a Plan costs O(step), not O(arena).

Two cache-mode engines over one table (real segment files, real /dev/shm
arenas, the sidecar's engine in process, so RPC noise stays out): a small
arena (0.5 M slots) and a large one (16 M slots; 4 M with --quick), each
filled to capacity first. Then the same steps run against both, interleaved:
- miss: 4,096 ids none of which is resident (every id is read from the cold
  tier and evicts a row: the path whose cost used to grow with the arena);
- hit: 4,096 resident ids.
The figure is the ratio of median Plan times, large over small (1.0 = flat).

It also measures the id -> slot lookup of the large arena: the slot-sized hash
map the engine keeps (tierstore/cache/slot_map.py, at most MAX_LOAD full)
against the per-row int32 array it replaced and against the same map at the
looser load it had before (2/3: 6 B a slot where MAX_LOAD's 4/5 takes 5), both
built beside it in the same run, over the same resident and missing ids
(within-run ratios: map over array, map over the looser map).
"""
from __future__ import annotations

import time
from fractions import Fraction
from pathlib import Path

import numpy as np

__all__ = ["run_scale_bench", "scale_line", "UNITS"]

UNITS = {"*_ms": "ms per Plan (median over rounds)", "ratio_*": "x (large arena's median over the small's)",
         "slots_*": "arena slots", "lookup_*_us": "µs per lookup of a step's ids (median over rounds)",
         "ratio_lookup_*": "x (the hash map's median over the per-row array's)",
         "ratio_load_*": "x (the hash map's median over the same map's at LOOSER_LOAD)",
         "map_bytes_a_slot": "B a slot of the hash map", "array_bytes_a_slot": "B a slot of the per-row array",
         "looser_map_bytes_a_slot": "B a slot of the hash map at LOOSER_LOAD"}
LOOSER_LOAD = Fraction(2, 3)  # the map's load before MAX_LOAD went to 4/5
ROW_DIM = 2  # 8-byte rows: a 24 M-row table is 192 MB, so a 16 M-slot arena fits this machine


def _engine(data_dir: Path, version, slots: int, leases):
    from tierstore.store.catalog import Catalog
    from tierstore.engine import make_engine
    from tierstore.tiers.dram import Arena
    from tierstore.tiers.nvme.reader import SegmentReader

    with Catalog(data_dir, readonly=True) as cat:
        sums = cat.checksums(version.table, version.number)
    reader = SegmentReader(data_dir, version, sums)
    arena = Arena(Path("/dev/shm") / f"tierstore-bench-scale.{slots}.{time.monotonic_ns()}", slots,
                  version.row_bytes)
    return make_engine(version, reader, arena, leases=leases, full=False)


def _fill(engine, first: int, log) -> None:
    """Make the arena hold rows [first, first + capacity): sequential plans of up to half of it."""
    piece = max(1, min(1 << 20, engine.capacity // 2))
    for a in range(first, first + engine.capacity, piece):
        ids = np.arange(a, min(a + piece, first + engine.capacity), dtype=np.int64)
        res = engine.plan(ids, ttl_s=60.0)
        engine.leases.release([res.lease_id])
    log(f"bench scale: {engine.capacity:,} slots filled, {engine.slots.resident:,} resident")


def _timed(engine, ids: np.ndarray) -> float:
    t0 = time.perf_counter()
    res = engine.plan(ids, ttl_s=60.0)
    dt = time.perf_counter() - t0
    engine.leases.release([res.lease_id])
    return dt


def run_scale_bench(out_dir, *, quick: bool = False, seed: int = 0, small: int = 500_000,
                    large: int | None = None, step: int = 4096, rounds: int | None = None, log=print) -> dict:
    from tierstore.ingest.writer import write_version
    from tierstore.cache.leases import LeaseTable

    large = large or (4_000_000 if quick else 16_000_000)
    rounds = rounds or (15 if quick else 30)
    rows = large + large // 2
    data_dir = Path(out_dir) / "scale-data"
    from tierstore.store.catalog import Catalog

    version = None
    if (data_dir / "catalog" / "data.mdb").exists():
        with Catalog(data_dir, readonly=True) as cat:
            v = cat.current("scale")
            version = v if v.rows == rows else None
    if version is None:
        log(f"bench scale: writing a {rows:,}-row table of {ROW_DIM * 4}-byte rows to {data_dir}")
        chunk = 1 << 22
        gen = (np.arange(a, min(a + chunk, rows), dtype=np.float32).repeat(ROW_DIM).reshape(-1, ROW_DIM)
               .view(np.uint8).reshape(-1, ROW_DIM * 4) for a in range(0, rows, chunk))
        version = write_version(data_dir, "scale", gen, rows=rows, row_format="fp32", row_dim=ROW_DIM)
    leases = LeaseTable(1024)
    engines = {}
    try:
        for name, slots in (("small", small), ("large", large)):
            engines[name] = _engine(data_dir, version, slots, leases)
            _fill(engines[name], 0, log)
        rng = np.random.default_rng(seed)
        fresh = rng.permutation(np.arange(large, rows, dtype=np.int64))  # resident in neither arena
        times = {f"{kind}_{name}": [] for kind in ("miss", "hit") for name in engines}
        for r in range(rounds + 1):  # the first round warms up
            miss = np.sort(fresh[r * step:(r + 1) * step])
            for name in (("small", "large") if r % 2 else ("large", "small")):
                eng = engines[name]
                hit = np.sort(eng.slots.id_of[rng.choice(eng.capacity, step, replace=False)])
                hit = hit[hit >= 0]
                dm, dh = _timed(eng, miss), _timed(eng, hit)
                if r:
                    times[f"miss_{name}"].append(dm)
                    times[f"hit_{name}"].append(dh)
        med = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
        lookup = _lookup_bench(engines["large"], rows, fresh[(rounds + 1) * step:], step, rounds, rng)
        res = {**lookup, "slots_small": small, "slots_large": large, "step_ids": step, "rounds": rounds, "table_rows": rows,
               **{f"{k}_ms": round(v, 3) for k, v in med.items()},
               "ratio_miss": round(med["miss_large"] / med["miss_small"], 3),
               "ratio_hit": round(med["hit_large"] / med["hit_small"], 3), "units": UNITS}
    finally:
        for eng in engines.values():
            eng.arena.close(unlink=True)
            eng.reader.close()
        leases.close()
    res["summary"] = scale_line(res)
    return res


def _lookup_bench(eng, rows: int, fresh: np.ndarray, step: int, rounds: int, rng) -> dict:
    """The engine's id -> slot lookup (its hash map) against a per-row array of the same arena
    and against the same map at LOOSER_LOAD, each round in another order."""
    from tierstore.cache.slot_map import SlotMap

    st = eng.slots
    held = st.id_of >= 0
    per_row = np.full(rows, -1, dtype=np.int32)  # what slot_of was: 4 B a row
    per_row[st.id_of[held]] = np.flatnonzero(held).astype(np.int32)
    looser = SlotMap(SlotMap.empty_table(eng.capacity, LOOSER_LOAD), st.id_of, eng.capacity)
    looser.insert(st.id_of[held], np.flatnonzero(held))
    fns = [("map", st.find), ("looser", looser.find), ("array", per_row.take)]
    times = {f"{how}_{kind}": [] for how, _ in fns for kind in ("hit", "miss")}
    for r in range(rounds + 1):
        ids = {"hit": np.sort(st.id_of[rng.choice(np.flatnonzero(held), step, replace=False)]).astype(np.int64),
               "miss": np.sort(fresh[(r * step) % max(1, fresh.size - step):][:step])}
        for kind, x in ids.items():
            got = {}
            for how, fn in fns[r % 3:] + fns[:r % 3]:
                t0 = time.perf_counter()
                got[how] = fn(x)
                dt = time.perf_counter() - t0
                if r:
                    times[f"{how}_{kind}"].append(dt)
            assert np.array_equal(got["map"], got["array"]) and np.array_equal(got["looser"], got["array"]), \
                "the maps and the array disagree"
    med = {k: float(np.median(v)) * 1e6 for k, v in times.items()}
    return {**{f"lookup_{k}_us": round(v, 2) for k, v in med.items()},
            "ratio_lookup_hit": round(med["map_hit"] / med["array_hit"], 3),
            "ratio_lookup_miss": round(med["map_miss"] / med["array_miss"], 3),
            "ratio_load_hit": round(med["map_hit"] / med["looser_hit"], 3),
            "ratio_load_miss": round(med["map_miss"] / med["looser_miss"], 3),
            "map_bytes_a_slot": round(st.map.table.nbytes / eng.capacity, 2),
            "looser_map_bytes_a_slot": round(looser.table.nbytes / eng.capacity, 2),
            "array_bytes_a_slot": round(per_row.nbytes / eng.capacity, 2)}


def scale_line(res: dict) -> str:
    return (f"scale: Plan of {res['step_ids']} missing ids {res['miss_small_ms']:.2f} ms at "
            f"{res['slots_small'] / 1e6:g} M slots vs {res['miss_large_ms']:.2f} ms at {res['slots_large'] / 1e6:g} M "
            f"(ratio {res['ratio_miss']:.2f}); resident ids {res['hit_small_ms']:.2f} vs {res['hit_large_ms']:.2f} ms "
            f"(ratio {res['ratio_hit']:.2f}); id -> slot lookup, hash map over per-row array: "
            f"{res['ratio_lookup_hit']:.2f}x resident, {res['ratio_lookup_miss']:.2f}x missing "
            f"({res['map_bytes_a_slot']:g} vs {res['array_bytes_a_slot']:g} B a slot); map at 4/5 load over 2/3: "
            f"{res['ratio_load_hit']:.2f}x resident, {res['ratio_load_miss']:.2f}x missing "
            f"({res['map_bytes_a_slot']:g} vs {res['looser_map_bytes_a_slot']:g} B a slot)")
