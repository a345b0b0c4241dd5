"""Bench: cache-mode misses from local NVMe vs from Mooncake over TCP, and
Mooncake's own EngramStore.lookup on the same table and ids.

    python -m tierstore.bench.remote --out DIR [--rows 200000] [--batch 4096]

Starts a loopback Mooncake cluster (master + 2 store processes), writes one
fp32 table, publishes it, then times, interleaved round by round (the box is
noisy), batches of unique random ids (every one a miss: cold rows) read into an
arena-sized buffer by a batch of misses through each reader (the read pipeline's
MissBatch, as the engine reads them: SegmentReader's, RemoteReader's), and
EngramStore.lookup of the same ids. Then the write-back warm-up of a new host:
every row read once in batches through a RemoteReader with a local copy (first
pass: from Mooncake, blocks written back in the background), the write-back
drained, and the same batches again (second pass: from the local copy). Writes
DIR/results.json key "remote" and prints a table and one line. The local table
is small enough to sit in the page cache: the NVMe figures are warm-file
ceilings, not device measurements. `tierstore bench remote` runs this.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

__all__ = ["run_bench", "remote_line", "format_remote", "main"]


def _read(reader, ids: np.ndarray, arena: np.ndarray, slots: np.ndarray) -> None:
    """Sorted, distinct `ids` into arena[slots]: one batch of misses, submitted and finished."""
    from tierstore.tiers.nvme.miss_batch import MissBatch

    MissBatch(reader, ids, arena, slots).submit().finish()


def _stats(times: list[float], rows: int) -> dict:
    t = np.asarray(times)
    return {"rows_per_s": rows * len(t) / t.sum(), "p50_ms": float(np.percentile(t, 50) * 1e3),
            "p99_ms": float(np.percentile(t, 99) * 1e3), "batches": len(t)}


def _warm_up(store, tv, sums, host: Path, rows: int, batch: int, rng, emb) -> dict:
    """First pass from Mooncake (write-back on, no fill) vs second pass from the local copy."""
    from tierstore.tiers.remote.publish import import_manifest
    from tierstore.tiers.remote.local_copy import LocalCopy
    from tierstore.tiers.remote.reader import RemoteReader

    import_manifest(host, tv, sums)
    reader = RemoteReader(store, tv, sums, copy=LocalCopy(host, tv, sums), fill=False)
    try:
        batches = [np.sort(b) for b in np.array_split(rng.permutation(rows).astype(np.int64), -(-rows // batch))]
        arena = np.empty((max(map(len, batches)), tv.row_bytes), dtype=np.uint8)
        res = {}
        for name in ("first_pass", "second_pass"):
            times, fetched, nblocks = [], reader.bytes_read, reader.blocks_fetched
            for ids in batches:
                slots = np.arange(ids.size)
                s = time.perf_counter(); _read(reader, ids, arena, slots); times.append(time.perf_counter() - s)
                assert np.array_equal(arena[:ids.size].view(np.float32), emb[ids]), f"{name}: rows differ"
            asked = sum(np.unique(ids // tv.block_rows).size for ids in batches)
            res[name] = {**_stats(times, 0), "rows_per_s": rows / sum(times),
                         "mooncake_bytes": reader.bytes_read - fetched,
                         "local_fraction": 1 - (reader.blocks_fetched - nblocks) / asked}
            if name == "first_pass":
                t0 = time.perf_counter()
                reader.writeback.drain(120)
                res["drain_s"] = time.perf_counter() - t0
        res["fill"] = _fill_rate(store, tv, sums, host.parent / "host-c")
        wb = reader.writeback.stats()
        res.update(blocks=wb["blocks"], written_blocks=wb["written"], dropped_blocks=wb["dropped"],
                   speedup=res["second_pass"]["rows_per_s"] / res["first_pass"]["rows_per_s"])
        return res
    finally:
        reader.close()


def _fill_rate(store, tv, sums, host: Path, timeout: float = 900.0) -> dict:
    """A new host with no traffic: how fast the background fill makes the whole version local."""
    from tierstore.tiers.remote.publish import import_manifest
    from tierstore.tiers.remote.local_copy import LocalCopy
    from tierstore.tiers.remote.reader import RemoteReader

    import_manifest(host, tv, sums)
    t0 = time.perf_counter()
    reader = RemoteReader(store, tv, sums, copy=LocalCopy(host, tv, sums), fill=True)
    try:
        while not reader.copy.finished and time.perf_counter() - t0 < timeout:
            time.sleep(0.01)
        dt = time.perf_counter() - t0
        return {"seconds": dt, "MB_s": tv.nbytes / 1e6 / dt, "finished": reader.copy.finished}
    finally:
        reader.close()


def run_bench(out: Path, rows: int = 200_000, dim: int = 64, batch: int = 4096, rounds: int = 30,
              seed: int = 0, warm: bool = True, write: bool = True) -> dict:
    from mooncake.store import EngramStore, EngramStoreConfig

    from tierstore.store.catalog import Catalog
    from tierstore.ingest.writer import write_version
    from tierstore.tiers.remote.mooncake import LocalCluster
    from tierstore.tiers.remote.publish import fetch_manifest, publish
    from tierstore.tiers.nvme.reader import SegmentReader
    from tierstore.tiers.remote.reader import RemoteReader

    rng = np.random.default_rng(seed)
    emb = rng.standard_normal((rows, dim)).astype(np.float32)
    table_bytes = emb.nbytes
    with tempfile.TemporaryDirectory() as tmp, \
            LocalCluster(stores=2, segment_bytes=max(256 << 20, 3 * table_bytes)) as cluster:
        data = Path(tmp) / "data"
        tv = write_version(data, "emb", [emb.view(np.uint8).reshape(rows, -1)], rows=rows, row_format="fp32",
                           row_dim=dim)
        with Catalog(data, readonly=True) as cat:
            sums = cat.checksums("emb", tv.number)
        store = cluster.connect()
        t0 = time.perf_counter()
        publish(store, data, "emb", replicas=1)
        publish_s = time.perf_counter() - t0
        rtv, rsums = fetch_manifest(store, "emb")
        local, remote = SegmentReader(data, tv, sums), RemoteReader(store, rtv, rsums)
        cfg = EngramStoreConfig()
        cfg.embedding_dim, cfg.table_vocab_sizes = dim, [rows]
        engram = EngramStore(1, cfg, store)
        engram.populate([emb])
        arena = np.empty((batch, tv.row_bytes), dtype=np.uint8)
        slots = np.arange(batch, dtype=np.int64)
        times = {"nvme": [], "mooncake": [], "engramstore": []}
        for r in range(rounds + 2):  # two warm-up rounds, not counted
            ids = np.sort(rng.choice(rows, batch, replace=False)).astype(np.int64)
            t = {}
            s = time.perf_counter(); _read(local, ids, arena, slots); t["nvme"] = time.perf_counter() - s
            s = time.perf_counter(); _read(remote, ids, arena, slots); t["mooncake"] = time.perf_counter() - s
            assert np.array_equal(arena.view(np.float32), emb[ids]), "remote rows differ"
            s = time.perf_counter(); got = engram.lookup(ids.reshape(1, -1, 1)); t["engramstore"] = time.perf_counter() - s
            assert np.array_equal(got[0, :, 0], emb[ids]), "EngramStore rows differ"
            if r >= 2:
                for k, v in t.items():
                    times[k].append(v)
        res = {k: _stats(v, batch) for k, v in times.items()}
        res["ratios"] = {"mooncake_over_nvme": res["mooncake"]["rows_per_s"] / res["nvme"]["rows_per_s"],
                         "mooncake_over_engramstore": res["mooncake"]["rows_per_s"] / res["engramstore"]["rows_per_s"]}
        res["setup"] = {"rows": rows, "row_bytes": tv.row_bytes, "block_rows": tv.block_rows, "batch": batch,
                        "rounds": rounds, "seed": seed, "transport": "tcp loopback", "store_processes": 2,
                        "publish_s": publish_s, "publish_MB_s": table_bytes / 1e6 / publish_s,
                        "remote_bytes_per_row": remote.bytes_read / max(1, (rounds + 2) * batch)}
        if warm:
            res["warmup"] = _warm_up(store, rtv, rsums, Path(tmp) / "host-b", rows, batch, rng, emb)
        local.close()
        store.close()
    res["summary"] = remote_line(res)
    if write:
        _write(out, res, seed)
    return res


def remote_line(r: dict) -> str:
    s = r["setup"]
    line = (f"remote: cache-mode misses, {s['batch']} ids/batch: NVMe {r['nvme']['rows_per_s'] / 1e3:.0f}k rows/s "
            f"(p99 {r['nvme']['p99_ms']:.1f} ms), Mooncake TCP {r['mooncake']['rows_per_s'] / 1e3:.0f}k rows/s "
            f"(p99 {r['mooncake']['p99_ms']:.1f} ms), EngramStore.lookup {r['engramstore']['rows_per_s'] / 1e3:.0f}k "
            f"rows/s (p99 {r['engramstore']['p99_ms']:.1f} ms); "
            f"Mooncake/NVMe {r['ratios']['mooncake_over_nvme']:.2f}x, "
            f"ours/EngramStore {r['ratios']['mooncake_over_engramstore']:.2f}x")
    w = r.get("warmup")
    if w:
        line += (f"; write-back warm-up: first pass {w['first_pass']['rows_per_s'] / 1e3:.0f}k rows/s, second "
                 f"{w['second_pass']['rows_per_s'] / 1e3:.0f}k rows/s ({w['speedup']:.2f}x, "
                 f"blocks read locally: {w['first_pass']['local_fraction']:.0%} then "
                 f"{w['second_pass']['local_fraction']:.0%}); fill alone {w['fill']['MB_s']:.0f} MB/s")
    return line


def format_remote(r: dict) -> list[str]:
    s = r["setup"]
    rows = [["path", "rows/s", "p50 ms", "p99 ms", "local blocks"]]
    names = {"nvme": "local NVMe (SegmentReader)", "mooncake": "Mooncake TCP (RemoteReader)",
             "engramstore": "Mooncake EngramStore.lookup"}
    for k, label in names.items():
        rows.append([label, f"{r[k]['rows_per_s'] / 1e6:.3f}M", f"{r[k]['p50_ms']:.2f}", f"{r[k]['p99_ms']:.2f}",
                     "100%" if k == "nvme" else "0%" if k == "mooncake" else "-"])
    w = r.get("warmup")
    if w:
        for k, label in (("first_pass", "new host, 1st pass (Mooncake + write-back)"),
                         ("second_pass", "new host, 2nd pass (written back)")):
            rows.append([label, f"{w[k]['rows_per_s'] / 1e6:.3f}M", f"{w[k]['p50_ms']:.2f}", f"{w[k]['p99_ms']:.2f}",
                         f"{w[k]['local_fraction']:.0%}"])
        f = w["fill"]
        rows.append(["new host, background fill only", f"{f['MB_s']:.1f} MB/s", "-", "-",
                     f"all in {f['seconds']:.1f} s"])
    widths = [max(len(x[i]) for x in rows) for i in range(5)]
    out = [f"== remote: {s['rows']:,} rows x {s['row_bytes']} B, {s['batch']} unique ids per batch, "
           f"{s['rounds']} interleaved rounds, {s['transport']}, {s['store_processes']} store processes; "
           f"publish {s['publish_MB_s']:.0f} MB/s"]
    out += ["   " + "  ".join(c.rjust(wd) if i else c.ljust(wd) for i, (c, wd) in enumerate(zip(x, widths)))
            for x in rows]
    return out


def _write(out: Path, res: dict, seed: int) -> None:
    try:
        from tierstore.bench.results import write_scenario
        write_scenario(out, "remote", res, seed=seed, started=time.time())
    except Exception:  # older results module: write our own file
        import json
        out.mkdir(parents=True, exist_ok=True)
        (out / "remote.json").write_text(json.dumps(res, indent=2))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tierstore.bench.remote", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    from tierstore.tiers.remote.mooncake import missing_reason
    why = missing_reason()
    if why:
        print(f"bench remote: skipped: {why}", file=sys.stderr)
        return 1
    r = run_bench(a.out, a.rows, batch=a.batch, rounds=a.rounds, seed=a.seed)
    print("\n".join(format_remote(r)))
    print(r["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
