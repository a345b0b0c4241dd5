"""Prefetch-hint floods over both transports the sidecar serves hints on (gRPC on its
unix socket, and on TCP with the token): every bad hint (negative ids, ids past the
table's rows, an unknown table, more ids than a hint may carry) is refused with its
code and a message naming the input, and queues nothing; a flood of them and of
huge good ones leaves the sidecar's RSS within a bound while another client's
lookups keep returning the right rows."""
from __future__ import annotations

import os
import socket
import threading
import time

import grpc
import numpy as np
import pytest

from tierstore.client.client import Client
from tierstore.proto import tierstore_pb2 as pb
from tierstore.sidecar.auth import TOKEN_HEADER
from tierstore.sidecar.prefetcher import MAX_HINT_IDS, PREFETCH_QUEUE_IDS

pytestmark = pytest.mark.reliability
C = grpc.StatusCode
ROWS, VROWS, DIM = 200_000, 4000, 16    # the attacker's table "t" and the victim's "v" (fp32: 64 B rows)
TOKEN = "s3cret"
ATTACKERS, BIGGEST = 4, 5_000_000 * 8  # concurrent flooding calls, and the largest hint they send (bytes)
# what a flood may leave the sidecar holding: the hint queue's ids (8 B each), and per concurrent
# call the received message the allocator may keep for reuse rather than return
RSS_BOUND = PREFETCH_QUEUE_IDS * 8 + ATTACKERS * BIGGEST
# what a second flood as long as the first may add: allocator noise, and half of what it would
# if the hints it has queued (a fifth of them, MAX_HINT_IDS ids each) were held past their run
ROUNDS = 15
REPEAT_BOUND = ATTACKERS * (ROUNDS // 5) * MAX_HINT_IDS * 8 // 2


class Transport:
    """Raw Prefetch and Stats calls over one transport."""

    def __init__(self, name: str, address: str, metadata=()):
        self.name, self.metadata = name, metadata
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 80 << 20)])
        self._prefetch = self.channel.unary_unary("/tierstore.v1.Tierstore/Prefetch",
                                                  request_serializer=pb.PrefetchRequest.SerializeToString,
                                                  response_deserializer=pb.PrefetchResponse.FromString)
        self._stats = self.channel.unary_unary("/tierstore.v1.Tierstore/Stats",
                                               request_serializer=pb.StatsRequest.SerializeToString,
                                               response_deserializer=pb.StatsResponse.FromString)

    def hint(self, table: str, ids, read: bool = True):
        """(status code, queued or the error's details)."""
        req = pb.PrefetchRequest(table=table, ids=np.asarray(ids, "<i8").tobytes(), hint_only=not read,
                                 owner=os.urandom(16))
        try:
            return C.OK, self._prefetch(req, metadata=self.metadata, timeout=120).queued
        except grpc.RpcError as e:
            return e.code(), e.details()

    def stats(self, table: str = "t") -> dict:
        s = next(t for t in self._stats(pb.StatsRequest(), metadata=self.metadata, timeout=30).tables
                 if t.table == table)
        return {"resident": s.resident, "prefetched": s.prefetched}


@pytest.fixture(scope="module")
def served(tmp_path_factory, rel):
    from tierstore.sidecar.launcher import SidecarProcess

    d = tmp_path_factory.mktemp("hints") / "data"
    rel.write_table(d, "t", ROWS, dim=DIM, seed=1)
    victim_rows = rel.write_table(d, "v", VROWS, dim=DIM, seed=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with SidecarProcess(d, dram_budget="2MiB", extra_args=["--listen", f"127.0.0.1:{port}", "--allow-tcp",
                                                           "--auth-token", TOKEN]) as sc:
        ways = [Transport("unix", f"unix:{sc.socket}"),
                Transport("tcp", f"127.0.0.1:{port}", ((TOKEN_HEADER, TOKEN),))]
        yield sc, ways, victim_rows
        for w in ways:
            w.channel.close()


def _settled(way: Transport, timeout: float = 10.0) -> dict:
    """Table t's stats once the prefetch threads have stopped changing them."""
    last, deadline = way.stats(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = way.stats()
        if now == last:
            return now
        last = now
    return last


def _fresh(k: int, n: int = 1000) -> np.ndarray:
    """n ids of t no other case hints (each case its own range)."""
    return 10_000 + k * n + np.arange(n)


BAD = [  # (what, table, ids, code, what the message must name)
    ("a negative id", "t", lambda k: np.r_[_fresh(k), -1], C.INVALID_ARGUMENT, "id -1 is out of range"),
    ("an id at 2^40", "t", lambda k: np.r_[_fresh(k), 2 ** 40], C.INVALID_ARGUMENT,
     f"id {2 ** 40} is out of range"),
    ("the id one past the rows", "t", lambda k: np.r_[_fresh(k), ROWS], C.INVALID_ARGUMENT,
     f"id {ROWS} is out of range"),
    ("an unknown table", "nope", _fresh, C.NOT_FOUND, "no table 'nope' is served"),
    ("a path for a table", "../t", _fresh, C.NOT_FOUND, "no table '../t' is served"),
    ("one id more than a hint may carry", "t", lambda k: np.arange(MAX_HINT_IDS + 1) % ROWS, C.INVALID_ARGUMENT,
     f"at most {MAX_HINT_IDS} ids a hint"),
    ("5 million ids", "t", lambda k: np.arange(5_000_000) % ROWS, C.INVALID_ARGUMENT,
     f"a prefetch hint carries at most {MAX_HINT_IDS} ids"),
]


@pytest.mark.parametrize("way", ["unix", "tcp"])
def test_a_bad_hint_is_refused_by_name_and_queues_nothing(served, way):
    sc, ways, _ = served
    w = next(t for t in ways if t.name == way)
    k0 = 0 if way == "unix" else 100
    for k, (what, table, ids, code, says) in enumerate(BAD):
        before = _settled(w)
        got, out = w.hint(table, ids(k0 + k))
        assert got == code and says in out, f"{way}: {what} -> {got} {str(out)[:300]}"
        assert len(out) < 2000, f"{way}: {what}: the error's details must stay bounded"
        assert _settled(w) == before, f"{way}: {what} promoted rows"
    # the same hint without the bad id is taken: the check above could see a queued one
    before = _settled(w)
    fresh = _fresh(k0 + 50)
    assert w.hint("t", fresh) == (C.OK, fresh.size)
    after = _settled(w)
    assert after["prefetched"] > before["prefetched"], (before, after)
    assert sc.proc.poll() is None, sc.log()


def test_a_hint_flood_keeps_rss_bounded_and_another_clients_lookups_right(served, rel):
    sc, ways, victim_rows = served
    pid = sc.proc.pid
    full = np.arange(MAX_HINT_IDS) % ROWS
    floods = [("t", np.arange(5_000_000) % ROWS, C.INVALID_ARGUMENT), ("t", full, C.OK),
              ("t", np.r_[full[1:], -5], C.INVALID_ARGUMENT), ("nope", full, C.NOT_FOUND),
              ("t", np.r_[full[1:], 2 ** 40], C.INVALID_ARGUMENT)]
    for w in ways:  # the gRPC threads, allocator arenas and the prefetch pool exist before the baseline
        for table, ids, _ in floods:
            w.hint(table, ids)
    _settled(ways[0])
    time.sleep(1.0)
    base = rel.proc_status(pid)["VmRSS"]
    rel.reset_peak_rss(pid)

    stop, served_ok, wrong = threading.Event(), [0], []

    def victim():
        rng = np.random.default_rng(0)
        with Client(sc.socket, timeout=60) as c:
            while not stop.is_set():
                ids = np.unique(rng.integers(0, VROWS, 256))
                try:
                    rows = c.lookup("v", ids)
                except Exception as e:  # noqa: BLE001 - what the victim would see
                    wrong.append(f"{type(e).__name__}: {e}")
                    continue
                if not np.array_equal(rows, victim_rows[ids]):
                    wrong.append(f"wrong rows for {ids[:8]}...")
                served_ok[0] += 1

    answers, unexpected = {}, []

    def attacker(w: Transport, rounds: int):
        for i in range(rounds):
            table, ids, want = floods[i % len(floods)]
            code, out = w.hint(table, ids)
            answers[code] = answers.get(code, 0) + 1
            if code != want:
                unexpected.append(f"{w.name}: {ids.size} ids of {table!r} -> {code} {str(out)[:200]}")

    def flood() -> tuple[int, int]:
        """(victim lookups during it, the sidecar's RSS once it has settled)."""
        before = served_ok[0]
        attackers = [threading.Thread(target=attacker, args=(w, ROUNDS)) for w in ways
                     for _ in range(ATTACKERS // len(ways))]
        for a in attackers:
            a.start()
        for a in attackers:
            a.join()
        during = served_ok[0] - before
        _settled(ways[0])
        time.sleep(1.0)
        return during, rel.proc_status(pid)["VmRSS"]

    v = threading.Thread(target=victim)
    v.start()
    try:
        time.sleep(0.5)
        (during, rss1), (during2, rss2) = flood(), flood()
    finally:
        stop.set()
        v.join()
    peak = rel.proc_status(pid)["VmHWM"] - base
    print(f"hint flood: {sum(answers.values())} hints {answers}, victim lookups during each {during}, {during2}; "
          f"sidecar RSS +{(rss1 - base) / 2**20:.1f} MiB, then +{(rss2 - rss1) / 2**20:.1f} MiB "
          f"(peak +{peak / 2**20:.1f} MiB)")
    assert not wrong, wrong[:5]
    assert not unexpected, unexpected[:5]
    assert min(during, during2) >= 20, f"the victim's lookups stalled: {during}, {during2} during the floods"
    assert rss1 - base < RSS_BOUND, f"the sidecar's RSS grew {(rss1 - base) >> 20} MiB under a flood " \
                                    f"(bound {RSS_BOUND >> 20})"
    assert rss2 - rss1 < REPEAT_BOUND, f"a second flood grew the sidecar's RSS {(rss2 - rss1) >> 20} MiB more " \
                                       f"(bound {REPEAT_BOUND >> 20}): something is held per hint"
    assert sc.proc.poll() is None, sc.log()
