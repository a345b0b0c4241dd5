"""The per-row checksum: a damaged row never keeps its sum."""
import numpy as np
from hypothesis import given, settings, strategies as st

from tierstore.tiers.nvme.rowsum import ALGO, RowKey, row_sums

WIDTHS = st.sampled_from([6, 33, 64, 128, 132, 256, 264])
# both algorithms readers check: fmix64-v1 (versions without a salt) and fmix64-v2 under a salt
KEYS = st.sampled_from([RowKey.of(None), RowKey.of(0), RowKey.of(0x5EED5EED5EED5EED)])


@st.composite
def rows(draw):
    width = draw(WIDTHS)
    n = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**32 - 1))
    data = np.random.default_rng(seed).integers(0, 256, (n, width), dtype=np.uint8)
    ids = np.sort(np.random.default_rng(seed + 1).choice(10**9, n, replace=False)).astype(np.int64)
    return data, ids


def test_pinned_algorithms():
    # stored sums are checked with the algorithm the manifest names: neither may ever drift
    v1, v2 = RowKey.of(None), RowKey.of(12345)
    assert ALGO == "fmix64-v2" and (v1.algo, v2.algo) == ("fmix64-v1", "fmix64-v2")
    assert int(row_sums(np.arange(264, dtype=np.uint8).reshape(1, 264), np.array([7]), v1)[0]) == 11165796929619310239
    assert int(row_sums(np.arange(6, dtype=np.uint8).reshape(1, 6), np.array([0]), v1)[0]) == 353575501079051837
    assert int(row_sums(np.arange(264, dtype=np.uint8).reshape(1, 264), np.array([7]), v2)[0]) == 95531446249904514
    assert int(row_sums(np.arange(6, dtype=np.uint8).reshape(1, 6), np.array([0]), RowKey.of(0))[0]) \
        == 4043006214757818168


@settings(max_examples=300, deadline=None)
@given(r=rows(), which=st.integers(0, 10**6), bit=st.integers(0, 7), key=KEYS)
def test_any_single_bit_flip_is_detected(r, which, bit, key):
    data, ids = r
    i, byte = which % data.shape[0], which % data.shape[1]
    bad = data.copy()
    bad[i, byte] ^= 1 << bit
    assert row_sums(bad, ids, key)[i] != row_sums(data, ids, key)[i]


@settings(max_examples=300, deadline=None)
@given(r=rows(), which=st.integers(0, 10**6), word=st.binary(min_size=8, max_size=8), key=KEYS)
def test_any_changed_word_is_detected(r, which, word, key):
    data, ids = r
    i = which % data.shape[0]
    w = which % max(1, data.shape[1] // 8)
    bad = data.copy()
    new = np.frombuffer(word, dtype=np.uint8)[:min(8, data.shape[1] - 8 * w)]
    bad[i, 8 * w:8 * w + new.size] = new
    same = np.array_equal(bad[i], data[i])
    assert (row_sums(bad, ids, key)[i] == row_sums(data, ids, key)[i]) == same


@settings(max_examples=300, deadline=None)
@given(r=rows(), which=st.integers(0, 10**6), fill=st.sampled_from([0x00, 0xFF]), key=KEYS)
def test_torn_and_zeroed_rows_are_detected(r, which, fill, key):
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
        assert row_sums(bad, ids, key)[i] != row_sums(data, ids, key)[i]


@settings(max_examples=100, deadline=None)
@given(r=rows(), key=KEYS)
def test_a_row_read_from_the_wrong_place_is_detected(r, key):
    data, ids = r
    # the id is part of the sum: row i's bytes served as another id do not verify
    assert np.all(row_sums(data, ids, key) != row_sums(data, ids + 1, key))


@settings(max_examples=200, deadline=None)
@given(r=rows(), salts=st.lists(st.integers(0, 2**64 - 1), min_size=2, max_size=2, unique=True),
       shift=st.integers(0, 2**20))
def test_a_sum_holds_in_its_own_version_only(r, salts, shift):
    """fmix64-v2: a genuine row's sum, made under one version's salt, fails under any other
    salt at the same id (always: the id term is a bijection of the key) and at other ids;
    fmix64-v1 binds the id alone, so the same row at the same id passes in any version."""
    data, ids = r
    mine, other = RowKey.of(salts[0]), RowKey.of(salts[1])
    sums = row_sums(data, ids, mine)
    assert np.all(row_sums(data, ids, other) != sums)
    assert np.all(row_sums(data, ids ^ shift, other)[(ids ^ shift) != ids] != sums[(ids ^ shift) != ids])
    assert np.all(row_sums(data, ids, RowKey.of(None)) != sums)


def test_sums_do_not_depend_on_batching_or_strides():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (5000, 264), dtype=np.uint8)
    ids = np.arange(5000, dtype=np.int64) * 3
    key = RowKey.of(77)
    whole = row_sums(data, ids, key)
    parts = np.concatenate([row_sums(data[a:a + 777], ids[a:a + 777], key) for a in range(0, 5000, 777)])
    wide = np.zeros((5000, 300), dtype=np.uint8)
    wide[:, :264] = data
    assert np.array_equal(whole, parts) and np.array_equal(whole, row_sums(wide[:, :264], ids, key))


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 9000), st.sampled_from([8, 64, 264, 1024]), st.integers(0, 2**40), KEYS)
def test_compiled_bulk_sums_equal_the_numpy_reference(n, width, first, key):
    """Batches past BULK_BYTES (ingest, verify) take the compiled loop: same sums, under either algorithm."""
    rows = np.random.default_rng(n).integers(0, 256, (n, width), dtype=np.uint8)
    ids = np.arange(first, first + n, dtype=np.int64)
    assert np.array_equal(row_sums(rows, ids, key), row_sums(rows, ids, key, compiled=False))
    big = np.tile(rows, (-(-(1 << 20) // rows.nbytes), 1))
    ids = np.arange(first, first + len(big), dtype=np.int64)
    assert np.array_equal(row_sums(big, ids, key), row_sums(big, ids, key, compiled=False))


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 9000), st.sampled_from([(256, 8), (64, 0), (8, 256), (1024, 16)]), st.integers(0, 2**40), KEYS)
def test_compiled_records_of_column_blocks_equal_the_numpy_reference(n, widths, first, key):
    """Format 2 records built in one compiled pass from two column blocks (an fp8 checkpoint's
    weight and scale, read apart) are byte for byte the packed rows, zero padding and the
    reference's sum."""
    from tierstore.tiers.nvme.rowsum import records

    rng = np.random.default_rng(n)
    a, b = (rng.integers(0, 256, (n, w), dtype=np.uint8) for w in widths)
    reps = -(-(1 << 20) // (n * sum(widths)))  # past BULK_BYTES: the compiled pass
    a, b = np.tile(a, (reps, 1)), np.tile(b, (reps, 1))
    ids = np.arange(first, first + len(a), dtype=np.int64)
    rows = np.concatenate([a, b], axis=1)
    want = np.concatenate([rows, row_sums(rows, ids, key, compiled=False).astype("<u8").view(np.uint8)
                           .reshape(-1, 8)], axis=1)
    assert np.array_equal(records((a, b), ids, key), want)
    assert np.array_equal(records(rows, ids, key), want)
    out = np.full_like(want, 0xAB)
    assert records((a, b), ids, key, out=out) is out and np.array_equal(out, want)
