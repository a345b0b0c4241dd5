"""Typed errors. Each message says what was wrong and how to fix it.

The server maps each class to one gRPC status code (GRPC_CODE), so a client
sees the same class name and message on the other side of the socket: the
class travels in the trailing metadata (ERROR_METADATA_KEY) and, for clients
older than that, as the status text "ClassName: message". A class defined
elsewhere (PinsSaturated in tierstore/cache/slot_table.py, say) travels as the
nearest class of its own defined here (wire_name), so the client rebuilds the
type it can catch and retry on.
"""
from __future__ import annotations

__all__ = ["ERROR_METADATA_KEY", "TierstoreError", "InvalidArgument", "BadJSON", "IdOutOfRange", "SpecMismatch", "NotFound",
           "TableNotFound", "VersionNotFound", "ResourceExhausted", "DataLoss", "ChecksumError", "Unavailable",
           "StaleRows", "StaleArena", "Unauthenticated", "BrokenInvariant", "wire_name"]

# gRPC trailing-metadata key whose value is the error's class name
ERROR_METADATA_KEY = "tierstore-error"


class TierstoreError(Exception):
    """Base class; GRPC_CODE names the grpc.StatusCode member it maps to."""

    GRPC_CODE = "INTERNAL"


class InvalidArgument(TierstoreError, ValueError):
    GRPC_CODE = "INVALID_ARGUMENT"


class BadJSON(InvalidArgument):
    """A JSON document refused by tierstore.bounded_json: over its size or nesting limit, or not JSON."""


class IdOutOfRange(InvalidArgument):
    """An id < 0 or >= the table's row count."""


class SpecMismatch(InvalidArgument):
    """A checkpoint whose shape, dtype or row count does not match its spec."""


class NotFound(TierstoreError, KeyError):
    GRPC_CODE = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0] if self.args else ""


class TableNotFound(NotFound):
    pass


class VersionNotFound(NotFound):
    pass


class ResourceExhausted(TierstoreError):
    """Arena full of leased rows, request over the size limit, budget over /dev/shm."""

    GRPC_CODE = "RESOURCE_EXHAUSTED"


class DataLoss(TierstoreError):
    """A checksum mismatch: a corrupt block is never served as a row."""

    GRPC_CODE = "DATA_LOSS"


class ChecksumError(DataLoss):
    """A block or row that failed its checksum (or whose file is missing or cut short): never
    returned. `block` names the block; `row` the row, where one row's check failed (else None)."""

    def __init__(self, table: str, version: int, block: int, detail: str = "", row: int | None = None):
        self.table, self.version, self.block, self.row = table, version, block, row
        msg = f"table {table!r} version {version}: checksum mismatch in block {block}"
        super().__init__(msg + (f" ({detail})" if detail else ""))


class Unavailable(TierstoreError):
    GRPC_CODE = "UNAVAILABLE"


class StaleRows(TierstoreError):
    """Rows read for a step were no longer that step's own: its lease ended before the
    gather finished (TTL, a release), or the arena was retired (version swap,
    restart). Never returned as rows; plan the step again (the client does once)."""

    GRPC_CODE = "ABORTED"


class StaleArena(StaleRows):
    """The arena a client mapped is not (or no longer) the one the sidecar serves."""


class Unauthenticated(TierstoreError):
    GRPC_CODE = "UNAUTHENTICATED"


class BrokenInvariant(TierstoreError, AssertionError):
    """A shared structure's check() found one of its invariants false (the slot table, the lease
    table, the slot index): a tierstore bug, never a caller's input, so nothing retries it.
    An AssertionError (raised, not `assert`ed: python -O keeps it) so a test or a debug run
    fails as on an assert. `structure` and `invariant` name the rule as the structure's
    docstring states it, `at` the slot, lease or id that breaks it."""

    def __init__(self, structure: str, invariant: str, at: str, detail: str = ""):
        self.structure, self.invariant, self.at = structure, invariant, at
        super().__init__(f"{structure}: {invariant}, broken at {at}" + (f" ({detail})" if detail else "")
                         + "; a tierstore bug: report it with the operations that led here")


def wire_name(e: BaseException) -> str:
    """The name `e` crosses the wire under: its class's, or that of its nearest base defined in
    this module (a client resolves names only here); "TierstoreError" for anything else."""
    for cls in type(e).__mro__:
        if cls.__module__ == __name__:
            return cls.__name__
    return TierstoreError.__name__
