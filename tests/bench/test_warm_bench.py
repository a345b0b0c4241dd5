"""`tierstore bench warm`: a restart with the warm start hits more in its first steps than one
without, both measured in the same run against the steady state before them."""
import json

import pytest


@pytest.mark.slow
def test_bench_warm_reports_warm_and_cold_restarts(cli, tmp_path):
    out = tmp_path / "out"
    code, stdout, _ = cli("bench", "warm", "--out", out, "--table-mib", "8", "--batch", "1024",
                          "--steady-steps", "60", "--after-steps", "30", "--no-progress")
    assert code == 0 and stdout.startswith("warm zipf1.0 b=1024 table 8 MiB")
    r = json.loads((out / "results.json").read_text())["scenarios"]["warm"]
    warm, cold = r["restarts"]["warm"], r["restarts"]["cold"]
    assert len(warm["hit_ratio_per_window"]) == len(cold["hit_ratio_per_window"]) == 3
    assert warm["warmed_rows"] > 0 and cold["warmed_rows"] == 0
    assert warm["hit_ratio_per_window"][0] > cold["hit_ratio_per_window"][0] + 0.1
    assert not list((out / "baselines").glob("warm-hot-set*"))
