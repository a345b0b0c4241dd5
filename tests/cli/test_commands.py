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


import pytest  # noqa: E402

HUGE = "9" * 400


@pytest.mark.parametrize("flag, env, names", [
    ("0", None, r"size 0 is outside 1 byte\.\.1 PiB"),
    ("-1", None, r"cannot read size '-1'"),
    ("1e999GiB", None, r"cannot read size '1e999GiB'"),
    (HUGE, None, r"size a 400-character number is outside 1 byte\.\.1 PiB"),
    (f"{HUGE}.5GiB", None, r"size a 405-character number is outside"),
    (None, HUGE, r"size a 400-character number is outside 1 byte\.\.1 PiB"),
    (None, "0", r"size 0 is outside"),
], ids=["zero", "negative", "exponent", "400-digits", "400-digits-gib", "env-400-digits", "env-zero"])
def test_a_bad_dram_budget_is_a_clear_error_not_a_traceback(tmp_path, monkeypatch, capsys, flag, env, names):
    import re

    from tierstore.cli import main

    data = tmp_path / "data"
    data.mkdir()
    if env is not None:
        monkeypatch.setenv("TIERSTORE_DRAM_BUDGET", env)
    argv = ["serve", "--data", str(data), "--socket", str(tmp_path / "s.sock")]
    assert main(argv + (["--dram-budget", flag] if flag is not None else [])) == 2
    err = capsys.readouterr().err
    assert re.search(r"--dram-budget \(TIERSTORE_DRAM_BUDGET\): " + names, err), err
    assert list(tmp_path.iterdir()) == [data]
