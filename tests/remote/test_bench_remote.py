"""tierstore bench remote (and python -m tierstore.bench.remote): one small run writes its
figures, warm-up included (no timed asserts)."""
from __future__ import annotations

import json

import pytest

from tierstore.tiers.remote.mooncake import missing_reason

pytestmark = pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))


def _check(res):
    for k in ("nvme", "mooncake", "engramstore"):
        assert res[k]["rows_per_s"] > 0 and res[k]["p99_ms"] >= res[k]["p50_ms"]
    assert set(res["ratios"]) == {"mooncake_over_nvme", "mooncake_over_engramstore"}


def test_bench_writes_ratios(tmp_path):
    from tierstore.bench.remote import main

    assert main(["--out", str(tmp_path), "--rows", "5000", "--batch", "256", "--rounds", "3"]) == 0
    _check(json.loads((tmp_path / "results.json").read_text())["scenarios"]["remote"])


def test_cli_quick_prints_a_table_and_the_warm_up(tmp_path, cli):
    code, out, err = cli("bench", "remote", "--out", tmp_path, "--quick")
    assert code == 0, err
    assert "Mooncake EngramStore.lookup" in out and "2nd pass (written back)" in out and "warm-up" in out
    res = json.loads((tmp_path / "results.json").read_text())["scenarios"]["remote"]
    _check(res)
    w = res["warmup"]
    assert w["second_pass"]["local_fraction"] == 1.0 and w["second_pass"]["mooncake_bytes"] == 0
    assert w["written_blocks"] == w["blocks"] and w["dropped_blocks"] == 0
    assert w["fill"]["finished"] and w["fill"]["MB_s"] > 0 and "background fill only" in out
    assert res["setup"]["rows"] == 20_000 and "command" in res
