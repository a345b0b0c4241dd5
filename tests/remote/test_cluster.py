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


def test_a_second_cluster_on_the_host_starts_beside_the_first(cluster, tmp_path):
    """Every port of a cluster is its own (the master's metrics server included, 9003 by
    Mooncake's default): a second cluster, as another test run or a user's own, starts and
    keeps its objects apart."""
    from mooncake_cluster import local_cluster

    with local_cluster(tmp_path / "second", stores=1) as other:
        a, b = cluster.connect(), other.connect()
        try:
            assert a.put("probe", b"first") == 0 and b.put("probe", b"second") == 0
            assert a.get_batch(["probe"])[0] == b"first" and b.get_batch(["probe"])[0] == b"second"
        finally:
            a.close()
            b.close()
