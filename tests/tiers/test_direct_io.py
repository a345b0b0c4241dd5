"""Row reads (tiers/nvme/direct_io.py): the compiled span and pread loops against their
references, and the page-cache path that reads what is cached at once and leaves the
rest for the ring (as the read pipeline's submit and finish stages drive it)."""
import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tierstore.jit import enabled
from tierstore.tiers.nvme import direct_io, uring
from tierstore.tiers.nvme.direct_io import Spans, _spans_reference

compiled = pytest.mark.skipif(not enabled(), reason="numba is not available here")


@compiled
@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5000)), min_size=1, max_size=60),
       rb=st.sampled_from([6, 8, 264, 256]), a=st.sampled_from([1, 512, 4096]), gap=st.sampled_from([0, 100, 2048]),
       one_file=st.booleans())
def test_compiled_spans_equal_the_numpy_reference(rows, rb, a, gap, one_file):
    rows = sorted(set(rows))  # sorted within each file, a file's rows together
    fds = np.array([3 if one_file else 10 + f for f, _ in rows], dtype=np.int64)
    fds = fds[:1] if one_file else fds
    off = np.array([r for _, r in rows], dtype=np.int64) * rb
    if one_file:
        off = np.unique(off)
    got = [(np.full((4, off.size), -7, np.int64), np.full(off.size, -7, np.int64)) for _ in range(2)]
    k = direct_io._SPANS.compiled()(fds, off, rb, a, gap, *got[0])
    ref = _spans_reference(fds, off, rb, a, gap, *got[1])
    assert tuple(map(int, k)) == tuple(map(int, ref))
    runs = int(ref[0])
    assert np.array_equal(got[0][0][:, :runs], got[1][0][:, :runs]) and np.array_equal(got[0][1], got[1][1])
    spans, pos = got[1]
    # each row lies whole inside its read, at its offset from the read's start
    run_of = np.searchsorted(spans[3, :runs], pos, side="right") - 1
    assert np.all(spans[1, run_of] + pos - spans[3, run_of] == off)
    assert np.all(pos + rb <= spans[3, run_of] + spans[2, run_of])


@pytest.fixture
def segment(tmp_path):
    data = np.random.default_rng(5).integers(0, 256, (20_000, 264), dtype=np.uint8)
    p = tmp_path / "seg.bin"
    p.write_bytes(data.tobytes())
    fd = os.open(p, os.O_RDONLY)
    yield fd, data, p
    os.close(fd)


def _buffer(n):
    return np.empty(max(n, 1), np.uint8)


def _preads(fd, ids, gap, out):
    """Rows `ids` pread into out: (bytes read, the first row short or -1)."""
    spans = Spans(fd, ids, 264, 1, _buffer, gap=gap)
    total, short = spans.settle()
    spans.copy_rows(out, short)
    return total, short


@compiled
@pytest.mark.parametrize("gap", [0, 2048])
def test_compiled_preads_equal_one_preadv_at_a_time_short_reads_included(segment, monkeypatch, gap):
    fd, data, path = segment
    rng = np.random.default_rng(gap)
    for n in (1, 7, 900):
        ids = np.sort(rng.choice(20_003, n, replace=False))  # a few past the end: short
        got = [np.zeros((n, 264), np.uint8) for _ in range(2)]
        fast = _preads(fd, ids, gap, got[0])
        with monkeypatch.context() as m:
            m.setattr(direct_io, "_preads", lambda: None)
            slow = _preads(fd, ids, gap, got[1])
        assert fast == slow
        held = n if fast[1] < 0 else fast[1]
        assert held == np.searchsorted(ids, 20_000) and np.array_equal(got[0][:held], got[1][:held])
        assert np.array_equal(got[0][:held], data[ids[:held]])


def test_rows_the_page_cache_holds_are_read_at_once_the_rest_through_the_ring(segment):
    """read_cached: a set whose rows are all cached lands at once (no ring round trip); once
    the file is dropped from the page cache, its reads go to the ring and still come back
    bit-exact."""
    fd, data, path = segment
    ring = uring.Ring.open()
    if ring is None or direct_io._preads() is None:
        pytest.skip("no io_uring or no compiled preads here")

    def read(spans):  # what the pipeline's submit and finish do with a set of spans
        spans.read_cached()
        todo = spans.short()
        if todo.size:
            spans.res[todo] = ring.wait(ring.submit(*spans.ring_reads(todo), keep=spans.scratch))
        out = np.zeros((ids.size, 264), np.uint8)
        got = spans.settle()
        spans.copy_rows(out, got[1])
        return got, out

    try:
        ids = np.arange(0, 20_000, 37)
        os.pread(fd, data.nbytes, 0)  # every page cached
        spans = Spans(fd, ids, 264, 1, _buffer)
        spans.read_cached()
        assert spans.landed
        got, out = read(spans)
        assert got == (ids.size * 264, -1) and np.array_equal(out, data[ids])
        os.fsync(fd)  # clean pages, so the advice drops them
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        spans = Spans(fd, ids, 264, 1, _buffer)
        spans.read_cached()
        assert not spans.landed  # a cold page: not read without waiting
        got, out = read(spans)
        assert got == (ids.size * 264, -1) and np.array_equal(out, data[ids])
    finally:
        ring.close()
