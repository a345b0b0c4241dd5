"""Live version swap under load: client processes on a full-resident and a
cache-mode sidecar run steps while both swap a table between two versions."""
from __future__ import annotations

import time

import numpy as np
import pytest

from tierstore.client.client import Client

ROWS, DIM = 30_000, 16


def _run(tmp_path, workers, sidecars, rel, clients_per_sidecar: int, swaps: int):
    d = tmp_path / "data"
    exp = []
    for seed in (1, 2):
        exp.append(rel.write_table(d, "t", ROWS, dim=DIM, seed=seed))
        np.save(tmp_path / f"v{seed}.npy", exp[-1])
    full = sidecars(d, "64MiB")
    cache = sidecars(d, "512KiB")  # 1/4 of the table
    stop = tmp_path / "stop"
    logs = []
    for sc in (full, cache):
        Client(sc.socket).reload("t", 1)  # both start on v1
        for i in range(clients_per_sidecar):
            logs.append(tmp_path / f"log{len(logs)}.npy")
            workers.spawn("versions", sock=str(sc.socket), table="t", seconds=120, seed=len(logs), stop=str(stop),
                          log=str(logs[-1]), expected=[str(tmp_path / "v1.npy"), str(tmp_path / "v2.npy")])
    workers.wait_for(lambda st: st.get("steps", 0) >= 20, timeout=60, what="steps before the first swap")
    swapped = []  # (time the reload returned, version now served)
    shm = []
    for k in range(swaps):
        time.sleep(1.0)
        version = 2 if k % 2 == 0 else 1
        for sc in (full, cache):
            with Client(sc.socket) as c:
                assert c.reload("t", version)
        swapped.append((time.time(), version - 1))
    time.sleep(2.5)
    stop.touch()
    workers.finish(timeout=60)
    time.sleep(1.0)  # the reaper frees the retired arenas of the last swap
    for sc in (full, cache):
        shm.append(sum(f.stat().st_size for f in sc.arena_files()))
    return swapped, [np.load(p) for p in logs], shm, exp


def _check(swapped, logs, shm):
    lag, lat_swap, lat_calm = [], [], []
    for log in logs:
        t, ver, dt = log[:, 0], log[:, 1].astype(int), log[:, 2]
        near = np.zeros(t.size, bool)
        for ts, v in swapped:
            after = t >= ts
            assert after.any(), "a client stopped stepping"
            first_new = t[after & (ver == v)]
            # steps that started 2 s after the reload returned are all on the new version
            # (until the next swap)
            nxt = min([s for s, _ in swapped if s > ts], default=np.inf)
            window = (t >= ts + 2.0) & (t < nxt)
            assert np.all(ver[window] == v), "a client stayed on the old version for more than 2 s"
            lag.append(first_new[0] - ts if first_new.size else np.inf)
            near |= (t >= ts - 0.5) & (t < ts + 1.0)
        lat_swap.append(dt[near])
        lat_calm.append(dt[~near])
    lat_swap, lat_calm = np.concatenate(lat_swap), np.concatenate(lat_calm)
    fig = dict(steps=int(sum(len(x) for x in logs)), swaps=len(swapped), max_switch_s=round(float(max(lag)), 3),
               p99_step_ms_during_swaps=round(float(np.percentile(lat_swap, 99)) * 1e3, 2),
               p99_step_ms_otherwise=round(float(np.percentile(lat_calm, 99)) * 1e3, 2), shm_bytes_after=shm)
    print(f"reload under load: {fig}")
    assert fig["max_switch_s"] <= 2.0
    return fig


def test_reload_under_load_short(tmp_path, workers, sidecars, rel):
    swapped, logs, shm, exp = _run(tmp_path, workers, sidecars, rel, clients_per_sidecar=1, swaps=2)
    _check(swapped, logs, shm)


@pytest.mark.reliability
def test_reload_under_load_8_clients_5_swaps(tmp_path, workers, sidecars, rel):
    swapped, logs, shm, exp = _run(tmp_path, workers, sidecars, rel, clients_per_sidecar=4, swaps=5)
    _check(swapped, logs, shm)
    # the old arenas' /dev/shm space is returned: what is left is one arena per sidecar
    full_bytes = exp[0].nbytes
    assert shm[0] <= full_bytes + 8192 and shm[1] <= full_bytes // 2, shm
