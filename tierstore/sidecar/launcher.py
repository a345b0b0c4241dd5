"""Start and stop a sidecar as a child process (used by `tierstore demo`, the
benchmarks and the tests — the real server in a real process).

    with SidecarProcess(data_dir, socket, dram_budget="1GiB") as sc:
        client = Client(sc.socket)
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tierstore.proto.frames import step_socket_path
from tierstore.sidecar.listeners import UNIX_PATH_MAX

__all__ = ["SidecarProcess"]


def _socket_dir() -> str:
    """A private directory for a sidecar's sockets: in the temporary directory, or in /tmp where
    a long TMPDIR would put the step socket past the length a unix socket path may have."""
    d = tempfile.mkdtemp(prefix="tierstore-")
    if len(os.fsencode(step_socket_path(Path(d) / "sidecar.sock"))) <= UNIX_PATH_MAX:
        return d
    os.rmdir(d)
    return tempfile.mkdtemp(prefix="tierstore-", dir="/tmp")


class SidecarProcess:
    """A sidecar (`tierstore serve`) run as a child process, for the tests, the benchmarks
    and `tierstore demo`: one job, start it, tell when it serves, stop it and clean up.

    start() runs `python -m tierstore serve --data data_dir --socket socket --dram-budget
    dram_budget *extra_args` (socket: a private temporary one when None) with `env` added to
    this process's environment, and returns once gRPC health says SERVING; RuntimeError with
    the log's tail when the child exits first, TimeoutError after start_timeout. The child
    gets --parent-pid, so it stops when this process dies. stop() sends `sig` and kills
    after `timeout`; cleanup() (also on leaving the `with` block) stops it and removes its
    shm files, its log and the temporary socket directory. Its output goes to log_path (a
    temporary file start() makes when None)."""

    def __init__(self, data_dir, socket=None, *, dram_budget="1GiB", extra_args=(), env=None,
                 start_timeout: float = 60.0, log_path=None):
        self.data_dir = Path(data_dir).resolve()  # the child runs in /, so paths must be absolute
        self._tmp = None
        if socket is None:
            self._tmp = _socket_dir()
            socket = Path(self._tmp) / "sidecar.sock"
        self.socket = Path(socket).absolute()
        # --parent-pid: a sidecar whose launcher dies (a killed test run) stops cleanly, not orphaned
        self.args = [sys.executable, "-m", "tierstore", "serve", "--data", str(self.data_dir),
                     "--socket", str(self.socket), "--dram-budget", str(dram_budget), "--parent-pid", str(os.getpid()),
                     *map(str, extra_args)]
        self.env = {**os.environ, **(env or {})}
        self.start_timeout = start_timeout
        # a temporary log is made by start(): one made here would outlive an object that is never
        # started (one built for its shm_files())
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None

    def start(self) -> "SidecarProcess":
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="tierstore-sidecar-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self._log = open(self.log_path, "wb")
        # cwd=/ keeps a checkout's top-level folders off sys.path of the child
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, cwd="/")
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sidecar exited with code {self.proc.returncode}:\n{self.log()}")
            if self.socket.exists() and self.healthy(timeout=1.0):
                return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"sidecar not healthy after {self.start_timeout}s:\n{self.log()}")

    def healthy(self, timeout: float = 1.0) -> bool:
        try:
            with grpc.insecure_channel(f"unix:{self.socket}") as ch:
                resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
                return resp.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def log(self) -> str:
        if self.log_path is None:  # never started
            return ""
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def shm_files(self) -> list[Path]:
        """Every /dev/shm file this sidecar owns: arenas and its lease board."""
        from tierstore.tiers.dram import arena_tag, own_files

        return own_files(Path("/dev/shm"), arena_tag(self.data_dir, str(self.socket.resolve())))

    def arena_files(self) -> list[Path]:
        """The arenas this sidecar owns (left behind only by a kill or --persist-arena)."""
        return [f for f in self.shm_files() if not f.name.endswith(".leases")]

    def cleanup(self) -> None:
        self.stop()
        for f in self.shm_files():
            f.unlink(missing_ok=True)
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
        if self._tmp:
            import shutil
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.cleanup()
