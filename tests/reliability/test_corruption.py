"""Area 3: corruption. A flipped byte in a cold block is DATA_LOSS naming table,
version and block, and every other block keeps serving bit-exact; an ingest
killed at any instant never leaves a torn catalog."""
from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tierstore import errors
from tierstore.store.catalog import Catalog
from tierstore.client.client import Client
from tierstore.tiers.nvme.reader import SegmentReader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from segment_damage import flip_row_byte  # noqa: E402

FORMATS = ["fp32", "bf16", "fp16", "fp8-e4m3-ue8m0"]
ROWS = 6000


def _flip(data_dir, tv, row, byte=3):
    flip_row_byte(data_dir, tv, row, byte)


@pytest.fixture(scope="module")
def corrupt(tmp_path_factory, rel):
    """Eight tables, one per row format and segment format (2: each record carries its row
    sum; 1: a row-sum file beside the segments), each with three corrupt blocks (first,
    middle, last); in format 2 the middle one's damage is in the row sum its record carries."""
    d = tmp_path_factory.mktemp("corrupt") / "data"
    tables = {}
    for i, fmt in enumerate(FORMATS):
        for seg in (2, 1):
            name = f"c{i}" if seg == 2 else f"c{i}-v1"
            expected = rel.write_table(d, name, ROWS, dim=64, fmt=fmt, seed=i, segment_format=seg)
            with Catalog(d, readonly=True) as cat:
                tv = cat.current(name)
            assert tv.segment_format == seg
            bad_rows = [5, ROWS // 2 + 7, ROWS - 1]
            for r in bad_rows:
                in_sum = seg == 2 and r == bad_rows[1]
                _flip(d, tv, r, byte=tv.record_bytes - 2 if in_sum else r % tv.row_bytes)
            bad_blocks = sorted({r // tv.block_rows for r in bad_rows})
            tables[name] = (tv, expected, bad_rows, bad_blocks)
    return d, tables


def test_corrupt_blocks_in_every_format_are_data_loss_and_the_rest_serves(corrupt, sidecars):
    d, tables = corrupt
    sc = sidecars(d, "200KiB")  # cache mode: every miss is read and verified from disk
    with Client(sc.socket, timeout=10) as c:
        for name, (tv, expected, bad_rows, bad_blocks) in tables.items():
            assert not c.table_info(name)["full_resident"]
            for r in bad_rows:
                blk = r // tv.block_rows
                pat = f"table '{name}' version {tv.number}: checksum mismatch in block {blk}"
                with pytest.raises(errors.DataLoss, match=pat):
                    c.lookup(name, [r])
                with pytest.raises(errors.DataLoss, match=pat):
                    c.lookup(name, [r], inline=True)
                # a step mixing good and bad rows gets no rows at all, not a partial answer
                with pytest.raises(errors.DataLoss):
                    c.plan(name, [0 if r else 1, r, ROWS // 3]).slots()
            # every row of every intact block, in steps that fit the arena
            in_bad = np.isin(np.arange(ROWS) // tv.block_rows, bad_blocks)
            good = np.flatnonzero(~in_bad)
            cap = c.tables()[0]["arena_slots"]
            for a in range(0, good.size, max(1, cap // 2)):
                ids = good[a:a + cap // 2]
                assert np.array_equal(c.lookup(name, ids), expected[ids]), (name, a)
        # failed steps pinned nothing. The last releases are asynchronous, and so are the
        # promotions the learner makes of the last notes (a fill pins its slots while it
        # reads): on a loaded host a nice-5 learner with a backlog of notes, each promoting
        # a whole arena, holds pins for seconds after the last step; a leak holds them for ever
        pinned = lambda: {t["table"]: int(t["leased_slots"]) for t in c.stats()["tables"] if int(t["leased_slots"])}
        deadline = time.monotonic() + 60
        while pinned() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = pinned()
        keys = ("table", "leases_active", "promotions", "local_steps", "notes_dropped")
        held = [{k: t[k] for k in keys} for t in c.stats()["tables"] if t["table"] in left]
        assert not left, f"slots still pinned 60 s after the last step: {left}; {held}\nsidecar log:\n{sc.log()}"


def test_full_mode_refuses_to_start_on_a_corrupt_block(corrupt, sidecars):
    d, tables = corrupt
    sc = sidecars(d, "64MiB", wait=False)
    with pytest.raises(RuntimeError, match="exited with code") as e:
        sc.start()
    assert "checksum mismatch in block" in str(e.value) and "version 1" in str(e.value)
    assert sc.proc.returncode != 0 and not sc.arena_files()


KILL_INGEST = """
import sys, numpy as np
from tierstore.ingest.writer import write_version
data, seed, rows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def chunks():
    for i in range(0, rows, 8192):
        yield np.full((min(8192, rows - i), 256), (seed * 31 + i // 8192) % 251, dtype=np.uint8)
write_version(data, "t", chunks(), rows=rows, row_format="fp32", row_dim=64, source=f"seed={seed} rows={rows}")
print("COMMITTED", flush=True)
"""


def _expected(seed, rows):
    return np.repeat(((seed * 31 + np.arange(-(-rows // 8192))) % 251).astype(np.uint8), 8192)[:rows]


def _check_catalog(d, allowed):
    with Catalog(d, readonly=True) as cat:
        tv = cat.current("t")
        assert tv.number in allowed, (tv.number, allowed)
        seed, rows = (int(kv.split("=")[1]) for kv in tv.source.split())
        with SegmentReader(d, tv, cat.checksums("t", tv.number)) as r:
            assert r.verify() == []
            got = r.read_range(0, tv.rows)
    assert tv.rows == rows and np.array_equal(got[:, 0], _expected(seed, rows)) and (got == got[:, :1]).all()
    return tv.number


def _torn_ingest_trials(tmp_path, trials):
    d = tmp_path / "data"
    rng = random.Random(1234)
    subprocess.run([sys.executable, "-c", KILL_INGEST, str(d), "0", "5000"], check=True, cwd=tmp_path)
    outcomes = {"old": 0, "new": 0}
    current = 1
    for trial in range(1, trials + 1):
        rows = rng.randrange(40_000, 120_000)  # 10-30 MB
        p = subprocess.Popen([sys.executable, "-c", KILL_INGEST, str(d), str(trial), str(rows)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
        try:
            time.sleep(rng.uniform(0.05, 1.2))  # from before the catalog opens to after the commit
            p.send_signal(signal.SIGKILL)
            p.communicate(timeout=30)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        v = _check_catalog(d, {current, current + 1})
        outcomes["new" if v == current + 1 else "old"] += 1
        current = v
        with Catalog(d):  # the next writer removes what the killed one left
            pass
        assert list((d / "tmp").iterdir()) == []
        assert sorted(int(x.name[1:]) for x in (d / "tables" / "t").iterdir()) == list(range(1, current + 1))
    return outcomes


def test_killed_ingest_never_tears_the_catalog_short(tmp_path):
    outcomes = _torn_ingest_trials(tmp_path, 3)
    assert sum(outcomes.values()) == 3


@pytest.mark.reliability
def test_killed_ingest_never_tears_the_catalog_20_trials(tmp_path):
    outcomes = _torn_ingest_trials(tmp_path, 24)
    print(f"kill -9 mid-ingest: {outcomes}")
    assert sum(outcomes.values()) == 24 and outcomes["old"] > 0
