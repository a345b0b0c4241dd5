"""tierstore audit: every execution path compared with the in-process fp32 reference.

The commands the README and docs show are run here as shown (DOCUMENTED): `--quick` in
the default suite (every path, a small demo table and input: about a minute), the full
run and the V4.1 recipe slow-marked. The rest use one tiny demo table (engram-paper-demo
/ 512, ~11 MB) and a d_model=64 demo model; sidecars are real processes, stopped (and
their /dev/shm arenas removed) by the audit itself.
"""
from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest

from tierstore.bench.audit import EXACT_PATHS, PATHS, Audit, CustomPath
from tierstore.client.model.source import RowSource
from tierstore.errors import InvalidArgument

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from v41_checkpoint import write_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(batch=2, seq=32, decode_tokens=2, model_kwargs={"d_model": 64}, log=lambda *a: None)
QUICK = "tierstore audit --data DIR --out OUT --quick"  # docs/operations.md
FULL = "tierstore audit --data DIR --out OUT"  # docs/operations.md
V41 = "tierstore audit --checkpoint $CKPT --data /var/lib/tierstore --out audit-v41 --seq 64 --decode-tokens 0"
DOCUMENTED = {QUICK: "operations.md", FULL: "operations.md", V41: "deepseek-v41.md"}


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    from tierstore.ingest.demo_table import make_demo_tables

    d = tmp_path_factory.mktemp("audit") / "data"
    make_demo_tables(d, "engram-paper-demo", 512)
    return d


def _run_as_shown(cli, command: str, places: dict) -> tuple[int, str]:
    """(exit code, stdout) of a command the docs show, its placeholders (whole words) put in `places`."""
    argv = shlex.split(command)
    assert argv[:2] == ["tierstore", "audit"]
    code, out, _ = cli(*[places.get(a, a) for a in argv[1:]])
    return code, out


def _check(doc: dict, stdout: str, out: Path) -> dict:
    """What every audit run must show: every path in order, the exact ones bit-exact and
    deterministic (after a sidecar restart too), drift reported without failing. Returns
    the paths by name."""
    assert "path" in stdout and "max abs err logits" in stdout and "OK:" in stdout
    paths = {p["name"]: p for p in doc["paths"]}
    assert list(paths) == list(PATHS) and not any(p["error"] for p in doc["paths"]), doc["paths"]
    assert doc["offenders"] == [] and sorted(doc["exact_paths"]) == sorted(EXACT_PATHS)
    for name in EXACT_PATHS:  # serving moves bytes, never values
        p = paths[name]
        assert p["bit_exact"] and p["deterministic"], p
        assert p["logits_max_abs"] == 0.0 and p["top1_agree"] == 1.0
        assert name in stdout
    assert "after a sidecar restart" not in stdout  # the restart changed nothing
    assert "identical to the overlapped sidecar-cache run: yes" in paths["late-plan"]["note"]
    # the arena sized for one step and refilled with other rows: the runs read their rows from NVMe
    nvme = re.search(r"(\d+)% from NVMe", paths["sidecar-cold"]["note"])
    assert nvme and int(nvme.group(1)) >= 90, paths["sidecar-cold"]["note"]
    assert paths["triton"]["top1_agree"] == 1.0 and paths["triton"]["logits_max_abs"] < 1e-3
    png = (out / "audit.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    return paths


def _check_demo(paths: dict) -> None:
    """The demo table is fp32: each narrower row format drifts, reported, not a failure."""
    fp8 = paths["rows-fp8"]
    assert not fp8["bit_exact"] and fp8["engram_max_abs"] > 0 and fp8["logits_max_abs"] > 0
    assert 0.0 <= fp8["top1_agree"] <= 1.0 and fp8["deterministic"]
    assert 0 < paths["rows-bf16"]["engram_max_abs"] and "quantisation" in fp8["note"]
    assert "interpreter" in paths["triton"]["note"] or "GPU" in paths["triton"]["note"]


def test_every_audit_command_the_docs_show_is_run_here_as_shown():
    shown = {}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for cmd in re.findall(r"tierstore audit\b[^`\n]*", doc.read_text()):
            if cmd.strip() != "tierstore audit":  # the command named, not shown
                shown.setdefault(cmd.strip(), doc.name)
    assert shown == DOCUMENTED


@pytest.mark.parametrize("command,sizes", [(QUICK, (1, 16, 1)),
                                           pytest.param(FULL, (2, 128, 8), marks=pytest.mark.slow)], ids=["quick", "full"])
def test_demo_audit_as_documented_passes_every_path(cli, tmp_path, command, sizes):
    """`tierstore audit --data DIR --out OUT [--quick]` over an empty directory: a demo table
    made, every path run at the sizes of the run asked for, the sidecar paths bit-exact."""
    out = tmp_path / "report"
    code, stdout = _run_as_shown(cli, command, {"DIR": str(tmp_path / "data"), "OUT": str(out)})
    assert code == 0, stdout
    doc = json.loads((out / "audit.json").read_text())
    assert (doc["config"]["batch"], doc["config"]["seq"], doc["config"]["decode_tokens"]) == sizes
    _check_demo(_check(doc, stdout, out))


@pytest.mark.slow
def test_v41_audit_as_documented_passes_every_path(cli, tmp_path):
    """docs/deepseek-v41.md's audit, on a tiny checkpoint of the real layout: ingested first."""
    write_checkpoint(tmp_path / "ck")
    out = tmp_path / "report"
    code, stdout = _run_as_shown(cli, V41, {"$CKPT": str(tmp_path / "ck"), "/var/lib/tierstore": str(tmp_path / "data"),
                                           "audit-v41": str(out)})
    assert code == 0, stdout
    paths = _check(json.loads((out / "audit.json").read_text()), stdout, out)
    assert paths["rows-bf16"]["bit_exact"]  # fp8 values and ue8m0 scales are exact in bf16


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
