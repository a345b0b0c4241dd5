"""EngramSpec: the published DeepSeek-V4.1 constants and spec validation."""
import numpy as np
import pytest

from tierstore.client.spec import PRESETS, EngramSpec, is_prime, preset

V41 = preset("deepseek-v4.1-flash")


def test_v41_published_constants():
    assert V41.compressed_vocab_size == 99_092
    assert V41.engram_vocab_size == (16_000_000,) * 3
    assert (V41.max_ngram, V41.n_heads, V41.layer_ids, V41.columns) == (4, 8, (1, 14), 24)
    assert V41.multipliers(1).tolist() == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert V41.multipliers(14).tolist() == [67716810739261, 51510806800915, 30921347202721, 82619226485591]


def test_v41_primes_and_rows():
    p1, p14 = V41.primes(1), V41.primes(14)
    assert (len(p1), p1[0], p1[-1]) == (24, 16000057, 16000463)
    assert (len(p14), p14[0], p14[-1]) == (24, 16000477, 16000889)
    assert V41.rows(1) == 384_006_168
    assert V41.rows(14) == 384_016_682
    assert V41.row_bytes == 264


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_primes_distinct_ascending_prime(name):
    spec = PRESETS[name]
    allp = np.concatenate([spec.primes(L) for L in spec.layer_ids]).tolist()
    assert allp == sorted(set(allp))
    assert all(is_prime(p) for p in allp)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_offsets_lay_ranges_end_to_end(name):
    spec = PRESETS[name]
    for L in spec.layer_ids:
        p, o = spec.primes(L), spec.offsets(L)
        assert o[0] == 0 and (o[1:] == o[:-1] + p[:-1]).all()
        assert o[-1] + p[-1] == spec.rows(L)


def test_products_stay_below_int64():
    for spec in PRESETS.values():
        for L in spec.layer_ids:
            m = spec.multipliers(L)
            assert (m % 2 == 1).all()
            assert int(m.max()) * (spec.compressed_vocab_size - 1) < 2**63


def test_paper_demo_rows():
    demo = preset("engram-paper-demo")
    for L in demo.layer_ids:
        assert abs(demo.rows(L) - 10.34e6) < 0.01e6


def test_scaled_spec_keeps_primes_prime_and_multipliers():
    small = preset("deepseek-v4.1-flash", scale=1000)
    assert small.name == "deepseek-v4.1-flash/1000"
    for L in small.layer_ids:
        assert all(is_prime(int(p)) for p in small.primes(L))
        assert (small.primes(L) >= 16_000).all() and (small.primes(L) < 17_000).all()
        assert (small.multipliers(L) == V41.multipliers(L)).all()
    assert small.scaled(1).rows(1) == V41.rows(1) and small.scaled(1).name == V41.name
    assert small.scaled(10).name == "deepseek-v4.1-flash/10"


def test_json_round_trip():
    assert EngramSpec.from_json(V41.to_json()) == V41


BASE = dict(name="t", layer_ids=(1,), max_ngram=3, n_heads=2, engram_vocab_size=100,
            compressed_vocab_size=50, row_dim=4, row_format="fp32")


@pytest.mark.parametrize("bad", [
    {"max_ngram": 1}, {"n_heads": 0}, {"engram_vocab_size": (100, 100, 100)}, {"layer_ids": ()},
    {"layer_ids": (1, 1)}, {"compressed_vocab_size": 1}, {"scale": 0}, {"scale": 60},
    {"row_format": "int3"},
])
def test_bad_spec_values_raise(bad):
    with pytest.raises(ValueError):
        EngramSpec(**{**BASE, **bad})


def test_unknown_names_raise():
    with pytest.raises(KeyError, match="presets are"):
        preset("nope")
    with pytest.raises(KeyError, match="layers are"):
        V41.primes(2)
    with pytest.raises(ValueError, match="unknown spec fields"):
        EngramSpec.from_dict({**V41.to_dict(), "colour": 1})
