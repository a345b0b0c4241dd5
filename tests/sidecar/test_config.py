"""ServeConfig refuses values that would break the sidecar later."""
from __future__ import annotations

import os

import pytest

from tierstore.sidecar.config import ServeConfig


@pytest.fixture
def base(tmp_path):
    return dict(data_dir=tmp_path, socket=tmp_path / "s.sock")


@pytest.mark.parametrize("ttl", [float("nan"), float("inf"), 1e17, 0.0, -1.0])
def test_bad_lease_ttl_is_refused(base, ttl):
    with pytest.raises(ValueError, match="--lease-ttl"):
        ServeConfig(**base, lease_ttl_s=ttl)


@pytest.mark.parametrize("field,value,flag", [
    ("workers", 0, "--workers"), ("workers", -3, "--workers"), ("workers", 10**6, "--workers"),
    ("max_leases", 0, "--max-leases"), ("max_leases", 10**12, "--max-leases"),
    ("max_leases", 65536, "--max-leases"),  # a row's pin count (slot_table.PIN_MAX) could then saturate
    ("max_leases_per_client", 0, "--max-leases-per-client"), ("max_leases_per_client", -1, "--max-leases-per-client"),
    ("max_client_share", 0.0, "--max-client-share"), ("max_client_share", 1.5, "--max-client-share"),
    ("max_client_share", float("nan"), "--max-client-share"),
    ("metrics_port", -1, "--metrics-port"), ("metrics_port", 0, "--metrics-port"),
    ("metrics_port", 70000, "--metrics-port"),
    ("verify_sample", float("nan"), "--verify-sample"), ("verify_sample", 1.5, "--verify-sample"),
    ("receive_timeout_s", float("inf"), "--receive-timeout"), ("policy", "lfu2", "policy kind 'lfu2'"),
    ("hot_set_interval_s", -1.0, "--hot-set-interval"), ("hot_set_interval_s", float("nan"), "--hot-set-interval"),
    ("arena_pages", "2M", "--arena-pages .*'2M': one of auto, huge, small"),
])
def test_bad_numbers_are_refused(base, field, value, flag):
    with pytest.raises(ValueError, match=flag):
        ServeConfig(**base, **{field: value})


def test_sane_values_pass(base):
    cfg = ServeConfig(**base, lease_ttl_s=86400, workers=1, max_leases=1, metrics_port=65535, verify_sample=0)
    assert cfg.lease_ttl_s == 86400


def test_cli_serve_refuses_a_nan_lease_ttl_with_exit_2(cli, tmp_path):
    code, _, err = cli("serve", "--data", tmp_path, "--socket", tmp_path / "s.sock", "--lease-ttl", "nan")
    assert code == 2 and "--lease-ttl" in err and "Traceback" not in err
    assert not (tmp_path / "s.sock").exists()


@pytest.mark.parametrize("value", ["0", "-1"])
def test_cli_serve_refuses_a_per_client_lease_bound_below_one_with_exit_2(cli, tmp_path, value):
    """0 used to mean no bound at all and -1 a sidecar that started and refused every plan."""
    code, _, err = cli("serve", "--data", tmp_path, "--socket", tmp_path / "s.sock", "--max-leases-per-client", value)
    assert code == 2 and "--max-leases-per-client must be 1..61440" in err and "Traceback" not in err
    assert not (tmp_path / "s.sock").exists()


def test_auth_token_file(tmp_path, monkeypatch):
    monkeypatch.delenv("TIERSTORE_AUTH_TOKEN", raising=False)
    f = tmp_path / "token"
    f.write_text("s3cret\n")
    os.chmod(f, 0o600)
    cfg = ServeConfig.from_env(data_dir=tmp_path, listen="127.0.0.1:1", allow_tcp=True, auth_token_file=f)
    assert cfg.auth_token == "s3cret"
    monkeypatch.setenv("TIERSTORE_AUTH_TOKEN", "from-env")  # the flag wins over the environment
    assert ServeConfig.from_env(data_dir=tmp_path, socket=tmp_path / "s", auth_token_file=f).auth_token == "s3cret"
    os.chmod(f, 0o640)
    with pytest.raises(ValueError, match="chmod 600"):
        ServeConfig(data_dir=tmp_path, socket=tmp_path / "s", auth_token_file=f)
    with pytest.raises(ValueError, match="cannot read"):
        ServeConfig(data_dir=tmp_path, socket=tmp_path / "s", auth_token_file=tmp_path / "missing")
    with pytest.raises(ValueError, match="once"):
        ServeConfig(data_dir=tmp_path, socket=tmp_path / "s", auth_token="x", auth_token_file=f)


def test_warm_start_flags_and_environment_map_onto_the_config(base, monkeypatch):
    monkeypatch.setenv("TIERSTORE_WARM_START", "0")
    monkeypatch.setenv("TIERSTORE_HOT_SET_INTERVAL_S", "12.5")
    cfg = ServeConfig.from_env(**base)
    assert cfg.warm_start is False and cfg.hot_set_interval_s == 12.5
    assert ServeConfig.from_env(**base, hot_set_interval_s=0.0).hot_set_interval_s == 0.0  # a flag wins


def test_arena_pages_from_the_environment(base, monkeypatch):
    assert ServeConfig(**base).arena_pages == "auto"  # huge pages by default, where the host gives them
    monkeypatch.setenv("TIERSTORE_ARENA_PAGES", "small")
    assert ServeConfig.from_env(**base).arena_pages == "small"
    assert ServeConfig.from_env(**base, arena_pages="huge").arena_pages == "huge"  # a flag wins


def test_cli_serve_refuses_an_unknown_startup_pause_point_with_exit_2(cli, tmp_path, monkeypatch):
    """TIERSTORE_STARTUP_PAUSE is read into the config with the rest, so a misspelt point is
    refused with the list of points instead of a start-up that never pauses."""
    monkeypatch.setenv("TIERSTORE_STARTUP_PAUSE", "tabels")
    code, _, err = cli("serve", "--data", tmp_path, "--socket", tmp_path / "s.sock")
    assert code == 2 and "TIERSTORE_STARTUP_PAUSE='tabels' names no point of start-up" in err, err
    assert "leases, arena, loaded, published, tables, bound, started" in err and "Traceback" not in err
    assert not (tmp_path / "s.sock").exists()
    monkeypatch.setenv("TIERSTORE_STARTUP_PAUSE", "tables")
    assert ServeConfig.from_env(data_dir=tmp_path, socket=tmp_path / "s.sock").startup_pause == "tables"
