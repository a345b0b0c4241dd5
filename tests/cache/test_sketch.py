"""FrequencySketch: count-min estimates with conservative update and halving."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tierstore.errors import InvalidArgument
from tierstore.cache.policy.sketch import FrequencySketch


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 10**9), min_size=1, max_size=60, unique=True), min_size=1, max_size=12),
       st.integers(4, 256))
def test_never_underestimates_before_halving(batches, width):
    sk = FrequencySketch(width=width, depth=4, counter_max=255, period=0)
    truth: dict[int, int] = {}
    for b in batches:
        sk.add(np.array(b))
        for x in b:
            truth[x] = truth.get(x, 0) + 1
    ids = np.array(list(truth))
    est = sk.estimate(ids)
    assert np.all(est >= np.array([truth[i] for i in ids]))


def test_exact_when_wide_enough():
    sk = FrequencySketch(width=1 << 16, counter_max=255)
    for _ in range(5):
        sk.add(np.arange(100))
    sk.add(np.arange(50))
    est = sk.estimate(np.arange(100))
    assert est[:50].tolist() == [6] * 50 and est[50:].tolist() == [5] * 50
    assert sk.estimate(np.array([10**6])).tolist() == [0]


def test_saturates_at_counter_max():
    sk = FrequencySketch(width=64, counter_max=15)
    for _ in range(40):
        sk.add(np.array([7]))
    assert sk.estimate(np.array([7]))[0] == 15


def test_halving_halves_every_counter():
    sk = FrequencySketch(width=1024, counter_max=255)
    sk.add(np.arange(10), counts=np.arange(10) * 3)
    before = sk.counters.copy()
    sk.halve()
    assert np.array_equal(sk.counters, before >> 1)
    assert sk.estimate(np.arange(10)).tolist() == [(3 * i) // 2 for i in range(10)]


def test_period_triggers_halving():
    sk = FrequencySketch(width=1024, counter_max=255, period=100)
    for _ in range(9):
        sk.add(np.arange(10))
    assert sk.halvings == 0 and sk.estimate(np.array([0]))[0] == 9
    sk.add(np.arange(10))  # the 100th access
    assert sk.halvings == 1 and sk.estimate(np.array([0]))[0] == 5


def test_bad_parameters_are_rejected():
    with pytest.raises(InvalidArgument, match="depth"):
        FrequencySketch(width=16, depth=9)
    with pytest.raises(InvalidArgument, match="counter_max"):
        FrequencySketch(width=16, counter_max=300)


@pytest.mark.parametrize("counter_max,per_byte", [(15, 2), (255, 1)])
def test_an_ids_counters_share_one_cache_line(counter_max, per_byte):
    sk = FrequencySketch(width=1 << 20, depth=4, counter_max=counter_max)
    idx = sk._index(np.arange(1000))
    per_line = 64 * per_byte
    assert np.all(idx.min(axis=0) // per_line == idx.max(axis=0) // per_line)  # one 64-byte block per id
    assert sk.nbytes == (4 << 20) // per_byte  # 4-bit counters where counter_max allows


@pytest.mark.parametrize("path", ["compiled", "numpy"])
def test_four_bit_counters_count_halve_and_saturate_on_their_own(path, numpy_path):
    """Two counters a byte: neither's update, saturation or halving reaches the other."""
    if path == "numpy":
        import tierstore.cache.policy.sketch as sketch_mod
        numpy_path(sketch_mod, "_LOOP")
    sk = FrequencySketch(width=64, depth=2, counter_max=15)  # 200 ids on 128 counters: bytes shared
    sk.add(np.arange(200), counts=np.arange(200) % 16)
    assert np.all(sk.estimate(np.arange(200)) >= np.arange(200) % 16)
    exact = FrequencySketch(width=1 << 16, depth=2, counter_max=15)
    exact.add(np.arange(50), counts=np.arange(50) % 16)
    assert exact.estimate(np.arange(50)).tolist() == (np.arange(50) % 16).tolist()
    exact.add(np.arange(50), counts=20)
    assert (exact.estimate(np.arange(50)) == 15).all()
    exact.halve()
    assert (exact.estimate(np.arange(50)) == 7).all()


def test_ids_sharing_a_counter_in_one_call_both_count():
    sk = FrequencySketch(width=1, depth=1, counter_max=255)  # every id on the same 64 counters
    ids = np.arange(500)
    sk.add(ids)
    assert np.all(sk.estimate(ids) >= 1)


def test_compiled_loop_matches_the_numpy_reference(numpy_path):
    import tierstore.cache.policy.sketch as sketch_mod
    rng = np.random.default_rng(3)
    batches = [np.unique(rng.zipf(1.2, 300) % 5000) for _ in range(60)]
    fast, ref = (FrequencySketch(width=1 << 16, counter_max=15, period=2000) for _ in range(2))
    got = [fast.add(b) for b in batches]
    numpy_path(sketch_mod, "_LOOP")
    want = [ref.add(b) for b in batches]
    # wide enough that no two ids share a counter: both are exact, so equal
    # (sharing one, the compiled loop sees the earlier id's update, as a stream would)
    assert np.array_equal(fast.counters, ref.counters)
    assert all((g is None and w is None) or np.array_equal(g, w) for g, w in zip(got, want))
    assert fast.halvings == ref.halvings == 4
    assert np.array_equal(fast.estimate(np.arange(5000)), ref.estimate(np.arange(5000)))
