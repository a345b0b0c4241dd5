"""Mooncake Store plumbing: connect a client, and run a loopback cluster.

Mooncake Store (kvcache-ai/Mooncake) is a master that keeps object metadata
plus store processes that each lend a DRAM segment to the pool; a client reads
and writes objects by key, over TCP here (RDMA where the hardware has it).

`connect` is what `tierstore publish` and the remote tier use. `LocalCluster`
starts a real `mooncake_master` and N store processes on free loopback ports
(tests, the bench, a one-host try-out) and stops every one of them.
The package is optional: `pip install 'tierstore[remote]'`.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tierstore.errors import InvalidArgument, Unavailable

__all__ = ["connect", "parse_master", "LocalCluster", "missing_reason"]

CLIENT_BUFFER_BYTES = 64 << 20   # the client's transfer buffer (Mooncake's local_buffer_size)


def missing_reason() -> str | None:
    """Why Mooncake cannot run here, or None when it can."""
    try:
        import mooncake.store  # noqa: F401
    except (ImportError, OSError) as e:  # OSError: libibverbs.so.1 missing
        return (f"Mooncake Store is not usable ({e}); install it with `pip install 'tierstore[remote]'` "
                f"and Debian's libibverbs1 (`apt-get install -y libibverbs1`)")
    if master_binary() is None:
        return "mooncake_master is not on PATH nor next to the Python interpreter"
    return None


def master_binary() -> str | None:
    here = Path(sys.executable).parent / "mooncake_master"
    return str(here) if here.exists() else shutil.which("mooncake_master")


def parse_master(addr: str) -> str:
    """'mooncake://HOST:PORT' or 'HOST:PORT' -> 'HOST:PORT'."""
    a = str(addr).removeprefix("mooncake://")
    host, _, port = a.rpartition(":")
    if not host or not port.isdigit():
        raise InvalidArgument(f"--mooncake/--remote {addr!r}: write the master as HOST:PORT (e.g. 127.0.0.1:50051)")
    return a


def connect(master: str, metadata: str, *, segment_bytes: int = 0, buffer_bytes: int = CLIENT_BUFFER_BYTES):
    """A MooncakeDistributedStore client of `master` (HOST:PORT); segment_bytes > 0 also
    lends that much DRAM to the pool. Raises Unavailable when the master does not answer."""
    why = missing_reason()
    if why:
        raise Unavailable(why)
    from mooncake.store import MooncakeDistributedStore

    master = parse_master(master)
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1" if master.startswith("127.") else socket.gethostname(), metadata,
                     int(segment_bytes), int(buffer_bytes), "tcp", "", master)
    if rc != 0:
        raise Unavailable(f"cannot reach the Mooncake master {master} (metadata {metadata}): setup returned {rc}; "
                          f"is mooncake_master running with --enable_http_metadata_server?")
    return store


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise Unavailable(f"mooncake_master exited with {proc.returncode} at start")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise Unavailable(f"mooncake_master did not listen on {port} within {timeout}s")


class LocalCluster:
    """A mooncake_master plus `stores` store processes, each lending `segment_bytes`.

    client_ttl_s: how long the master waits for a dead store's heartbeat before
    it drops that store's replicas (Mooncake's default is 10 s).
    Use as a context manager; `stop()` leaves no process behind.
    """

    def __init__(self, stores: int = 2, segment_bytes: int = 256 << 20, *, client_ttl_s: int = 2,
                 log_dir: Path | None = None):
        self.segment_bytes, self.client_ttl_s = segment_bytes, client_ttl_s
        # every port its own: the master's metrics server defaults to 9003, so a second cluster on
        # the host (another test run, a user's own master) could not start
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.master_addr = f"127.0.0.1:{self.rpc_port}"
        self.metadata = f"http://127.0.0.1:{self.http_port}/metadata"
        self.log_dir = Path(log_dir) if log_dir else None
        self.master = None
        self.stores: list[subprocess.Popen] = []
        try:
            self.start_master()
            for _ in range(stores):
                self.add_store()
        except BaseException:
            self.stop()
            raise

    def _log(self, name: str):
        if self.log_dir is None:
            return subprocess.DEVNULL
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return open(self.log_dir / name, "ab")

    def start_master(self) -> None:
        why = missing_reason()
        if why:
            raise Unavailable(why)
        self.master = subprocess.Popen(
            [master_binary(), f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
             "--enable_http_metadata_server=true", f"--http_metadata_server_port={self.http_port}",
             "--http_metadata_server_host=127.0.0.1", f"--metrics_port={self.metrics_port}",
             "--metrics_host=127.0.0.1",
             f"--client_ttl={self.client_ttl_s}"],
            stdout=self._log("master.log"), stderr=subprocess.STDOUT, start_new_session=True)
        _wait_port(self.rpc_port, self.master, 20)
        _wait_port(self.http_port, self.master, 20)

    def stop_master(self) -> None:
        _stop(self.master)

    def add_store(self) -> subprocess.Popen:
        p = subprocess.Popen(
            [sys.executable, "-m", "tierstore.tiers.remote.mooncake", self.master_addr, self.metadata, str(self.segment_bytes)],
            stdout=subprocess.PIPE, stderr=self._log(f"store{len(self.stores)}.log"), start_new_session=True)
        self.stores.append(p)
        line = p.stdout.readline()
        if not line.startswith(b"READY"):
            raise Unavailable(f"a Mooncake store process did not start: {line!r}")
        return p

    def kill_store(self, i: int) -> None:
        p = self.stores[i]
        p.kill()
        p.wait()

    def connect(self, **kw):
        return connect(self.master_addr, self.metadata, **kw)

    def stop(self) -> None:
        for p in self.stores:
            _stop(p)
        _stop(self.master)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _stop(p) -> None:
    if p is None or p.poll() is not None:
        return
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(5)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    if p.stdout:
        p.stdout.close()


def _store_main(master: str, metadata: str, segment_bytes: str) -> None:
    """A store process: lend a segment to the pool and stay alive until SIGTERM."""
    store = connect(master, metadata, segment_bytes=int(segment_bytes), buffer_bytes=16 << 20)
    signal.signal(signal.SIGTERM, lambda *a: os._exit(0))  # Mooncake's teardown can block on a dead master
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    while True:
        time.sleep(3600)
    store.close()


if __name__ == "__main__":
    _store_main(*sys.argv[1:4])
