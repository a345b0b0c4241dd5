"""Local reads (client/local_reads.py): Client.lookup of a cache-mode table served in
the client, against a real sidecar process: resident rows from the shared arena,
validated by the slot index's sequence locks; misses from the segment files;
the steps told to the sidecar afterwards."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tierstore import errors
from tierstore.client.step_channel import StepChannel
from tierstore.client.client import Client
from tierstore.proto.frames import NOTE, NoteItem, encode_note, send_frame, step_socket_path
from tierstore.ingest.writer import write_version
from tierstore.sidecar.launcher import SidecarProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from direct_sidecar import direct_sidecar  # noqa: E402

ROWS, WIDTH = 50_000, 64
# a client of another uid (nobody) sending one note that carries `records` for `ids`
_OTHER_UID_NOTE = """import os, sys
import numpy as np
from tierstore.client.step_channel import StepChannel
from tierstore.proto.frames import NoteItem
path, ids, records = sys.argv[1], np.load(sys.argv[2]), np.load(sys.argv[3])
os.setgid(65534)
os.setuid(65534)
fp = StepChannel(path).connect()
ok = fp.send_notes([NoteItem("t", ids, np.array([ids.size], dtype=np.int64), 0, ids, records)])
fp.close()
sys.exit(0 if ok else 2)
"""


def _write(d, seed: int = 0, table: str = "t", **kw) -> np.ndarray:
    """Rows that name their id (bytes 0..7) so a row served for another id is caught."""
    data = np.random.default_rng(seed).integers(0, 256, size=(ROWS, WIDTH), dtype=np.uint8)
    data[:, :8] = np.arange(ROWS, dtype="<u8").view(np.uint8).reshape(ROWS, 8)
    write_version(d, table, [data], rows=ROWS, row_format="fp32", row_dim=WIDTH // 4, **kw)
    return data


def _stats(c: Client, table: str = "t") -> dict:
    return {k: (int(v) if isinstance(v, str) and v.isdigit() else v)
            for k, v in next(t for t in c.stats()["tables"] if t["table"] == table).items()}


def _wait(c: Client, key: str, at_least: int, timeout: float = 30.0, table: str = "t") -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = _stats(c, table)
        if s[key] >= at_least or time.monotonic() > deadline:
            return s
        time.sleep(0.02)


@pytest.fixture
def served(tmp_path):
    d = tmp_path / "data"
    data = _write(d)
    with SidecarProcess(d, dram_budget="1MiB") as sc, Client(sc.socket) as c:
        yield sc, c, data


def test_lookup_reads_locally_and_the_sidecar_learns_the_steps(served):
    sc, c, data = served
    rng = np.random.default_rng(1)
    hot = rng.choice(ROWS, 300, replace=False)
    for _ in range(3):  # a row is promoted once the sidecar has learned the step that missed it
        ids = np.concatenate([hot, rng.integers(0, ROWS, 200)])
        assert np.array_equal(c.lookup("t", ids), data[ids])
        c.flush()
        _wait(c, "local_steps", 1)
    s = _wait(c, "local_steps", 3)
    assert s["local_steps"] == 3 and s["plans"] == 0, "lookups went through Plan instead of reading locally"
    assert s["leases_active"] == 0
    local = c.handle("t").local_reads
    assert local.rows_cold > 0, "no miss was read from the segment files"
    # the learner promotes after it counts the step: on a busy host the rows land a little later
    deadline = time.monotonic() + 10.0
    while True:
        before = local.rows_resident
        assert np.array_equal(c.lookup("t", hot), data[hot])
        if local.rows_resident - before == hot.size or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert local.rows_resident - before == hot.size, "rows the sidecar promoted were not read from the arena"
    # a planned step (what a kernel reading by slot needs) sees the same rows resident
    with c.plan("t", hot) as step:
        assert np.array_equal(step.rows(), data[hot]) and step.hits == hot.size


def test_local_reads_stay_exact_while_another_client_churns_the_arena(served):
    """Rows evicted and refilled while a local read copies them are never returned for the wrong id."""
    sc, c, data = served
    stop = threading.Event()
    errs: list = []

    def churn():
        rng = np.random.default_rng(7)
        try:
            with Client(sc.socket) as other:
                while not stop.is_set():
                    with other.plan("t", rng.integers(0, ROWS, 4000)) as step:
                        step.rows()
        except Exception as e:  # noqa: BLE001 - reported below
            errs.append(e)

    t = threading.Thread(target=churn)
    t.start()
    rng = np.random.default_rng(3)
    zipf = (rng.zipf(1.1, 400_000) - 1) % ROWS  # hot rows: resident, and evicted now and then
    try:
        deadline, steps = time.monotonic() + 3.0, 0
        while time.monotonic() < deadline:
            ids = zipf[(steps * 2000) % 398_000:][:2000]
            got = c.lookup("t", ids)
            bad = np.flatnonzero((got != data[ids]).any(axis=1))
            assert bad.size == 0, f"step {steps}: {bad.size} rows differ, first id {ids[bad[0]]}"
            steps += 1
    finally:
        stop.set()
        t.join(30)
    assert not errs, errs
    local = c.handle("t").local_reads
    assert steps > 10 and local.rows_resident > 0 and local.rows_cold > 0
    assert _stats(c)["evictions"] > 0


def test_a_corrupt_row_read_locally_is_data_loss_and_other_rows_still_read(tmp_path):
    d = tmp_path / "data"
    data = _write(d)
    seg = d / "tables" / "t" / "v1" / "seg-00000.bin"
    with SidecarProcess(d, dram_budget="1MiB") as sc, Client(sc.socket) as c:
        assert np.array_equal(c.lookup("t", [1, 2]), data[[1, 2]])
        with open(seg, "r+b") as f:  # row 40000, never read: flip one byte after the sidecar mapped it
            f.seek(40_000 * (WIDTH + 8) + 20)  # a record: the row, then its 8-byte sum
            b = f.read(1)
            f.seek(40_000 * (WIDTH + 8) + 20)
            f.write(bytes([b[0] ^ 0xFF]))
        with pytest.raises(errors.DataLoss, match="40000"):
            c.lookup("t", [5, 40_000])
        assert np.array_equal(c.lookup("t", [5, 6]), data[[5, 6]])


def test_a_version_swap_serves_the_new_rows(tmp_path):
    d = tmp_path / "data"
    old = _write(d, seed=0)
    with SidecarProcess(d, dram_budget="1MiB") as sc, Client(sc.socket) as c:
        ids = np.arange(0, ROWS, 97)
        assert np.array_equal(c.lookup("t", ids), old[ids])
        new = _write(d, seed=1)
        assert c.reload("t")
        assert np.array_equal(c.lookup("t", ids), new[ids]), "a lookup after the swap read the old version"


@pytest.mark.parametrize("flag", ["--no-local-reads", "--direct-io"])
def test_without_local_reads_or_with_direct_io_lookups_stay_exact(tmp_path, flag):
    d = tmp_path / "data"
    data = _write(d)
    sc = SidecarProcess(d, dram_budget="1MiB", extra_args=[flag])
    try:
        sc.start()
    except Exception as e:  # noqa: BLE001
        sc.cleanup()
        if flag == "--direct-io":
            pytest.skip(f"O_DIRECT refused where the test data lives: {e}")
        raise
    try:
        with Client(sc.socket) as c:
            rng = np.random.default_rng(2)
            for _ in range(5):
                ids = rng.integers(0, ROWS, 500)
                assert np.array_equal(c.lookup("t", ids), data[ids])
            s = _stats(c)
            if flag == "--no-local-reads":
                assert s["plans"] == 5 and s["local_steps"] == 0 and c.handle("t").local_reads is None
            else:  # misses too are read here, with O_DIRECT as the sidecar reads them: no plan
                local = c.handle("t").local_reads
                assert s["plans"] == 0 and local.rows_cold > 0 and local._cold.direct is not None
    finally:
        sc.cleanup()


def test_bad_access_notes_change_nothing_and_the_connection_serves_on(served):
    sc, c, data = served
    before = _stats(c)
    fp = StepChannel(step_socket_path(sc.socket)).connect()
    try:
        out_of_range = NoteItem("t", np.array([1, ROWS + 5], dtype=np.int64), np.array([2], dtype=np.int64))
        bad_ends = NoteItem("t", np.array([1, 2, 3], dtype=np.int64), np.array([2], dtype=np.int64))
        no_table = NoteItem("nope", np.array([1], dtype=np.int64), np.array([1], dtype=np.int64))
        for item in (out_of_range, bad_ends, no_table):
            assert fp.send_notes([item])
        assert fp.release([]) == 0  # a round trip after the notes: they have been handled
        after = _stats(c)
        assert (after["local_steps"], after["hits"], after["misses"]) == \
               (before["local_steps"], before["hits"], before["misses"])
        # a truncated frame ends that connection (the stream is out of step), not the sidecar
        parts, size = encode_note([NoteItem("t", np.array([1], dtype=np.int64), np.array([1], dtype=np.int64))])
        send_frame(fp._sock, NOTE, [b"".join(parts)[:-8]], size - 8)
        try:  # the sidecar answers with its error and hangs up; our next send may see either first
            fp.release([])
        except errors.InvalidArgument as e:
            assert "NOTE" in str(e)
        assert fp.release([]) == 0  # reconnected by itself
    finally:
        fp.close()
    assert np.array_equal(c.lookup("t", [3, 4]), data[[3, 4]])


def test_a_note_of_more_parts_than_one_send_takes_arrives_whole_and_is_learned(served):
    """A note is sent as a scatter list (its rows are not copied into one frame): 700 steps,
    each carrying the 16 KiB of its misses' rows, are ~1,400 views, past what one sendmsg
    takes (IOV_CAP), so the frame goes in several; every step is learned, its rows placed."""
    sc, c, data = served
    before = _stats(c)
    rng = np.random.default_rng(5)
    steps = [rng.choice(ROWS, 256, replace=False).astype(np.int64) for _ in range(700)]
    items = [NoteItem("t", ids, np.array([ids.size], dtype=np.int64), 0, ids, data[ids]) for ids in steps]
    with StepChannel(step_socket_path(sc.socket)).connect() as fp:
        assert fp.send_notes(items)
        assert fp.release([]) == 0  # a round trip after the note: it has been handled
    after = _wait(c, "local_steps", before["local_steps"] + len(steps))
    assert after["local_steps"] - before["local_steps"] == len(steps)
    assert after["hits"] + after["misses"] - before["hits"] - before["misses"] == 700 * 256
    assert after["notes_dropped"] == before["notes_dropped"]
    assert np.array_equal(c.lookup("t", steps[-1]), data[steps[-1]])


_BAD_NOTE = NoteItem("t", np.array([1, ROWS + 5], dtype=np.int64), np.array([2], dtype=np.int64))


def _send_bad_notes(fp: StepChannel) -> int:
    """Bad notes in a loop over `fp`; returns how many were sent, once the sidecar handled them all."""
    sent = 0
    for _ in range(5):
        sent += 4000 if fp.send_notes([_BAD_NOTE] * 4000) else 0  # a frame the socket had no room for is not sent
    assert fp.release([]) == 0 and sent  # a round trip after the notes: they have been handled
    return sent


def _note_lines(sc) -> list[str]:
    return [ln for ln in sc.log_path.read_text().splitlines() if "access note" in ln]


def test_refused_access_notes_are_counted_and_logged_once(tmp_path, free_port):
    """A client sending bad notes in a loop: each one counts in Stats and Prometheus, and
    the log gets one line a table, not one a note."""
    import urllib.request

    from tierstore.sidecar.served_steps import NOTE_LOG_INTERVAL_S

    d = tmp_path / "data"
    _write(d)
    port = free_port()
    with SidecarProcess(d, dram_budget="1MiB", extra_args=["--metrics-port", port]) as sc, Client(sc.socket) as c, \
            StepChannel(step_socket_path(sc.socket)).connect() as fp:
        t0 = time.monotonic()
        sent = _send_bad_notes(fp)
        lines = _note_lines(sc)
        assert 1 <= len(lines) <= 1 + (time.monotonic() - t0) / NOTE_LOG_INTERVAL_S, lines[:3]
        s = _stats(c)
        assert s["notes_refused"] == sent and s["local_steps"] == 0
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert f'tierstore_access_notes_refused_total{{table="t"}} {float(sent)}' in text


@pytest.mark.slow  # waits out NOTE_LOG_INTERVAL_S
def test_refused_access_notes_are_logged_again_after_the_interval_with_their_count(tmp_path):
    from tierstore.sidecar.served_steps import NOTE_LOG_INTERVAL_S

    d = tmp_path / "data"
    _write(d)
    with SidecarProcess(d, dram_budget="1MiB") as sc, StepChannel(step_socket_path(sc.socket)).connect() as fp:
        sent = _send_bad_notes(fp)
        time.sleep(NOTE_LOG_INTERVAL_S)
        assert fp.send_notes([_BAD_NOTE]) and fp.release([]) == 0
        lines = _note_lines(sc)
        assert len(lines) == 2 and f"{sent} refused" in lines[1], lines  # the ones since, this one included


def test_the_slot_index_goes_with_the_sidecar(tmp_path):
    d = tmp_path / "data"
    _write(d)
    shm = tmp_path / "shm"
    shm.mkdir()
    with SidecarProcess(d, dram_budget="1MiB", env={"TIERSTORE_SHM_DIR": str(shm)}) as sc, Client(sc.socket) as c:
        path = c.handle("t").index_path
        assert path.startswith(str(shm)) and path.endswith(".index")
        assert (shm / path.rsplit("/", 1)[1]).exists()
    assert not list(shm.iterdir()), "the sidecar left files in its shm dir"


def test_rows_read_locally_are_sampled_for_online_verification(tmp_path, free_port, metric):
    d = tmp_path / "data"
    data = _write(d)
    port = free_port()
    extra = ["--verify-sample", "1.0", "--metrics-port", port]
    with SidecarProcess(d, dram_budget="1MiB", extra_args=extra) as sc, Client(sc.socket) as c:
        hot = np.arange(100, 400)
        for _ in range(4):  # promoted once the sidecar learns the step; then read from the arena
            assert np.array_equal(c.lookup("t", hot), data[hot])
            c.flush()
            time.sleep(0.1)
        assert _stats(c)["plans"] == 0
        deadline = time.monotonic() + 10
        while metric(port, "tierstore_verified_rows", "dram") == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric(port, "tierstore_verified_rows", "dram") > 0


def test_misses_are_planned_when_the_segment_files_are_out_of_reach(served, tmp_path):
    sc, c, data = served
    h = c.handle("t")
    h.cold_dir = str(tmp_path / "not-a-data-dir")  # as if this process could not open them
    ids = np.arange(1000, 1300)
    assert np.array_equal(c.lookup("t", ids), data[ids])
    assert h.cold_dir == "" and _stats(c)["plans"] == 1  # planned once, and from now on
    assert np.array_equal(c.lookup("t", ids + 1), data[ids + 1])


def test_local_reads_fill_the_arena_as_rows_arrive_and_beat_lru(tmp_path):
    """A client on the host's misses must fill the arena, or local reads would leave it cold: every
    miss a client on the host reads goes into a free slot at first sight, from the bytes the client
    read (the sidecar reads nothing from disk), so the arena is as full as the distinct rows
    asked allow after every step; once it is full the doorkeeper guards evictions, and the hit
    ratio the client sees is at least LRU's on the same steps at the same capacity."""
    d = tmp_path / "data"
    data = _write(d)
    # no online verification: its re-reads would count in the disk bytes this test checks
    with SidecarProcess(d, dram_budget="512KiB", extra_args=["--verify-sample", "0"]) as sc, \
            Client(sc.socket) as c:
        _fill_and_compare(c, data)


def _settled(c: Client, steps: int, timeout: float = 10.0) -> dict:
    """Stats once the sidecar has learned `steps` noted steps and its promotions stopped."""
    s, deadline = _wait(c, "local_steps", steps, timeout), time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = _stats(c)
        if now["promotions"] == s["promotions"]:
            return now
        s = now
    return s


def _fill_and_compare(c: Client, data: np.ndarray) -> None:
    from tierstore.bench.cache import replay_steps
    from tierstore.bench.workload import make_batches
    from tierstore.cache.policy import PolicyConfig

    cap = int(c.tables()[0]["arena_slots"])
    steps = make_batches("zipf0.9", ROWS, 1500, 40, seed=4)
    seen = np.zeros(ROWS, dtype=bool)
    local = None
    for k, ids in enumerate(steps):
        assert np.array_equal(c.lookup("t", ids), data[ids])
        local = c.handle("t").local_reads
        c.flush()
        seen[ids] = True
        want = min(int(seen.sum()), cap)
        # once the sidecar has learned the step: in step with it, as a step that waits on its forward
        # is (a full arena's resident count says nothing of that; on a loaded host the learner then
        # lags steps behind, evicts rows the next steps hit and reads them again to promote them)
        _wait(c, "local_steps", k + 1)
        s = _wait(c, "resident", int(np.ceil(0.95 * want)))
        assert s["resident"] >= 0.95 * want, f"step {k}: {s['resident']} rows resident of {want} distinct asked"
        if k == 9:
            asked, cold = local.distinct_asked, local.distinct_cold
    assert seen.sum() > 1.5 * cap and s["resident"] == cap  # well past capacity: full, and evicting
    s = _settled(c, len(steps))
    # promoted from the bytes the client sent, bar a few rows the client found resident but the
    # sidecar evicted (promoting the step before) by the time it learned the step: those it reads
    assert s["promotions"] > cap and s["note_rows_refused"] == 0
    assert s["note_rows_placed"] >= 0.98 * s["promotions"], "the sidecar read rows its clients had sent"
    assert s["bytes_read"] <= (s["promotions"] - s["note_rows_placed"]) * (WIDTH + 8)  # 8: the record's row sum
    hit = 1 - (local.distinct_cold - cold) / (local.distinct_asked - asked)
    lru = replay_steps(steps, ROWS, cap, PolicyConfig(kind="lru"), count_from=10)
    assert hit >= lru, f"hit ratio {hit:.3f} below LRU's {lru:.3f} on the same steps"


def _segments(d, table: str = "t") -> list:
    from tierstore.store.catalog import Catalog

    with Catalog(d, readonly=True) as cat:
        return [d / rel for rel in cat.current(table).segments]


def _carried(d, table: str, version: int, rows: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The records (row, padding, row sum) a client reading `table` at `version` carries
    for `rows` stored as `ids` (SegmentReader.carried_records): genuine ones."""
    from tierstore.store.catalog import Catalog
    from tierstore.tiers.nvme.reader import SegmentReader

    with Catalog(d, readonly=True) as cat:
        tv, sums = cat.get(table, version), cat.checksums(table, version)
    with SegmentReader(d, tv, sums) as r:
        return r.carried_records(ids, rows)


def test_with_direct_io_the_arena_fills_from_the_clients_records_and_the_next_steps_hit(tmp_path):
    """The arena fills from local reads under --direct-io too: the misses a client on the host read
    are promoted as the steps arrive (the arena holds every distinct row asked while it has
    room) from the records the client's note carries (each row with its sum: the client's peer
    uid is the sidecar's), not read from disk a second time, and never by faulting the segment
    files' pages in one at a time through their maps: the files stay out of the page cache, as
    --direct-io promises. The next steps over the same rows hit, bit-exact."""
    from tierstore.bench.memory import drop_page_cache, resident_bytes

    d = tmp_path / "data"
    data = _write(d)
    segs = _segments(d)
    drop_page_cache(segs)
    sc = direct_sidecar(d, extra=["--verify-sample", "0", "--no-warm-start"])
    try:
        with Client(sc.socket) as c:
            cap = int(c.tables()[0]["arena_slots"])
            ids = np.random.default_rng(5).permutation(ROWS)[:int(0.6 * cap)]
            steps = np.array_split(ids, 6)
            for step in steps:
                assert np.array_equal(c.lookup("t", step), data[step])
                c.flush()
            local = c.handle("t").local_reads
            assert local._cold.direct is not None and local.rows_cold == ids.size
            s = _settled(c, len(steps))
            assert s["local_steps"] == len(steps) and s["notes_dropped"] == 0
            assert s["resident"] >= 0.98 * ids.size, f"{s['resident']} rows resident of {ids.size} asked"
            # placed from the client's records, not read again; no page of the segments cached
            assert s["note_rows_placed"] >= 0.98 * s["promotions"] and s["note_rows_refused"] == 0, s
            assert s["bytes_read"] <= (s["promotions"] - s["note_rows_placed"]) * (WIDTH + 8), s
            cached = resident_bytes(segs)
            assert cached <= 0.01 * sum(p.stat().st_size for p in segs), f"{cached} B of segments in the page cache"
            for step in steps:  # the next steps hit
                assert np.array_equal(c.lookup("t", step), data[step])
            assert local.rows_cold - ids.size <= 0.02 * ids.size, "rows promoted were read from disk again"
    finally:
        sc.cleanup()


def test_with_direct_io_a_format_1_table_still_places_the_rows_a_client_read(tmp_path):
    """Format 1 holds its row sums: checking a client's rows costs no disk read even under
    --direct-io, so the sidecar places them instead of reading them again."""
    d = tmp_path / "data"
    data = _write(d, segment_format=1)
    sc = direct_sidecar(d, extra=["--verify-sample", "0", "--no-warm-start"])
    try:
        with Client(sc.socket) as c:
            cap = int(c.tables()[0]["arena_slots"])
            ids = np.random.default_rng(6).permutation(ROWS)[:int(0.5 * cap)]
            for step in np.array_split(ids, 4):
                assert np.array_equal(c.lookup("t", step), data[step])
                c.flush()
            s = _settled(c, 4)
            assert s["note_rows_placed"] >= 0.9 * ids.size and s["note_rows_refused"] == 0, s
            assert s["resident"] >= 0.98 * ids.size
            assert np.array_equal(c.lookup("t", ids), data[ids])
    finally:
        sc.cleanup()


@pytest.fixture(params=["page-cache", "direct-io"])
def served_either(request, tmp_path):
    d = tmp_path / "data"
    data = _write(d)
    if request.param == "direct-io":
        sc = direct_sidecar(d)
    else:
        sc = SidecarProcess(d, dram_budget="1MiB").start()
    try:
        with Client(sc.socket) as c:
            yield sc, c, data, request.param
    finally:
        sc.cleanup()


def test_a_note_whose_rows_fail_their_row_sums_is_read_from_disk(served_either):
    """The sidecar never places a row that fails its sum: an access note carrying a
    corrupted record (the row and its sum) gets that note's rows read from disk
    (counted), and every client then reads the rows as stored."""
    sc, c, data, mode = served_either
    ids = np.arange(30_000, 30_064, dtype=np.int64)
    rows = _carried(sc.data_dir, "t", 1, data[ids], ids)
    rows[10, 40] ^= 0x01  # one flipped bit
    fp = StepChannel(step_socket_path(sc.socket)).connect()
    try:
        assert fp.send_notes([NoteItem("t", ids, np.array([ids.size], dtype=np.int64), 0, ids, rows)])
        s = _wait(c, "local_steps", 1)
    finally:
        fp.close()
    s = _wait(c, "promotions", ids.size)
    assert s["note_rows_refused"] == ids.size and s["note_rows_placed"] == 0 and s["bytes_read"] > 0
    local_before = c.lookup("t", [1])  # opens the local reader
    assert np.array_equal(local_before, data[[1]])
    got = c.lookup("t", ids)
    assert np.array_equal(got, data[ids]) and c.handle("t").local_reads.rows_resident >= ids.size
    with c.plan("t", ids) as step:
        assert np.array_equal(step.rows(), data[ids]) and step.hits == ids.size


def test_with_direct_io_records_of_another_table_or_version_are_never_placed(tmp_path):
    """A client of the sidecar's own uid that mixes up layer names or holds a stale version
    sends genuine records (rows and sums as that table's reader carries them) of table u,
    or of table t v1, in a note labelled t v2 for the same ids. Each record's sum is keyed
    by its own version's salt, so none is placed: the note's rows are read from disk
    (counted as refused), and local reads, Plan and `tierstore verify` all see t v2's rows."""
    import subprocess

    d = tmp_path / "data"
    stale = _write(d, seed=1)  # t v1
    other = _write(d, seed=2, table="u")  # u v1: the same ids, other rows
    data = _write(d, seed=3)  # t v2, current
    sc = direct_sidecar(d, extra=["--verify-sample", "0", "--no-warm-start"])
    try:
        fp = StepChannel(step_socket_path(sc.socket)).connect()
        with Client(sc.socket) as c:
            sent = 0
            for lo, (table, version, rows) in zip((20_000, 30_000), (("u", 1, other), ("t", 1, stale))):
                ids = np.arange(lo, lo + 64, dtype=np.int64)
                mislabelled = _carried(d, table, version, rows[ids], ids)
                assert fp.send_notes([NoteItem("t", ids, np.array([ids.size], dtype=np.int64), 2, ids, mislabelled)])
                sent += ids.size
                s = _wait(c, "promotions", sent)
                assert s["promotions"] >= sent and s["note_rows_placed"] == 0, s
                assert s["note_rows_refused"] == sent, s
                assert np.array_equal(c.lookup("t", ids), data[ids]), "a local read served another table's rows"
                with c.plan("t", ids) as step:
                    assert np.array_equal(step.rows(), data[ids]) and step.hits == ids.size
                assert np.array_equal(c.lookup("u", ids), other[ids])
        fp.close()
    finally:
        sc.cleanup()
    verify = subprocess.run([sys.executable, "-m", "tierstore", "verify", "--data", str(d)], capture_output=True,
                            text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_with_direct_io_a_peer_of_another_uid_cannot_place_records(tmp_path):
    """Records carry their own sums, so the sidecar takes them only from a peer of its own
    uid (who can write the segments anyway: tierstore/tiers/trust.py). A client of another uid (the step socket
    widened by an operator) that sends forged records with consistent sums gets its misses
    read from disk: every client reads the rows as stored."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a client as another uid")
    d = tmp_path / "data"
    data = _write(d)
    sc = direct_sidecar(d, extra=["--verify-sample", "0", "--no-warm-start"])
    widened = []
    try:
        path = step_socket_path(sc.socket)
        os.chmod(path, 0o666)
        for parent in path.parents:  # the operator's widening: the socket reachable by others
            mode = parent.stat().st_mode
            if not mode & 0o001:
                widened.append((parent, mode))
                os.chmod(parent, mode | 0o001)
        ids = np.arange(20_000, 20_064, dtype=np.int64)
        forged = np.full((ids.size, WIDTH), 0xAB, dtype=np.uint8)
        forged[:, :8] = data[ids, :8]  # the id bytes kept: only the rest is forged
        frame_records = _carried(d, "t", 1, forged, ids)  # sums that match the forged bytes
        np.save(d / "note-ids.npy", ids)
        np.save(d / "note-records.npy", frame_records)
        # the other uid's client, a process of its own (a fork of this one runs gRPC's at-fork
        # handler, which can block the fork once an earlier test has made a channel)
        other = subprocess.run([sys.executable, "-c", _OTHER_UID_NOTE, str(path), str(d / "note-ids.npy"),
                                str(d / "note-records.npy")], capture_output=True, text=True, timeout=60)
        assert other.returncode == 0, f"the other uid's client could not send its note: {other.stderr}"
        with Client(sc.socket) as c:
            s = _wait(c, "promotions", ids.size)
            assert s["local_steps"] == 1 and s["promotions"] >= ids.size, s
            assert s["note_rows_placed"] == 0 and s["bytes_read"] >= ids.size * (WIDTH + 8), s
            with c.plan("t", ids) as step:
                assert np.array_equal(step.rows(), data[ids]) and step.hits == ids.size
    finally:
        for parent, mode in widened:
            os.chmod(parent, mode)
        sc.cleanup()


@pytest.mark.parametrize("flag", ["page-cache", "--direct-io"])
def test_lookup_many_reads_a_steps_tables_at_once_exactly_and_each_is_learned(tmp_path, flag, monkeypatch):
    """Client.lookup_many: a step's tables read overlapped under --direct-io (each begun in turn,
    its misses in flight on the calling thread's ring while the next is begun, then each ended),
    in turn through the page cache; each table's rows its own, bit-exact, each table's steps
    noted; a bad id in one table raises that table's error after the others' reads end, and the
    client reads on."""
    from tierstore.client.engines.step_reads import read_step

    d = tmp_path / "data"
    data = {t: _write(d, seed=k, table=t) for k, t in enumerate(("a", "b", "c"))}
    assert not np.array_equal(data["a"][:, 8:], data["b"][:, 8:])  # beyond their ids: a swap would show
    sc = direct_sidecar(d) if flag == "--direct-io" else SidecarProcess(d, dram_budget="1MiB").start()
    try:
        with Client(sc.socket) as c:
            rng = np.random.default_rng(3)
            for _ in range(6):
                step = {t: rng.integers(0, ROWS, 700) for t in ("c", "a", "b")}  # any order of tables
                got = c.lookup_many(step)
                assert list(got) == ["c", "a", "b"]
                for t, ids in step.items():
                    assert np.array_equal(got[t], data[t][ids]), f"table {t} served other rows"
            c.flush()
            for t in data:
                assert _wait(c, "local_steps", 6, table=t)["local_steps"] == 6
            assert 0 < c.miss_clock.seconds <= sum(c.handle(t).local_reads.cold_seconds for t in data) + 1e-6
            assert c.overlapped == (6 if flag == "--direct-io" else 0), "overlapped reads only under O_DIRECT"
            with pytest.raises(errors.IdOutOfRange) as bad:
                c.lookup_many({"a": np.arange(10), "b": np.array([ROWS])})
            assert bad.value.table == "b"  # the table whose read raised it (an engine names its layer)
            with pytest.raises(errors.TableNotFound) as bad:
                c.lookup_many({"nope": np.arange(3), "a": np.arange(3)})
            assert bad.value.table == "nope"
            # an engine's step (client/engines/step_reads.py): two layers on one table read as one ask
            asks = [(c, "a", rng.integers(0, ROWS, 300)), (c, "b", rng.integers(0, ROWS, 200)),
                    (c, "a", rng.integers(0, ROWS, 100))]
            for (_, t, ids), rows in zip(asks, read_step(asks)):
                assert np.array_equal(rows, data[t][ids])
            with pytest.raises(errors.InvalidArgument, match="table: ids"):
                c.lookup_many([("a", np.arange(3))])
            ids = rng.integers(0, ROWS, 50)
            assert np.array_equal(c.lookup_many({"a": ids, "b": ids})["b"], data["b"][ids])
    finally:
        sc.cleanup()



@pytest.mark.parametrize("flag", ["page-cache", "--direct-io"])
def test_the_next_steps_misses_read_ahead_serve_it_exactly_without_a_read_of_its_own(tmp_path, flag):
    """lookup(..., ahead=next ids) and lookup_many(..., ahead=): the next step's misses are read
    behind this step's (their batch in flight on the calling thread's ring across the calls),
    and the next call copies those rows instead of reading them: no device read of its own,
    every row bit-exact, each step noted with its misses as ever. A call from another thread
    reads its own misses, exactly; closing the client abandons a read ahead no step took,
    leaving nothing on the thread's ring."""
    from tierstore.tiers.nvme.direct_io import thread_ring

    d = tmp_path / "data"
    data = {t: _write(d, seed=k, table=t) for k, t in enumerate(("a", "b"))}
    sc = direct_sidecar(d) if flag == "--direct-io" else SidecarProcess(d, dram_budget="1MiB").start()
    try:
        with Client(sc.socket) as c:
            # steps share no id: none is resident when the next step's misses are read ahead
            steps = list(np.random.default_rng(9).permutation(ROWS)[:600 * 9].reshape(9, 600))
            for k, ids in enumerate(steps[:5]):
                reads = c.handle("a").local_reads
                device = reads.distinct_device if reads is not None else 0
                assert np.array_equal(c.lookup("a", ids, ahead=steps[k + 1]), data["a"][ids])
                if k:  # read ahead by the call before: none of its misses read now
                    assert c.handle("a").local_reads.distinct_device == device, f"step {k} read its misses again"
            # steps[5] was read ahead for "a"; another thread asks for it: read there, exactly
            got = {}
            other = threading.Thread(target=lambda: got.update(x=c.lookup("a", steps[5])))
            other.start()
            other.join()
            assert np.array_equal(got["x"], data["a"][steps[5]])
            got = c.lookup_many({"a": steps[6], "b": steps[7]}, ahead={"a": steps[7], "b": steps[8]})
            assert np.array_equal(got["a"], data["a"][steps[6]]) and np.array_equal(got["b"], data["b"][steps[7]])
            device = {t: c.handle(t).local_reads.distinct_device for t in ("a", "b")}
            got = c.lookup_many({"a": steps[7], "b": steps[8]})
            assert np.array_equal(got["a"], data["a"][steps[7]]) and np.array_equal(got["b"], data["b"][steps[8]])
            assert {t: c.handle(t).local_reads.distinct_device for t in ("a", "b")} == device, "read again"
            c.lookup("a", steps[0], ahead=steps[8])  # a read ahead no step takes
            ring = thread_ring()
            for k in range(5):  # lookups of another table finish it once landed: the ring's queue empties
                assert np.array_equal(c.lookup("b", steps[k]), data["b"][steps[k]])
                if ring is None or ring.queued == 0:
                    break
            assert ring is None or ring.queued == 0, "a read ahead held the ring's queue"
            c.lookup("a", steps[1], ahead=steps[2])  # one left for close
            c.flush()
            assert _wait(c, "local_steps", 10, table="a")["local_steps"] == 10  # each call noted once
        ring = thread_ring()
        assert ring is None or ring.queued == 0, "a read ahead left on the ring after close"
    finally:
        sc.cleanup()


def test_a_bad_ahead_is_refused_before_anything_is_read(served):
    """ahead ids out of range, not integers, or for a table the step does not read: the typed
    error, and nothing read or noted for the call (the ids asked for are not read either)."""
    sc, c, data = served
    ids = np.arange(0, ROWS, 97)
    c.lookup("t", ids[:10])
    reads = c.handle("t").local_reads
    before = (reads.steps, reads.distinct_device)
    for bad in ([ROWS], [-1], np.array([0.5])):
        with pytest.raises((errors.IdOutOfRange, errors.InvalidArgument)):
            c.lookup("t", ids, ahead=bad)
        with pytest.raises((errors.IdOutOfRange, errors.InvalidArgument)) as e:
            c.lookup_many({"t": ids}, ahead={"t": bad})
        assert e.value.table == "t"
    with pytest.raises(errors.InvalidArgument, match="names table"):
        c.lookup_many({"t": ids}, ahead={"u": ids})
    with pytest.raises(errors.InvalidArgument, match="ahead"):
        c.lookup_many({"t": ids}, ahead=[ids])
    assert (reads.steps, reads.distinct_device) == before
    assert np.array_equal(c.lookup("t", ids, ahead=ids[::-1]), data[ids])


def test_the_miss_clock_counts_overlapping_paths_once():
    """Client.miss_clock: two tables' miss paths at once count their overlap once."""
    from tierstore.client.local_reads import BusyClock

    clock, met, walls = BusyClock(), threading.Barrier(2), []

    def waits():
        t0 = time.perf_counter()
        with clock:
            met.wait()
            time.sleep(0.05)
        walls.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=waits) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 0.05 <= clock.seconds < sum(walls) - 0.04, (clock.seconds, walls)  # the 50 ms together, once
