"""The loopback cluster the remote tests stand on: real processes, cleaned up."""
from __future__ import annotations

import numpy as np


def test_objects_round_trip_between_processes(cluster):
    client = cluster.connect()
    try:
        data = np.arange(4096, dtype=np.uint8)
        assert client.put("probe", data.tobytes()) == 0
        assert cluster.connect().get_batch(["probe"])[0] == data.tobytes()
    finally:
        client.close()
    assert len(cluster.stores) == 2 and all(p.poll() is None for p in cluster.stores)
