"""bench/step_socket.py's harness: the record of leases its ModuloHandler keeps per conn_id."""
from __future__ import annotations

import time

from tierstore.bench.step_socket import OwnedLeases


def test_owned_leases_end_only_their_owners_and_forget_the_expired():
    owned, a, b = OwnedLeases(), b"a" * 16, b"b" * 16
    owned.add(a, 1, time.monotonic() + 60)
    owned.add(b, 2, time.monotonic() + 60)
    assert owned.take(a, [2, 1, 99]) == [1] and owned.take(a, [1]) == []  # b's lease 2 is not a's to end
    assert owned.take_all(b) == [2] and len(owned) == 0
    for i in range(3000):  # a client that never releases: expired entries go as new ones come
        owned.add(a, 10 + i, time.monotonic() - 1)
    assert len(owned) < 2100
