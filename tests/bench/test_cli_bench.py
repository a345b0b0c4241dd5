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
