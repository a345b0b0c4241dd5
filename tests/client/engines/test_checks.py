"""client/engines/checks.py: the refusal table the plugins raise from is the one docs/engines.md shows,
and a table of another shape than the engine's layer is refused alike under both engines."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tierstore.client.engines import checks, sglang, sglang_stager, vllm_plugin, vllm_stager

DOC = Path(__file__).resolve().parents[3] / "docs" / "engines.md"


def test_the_docs_matrix_is_what_the_generator_prints():
    page = DOC.read_text()
    shown = re.search(r"<!-- matrix: python -m tierstore.client.engines.checks -->\n(.*?)<!-- /matrix -->",
                      page, re.S)
    assert shown, "docs/engines.md has no generated matrix"
    printed = subprocess.run([sys.executable, "-m", "tierstore.client.engines.checks"], capture_output=True,
                             text=True, check=True).stdout
    assert shown.group(1) == printed == checks.matrix()


def test_every_refused_feature_is_one_a_plugin_raises():
    """Each REFUSED row is named by the plugin that refuses it (the constant it raises with),
    and each name a plugin raises with is a REFUSED row: the matrix cannot list a refusal no
    code makes, nor miss one."""
    raised = {("sglang", n) for n in (sglang.SPECULATIVE, sglang.DUMMY, sglang.PEER_SHARDS, sglang.PER_RANK,
                                       sglang_stager.OVERLAP)}
    raised |= {("vllm", n) for n in (vllm_plugin.HBM_TABLES, vllm_plugin.DUMMY, vllm_stager.ASYNC_SCHEDULING,
                                     vllm_stager.RUNNER_V2, vllm_stager.ENGRAM_DP)}
    listed = {(f.engine, f.name) for f in checks.FEATURES if checks.REFUSED in (f.mapped, f.staged)}
    assert raised == listed
    for engine, name in raised:
        assert checks.EngineRefused.of(engine, name, "x").args[0].endswith(checks.feature(engine, name).fix)


def test_a_table_of_another_shape_is_one_checkpoint_mismatch_under_either_engine():
    """sglang and vLLM check a layer's table the same way, with the same error and fix."""
    for engine, shown in (("sglang", "sglang"), ("vllm", "vLLM")):
        with pytest.raises(checks.CheckpointMismatch, match=rf"'l3' holds 12 rows x 256 .*{shown}'s Engram layer 3 "
                                                            rf"wants 10 x 256 .*ingest the checkpoint {shown} serves"):
            checks.check_shape(engine, 3, "l3", 12, 256, 10, 256)
        with pytest.raises(checks.CheckpointMismatch, match="blocks of 128"):
            checks.check_shape(engine, 3, "l3", 10, 256, 10, 256, block_size=128)
        checks.check_shape(engine, 3, "l3", 10, 256, 10, 256)  # the layer's own shape: nothing raised
