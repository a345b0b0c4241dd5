"""tierstore/tiers/trust.py: what a note may carry for a version's misses, and from whom. The
records-path tests (tests/reliability/test_carried_records.py, test_miss_flights_peer.py,
tests/client/test_local_reads.py's other-uid test) attack the rule through a real sidecar;
this is the rule itself, every case of it."""
import socket

import numpy as np
import pytest

from tierstore.tiers import trust
from tierstore.tiers.trust import NOTHING, RECORDS, ROWS, Carried

RB, REC = 264, 280  # a V4.1 row, and its format 2 record


@pytest.mark.parametrize("verifies, in_records, binds, direct, form", [
    (False, False, False, False, NOTHING),  # no row sums: rows verify by block
    (False, True, True, True, NOTHING),
    (True, True, True, False, RECORDS),  # format 2, salted: records in either mode
    (True, True, True, True, RECORDS),
    (True, True, False, False, ROWS),  # format 2 before row_salt: its sums on disk, through the page cache
    (True, True, False, True, NOTHING),  # ... but not under O_DIRECT (not cached), and no records (fmix64-v1)
    (True, False, True, False, ROWS),  # format 1: the row-sum file
    (True, False, False, True, ROWS),
])
def test_the_form_a_version_carries(verifies, in_records, binds, direct, form):
    c = Carried.of(verifies_rows=verifies, sums_in_records=in_records, binds_version=binds, direct=direct,
                   row_bytes=RB, record_bytes=REC if in_records else RB)
    assert c.form == form
    assert c.width == {RECORDS: REC, ROWS: RB, NOTHING: 0}[form]


def test_records_only_from_a_trusted_peer_rows_from_anyone_and_only_in_the_versions_form():
    records, rows, nothing = Carried(RECORDS, REC), Carried(ROWS, RB), trust.NONE
    recs, bare = np.zeros((3, REC), np.uint8), np.zeros((3, RB), np.uint8)
    assert records.admits(recs, trusted=True) and not records.admits(recs, trusted=False)
    assert rows.admits(bare, trusted=False) and rows.admits(bare, trusted=True)
    assert not records.admits(bare, trusted=True)  # another form than the version's: read from disk
    assert not rows.admits(recs, trusted=True)
    assert not nothing.admits(bare, trusted=True) and not nothing.admits(np.zeros((3, 0), np.uint8), trusted=True)


def test_a_peer_of_this_uid_is_trusted_and_a_socket_without_credentials_is_not():
    a, b = socket.socketpair(socket.AF_UNIX)
    try:
        assert trust.peer_trusted(a) and trust.peer_trusted(b)
    finally:
        a.close(), b.close()
    tcp = socket.socket(socket.AF_INET)
    try:
        assert not trust.peer_trusted(tcp)  # no SO_PEERCRED: never trusted
    finally:
        tcp.close()
