"""The lookup and cold scenarios on tiny tables: sane figures, wrong rows caught."""
import numpy as np
import pytest

from tierstore.bench import baselines
from tierstore.bench.lookup import LookupOptions, WrongRows, run_lookup_bench, run_rounds
from tierstore.bench.workload import make_batches, parse_dist


def test_workload_is_seeded_in_range_and_skewed():
    a = make_batches("zipf1.2", 5000, 512, 4, seed=3)
    assert all(np.array_equal(x, y) for x, y in zip(a, make_batches("zipf1.2", 5000, 512, 4, seed=3)))
    flat = np.concatenate(a)
    assert flat.min() >= 0 and flat.max() < 5000 and flat.dtype == np.int64
    u = np.concatenate(make_batches("uniform", 5000, 512, 4))
    assert np.unique(flat).size < np.unique(u).size  # Zipf repeats its head
    with pytest.raises(ValueError, match="zipf"):
        parse_dist("pareto")


def test_lookup_scenario_numbers_are_sane(make_table, data_dir, tmp_path):
    tv, rows = make_table("t", rows=3000, row_bytes=64)
    res = run_lookup_bench(data_dir, tmp_path / "out", LookupOptions(batches=(256,), dists=("zipf1.0",), rounds=2,
                                                                    rows_per_pass=768, progress=False),
                           log=lambda *_: None)
    comps = res["cells"][0]["competitors"]
    expected = {"ceiling", "arena", "arena-cache", "inline", "mmap", "lmdb"}
    if baselines.redis_available() is None:
        expected.add("redis")
    else:
        assert "redis" in res["skipped"]
    assert expected <= set(comps)
    for name, d in comps.items():
        assert d["rows_per_s"] > 0 and d["ratio_vs_ceiling"] > 0, name
        assert 0 < d["p50_ms"] <= d["p99_ms"], name
    assert 0.0 <= comps["arena-cache"]["hit_ratio"] <= 1.0
    # the timed rounds' own hit ratio (the warm-up pass filled the arena), and the reading thread's CPU
    # against the ceiling's, which a loaded host's scheduling does not move
    assert 0.0 <= comps["arena-cache"]["hit_ratio_timed"] <= 1.0
    assert all(d["cpu_ratio_vs_ceiling"] > 0 for d in comps.values())
    assert (tmp_path / "out" / "baselines" / f"lmdb-t-v{tv.number}").is_dir()


def test_arena_huge_reads_huge_pages_and_the_run_says_what_each_arena_read_through(make_table, data_dir, tmp_path,
                                                                                     tmpfs):
    make_table("t", rows=24 * 1024, row_bytes=256)  # 6 MiB: three huge pages
    res = run_lookup_bench(data_dir, tmp_path / "out", LookupOptions(
        batches=(256,), dists=("uniform",), rounds=1, rows_per_pass=768, competitors=("arena", "arena-huge"),
        huge_shm_dir=str(tmpfs("within_size")), progress=False), log=lambda *_: None)
    assert set(res["cells"][0]["competitors"]) == {"ceiling", "arena", "arena-huge"}
    pages = res["config"]["pages"]
    assert pages["arena-huge"]["page_bytes"] == 2 << 20 and pages["arena-huge"]["client_mapped_bytes"] >= 6 << 20
    if pages["arena"]["page_bytes"] == 4096:  # this host's default: the client maps no huge page of it
        assert pages["arena"]["client_huge_bytes"] == 0


def test_interleaved_rounds_time_every_competitor():
    calls = []
    fns = {"a": lambda b: calls.append("a"), "b": lambda b: calls.append("b")}
    t = run_rounds(fns, [1, 2], rounds=3, after_warmup=lambda: calls.append("settled"))
    assert calls[:5] == ["a", "a", "b", "b", "settled"]  # warm-up pass first, then the settling wait
    assert calls[5:9] == ["a", "a", "b", "b"] and calls[9:11] == ["b", "b"]  # order rotates
    assert all(len(v["pass_s"]) == 3 and len(v["lat_s"]) == 6 for v in t.values())


def test_a_competitor_returning_wrong_rows_fails_loudly(make_table, data_dir, tmp_path, monkeypatch):
    make_table("t", rows=2000, row_bytes=64)
    real = baselines.MmapTable.get

    def corrupt(self, ids):
        out = real(self, ids).copy()
        out[0, 0] ^= 1
        return out

    monkeypatch.setattr(baselines.MmapTable, "get", corrupt)
    with pytest.raises(WrongRows, match="mmap"):
        run_lookup_bench(data_dir, tmp_path / "out", LookupOptions(batches=(64,), dists=("uniform",), rounds=1,
                                                                   rows_per_pass=64, competitors=("mmap",),
                                                                   progress=False), log=lambda *_: None)


@pytest.mark.slow
def test_cold_scenario_is_slower_than_dram_and_bounded(tmp_path):
    from tierstore.bench.cold import ColdOptions, run_cold_bench

    res = run_cold_bench(tmp_path / "out", ColdOptions(table_bytes=4 << 20, batch=1024, rounds=2, rows_per_pass=3072,
                                                       slack_bytes=16 << 20, progress=False), log=lambda *_: None)
    comps = res["competitors"]
    assert {"dram", "tierstore-cold", "mmap-cold"} <= set(comps) <= {"dram", "tierstore-cold", "tierstore-direct",
                                                                      "tierstore-local", "mmap-cold"}
    assert res["dram_budget_bytes"] == res["table_bytes"] // 4
    assert 0.0 <= comps["tierstore-cold"]["hit_ratio"] <= 1.0
    for name, d in comps.items():
        assert d["rows_per_s"] > 0 and d["ratio_vs_dram"] > 0, name
    assert {"tierstore-cold", "mmap-cold"} <= set(res["cold_start"])
    assert "fadvise" in res["page_cache_drop"]
    mem = res["memory_limits"]
    assert mem["cgroup"] in ("v1", "v2") or mem["reason"]


@pytest.mark.parametrize("row_bytes", [264, 66])  # copied as 8-byte words, and byte by byte
def test_the_compiled_ceiling_gathers_what_numpy_does_into_one_reused_buffer(row_bytes):
    from tierstore.bench.lookup import CompiledGather

    table = np.random.default_rng(1).integers(0, 256, size=(1000, row_bytes), dtype=np.uint8)
    ceiling = CompiledGather(table)
    a, b = np.array([5, 999, 0, 5], dtype=np.int64), np.array([7, 1, 2, 3], dtype=np.int64)
    got_a = ceiling.get(a).copy()
    got_b = ceiling.get(b)
    assert np.array_equal(got_a, table[a]) and np.array_equal(got_b, table[b])
    assert ceiling.get(a) is got_b  # the same buffer for the same batch size: nothing allocated per call


def test_the_ceiling_without_numba_is_numpys_take(numpy_path):
    from tierstore.bench import lookup

    numpy_path(lookup, "_GATHER")
    table = np.arange(64 * 40, dtype=np.uint8).reshape(64, 40)
    ceiling = lookup.CompiledGather(table)
    assert ceiling.kind.startswith("numpy")
    ids = np.array([3, 63, 3], dtype=np.int64)
    assert np.array_equal(ceiling.get(ids), table[ids])


@pytest.mark.slow
def test_lookup_table_mib_writes_its_own_table_once_and_leaves_out_whole_copies(tmp_path, monkeypatch):
    from tierstore.bench import lookup

    monkeypatch.setattr(lookup, "COPY_LIMIT", 1 << 20)  # a 2 MiB table counts as large here
    kw = dict(table_bytes=2 << 20, batches=(256,), dists=("uniform",), rounds=1, rows_per_pass=768,
              competitors=("arena", "mmap", "lmdb"), progress=False)
    quiet = dict(log=lambda *_: None)
    res = run_lookup_bench(tmp_path / "unused", tmp_path / "out", LookupOptions(**kw), **quiet)
    assert res["row_bytes"] == 264 and abs(res["table_bytes"] - (2 << 20)) < 264 * 1024
    assert res["config"]["ceiling"]["gather"] in ("numba", "numpy take (numba missing or TIERSTORE_NO_JIT=1)")
    assert set(res["cells"][0]["competitors"]) == {"ceiling", "arena", "mmap", "lmdb"}  # named: lmdb runs
    res = run_lookup_bench(tmp_path / "unused", tmp_path / "out", LookupOptions(**{**kw, "competitors": None}), **quiet)
    assert "lmdb" in res["skipped"] and "redis" in res["skipped"] and "lmdb" not in res["cells"][0]["competitors"]
    with pytest.raises(lookup.InvalidArgument, match="--table-mib"):
        run_lookup_bench(tmp_path / "unused", tmp_path / "out", LookupOptions(table="t", **kw), **quiet)


def test_a_lookup_run_neither_warms_from_nor_rewrites_the_datas_hot_sets(make_table, data_dir, tmp_path):
    """The arena-cache sidecars start cold (their hit ratio is the run's own) and record nothing:
    the hot set a serving sidecar left in the data directory is byte for byte what it was."""
    from tierstore.client.client import Client
    from tierstore.sidecar.launcher import SidecarProcess
    from tierstore.store.hot_set import hot_set_path

    tv, rows = make_table("t", rows=3000, row_bytes=64)
    with SidecarProcess(data_dir, dram_budget="64KiB") as sc, Client(sc.socket) as c:
        for _ in range(3):
            c.lookup("t", np.arange(0, 3000, 3))
        c.flush()
    path = hot_set_path(data_dir, "t", tv.number)
    before = path.read_bytes()
    res = run_lookup_bench(data_dir, tmp_path / "out", LookupOptions(batches=(256,), dists=("zipf1.0",), rounds=1,
                                                                    rows_per_pass=768, progress=False,
                                                                    competitors=("arena-cache",)),
                           log=lambda *_: None)
    assert res["cells"][0]["competitors"]["arena-cache"]["hit_ratio"] < 1.0  # cold: its warm-up pass missed
    assert path.read_bytes() == before
