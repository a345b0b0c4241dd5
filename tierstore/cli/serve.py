"""tierstore serve: run the sidecar until SIGTERM/SIGINT.

A signal while it starts ends the start-up: exit 128 + signum, no traceback, and no file
left in the shm directory (tierstore/sidecar/startup.py), however many signals follow.

On a clean stop the socket is removed and the arenas are unlinked, unless
--persist-arena leaves them where they live (--shm-dir, or the hugetlbfs mount
they went on) for the next sidecar to re-attach (after verifying every block). Clients that still map an arena keep a valid
mapping either way: unlinking a shm file never pulls pages from under a reader.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import threading

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    # each flag's dest is its ServeConfig field (run() maps them by name); --remote-table and
    # --log-level are this command's own
    p.add_argument("--data", required=True, dest="data_dir", metavar="DATA", help="data directory (catalog + segments)")
    p.add_argument("--socket", help="unix socket path (created 0600)")
    p.add_argument("--dram-budget", help="bytes of /dev/shm for all arenas, e.g. 4GiB (default 1GiB)")
    p.add_argument("--listen", help="HOST:PORT to also listen on TCP (needs --allow-tcp and a token)")
    p.add_argument("--allow-tcp", action="store_true", default=None, help="permit --listen")
    p.add_argument("--auth-token", help="shared token TCP clients must send (or TIERSTORE_AUTH_TOKEN)")
    p.add_argument("--auth-token-file", help="file holding the token (mode 0600); instead of --auth-token")
    p.add_argument("--tls-cert", help="PEM certificate chain for the TCP listener")
    p.add_argument("--tls-key", help="PEM private key for the TCP listener")
    p.add_argument("--metrics-port", type=int, help="Prometheus text endpoint on 127.0.0.1:PORT")
    p.add_argument("--lease-ttl", type=float, dest="lease_ttl_s", help="seconds a lease lives without Release")
    p.add_argument("--max-leases", type=int, help="live leases in all (default and most 61440)")
    p.add_argument("--max-leases-per-client", type=int, help="live leases of one client (default 1024)")
    p.add_argument("--max-client-share", type=float,
                   help="fraction of a cached table's arena slots one client's leases may hold while another "
                        "client holds leases of the table or, within --lease-ttl, planned a step into its last 1/8 "
                        "(default 0.5); otherwise a client may lease all but that 1/8, kept for the next client; "
                        "1: no per-client bound")
    p.add_argument("--workers", type=int, help="gRPC worker threads (per transport: unix socket, TCP)")
    p.add_argument("--receive-timeout", type=float, dest="receive_timeout_s",
                   help="seconds a TCP caller has to send its request message (default 30)")
    p.add_argument("--shm-dir", help="a tmpfs for the sidecar's shared files (default /dev/shm), its arenas too "
                                     "unless they go on hugetlbfs; mounted huge=within_size it gives arenas huge pages")
    p.add_argument("--arena-pages", choices=("auto", "huge", "small"),
                   help="auto (default): arenas on huge pages where the host gives them (--shm-dir's mount, else a "
                        "hugetlbfs mount with free pages), else 4 KiB pages and a warning saying what to set; huge: "
                        "fail at start without them; small: 4 KiB pages")
    p.add_argument("--persist-arena", action="store_true", default=None,
                   help="leave arenas (in /dev/shm, or on hugetlbfs) on shutdown for re-attach")
    p.add_argument("--verify-sample", type=float, help="fraction of served rows re-verified off the hot path")
    p.add_argument("--policy", help="cache policy: s3fifo (default: S3-FIFO queues with a TinyLFU sketch), lru, random")
    p.add_argument("--profile", help="hot-set profile from `tierstore profile`: seeds the cache policy")
    p.add_argument("--no-warm-start", action="store_false", dest="warm_start", default=None,
                   help="cache mode: start with an empty arena instead of promoting the hot set the last sidecar "
                   "recorded (or --profile's hot rows) in the background")
    p.add_argument("--hot-set-interval", type=float, dest="hot_set_interval_s",
                   help="seconds between recordings of each cache-mode table's hot set in DATA/hot_sets "
                   "(default 300; 0: only at stop)")
    p.add_argument("--no-record-hot-sets", action="store_false", dest="record_hot_sets", default=None,
                   help="write no hot set to DATA/hot_sets, at intervals or at stop: the hot sets a serving "
                   "sidecar recorded stay as they were (a benchmark's or a test's sidecar over your data)")
    p.add_argument("--record-trace", help="log the row ids served to FILE.<table>.npy (bounded; replay with "
                   "`tierstore bench cache --trace`); files are 0600, in a directory of yours others cannot write")
    p.add_argument("--direct-io", action="store_true", default=None,
                   help="read cold rows with O_DIRECT (no page cache: RSS + page cache stay near --dram-budget)")
    p.add_argument("--no-local-reads", action="store_false", dest="local_reads", default=None,
                   help="cache mode: clients on the host ask the sidecar for every step instead of reading resident "
                   "rows (and misses, from the segment files) themselves")
    p.add_argument("--remote", help="mooncake://HOST:PORT: serve versions with no local rows from Mooncake Store, "
                   "writing fetched blocks back to --data in the background")
    p.add_argument("--metadata", help="Mooncake metadata URL (with --remote)")
    p.add_argument("--remote-table", action="append", metavar="TABLE[@VERSION]",
                   help="with --remote: also serve this published table (default its latest published version), "
                   "recording its manifest in --data at start-up when missing (repeatable)")
    p.add_argument("--parent-pid", type=int, help="stop (as on SIGTERM: arenas and socket removed) once process "
                   "PID is no longer this sidecar's parent, e.g. it died; PID must be the parent's (the launcher's "
                   "os.getpid()), checked at start; set by the launcher tests and benches use")
    p.add_argument("--split-layout", metavar="TABLES",
                   help="comma-separated fp8-e4m3-ue8m0 tables (or 'all') whose arena holds all weights, then all "
                        "scales: byte for byte the host table sglang and vLLM map (docs/engines.md); they must be "
                        "full-resident (fit --dram-budget)")
    p.add_argument("--log-level", default="INFO")


def run(args) -> int:
    startup = _StartUpSignals()  # first: a signal from here on ends start-up cleanly
    import logging

    from tierstore.sidecar.config import ServeConfig
    from tierstore.sidecar.server import Server
    from tierstore.sidecar.startup import StartUpFiles, pause

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _return_big_buffers_to_the_os()
    environment = ServeConfig.environment()  # read once: the checks below and the config see the same
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServeConfig)
             if getattr(args, f.name, None) is not None}  # flags given, by their fields' names
    if args.remote_table:
        _prepare_remote_tables(args, {**environment, **given})
    cfg = ServeConfig.from_env(environment, **given)
    if args.remote_table:
        _import_remote_tables(cfg, args.remote_table)
    # Server and ServedTables remove what they made when they fail; this catches what a signal
    # leaves between one returning and the next line (startup.py)
    made = StartUpFiles(cfg)
    server = None
    stop = _StopPipe()
    try:
        server = Server(cfg)
        server.start()
        pause(cfg, "started")
        startup.serve(stop)  # serving: a signal now asks for a clean stop
    except BaseException:  # e.g. --metrics-port in use, a bad table, or a signal
        if server is not None:
            server.stop(grace=0)  # leave no socket or arena behind
        made.remove()
        if startup.signum:  # a signal ended start-up, whatever else was unwinding it: exit as for it
            _ignore_stop_signals()  # kept through the interpreter's exit (it resets Python handlers)
            raise SystemExit(128 + startup.signum) from None
        raise
    if cfg.parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(cfg.parent_pid, stop), name="parent-watch", daemon=True).start()
    modes = ", ".join(f"{t}:{e.stats()['mode']}" for t, e in server.served.engines.items())
    print(f"tierstore serving {len(server.served.engines)} table(s) [{modes}] on {' '.join(server.addresses)}",
          flush=True)
    stop.wait()
    _ignore_stop_signals()  # one stop: more signals (Ctrl-C pressed again) neither interrupt nor kill it
    server.stop()
    print("tierstore stopped", flush=True)
    return 0


PARENT_POLL_S = 0.25


class _StopPipe:
    """What ends `serve`: SIGTERM, SIGINT or a parent gone. A signal handler must take no
    lock: it runs in the main thread between two bytecodes, possibly while that thread
    holds the very lock it would take (threading.Event.set() from a handler deadlocks
    when the signal lands as Event.wait() begins, and the sidecar then never stops). So
    a handler only writes a byte to a pipe, and the main thread blocks reading it.

    The kernel may hand a process's signal to any of its threads (gRPC's, the reaper's):
    the main thread's read() is then not interrupted, and a Python handler, which runs
    only in the main thread, would wait for a wake-up that never comes. So the pipe is
    also the interpreter's wake-up fd (serve()): the C-level handler writes to it from
    whichever thread took the signal, and the read returns."""

    def __init__(self):
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        self.wakeup_fd = self._w  # non-blocking, as signal.set_wakeup_fd requires
        self.stopped = threading.Event()  # for threads (the parent watch), set by the main thread

    def signal(self, *_) -> None:
        self.set()

    def set(self) -> None:
        try:
            os.write(self._w, b"x")
        except BlockingIOError:  # the pipe is full of earlier requests: one is enough
            pass

    def wait(self) -> None:
        os.read(self._r, 1)
        self.stopped.set()


def _watch_parent(pid: int, stop: _StopPipe) -> None:
    """Stop once `pid` is no longer the parent (it died: this process was re-parented)."""
    while not stop.stopped.wait(PARENT_POLL_S):
        if os.getppid() != pid:
            print(f"tierstore: parent process {pid} is gone; stopping", flush=True)
            stop.set()
            return


def _prepare_remote_tables(args, values: dict) -> None:
    """Check --remote-table's companions (values: the serve config's fields given, by flag or
    TIERSTORE_* variable), then make --data (a new host starts empty)."""
    from tierstore.store.catalog import private_dirs
    from tierstore.tiers.remote.publish import parse_remote_table

    if not (values.get("remote") and values.get("metadata")):
        raise ValueError("--remote-table needs --remote mooncake://HOST:PORT and --metadata URL")
    for name in args.remote_table:
        parse_remote_table(name)
    private_dirs(args.data_dir)


def _import_remote_tables(cfg, names) -> None:
    """Record the named published tables in the local catalog (manifests only; rows stay in Mooncake)."""
    import logging

    from tierstore.tiers.remote.mooncake import connect
    from tierstore.tiers.remote.publish import import_published

    store = connect(cfg.remote, cfg.metadata)
    try:
        done = import_published(cfg.data_dir, store, names)
    finally:
        store.close()
    for tv, new in done:
        logging.getLogger("tierstore.serve").info(
            "table %s v%d: manifest %s from Mooncake", tv.table, tv.number, "recorded" if new else "already recorded")


def _return_big_buffers_to_the_os() -> None:
    """Fills run in many RPC threads at once; glibc would keep their freed multi-MiB
    read buffers in per-thread heaps (RSS grows with concurrency, never shrinks).
    A fixed mmap threshold makes every buffer over 1 MiB a mapping, unmapped on free."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: nothing to tune


def _ignore_stop_signals() -> None:
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


class _StartUpSignals:
    """SIGTERM and SIGINT while the sidecar starts. The first one ends start-up: SystemExit
    (128 + signum) raised in the main thread unwinds it, and each layer removes what it made
    (CacheEngine its index, ServedTables its arenas and board, run every shm file made since
    it began). Nothing may cut that cleanup short, so every later signal is ignored, and a
    first one that lands while an exception is being handled (start-up already unwinding
    from an error, or code recovering from one) only is remembered: raising there would
    interrupt the handling. start-up then ends at serve(), or run exits 128 + signum once
    the unwinding is done. The handler takes no lock (see _StopPipe)."""

    def __init__(self):
        import signal

        self.signum = 0
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        import sys

        if self.signum:
            return
        self.signum = signum
        if sys.exc_info()[1] is None:
            raise SystemExit(128 + signum)

    def serve(self, stop: "_StopPipe") -> None:
        """Start-up is over: signals go to `stop` from now on, unless one already came."""
        import signal

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stop.signal)
        signal.set_wakeup_fd(stop.wakeup_fd, warn_on_full_buffer=False)
        if self.signum:
            raise SystemExit(128 + self.signum)
