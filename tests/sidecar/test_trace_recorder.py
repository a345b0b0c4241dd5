"""TraceRecorder: what it writes replays in `bench cache --trace`; bounded; sampled by id."""
import json

import numpy as np
import pytest

from tierstore.bench.traces import access_trace
from tierstore.errors import InvalidArgument
from tierstore.sidecar.trace_recorder import TraceRecorder


def test_recorded_calls_replay_as_steps(tmp_path):
    rec = TraceRecorder(tmp_path / "trace.npy")
    calls = [np.array([5, 3, 9]), np.array([3, 7]), np.array([1, 2, 3, 4])]
    for c in calls:
        rec.record("l1", c, n_ids=100)
    rec.record("l/2", np.array([0]))
    paths = rec.close()
    assert sorted(p.name for p in paths) == ["trace.l1.npy", "trace.l_2.npy"]
    t = access_trace(tmp_path / "trace.l1.npy")
    assert t.n_ids == 100 and t.steps == 3
    assert [t.step(i).tolist() for i in range(3)] == [c.tolist() for c in calls]
    assert json.loads((tmp_path / "trace.l1.json").read_text())["recorded"] == 9


def test_memory_is_bounded_and_drops_are_counted(tmp_path):
    rec = TraceRecorder(tmp_path / "t.npy", max_ids=10)
    for _ in range(5):
        rec.record("l1", np.arange(4))
    assert rec.stats()["l1"] == {"recorded": 8, "dropped": 12}
    rec.flush()
    rec.record("l1", np.arange(2))  # flushes keep what came before
    rec.close()
    assert np.load(tmp_path / "t.l1.npy").size == 10
    assert np.load(tmp_path / "t.l1.steps.npy").tolist() == [4, 4, 2]


def test_sampling_keeps_every_access_of_a_kept_id(tmp_path):
    rec = TraceRecorder(tmp_path / "t.npy", sample=0.25)
    ids = np.arange(40_000)
    rec.record("l1", ids)
    rec.record("l1", ids[::-1])
    rec.close()
    kept = np.load(tmp_path / "t.l1.npy")
    first, second = kept[: kept.size // 2], kept[kept.size // 2:]
    assert abs(first.size / ids.size - 0.25) < 0.02
    assert np.array_equal(np.sort(first), np.sort(second))  # the same ids both times
    assert access_trace(tmp_path / "t.l1.npy").meta["sample"] == 0.25


@pytest.mark.parametrize("kw", [{"max_ids": 0}, {"sample": 0.0}, {"sample": 1.5}, {"flush_s": -1}])
def test_bad_settings_are_refused(tmp_path, kw):
    with pytest.raises(InvalidArgument):
        TraceRecorder(tmp_path / "t.npy", **kw)


def test_bad_path_and_ids_are_refused(tmp_path):
    with pytest.raises(InvalidArgument, match=".npy"):
        TraceRecorder(tmp_path / "t.log")
    with pytest.raises(InvalidArgument, match="does not exist"):
        TraceRecorder(tmp_path / "nope" / "t.npy")
    rec = TraceRecorder(tmp_path / "t.npy")
    with pytest.raises(InvalidArgument, match="integers"):
        rec.record("l1", np.array([0.5]))
    assert rec.stats() == {}
