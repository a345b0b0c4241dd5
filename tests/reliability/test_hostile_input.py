"""Area 5: hostile input against one long-lived sidecar. Every RPC gets random
field values (huge, negative and out-of-range ids, empty and enormous batches,
wrong and path-like table names, random versions, TTLs and lease ids) and
random bytes as a raw message. The server must never crash, never hand out a
slot outside its arena, answer with the status code the input deserves, and
serve the next good request bit-exact."""
from __future__ import annotations

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierstore.proto import MAX_INLINE_BYTES, MAX_REQUEST_IDS, MAX_RESPONSE_BYTES
from tierstore.proto import tierstore_pb2 as pb
from tierstore.tiers.dram import map_readonly

ROWS, DIM = 5000, 16          # fp32: 64 B rows
C = grpc.StatusCode
FUZZ = settings(deadline=None, suppress_health_check=list(HealthCheck), database=None)
TRIED = {"structured": 0, "raw": 0, "enormous": 0}
METHODS = ["ListTables", "DescribeTable", "Lookup", "Stats"]


class Target:
    """A sidecar plus a raw-bytes channel to it and what its arena holds."""

    def __init__(self, sc, expected):
        self.sc, self.expected = sc, expected
        self.channel = grpc.insecure_channel(f"unix:{sc.socket}", options=[
            ("grpc.max_receive_message_length", MAX_RESPONSE_BYTES), ("grpc.max_send_message_length", 80 << 20)])
        self.raw = {m: self.channel.unary_unary(f"/tierstore.v1.Tierstore/{m}", request_serializer=None,
                                                response_deserializer=None) for m in METHODS}
        info = pb.TableInfo.FromString(self.raw["DescribeTable"](pb.DescribeTableRequest(table="t").SerializeToString()))
        self.version, self.full, self.slots = info.version, info.arena.full_resident, info.arena.slots
        self.arena, _ = map_readonly(info.arena.path, info.arena.slots, info.row_bytes)

    def call(self, method: str, raw: bytes):
        try:
            return C.OK, self.raw[method](raw, timeout=60)
        except grpc.RpcError as e:
            return e.code(), e.details()

    def still_serves(self):
        assert self.sc.proc.poll() is None, f"sidecar died:\n{self.sc.log()}"
        ids = np.array([0, ROWS - 1, 1234])
        code, out = self.call("Lookup", pb.LookupRequest(table="t", ids=ids.astype("<i8").tobytes()).SerializeToString())
        assert code == C.OK, out
        assert np.array_equal(np.frombuffer(pb.LookupResponse.FromString(out).rows, np.uint8).reshape(3, -1),
                              self.expected[ids])


@pytest.fixture(scope="module", params=["cache", pytest.param("full", marks=pytest.mark.reliability)])
def target(request, tmp_path_factory, rel):
    from tierstore.sidecar.launcher import SidecarProcess

    d = tmp_path_factory.mktemp("hostile") / "data"
    expected = rel.write_table(d, "t", ROWS, dim=DIM, seed=9)
    budget = "100KiB" if request.param == "cache" else "64MiB"
    with SidecarProcess(d, dram_budget=budget, extra_args=["--lease-ttl", "2"]) as sc:
        t = Target(sc, expected)
        assert t.full == (request.param == "full")
        yield t
        t.channel.close()


NAMES = st.one_of(
    st.sampled_from(["t", "", "../x", "../../etc/passwd", "/dev/shm/x", "t/../t", "t\x00", "T", " t", "t.v1", "%s%n",
                     "tables/t/v1", "t" * 65]),
    st.text(max_size=40),
    st.builds(lambda n, ch: ch * n, st.integers(100, 2_000_000), st.sampled_from(["x", "/", "é", "../"])))
ID_LISTS = st.one_of(
    st.lists(st.integers(0, ROWS - 1), max_size=300),
    st.lists(st.integers(-(2 ** 63), 2 ** 63 - 1), max_size=20),
    st.lists(st.sampled_from([-1, ROWS, ROWS + 1, 2 ** 31, 2 ** 63 - 1, -(2 ** 63), 0, ROWS - 1]), max_size=8),
    st.builds(lambda n: list(range(n)), st.sampled_from([0, 1, 4096]).map(lambda n: min(n, ROWS))),
)
IDS = st.one_of(ID_LISTS.map(lambda l: np.array(l, dtype="<i8").tobytes()), st.binary(max_size=64))
VERSIONS = st.one_of(st.just(0), st.just(1), st.integers(0, 2 ** 64 - 1))


def expected_code(t: Target, method: str, req) -> "grpc.StatusCode":
    """The status the sidecar owes this (well-formed) request."""
    if method in ("ListTables", "Stats"):
        return C.OK
    if req.table != "t":
        return C.NOT_FOUND
    if method == "DescribeTable":
        return C.OK
    if req.version not in (0, t.version):
        return C.NOT_FOUND
    if len(req.ids) % 8:
        return C.INVALID_ARGUMENT
    ids = np.frombuffer(req.ids, "<i8")
    if ids.size > MAX_REQUEST_IDS:
        return C.RESOURCE_EXHAUSTED
    if method == "Lookup" and ids.size * DIM * 4 > MAX_INLINE_BYTES:
        return C.RESOURCE_EXHAUSTED
    if ids.size and ((ids < 0) | (ids >= ROWS)).any():
        return C.INVALID_ARGUMENT
    if not t.full and np.unique(ids).size > t.slots:  # Lookup plans through the cache too
        return C.RESOURCE_EXHAUSTED
    return C.OK


def check_answer(t: Target, method: str, req, code, out) -> None:
    want = expected_code(t, method, req)
    assert code == want, f"{method}({str(req)[:300]}) -> {code}: {str(out)[:300]}; expected {want}"
    if code != C.OK:
        assert len(out) < 2000, "error details must stay bounded"
        return
    if method == "Lookup":
        ids = np.frombuffer(req.ids, "<i8")
        rows = np.frombuffer(pb.LookupResponse.FromString(out).rows, np.uint8).reshape(ids.size, DIM * 4)
        assert np.array_equal(rows, t.expected[ids])
    elif method == "DescribeTable":
        assert pb.TableInfo.FromString(out).rows == ROWS


REQUESTS = st.one_of(
    st.builds(lambda: ("ListTables", pb.ListTablesRequest())),
    st.builds(lambda: ("Stats", pb.StatsRequest())),
    st.builds(lambda n: ("DescribeTable", pb.DescribeTableRequest(table=n)), NAMES),
    st.builds(lambda n, v, i: ("Lookup", pb.LookupRequest(table=n, version=v, ids=i)),
              st.one_of(st.just("t"), NAMES), VERSIONS, IDS),
)


def _structured(t, examples):
    @settings(FUZZ, max_examples=examples)
    @given(REQUESTS)
    def run(case):
        method, req = case
        code, out = t.call(method, req.SerializeToString())
        TRIED["structured"] += 1
        check_answer(t, method, req, code, out)
        t.still_serves()
    run()


def _raw(t, examples):
    @settings(FUZZ, max_examples=examples)
    @given(st.sampled_from(METHODS), st.one_of(st.binary(max_size=200),
                                               st.binary(max_size=20).map(lambda b: b"\x1a\x08" + b)))
    def run(method, raw):
        code, out = t.call(method, raw)
        TRIED["raw"] += 1
        req_cls = {"ListTables": pb.ListTablesRequest, "DescribeTable": pb.DescribeTableRequest,
                   "Lookup": pb.LookupRequest,
                   "Stats": pb.StatsRequest}[method]
        try:
            req = req_cls.FromString(raw)
        except Exception:  # noqa: BLE001 - what the server must call malformed
            assert code == C.INVALID_ARGUMENT, (method, raw, code, out)
            assert "malformed" in out
        else:
            check_answer(t, method, req, code, out)
        t.still_serves()
    run()


def test_fuzz_every_rpc_short(target):
    _structured(target, 150)
    _raw(target, 150)
    print(f"hostile inputs tried so far: {TRIED}")


@pytest.mark.reliability
def test_fuzz_every_rpc_long(target):
    _structured(target, 1500)
    _raw(target, 1500)
    print(f"hostile inputs tried so far: {TRIED}")


@pytest.mark.parametrize("n_ids", [pytest.param(MAX_REQUEST_IDS, marks=pytest.mark.reliability),
                                   MAX_REQUEST_IDS + 1, pytest.param(9_000_000, marks=pytest.mark.reliability)])
def test_enormous_batches_are_refused_or_served(target, n_ids):
    ids = (np.arange(n_ids, dtype="<i8") % ROWS).tobytes()
    for method, req in (("Lookup", pb.LookupRequest(table="t", ids=ids)),):
        code, out = target.call(method, req.SerializeToString())
        TRIED["enormous"] += 1
        if n_ids * 8 > (64 << 20):  # over the wire limit: gRPC refuses before our code runs
            assert code == C.RESOURCE_EXHAUSTED, (code, out)
        else:
            check_answer(target, method, req, code, out)
        target.still_serves()
