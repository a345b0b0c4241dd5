"""`tierstore bench ...` end to end: results.json, plots, summary lines, report."""
import json

import pytest

from tierstore.bench import baselines


def test_bench_lookup_writes_results_plot_and_report(cli, make_table, data_dir, tmp_path):
    make_table("t", rows=3000, row_bytes=64)
    out = tmp_path / "out"
    code, stdout, _ = cli("bench", "lookup", "--data", data_dir, "--out", out, "--batches", "128",
                          "--dists", "zipf1.0", "--rounds", "1", "--quick", "--no-progress")
    assert code == 0
    assert stdout.startswith("lookup zipf1.0 b=128: arena ")
    doc = json.loads((out / "results.json").read_text())
    assert {"machine", "git_commit", "scenarios"} <= set(doc)
    assert doc["machine"]["cores"] >= 1 and doc["machine"]["ram_bytes"] > 0
    lk = doc["scenarios"]["lookup"]
    assert {"seed", "command", "started_utc", "units", "cells"} <= set(lk)
    assert lk["units"]["rows_per_s"] == "rows/s"
    if baselines.redis_available() is not None:
        assert "redis" in lk["skipped"]
    assert (out / "lookup.png").stat().st_size > 1000

    code, report, _ = cli("bench", "report", out)
    assert code == 0
    assert "ceiling" in report and "zipf1.0 batch=128" in report and "lookup zipf1.0 b=128" in report


@pytest.mark.slow
def test_bench_cold_adds_to_the_same_results(cli, tmp_path):
    out = tmp_path / "out"
    (out).mkdir()
    (out / "results.json").write_text(json.dumps({"scenarios": {"earlier": {"summary": "kept"}}}))
    code, stdout, _ = cli("bench", "cold", "--data", tmp_path / "unused", "--out", out, "--table-mib", "4",
                          "--batch", "1024", "--quick", "--no-progress")
    assert code == 0 and stdout.startswith("cold zipf1.0 b=1024")
    doc = json.loads((out / "results.json").read_text())
    assert set(doc["scenarios"]) == {"earlier", "cold"}
    assert (out / "cold.png").stat().st_size > 1000


def test_bench_report_without_results_says_how(cli, tmp_path):
    code, _, err = cli("bench", "report", tmp_path)
    assert code == 2 and "tierstore bench lookup" in err


# every scenario of `bench all` cut to a tiny table: the suite runs in well under a minute
TINY_SUITE = ("--quick", "--no-progress", "--lookup-batches", "128", "--lookup-rounds", "1",
              "--lookup-dists", "zipf1.0", "--lookup-competitors", "arena", "--cold-table-mib", "4",
              "--cold-batch", "1024", "--cache-traces", "zipf1.0", "--cache-sizes", "0.01", "--cache-jobs", "1",
              "--cache-no-hbm-drift", "--hash-preset", "engram-paper-demo", "--e2e-rounds", "1",
              "--scale-large", "20000", "--scale-small", "5000", "--scale-rounds", "2",
              "--concurrency-clients", "2", "--concurrency-batch", "256", "--concurrency-seconds", "0.5",
              "--concurrency-rounds", "1")


@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory):
    from tierstore.ingest.demo_table import make_demo_tables

    d = tmp_path_factory.mktemp("bench-all") / "data"
    make_demo_tables(d, "engram-paper-demo", 512)
    return d


def test_bench_all_quick_runs_every_scenario(cli, tiny_demo, tmp_path):
    from tierstore.cli.bench import SCENARIOS

    out = tmp_path / "out"
    code, stdout, err = cli("bench", "all", "--data", tiny_demo, "--out", out, *TINY_SUITE)
    assert code == 0, err[-3000:]
    doc = json.loads((out / "results.json").read_text())
    assert set(doc["scenarios"]) == set(SCENARIOS)
    assert "skipped:" not in stdout
    cold = doc["scenarios"]["cold"]  # the cold parser's default budget, reached through `all`
    assert cold["dram_budget_bytes"] == int(cold["table_bytes"] * 0.25)
    # cold's misses against the disk's best 512-B queue depth of 32..256 (the probe bench large runs too)
    if "skipped" not in cold["disk"]:
        assert set(cold["disk"]) == {"512B_qd32", "512B_qd64", "512B_qd128", "512B_qd256"}
        assert all(d["seconds"] < 2 for d in cold["disk"].values())  # --quick: a fraction of a second a depth
        assert cold["disk_best_iops"] == cold["disk"][f"512B_qd{cold['disk_best_qd']}"]["iops"]
        for name in ("tierstore-local", "tierstore-direct"):
            d = cold["competitors"].get(name)
            if d is not None and cold["direct_io"] == "on":
                assert d["misses_per_s"] > 0
                assert d["misses_per_s_of_disk_best"] == d["misses_per_s"] / cold["disk_best_iops"]
        assert f"of the disk's {cold['disk_best_iops'] / 1e3:.0f}k IOPS at QD{cold['disk_best_qd']}" in stdout
    conc = doc["scenarios"]["concurrency"]
    assert conc["batch"] == 256
    # every round read rows: its workers start together once all are warm (a fixed head start let a
    # loaded host's late workers miss the round and report 0 rows/s)
    assert all(conc[read][f"rows_per_s_{n}"] > 0 for read in ("lookup", "plan") for n in (1, 2)), conc
    assert [line.split(" ")[0].rstrip(":") for line in stdout.splitlines()] == [
        "lookup", "cold", "zipf1", "hash", "e2e", "scale", "concurrency"]


def test_bench_all_gives_each_scenario_what_its_own_parser_would(tmp_path):
    from tierstore.cli import build_parser
    from tierstore.cli.bench import SCENARIOS, scenario_args

    common = ["--data", str(tmp_path), "--out", str(tmp_path / "o"), "--seed", "7", "--quick"]
    given = {"cold": ["--table-mib", "4", "--budget-fraction", "0.5", "--disk-seconds", "0.2"], "scale": ["--large", "9000"],
             "lookup": ["--batches", "128,256"], "cache": ["--sizes", "0.01", "--no-hbm-drift"]}
    flags = [f"--{name}-{opt.lstrip('-')}" if opt.startswith("--") else opt
             for name, opts in given.items() for opt in opts]
    suite = build_parser("bench").parse_args(["bench", "all", *common, *flags])
    for name in SCENARIOS:
        own = build_parser("bench").parse_args(
            ["bench", name, *(common if name not in ("cache", "hash", "scale") else common[2:]), *given.get(name, [])])
        want = {k: v for k, v in vars(own).items() if not k.startswith("_") and k != "command"}
        got = vars(scenario_args(name, suite, suite._scenario_parsers))
        if name in ("cache", "hash", "scale"):
            assert got.pop("data") == str(tmp_path)
        assert got == want, name


def test_every_flag_of_a_scenario_with_options_is_one_of_their_fields(tmp_path):
    """`tierstore bench` hands a scenario's flags to its options dataclass by name: a flag
    whose dest were no field would be dropped without a word."""
    from dataclasses import fields

    from tierstore.bench.cold import ColdOptions
    from tierstore.bench.large import LargeOptions
    from tierstore.bench.lookup import LookupOptions
    from tierstore.bench.warm import WarmOptions
    from tierstore.cli import build_parser

    parsers = build_parser("bench").parse_args(["bench", "report", str(tmp_path)])._scenario_parsers
    for name, options in {"cold": ColdOptions, "lookup": LookupOptions, "large": LargeOptions,
                          "warm": WarmOptions}.items():
        dests = {a.dest for a in parsers[name]._actions} - {"data", "out", "help"}  # where, not how
        if "table_mib" in dests:  # handed over in bytes
            dests = dests - {"table_mib"} | {"table_bytes"}
        names = {f.name for f in fields(options)}
        assert dests <= names, (name, dests - names)
