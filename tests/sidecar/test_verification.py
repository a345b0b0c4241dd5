"""Online verification (--verify-sample): corrupt bytes in a served cold block or in
the DRAM arena are found off the hot path, counted per tier, and never served."""
from __future__ import annotations

import time

import numpy as np
import pytest

from tierstore import errors
from tierstore.client.client import Client
from tierstore.table.formats import encode_rows
from tierstore.ingest.writer import write_version
from tierstore.sidecar.launcher import SidecarProcess

ROWS, DIM = 6000, 32


@pytest.fixture
def table(tmp_path):
    rows = encode_rows(np.random.default_rng(4).standard_normal((ROWS, DIM)).astype(np.float32), "fp32")
    tv = write_version(tmp_path / "d", "v", [rows], rows=ROWS, row_format="fp32", row_dim=DIM)
    return tmp_path / "d", tv, rows


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def _wait(pred, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


def test_flipped_cold_byte_under_a_resident_row_is_caught_and_refused(table, free_port, metric):
    d, tv, rows = table
    port = free_port()
    extra = ["--verify-sample", "1.0", "--metrics-port", port]
    with SidecarProcess(d, dram_budget="100KiB", extra_args=extra) as sc, Client(sc.socket) as c:
        assert not c.table_info("v")["full_resident"]
        victim = 1000
        ids = np.arange(victim - 3, victim + 3)
        with c.plan("v", ids) as step:  # planned: promoted, resident and correct
            assert np.array_equal(step.rows(), rows[ids])
        _flip(d / tv.segments[0], victim * tv.record_bytes + 5)   # the cold copy rots afterwards
        with c.plan("v", ids) as step:
            assert np.array_equal(step.rows(), rows[ids])  # still the verified copy ...
        assert _wait(lambda: metric(port, "tierstore_verify_mismatches", "nvme") > 0)  # ... but found
        block = victim // tv.block_rows
        with pytest.raises(errors.DataLoss, match=f"block {block}"):
            c.lookup("v", [victim])  # read locally: the bad block's rows left the arena
        with pytest.raises(errors.DataLoss, match=f"block {block}"):
            with c.plan("v", [victim]) as step:
                step.rows()
        far = np.array([0, ROWS - 1])
        assert np.array_equal(c.lookup("v", far), rows[far])  # the rest keeps serving
        with c.plan("v", far) as step:
            assert np.array_equal(step.rows(), rows[far])
        assert _wait(lambda: metric(port, "tierstore_verified_rows", "dram") > 0)


def test_corrupt_arena_bytes_are_repaired_by_the_scrub(table, free_port, metric):
    d, tv, rows = table
    port = free_port()
    extra = ["--verify-sample", "1.0", "--metrics-port", port]
    with SidecarProcess(d, dram_budget="64MiB", extra_args=extra) as sc, Client(sc.socket) as c:
        assert c.table_info("v")["full_resident"]
        arena = sc.arena_files()[0]
        _flip(arena, 77 * tv.row_bytes + 1)
        assert _wait(lambda: metric(port, "tierstore_verify_mismatches", "dram") >= 1)
        assert np.array_equal(c.lookup("v", np.arange(ROWS)), rows)  # repaired in place
        # the counter moves inside the scrub, the log line follows it: wait, do not race it
        assert _wait(lambda: "mismatch in table 'v'" in sc.log())


def _counter(port, name: str) -> float:
    """Counter `name` of the sidecar's one table (its _total line)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return float(next(ln for ln in text.splitlines() if ln.startswith(f"{name}_total{{")).rsplit(" ", 1)[1])


def test_a_segment_cut_short_is_no_verdict_and_a_flipped_byte_put_back_serves_again(table, free_port, metric):
    """A cold block the verifier cannot read whole (its segment cut short, as `cp` over it does
    first) is counted unreadable and refuses nothing; a block whose bytes fail is refused until
    the good bytes are back, then served again (tierstore_verify_lifted_blocks)."""
    d, tv, rows = table
    port = free_port()
    seg = d / tv.segments[0]
    whole = seg.read_bytes()
    extra = ["--verify-sample", "1.0", "--metrics-port", port]
    with SidecarProcess(d, dram_budget="100KiB", extra_args=extra) as sc, Client(sc.socket) as c:
        ids = np.arange(2000, 2006)
        with c.plan("v", ids) as step:  # resident and correct
            assert np.array_equal(step.rows(), rows[ids])
        seg.write_bytes(b"")
        with c.plan("v", ids) as step:  # served from the arena; the verifier's read comes back short
            assert np.array_equal(step.rows(), rows[ids])
        assert _wait(lambda: _counter(port, "tierstore_verify_unreadable_blocks") > 0)
        with c.plan("v", ids) as step:  # no verdict: still served
            assert np.array_equal(step.rows(), rows[ids])
        flipped = bytearray(whole)
        flipped[2003 * tv.record_bytes + 5] ^= 0x10
        seg.write_bytes(bytes(flipped))  # back, but one byte rotted
        assert _wait(lambda: metric(port, "tierstore_verify_mismatches", "nvme") > 0)
        with pytest.raises(errors.DataLoss, match=f"block {2003 // tv.block_rows}"):
            with c.plan("v", ids) as step:
                step.rows()
        seg.write_bytes(whole)  # a good copy put back
        assert _wait(lambda: _counter(port, "tierstore_verify_lifted_blocks") > 0)
        with c.plan("v", ids) as step:
            assert np.array_equal(step.rows(), rows[ids])
