"""step_reads.RowScratch and read_step(outs): a staged layer's rows read into a buffer reused
step after step (the stagers' read of a step allocates nothing per layer), against a real
sidecar; layers sharing a table still get their own rows."""
from __future__ import annotations

import threading

import numpy as np

from tierstore.client.client import Client
from tierstore.client.engines import step_reads
from tierstore.client.engines.step_reads import RowScratch, read_step
from tierstore.ingest.writer import write_version
from tierstore.sidecar.launcher import SidecarProcess

ROWS, WIDTH = 5000, 72


def test_a_scratch_is_reused_grows_keeps_its_spare_rows_zero_and_is_one_per_thread(monkeypatch):
    s = RowScratch(WIDTH, spare=1)
    a = s.take(100)
    assert a.shape == (101, WIDTH) and not a[100].any()
    a[:] = 7
    b = s.take(60)  # a smaller step: the same memory, its spare row zeroed again
    assert b.ctypes.data == a.ctypes.data and b.shape == (61, WIDTH) and not b[60].any()
    c = s.take(150)  # grown (to twice the old size), then kept
    assert c.shape == (151, WIDTH) and s.take(190).ctypes.data == c.ctypes.data
    other = []
    threading.Thread(target=lambda: other.append(s.take(10))).start()
    while not other:
        pass
    assert other[0].ctypes.data != c.ctypes.data  # another thread's read never shares this one's buffer
    monkeypatch.setattr(step_reads, "KEEP_BYTES", 300 * WIDTH)
    big = s.take(400)  # past KEEP_BYTES: a fresh array, all zero, not kept
    assert big.shape == (401, WIDTH) and not big.any() and s.take(10).ctypes.data == c.ctypes.data


def test_read_step_fills_the_outs_it_is_given_even_for_layers_sharing_a_table(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, size=(ROWS, WIDTH), dtype=np.uint8)
    for t in ("a", "b"):
        write_version(tmp_path / "data", t, [data if t == "a" else data[::-1].copy()], rows=ROWS,
                      row_format="fp32", row_dim=WIDTH // 4)
    want = {"a": data, "b": data[::-1]}
    with SidecarProcess(tmp_path / "data", dram_budget="512KiB") as sc, Client(sc.socket) as c:
        rng = np.random.default_rng(1)
        scratch = [RowScratch(WIDTH) for _ in range(3)]
        for _ in range(3):
            asks = [(c, "a", rng.integers(0, ROWS, 300)), (c, "b", rng.integers(0, ROWS, 200)),
                    (c, "a", rng.integers(0, ROWS, 100))]  # two layers on table a: one joined read
            outs = [s.take(ids.size) for s, (_, _, ids) in zip(scratch, asks)]
            got = read_step(asks, outs)
            for (_, t, ids), rows, out in zip(asks, got, outs):
                assert rows is out and np.array_equal(rows, want[t][ids]), f"table {t} served other rows"
        got = read_step(asks, [None, outs[1], None])  # outs for some layers only
        assert got[1] is outs[1] and all(np.array_equal(r, want[t][ids]) for (_, t, ids), r in zip(asks, got))
