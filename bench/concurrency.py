"""`tierstore bench concurrency`: several worker processes reading one cache-mode table.

A sidecar holds 10% of the table in DRAM; 1 and then N client processes (real
processes, each its own Client over the step socket) read 4,096-id Zipf steps
for a few seconds; rounds alternate 1 and N. The figure is aggregate rows/s of
N clients over one client's, for each way a worker reads:
  lookup  Client.lookup: local reads (client/local_reads.py), no round trip;
          the sidecar only learns the steps after the fact
  plan    a leased Plan per step over the step socket, then rows(): every step
          is served by the sidecar (promotion runs off the table lock, so one
          worker's disk reads do not stall the others' plans)
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np

from tierstore.bench.lookup import BENCH_SIDECAR_FLAGS

__all__ = ["run_concurrency_bench", "UNITS"]

UNITS = {"rows_per_s_*": "rows/s, all clients together (median over rounds)",
         "ratio": "x (N clients' aggregate rows/s over one client's)",
         "hit_ratio": "fraction of the steps' distinct ids the sidecar found resident (learned steps only)",
         "local_steps_*": "steps, summed over rounds (dropped: notes the sidecar's learner had no room for)"}


def _worker(a: dict) -> None:
    from tierstore.bench.workload import make_batches
    from tierstore.client.client import Client

    # one model's workers: the same rows are hot for all of them, the samples differ
    batches = make_batches(a["dist"], a["rows"], a["batch"], 64, a["seed"], hot_seed=a["hot_seed"])
    with Client(a["sock"]) as c:
        def read(ids) -> int:
            if a["read"] == "lookup":
                return c.lookup(a["table"], ids).shape[0]
            with c.plan(a["table"], ids) as s:
                return s.rows().shape[0]

        for b in batches[:4]:  # warm-up: connect, map the arena
            read(b)
        print("ready", flush=True)
        start = float(sys.stdin.readline())  # the round's start, once every worker is ready
        while time.time() < start:
            time.sleep(0.001)
        n, k = 0, 0
        while time.time() < start + a["seconds"]:
            n += read(batches[k % len(batches)])
            k += 1
    print(json.dumps({"rows": n}), flush=True)


def _round(sock: str, table: str, rows: int, clients: int, seconds: float, seed: int, batch: int, dist: str,
           read: str) -> float:
    procs = [subprocess.Popen([sys.executable, "-m", "tierstore.bench.concurrency", "--worker", json.dumps(dict(
        sock=sock, table=table, rows=rows, batch=batch, dist=dist, seed=seed + i, hot_seed=seed,
        seconds=seconds, read=read))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/") for i in range(clients)]
    # every worker imports, connects and warms up before the round starts: on a loaded host a
    # fixed head start left late workers no time in the round (a round of 0 rows/s)
    for p in procs:
        if p.stdout.readline().strip() != b"ready":
            p.wait(timeout=60)
            raise RuntimeError(f"concurrency worker failed before the round: {p.stderr.read().decode()[-2000:]}")
    start = f"{time.time() + 0.05!r}\n".encode()
    for p in procs:
        p.stdin.write(start)
        p.stdin.flush()
    total = 0
    for p in procs:
        out, err = p.communicate(timeout=seconds + 120)
        if p.returncode:
            raise RuntimeError(f"concurrency worker failed: {err.decode()[-2000:]}")
        total += json.loads(out.decode().strip().splitlines()[-1])["rows"]
    return total / seconds


def _counts(c, table: str) -> np.ndarray:
    t = next(t for t in c.stats()["tables"] if t["table"] == table)
    return np.array([int(t.get(k, 0)) for k in ("hits", "misses", "local_steps", "notes_dropped")], dtype=np.int64)


def run_concurrency_bench(data_dir, *, clients: int = 4, seconds: float = 4.0, rounds: int = 3, seed: int = 0,
                          batch: int = 4096, dist: str = "zipf1.0", cache_fraction: float = 0.10,
                          reads: tuple[str, ...] = ("lookup", "plan"), log=print) -> dict:
    """Returns {read: {rows_per_s_1, rows_per_s_N, ratio}} for each of `reads`, and the first's
    figures at the top level (the headline)."""
    from tierstore.store.catalog import Catalog
    from tierstore.client.client import Client
    from tierstore.sidecar.launcher import SidecarProcess

    with Catalog(data_dir, readonly=True) as cat:
        names = cat.tables()
        version = cat.current(names[0])
        total_bytes = sum(cat.current(t).nbytes for t in names)
    budget = max(int(total_bytes * cache_fraction), 1 << 16)
    runs = {(read, n): [] for read in reads for n in (1, clients)}
    learned = {(read, n): np.zeros(4, dtype=np.int64) for read in reads for n in (1, clients)}
    for read in reads:  # a sidecar each: one read mode's warm rows are not handed to the other
        with SidecarProcess(data_dir, dram_budget=budget, extra_args=BENCH_SIDECAR_FLAGS) as sc, \
                Client(sc.socket) as c:
            for r in range(rounds):
                for n in ((1, clients) if r % 2 == 0 else (clients, 1)):
                    s0 = _counts(c, version.table)
                    runs[(read, n)].append(_round(str(sc.socket), version.table, version.rows, n, seconds,
                                                  seed + 100 * r, batch, dist, read))
                    learned[(read, n)] += _counts(c, version.table) - s0
                    log(f"concurrency {read}: round {r + 1}/{rounds}, {n} client(s): "
                        f"{runs[(read, n)][-1] / 1e6:.2f} M rows/s")
    res = {"table": version.table, "clients": clients, "batch": batch, "dist": dist, "seconds": seconds,
           "rounds": rounds, "dram_budget_bytes": budget, "units": UNITS}
    parts = []
    for read in reads:
        one, many = float(np.median(runs[(read, 1)])), float(np.median(runs[(read, clients)]))
        ratio = round(many / one, 3) if one else float("nan")  # a worker that started late read nothing
        res[read] = {"rows_per_s_1": round(one), f"rows_per_s_{clients}": round(many), "ratio": ratio}
        for n in (1, clients):  # the sidecar's view: hit ratio, and local steps learned or dropped (lookup)
            h, m, steps, dropped = learned[(read, n)].tolist()
            res[read][f"sidecar_{n}"] = {"hit_ratio": round(h / (h + m), 4) if h + m else None,
                                         "local_steps_learned": steps, "local_steps_dropped": dropped}
        parts.append(f"{read} {many / 1e6:.2f} M rows/s vs one {one / 1e6:.2f} ({ratio:.2f}x)")
    res.update(res[reads[0]], read=reads[0])
    res["summary"] = f"concurrency: {clients} clients on one cache-mode table: " + "; ".join(parts)
    return res

if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        _worker(json.loads(sys.argv[2]))
