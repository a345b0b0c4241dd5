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


# a tracker's or a work log's number, in any case: the words issue(s), session(s), round and item(s)
# followed by a number (or "#" and one), in prose or in a name (test_issue_N); "rounds N" is the
# benches' own flag, not a tracker
_TRACKED = re.compile(r"(?:\b|_)(?:issues?|sessions?|round|items?)[ _]+#?\d", re.IGNORECASE)
# a bare "#N" in prose, a comment or a docstring; another project's issue cited as owner/repo#N stays
_HASH_NUMBER = re.compile(r"(?<![\w/.&#-])#\d+\b")
CODE_DIRS = ("tierstore", "client", "kernels", "bench", "proto", "tests")


def _prose_of_python(text: str) -> list[str]:
    """The comments and docstrings of a Python file: where a bare #N would be prose."""
    import ast
    import io
    import tokenize

    out = [tok.string.lstrip("#") for tok in tokenize.generate_tokens(io.StringIO(text).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append(ast.get_docstring(node, clean=False) or "")
    return out


def test_no_tracker_or_work_log_number_anywhere():
    """The repo states what is true of the project, never a number of the tracker or the work log
    that got it there (it means nothing to a reader, and git keeps the history): not in the docs,
    the README, the code's comments and docstrings, log and help texts, nor test names."""
    cited = []
    files = [f for f in _tracked() if f.split("/")[0] in CODE_DIRS or f == "README.md"
             or (f.startswith("docs/") and f.endswith(".md"))]
    for f in files:
        try:
            text = (ROOT / f).read_text()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary or not in this checkout
        cited += [f"{f}: {m.group(0)!r}" for m in _TRACKED.finditer(text)]
        prose = _prose_of_python(text) if f.endswith(".py") else [text] if f.endswith(".md") else []
        cited += [f"{f}: {m.group(0)!r}" for p in prose for m in _HASH_NUMBER.finditer(p)]
    assert not cited, f"tracker or work-log numbers: {cited}"


def _bench_scenarios() -> dict:
    """`tierstore bench`'s subcommands, from the real CLI parser."""
    import argparse

    from tierstore.cli import build_parser

    bench = next(a for a in build_parser("bench")._actions if isinstance(a, argparse._SubParsersAction))
    bench = next(a for a in bench.choices["bench"]._actions if isinstance(a, argparse._SubParsersAction))
    return bench.choices


def test_benchmarks_md_has_a_section_for_every_bench_scenario():
    """docs/benchmarks.md is read by scenario: every `tierstore bench` subcommand (but `report`,
    which prints an earlier run's results again) has its own `## ` section naming it."""
    headings = [line for line in (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
                if line.startswith("## ")]
    missing = [name for name in _bench_scenarios() if name != "report"
               and not any(f"`bench {name}`" in h for h in headings)]
    assert not missing, f"docs/benchmarks.md has no section for bench {missing}"


def _shown_commands(text: str) -> list[str]:
    """Every `tierstore ...` command a page shows: the lines of its fenced blocks (continuations
    joined) and its inline code spans (which may wrap)."""
    shown = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        shown += [line.strip() for line in block.replace("\\\n", " ").splitlines()
                  if line.strip().startswith("tierstore ")]
    shown += [" ".join(span.split()) for span in re.findall(r"`(tierstore [^`]+)`", text)]
    return shown


@pytest.mark.parametrize("doc", ["benchmarks.md", "decisions.md"])
def test_every_command_the_benchmark_docs_show_parses(doc):
    """A command docs/benchmarks.md or docs/decisions.md shows, parsed by the real CLI parser
    (nothing run): a renamed flag or scenario fails here, not in a reader's shell."""
    import contextlib
    import io
    import shlex

    from tierstore.cli import build_parser

    shown = _shown_commands((ROOT / "docs" / doc).read_text())
    assert shown, f"no tierstore command found in {doc}"
    bad = []
    for cmd in shown:
        argv = shlex.split(cmd)[1:]
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                build_parser(argv[0]).parse_args(argv)
        except SystemExit:
            bad.append(f"{cmd}: {err.getvalue().strip().splitlines()[-1:]}")
    assert not bad, f"{doc} shows commands the CLI refuses: {bad}"


def test_every_quoted_section_a_page_names_exists():
    """A pointer such as docs/decisions.md, "The step socket" (in the docs, the README or the
    code) names a heading that exists in that page."""
    pages = {p.name: [h.lower() for h in re.findall(r"^#+ (.+)$", p.read_text(), re.MULTILINE)]
             for p in DOCS}
    files = [f for f in _tracked() if f.endswith((".py", ".md"))
             and (f.split("/")[0] in CODE_DIRS or f == "README.md" or f.startswith("docs/"))]
    missing = []
    for f in files:
        text = (ROOT / f).read_text()
        for page, section in re.findall(r"([\w-]+\.md)[,:]\s+\"([^\"]+)\"", text):
            heads = pages.get(page)
            section = " ".join(section.replace("#", " ").split())  # a quote may wrap, in a comment too
            if heads is not None and not any(section.lower() in h for h in heads):
                missing.append(f"{f}: {page}, {section!r}")
    assert not missing, f"pointers to sections that do not exist: {missing}"
