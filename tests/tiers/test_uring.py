"""The io_uring behind O_DIRECT row reads: every span read in one call, bit for
bit what pread reads, short reads and errors reported per span."""
import os
import time

import numpy as np
import pytest

from tierstore.tiers.nvme import direct_io

from tierstore.tiers.nvme import uring
from tierstore.tiers.nvme.direct_io import Spans, thread_buffer


def _read(ring, fd, offsets, lengths, addrs, depth=None):
    """One batch of reads submitted and waited for: its results."""
    return ring.wait(ring.submit(fd, offsets, lengths, addrs, depth))


def _rows(fd, offsets, rb, a, out, buffer, ring):
    """Rows `offsets` into out as the read pipeline reads them (its submit and finish
    stages): every span on `ring` (or none), what it left short pread; (bytes, first short row)."""
    spans = Spans(fd, offsets, rb, a, buffer)
    todo = spans.short()
    if ring is not None and todo.size:
        spans.res[todo] = ring.wait(ring.submit(*spans.ring_reads(todo), keep=spans.scratch))
    got = spans.settle()
    spans.copy_rows(out, got[1])
    return got


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
        res = _read(ring, fd, offs, lens, out.ctypes.data + pos)
        want = np.minimum(lens, data.size - offs)
        assert np.array_equal(res, want)
        for o, p, k in zip(offs.tolist(), pos.tolist(), want.tolist()):
            assert np.array_equal(out[p:p + k], data[o:o + k])


def test_a_read_past_the_end_is_short_and_a_bad_descriptor_is_an_errno(ring, file):
    fd, data = file
    out = np.zeros(4096, np.uint8)
    res = _read(ring, fd, np.array([data.size - 100, data.size, data.size + 8192]), np.array([512, 512, 512]),
                    out.ctypes.data + np.array([0, 1024, 2048]))
    assert res.tolist() == [100, 0, 0]
    assert np.array_equal(out[:100], data[-100:])
    bad = os.open(os.devnull, os.O_RDONLY)
    os.close(bad)  # a descriptor number nothing holds now
    assert _read(ring, bad, np.array([0, 512]), np.array([512, 512]), out.ctypes.data + np.array([0, 512])).tolist() \
        == [-9, -9]


@pytest.mark.parametrize("rb,a", [(256, 512), (264, 512), (264, 4096), (6, 1)])
def test_rows_through_the_ring_equal_one_pread_at_a_time(ring, file, rb, a):
    fd, data = file
    rows = data.size // rb
    rng = np.random.default_rng(rb + a)
    for n in (1, 3, 40, 500):
        local = np.sort(rng.choice(rows + 3, n, replace=False))  # a few past the end: short
        got = [np.zeros((n, rb), np.uint8) for _ in range(2)]
        scratch = [direct_io._Scratch(), direct_io._Scratch()]
        with_ring = _rows(fd, local, rb, a, got[0], lambda k: thread_buffer(scratch[0], k), ring)
        plain = _rows(fd, local, rb, a, got[1], lambda k: thread_buffer(scratch[1], k), None)
        assert with_ring == plain
        held = n if plain[1] < 0 else plain[1]
        assert np.array_equal(got[0][:held], got[1][:held])
        assert np.array_equal(got[0][:held], data[:rows * rb].reshape(rows, rb)[local[:held]])


@pytest.mark.parametrize("rb,a", [(264, 512), (264, 4096)])
def test_rows_over_several_files_in_one_ring_call_equals_each_file_alone(ring, tmp_path, rb, a):
    """A call's rows over several segments (one descriptor a row) read through one ring are the
    rows each file gives read alone; spans of two files never merge, even at equal offsets; a
    row past one file's end is reported at its own index."""
    rng = np.random.default_rng(rb + a)
    files, fds = [rng.integers(0, 256, 300 * rb + 77 * k, dtype=np.uint8) for k in range(3)], []
    for k, data in enumerate(files):
        (tmp_path / f"seg{k}.bin").write_bytes(data.tobytes())
        fds.append(os.open(tmp_path / f"seg{k}.bin", os.O_RDONLY))
    try:
        per = [np.sort(rng.choice(300, 90, replace=False)) for _ in files]
        per[0][:5] = per[1][:5] = np.arange(5)  # the same offsets in two files, side by side in the call
        per[0].sort(), per[1].sort()
        which = np.repeat(np.arange(3), 90)
        local = np.concatenate(per).astype(np.int64)
        scratch = [direct_io._Scratch(), direct_io._Scratch()]
        got, plain = np.zeros((local.size, rb), np.uint8), np.zeros((local.size, rb), np.uint8)
        fd_of = np.array(fds)[which]
        assert _rows(fd_of, local, rb, a, got, lambda k: thread_buffer(scratch[0], k), ring) == \
            _rows(fd_of, local, rb, a, plain, lambda k: thread_buffer(scratch[1], k), None)
        assert np.array_equal(got, plain)
        for k, data in enumerate(files):
            rows = data[:300 * rb].reshape(300, rb)
            assert np.array_equal(got[which == k], rows[per[k]])
        # a row past the end of the middle file: reported at its index in the call
        short = local.copy()
        short[90 + 89] = 400
        out = np.zeros_like(got)
        _, bad = _rows(fd_of, short, rb, a, out, lambda k: thread_buffer(scratch[0], k), ring)
        assert bad == 90 + 89
        assert np.array_equal(out[:90], files[0][:300 * rb].reshape(300, rb)[per[0]])
    finally:
        for fd in fds:
            os.close(fd)


def test_switched_off_or_refused_means_no_ring(monkeypatch):
    monkeypatch.setenv("TIERSTORE_IO_URING", "0")
    assert uring.Ring.open() is None


@pytest.fixture(params=["compiled", "reference"])
def loop(request, monkeypatch):
    """Ring.submit and wait through its compiled loop, or through the numpy reference it is checked against."""
    from tierstore.jit import enabled

    if request.param == "compiled" and not enabled():
        pytest.skip("numba is not available here")
    if request.param == "reference":
        monkeypatch.setattr(uring._READ, "_jit", None)
    return request.param


@pytest.mark.parametrize("depth", [1, 3, 64, None])
def test_reads_over_several_files_in_one_call_at_any_depth_are_the_files_bytes(ring, tmp_path, loop, depth):
    rng = np.random.default_rng(7)
    files = [rng.integers(0, 256, (1 << 18) + 77 * k, dtype=np.uint8) for k in range(3)]
    fds = []
    for k, data in enumerate(files):
        (tmp_path / f"seg{k}.bin").write_bytes(data.tobytes())
        fds.append(os.open(tmp_path / f"seg{k}.bin", os.O_RDONLY))
    try:
        n = 700  # more reads than the ring's 256 entries
        which = rng.integers(0, 3, n)
        offs = rng.integers(0, (1 << 18) // 512, n).astype(np.int64) * 512
        offs[-3:] = [files[which[-3]].size - 10, files[which[-2]].size, files[which[-1]].size + 512]  # short, none
        lens = rng.integers(1, 1025, n).astype(np.int64)
        pos = np.concatenate([[0], np.cumsum(lens)[:-1]])
        out = np.zeros(int(lens.sum()), np.uint8)
        res = _read(ring, np.array(fds)[which], offs, lens, out.ctypes.data + pos, depth=depth)
        sizes = np.array([f.size for f in files])[which]
        assert np.array_equal(res, np.clip(sizes - offs, 0, lens))
        for k, o, p, m in zip(which.tolist(), offs.tolist(), pos.tolist(), res.tolist()):
            assert np.array_equal(out[p:p + m], files[k][o:o + m])
    finally:
        for fd in fds:
            os.close(fd)


def test_a_read_that_waits_does_not_hold_up_the_reads_behind_it(ring, file, loop):
    """The queue stays full: while one read waits (a pipe no one has written yet), the
    reads behind it go on through its place-holders' free places, as a device's queue
    keeps serving while one read is slow; batches would wait for the slow one first."""
    import threading
    import time

    if loop == "reference":
        pytest.skip("the numpy reference waits for each batch whole (a shallower queue, the same results)")
    fd, data = file
    r, w = os.pipe()
    try:
        n = 600  # the pipe's read first, then more file reads than the ring has entries
        offs = np.concatenate([[0], np.arange(n - 1) * 512]).astype(np.int64)
        lens = np.full(n, 512, dtype=np.int64)
        out = np.zeros(n * 512, np.uint8)
        last = out[-512:]
        seen = []

        def write_once_the_last_file_read_is_in():
            t0 = time.monotonic()
            while not np.array_equal(last, data[(n - 2) * 512:(n - 1) * 512]) and time.monotonic() - t0 < 10:
                time.sleep(0.01)
            seen.append(np.array_equal(last, data[(n - 2) * 512:(n - 1) * 512]))
            os.write(w, b"x" * 512)

        t = threading.Thread(target=write_once_the_last_file_read_is_in)
        t.start()
        try:
            res = _read(ring, np.array([r] + [fd] * (n - 1)), offs, lens, out.ctypes.data + np.arange(n) * 512,
                            depth=16)
        finally:
            t.join()  # it writes the pipe at the latest after its wait: then nothing is left in flight
        assert seen == [True]  # the last file read finished while the first still waited
        assert res.tolist() == [512] * n and bytes(out[:512]) == b"x" * 512
    finally:
        os.close(r)
        os.close(w)


def test_a_depth_out_of_range_or_descriptors_that_do_not_match_are_refused(ring, file):
    from tierstore.errors import InvalidArgument

    fd, _ = file
    out = np.zeros(1024, np.uint8)
    args = (np.array([0, 512]), np.array([512, 512]), out.ctypes.data + np.array([0, 512]))
    for depth in (0, ring.entries + 1):
        with pytest.raises(InvalidArgument, match=rf"queue depth {depth} is outside 1\.\.{ring.entries}"):
            _read(ring, fd, *args, depth=depth)
    with pytest.raises(InvalidArgument, match="3 descriptors for 2 reads"):
        _read(ring, np.array([fd, fd, fd]), *args)
    assert not out.any()  # nothing was read


def test_batches_submitted_together_are_each_the_files_bytes_in_any_order_of_waits(ring, file, loop):
    """Ring.submit / wait: several batches in flight at once (a step's tables), waited for in
    any order, each gets its own reads' results and bytes; a batch waited for twice, or
    never submitted, is a KeyError; the queue starts over once nothing is owed."""
    fd, data = file
    rng = np.random.default_rng(11)
    sizes = (300, 1, 700, 0, 90)  # past the ring's 256 entries, one read, none
    outs, tickets, want = [], [], []
    for n in sizes:
        offs = rng.integers(0, data.size // 512, n).astype(np.int64) * 512
        lens = rng.integers(1, 1025, n).astype(np.int64)
        if n > 2:
            offs[-1] = data.size - 7  # short
        pos = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        out = np.zeros(max(1, int(lens.sum())), np.uint8)
        tickets.append(ring.submit(fd, offs, lens, out.ctypes.data + pos, depth=64, keep=out))
        outs.append((out, offs, lens, pos))
        want.append(np.minimum(lens, data.size - offs))
    for k in (2, 0, 4, 3, 1):  # not in the order submitted
        res = ring.wait(tickets[k])
        out, offs, lens, pos = outs[k]
        assert np.array_equal(res, want[k])
        for o, p, m in zip(offs.tolist(), pos.tolist(), res.tolist()):
            assert np.array_equal(out[p:p + m], data[o:o + m])
    with pytest.raises(KeyError):
        ring.wait(tickets[0])
    assert ring._n == 0  # nothing owed: the next batch starts the queue over
    assert np.array_equal(_read(ring, fd, np.array([0]), np.array([512]), outs[0][0].ctypes.data + np.array([0])),
                          [512])


def test_reads_of_later_batches_go_on_while_an_earlier_one_is_waited_for(ring, file, loop):
    """The device's queue does not drain between batches: while the first batch is waited
    for, the second one's reads take the places its reads free, so once the first is done
    the second is (mostly) done too, never started from scratch."""
    if loop == "reference":
        pytest.skip("the numpy reference reads each batch whole, in turn (the same results)")
    fd, data = file
    n = 200
    offs = (np.arange(n, dtype=np.int64) * 512) % (data.size - 512)
    lens = np.full(n, 512, dtype=np.int64)
    a, b = np.zeros(n * 512, np.uint8), np.zeros(n * 512, np.uint8)
    ta = ring.submit(fd, offs, lens, a.ctypes.data + np.arange(n) * 512, depth=256)
    tb = ring.submit(fd, offs[::-1].copy(), lens, b.ctypes.data + np.arange(n) * 512, depth=256)
    ring.wait(ta)
    assert ring._left[tb] < n  # the second batch's reads were in flight with the first's
    assert np.array_equal(ring.wait(tb), lens)
    assert np.array_equal(b.reshape(n, 512)[::-1], a.reshape(n, 512))


def test_done_says_a_batch_has_landed_without_waiting_and_its_wait_still_gets_the_results(ring, file, loop):
    """Ring.done(ticket): False while reads are in flight (asked without blocking), True once
    every read of the batch is done; its wait then returns at once with the results (the bytes
    read), and a waited ticket is a KeyError (the read pipeline reaps a batch read ahead so)."""
    fd, data = file
    n = 300
    offs = (np.arange(n, dtype=np.int64) * 4096) % (data.size - 512)
    lens = np.full(n, 512, dtype=np.int64)
    out = np.zeros(n * 512, np.uint8)
    t = ring.submit(fd, offs, lens, out.ctypes.data + np.arange(n) * 512, depth=64, keep=out)
    deadline = time.monotonic() + 10
    while not ring.done(t):
        assert time.monotonic() < deadline, "a batch of 300 reads never landed"
    assert np.array_equal(ring.wait(t), lens)
    for o, k in zip(offs.tolist(), range(n)):
        assert np.array_equal(out[k * 512:(k + 1) * 512], data[o:o + 512])
    assert ring._n == 0  # nothing owed: the queue starts over
    with pytest.raises(KeyError):
        ring.done(t)


def test_a_ring_closed_with_reads_in_flight_waits_for_them_first(file, loop):
    """close() with a batch still in flight: the reads end before the ring goes (they write the
    caller's memory until they do), and the bytes they wrote are the file's."""
    ring = uring.Ring.open()
    if ring is None:
        pytest.skip("io_uring is not available here")
    fd, data = file
    n = 100
    out = np.zeros(n * 512, np.uint8)
    ring.submit(fd, np.arange(n, dtype=np.int64) * 512, np.full(n, 512), out.ctypes.data + np.arange(n) * 512)
    ring.close()
    if loop == "compiled":
        assert np.array_equal(out, data[:n * 512])  # submitted at once, ended before close returned
    else:
        assert not out.any()  # the reference submits only when waited for: nothing was read
