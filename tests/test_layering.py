"""The core (tierstore/) never imports the client: arrows run client -> core, never back.

client/, kernels/ and bench/ are separate packages (pyproject `package-dir`); tierstore/ holds
the core and the CLI (the README's "Where things are" table). Two subcommands are clients of a running sidecar by nature and import
the RPC client inside run(); they are named here so that a new arrow is a decision, not a slip.
"""
from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "tierstore"
CLIENT_COMMANDS = {"commands/lookup.py", "commands/reload.py"}  # `tierstore lookup` / `reload` talk to a sidecar


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "tierstore":  # `from tierstore import client`
                out += [(node.lineno, f"tierstore.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, node.module))
    return out


def test_core_never_imports_the_client():
    files = sorted(CORE.rglob("*.py"))
    assert len(files) > 40
    bad = [f"{p.relative_to(CORE)}:{line} imports {mod}"
           for p in files if str(p.relative_to(CORE)) not in CLIENT_COMMANDS
           for line, mod in _imports(p) if mod == "tierstore.client" or mod.startswith("tierstore.client.")]
    assert not bad, "the core must not import tierstore.client:\n" + "\n".join(bad)


def test_core_modules_outside_the_cli_import_no_tool_package():
    # the CLI (commands/) runs the benchmarks and the audit; the rest of the core needs none of them
    tools = ("tierstore.client", "tierstore.bench", "tierstore.kernels")
    files = [p for p in sorted(CORE.rglob("*.py")) if p.relative_to(CORE).parts[0] not in ("commands", "audit.py")]
    bad = [f"{p.relative_to(CORE)}:{line} imports {mod}" for p in files for line, mod in _imports(p)
           if any(mod == t or mod.startswith(t + ".") for t in tools)]
    assert not bad, "\n".join(bad)


def test_the_check_sees_an_import(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from tierstore.client.sidecar import Client\nfrom tierstore import client\n")
    assert sorted(_imports(f)) == [(2, "tierstore.client.sidecar"), (3, "tierstore.client")]


def test_moved_modules_answer_to_their_old_names_with_a_warning():
    import subprocess
    import sys

    code = ("import importlib, warnings\n"
            "for old, new in [('tierstore.client.spec', 'tierstore.spec'), ('tierstore.client.hf_config', "
            "'tierstore.hf_config'), ('tierstore.client.tokenizer_map', 'tierstore.tokenizer_map'), "
            "('tierstore.client.profile', 'tierstore.profile'), ('tierstore.audit', 'tierstore.bench.audit')]:\n"
            "    with warnings.catch_warnings(record=True) as w:\n"
            "        warnings.simplefilter('always')\n"
            "        assert importlib.import_module(old) is importlib.import_module(new), old\n"
            "    assert any(issubclass(x.category, DeprecationWarning) and new in str(x.message) for x in w), old\n"
            "import tierstore.client.hasher as h, tierstore.hasher as core\n"
            "assert h is core and h.NgramHasher is __import__('tierstore.client').client.NgramHasher\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
