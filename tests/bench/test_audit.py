"""tierstore audit: every execution path compared with the in-process fp32 reference.

One tiny demo table (engram-paper-demo / 512, ~11 MB) and a d_model=64 demo
model keep the whole file to a few tens of seconds; sidecars are real
processes, stopped (and their /dev/shm arenas removed) by the audit itself.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from tierstore.bench.audit import EXACT_PATHS, PATHS, Audit, CustomPath
from tierstore.client.model.source import RowSource
from tierstore.errors import InvalidArgument

SMALL = dict(batch=2, seq=32, decode_tokens=2, model_kwargs={"d_model": 64}, log=lambda *a: None)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    from tierstore.ingest.demo_table import make_demo_tables

    d = tmp_path_factory.mktemp("audit") / "data"
    make_demo_tables(d, "engram-paper-demo", 512)
    return d


@pytest.mark.slow
def test_cli_audit_reports_every_path(cli, demo_dir, tmp_path):
    out = tmp_path / "report"
    code, stdout, _ = cli("audit", "--data", demo_dir, "--out", out, "--batch", 2, "--seq", 32,
                          "--decode-tokens", 2, "--d-model", 64, "--json", tmp_path / "copy.json")
    assert code == 0, stdout
    assert "path" in stdout and "max abs err logits" in stdout and "OK:" in stdout
    doc = json.loads((out / "audit.json").read_text())
    assert doc == json.loads((tmp_path / "copy.json").read_text())
    paths = {p["name"]: p for p in doc["paths"]}
    assert list(paths) == list(PATHS)
    assert doc["offenders"] == [] and sorted(doc["exact_paths"]) == sorted(EXACT_PATHS)
    for name in EXACT_PATHS:  # serving moves bytes, never values
        p = paths[name]
        assert p["bit_exact"] and p["deterministic"], p
        assert p["logits_max_abs"] == 0.0 and p["top1_agree"] == 1.0
        assert name in stdout
    assert "after a sidecar restart" not in stdout  # the restart changed nothing
    assert "identical to the overlapped sidecar-cache run: yes" in paths["late-plan"]["note"]
    assert "NVMe" in paths["sidecar-cold"]["note"]
    fp8 = paths["rows-fp8"]  # quantisation drifts: reported, not a failure
    assert not fp8["bit_exact"] and fp8["engram_max_abs"] > 0 and fp8["logits_max_abs"] > 0
    assert 0.0 <= fp8["top1_agree"] <= 1.0 and fp8["deterministic"]
    assert 0 < paths["rows-bf16"]["engram_max_abs"] and "quantisation" in fp8["note"]
    assert paths["triton"]["error"] == "" and "interpreter" in paths["triton"]["note"]
    assert paths["triton"]["top1_agree"] == 1.0 and paths["triton"]["logits_max_abs"] < 1e-3
    png = (out / "audit.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_corrupt_row_is_not_exact_and_fails_the_audit(demo_dir):
    from tierstore.bench.e2e import in_process_source
    from tierstore.cli.audit import format_table

    with Audit(demo_dir, restart=False, **SMALL) as audit:
        hot = int(audit.hot_ids("l1")[0])
        broken = in_process_source(demo_dir, audit.spec)
        rows = broken.rows("l1")
        rows[hot, 1] ^= 0xFF  # one byte of one row, mantissa bits: a small, silent drift
        flaky = _Alternating(broken, audit.in_process)
        report = audit.run(["in-process", "sidecar-full"],
                           extra=[CustomPath("corrupt-row", broken), CustomPath("flaky", flaky, expect_exact=False)])
        assert audit.sidecars.procs  # the full-resident sidecar ran
    assert not audit.sidecars.procs  # close() stopped it
    bad = {p.name: p for p in report.paths}["corrupt-row"]
    assert not bad.bit_exact and bad.deterministic and bad.engram_max_abs > 0
    assert report.offenders() == ["corrupt-row"] and report.exit_code == 1
    assert "NO (must be exact)" in format_table(report)
    flaky = {p.name: p for p in report.paths}["flaky"]  # drifts, but need not be exact: not an offender
    assert flaky.deterministic is False and "run 2" in flaky.nondeterminism


class _Alternating(RowSource):
    """A RowSource serving its plans alternately from two tables: runs do not repeat."""

    def __init__(self, a, b):
        self.sources, self.n = (a, b), {}

    def plan(self, table, ids):
        self.n[table] = self.n.get(table, 0) + 1
        return self.sources[self.n[table] % 2].plan(table, ids)

    def table_info(self, table):
        return self.sources[0].table_info(table)


def test_tokens_outside_the_vocabulary_are_refused(demo_dir):
    with pytest.raises(InvalidArgument, match="token ids must be in"):
        Audit(demo_dir, tokens=np.array([[1, 2, 10**6]]), **{k: v for k, v in SMALL.items() if k != "batch"})


def test_unknown_path_is_refused(demo_dir):
    with Audit(demo_dir, **SMALL) as audit, pytest.raises(InvalidArgument, match="paths are"):
        audit.run(["sidecar-warp"])
