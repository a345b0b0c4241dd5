"""client/engines/device_fill.py: the fast form's exchange between a device that never blocks the
CPU and the host thread that fills its misses, on CPU. A thread of the test plays the device (it
rings each step's misses and waits for their rows, device_fill's torch reference of the kernel's
side) over the same memory the server reads; the rows are read from a real sidecar."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from tierstore.client.client import Client
from tierstore.client.engines import StagingError
from tierstore.client.engines.device_fill import FillChannel, FillServer, ring, wait
from tierstore.kernels.staged_gather import DONE
from tierstore.ingest.writer import write_version
from tierstore.sidecar.launcher import SidecarProcess

ROWS, WIDTH = 4000, 72


@pytest.fixture
def table(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, size=(ROWS, WIDTH), dtype=np.uint8)
    write_version(tmp_path / "data", "t", [data], rows=ROWS, row_format="fp32", row_dim=WIDTH // 4)
    with SidecarProcess(tmp_path / "data", dram_budget="256KiB") as sc, Client(sc.socket) as c:
        yield c, data


def test_each_steps_misses_are_filled_for_the_device_and_read_only_once_done(table):
    client, data = table
    channel = FillChannel(512, WIDTH)
    server = FillServer(channel, lambda ids: client.lookup("t", ids))
    got, rng = {}, np.random.default_rng(1)
    steps = {s: rng.integers(0, ROWS, int(rng.integers(1, 512))) for s in range(1, 21)}

    def device():  # rings a step, waits for its rows, copies them out (the kernel's gather), next step
        for s, ids in steps.items():
            ring(channel, s, ids)
            got[s] = wait(channel, s, timeout=10).numpy().copy()

    t = threading.Thread(target=device)
    t.start()
    t.join(60)
    server.stop()
    assert not t.is_alive() and server.filled == len(steps)
    for s, ids in steps.items():
        assert np.array_equal(got[s], data[ids]), f"step {s} read other rows"
    with pytest.raises(ValueError, match="step 3 rung after step 20"):
        ring(channel, 3, steps[3])


def test_a_failed_read_and_a_lost_host_thread_are_errors_never_stale_rows(table):
    client, _ = table
    channel = FillChannel(64, WIDTH)
    server = FillServer(channel, lambda ids: client.lookup("t", ids))
    ring(channel, 1, np.arange(10))
    wait(channel, 1, timeout=10)
    ring(channel, 2, np.array([ROWS + 5]))  # an id beyond the table: the read raises
    with pytest.raises(StagingError, match="could not fill step 2's Engram misses .*IdOutOfRange"):
        wait(channel, 2, timeout=10, server=server)
    server.stop()  # the host thread is gone: the next step times out, its rows never served
    ring(channel, 3, np.arange(4))
    with pytest.raises(StagingError, match="within 0.2 s .*DONE names step 1"):
        wait(channel, 3, timeout=0.2)
    assert int(channel.words[DONE]) == 1
    with pytest.raises(ValueError, match="do not fit the 64-miss fill channel"):
        ring(channel, 4, np.arange(65))
