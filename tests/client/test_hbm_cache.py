"""HBMCache: hot rows on the device, bit-identical to reading them from the arena."""
import numpy as np
import pytest
import torch

from tierstore.client.hasher import NgramHasher
from tierstore.client.hbm_cache import HBMCache
from tierstore.client.layer import EngramLayer
from tierstore.client.local import LocalTable
from tierstore.client.spec import EngramSpec
from tierstore.errors import IdOutOfRange, InvalidArgument, SpecMismatch

SPEC = EngramSpec(name="t", layer_ids=(1, 3), max_ngram=3, n_heads=2, engram_vocab_size=300,
                  compressed_vocab_size=40, row_dim=32, row_format="fp8-e4m3-ue8m0",
                  hidden_size=32, hc_mult=2)
N = SPEC.rows(1)


@pytest.fixture(scope="module")
def src():
    return LocalTable.synthetic(SPEC, seed=1)


def test_hits_and_misses_give_bit_identical_output(src):
    ids = np.random.default_rng(0).integers(0, 10, (3, 20))
    rows = NgramHasher(SPEC).hash(ids, 1)
    uniq = np.unique(rows)
    hot = uniq[::2]  # about half the step's rows are cached
    cache = HBMCache.from_source(src, "l1", capacity_rows=512, device="cpu", hot_ids=hot)
    torch.manual_seed(0)
    plain = EngramLayer(SPEC, 1, source=src)
    cached = EngramLayer(SPEC, 1, source=src, hbm_cache=cache)
    cached.load_state_dict(plain.state_dict())
    h = torch.randn(3, 20, 2, 32)
    with torch.no_grad():
        a, b = plain(h, rows), cached(h, rows)
    assert torch.equal(a, b)
    st = cache.stats()
    assert st["hits"] == hot.size and st["misses"] == uniq.size - hot.size
    assert cache.pins == 0


def test_lookup_and_seed(src):
    cache = HBMCache(4, SPEC.row_bytes, "cpu", N, table="l1")
    assert (cache.lookup([1, 2, 3]) == -1).all() and cache.misses == 3
    ids = np.array([9, 5, 9, 7, 2, 1])  # hottest first, a duplicate, more than capacity
    n = cache.seed(ids, src.rows("l1")[ids])
    assert n == 4 and cache.resident == 4
    np.testing.assert_array_equal(cache.lookup([9, 5, 7, 2, 1, 3]), [0, 1, 2, 3, -1, -1])
    assert torch.equal(cache.rows, src.rows("l1")[[9, 5, 7, 2]])


def test_refresh_admits_hot_ids_and_evicts_cold(src):
    cache = HBMCache.from_source(src, "l1", capacity_rows=3, device="cpu", hot_ids=[10, 11, 12],
                                 refresh_every=2)
    cache.observe([10, 50, 51], counts=[1, 5, 1])
    assert cache.maybe_refresh(src) == 0  # one step observed, refresh_every=2
    cache.observe([50, 60], counts=[5, 1])
    assert cache.maybe_refresh(src) == 2  # 50, 51 replace the cold 12, 11; 60 does not beat 10 (read again)
    slots = cache.lookup([10, 50])
    assert (slots >= 0).all()
    assert (cache.lookup([11, 12]) == -1).sum() == 2
    assert torch.equal(cache.rows[slots], src.rows("l1")[[10, 50]])
    held = cache.id_at[cache.id_at >= 0]
    assert (cache.slot_of[held] == np.flatnonzero(cache.id_at >= 0)).all()


def test_refresh_waits_for_prepared_steps(src):
    cache = HBMCache.from_source(src, "l1", capacity_rows=2, device="cpu", hot_ids=[1, 2], refresh_every=1)
    layer = EngramLayer(SPEC, 1, source=src, hbm_cache=cache)
    layer.prepare(np.full((1, 1, SPEC.columns), 7))
    assert cache.pins == 1 and cache.maybe_refresh(src) == 0
    with pytest.raises(InvalidArgument, match="prepared step"):
        cache.seed([3], src.rows("l1")[[3]])
    layer.reset()
    assert cache.pins == 0 and cache.maybe_refresh(src) == 1
    assert cache.lookup([7], count=False)[0] >= 0


def test_bad_input(src):
    cache = HBMCache(4, SPEC.row_bytes, "cpu", N, table="l1")
    with pytest.raises(IdOutOfRange, match=f"table 'l1' has {N} rows; id {N} is out of range"):
        cache.lookup([N])
    with pytest.raises(InvalidArgument, match=r"rows must be uint8 \[2, 33\]"):
        cache.seed([1, 2], np.zeros((2, 8), np.uint8))
    with pytest.raises(SpecMismatch, match="HBMCache holds"):
        EngramLayer(SPEC, 3, source=src, hbm_cache=cache)
