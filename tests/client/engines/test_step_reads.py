"""step_reads.read_step(outs): a staged layer's rows read into its RowScratch, reused step after
step, against a real sidecar; layers sharing a table still get their own rows."""
from __future__ import annotations

import numpy as np

from tierstore.client.client import Client
from tierstore.client.engines.step_reads import read_step
from tierstore.client.row_scratch import RowScratch
from tierstore.ingest.writer import write_version
from tierstore.sidecar.launcher import SidecarProcess

ROWS, WIDTH = 5000, 72


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
