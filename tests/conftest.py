"""Shared fixtures. Keep this small: fixtures used by one test file live there."""
from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def data_dir(tmp_path):
    """An empty tierstore data directory, removed with tmp_path."""
    return tmp_path / "data"


@pytest.fixture
def make_table(data_dir):
    """make_table(name, rows, row_bytes=..., seed=0, **write_version kwargs) -> (TableVersion, rows uint8).

    Writes random uint8 rows as an fp32 table (row_bytes must be a multiple of 4)
    and returns its manifest and the exact bytes written.
    """
    from tierstore.ingest.writer import write_version

    def make(name="t", rows=1000, row_bytes=64, seed=0, chunk=333, **kw):
        data = np.random.default_rng(seed).integers(0, 256, size=(rows, row_bytes), dtype=np.uint8)
        tv = write_version(data_dir, name, (data[i:i + chunk] for i in range(0, rows, chunk)), rows=rows,
                           row_format="fp32", row_dim=row_bytes // 4, **kw)
        return tv, data

    return make


@pytest.fixture
def cli(capsys):
    """cli(*argv) -> (exit code, stdout, stderr) of the `tierstore` command, run in-process."""
    from tierstore.cli import main

    def run(*argv):
        code = main([str(a) for a in argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


@pytest.fixture
def numpy_path(monkeypatch):
    """numpy_path(module, *kernels): those tierstore.jit.Kernel globals of `module` act
    as if numba were missing, so the code under test takes its numpy reference path."""
    from tierstore import jit

    if not jit.enabled():
        pytest.skip("numba is not installed: only the numpy path exists")

    class Off:
        def compiled(self):
            return None

    def off(module, *names):
        for name in names:
            monkeypatch.setattr(module, name, Off())
    return off
