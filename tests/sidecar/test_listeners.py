"""`tierstore serve` refuses a bad --socket / --listen / --tls-* / --metrics-port with
one clear line and exit 2, and never deletes what sits at --socket."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from tierstore.store.catalog import Catalog
from tierstore.ingest.writer import write_version
from tierstore.sidecar.launcher import SidecarProcess


@pytest.fixture
def data(tmp_path):
    d = tmp_path / "data"
    write_version(d, "t", [np.zeros((10, 16), np.uint8)], rows=10, row_format="fp32", row_dim=4)
    return d


def serve(cli, data, *args):
    code, out, err = cli("serve", "--data", data, "--dram-budget", "1MiB", *args)
    assert "Traceback" not in err and "GRPC_VERBOSITY" not in err
    return code, err


def test_a_regular_file_at_socket_is_never_deleted(cli, data, tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("keep me")
    code, err = serve(cli, data, "--socket", f)
    assert code == 2 and "is a regular file; refusing to replace it" in err
    assert f.read_text() == "keep me"


def test_a_typo_pointing_socket_at_the_catalog_keeps_the_catalog(cli, data):
    before = (data / "catalog" / "data.mdb").read_bytes()
    code, err = serve(cli, data, "--socket", data / "catalog" / "data.mdb")
    assert code == 2 and "refusing" in err
    assert (data / "catalog" / "data.mdb").read_bytes() == before
    with Catalog(data, readonly=True) as cat:
        assert cat.tables() == ["t"]


def test_a_directory_at_socket_is_refused(cli, data, tmp_path):
    code, err = serve(cli, data, "--socket", tmp_path)
    assert code == 2 and "is a directory" in err and tmp_path.is_dir()


@pytest.mark.parametrize("name, says", [("a%2Fs.sock", "it decodes each %XX escape"),
                                         ("a,b.sock", "at each ','"), ("a?b.sock", "at '?'"), ("a#b.sock", "at '#'")])
def test_a_socket_path_grpc_would_read_as_another_is_refused(cli, data, tmp_path, name, says):
    (tmp_path / "a").mkdir()
    code, err = serve(cli, data, "--socket", tmp_path / name)
    assert code == 2 and "gRPC reads a unix socket path as a URI" in err and says in err, err
    assert "choose a path without % , ? or #" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "data"] and not list((tmp_path / "a").iterdir())


def test_a_live_sidecar_is_never_taken_over(data, tmp_path):
    with SidecarProcess(data, tmp_path / "s.sock", dram_budget="1MiB") as a:
        ino = os.stat(a.socket).st_ino
        b = subprocess.run([sys.executable, "-m", "tierstore", "serve", "--data", str(data), "--socket",
                            str(a.socket)], capture_output=True, text=True, timeout=120)
        assert b.returncode == 2 and "another sidecar is serving on it" in b.stderr, b.stderr
        assert "Traceback" not in b.stderr
        assert os.stat(a.socket).st_ino == ino and a.healthy()


def test_a_stale_socket_is_replaced(data, tmp_path):
    path = tmp_path / "s.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()  # a socket file nobody listens on: what a killed sidecar leaves
    with SidecarProcess(data, path, dram_budget="1MiB") as sc:
        assert sc.healthy()
    assert not path.exists()


def test_a_start_refused_before_the_bind_leaves_a_stale_socket_as_it_was(cli, data, tmp_path):
    """The socket is claimed (a stale one removed) only at the bind: a start-up refused before
    it, here by a table that cannot be split, changes nothing at --socket."""
    path = tmp_path / "s.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()
    ino = os.stat(path).st_ino
    code, err = serve(cli, data, "--socket", path, "--split-layout", "t")
    assert code == 2 and "--split-layout t: the table is fp32" in err, err
    assert os.stat(path).st_ino == ino


def test_a_socket_whose_step_socket_would_be_too_long_is_refused_before_anything_binds(cli, data, tmp_path):
    """The step socket beside --socket (its path + ".steps") is the longer path: a --socket that
    fits but whose step socket does not is refused up front, not after the tables have loaded."""
    path = tmp_path / ("s" * (104 - len(os.fsencode(tmp_path)) - 1))  # 104 bytes; its step socket 110
    assert len(os.fsencode(path)) == 104
    code, err = serve(cli, data, "--socket", path)
    assert code == 2 and f"its step socket {path}.steps is 110 bytes long" in err and "limited to 107" in err, err
    assert list(tmp_path.iterdir()) == [data]  # nothing bound, nothing left


def test_a_sidecar_started_under_a_long_tmpdir_puts_its_sockets_where_they_fit(data, tmp_path, monkeypatch):
    import tempfile

    long = tmp_path / ("t" * 90)
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))  # what TMPDIR=long gives a fresh process
    with SidecarProcess(data, dram_budget="1MiB") as sc:
        assert len(os.fsencode(f"{sc.socket}.steps")) <= 107 and sc.healthy()
        sock_dir = sc.socket.parent
    assert not sock_dir.exists() and list(long.iterdir()) == []


def _busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_bind_failures_say_why(cli, data, tmp_path, monkeypatch):
    monkeypatch.setenv("TIERSTORE_AUTH_TOKEN", "tok")
    long = tmp_path / ("x" * 120)
    code, err = serve(cli, data, "--socket", long)
    assert code == 2 and "limited to 107" in err
    code, err = serve(cli, data, "--socket", tmp_path / "missing" / "s.sock")
    assert code == 2 and "does not exist" in err
    busy = _busy_port()
    try:
        port = busy.getsockname()[1]
        code, err = serve(cli, data, "--socket", tmp_path / "s.sock", "--allow-tcp", "--listen", f"127.0.0.1:{port}")
        assert code == 2 and "the port is in use" in err
        code, err = serve(cli, data, "--socket", tmp_path / "s.sock", "--metrics-port", port)
        assert code == 2 and "--metrics-port" in err and "in use" in err
    finally:
        busy.close()
    for bad in ("-1", "70000"):
        code, err = serve(cli, data, "--socket", tmp_path / "s.sock", "--metrics-port", bad)
        assert code == 2 and "1..65535" in err
    (tmp_path / "c.pem").write_text("-----BEGIN CERTIFICATE-----\njunk\n-----END CERTIFICATE-----\n")
    (tmp_path / "k.pem").write_text("junk")
    code, err = serve(cli, data, "--socket", tmp_path / "s.sock", "--allow-tcp", "--listen", "127.0.0.1:0",
                      "--tls-cert", tmp_path / "c.pem", "--tls-key", tmp_path / "k.pem")
    assert code == 2 and "not a PEM certificate chain" in err
    code, err = serve(cli, data, "--socket", tmp_path / "s.sock", "--allow-tcp", "--listen", "nonsense")
    assert code == 2 and "HOST:PORT" in err
    assert not (tmp_path / "s.sock").exists()


def test_stop_removes_its_own_socket_only(data, tmp_path):
    with SidecarProcess(data, tmp_path / "s.sock", dram_budget="1MiB") as a:
        a.socket.unlink()  # someone else's file now sits where our socket was
        a.socket.write_text("not ours")
        a.stop()
        assert a.socket.read_text() == "not ours"
        a.socket.unlink()
