"""The sidecar (Server: the serving process) and its gRPC service (GrpcService), the control plane.

Every handler maps tierstore errors to one status code (errors.GRPC_CODE) and
keeps serving; an unexpected exception is INTERNAL and logged, never a crash.
"""
from __future__ import annotations

import functools
import hmac
import logging
import os
import time
from concurrent import futures

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tierstore.sidecar.auth import TOKEN_HEADER, TokenInterceptor, tcp_options
from tierstore.proto import MAX_INLINE_BYTES, MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES
from tierstore.sidecar.config import ServeConfig
from tierstore.errors import (ERROR_METADATA_KEY, InvalidArgument, ResourceExhausted, TierstoreError, Unauthenticated,
                             wire_name)
from tierstore.sidecar import listeners
from tierstore.proto import tierstore_pb2 as pb
from tierstore.proto import tierstore_pb2_grpc as pb_grpc
from tierstore.sidecar.served_steps import ServedSteps
from tierstore.sidecar.prefetcher import MAX_HINT_IDS
from tierstore.sidecar.served import ServedTables
from tierstore.sidecar.startup import pause

__all__ = ["Server", "GrpcService", "add_service", "decode_ids", "SERVICE", "GRPC_OPTIONS"]

log = logging.getLogger("tierstore.sidecar.server")
SERVICE = "tierstore.v1.Tierstore"
STEP_SOCKET_CLIENTS = 256  # local step-socket connections (one per worker process, or per thread)
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
    ("grpc.max_send_message_length", MAX_RESPONSE_BYTES),
    ("grpc.so_reuseport", 0),
]


def decode_ids(raw: bytes, limit: int) -> np.ndarray:
    if len(raw) % 8:
        raise InvalidArgument(f"ids must be packed little-endian int64 (8 bytes each); got {len(raw)} bytes")
    n = len(raw) // 8
    if n > limit:
        raise ResourceExhausted(f"{n} ids in one request; the limit is {limit}: split the request")
    return np.frombuffer(raw, dtype="<i8").astype(np.int64, copy=False)


# The longest message a method takes, when below the server's: a longer one is refused
# unparsed (a hint's ids, its other fields and their tags), so a flood of huge hints costs
# the bytes gRPC received and no copy of them
MAX_MESSAGE_BYTES = {"Prefetch": MAX_HINT_IDS * 8 + (64 << 10)}


class _Refused:
    """A request refused before it reached its method: answered with `error` by the
    handler (gRPC itself would answer INTERNAL for a deserializer that raises)."""

    def __init__(self, error: TierstoreError):
        self.error = error


def _lenient(cls, max_bytes: int | None = None):
    def parse(raw: bytes):
        if max_bytes is not None and len(raw) > max_bytes:
            return _Refused(InvalidArgument(
                f"a {cls.__name__} of {len(raw)} bytes; at most {max_bytes} (a prefetch hint carries at most "
                f"{MAX_HINT_IDS} ids): hint the rows of one queued request"))
        try:
            return cls.FromString(raw)
        except Exception as e:  # noqa: BLE001 - DecodeError, invalid UTF-8 in a string field
            return _Refused(InvalidArgument(f"malformed {cls.__name__} ({len(raw)} bytes): {e}; send a "
                                            f"tierstore.v1 protobuf message"))
    return parse


def add_service(servicer, server) -> None:
    """Register every method of the Tierstore service with lenient request parsing."""
    handlers = {}
    for m in pb.DESCRIPTOR.services_by_name["Tierstore"].methods:
        handlers[m.name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, m.name),
            request_deserializer=_lenient(getattr(pb, m.input_type.name), MAX_MESSAGE_BYTES.get(m.name)),
            response_serializer=getattr(pb, m.output_type.name).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


def _rpc(method):
    @functools.wraps(method)
    def wrapper(self, request, context):
        t0 = time.perf_counter()
        try:
            self._authorize(context)
            if isinstance(request, _Refused):
                raise request.error
            return method(self, request, context)
        except TierstoreError as e:
            name = wire_name(e)  # the class, not parsed text: the nearest one a client can rebuild
            context.set_trailing_metadata(((ERROR_METADATA_KEY, name),))
            context.abort(getattr(grpc.StatusCode, e.GRPC_CODE), f"{name}: {e}")
        except Exception as e:  # noqa: BLE001 - keep serving, say what happened
            log.exception("internal error in %s", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
        finally:
            self.metrics.observe(method.__name__, time.perf_counter() - t0)
    return wrapper


def _checkpoint_json(v) -> str:
    """TableInfo.checkpoint_json of version `v`: what its manifest records of the checkpoint tensors
    its rows came from (an older ingest's: what its source note says), "" where nothing."""
    import json

    rec = v.checkpoint_record()
    return json.dumps({k: t.to_dict() for k, t in rec.items()}) if rec else ""


class GrpcService(pb_grpc.TierstoreServicer):
    """The sidecar's gRPC servicer: proto/tierstore.proto's Tierstore service (ListTables,
    DescribeTable, Lookup with the rows inline, Prefetch, Reload, Stats) over the served tables.

    One job: turn each request into calls on `served` (ServedTables) and the answer into a
    message. Every method authorizes the caller first (a unix-socket peer by the socket's
    0600 mode, a TCP peer by the shared token), answers a TierstoreError with its status code
    (errors.GRPC_CODE) and anything else with INTERNAL, keeps serving either way, and has its
    latency observed in `metrics`. Server runs one instance on both gRPC servers (unix
    socket, TCP); the step socket is StepServer's, not this."""

    def __init__(self, served: ServedTables, metrics):
        self.served = served
        self.metrics = metrics
        self.cfg = served.config

    def _authorize(self, context) -> None:
        """Unix-socket peers are trusted by file mode (0600); TCP peers must send the token."""
        if context.peer().startswith("unix:") or not self.cfg.auth_token:
            return
        sent = dict(context.invocation_metadata()).get(TOKEN_HEADER, "")
        if not hmac.compare_digest(sent.encode(), self.cfg.auth_token.encode()):
            raise Unauthenticated(f"this sidecar needs the shared token in the {TOKEN_HEADER!r} metadata header")

    def _info(self, eng) -> pb.TableInfo:
        v, board = eng.version, self.served.leases.board
        import json
        return pb.TableInfo(
            table=v.table, version=v.number, rows=v.rows, row_format=v.row_format, row_dim=v.row_dim,
            row_bytes=v.row_bytes, spec_json=json.dumps(v.spec) if v.spec else "",
            layer_id=-1 if v.layer_id is None else v.layer_id, max_prefetch_steps=eng.hints.max_steps,
            checkpoint_json=_checkpoint_json(v),
            arena=pb.Arena(path=str(eng.arena.path), slots=eng.arena.slots, full_resident=eng.full,
                           size_bytes=eng.arena.size, instance=self.served.instance,
                           lease_board=str(board.path) if board else "",
                           lease_board_entries=board.n if board else 0, layout="split" if eng.arena.split else "",
                           split_bytes=eng.arena.split, **self._local_reads(eng)))

    def _local_reads(self, eng) -> dict:
        """What a client on the host needs to read this table without a Plan (client/local_reads.py):
        the slot index, and the segment files its misses may be read from (ColdTier.cold_dir)."""
        index = eng.slot_index()
        if index is None:
            return {}
        cold = eng.reader.cold_dir
        return dict(index=str(index.path), cold_dir=str(cold.resolve()) if cold is not None else "",
                    cold_direct=cold is not None and eng.reader.direct is not None)

    @_rpc
    def ListTables(self, request, context):
        return pb.ListTablesResponse(tables=[self._info(e) for e in self.served.engines.values()])

    @_rpc
    def DescribeTable(self, request, context):
        return self._info(self.served.engine(request.table))

    @_rpc
    def Prefetch(self, request, context):
        eng = self.served.engine(request.table)
        ids = decode_ids(request.ids, self.cfg.max_request_ids)
        queued = self.served.prefetch(eng, ids, read=not request.hint_only, steps=request.steps or None,
                                      conn_id=bytes(request.owner))
        return pb.PrefetchResponse(queued=queued)

    @_rpc
    def Reload(self, request, context):
        changed = self.served.reload(request.table, request.version)
        return pb.ReloadResponse(changed=[pb.ReloadResponse.Change(table=t, old_version=a, new_version=b)
                                          for t, a, b in changed])

    @_rpc
    def Lookup(self, request, context):
        eng = self.served.engine(request.table, request.version)
        ids = decode_ids(request.ids, self.cfg.max_request_ids)
        if ids.size * eng.version.row_bytes > MAX_INLINE_BYTES:
            # three copies of the rows live at once (gather, bytes, message): bound them
            raise ResourceExhausted(
                f"{ids.size} rows of {eng.version.row_bytes} B exceed the {MAX_INLINE_BYTES >> 20} MiB inline "
                f"lookup limit; split the lookup or use plan() and the shared arena")
        rows = eng.lookup(ids)
        return pb.LookupResponse(rows=rows.tobytes(), row_bytes=eng.version.row_bytes, version=eng.version.number)

    @_rpc
    def Stats(self, request, context):
        tables = [pb.TableStats(**e.stats()) for e in self.served.engines.values()]
        return pb.StatsResponse(tables=tables, uptime_s=time.monotonic() - self.served.started,
                                leases_active=len(self.served.leases))


class Server:
    """The sidecar process: gRPC on a unix socket (0600) beside the step socket
    (`<socket>.steps`), optional TCP and metrics.

    Unix-socket and TCP callers get separate gRPC servers and worker pools, so
    no TCP caller (authenticated or not) can take the capacity local workers need.
    """

    def __init__(self, config: ServeConfig):
        from tierstore.sidecar.metrics import Metrics

        self.config = config
        self.steps = None  # the step server, from start() on
        self._socket_id = None  # (st_dev, st_ino) of the socket this sidecar bound
        pem = self._check_transports(config)  # before anything is loaded or created
        self.served = ServedTables(config)
        try:
            self._build(config, Metrics, pem)
            pause(config, "bound")
        except BaseException:  # neither its shm files nor its socket may outlive a failed start
            self._remove_socket()
            self.served.close()
            raise

    def _build(self, config: ServeConfig, Metrics, pem) -> None:
        self.metrics = Metrics(self.served)
        self.health = health.HealthServicer()
        # grpc's servicer says SERVING for "" from the start: not until start() has brought up the
        # step socket and the sidecar (a launcher that stops us on SERVING must not catch us half-started)
        self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        service = GrpcService(self.served, self.metrics)
        self.guard = None if config.listen is None else \
            TokenInterceptor(config.auth_token, config.receive_timeout_s)
        self.servers = []
        self.addresses = []
        if config.socket is not None:
            unix = self._grpc_server(config, service, "rpc")
            # claimed here, at the bind (a stale socket removed, a live one refused): another sidecar
            # may have bound it while the tables loaded
            listeners.claim_socket(config.socket)
            old = os.umask(0o177)  # the socket is born 0600
            try:
                self._bind(unix.add_insecure_port, f"unix:{config.socket}", "--socket")
            finally:
                os.umask(old)
            st = os.stat(config.socket)
            self._socket_id = (st.st_dev, st.st_ino)  # stop() removes this socket and no other
            self.addresses.append(f"unix:{config.socket}")
        if config.listen is not None:
            tcp = self._grpc_server(config, service, "tcp", (self.guard,), tcp_options())
            if pem:
                creds = grpc.ssl_server_credentials([(pem[1], pem[0])])
                self._bind(lambda a: tcp.add_secure_port(a, creds), config.listen, "--listen")
                self.addresses.append(f"{config.listen} (tls)")
            else:
                self._bind(tcp.add_insecure_port, config.listen, "--listen")
                self.addresses.append(config.listen)

    def _grpc_server(self, config: ServeConfig, service, name: str, interceptors=(), options=()):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix=name),
                             options=GRPC_OPTIONS + list(options), maximum_concurrent_rpcs=config.workers * 64,
                             interceptors=interceptors)
        add_service(service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self.servers.append(server)
        return server

    @staticmethod
    def _check_transports(config: ServeConfig):
        if config.socket is not None:
            listeners.check_socket(config.socket)  # refused before anything loads; claimed at the bind
        pem = None
        if config.listen is not None:
            listeners.check_tcp(config.listen)
            if config.tls_cert and config.tls_key:
                pem = listeners.check_tls(config.tls_cert, config.tls_key)
        if config.metrics_port is not None:
            listeners.check_port("127.0.0.1", config.metrics_port, "--metrics-port")
        return pem

    @staticmethod
    def _bind(add_port, address: str, flag: str) -> None:
        try:
            add_port(address)
        except RuntimeError:  # gRPC says only "Failed to bind"; the checks above say why, bar races
            raise InvalidArgument(f"{flag}: cannot listen on {address}") from None

    def start(self) -> None:
        for server in self.servers:
            server.start()
        if self.config.socket is not None:
            os.chmod(self.config.socket, 0o600)
            from tierstore.proto.frames import step_socket_path
            from tierstore.sidecar.step_server import StepServer

            self.steps = StepServer(step_socket_path(self.config.socket),
                                       ServedSteps(self.served, self.config, self.metrics),
                                       max_request_bytes=MAX_REQUEST_BYTES, max_clients=STEP_SOCKET_CLIENTS)
            self.steps.start()
        self.served.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.health.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
        if self.config.metrics_port is not None:
            try:
                self.metrics.serve(self.config.metrics_port)
            except OSError as e:  # taken since the check in __init__
                raise InvalidArgument(f"--metrics-port: cannot listen on 127.0.0.1:{self.config.metrics_port}: "
                                      f"{e.strerror}") from None

    def stop(self, grace: float = 2.0) -> None:
        if self.steps is not None:
            self.steps.stop()
            self.steps = None
        self.health.enter_graceful_shutdown()
        for event in [server.stop(grace) for server in self.servers]:
            event.wait()
        if self.guard is not None:
            self.guard.close()
        self.served.close()
        self.metrics.close()
        self._remove_socket()

    def _remove_socket(self) -> None:
        """Remove the socket this server bound (and no other: another sidecar's, bound since)."""
        if self.config.socket is not None and self._socket_id is not None:
            try:
                st = os.lstat(self.config.socket)
                if (st.st_dev, st.st_ino) == self._socket_id:
                    self.config.socket.unlink()
            except FileNotFoundError:
                pass
