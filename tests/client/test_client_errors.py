"""Errors cross the socket as their own class: named in trailing metadata, or in the status text
of an older sidecar that sends no metadata."""
from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from tierstore import errors
from tierstore.client.channel import to_error
from tierstore.client.client import Client
from tierstore.sidecar.launcher import SidecarProcess


def test_an_error_whose_message_holds_a_colon_arrives_as_its_class(data_dir, make_table):
    make_table("t", rows=10, row_bytes=16)
    with SidecarProcess(data_dir, dram_budget="1MiB") as sc, Client(sc.socket, timeout=10) as c:
        with pytest.raises(errors.TableNotFound) as got:
            c.table_info("a: b")
        assert str(got.value) == "no table 'a: b' is served; tables: ['t']"
        with pytest.raises(errors.IdOutOfRange, match="has 10 rows; id 10 is out of range"):
            c.lookup("t", [10], inline=True)
        # the class also travels in the trailing metadata, for any gRPC client
        from tierstore.proto import tierstore_pb2 as pb
        with grpc.insecure_channel(f"unix://{sc.socket}") as ch:
            call = ch.unary_unary("/tierstore.v1.Tierstore/DescribeTable",
                                  request_serializer=pb.DescribeTableRequest.SerializeToString)
            with pytest.raises(grpc.RpcError) as raw:
                call(pb.DescribeTableRequest(table="a: b"), timeout=10)
        assert (errors.ERROR_METADATA_KEY, "TableNotFound") in tuple(raw.value.trailing_metadata())


@pytest.fixture
def status_server(tmp_path):
    """A bare gRPC server whose one method ends with the (code, text, metadata) the test sets."""
    answer = {}

    def fail(request, context):
        if answer.get("metadata"):
            context.set_trailing_metadata(answer["metadata"])
        context.abort(answer["code"], answer["text"])

    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t.T", {"Fail": grpc.unary_unary_rpc_method_handler(fail)}),))
    sock = tmp_path / "s.sock"
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    channel = grpc.insecure_channel(f"unix://{sock}")
    method = channel.unary_unary("/t.T/Fail")

    def call(code, text, metadata=None) -> errors.TierstoreError:
        answer.update(code=code, text=text, metadata=metadata)
        with pytest.raises(grpc.RpcError) as e:
            method(b"", timeout=10)
        return to_error(e.value)

    yield call
    channel.close()
    server.stop(None)


def test_metadata_names_the_class_and_the_text_is_the_fallback(status_server):
    key = errors.ERROR_METADATA_KEY
    err = status_server(grpc.StatusCode.NOT_FOUND, "TableNotFound: no table 'a: b'", ((key, "TableNotFound"),))
    assert type(err) is errors.TableNotFound and str(err) == "no table 'a: b'"
    # the metadata wins over a text that does not start with the class name
    err = status_server(grpc.StatusCode.INVALID_ARGUMENT, "SpecMismatch: rows: 3", ((key, "IdOutOfRange"),))
    assert type(err) is errors.IdOutOfRange and str(err) == "SpecMismatch: rows: 3"
    # an older sidecar: the class only in the text
    err = status_server(grpc.StatusCode.INVALID_ARGUMENT, "SpecMismatch: rows: 3 != 4")
    assert type(err) is errors.SpecMismatch and str(err) == "rows: 3 != 4"
    # neither: the status code decides
    err = status_server(grpc.StatusCode.DATA_LOSS, "disk: gone")
    assert type(err) is errors.DataLoss and "disk: gone" in str(err)


def test_a_call_after_a_lost_reply_waits_once_for_a_dead_sidecar(data_dir, make_table):
    """The sidecar dies with a step in flight: the next call collects that lost reply and
    then sends its own; together they wait for the sidecar once (RECONNECT_WAIT_S), then
    Unavailable. (Each waited in turn: twice the bound a caller plans for.)"""
    import time

    import numpy as np

    from tierstore.client.step_channel import RECONNECT_WAIT_S, StepChannel
    from tierstore.proto.frames import PlanItem, step_socket_path

    make_table("t", rows=100, row_bytes=16)
    with SidecarProcess(data_dir, dram_budget="1MiB") as sc, StepChannel(step_socket_path(sc.socket)).connect() as c:
        assert c.submit([PlanItem("t", np.arange(4))]).result()[0].slots.size == 4
        sc.kill()
        first = c.submit([PlanItem("t", np.arange(4))])  # the send fails: its reply is lost
        t0 = time.monotonic()
        with pytest.raises(errors.Unavailable):
            c.submit([PlanItem("t", np.arange(8))]).result()
        took = time.monotonic() - t0
        assert took < RECONNECT_WAIT_S + 1.0, took
        with pytest.raises(errors.Unavailable):
            first.result()
