"""The gRPC channel to a sidecar: how it is opened, found again, and how its failures read.

A failed call becomes the tierstore error the sidecar raised (its class travels
in the trailing metadata), or Unavailable naming the socket when nobody answers.
"""
from __future__ import annotations

import grpc

from tierstore import errors
from tierstore.client.step_channel import RECONNECT_WAIT_S  # one wait for both transports (defined there: no gRPC)
from tierstore.proto import MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES

__all__ = ["open_channel", "reconnected", "to_error"]

_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
    grpc.StatusCode.DATA_LOSS: errors.DataLoss,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.Unavailable,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.ABORTED: errors.StaleRows,
}


def to_error(e: grpc.RpcError, target: str = "") -> errors.TierstoreError:
    """The tierstore error a status carries: the class named in its trailing metadata
    (errors.ERROR_METADATA_KEY), else in its text ("ClassName: message", older sidecars), else by code."""
    detail = e.details() or ""
    name, _, msg = detail.partition(": ")
    named = dict(getattr(e, "trailing_metadata", lambda: None)() or ()).get(errors.ERROR_METADATA_KEY)
    if named:
        name, msg = named, detail.removeprefix(f"{named}: ")
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.TierstoreError) and cls is not errors.ChecksumError:
        return cls(msg)
    if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and target:
        return errors.Unavailable(f"no tierstore sidecar answers at {target} (is `tierstore serve` running "
                                  f"there?): {e.code().name}: {detail}")
    return _BY_CODE.get(e.code(), errors.TierstoreError)(f"{e.code().name}: {detail}")


def open_channel(target: str, root_certificates: bytes | None = None) -> grpc.Channel:
    """A channel to `target` ("unix:PATH" or "host:port"; TLS when root_certificates are given)."""
    options = [
        ("grpc.max_receive_message_length", MAX_RESPONSE_BYTES),
        ("grpc.max_send_message_length", MAX_REQUEST_BYTES),
        # a restarted sidecar is found again within the 500 ms backoff cap set here, not gRPC's default 1-120 s
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 500),
    ]
    if root_certificates is not None:
        creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
        return grpc.secure_channel(target, creds, options=options)
    return grpc.insecure_channel(target, options=options)


def reconnected(channel: grpc.Channel, timeout: float) -> bool:
    """After UNAVAILABLE: wait briefly for the sidecar to come back (one retry, bounded)."""
    try:
        grpc.channel_ready_future(channel).result(timeout=min(timeout, RECONNECT_WAIT_S))
        return True
    except grpc.FutureTimeoutError:
        return False
