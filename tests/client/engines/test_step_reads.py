"""step_reads.read_step(outs): a staged layer's rows read into its RowScratch, reused step after
step, against a real sidecar; layers sharing a table still get their own rows."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tierstore.client.client import Client
from tierstore.client.engines import StagingError
from tierstore.client.engines.step_reads import read_layers, read_step
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


def test_read_layers_names_the_layer_whose_read_failed_and_refuses_another_version(tmp_path):
    """step_reads.read_layers, both engines' read: a bad id stops the step with StagingError
    naming only the layer whose read raised; a layer built on another version than the one
    served is refused, nothing returned."""
    data = _tables_a_and_b(tmp_path / "data", seed=2)
    said = dict(failed=lambda which, e: f"layers {[t.table for t in which]}: {type(e).__name__}",
                moved=lambda t, v: f"{t.table} now v{v}, built on v{t.version}")
    with SidecarProcess(tmp_path / "data", dram_budget="512KiB") as sc, Client(sc.socket) as c:
        a, b = _layers(c, ("a", "b"))
        got = read_layers([a, b], [np.arange(10), np.arange(5)], None, **said)
        assert np.array_equal(got[0], data[:10]) and np.array_equal(got[1], data[:5])
        with pytest.raises(StagingError, match=r"layers \['b'\]: IdOutOfRange"):
            read_layers([a, b], [np.arange(10), np.array([ROWS + 7])], None, **said)
        stale = SimpleNamespace(client=c, table="a", version=a.version + 1)
        with pytest.raises(StagingError, match=f"a now v{a.version}, built on v{a.version + 1}"):
            read_layers([stale], [np.arange(3)], None, **said)


def test_read_layers_stops_at_a_damaged_segment_and_serves_no_row_of_it(tmp_path):
    """A table's segment file cut short under a running sidecar (a disk that lost its tail):
    the step whose misses fall past the cut stops with StagingError naming that layer only,
    never with rows of another place; the other layer's rows, and the damaged table's rows
    before the cut, still read right."""
    data = _tables_a_and_b(tmp_path / "data", seed=3)
    said = dict(failed=lambda which, e: f"layers {[t.table for t in which]}: {e}",
                moved=lambda t, v: f"{t.table} now v{v}")
    with SidecarProcess(tmp_path / "data", dram_budget="64KiB") as sc, Client(sc.socket) as c:
        a, b = _layers(c, ("a", "b"))
        seg_b = sorted((tmp_path / "data" / "tables" / "b").rglob("seg-*.bin"))
        assert len(seg_b) == 1, seg_b
        with open(seg_b[0], "r+b") as f:
            f.truncate(seg_b[0].stat().st_size // 2)
        tail = np.arange(ROWS - 50, ROWS)
        with pytest.raises(StagingError, match=r"layers \['b'\]: .*seg-00000.bin is truncated"):
            read_layers([a, b], [tail, tail], None, **said)
        got = read_layers([a, b], [tail, np.arange(40)], None, **said)
        assert np.array_equal(got[0], data[tail]) and np.array_equal(got[1], data[:40])


def _tables_a_and_b(data_dir, seed: int) -> np.ndarray:
    """Tables a and b of the same random rows, returned."""
    data = np.random.default_rng(seed).integers(0, 256, size=(ROWS, WIDTH), dtype=np.uint8)
    for t in ("a", "b"):
        write_version(data_dir, t, [data], rows=ROWS, row_format="fp32", row_dim=WIDTH // 4)
    return data


def _layers(c: Client, tables) -> list:
    """A staged layer on each table, as an engine's stager holds one: checked against the version served now."""
    return [SimpleNamespace(client=c, table=t, version=c.handle(t).version) for t in tables]


def test_a_stagers_thread_and_the_schedulers_share_one_client(tmp_path):
    """A later layer read on the stager's thread (read_layers) while the scheduler's thread uses the
    same Client (prefetch hints, another table's lookups, slot-index probes), against a real sidecar
    whose cache is a fraction of the rows (hits, misses and promotions under both): every row either
    thread reads is exact, neither raises, and the sidecar serves both afterwards."""
    import threading

    from tierstore.client.engines.slot_probe import SlotProbe

    data = _tables_a_and_b(tmp_path / "data", 9)
    with SidecarProcess(tmp_path / "data", dram_budget="256KiB") as sc, Client(sc.socket) as c:
        layers, probe = _layers(c, ["a"]), SlotProbe(c, "b")
        said = dict(failed=lambda which, e: f"failed {e}", moved=lambda t, v: f"moved {v}")
        errors, bad, stop = [], [], threading.Event()

        def stager():
            rng, scratch = np.random.default_rng(1), RowScratch(WIDTH)
            while not stop.is_set():
                ids = rng.integers(0, ROWS, 300)
                got = read_layers(layers, [ids], [scratch.take(ids.size)], **said)[0]
                if not np.array_equal(got, data[ids]):
                    bad.append("a")

        def scheduler():
            rng = np.random.default_rng(2)
            while not stop.is_set():
                ids = rng.integers(0, ROWS, 300)
                c.prefetch("a", rng.integers(0, ROWS, 64), read=True, steps=4)
                if not np.array_equal(c.lookup("b", ids), data[ids]):
                    bad.append("b")
                assert 0 <= probe.misses(ids) <= ids.size

        _race([stager, scheduler], stop, errors)
        assert not errors and not bad, (errors, bad[:3])
        ids = np.arange(0, ROWS, 3)
        assert np.array_equal(c.lookup_many({"a": ids, "b": ids})["a"], data[ids])
        local = c.handle("a").local_reads
        assert local.rows_cold > 0 and local.rows_resident > 0  # both paths ran under the race


def test_the_forwards_thread_and_the_stagers_thread_read_the_same_rows_through_one_client(tmp_path):
    """Layer behind: the forward's thread reads a batch's first layer while the stager's host
    thread reads the later one, both through one Client and over the same ids of the same two
    tables (the same misses asked by both at once: one read of each, single-flight), against a
    real sidecar whose cache holds a fraction of the rows: every row either thread gets is the
    table's, into buffers each thread reuses, and neither raises."""
    import threading

    data = _tables_a_and_b(tmp_path / "data", 11)
    with SidecarProcess(tmp_path / "data", dram_budget="256KiB") as sc, Client(sc.socket) as c:
        layers = _layers(c, ["a", "b"])
        said = dict(failed=lambda which, e: f"failed {e}", moved=lambda t, v: f"moved {v}")
        errors, bad, stop, reads = [], [], threading.Event(), {}
        steps = [np.random.default_rng([5, i]).integers(0, ROWS, 400) for i in range(64)]  # the batches, in turn

        def thread(first: int, name: str):
            def read():
                scratch, done = [RowScratch(WIDTH), RowScratch(WIDTH)], 0
                while not stop.is_set():
                    ids = steps[done % len(steps)]
                    order = layers if first == 0 else layers[::-1]  # each thread's first layer is the other's last
                    got = read_layers(order, [ids, ids[::-1]], [s.take(ids.size) for s in scratch], **said)
                    if not (np.array_equal(got[0], data[ids]) and np.array_equal(got[1], data[ids[::-1]])):
                        bad.append((name, done))
                    done += 1
                    reads[name] = done
            return read

        _race([thread(0, "forward"), thread(1, "stager")], stop, errors, seconds=2.0)
        assert not errors and not bad, (errors, bad[:3])
        assert min(reads.get("forward", 0), reads.get("stager", 0)) >= 3, reads  # both threads read steps
        local = c.handle("a").local_reads
        assert local.rows_cold > 0 and local.rows_resident > 0  # misses and hits both, under the race


def _race(fns, stop, errors, seconds: float = 3.0) -> None:
    """Run each of `fns` on a thread of its own for `seconds` (or until one raises: its error into
    `errors`), then stop and join them."""
    import threading

    def run(f):
        try:
            f()
        except BaseException as e:  # noqa: BLE001 - the test reports it
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=run, args=(f,)) for f in fns]
    for t in threads:
        t.start()
    stop.wait(seconds)
    stop.set()
    for t in threads:
        t.join(30)


def test_a_later_layer_is_read_behind_only_with_misses_to_read(tmp_path):
    """read_now: the first layer always before the forward; a later one too when its slot-index
    probe finds all its ids resident ("misses", the stagers' default), behind when some are not;
    "always" and "never" as named; another name refused."""
    import time

    from tierstore.client.engines.slot_probe import SlotProbe
    from tierstore.client.engines.step_reads import check_behind, read_now

    _tables_a_and_b(tmp_path / "data", 4)
    with SidecarProcess(tmp_path / "data", dram_budget="512KiB") as sc, Client(sc.socket) as c:
        layers = [SimpleNamespace(probe=SlotProbe(c, t)) for t in ("a", "b", "b")]
        warm, cold = np.arange(100), np.arange(4000, 4100)
        deadline = time.monotonic() + 20
        while layers[1].probe.misses(warm) and time.monotonic() < deadline:  # the sidecar promotes what was read
            c.lookup("b", warm)
            c.flush()
            time.sleep(0.05)
        assert layers[1].probe.misses(warm) == 0 and layers[1].probe.misses(cold) == cold.size
        assert read_now("misses", layers, [cold, warm, cold]) == [0, 1]
        assert read_now("always", layers, [cold, warm, cold]) == [0]
        assert read_now("never", layers, [cold, warm, cold]) == [0, 1, 2]
        with pytest.raises(ValueError, match="one of misses, always, never"):
            check_behind("sometimes")
