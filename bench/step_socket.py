"""Round-trip latency of a step's Plan: the step socket against a Python gRPC unary call.

    python -m tierstore.bench.step_socket [--rounds 7] [--calls 300] [--out results.json]

Both servers run in one child process over the same handler (ModuloHandler:
slots = ids % N, leases kept per conn_id in an OwnedLeases) and receive the same
payload bytes (the step socket's PLAN body; gRPC carries it as a raw unary
request, no protobuf), so the difference is the transport. Every call releases
the previous call's leases inside it, as a decode step does (the step socket:
queued by release_later, as a StepPlan's release is, and carried by the PLAN).
Competitors are interleaved round by round (the box is noisy); figures are over
all rounds, ratios from the same run.

One cohesive thing: both transports' harnesses (the handler and its record of leases) and
the measurement that compares them.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

import numpy as np

from tierstore import errors
from tierstore.proto.frames import PlanItem, PlanResult, encode_plan_results, parse_plan

__all__ = ["ModuloHandler", "OwnedLeases", "ChildServer", "serve_child", "run_fastpath_bench", "run_clients_bench",
           "main"]

GRPC_METHOD = "/tierstore.bench.FastPath/Plan"


class OwnedLeases:
    """Which step-socket conn_id holds which lease, as ModuloHandler keeps them: a client may end
    only its own leases, and all of them end when its connection closes. Thread-safe. Entries
    past their expiry are pruned as new ones arrive, so a client that never releases cannot
    grow it. (The sidecar's own record is its LeaseTable, keyed by conn_id.)"""

    def __init__(self):
        self._by_conn: dict[bytes, dict[int, float]] = {}
        self._lock = threading.Lock()
        self._adds = 0

    def add(self, conn_id: bytes, lease_id: int, expires: float) -> None:
        """`expires`: time.monotonic() deadline after which the sidecar has reaped the lease anyway."""
        with self._lock:
            mine = self._by_conn.setdefault(conn_id, {})
            mine[lease_id] = expires
            self._adds += 1
            if self._adds % 1024 == 0 and len(mine) > 1024:
                now = time.monotonic()
                for k in [k for k, t in mine.items() if t < now]:
                    del mine[k]

    def take(self, conn_id: bytes, lease_ids) -> list[int]:
        """The ones of `lease_ids` that `conn_id` holds, forgotten here: release those in the sidecar."""
        with self._lock:
            mine = self._by_conn.get(conn_id)
            return [i for i in lease_ids if mine.pop(i, None) is not None] if mine else []

    def take_all(self, conn_id: bytes) -> list[int]:
        with self._lock:
            return list(self._by_conn.pop(conn_id, {}))

    def holders(self) -> dict[int, bytes]:
        """lease id -> conn_id, of every lease held here."""
        with self._lock:
            return {i: o for o, mine in self._by_conn.items() for i in mine}

    def __len__(self) -> int:
        with self._lock:
            return sum(len(m) for m in self._by_conn.values())


class ModuloHandler:
    """A real, small StepHandler over numpy: tables of `rows` ids, slot = id % slots (a power of two).

    Also the shape of a sidecar's handler: per-item errors, releases first, leases kept per conn_id."""

    def __init__(self, tables: dict[str, int] | None = None, slots: int = 1 << 20, instance: str | None = None):
        self.tables = tables or {"l1": 1 << 30, "l14": 1 << 30}
        if slots & (slots - 1):
            raise ValueError(f"slots must be a power of two, got {slots}")
        self.mask, self._instance = slots - 1, instance or os.urandom(8).hex()
        self.owned = OwnedLeases()
        self.disconnects: list[bytes] = []
        self._ids = itertools.count(1)

    @property
    def leases(self) -> dict[int, bytes]:
        """lease id -> conn_id of every live lease."""
        return self.owned.holders()

    def instance(self) -> str:
        return self._instance

    def plan(self, conn_id: bytes, items: list[PlanItem], release: list[int]) -> list:
        self.release(conn_id, release)
        out = []
        for it in items:
            rows = self.tables.get(it.table)
            if rows is None:
                out.append(errors.TableNotFound(f"no table {it.table!r}; known: {sorted(self.tables)}"))
            elif it.ids.size and int(it.ids.view(np.uint64).max()) >= rows:  # a negative id is huge as uint64
                out.append(errors.IdOutOfRange(f"table {it.table!r} has {rows} rows; an id is out of range"))
            else:
                lease = next(self._ids)
                self.owned.add(conn_id, lease, time.monotonic() + (it.ttl_ms or 30_000) / 1000)
                out.append(PlanResult(lease, it.version or 1, it.ids & self.mask, hits=it.ids.size))
        return out

    def release(self, conn_id: bytes, lease_ids: list[int]) -> int:
        return len(self.owned.take(conn_id, lease_ids))

    def note(self, conn_id: bytes, items: list, trusted: bool) -> None:
        """No policy here: steps a client read itself teach it nothing."""

    def disconnected(self, conn_id: bytes) -> None:
        self.owned.take_all(conn_id)
        self.disconnects.append(conn_id)


def serve_child(path: str, grpc_path: str | None) -> None:
    """The child's side of ChildServer: serve until stdin closes; answer "leases" lines."""
    from tierstore.sidecar.step_server import StepServer

    handler = ModuloHandler()
    fast = StepServer(Path(path), handler, max_request_bytes=16 << 20, max_clients=8)
    fast.start()
    grpc_server = _grpc_server(grpc_path, handler) if grpc_path else None
    print(handler.instance(), flush=True)
    for line in sys.stdin:
        if line.strip() != "leases":
            break
        print(json.dumps(dict(leases=len(handler.leases), disconnects=len(handler.disconnects))), flush=True)
    if grpc_server is not None:
        grpc_server.stop(0).wait()
    fast.stop()


def _grpc_server(path: str, handler: ModuloHandler):
    import grpc

    def plan(request: bytes, context) -> bytes:
        items, release = parse_plan(request)
        return b"".join(encode_plan_results(handler.plan(b"grpc", items, release))[0])

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=[
        ("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)])
    rpc = grpc.unary_unary_rpc_method_handler(plan, request_deserializer=None, response_serializer=None)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("tierstore.bench.FastPath",
                                                                          {"Plan": rpc})])
    server.add_insecure_port(f"unix:{path}")
    server.start()
    return server


class ChildServer:
    """A StepServer (and optionally a gRPC twin) over ModuloHandler in a child process."""

    def __init__(self, path: Path, grpc_path: Path | None = None):
        self.path, self.grpc_path = Path(path), grpc_path
        argv = [sys.executable, "-m", "tierstore.bench.step_socket", "--serve", str(path)]
        self.proc = subprocess.Popen(argv + (["--serve-grpc", str(grpc_path)] if grpc_path else []),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.instance = self.proc.stdout.readline().strip()
        if not self.instance:
            self.kill()
            raise RuntimeError(f"step-socket child server did not start (exit code {self.proc.returncode})")

    def leases(self) -> dict:
        self.proc.stdin.write("leases\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # the child stops its servers and exits
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


def _grpc_caller(grpc_path: Path):
    import grpc

    channel = grpc.insecure_channel(f"unix:{grpc_path}", options=[
        ("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)])
    return channel, channel.unary_unary(GRPC_METHOD, request_serializer=None, response_deserializer=None)


def _payload(items: list[PlanItem], release: list[int]) -> bytes:
    from tierstore.proto.frames import ITEM, PLAN_REQ, pad8

    parts = [PLAN_REQ.pack(len(items), len(release)), np.asarray(release, "<u8").tobytes()]
    for it in items:
        name = it.table.encode()
        parts += [ITEM.pack(it.version, it.request_id, it.ids.size, it.ttl_ms, len(name)), name,
                  bytes(pad8(len(name))), it.ids.astype("<i8").tobytes()]
    return b"".join(parts)


def _handler_us(items: list[PlanItem], n: int = 200) -> float:
    """Median in-process time of the same handler call: what no transport can take away."""
    h, ns = ModuloHandler(), []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        h.plan(b"x", items, [])
        ns.append(time.perf_counter_ns() - t0)
    return float(np.median(ns)) / 1000.0


def run_fastpath_bench(rounds: int = 7, calls: int = 300, sizes=(256, 32768), tables=(1, 4), seed: int = 0) -> list:
    from tierstore.client.step_channel import StepChannel, raise_errors
    from tierstore.proto.frames import COUNT, RES_OK

    rng = np.random.default_rng(seed)
    cells = []
    with tempfile.TemporaryDirectory(prefix="tsfp-") as d:
        server = ChildServer(Path(d) / "s.steps", Path(d) / "s.grpc")
        channel, grpc_plan = _grpc_caller(Path(d) / "s.grpc")
        client = StepChannel(Path(d) / "s.steps").connect()
        try:
            for n_ids, n_tables in itertools.product(sizes, tables):
                items = [PlanItem(("l1", "l14")[t % 2], rng.zipf(1.2, n_ids).astype(np.int64) % (1 << 30))
                         for t in range(n_tables)]
                want = [it.ids % (1 << 20) for it in items]
                lat = {"fastpath": [], "grpc": []}
                held = {"fastpath": [], "grpc": []}

                def fast_call():
                    client.release_later(held["fastpath"])  # rides on this call's PLAN, as a StepPlan's release does
                    res = raise_errors(client.submit(items).result())
                    held["fastpath"] = [r.lease_id for r in res]
                    return [r.slots for r in res]

                def grpc_call():
                    body = grpc_plan(_payload(items, held["grpc"]), timeout=30)
                    off, slots, leases = COUNT.size, [], []
                    for _ in range(COUNT.unpack_from(body)[0]):
                        _, n, lease, *_ = RES_OK.unpack_from(body, off)
                        slots.append(np.frombuffer(body, "<i8", n, off + RES_OK.size))
                        leases.append(lease)
                        off += RES_OK.size + 8 * n
                    held["grpc"] = leases
                    return slots

                calls_of = {"fastpath": fast_call, "grpc": grpc_call}
                for name, call in calls_of.items():  # warm-up, and both must return the right slots
                    for _ in range(max(20, calls // 10)):
                        got = call()
                    assert all(np.array_equal(g, w) for g, w in zip(got, want)), f"{name} returned wrong slots"
                n = calls if n_ids <= 4096 else max(20, calls // 10)
                for r in range(rounds):
                    for name in (("fastpath", "grpc") if r % 2 == 0 else ("grpc", "fastpath")):
                        call, out = calls_of[name], lat[name]
                        for _ in range(n):
                            t0 = time.perf_counter_ns()
                            call()
                            out.append(time.perf_counter_ns() - t0)
                cell = dict(ids=n_ids, tables=n_tables, calls=len(lat["fastpath"]),
                            handler_us=_handler_us(items))  # the server-side work both transports share
                for name, ns in lat.items():
                    us = np.asarray(ns) / 1000.0
                    cell[name] = dict(p50_us=float(np.percentile(us, 50)), p99_us=float(np.percentile(us, 99)))
                cell["grpc_over_fastpath_p50"] = cell["grpc"]["p50_us"] / cell["fastpath"]["p50_us"]
                cell["grpc_over_fastpath_p99"] = cell["grpc"]["p99_us"] / cell["fastpath"]["p99_us"]
                cells.append(cell)
        finally:
            client.close()
            channel.close()
            server.stop()
    return cells


def _client_loop(path: str, n_ids: int, calls: int, go, out) -> None:
    from tierstore.client.step_channel import StepChannel, raise_errors

    with StepChannel(path).connect() as c:
        items, held, ns = [PlanItem("l1", np.random.default_rng(os.getpid()).integers(0, 1 << 30, n_ids))], [], []
        go.wait()
        for _ in range(calls):
            t0 = time.perf_counter_ns()
            c.release_later(held)
            held = [r.lease_id for r in raise_errors(c.submit(items).result())]
            ns.append(time.perf_counter_ns() - t0)
    out.put(ns)


def run_clients_bench(clients=(1, 4), n_ids: int = 256, calls: int = 2000) -> list:
    """Several client processes planning at once against one server: per-call p50 and aggregate calls/s."""
    import multiprocessing as mp

    ctx, cells = mp.get_context("fork"), []  # fork: before any gRPC channel exists in this process
    with tempfile.TemporaryDirectory(prefix="tsfp-") as d:
        server = ChildServer(Path(d) / "s.steps")
        try:
            for k in clients:
                go, out = ctx.Event(), ctx.Queue()
                procs = [ctx.Process(target=_client_loop, args=(str(server.path), n_ids, calls, go, out))
                         for _ in range(k)]
                for p in procs:
                    p.start()
                time.sleep(0.5)
                t0 = time.perf_counter()
                go.set()
                lat = [out.get(timeout=300) for _ in procs]
                wall = time.perf_counter() - t0
                for p in procs:
                    p.join(30)
                us = np.concatenate(lat) / 1000.0
                cells.append(dict(clients=k, ids=n_ids, p50_us=float(np.percentile(us, 50)),
                                  p99_us=float(np.percentile(us, 99)), calls_per_s=k * calls / wall))
        finally:
            server.stop()
    return cells


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=300, help="calls per round per competitor (256-id cells)")
    ap.add_argument("--ids", type=int, nargs="+", default=[256, 32768], help="ids per table per step")
    ap.add_argument("--tables", type=int, nargs="+", default=[1, 4], help="tables per step")
    ap.add_argument("--clients", type=int, nargs="*", default=[1, 4],
                    help="also run these numbers of concurrent client processes (256 ids, step socket only)")
    ap.add_argument("--out", type=Path, help="write the cells as JSON here")
    ap.add_argument("--serve", help=argparse.SUPPRESS)  # the child of ChildServer
    ap.add_argument("--serve-grpc", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve_child(args.serve, args.serve_grpc)
        return 0
    scaling = run_clients_bench(clients=args.clients) if args.clients else []
    for c in scaling:
        print(f"{c['clients']} client processes x {c['ids']} ids: p50 {c['p50_us']:.1f} µs p99 {c['p99_us']:.1f} µs, "
              f"{c['calls_per_s']:.0f} plans/s in all")
    cells = run_fastpath_bench(rounds=args.rounds, calls=args.calls, sizes=args.ids, tables=args.tables)
    for c in cells:
        print(f"{c['ids']:>6} ids x {c['tables']} tables (handler {c['handler_us']:6.1f} µs): "
              f"fastpath p50 {c['fastpath']['p50_us']:8.1f} µs "
              f"p99 {c['fastpath']['p99_us']:8.1f} µs | grpc p50 {c['grpc']['p50_us']:8.1f} µs "
              f"p99 {c['grpc']['p99_us']:8.1f} µs | grpc/fast p50 {c['grpc_over_fastpath_p50']:.1f}x "
              f"p99 {c['grpc_over_fastpath_p99']:.1f}x")
    if args.out:
        args.out.write_text(json.dumps(dict(bench="fastpath", unit="µs per round trip", cells=cells,
                                            clients=scaling), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
