"""`tierstore audit --checkpoint DIR`: the audit on a V4.1 checkpoint's real Engram layers."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from v41_checkpoint import write_checkpoint  # noqa: E402

from tierstore.cli import main


def test_audit_checkpoint_ingests_then_serves_bit_exact(tmp_path, capsys):
    ck, data, out = tmp_path / "ck", tmp_path / "data", tmp_path / "out"
    write_checkpoint(ck)
    rc = main(["audit", "--checkpoint", str(ck), "--data", str(data), "--out", str(out), "--seq", "16",
               "--decode-tokens", "0", "--no-restart", "--paths", "in-process", "sidecar-full", "rows-bf16",
               "--json", str(tmp_path / "copy.json")])
    text = capsys.readouterr().out
    assert rc == 0, text
    report = json.loads((out / "audit.json").read_text())
    assert report == json.loads((tmp_path / "copy.json").read_text())
    assert report["config"]["model"] == "tierstore.client.model.v41_model:audit_model"
    paths = {p["name"]: p for p in report["paths"]}
    assert paths["sidecar-full"]["bit_exact"] and paths["in-process"]["bit_exact"]
    assert paths["rows-bf16"]["bit_exact"]  # fp8 values and ue8m0 scales are exact in bf16
    assert (data / "catalog").exists()
