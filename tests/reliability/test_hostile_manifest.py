"""A hostile manifest in Mooncake (any host of the pool can write it): `tierstore
fetch-manifest` refuses a nested, huge or NaN-bearing one with a clear error, no
traceback, and records nothing in the local catalog; the genuine one, published
again, is fetched as before. Against a real Mooncake cluster on loopback."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tierstore.store.catalog import MAX_RECORD_BYTES, Catalog
from tierstore.tiers.remote.publish import prefix

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mooncake_cluster import local_cluster  # noqa: E402

pytestmark = pytest.mark.reliability


@pytest.fixture
def cluster(tmp_path):
    with local_cluster(tmp_path / "mooncake-logs", stores=1) as c:
        yield c


def _hostile(genuine: bytes) -> dict[str, tuple[bytes, str]]:
    """name -> (manifest bytes, what the error must say)."""
    d = json.loads(genuine)
    nested = dict(d, manifest=dict(d["manifest"], spec={"x": json.loads("[" * 60 + "]" * 60)}))
    nested = json.dumps(nested).replace("[" * 60 + "]" * 60, "[" * 200_000 + "]" * 200_000).encode()
    nan = json.dumps(dict(d, manifest=dict(d["manifest"], spec={"scale": float("nan")}))).encode()
    huge = genuine[:-1] + b" " * MAX_RECORD_BYTES + b"}"  # valid JSON, only over the size limit
    return {"nested": (nested, "nested 200003 levels deep, over the limit of 64"),
            "nan": (nan, "NaN is not a JSON number"),
            "huge": (huge, f"over the {MAX_RECORD_BYTES >> 20} MiB limit")}


def test_a_hostile_manifest_is_refused_and_records_nothing(cluster, make_table, data_dir, tmp_path, cli):
    tv, _ = make_table("emb", rows=600, row_bytes=64)
    args = ["--table", "emb", "--mooncake", cluster.master_addr, "--metadata", cluster.metadata]
    code, _, err = cli("publish", "--data", data_dir, *args)
    assert code == 0, err
    store = cluster.connect()
    try:
        key = prefix("emb", tv.number) + "manifest"
        genuine = bytes(store.get_batch([key])[0])
        other = tmp_path / "host-b"
        for name, (raw, says) in _hostile(genuine).items():
            assert store.upsert(key, raw) == 0, name
            code, out, err = cli("fetch-manifest", "--data", other, *args)
            assert code == 1, (name, out, err[-2000:])
            assert "manifest in Mooncake is refused" in err and says in err, (name, err[-2000:])
            assert "Traceback" not in err and len(err) < 2000, name
            assert not other.exists(), f"{name}: a refused manifest created {other}"
        assert store.upsert(key, genuine) == 0
    finally:
        store.close()
    code, _, err = cli("fetch-manifest", "--data", other, *args)
    assert code == 0, err
    with Catalog(other, readonly=True) as cat:
        assert cat.current("emb") == tv
