"""Client.lookup(out=) and lookup_many(out=): rows read into a caller's buffer, by every
route a lookup takes (full-resident arena, cache-mode local reads with their misses, a
planned copy under --no-local-reads, inline over gRPC, overlapped under --direct-io),
against a real sidecar process; an unfit buffer is refused before anything is read."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tierstore import errors
from tierstore.client.client import Client
from tierstore.ingest.writer import write_version
from tierstore.sidecar.launcher import SidecarProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from direct_sidecar import direct_sidecar  # noqa: E402

ROWS, WIDTH = 20_000, 64


def _write(d, table: str, seed: int) -> np.ndarray:
    """Rows that name their id (bytes 0..7), so a row served for another id is caught."""
    data = np.random.default_rng(seed).integers(0, 256, size=(ROWS, WIDTH), dtype=np.uint8)
    data[:, :8] = np.arange(ROWS, dtype="<u8").view(np.uint8).reshape(ROWS, 8)
    write_version(d, table, [data], rows=ROWS, row_format="fp32", row_dim=WIDTH // 4)
    return data


def _steps(c: Client, table: str, at_least: int = 0, timeout: float = 30.0) -> int:
    """The table's steps the sidecar has seen (local reads learned, plans), once at least
    `at_least` (the learner runs behind the reads) or `timeout` s have passed."""
    deadline = time.monotonic() + timeout
    while True:
        t = next(t for t in c.stats()["tables"] if t["table"] == table)
        n = int(t["local_steps"]) + int(t["plans"])
        if n >= at_least or time.monotonic() > deadline:
            return n
        time.sleep(0.02)


@pytest.mark.parametrize("budget, flag", [("64MiB", None), ("256KiB", None), ("256KiB", "--no-local-reads")],
                         ids=["full-resident", "cache-local-reads", "cache-planned"])
def test_lookup_fills_the_callers_buffer_by_every_route(tmp_path, budget, flag):
    """The rows land in `out` (returned as is), bit-exact, hits and misses alike; a buffer
    reused across steps holds only the last step's rows; a slice of a larger buffer works."""
    data = _write(tmp_path / "data", "t", 0)
    with SidecarProcess(tmp_path / "data", dram_budget=budget, extra_args=[flag] if flag else []) as sc, \
            Client(sc.socket) as c:
        h = c.handle("t")
        assert h.full_resident == (budget == "64MiB")
        assert (h.index_path != "") == (budget != "64MiB" and flag is None)
        rng = np.random.default_rng(1)
        buf = np.full((1000, WIDTH), 0xAB, np.uint8)
        for n in (1000, 600, 1000):  # a rewarmed arena: misses, then hits; a shorter step in a slice
            ids = rng.integers(0, ROWS, n)
            out = buf[:n]
            assert c.lookup("t", ids, out=out) is out
            assert np.array_equal(out, data[ids])
            c.flush()
        ids = rng.integers(0, ROWS, 300)
        out = np.zeros((300, WIDTH), np.uint8)
        assert c.lookup("t", ids, inline=True, out=out) is out and np.array_equal(out, data[ids])
        with c.plan("t", ids) as step:
            out = np.zeros((300, WIDTH), np.uint8)
            assert step.rows(out) is out and np.array_equal(out, data[ids])


@pytest.mark.parametrize("flag", ["page-cache", "--direct-io"])
def test_lookup_many_fills_the_buffers_it_is_given(tmp_path, flag):
    """Under --direct-io the tables are read overlapped (each begun into its buffer, then each
    ended); a table without a buffer in `out` gets a fresh array."""
    d = tmp_path / "data"
    data = {t: _write(d, t, k) for k, t in enumerate(("a", "b"))}
    sc = direct_sidecar(d, "256KiB") if flag == "--direct-io" else SidecarProcess(d, dram_budget="256KiB").start()
    try:
        with Client(sc.socket) as c:
            rng = np.random.default_rng(2)
            bufs = {"a": np.zeros((700, WIDTH), np.uint8)}
            for _ in range(3):
                step = {"b": rng.integers(0, ROWS, 500), "a": rng.integers(0, ROWS, 700)}
                got = c.lookup_many(step, out=bufs)
                assert got["a"] is bufs["a"]
                for t, ids in step.items():
                    assert np.array_equal(got[t], data[t][ids]), f"table {t} served other rows"
            assert c.overlapped == (3 if flag == "--direct-io" else 0)
    finally:
        sc.cleanup()


def test_an_unfit_buffer_is_refused_naming_it_and_nothing_is_read(tmp_path):
    """Wrong shape, dtype, layout, a read-only array, a buffer for a table the step does not
    read: InvalidArgument before any read (the buffer untouched, no step noted or planned)."""
    data = _write(tmp_path / "data", "t", 0)
    with SidecarProcess(tmp_path / "data", dram_budget="256KiB") as sc, Client(sc.socket) as c:
        ids = np.arange(100, dtype=np.int64)
        c.lookup("t", ids)  # the table described, its reader made
        c.flush()
        before = _steps(c, "t", 1)
        ro = np.zeros((100, WIDTH), np.uint8)
        ro.flags.writeable = False
        unfit = {"shape": np.zeros((99, WIDTH), np.uint8), "width": np.zeros((100, WIDTH + 8), np.uint8),
                 "dtype": np.zeros((100, WIDTH // 4), np.float32), "layout": np.zeros((WIDTH, 100), np.uint8).T,
                 "read-only": ro, "not an array": [[0] * WIDTH] * 100}
        for why, out in unfit.items():
            kept = np.array(out, copy=True)
            for inline in (False, True):
                with pytest.raises(errors.InvalidArgument, match=r"out for table 't' must be .*\(100, 64\)"):
                    c.lookup("t", ids, inline=inline, out=out)
                assert np.array_equal(np.asarray(out), kept), f"a refused {why} buffer was written"
            with c.plan("t", ids) as step, pytest.raises(errors.InvalidArgument, match="out for table 't'"):
                step.rows(out)
        with pytest.raises(errors.InvalidArgument, match=r"\['u'\]"):
            c.lookup_many({"t": ids}, out={"u": np.zeros((100, WIDTH), np.uint8)})
        with pytest.raises(errors.InvalidArgument, match="out=\\{table: buffer\\}"):
            c.lookup_many({"t": ids}, out=[np.zeros((100, WIDTH), np.uint8)])
        c.flush()
        time.sleep(0.5)  # a stray step would have been learned by now
        assert _steps(c, "t") == before + len(unfit), "only the plans the test made itself were sent"
        out = np.zeros((100, WIDTH), np.uint8)
        assert np.array_equal(c.lookup("t", ids, out=out), data[ids])  # and the client reads on
