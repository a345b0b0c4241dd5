"""TraceRecorder: what it writes replays in `bench cache --trace`; bounded; sampled by id."""
import json
import os

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


_NAMES = ["trace.l1.npy", "trace.l1.steps.npy", "trace.l1.json",
          "trace.l1.npy.tmp", "trace.l1.steps.npy.tmp", "trace.l1.json.tmp"]


def test_links_planted_at_the_trace_names_are_replaced_never_written_through(tmp_path):
    """A trace holds every row id served: it is created 0600 under a fresh name and renamed
    into place, so a link planted at any of its names has its target left alone."""
    import os
    import stat

    d, outside = tmp_path / "traces", tmp_path / "outside"
    d.mkdir(mode=0o700)
    outside.mkdir()
    for name in _NAMES:
        (outside / name).write_bytes(b"precious")
        (d / name).symlink_to(outside / name)
    rec = TraceRecorder(d / "trace.npy")
    rec.record("l1", np.array([4, 2]), n_ids=10)
    rec.flush()
    rec.record("l1", np.array([7]))
    rec.close()
    assert all((outside / n).read_bytes() == b"precious" for n in _NAMES)
    for name in _NAMES[:3]:
        st = os.lstat(d / name)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, (name, oct(st.st_mode))
    t = access_trace(d / "trace.l1.npy")
    assert [t.step(i).tolist() for i in range(t.steps)] == [[4, 2], [7]]
    assert sorted(p.name for p in d.iterdir() if not p.is_symlink()) == sorted(_NAMES[:3])  # no temporary left


def test_a_directory_others_could_write_to_or_a_link_is_refused(tmp_path):
    import os

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(InvalidArgument, match="writable by group or others.*chmod"):
        TraceRecorder(shared / "t.npy")
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(InvalidArgument, match="symlink"):
        TraceRecorder(tmp_path / "link" / "t.npy")
    rec = TraceRecorder(real / "t.npy")
    rec.record("l1", np.array([1]))
    os.chmod(real, 0o770)  # checked again when the files are written
    with pytest.raises(InvalidArgument, match="writable by group or others"):
        rec.flush()
    assert list(real.iterdir()) == []


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="giving a directory away needs root")
def test_a_directory_of_another_user_is_refused(tmp_path):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    with pytest.raises(InvalidArgument, match="owned by uid 65534"):
        TraceRecorder(d / "t.npy")


def test_serve_record_trace_replaces_planted_links(tmp_path):
    """End to end: a cache-mode sidecar's trace lands 0600 in place of the links, their targets untouched."""
    import stat

    from tierstore.client.client import Client
    from tierstore.ingest.writer import write_version
    from tierstore.sidecar.launcher import SidecarProcess

    rows = np.zeros((100_000, 256), np.uint8)  # 25 MB under an 8 MiB arena: cache mode, where Plans are recorded
    write_version(tmp_path / "data", "t", [rows], rows=rows.shape[0], row_format="fp32", row_dim=64)
    d = tmp_path / "traces"
    d.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    for name in ("trace.t.npy", "trace.t.steps.npy", "trace.t.json"):
        (d / name).symlink_to(victim)
    args = ["--record-trace", d / "trace.npy", "--no-local-reads"]
    with SidecarProcess(tmp_path / "data", dram_budget="8MiB", extra_args=args) as sc, Client(sc.socket) as c:
        c.plan("t", np.arange(20, 30))
    assert victim.read_bytes() == b"precious"
    assert stat.S_IMODE(os.lstat(d / "trace.t.npy").st_mode) == 0o600
    assert sorted(access_trace(d / "trace.t.npy").step(0).tolist()) == list(range(20, 30))
