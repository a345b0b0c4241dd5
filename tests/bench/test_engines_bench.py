"""`tierstore bench engines` end to end on a tiny table: sglang's real Engram, a real sidecar."""
from __future__ import annotations

import json

import pytest


def test_bench_engines_records_ratios_and_bit_exactness(tmp_path, cli):
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
    assert not list(tmp_path.glob("bench-engines-*"))  # its scratch table is removed
