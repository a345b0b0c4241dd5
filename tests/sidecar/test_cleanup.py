"""A sidecar cleans up what it created on every exit path."""
from __future__ import annotations

import signal
import socket as socketlib
import time

import numpy as np
import pytest

from tierstore.client.client import Client
from tierstore.ingest.writer import write_version
from tierstore.sidecar.launcher import SidecarProcess


def _table(d, rows: int, dim: int = 64, seed: int = 0) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, size=(rows, dim * 4), dtype=np.uint8)
    write_version(d, "t", [data[i:i + 65536] for i in range(0, rows, 65536)], rows=rows, row_format="fp32",
                  row_dim=dim)
    return data


def test_sigterm_while_tables_load_leaves_no_arena(tmp_path):
    d = tmp_path / "data"
    _table(d, 200_000)  # 51 MB: loading takes a moment
    sc = SidecarProcess(d, dram_budget="256MiB", log_path=tmp_path / "sidecar.log")
    sc._log = open(sc.log_path, "wb")
    import subprocess

    sc.proc = subprocess.Popen(sc.args, stdout=sc._log, stderr=subprocess.STDOUT, cwd="/")
    try:
        deadline = time.monotonic() + 30
        while not any(f.name.endswith(".new") for f in sc.shm_files()) and time.monotonic() < deadline:
            time.sleep(0.002)
        sc.proc.send_signal(signal.SIGTERM)
        sc.proc.wait(30)
        assert sc.shm_files() == [], f"left behind: {sc.shm_files()}"
    finally:
        sc.cleanup()


def test_a_failed_start_leaves_no_socket_or_arena(tmp_path):
    d = tmp_path / "data"
    _table(d, 1000)
    with socketlib.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        sc = SidecarProcess(d, dram_budget="64MiB", extra_args=["--metrics-port", port])
        with pytest.raises(RuntimeError):
            sc.start()
        try:
            assert sc.shm_files() == [] and not sc.socket.exists()
        finally:
            sc.cleanup()


def test_persisted_arenas_of_versions_no_longer_current_are_removed(tmp_path):
    d = tmp_path / "data"
    _table(d, 1000, seed=1)
    sc = SidecarProcess(d, dram_budget="64MiB", extra_args=["--persist-arena"]).start()
    try:
        sc.stop()
        assert any(".t.v1" in f.name for f in sc.arena_files())
        v2 = _table(d, 1000, seed=2)
        sc2 = SidecarProcess(d, socket=sc.socket, dram_budget="64MiB", extra_args=["--persist-arena"]).start()
        try:
            names = [f.name for f in sc2.arena_files()]
            assert not any(".t.v1" in n for n in names) and any(".t.v2" in n for n in names)
            with Client(sc2.socket) as c:
                assert np.array_equal(c.lookup("t", np.arange(1000)), v2)
        finally:
            sc2.cleanup()
    finally:
        sc.cleanup()
    assert sc.shm_files() == []


_LAUNCHER = """
import sys, time
from tierstore.sidecar.launcher import SidecarProcess
sc = SidecarProcess(sys.argv[1], dram_budget="64MiB").start()
print(sc.proc.pid, sc.socket, sc.log_path, flush=True)
time.sleep(600)
"""


def test_a_sidecar_whose_launcher_is_killed_stops_and_cleans_up(tmp_path):
    """A killed test run or benchmark must not leave its sidecar serving, or its arenas in /dev/shm."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    d = tmp_path / "data"
    _table(d, 1000)
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(d)], stdout=subprocess.PIPE, text=True)
    made = []  # the launcher's own files, which its kill leaves: its log and socket directory
    try:
        pid, sock, log = launcher.stdout.readline().split()
        made = [Path(log), Path(sock).parent]
        side = SidecarProcess(d, socket=sock)  # for its shm_files(): the files this sidecar's tag names
        assert side.shm_files() and Path(sock).exists()
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 20
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
        if alive:
            os.kill(int(pid), signal.SIGKILL)
        assert not alive, "the sidecar kept serving after its launcher died"
        assert side.shm_files() == [] and not Path(sock).exists()
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.stdout.close()
        import shutil

        for f in made:
            if f.is_dir():
                shutil.rmtree(f, ignore_errors=True)
            else:
                f.unlink(missing_ok=True)


def test_health_says_serving_only_once_the_step_socket_and_tables_are_up(tmp_path):
    """A launcher returns on SERVING and may stop the sidecar at once: a stop that came while the
    step socket was still starting left its arenas behind (grpc's servicer said SERVING from the start)."""
    from grpc_health.v1 import health_pb2

    from tierstore.sidecar.config import ServeConfig
    from tierstore.sidecar.server import Server

    d = tmp_path / "data"
    _table(d, 1000)
    server = Server(ServeConfig.from_env(data_dir=d, socket=tmp_path / "s.sock", dram_budget="64MiB"))
    try:
        check = lambda: server.health.Check(health_pb2.HealthCheckRequest(service=""), None).status  # noqa: E731
        assert check() == health_pb2.HealthCheckResponse.NOT_SERVING
        server.start()
        assert check() == health_pb2.HealthCheckResponse.SERVING and server.steps.path.exists()
    finally:
        server.stop(grace=0)
    assert not (tmp_path / "s.sock").exists()


def test_a_step_socket_stopped_before_its_acceptor_ran_stops_cleanly(tmp_path):
    import threading

    from tierstore.bench.step_socket import ModuloHandler
    from tierstore.sidecar.step_server import StepServer

    srv = StepServer(tmp_path / "f.steps", ModuloHandler())
    srv._listener = srv._bind()
    srv._acceptor = threading.Thread(target=srv._accept_loop, daemon=True)  # a SIGTERM came before start() ran it
    srv.stop()
    assert not (tmp_path / "f.steps").exists()


@pytest.mark.parametrize("pid", ["-5", str(2**40), "0", "not-the-parent"])
def test_a_parent_pid_that_is_not_the_parent_is_refused_before_any_table_loads(tmp_path, pid):
    """--parent-pid names the process that started the sidecar; anything else was a mistake
    that used to load every table and then stop at once with exit 0."""
    import subprocess
    import sys

    d = tmp_path / "data"
    _table(d, 1000)
    sock = tmp_path / "s.sock"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # alive, not the parent
    try:
        value = str(other.pid) if pid == "not-the-parent" else pid
        done = subprocess.run([sys.executable, "-m", "tierstore", "serve", "--data", str(d), "--socket", str(sock),
                               "--dram-budget", "64MiB", f"--parent-pid={value}"],
                              capture_output=True, text=True, timeout=60, cwd="/")
    finally:
        other.kill()
        other.wait()
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and "--parent-pid" in lines[0] and value in lines[0] and "parent" in lines[0], lines
    assert "serving" not in done.stdout and not sock.exists()
    assert SidecarProcess(d, socket=sock).shm_files() == []


def test_a_burst_of_signals_stops_the_sidecar_cleanly(tmp_path):
    """Ctrl-C pressed again and again, or a supervisor repeating SIGTERM: the sidecar stops,
    exit 0, its socket and arenas gone. (A handler that set a threading.Event deadlocked
    when a signal landed while the main thread held the Event's lock: the sidecar hung.)"""
    d = tmp_path / "data"
    _table(d, 4096)
    for sig in (signal.SIGINT, signal.SIGTERM):
        sc = SidecarProcess(d, dram_budget="8MiB").start()
        shm = sc.shm_files()
        assert shm
        try:
            deadline = time.monotonic() + 5
            while sc.proc.poll() is None and time.monotonic() < deadline:
                sc.proc.send_signal(sig)
            sc.proc.wait(10)
            assert sc.proc.returncode == 0, sc.log()
            assert not sc.socket.exists() and not any(p.exists() for p in shm)
        finally:
            sc.cleanup()


def test_a_sigterm_taken_by_another_thread_stops_the_sidecar(tmp_path):
    """A supervisor's SIGTERM may be handed to any thread of the sidecar (gRPC's, the lease
    reaper's), not the main thread that waits to stop: the sidecar must stop all the same,
    exit 0, its socket and arenas gone. The signal is sent to each other thread in turn."""
    import ctypes
    import os
    import platform

    libc = ctypes.CDLL(None, use_errno=True)
    sys_tgkill = {"x86_64": 234, "aarch64": 131}.get(platform.machine())
    if sys_tgkill is None:
        pytest.skip(f"tgkill's syscall number on {platform.machine()} is not known here")
    d = tmp_path / "data"
    _table(d, 4096)
    sc = SidecarProcess(d, dram_budget="64KiB").start()  # cache mode: reaper, verifier, learner threads
    try:
        with Client(sc.socket) as c:
            c.lookup("t", np.arange(10))
        pid = sc.proc.pid
        others = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
        assert others, "the sidecar runs its gRPC and step-socket threads"
        shm = sc.shm_files()
        assert libc.syscall(sys_tgkill, pid, others[-1], int(signal.SIGTERM)) == 0, ctypes.get_errno()
        try:
            sc.proc.wait(10)
        except Exception:
            pytest.fail(f"a SIGTERM taken by thread {others[-1]} did not stop the sidecar within 10 s")
        assert sc.proc.returncode == 0, sc.log()
        assert "tierstore stopped" in sc.log()
        assert not sc.socket.exists() and not any(p.exists() for p in shm)
    finally:
        sc.cleanup()


def test_a_launcher_never_started_makes_no_file(tmp_path, monkeypatch):
    """A SidecarProcess built only for its shm_files() (as the tests above do) leaves no log
    or socket directory in the temporary directory: start() makes them, cleanup() removes them."""
    import tempfile

    temp = tmp_path / "t"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    d = tmp_path / "data"
    _table(d, 10)
    assert SidecarProcess(d, socket=tmp_path / "s.sock").shm_files() == []
    assert list(temp.iterdir()) == []
    sc = SidecarProcess(d, dram_budget="1MiB").start()
    made = [sc.log_path, sc.socket.parent]  # the socket's directory in /tmp where temp's path is too long
    assert all(p.exists() for p in made) and sc.log_path.parent == temp
    sc.cleanup()
    assert not any(p.exists() for p in made) and list(temp.iterdir()) == []
