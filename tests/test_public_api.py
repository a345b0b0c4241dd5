"""Every public module says what it exports (`__all__`), and every name it lists exists."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"tierstore": "tierstore", "tierstore.client": "client", "tierstore.kernels": "kernels",
            "tierstore.proto": "proto"}  # setup.py ROOTS; bench/ is a tool, not API
NOT_API = {"tierstore.__main__", "tierstore.proto.tierstore_pb2", "tierstore.proto.tierstore_pb2_grpc"}  # generated


def _modules() -> list[str]:
    out = []
    for pkg, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if path.name == "__init__.py" and _docstring_only(path):
                continue  # a package that only describes its modules exports nothing itself
            out.append(".".join([pkg, *parts]))
    return [m for m in out if m not in NOT_API]


def _docstring_only(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)


MODULES = _modules()


def test_the_walk_finds_the_package():
    assert {"tierstore.table.spec", "tierstore.client.model.in_process_table", "tierstore.kernels.gather",
            "tierstore.cli.hash", "tierstore.proto.frames", "tierstore.tiers.dram"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_module_declares_all_and_every_name_exists(name):
    mod = importlib.import_module(name)
    assert isinstance(getattr(mod, "__all__", None), (list, tuple)), f"{name} has no __all__"
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing, f"{name}.__all__ lists {missing}, which it does not define"
    assert len(set(mod.__all__)) == len(mod.__all__), f"{name}.__all__ repeats a name"
