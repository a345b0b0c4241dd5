"""The disk probe `bench large` and `bench cold` share: 512-B and 4 KiB O_DIRECT random reads
at queue depths 32, 64, 128 and 256, the best of them named, quick enough for --quick."""
import time

import numpy as np
import pytest

from tierstore.bench.cold import direct_io_refusal
from tierstore.bench.disk import DEPTHS, best_iops, burst_limit, disk_limit
from tierstore.errors import InvalidArgument


@pytest.fixture
def segments(tmp_path):
    rng = np.random.default_rng(3)
    paths = []
    for k in range(2):
        p = tmp_path / f"seg-{k}.bin"
        p.write_bytes(rng.integers(0, 256, (4 << 20) + 4096 * k, dtype=np.uint8).tobytes())
        paths.append(p)
    why = direct_io_refusal(paths)
    if why:
        pytest.skip(why)
    return paths


def test_the_probe_sweeps_every_depth_to_256_and_names_the_best(segments):
    t0 = time.monotonic()
    disk = disk_limit(segments, seconds=0.1)
    took = time.monotonic() - t0
    if "skipped" in disk:
        pytest.skip(disk["skipped"])
    assert DEPTHS == (32, 64, 128, 256)
    assert set(disk) == {f"{b}B_qd{qd}" for b in (512, 4096) for qd in DEPTHS}
    for key, d in disk.items():
        assert d["iops"] > 0 and d["reads"] >= d["qd"] and d["seconds"] >= 0.1, key
        assert d["cpu_us_per_read"] > 0 and d["rings"] == 1
    best = best_iops(disk)
    want = max(DEPTHS, key=lambda qd: disk[f"512B_qd{qd}"]["iops"])
    assert best == {"iops": disk[f"512B_qd{want}"]["iops"], "qd": want, "rings": 1, "key": f"512B_qd{want}"}
    assert best_iops(disk, 4096)["key"].startswith("4096B_qd")
    # --quick probes a fraction of a second per depth: eight probes of 0.1 s, not seconds each
    assert took < 8 * 0.1 + 4, took


def test_two_rings_split_the_same_depth(segments):
    disk = disk_limit(segments, blocks=(512,), depths=(64,), rings=(1, 2), seconds=0.05)
    if "skipped" in disk:
        pytest.skip(disk["skipped"])
    assert set(disk) == {"512B_qd64", "512B_qd64x2"}
    assert disk["512B_qd64x2"]["rings"] == 2 and disk["512B_qd64x2"]["qd"] == 64
    assert best_iops(disk)["iops"] == max(d["iops"] for d in disk.values())


def test_bad_probe_settings_are_refused_with_the_fix(segments):
    with pytest.raises(InvalidArgument, match="seconds must be > 0"):
        disk_limit(segments, seconds=0)
    with pytest.raises(InvalidArgument, match="queue depth 96 does not split over 64 rings"):
        disk_limit(segments, blocks=(512,), depths=(96,), rings=(64,), seconds=0.05)
    with pytest.raises(InvalidArgument, match=r"queue depth 512 over 1 ring\(s\) is more than a ring's 256 entries"):
        disk_limit(segments, blocks=(512,), depths=(32, 512), seconds=0.05)


def test_the_burst_probe_reads_whole_bursts_and_refuses_bad_settings(segments):
    """burst_limit: a decode step's misses as the disk sees them (bursts read whole, one after
    another): every read counted is a whole burst's, and what it cannot run is refused."""
    b = burst_limit(segments, 300, seconds=0.1)
    if "skipped" in b:
        pytest.skip(b["skipped"])
    assert b["burst"] == 300 and b["qd"] == 256 and b["reads"] % 300 == 0 and b["reads"] >= 300
    assert b["iops"] == pytest.approx(b["reads"] / b["seconds"]) and b["seconds"] >= 0.1
    for bad, why in ((dict(burst=0), "a burst must be >= 1 read"),
                     (dict(burst=10, qd=257), r"the depth must be 1\.\.256"),
                     (dict(burst=10, seconds=0), "seconds must be > 0")):
        kw = {"seconds": 0.05, **bad}
        with pytest.raises(InvalidArgument, match=f"burst probe: {why}"):
            burst_limit(segments, kw.pop("burst"), **kw)
