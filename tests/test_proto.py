"""The .proto is the source of truth: checked-in stubs must match a fresh generation,
and every message survives a round trip."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from tierstore.proto import tierstore_pb2 as pb

PROTO_DIR = Path(pb.__file__).resolve().parent


def _generator():
    spec = importlib.util.spec_from_file_location("proto_generate", PROTO_DIR / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_checked_in_stubs_are_not_stale(tmp_path):
    gen = _generator()
    for fresh in gen.generate(tmp_path):
        checked_in = PROTO_DIR / fresh.name
        assert checked_in.read_bytes() == fresh.read_bytes(), f"{fresh.name} is stale: run `make proto`"


def test_messages_round_trip():
    ids = np.array([0, 5, 2**40, 7], dtype="<i8")
    msgs = [
        pb.LookupRequest(table="l1", version=3, ids=ids.tobytes()),
        pb.PrefetchRequest(table="l1", ids=ids.tobytes(), hint_only=True, steps=4),
        pb.LookupResponse(rows=b"\x00\xff" * 8, row_bytes=4, version=1),
        pb.TableInfo(table="l1", rows=10, row_format="fp32", row_dim=4, row_bytes=16, layer_id=-1,
                     arena=pb.Arena(path="/dev/shm/x", slots=10, full_resident=True, size_bytes=160)),
        pb.StatsResponse(tables=[pb.TableStats(table="l1", mode="cache", hits=3)], uptime_s=1.5),
    ]
    for m in msgs:
        back = type(m).FromString(m.SerializeToString())
        assert back == m
    assert np.array_equal(np.frombuffer(msgs[0].ids, "<i8"), ids)


def test_errors_defined_outside_tierstore_errors_cross_the_step_socket_as_their_public_class():
    """A refusal raised as a subclass kept beside its cause (PinsSaturated, NotEnoughEvictable)
    reaches the client as the tierstore.errors class it derives from, message intact: a client
    that retries on ResourceExhausted retries on these too."""
    from tierstore import errors
    from tierstore.cache.policy.base import NotEnoughEvictable
    from tierstore.cache.slot_table import PinsSaturated
    from tierstore.proto.frames import decode_error, encode_error

    for raised in (PinsSaturated(), NotEnoughEvictable("no victims"), errors.IdOutOfRange("id 9 of 3")):
        got, _ = decode_error(b"".join(encode_error(raised)), 0)
        assert type(got) is next(c for c in type(raised).__mro__ if c.__module__ == errors.__name__)
        assert str(got) == str(raised)
    assert type(decode_error(b"".join(encode_error(PinsSaturated())), 0)[0]) is errors.ResourceExhausted
    assert errors.wire_name(PinsSaturated()) == "ResourceExhausted"  # the gRPC trailing metadata's name
    assert errors.wire_name(KeyError("x")) == "TierstoreError"
