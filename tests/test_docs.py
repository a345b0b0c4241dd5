"""The docs name files that exist: a module moved or renamed leaves no page
pointing at the old place (README.md and docs/*.md; an engine's file is looked
up in the installed engine, and skipped where that engine is not installed)."""
from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ENGINES = ("sglang", "vllm")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if ".venv" not in p.parts]
    return out.stdout.split()


def _engine_files(name: str) -> list[str]:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return []
    top = Path(list(spec.submodule_search_locations)[0])
    return [str(p.relative_to(top.parent)) for p in top.rglob("*.py")]


def _found(name: str, files: list[str]) -> bool:
    if "/" in name:
        return any(f == name or f.endswith("/" + name) for f in files)
    return any(f.rsplit("/", 1)[-1] == name for f in files)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_file_a_page_names_exists(doc):
    ours = _tracked()
    engines = {e: _engine_files(e) for e in ENGINES}
    missing = []
    for name in sorted(set(re.findall(r"[\w./-]+\.py\b", doc.read_text()))):
        if _found(name, ours):
            continue
        installed = [f for e in ENGINES for f in engines[e]]
        if _found(name, installed):
            continue
        if not all(engines.values()) and (name.split("/")[0] in ENGINES + ("srt", "models") or
                                          "engram" in name):
            continue  # an engine's file, that engine not installed here
        missing.append(name)
    assert not missing, f"{doc.name} names files that do not exist: {missing}"


def test_no_code_points_at_an_issue_number():
    """History lives in the notes and docs/benchmarks.md: a docstring or comment says what the
    code does and why, never an issue's number (it means nothing to a reader of the code),
    tests included, in either case (a docstring opening "Issue N:" too). Another project's
    issue, cited as `#N`, is a reference and stays."""
    cited = []
    for f in _tracked():
        if f.endswith(".py") and f.split("/")[0] in ("tierstore", "client", "kernels", "bench", "proto", "tests"):
            text = (ROOT / f).read_text()
            cited += [f"{f}: {m.group(0)}" for m in re.finditer(r"\bissues? \d+(?:\.\d+)?", text, re.IGNORECASE)]
    assert not cited, f"code names issue numbers: {cited}"
