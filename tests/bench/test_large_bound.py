"""bench large's bound on the hit ratio: the hit ratio of an arena that never lets a row
go, which LRU replayed over the same steps reaches when the run asks no more rows than
the arena holds, and no policy passes at any capacity."""
import numpy as np
import pytest

from tierstore.bench.cache import replay_steps
from tierstore.bench.large import PHASES, _asked_and_bound
from tierstore.cache.policy import PolicyConfig

ROWS = 5_000


def _phases(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    sizes = {"cold_prefill": (3, 400), "cold_decode": (20, 40), "warmup": (5, 400), "steady_prefill": (3, 400),
             "steady_decode": (20, 40)}
    # Zipf-like ids, two layers; repeats inside a step are asked once
    return {p: [[np.minimum(rng.zipf(1.2, size) - 1, ROWS - 1).astype(np.int64) for _layer in range(2)]
                for _ in range(n)] for p, (n, size) in sizes.items()}


def _steps(phases, j):
    return [st[j] for p in PHASES for st in phases[p]]


@pytest.mark.parametrize("j", [0, 1])
def test_the_bound_is_lru_with_room_for_every_row_and_no_policy_passes_it(j):
    phases = _phases()
    n_cold = len(phases["cold_prefill"]) + len(phases["cold_decode"])
    n_warm = n_cold + len(phases["warmup"])
    so_far, (cold, steady) = _asked_and_bound(phases, j, ROWS, n_cold, n_warm)
    steps = _steps(phases, j)
    distinct = so_far["steady_decode"]
    assert list(so_far) == list(PHASES) and list(so_far.values()) == sorted(so_far.values())
    assert distinct == np.unique(np.concatenate(steps)).size
    # room for every row the run asks: LRU never lets one go and is the bound, cold and steady
    assert replay_steps(steps[:n_cold], ROWS, distinct, PolicyConfig(kind="lru")) == pytest.approx(cold)
    assert replay_steps(steps, ROWS, distinct, PolicyConfig(kind="lru"), count_from=n_warm) == pytest.approx(steady)
    # a quarter of the room: rows leave, and neither LRU nor ours reaches the bound
    small = distinct // 4
    for config in (PolicyConfig(kind="lru"), PolicyConfig()):
        assert replay_steps(steps, ROWS, small, config, count_from=n_warm) < steady
