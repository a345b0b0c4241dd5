"""The floor under the step socket: a bare round trip of N int64 ids between two Python processes.

    python -m tierstore.bench.step_socket_floor [--ids 256 32768] [--calls 3000]

Designs timed side by side (Linux; the server is a forked child doing ids & mask):
  stream   ids and slots through a unix stream socket, server blocked in recv (what fastpath.py does)
  epoll    the same, the server waits in epoll first (an event loop serving many clients)
  shm      ids and slots through a shared mapping, an 8-byte doorbell on the socket; both sides copy
           out of the mapping (a client may scribble on it, and the next step reuses it)
The gap between these and bench/step_socket.py is Python framing, parsing and the handler.
"""
from __future__ import annotations

import argparse
import mmap
import os
import select
import socket
import time

import numpy as np

__all__ = ["floor_round_trips", "main"]
MASK = (1 << 20) - 1


def _recv_exact(sock: socket.socket, view: memoryview, n: int) -> None:
    got = 0
    while got < n:
        k = sock.recv_into(view[got:n])
        if not k:
            raise EOFError
        got += k


def _serve(sock: socket.socket, mode: str, n: int, shm: mmap.mmap) -> None:
    buf = memoryview(bytearray(n * 8 + 8))
    poller = select.epoll()
    poller.register(sock.fileno(), select.EPOLLIN)
    ids_in, slots_out = np.frombuffer(shm, np.int64, n, 0), np.frombuffer(shm, np.int64, n, n * 8)
    while True:
        if mode == "shm":
            _recv_exact(sock, buf, 8)
            np.bitwise_and(ids_in.copy(), MASK, out=slots_out)
            sock.sendall(b"\0" * 8)
        else:
            if mode == "epoll":
                poller.poll()
            _recv_exact(sock, buf, n * 8)
            sock.sendall(np.frombuffer(buf, np.int64, n) & MASK)


def floor_round_trips(n: int, mode: str, calls: int) -> np.ndarray:
    """Round-trip times in µs of `calls` steps of `n` ids over `mode` (after a 10% warm-up)."""
    a, b = socket.socketpair()
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    shm = mmap.mmap(-1, 2 * n * 8)
    pid = os.fork()
    if pid == 0:
        a.close()
        try:
            _serve(b, mode, n, shm)
        except (EOFError, OSError):
            pass
        os._exit(0)
    b.close()
    ids = np.random.default_rng(0).integers(0, 1 << 30, n)
    ids_in, slots_out = np.frombuffer(shm, np.int64, n, 0), np.frombuffer(shm, np.int64, n, n * 8)
    door, lat = memoryview(bytearray(8)), []
    try:
        for _ in range(calls + calls // 10):
            t0 = time.perf_counter_ns()
            if mode == "shm":
                ids_in[:] = ids
                a.sendall(b"\0" * 8)
                _recv_exact(a, door, 8)
                slots = slots_out.copy()
            else:
                a.sendall(ids)
                reply = bytearray(n * 8)
                _recv_exact(a, memoryview(reply), n * 8)
                slots = np.frombuffer(reply, np.int64)
            lat.append(time.perf_counter_ns() - t0)
        assert np.array_equal(slots, ids & MASK), mode
    finally:
        a.close()
        os.waitpid(pid, 0)
        del ids_in, slots_out
        shm.close()
    return np.asarray(lat[calls // 10:]) / 1000.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ids", type=int, nargs="+", default=[256, 32768])
    ap.add_argument("--calls", type=int, default=3000, help="round trips per design (a tenth of that at 32k ids)")
    ap.add_argument("--rounds", type=int, default=3, help="passes over the designs, interleaved")
    args = ap.parse_args(argv)
    for n in args.ids:
        lat = {m: [] for m in ("stream", "epoll", "shm")}
        for _ in range(args.rounds):
            for mode in lat:
                lat[mode].append(floor_round_trips(n, mode, args.calls if n <= 4096 else max(100, args.calls // 10)))
        print(f"{n:>6} ids: " + " | ".join(
            f"{m} p50 {np.percentile(np.concatenate(v), 50):6.1f} µs p99 {np.percentile(np.concatenate(v), 99):7.1f} µs"
            for m, v in lat.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
