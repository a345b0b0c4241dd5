"""The per-row checksum: a damaged row never keeps its sum."""
import numpy as np
from hypothesis import given, settings, strategies as st

from tierstore.tiers.nvme.rowsum import ALGO, row_sums

WIDTHS = st.sampled_from([6, 33, 64, 128, 132, 256, 264])


@st.composite
def rows(draw):
    width = draw(WIDTHS)
    n = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**32 - 1))
    data = np.random.default_rng(seed).integers(0, 256, (n, width), dtype=np.uint8)
    ids = np.sort(np.random.default_rng(seed + 1).choice(10**9, n, replace=False)).astype(np.int64)
    return data, ids


def test_pinned_algorithm():
    # stored sums are checked with the algorithm the manifest names: this must never drift
    assert ALGO == "fmix64-v1"
    assert int(row_sums(np.arange(264, dtype=np.uint8).reshape(1, 264), np.array([7]))[0]) == 11165796929619310239
    assert int(row_sums(np.arange(6, dtype=np.uint8).reshape(1, 6), np.array([0]))[0]) == 353575501079051837


@settings(max_examples=300, deadline=None)
@given(r=rows(), which=st.integers(0, 10**6), bit=st.integers(0, 7))
def test_any_single_bit_flip_is_detected(r, which, bit):
    data, ids = r
    i, byte = which % data.shape[0], which % data.shape[1]
    bad = data.copy()
    bad[i, byte] ^= 1 << bit
    assert row_sums(bad, ids)[i] != row_sums(data, ids)[i]


@settings(max_examples=300, deadline=None)
@given(r=rows(), which=st.integers(0, 10**6), word=st.binary(min_size=8, max_size=8))
def test_any_changed_word_is_detected(r, which, word):
    data, ids = r
    i = which % data.shape[0]
    w = which % max(1, data.shape[1] // 8)
    bad = data.copy()
    new = np.frombuffer(word, dtype=np.uint8)[:min(8, data.shape[1] - 8 * w)]
    bad[i, 8 * w:8 * w + new.size] = new
    same = np.array_equal(bad[i], data[i])
    assert (row_sums(bad, ids)[i] == row_sums(data, ids)[i]) == same


@settings(max_examples=300, deadline=None)
@given(r=rows(), which=st.integers(0, 10**6), fill=st.sampled_from([0x00, 0xFF]))
def test_torn_and_zeroed_rows_are_detected(r, which, fill):
    data, ids = r
    i = which % data.shape[0]
    cut = which % data.shape[1]  # a torn write: the row's tail never landed
    for bad_row in (np.full(data.shape[1], fill, np.uint8), np.concatenate([data[i, :cut],
                                                                            np.full(data.shape[1] - cut, fill,
                                                                                    np.uint8)])):
        if np.array_equal(bad_row, data[i]):
            continue
        bad = data.copy()
        bad[i] = bad_row
        assert row_sums(bad, ids)[i] != row_sums(data, ids)[i]


@settings(max_examples=100, deadline=None)
@given(r=rows())
def test_a_row_read_from_the_wrong_place_is_detected(r):
    data, ids = r
    # the id is part of the sum: row i's bytes served as another id do not verify
    assert np.all(row_sums(data, ids) != row_sums(data, ids + 1))


def test_sums_do_not_depend_on_batching_or_strides():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (5000, 264), dtype=np.uint8)
    ids = np.arange(5000, dtype=np.int64) * 3
    whole = row_sums(data, ids)
    parts = np.concatenate([row_sums(data[a:a + 777], ids[a:a + 777]) for a in range(0, 5000, 777)])
    wide = np.zeros((5000, 300), dtype=np.uint8)
    wide[:, :264] = data
    assert np.array_equal(whole, parts) and np.array_equal(whole, row_sums(wide[:, :264], ids))


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 9000), st.sampled_from([8, 64, 264, 1024]), st.integers(0, 2**40))
def test_compiled_bulk_sums_equal_the_numpy_reference(n, width, first):
    """Batches past BULK_BYTES (ingest, verify) take the compiled loop: same sums."""
    rows = np.random.default_rng(n).integers(0, 256, (n, width), dtype=np.uint8)
    ids = np.arange(first, first + n, dtype=np.int64)
    assert np.array_equal(row_sums(rows, ids), row_sums(rows, ids, compiled=False))
    big = np.tile(rows, (-(-(1 << 20) // rows.nbytes), 1))
    ids = np.arange(first, first + len(big), dtype=np.int64)
    assert np.array_equal(row_sums(big, ids), row_sums(big, ids, compiled=False))
