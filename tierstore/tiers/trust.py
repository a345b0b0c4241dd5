"""Trust: what a note may carry for the misses a client read, and from whom. Decided here and
nowhere else; the reader, the engine, the learner, the step server and the miss flights ask.

A client on the sidecar's host that reads its own misses (client/local_reads.py) tells the
sidecar each step afterwards (an access note), and the note may carry the rows it read, so
the sidecar promotes them without reading them again. Nothing the sidecar did not verify
for that place is ever placed; what a carried row is checked against decides whom it is
taken from. A table version carries one form (`Carried.of`):

- ROWS: the bare row, checked against a sum the sidecar reads itself (format 1's row-sum
  file, 8 B a row; a format 2 record's last word through the page cache, which the
  client's read has just filled). Taken from any peer: a forged row fails the sidecar's
  own sum.
- RECORDS: the row with its row sum, checked against the sum it carries. The form of a
  format 2 version whose sums bind the version (fmix64-v2, keyed by its salt: a genuine
  record of another id, table or version fails), where the sum on disk would cost the
  sidecar a read of its own. Taken only from a peer that runs as the sidecar's uid or as
  root (`peer_trusted`), who can write the segments and the arena anyway: against it the
  sum guards against faults, not forgery. Records from any other peer are left out and
  their misses read from disk.
- NOTHING: a version without row sums (its rows verify by block), or a format 2 version
  written before row_salt read with O_DIRECT (fmix64-v1 binds the id alone, so a record of
  any version would pass, and its sums on disk are not cached for the sidecar to read
  cheaply): its misses are read from disk.

The miss flights file (cache/miss_flights.py) is the same trust: 0600 and the sidecar's
uid's, so whoever writes a row there is a peer records are taken from, and each row copied
out of it is placed in the table's form (SegmentReader.place_carried), checked as a
carried row is.
"""
from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

import numpy as np

__all__ = ["Carried", "ROWS", "RECORDS", "NOTHING", "peer_trusted"]

ROWS, RECORDS, NOTHING = "rows", "records", ""


def peer_trusted(sock: socket.socket) -> bool:
    """The process at the other end of a unix socket runs as this process's effective uid or
    as root (SO_PEERCRED, read once at accept): it can write whatever this process can
    (segments, arenas), so the records it vouches for need no more than a fault check. The
    step socket is born 0600, so only such peers connect unless an operator widened it."""
    try:
        _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except (OSError, AttributeError):  # not a unix socket, or no SO_PEERCRED here
        return False
    return uid in (0, os.geteuid())


@dataclass(frozen=True)
class Carried:
    """What the notes of one table version carry (a client) and take (the sidecar): `form`
    (ROWS, RECORDS or NOTHING) and `width`, a carried row's bytes (row_bytes for rows,
    record_bytes for records, 0 for nothing)."""

    form: str
    width: int

    @classmethod
    def of(cls, *, verifies_rows: bool, sums_in_records: bool, binds_version: bool, direct: bool,
           row_bytes: int, record_bytes: int) -> "Carried":
        """The form of a version read by a reader whose rows verify by their own sums
        (`verifies_rows`), stored in their records (`sums_in_records`: format 2) and keyed by
        the version (`binds_version`: fmix64-v2), with O_DIRECT (`direct`): the module's rule."""
        if not verifies_rows:
            return NONE
        if sums_in_records and binds_version:
            return cls(RECORDS, record_bytes)
        if sums_in_records and direct:
            return NONE
        return cls(ROWS, row_bytes)

    def admits(self, rows: np.ndarray, trusted: bool) -> bool:
        """A note's carried `rows` (uint8 [n, width]) are placed, each checked, rather than
        their misses read from disk: they are of this version's form, and a peer that is not
        `trusted` (peer_trusted) sends no records. The one check; callers place what it admits."""
        return bool(self.form) and rows.shape[1] == self.width and (self.form != RECORDS or trusted)


NONE = Carried(NOTHING, 0)
