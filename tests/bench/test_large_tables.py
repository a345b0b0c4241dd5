"""bench large's table in --data: written once per shape and seed, and a rewrite (ab_misses'
seed after bench large's) leaves only the version it wrote, so alternating the two
never fills a disk that holds the table twice."""
from pathlib import Path

from tierstore.bench.large import large_tables
from tierstore.store.catalog import Catalog


def _versions(data) -> dict:
    with Catalog(data, readonly=True) as cat:
        return {t: sorted(v.number for v in cat.versions(t)) for t in cat.tables()}


def test_a_rewrite_at_another_seed_removes_the_versions_bench_wrote_before(tmp_path):
    data = tmp_path / "data"
    for seed in (0, 1, 0):
        _, versions = large_tables(data, 1 / 64, seed=seed, progress=False, log=lambda *a: None)
        assert _versions(data) == {v.table: [v.number] for v in versions}
    for v in versions:  # the old versions' files are gone too, the current one's are whole
        kept = sorted(p.name for p in (data / "tables" / v.table).iterdir() if p.name.startswith("v"))
        assert kept == [f"v{v.number}"]
        assert all((Path(data) / s).stat().st_size > 0 for s in v.segments)
    # the second call of a shape and seed finds its table and writes nothing
    again = [v.number for v in large_tables(data, 1 / 64, seed=0, progress=False, log=lambda *a: None)[1]]
    assert again == [v.number for v in versions]
