"""client/engines/checks.py: the refusal table the plugins raise from is the one docs/engines.md shows,
a table of another shape than the engine's layer is refused alike under both engines, the sampled
rows are a fresh draw each start, and a table ingested before checkpoint records were kept is
checked by what its source note kept. (A changed checkpoint refused through vLLM's own loader:
test_vllm_plugin.py; sixteen kinds of change: tests/reliability/test_changed_checkpoint.py.)"""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from v41_checkpoint import write_checkpoint  # noqa: E402

from tierstore.client.engines import checks, sglang, sglang_stager, vllm_plugin, vllm_stager  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "engines.md"


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
    raised = {("sglang", n) for n in (sglang.DUMMY, sglang.PEER_SHARDS, sglang.PER_RANK, sglang.NUMA_SHARED,
                                      sglang_stager.CONTEXT_PARALLEL)}
    raised |= {("vllm", n) for n in (vllm_plugin.HBM_TABLES, vllm_plugin.DUMMY, vllm_stager.RUNNER_V1,
                                     vllm_stager.MICRO_BATCHES, vllm_stager.CONTEXT_PARALLEL, vllm_stager.ENGRAM_DP)}
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


WEIGHT, SCALE = torch.empty(0, dtype=torch.float8_e4m3fn), torch.empty(0, dtype=torch.uint8)  # the two parameters


def test_the_sample_is_a_fresh_draw_each_start_named_in_the_log_and_drawn_again_from_its_seed(caplog):
    rows = 100_000
    table = np.zeros((rows, 256), np.uint8)

    def check(seed=None):
        return checks.CheckpointCheck("vllm", 1, "l1", 1, rows, 256, lambda which, ids: table[ids], "sample",
                                      seed=seed)
    a, b = check(), check()
    sa, sb = a.sample(), b.sample()
    assert len(sa) == len(sb) == checks.SAMPLE_ROWS and (sa[0], sa[-1]) == (0, rows - 1) and np.all(np.diff(sa) > 0)
    assert len(np.intersect1d(sa, sb)) < 1000  # two starts share about SAMPLE_ROWS ** 2 / rows drawn rows, not all
    assert np.array_equal(check(a.seed).sample(), sa)
    changed = table.copy()
    changed[sa[7], 3] = 1
    with caplog.at_level(logging.INFO, logger="tierstore.client.engines.checks"):
        with pytest.raises(checks.CheckpointMismatch, match=rf"at row {sa[7]}: .* \(the sample's seed: {a.seed}\)$"):
            a(WEIGHT, torch.from_numpy(changed).view(torch.float8_e4m3fn))
    assert f"comparing 4096 of the 100000 rows of embed.weight with table l1 v1 (seed {a.seed})" in caplog.text


def test_a_table_ingested_before_records_were_kept_is_checked_by_its_shards_size_and_mtime(tmp_path, caplog):
    """Its source note kept the weight shard's path, size and mtime: a start compares those (and the
    sample), warning that a re-ingest records the rest; a shard with another mtime is refused."""
    from safetensors import safe_open

    from tierstore.ingest.checkpoint import _source_note
    from tierstore.store.version import TableVersion
    from tierstore.table.checkpoint import Checkpoint

    arrays = write_checkpoint(tmp_path)
    refs = Checkpoint(tmp_path).engram_tensors(1)
    rows = refs["weight"].shape[0]
    old = TableVersion(table="l1", number=1, rows=rows, row_format="fp8-e4m3-ue8m0", row_dim=256, row_bytes=264,
                       block_rows=rows, n_blocks=1, segments=("s",), segment_rows=rows, spec=None, layer_id=1,
                       created_at=0.0, source=_source_note(refs["weight"], refs["scale"]))
    record = old.checkpoint_record()
    assert set(record) == {"weight"} and record["weight"].xxh3_128 is None

    def load():
        check = checks.CheckpointCheck("sglang", 1, "l1", 1, rows, 256,
                                       lambda which, ids: arrays[1][f"embed.{which}"][ids], "sample",
                                       checkpoint=record)
        with safe_open(refs["weight"].path, "pt") as f:  # views of the shard's mapping, as the engines load
            check(WEIGHT, f.get_tensor(refs["weight"].name))
            check(SCALE, f.get_tensor(refs["scale"].name))
    with caplog.at_level(logging.WARNING, logger="tierstore.client.engines.checks"):
        load()
    assert "was ingested before checkpoint digests were kept: its shard's size and mtime and 4096 rows" in caplog.text
    assert "records no checkpoint tensor it was ingested from" in caplog.text  # the scale: the note named none
    st = refs["weight"].path.stat()
    os.utime(refs["weight"].path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    with pytest.raises(checks.CheckpointMismatch, match=rf"but mtime_ns {st.st_mtime_ns + 1} \(ingest: "
                                                        rf"{st.st_mtime_ns}\): .* TIERSTORE_SGLANG_VERIFY=all"):
        load()


def _neighbours(version: str) -> tuple[str, str]:
    """The releases just before and after `version` at the level the engine releases at
    (vLLM: 0.x.0 minors; sglang: 0.5.x patches)."""
    major, minor, micro = (int(p) for p in version.split("."))
    if micro == 0:
        return f"{major}.{minor - 1}.0", f"{major}.{minor + 1}.0"
    return f"{major}.{minor}.{micro - 1}", f"{major}.{minor}.{micro + 1}"


def test_the_engine_extras_admit_every_supported_release_and_no_other():
    """pyproject's tierstore[vllm] / tierstore[sglang] are ranges over the supported releases: a
    supported engine already installed satisfies its extra, so `pip install "tierstore[vllm]"`
    keeps it (pip changes an installed requirement only when it does not satisfy), and the
    releases just outside are not admitted (the plugin would refuse them)."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for engine, (dist, versions) in checks.SUPPORTED.items():
        [req] = [Requirement(r) for r in extras[engine]]
        assert req.name == dist
        assert all(req.specifier.contains(v) for v in versions), (engine, str(req.specifier))
        before, after = _neighbours(versions[0])[0], _neighbours(versions[-1])[1]
        assert not req.specifier.contains(before) and not req.specifier.contains(after), (engine, str(req))
