"""HBMCache: hot rows on the device, bit-identical to reading them from the arena."""
import numpy as np
import pytest
import torch

from tierstore.table.hasher import NgramHasher
from tierstore.client.model.hbm_cache import HBMCache
from tierstore.client.model.layer import EngramLayer
from tierstore.client.model.in_process_table import InProcessTable
from tierstore.table.spec import EngramSpec
from tierstore.errors import IdOutOfRange, InvalidArgument, SpecMismatch

SPEC = EngramSpec(name="t", layer_ids=(1, 3), max_ngram=3, n_heads=2, engram_vocab_size=300,
                  compressed_vocab_size=40, row_dim=32, row_format="fp8-e4m3-ue8m0",
                  hidden_size=32, hc_mult=2)
N = SPEC.rows(1)


@pytest.fixture(scope="module")
def src():
    return InProcessTable.synthetic(SPEC, seed=1)


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
    assert (cache.find([1, 2, 3]) == -1).all() and cache.misses == 3
    ids = np.array([9, 5, 9, 7, 2, 1])  # hottest first, a duplicate, more than capacity
    n = cache.seed(ids, src.rows("l1")[ids])
    assert n == 4 and cache.resident == 4
    np.testing.assert_array_equal(cache.find([9, 5, 7, 2, 1, 3]), [0, 1, 2, 3, -1, -1])
    assert torch.equal(cache.rows, src.rows("l1")[[9, 5, 7, 2]])


def test_refresh_admits_hot_ids_and_evicts_cold(src):
    cache = HBMCache(3, SPEC.row_bytes, "cpu", N, table="l1", refresh_every=2, admit_margin=0)
    cache.seed([10, 11, 12], src.rows("l1")[[10, 11, 12]], prior=1.0)  # a weak profile: one read at most
    cache.observe([10, 50, 51], counts=[1, 5, 1])
    assert cache.maybe_refresh(src) == 0  # one step observed, refresh_every=2
    cache.observe([50, 60], counts=[5, 1])
    assert cache.maybe_refresh(src) == 2  # 50, 51 replace the cold 12, 11; 60 does not beat 10 (read again)
    slots = cache.find([10, 50])
    assert (slots >= 0).all()
    assert (cache.find([11, 12]) == -1).sum() == 2
    assert torch.equal(cache.rows[slots], src.rows("l1")[[10, 50]])
    held = cache.id_at[cache.id_at >= 0]
    assert (cache.slot_of[held] == np.flatnonzero(cache.id_at >= 0)).all()


def test_a_profiles_head_outlasts_one_off_reads(src):
    cache = HBMCache.from_source(src, "l1", capacity_rows=4, device="cpu", hot_ids=[10, 11, 12, 13],
                                 refresh_every=1, half_life=64)
    cache.observe([50, 51])
    assert cache.maybe_refresh(src) == 0  # a one-off read does not displace the profile
    for _ in range(40):  # rows read every step for a while outweigh its prior, tail first
        cache.observe([50, 51])
        cache.maybe_refresh(src)
    assert (cache.find([10, 11, 50, 51], count=False) >= 0).all()


def test_a_row_read_about_as_often_as_the_one_it_would_replace_is_not_copied(src):
    cache = HBMCache(2, SPEC.row_bytes, "cpu", N, table="l1", refresh_every=1)
    cache.seed([1, 2], src.rows("l1")[[1, 2]], prior=1.0)
    cache.observe([5])
    assert cache.maybe_refresh(src) == 0  # one read beats a prior of 0.5 by less than the copy costs
    cache.observe([5])
    assert cache.maybe_refresh(src) == 1  # two do


def test_refresh_waits_for_prepared_steps(src):
    cache = HBMCache(2, SPEC.row_bytes, "cpu", N, table="l1", refresh_every=1, admit_margin=0)
    cache.seed([1, 2], src.rows("l1")[[1, 2]], prior=1.0)
    layer = EngramLayer(SPEC, 1, source=src, hbm_cache=cache)
    layer.prepare(np.full((1, 1, SPEC.columns), 7))
    assert cache.pins == 1 and cache.maybe_refresh(src) == 0
    with pytest.raises(InvalidArgument, match="prepared step"):
        cache.seed([3], src.rows("l1")[[3]])
    layer.reset()
    assert cache.pins == 0 and cache.maybe_refresh(src) == 1
    assert cache.find([7], count=False)[0] >= 0


def test_bad_input(src):
    cache = HBMCache(4, SPEC.row_bytes, "cpu", N, table="l1")
    with pytest.raises(IdOutOfRange, match=f"table 'l1' has {N} rows; id {N} is out of range"):
        cache.find([N])
    with pytest.raises(InvalidArgument, match=r"rows must be uint8 \[2, 33\]"):
        cache.seed([1, 2], np.zeros((2, 8), np.uint8))
    with pytest.raises(SpecMismatch, match="HBMCache holds"):
        EngramLayer(SPEC, 3, source=src, hbm_cache=cache)


def _steps(rng, hot, n_steps, B=2, L=8):
    """Row ids [B, L, columns] per step, drawn mostly from `hot` token ids."""
    return [NgramHasher(SPEC).hash(rng.choice(hot, (B, L)), 1) for _ in range(n_steps)]


def test_layer_adapts_the_cache_between_steps_without_being_asked(src):
    rng = np.random.default_rng(0)
    steps = _steps(rng, np.arange(5), 12)  # a small vocabulary: the same rows every step
    cache = HBMCache(256, SPEC.row_bytes, "cpu", N, table="l1", refresh_every=2)
    torch.manual_seed(0)
    plain = EngramLayer(SPEC, 1, source=src)
    cached = EngramLayer(SPEC, 1, source=src, hbm_cache=cache)
    cached.load_state_dict(plain.state_dict())
    with torch.no_grad():
        for rows in steps:
            h = torch.randn(2, 8, 2, 32)
            assert torch.equal(plain(h, rows), cached(h, rows))  # refreshed rows are the table's rows
    assert cache.refreshes >= 1 and cache.resident > 0
    st = cached.stats()
    assert st["tokens"] == 12 * 16 and st["rows_read"] == sum(np.unique(r).size for r in steps)
    assert 0.5 < st["hbm_hit_ratio"] < 1  # first steps miss, later ones hit
    assert st["refresh_bytes"] == cache.stats()["refresh_bytes"] > 0
    assert st["h2d_bytes"] == st["rows_fetched"] * SPEC.row_bytes + st["refresh_bytes"]
    assert plain.stats()["hbm_hit_ratio"] == 0.0


def test_refresh_traffic_is_bounded_per_step(src):
    cache = HBMCache(64, SPEC.row_bytes, "cpu", N, table="l1", refresh_every=1, refresh_bytes=3 * SPEC.row_bytes)
    cache.observe(np.arange(40))
    assert cache.maybe_refresh(src) == 3  # 3 rows' bytes per observed step
    cache.observe(np.arange(40))
    cache.observe(np.arange(40))
    assert cache.maybe_refresh(src) == 6 and cache.resident == 9
    assert cache.stats()["refresh_bytes"] == 9 * SPEC.row_bytes
    frozen = HBMCache(64, SPEC.row_bytes, "cpu", N, table="l1", refresh_every=1, refresh_bytes=0)
    frozen.observe(np.arange(40))
    assert frozen.maybe_refresh(src) == 0 and frozen.resident == 0


def test_cache_follows_a_topic_change(src):
    cache = HBMCache(20, SPEC.row_bytes, "cpu", N, table="l1", refresh_every=1, refresh_bytes=None, half_life=4)
    for ids in [np.arange(20)] * 10 + [np.arange(100, 120)] * 10:
        cache.find(ids)
        cache.observe(ids)
        cache.maybe_refresh(src)
    assert (cache.find(np.arange(100, 120), count=False) >= 0).all()


def test_attachment_reports_per_tier_stats(src):
    from torch import nn

    from tierstore.client.model.attach import attach_engram

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Identity(), nn.Identity()])

        def forward(self, input_ids):
            h = torch.zeros(*input_ids.shape, 2, 32)
            for b in self.blocks:
                h = b(h)
            return h

    model = Model()
    cache = HBMCache(512, SPEC.row_bytes, "cpu", N, table="l1", refresh_every=1)
    att = attach_engram(model, SPEC, src, {1: "blocks.0", 3: "blocks.1"}, hbm_cache={1: cache})
    with torch.no_grad():
        for _ in range(4):
            model(torch.randint(0, 5, (2, 8)))
    st = att.stats()
    assert st["all"]["tokens"] == 4 * 16 and st[1]["hbm_hit_ratio"] > 0 == st[3]["hbm_hit_ratio"]
    assert st["all"]["h2d_bytes"] == st[1]["h2d_bytes"] + st[3]["h2d_bytes"]
    assert st["all"]["h2d_bytes_per_token"] > 0
    att.detach()
