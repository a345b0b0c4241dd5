"""The direction of imports, the architecture's arrows: `ALLOWED` below is the rule (what
each package may import besides itself and BASE; OPEN may import anything), and
docs/architecture.md's import-rules block states it line for line
(test_the_docs_state_the_import_rules).

Every import counts, a lazy one inside a function too: a cycle hidden in a
function body is still a cycle. Only `if TYPE_CHECKING:` imports (annotations,
never run) are left out. A new arrow is a decision made here, not a slip.
"""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"tierstore": "tierstore", "tierstore.client": "client", "tierstore.kernels": "kernels",
           "tierstore.bench": "bench", "tierstore.proto": "proto"}
BASE = {"errors", "jit", "cpu_token", "bounded_json", "tierstore"}  # utilities every layer may use
ALLOWED = {
    **{b: set() for b in BASE},
    "table": set(),
    "store": {"table"},
    "tiers": set(),
    "tiers.nvme": {"tiers", "store"},
    "tiers.remote": {"tiers", "tiers.nvme", "store"},
    "ingest": {"table", "store", "tiers.nvme"},
    "cache": {"tiers"},
    "cache.policy": {"cache", "tiers"},
    "engine": {"tiers", "tiers.nvme", "cache", "cache.policy"},
    "proto": set(),
    "sidecar": {"table", "store", "tiers", "tiers.nvme", "tiers.remote", "cache", "cache.policy", "engine", "proto"},
    "client": {"table", "store", "tiers", "tiers.nvme", "cache", "proto"},
    "client.model": {"client", "kernels", "table", "tiers", "cache.policy"},
    # engines fed by tierstore: through the client; table: the checkpoint's headers (checks.CheckpointCheck);
    # kernels and cache: the fast form probes the slot index on the device (staged_gather, slot_probe)
    "client.engines": {"client", "table", "kernels", "cache"},
    "kernels": {"table"},
}
OPEN = {"cli", "bench", "__main__"}  # may import anything of ours
SUBGROUPS = {("tiers", "nvme"), ("tiers", "remote"), ("cache", "policy"), ("client", "model"), ("client", "engines")}


def _module(path: Path) -> str:
    for name, folder in sorted(FOLDERS.items(), key=lambda kv: -len(kv[0])):
        base = ROOT / folder
        if path.is_relative_to(base):
            parts = [p for p in path.relative_to(base).with_suffix("").parts if p != "__init__"]
            return ".".join([name, *parts])
    raise ValueError(path)


def _group(module: str) -> str:
    parts = module.split(".")[1:]
    if not parts:
        return "tierstore"
    if len(parts) > 1 and (parts[0], parts[1]) in SUBGROUPS:
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


MODULES = {_module(p): p for folder in FOLDERS.values() for p in sorted((ROOT / folder).rglob("*.py"))}


def _walk(tree):
    """ast.walk without the bodies of `if TYPE_CHECKING:`."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            todo += node.orelse
            continue
        todo += list(ast.iter_child_nodes(node))


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of ours in `path`, at any depth."""
    out = []
    for node in _walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("tierstore")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.startswith("tierstore"):
            for a in node.names:  # `from tierstore.tiers import dram` imports a module
                sub = f"{node.module}.{a.name}"
                out.append((node.lineno, sub if sub in MODULES else node.module))
        elif isinstance(node, ast.ImportFrom) and node.level:
            out.append((node.lineno, "." * node.level + (node.module or "")))  # refused below: say the module
    return out


def _edges() -> dict[str, set[str]]:
    graph = defaultdict(set)
    for mod, path in MODULES.items():
        for _, dep in _imports(path):
            if dep in MODULES and dep != mod:
                graph[mod].add(dep)
    return graph


def test_the_walk_sees_every_layer():
    assert {_group(m) for m in MODULES} >= set(ALLOWED) | OPEN - {"__main__"}
    assert len(MODULES) > 100


def test_every_import_follows_the_arrows():
    bad = []
    for mod, path in MODULES.items():
        src = _group(mod)
        if src in OPEN:
            continue
        allowed = ALLOWED[src] | BASE | {src}
        for line, dep in _imports(path):
            if dep in MODULES or dep == "tierstore":
                to = _group(dep)
                if to not in allowed:
                    bad.append(f"{path.relative_to(ROOT)}:{line} ({src}) imports {dep} ({to})")
    assert not bad, "imports against the architecture's direction:\n" + "\n".join(bad)


def test_only_cli_and_bench_import_the_sidecar():
    users = {_group(m) for m, deps in _edges().items() for d in deps if _group(d) == "sidecar"}
    assert users <= {"sidecar", "cli", "bench"}, users


def test_no_import_cycle():
    graph = _edges()
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    # a package's __init__ importing its own modules is the one allowed loop (its listing)
    cycles = [c for c in cycles if not all(m.startswith(min(c, key=len) + ".") or m == min(c, key=len) for m in c)]
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_alias_module_is_left():
    # a module that only re-exports another under an old name keeps two names for one thing
    stubs = []
    for mod, path in MODULES.items():
        tree = ast.parse(path.read_text())
        body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        has_code = any(not isinstance(n, (ast.Import, ast.ImportFrom)) and
                       not (isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in n.targets))
                       for n in body)
        if body and not has_code and path.name != "__init__.py":
            stubs.append(mod)
        text = path.read_text()
        if "DeprecationWarning" in text or "old name" in text:
            stubs.append(mod)
    assert not stubs, f"alias modules: {stubs}"


def test_imports_name_their_module():
    rel = [f"{p.relative_to(ROOT)}:{line}" for p in MODULES.values() for line, m in _imports(p) if m.startswith(".")]
    assert not rel, f"relative imports (write the module's full name): {rel}"


def test_the_check_sees_an_import(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from tierstore.client.client import Client\nfrom tierstore import errors\n")
    assert sorted(_imports(f)) == [(2, "tierstore.client.client"), (3, "tierstore.errors")]


def _documented_rules() -> dict[str, set[str] | str]:
    """docs/architecture.md's import-rules block: `a, b -> c, d` gives a and b {c, d};
    `nothing` is the empty set, `anything` stays the word."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"<!-- import rules:[^\n]*-->\n```\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no import-rules block (<!-- import rules: ... --> then a fenced block)"
    rules = {}
    for line in block.group(1).splitlines():
        left, right = (s.strip() for s in line.split("->"))
        deps = right if right == "anything" else set() if right == "nothing" else set(right.replace(" ", "").split(","))
        for name in left.replace(" ", "").split(","):
            assert name not in rules, f"{name} has two lines in the docs' import rules"
            rules[name] = deps
    return rules


def test_the_docs_state_the_import_rules():
    assert _documented_rules() == {**ALLOWED, **{name: "anything" for name in OPEN}}
