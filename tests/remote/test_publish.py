"""tierstore publish / fetch-manifest against a real Mooncake cluster."""
from __future__ import annotations

import numpy as np

from tierstore.store.catalog import Catalog
from tierstore.tiers.remote.publish import fetch_manifest, prefix


def test_publish_then_fetch_manifest_on_another_host(cluster, make_table, data_dir, tmp_path, cli):
    tv, _ = make_table("emb", rows=3000, row_bytes=64)
    args = ["--table", "emb", "--mooncake", cluster.master_addr, "--metadata", cluster.metadata]
    code, out, err = cli("publish", "--data", data_dir, *args, "--replicas", "2")
    assert code == 0, err
    assert "published" in out
    code, out, _ = cli("publish", "--data", data_dir, *args)
    assert code == 0 and "already published; nothing written" in out

    other = tmp_path / "host-b"
    code, out, err = cli("fetch-manifest", "--data", other, *args)
    assert code == 0, err
    with Catalog(other, readonly=True) as cat, Catalog(data_dir, readonly=True) as src:
        assert cat.current("emb") == tv
        assert np.array_equal(cat.checksums("emb", tv.number), src.checksums("emb", tv.number))
    assert not (other / "tables").exists()  # no rows copied


def test_manifest_goes_last_so_a_half_version_is_invisible(cluster, make_table, data_dir):
    tv, _ = make_table("emb", rows=500, row_bytes=64)
    store = cluster.connect()
    try:
        from tierstore.tiers.remote.publish import publish
        publish(store, data_dir, "emb")
        store.remove(prefix("emb", tv.number) + "manifest", True)  # as if killed before the last put
        import pytest
        from tierstore.errors import VersionNotFound
        with pytest.raises(VersionNotFound, match="not published"):
            fetch_manifest(store, "emb", tv.number)
        _, done = publish(store, data_dir, "emb")  # a re-run completes it
        assert done and fetch_manifest(store, "emb")[0] == tv
    finally:
        store.close()


def test_unknown_table_and_bad_master_are_clear_errors(cluster, data_dir, make_table, cli):
    make_table("emb", rows=10, row_bytes=64)
    code, _, err = cli("publish", "--data", data_dir, "--table", "nope", "--mooncake", cluster.master_addr,
                       "--metadata", cluster.metadata)
    assert code == 2 and "no table 'nope'" in err
    code, _, err = cli("publish", "--data", data_dir, "--table", "emb", "--mooncake", "nohostport",
                       "--metadata", cluster.metadata)
    assert code == 2 and "HOST:PORT" in err
