"""The io_uring behind O_DIRECT row reads: every span read in one call, bit for
bit what pread reads, short reads and errors reported per span."""
import os

import numpy as np
import pytest

from tierstore.tiers.nvme import direct_io

from tierstore.tiers.nvme import uring
from tierstore.tiers.nvme.direct_io import pread_rows, thread_buffer


@pytest.fixture
def ring():
    r = uring.Ring.open()
    if r is None:
        pytest.skip("io_uring is not available here")
    yield r
    r.close()


@pytest.fixture
def file(tmp_path):
    data = np.random.default_rng(5).integers(0, 256, (1 << 20) + 300, dtype=np.uint8)
    p = tmp_path / "seg.bin"
    p.write_bytes(data.tobytes())
    fd = os.open(p, os.O_RDONLY)
    yield fd, data
    os.close(fd)


def test_scattered_spans_read_in_one_call_are_the_files_bytes(ring, file):
    fd, data = file
    rng = np.random.default_rng(1)
    for n in (2, 17, 600):  # 600: more than the ring's 256 entries, read in batches
        offs = np.sort(rng.choice(data.size // 512, n, replace=False)).astype(np.int64) * 512
        lens = rng.integers(1, 1025, n).astype(np.int64)
        pos = np.concatenate([[0], np.cumsum(lens)[:-1]])
        out = np.zeros(int(lens.sum()), np.uint8)
        res = ring.read(fd, offs, lens, out.ctypes.data + pos)
        want = np.minimum(lens, data.size - offs)
        assert np.array_equal(res, want)
        for o, p, k in zip(offs.tolist(), pos.tolist(), want.tolist()):
            assert np.array_equal(out[p:p + k], data[o:o + k])


def test_a_read_past_the_end_is_short_and_a_bad_descriptor_is_an_errno(ring, file):
    fd, data = file
    out = np.zeros(4096, np.uint8)
    res = ring.read(fd, np.array([data.size - 100, data.size, data.size + 8192]), np.array([512, 512, 512]),
                    out.ctypes.data + np.array([0, 1024, 2048]))
    assert res.tolist() == [100, 0, 0]
    assert np.array_equal(out[:100], data[-100:])
    bad = os.open(os.devnull, os.O_RDONLY)
    os.close(bad)  # a descriptor number nothing holds now
    assert ring.read(bad, np.array([0, 512]), np.array([512, 512]), out.ctypes.data + np.array([0, 512])).tolist() \
        == [-9, -9]


@pytest.mark.parametrize("rb,a", [(256, 512), (264, 512), (264, 4096), (6, 1)])
def test_pread_rows_through_the_ring_equals_one_pread_at_a_time(ring, file, rb, a):
    fd, data = file
    rows = data.size // rb
    rng = np.random.default_rng(rb + a)
    for n in (1, 3, 40, 500):
        local = np.sort(rng.choice(rows + 3, n, replace=False))  # a few past the end: short
        got = [np.zeros((n, rb), np.uint8) for _ in range(2)]
        scratch = [direct_io._Scratch(), direct_io._Scratch()]
        with_ring = pread_rows(fd, local, rb, a, got[0], lambda k: thread_buffer(scratch[0], k), ring)
        plain = pread_rows(fd, local, rb, a, got[1], lambda k: thread_buffer(scratch[1], k), None)
        assert with_ring == plain
        held = n if plain[1] < 0 else plain[1]
        assert np.array_equal(got[0][:held], got[1][:held])
        assert np.array_equal(got[0][:held], data[:rows * rb].reshape(rows, rb)[local[:held]])


def test_switched_off_or_refused_means_no_ring(monkeypatch):
    monkeypatch.setenv("TIERSTORE_IO_URING", "0")
    assert uring.Ring.open() is None
