"""RowScratch (client/row_scratch.py): the buffer lookup(out=) and the stagers read into, reused
read after read, one per thread, its spare rows zero."""
from __future__ import annotations

import threading

from tierstore.client import row_scratch
from tierstore.client.row_scratch import RowScratch

WIDTH = 72


def test_a_scratch_is_reused_grows_keeps_its_spare_rows_zero_and_is_one_per_thread(monkeypatch):
    s = RowScratch(WIDTH, spare=1)
    a = s.take(100)
    assert a.shape == (101, WIDTH) and not a[100].any()
    a[:] = 7
    b = s.take(60)  # a smaller step: the same memory, its spare row zeroed again
    assert b.ctypes.data == a.ctypes.data and b.shape == (61, WIDTH) and not b[60].any()
    c = s.take(20_000)  # past the buffer it had (1.4 MB): grown, then kept for smaller reads
    assert c.shape == (20_001, WIDTH) and not c[20_000].any() and s.take(190).ctypes.data == c.ctypes.data
    other = []
    threading.Thread(target=lambda: other.append(s.take(10))).start()
    while not other:
        pass
    assert other[0].ctypes.data != c.ctypes.data  # another thread's read never shares this one's buffer
    monkeypatch.setattr(row_scratch, "KEEP_BYTES", 300 * WIDTH)
    big = s.take(400)  # past KEEP_BYTES: a fresh array, all zero, not kept
    assert big.shape == (401, WIDTH) and not big.any() and big.ctypes.data != c.ctypes.data
    assert s.take(10).ctypes.data == c.ctypes.data
