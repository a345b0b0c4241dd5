"""Area 2: a client killed mid-step leaks nothing: its leases end by TTL, its
arena mappings go with it, and the sidecar's memory returns to where it was."""
from __future__ import annotations

import time

import numpy as np
import pytest

from tierstore.client.client import Client

ROWS = 60_000  # x 64 B
TTL_S = 1.0


@pytest.fixture(scope="module")
def table(tmp_path_factory, rel):
    d = tmp_path_factory.mktemp("clientkill")
    expected = rel.write_table(d / "data", "t", ROWS, dim=16, fmt="fp32", seed=4)
    return d / "data", expected


def _kill_cycles(table, workers, sidecars, rel, cycles, per_cycle):
    data, expected = table
    sc = sidecars(data, "1MiB", "--lease-ttl", TTL_S)  # 16k slots
    pid = sc.proc.pid
    with Client(sc.socket, timeout=10) as c:
        cap = c.tables()[0]["arena_slots"]
        arena = c.handle("t")._arena_path
        rng = np.random.default_rng(0)
        # warm up: fill the arena and let every RPC path allocate what it keeps
        for _ in range(6):
            with c.plan("t", rng.integers(0, ROWS, cap // 2)) as s:
                s.rows()
        leased = lambda: int(c.stats()["tables"][0]["leased_slots"])
        base = rel.proc_status(pid)
        samples = []
        for cycle in range(cycles):
            n = cap // (2 * per_cycle)
            procs = [workers.spawn("hold", sock=str(sc.socket), table="t", n=n, start=i * n, ttl_s=TTL_S)
                     for i in range(per_cycle)]
            for p in procs:
                assert p.stdout.readline().strip() == b"planned"
            assert leased() >= cap // 2 - per_cycle
            assert set(rel.mappers_of(arena, [p.pid for p in procs])) == {p.pid for p in procs}
            for p in procs:
                p.kill()
                p.wait()
            deadline = time.monotonic() + TTL_S + 10
            while leased() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert leased() == 0 and int(c.stats()["leases_active"]) == 0, "a dead client's lease outlived its TTL"
            assert rel.mappers_of(arena, [p.pid for p in procs]) == []
            # the rows the dead clients held are evictable again: a full-arena step fits
            with c.plan("t", rng.choice(ROWS, 3 * cap // 4, replace=False)) as s:
                ids = s._ids
                assert np.array_equal(s.rows(), expected[ids])
            samples.append(rel.proc_status(pid))
        end = rel.proc_status(pid)
    return base, end, samples


def _assert_rss_back(base, end):
    # anonymous memory is the leak-relevant part (the arena is shared memory, counted once touched)
    assert end["RssAnon"] <= base["RssAnon"] + 24 * 2**20, (base, end)
    assert end["VmRSS"] <= base["VmRSS"] + 32 * 2**20, (base, end)


def test_killed_clients_leak_no_lease_mapping_or_memory_short(table, workers, sidecars, rel):
    base, end, _ = _kill_cycles(table, workers, sidecars, rel, cycles=1, per_cycle=2)
    _assert_rss_back(base, end)


@pytest.mark.reliability
def test_killed_clients_leak_nothing_over_many_cycles(table, workers, sidecars, rel):
    base, end, samples = _kill_cycles(table, workers, sidecars, rel, cycles=12, per_cycle=4)
    print(f"sidecar RSS base {base['VmRSS'] / 2**20:.1f} MiB (anon {base['RssAnon'] / 2**20:.1f}), "
          f"after 48 killed clients {end['VmRSS'] / 2**20:.1f} MiB (anon {end['RssAnon'] / 2**20:.1f})")
    _assert_rss_back(base, end)
    # no upward trend across the last cycles either
    assert samples[-1]["RssAnon"] <= samples[len(samples) // 2]["RssAnon"] + 8 * 2**20
