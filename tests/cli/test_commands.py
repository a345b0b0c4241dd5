"""The `tierstore` command builds only the subcommand it runs: `tierstore serve` (every
sidecar start) never imports torch, which only the model-side commands need."""
from __future__ import annotations

import subprocess
import sys

from tierstore.cli import COMMANDS


def _imports_after_parsing(argv: list[str]) -> set[str]:
    code = ("import sys; from tierstore.cli import build_parser, _command; "
            f"build_parser(_command({argv!r})).parse_args({argv!r}); "
            "print(' '.join(sorted(m for m in sys.modules if '.' not in m)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_serving_parses_without_importing_torch():
    assert "torch" not in _imports_after_parsing(["serve", "--data", "d"])


def test_every_command_still_parses_its_help():
    for name in COMMANDS:
        done = subprocess.run([sys.executable, "-m", "tierstore", name, "--help"], capture_output=True, text=True)
        assert done.returncode == 0 and f"usage: tierstore {name}" in done.stdout, (name, done.stderr[-500:])
