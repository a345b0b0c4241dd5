"""python -m tierstore.bench.remote: one small run writes its figures (no timed asserts)."""
from __future__ import annotations

import json

import pytest

from tierstore.mooncake import missing_reason


@pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))
def test_bench_writes_ratios(tmp_path):
    from tierstore.bench.remote import main

    assert main(["--out", str(tmp_path), "--rows", "5000", "--batch", "256", "--rounds", "3"]) == 0
    res = json.loads((tmp_path / "results.json").read_text())["scenarios"]["remote"]
    for k in ("nvme", "mooncake", "engramstore"):
        assert res[k]["rows_per_s"] > 0 and res[k]["p99_ms"] >= res[k]["p50_ms"]
    assert set(res["ratios"]) == {"mooncake_over_nvme", "mooncake_over_engramstore"}
