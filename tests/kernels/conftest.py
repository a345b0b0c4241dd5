"""Running a kernel test file's `interp_` tests in a child with TRITON_INTERPRET=1:
Triton fixes interpreter mode when it is first imported, so it cannot be
switched on inside this process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tierstore.kernels import triton_available


@pytest.fixture
def interpreter_child():
    def run(test_file: str) -> None:
        if not triton_available():
            pytest.skip("triton is not installed; the Triton kernel cannot be checked")
        env = dict(os.environ, TRITON_INTERPRET="1", TIERSTORE_KERNEL_TEST_CHILD="1")
        env.pop("TIERSTORE_FORCE_TORCH", None)
        root = Path(__file__).resolve().parents[2]
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-k", "interp_", str(test_file)],
                           cwd=root, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
        assert " passed" in r.stdout and "skipped" not in r.stdout.splitlines()[-1], r.stdout[-2000:]
    return run
