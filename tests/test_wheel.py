"""The project as a user installs it: a built wheel in a fresh virtualenv, no
editable install and no source tree on the path, serves a table.

The new environment borrows this one's third-party packages (torch, grpc, ...)
through a path entry; the dev venv's editable-install hook is a `.pth` there,
which a plain path entry does not run, so only the wheel provides `tierstore`.
"""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import time
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd, **kw):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=kw.pop("timeout", 300), **kw)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python, tierstore script, cwd) of a fresh venv holding only the built wheel."""
    tmp = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp / "dist"),
          str(ROOT)])
    wheel = next((tmp / "dist").glob("tierstore-*.whl"))
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    (site / "borrowed-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(wheel)])
    return py, env_dir / "bin" / "tierstore", tmp


def test_the_wheel_ships_every_package(installed):
    py, _, cwd = installed
    names = _run([str(py), "-c", "import importlib.metadata as m; print('\\n'.join(str(f) for f in "
                                 "m.files('tierstore')))"], cwd=cwd).split()
    shipped = {str(Path(n).parent) for n in names if n.endswith(".py")}
    for folder, pkg in (("tierstore", "tierstore"), ("client", "tierstore/client"), ("kernels", "tierstore/kernels"),
                        ("bench", "tierstore/bench"), ("proto", "tierstore/proto")):
        for init in (ROOT / folder).rglob("__init__.py"):
            sub = init.parent.relative_to(ROOT / folder)
            want = str(Path(pkg) / sub) if str(sub) != "." else pkg
            assert want in shipped, f"the wheel misses package {want}"
    where = _run([str(py), "-c", "import tierstore.sidecar.server as s; print(s.__file__)"], cwd=cwd)
    assert "site-packages" in where and str(ROOT) not in where


@pytest.mark.slow
def test_the_installed_command_serves_a_table(installed):
    py, script, cwd = installed
    data, sock = cwd / "data", cwd / "s.sock"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    _run([str(script), "demo-table", "--preset", "engram-paper-demo", "--scale", "512", "--data", str(data)],
         cwd=cwd, env=env)
    serve = subprocess.Popen([str(script), "serve", "--data", str(data), "--socket", str(sock), "--dram-budget",
                              "64MiB", "--parent-pid", str(os.getpid())], cwd=cwd, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not sock.exists():
            assert serve.poll() is None, f"tierstore serve exited {serve.returncode}: {serve.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, "tierstore serve did not come up in 120 s"
            time.sleep(0.2)
        served = _run([str(script), "lookup", "--socket", str(sock), "--table", "l1", "--ids", "0,5,77"],
                      cwd=cwd, env=env).split()
        # the same rows read straight from the version's files, by the installed package
        check = _run([str(py), "-c", f"""
import numpy as np
from tierstore.store.catalog import Catalog
from tierstore.tiers.nvme.reader import SegmentReader
cat = Catalog({str(data)!r})
v = cat.current("l1")
with SegmentReader({str(data)!r}, v, cat.checksums("l1", v.number)) as r:
    for i, row in zip((0, 5, 77), r.read_rows(np.array([0, 5, 77]))):
        print(i, row.tobytes().hex())
"""], cwd=cwd, env=env).split()
        assert served == check and len(served) == 6
    finally:
        serve.terminate()
        serve.wait(timeout=30)
    assert not sock.exists()
