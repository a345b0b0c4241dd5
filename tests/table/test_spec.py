"""EngramSpec: the published DeepSeek-V4.1 constants and spec validation."""
import numpy as np
import pytest

from tierstore.table.spec import PRESETS, EngramSpec, is_prime, preset
from tierstore.table.hf_config import spec_from_config

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


# DeepSeek-V4.1-Flash config.json as published (Engram fields nest under text_config)
V41_CONFIG = {
    "model_type": "deepseek_v41", "image_token_id": 129264,
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32], "scale_fmt": "ue8m0"},
    "text_config": {"hidden_size": 5120, "hc_mult": 4, "rms_norm_eps": 1e-20, "engram_layer_ids": [1, 14],
                    "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4,
                    "engram_n_heads": 8, "engram_head_dim": 256, "engram_vocab_size": 16000000,
                    "engram_pad_token_id": 2, "engram_compressed_vocab_size": 99092},
}


def test_v41_preset_is_its_config_json(tmp_path):
    assert (V41.hidden_size, V41.hc_mult, V41.rms_norm_eps, V41.image_token_id) == (5120, 4, 1e-20, 129264)
    assert V41.use_conv is False
    (tmp_path / "config.json").write_text(__import__("json").dumps(V41_CONFIG))
    assert spec_from_config(tmp_path, name="deepseek-v4.1-flash") == V41
    assert spec_from_config(V41_CONFIG).name == "deepseek_v41"
    assert EngramSpec.from_json(V41.to_json()) == V41


def test_from_config_refuses_what_would_rehash_the_table():
    from tierstore.errors import SpecMismatch

    bad = {**V41_CONFIG, "text_config": {**V41_CONFIG["text_config"], "engram_num_embeddings": [384006168, 1]}}
    with pytest.raises(SpecMismatch, match="layer 14 has 1 rows.*gives 384016682"):
        spec_from_config(bad)
    gone = {**V41_CONFIG, "text_config": {k: v for k, v in V41_CONFIG["text_config"].items() if k != "engram_n_heads"}}
    with pytest.raises(SpecMismatch, match="no engram_n_heads"):
        spec_from_config(gone)


@pytest.mark.parametrize("field, value, why", [
    ("n_heads", 10 ** 7, r"n_heads = 10000000 is outside 1\.\.256"),
    ("engram_vocab_size", int("9" * 4000), r"engram_vocab_size = a 4000-digit number is outside 2\.\.1099511627776"),
    ("max_ngram", 10 ** 6, r"max_ngram = 1000000 is outside 2\.\.16"),
    ("compressed_vocab_size", -5, r"compressed_vocab_size = -5 is outside"),
    ("layer_ids", tuple(range(200)), r"200 layers x 3 n-gram orders x 8 heads is 4800 hash buckets, over the limit"),
    ("n_heads", 8.0, r"n_heads must be an integer, got 8\.0"),
    ("hc_mult", True, r"hc_mult must be an integer, got True"),
    ("rms_norm_eps", float("nan"), r"rms_norm_eps must be a finite number"),
], ids=["heads", "vocab-digits", "ngram", "negative-C", "buckets", "float", "bool", "nan-eps"])
def test_every_field_is_bounded_before_the_prime_search(field, value, why):
    """A hostile config must not start a prime search of hours: each field is refused at
    construction, in well under a second."""
    import time

    base = PRESETS["deepseek-v4.1-flash"].to_dict()
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=why):
        EngramSpec.from_dict({**base, field: value})
    assert time.perf_counter() - t0 < 1.0


def test_the_largest_spec_within_the_limits_derives_in_seconds():
    """The prime search is bounded by LIMITS and MAX_BUCKETS: its worst case (every bucket
    from the same start, the largest vocabulary) finishes, and matches a plain search."""
    import time

    from tierstore.table.spec import LIMITS, MAX_BUCKETS, is_prime

    t0 = time.perf_counter()
    big = EngramSpec(name="big", layer_ids=tuple(range(64)), max_ngram=2, n_heads=MAX_BUCKETS // 64,
                     engram_vocab_size=LIMITS["engram_vocab_size"][1], compressed_vocab_size=1 << 20,
                     row_dim=256, row_format="fp8-e4m3-ue8m0")
    primes = np.concatenate([big.primes(L) for L in big.layer_ids])
    assert time.perf_counter() - t0 < 60
    n, plain = LIMITS["engram_vocab_size"][1] - 1, []
    while len(plain) < MAX_BUCKETS:  # the definition: each bucket the next prime no earlier bucket took
        n += 1
        if is_prime(n):
            plain.append(n)
    assert primes.tolist() == plain
