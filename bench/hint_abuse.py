"""Prefetch-hint abuse: a victim's Plan latency while another client abuses hints.

A cache-mode sidecar (1 M rows of 64 B, a 16 MiB arena of 256 Ki slots); the
victim plans 256-id Zipf steps. Three attacks, each against a fresh sidecar:
- extend: the attacker fills the arena with its own rows and hints them with
  steps=1 then --steps, over and over (an extension the protection cap must count);
- pending: it hints every id read=False for --steps (most are not resident), then
  keeps hinting 1,000 random ids every 10 ms while the victim plans.
Prints the victim's p50 before and after, and the sidecar's RSS.
Run: python -m tierstore.bench.hint_abuse --data DIR [--steps 4096]
(DIR is made on the first run; --steps 1000000000 is what the issue's attacker sent).
"""
from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import numpy as np

ROWS, DIM, BUDGET = 1_000_000, 16, "16MiB"


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS")) / 1024


def _victim_p50_ms(c, steps: int, seed: int = 0) -> float:
    rng, lat = np.random.default_rng(seed), []
    for _ in range(steps):
        ids = np.unique(rng.zipf(1.02, 256) % ROWS)
        t = time.perf_counter()
        with c.plan("t", ids) as s:
            s.slots()
        lat.append(time.perf_counter() - t)
    return float(np.median(lat)) * 1e3


def _hint(c, ids, steps: int) -> None:
    from tierstore import errors

    try:
        c.prefetch("t", ids, read=False, steps=steps)
    except errors.InvalidArgument as e:  # a sidecar that bounds a hint's life
        print(f"  hint refused: {e}")


def _extend(a, steps: int) -> None:
    own = np.arange(500_000, 500_000 + 262_144)
    for k in range(0, own.size, 8192):
        with a.plan("t", own[k:k + 8192]) as s:
            s.slots()
    for _ in range(8):
        for k in range(0, own.size, 25_000):
            with a.plan("t", own[k:k + 16]) as s:  # a step passes: the steps=1 hints end
                s.slots()
            _hint(a, own[k:k + 25_000], 1)
            _hint(a, own[k:k + 25_000], steps)
            time.sleep(0.02)


def _pending(a, steps: int, stop: threading.Event) -> threading.Thread:
    _hint(a, np.arange(ROWS), steps)
    time.sleep(2.0)

    def more():
        rng = np.random.default_rng(9)
        while not stop.is_set():
            _hint(a, rng.choice(ROWS, 1000, replace=False), steps)
            time.sleep(0.01)
    t = threading.Thread(target=more, daemon=True)
    t.start()
    return t


def run_hint_abuse(data_dir, steps: int, attacks=("extend", "pending")) -> dict:
    from tierstore.client.client import Client
    from tierstore.ingest.writer import write_version
    from tierstore.sidecar.launcher import SidecarProcess

    d = Path(data_dir)
    if not d.exists() or not any(d.iterdir()):
        write_version(d, "t", (np.full((100_000, DIM * 4), i, np.uint8) for i in range(10)), rows=ROWS,
                      row_format="fp32", row_dim=DIM)
    out = {}
    for attack in attacks:
        with SidecarProcess(d, dram_budget=BUDGET) as sc, Client(sc.socket) as v, Client(sc.socket) as a:
            _victim_p50_ms(v, 200)  # warm: the Zipf head resident
            base, rss0 = _victim_p50_ms(v, 300), _rss_mib(sc.proc.pid)
            stop, t = threading.Event(), None
            if attack == "extend":
                _extend(a, steps)
                time.sleep(1.0)
            else:
                t = _pending(a, steps, stop)
            after = _victim_p50_ms(v, 300)
            stop.set()
            if t is not None:
                t.join()
            out[attack] = {"victim_p50_ms": [base, after], "sidecar_rss_mib": [rss0, _rss_mib(sc.proc.pid)]}
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=4096)
    a = ap.parse_args()
    for name, r in run_hint_abuse(a.data, a.steps).items():
        (b, f), (r0, r1) = r["victim_p50_ms"], r["sidecar_rss_mib"]
        print(f"{name}: victim p50 {b:.2f} -> {f:.2f} ms, sidecar RSS {r0:.0f} -> {r1:.0f} MiB")
