"""tierstore's sglang plugin as sglang loads it (its own load_plugins(): the entry point, then
HookRegistry.apply_hooks): what it refuses at start, with the fix, instead of letting sglang fall
back to its own full host table, and what a mapped layer costs after a sidecar restart."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import sglang_plugins  # noqa: E402
from sglang_engram import build_engram  # noqa: E402
from v41_checkpoint import write_checkpoint  # noqa: E402

from tierstore.client.client import Client
from tierstore.client.engines import checks, seams
from tierstore.client.engines import sglang as ts_sglang
from tierstore.ingest.checkpoint import ingest_checkpoint
from tierstore.sidecar.launcher import SidecarProcess

HOST_TABLE = "SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE"


def _refused(socket, **env) -> str:
    """sglang's load_plugins() with the plugin on: the message it exits with (SystemExit, which
    load_plugins does not swallow); the host-table flag must not have been set."""
    with pytest.raises(SystemExit) as e:
        with sglang_plugins.loaded(TIERSTORE_SGLANG_SOCKET=socket, **env):
            pass
    assert HOST_TABLE not in os.environ
    return str(e.value)


def test_another_sglang_version_stops_the_start_naming_the_supported_ones(sglang_engram, tmp_path, monkeypatch):
    monkeypatch.setitem(checks.SUPPORTED, "sglang", ("sglang", ("0.5.24",)))
    msg = _refused(tmp_path / "ts.sock")
    assert msg.startswith("tierstore: EngineRefused:")
    assert "supports sglang 0.5.24, found 0.5.23" in msg and "unset TIERSTORE_SGLANG_SOCKET" in msg


def test_a_seam_sglang_renamed_stops_the_start_instead_of_a_full_host_table(sglang_engram, tmp_path, monkeypatch):
    """sglang logs and drops a plugin's exceptions and its failed hooks: with _init_host_table
    gone the plugin must stop the process itself, before it turns the host table on."""
    monkeypatch.delattr(sglang_engram[0].EngramEmbedding, "_init_host_table")
    msg = _refused(tmp_path / "ts.sock")
    assert "no sglang.srt.layers.engram.EngramEmbedding._init_host_table" in msg
    assert "its own full Engram host table" in msg and "unset TIERSTORE_SGLANG_SOCKET" in msg


def test_a_seam_missing_from_sglangs_source_stops_the_start_naming_it(sglang_engram, tmp_path, monkeypatch):
    """sglang's load_plugins() runs the manifest check (seams.py) before any hook is registered:
    with EngramRowStager.from_model renamed in sglang's source (as the check reads it), the
    process stops naming that seam, the version and the fix, the host-table flag unset."""
    read = seams.source_of

    def renamed(module):
        text = read(module)
        return text.replace("def from_model(", "def build(") if module.endswith("engram_staging") else text

    monkeypatch.setattr(seams, "source_of", renamed)
    msg = _refused(tmp_path / "ts.sock")
    assert ("sglang.srt.layers.engram_staging:EngramRowStager.from_model(cls, model, hasher, device): not defined"
            in msg)
    assert "this install of sglang 0.5.23 lacks or changed 1 of them" in msg and "unset TIERSTORE_SGLANG_SOCKET" in msg


@pytest.mark.parametrize("env, feature", [
    ({"SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS": "1"}, "peer shards (SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS)"),
    ({"SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT": "per_rank"},
     "per_rank host-table layout (SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT)"),
    ({"SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT": "numa_shared"}, ts_sglang.NUMA_SHARED),
])
def test_engram_settings_that_would_bypass_tierstore_stop_the_start(sglang_engram, tmp_path, env, feature):
    msg = _refused(tmp_path / "ts.sock", **env)
    assert f"refuses {feature}" in msg and checks.feature("sglang", feature).fix in msg


def test_dummy_weights_are_refused_at_start(sglang_engram, tmp_path):
    """sglang's start checks its ServerArgs before it spawns a process: the plugin refuses there
    (before sglang's own checks), so the dummy initialiser never writes the read-only arena."""
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path=str(tmp_path), load_format="dummy")
    with sglang_plugins.loaded(TIERSTORE_SGLANG_SOCKET=tmp_path / "ts.sock"):
        with pytest.raises(checks.EngineRefused, match="refuses --load-format dummy"):
            server_args.check_server_args()


def test_sglangs_defaults_start_with_staged_tables(sglang_engram, tmp_path):
    """sglang's defaults, the overlap scheduler on, and speculative decoding (DSpark, what V4.1
    runs) pass the plugin's start check with every table staged (cache mode) or mapped: a batch
    whose tokens are on the device is staged at its ForwardBatch (test_sglang_stager.py). The
    hook that does so, on ForwardBatch.init_new, is one of those the start requires applied."""
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import ServerArgs

    write_checkpoint(tmp_path / "ckpt")
    ingest_checkpoint(tmp_path / "ckpt", tmp_path / "data", progress=False, layers=[1])
    socket = tmp_path / "ts.sock"
    for extra in ((), ("--split-layout", "all")):
        with SidecarProcess(tmp_path / "data", socket, dram_budget="64MiB", extra_args=extra):
            with sglang_plugins.loaded(TIERSTORE_SGLANG_SOCKET=socket):
                assert ts_sglang.FORWARD_BATCH_TARGET in ts_sglang.REQUIRED
                assert ts_sglang.FORWARD_BATCH_TARGET in HookRegistry._patched
                defaults = ServerArgs(model_path=str(tmp_path))
                assert not defaults.disable_overlap_schedule
                ts_sglang.check_server_args(defaults)
                ts_sglang.check_server_args(ServerArgs(model_path=str(tmp_path), speculative_algorithm="DSPARK"))


def test_a_sidecar_restart_costs_one_describe_not_one_per_forward(tmp_path, sglang_engram, monkeypatch):
    """After the sidecar restarts (same version), the mapped layer's retired arena is checked
    against what the new one serves once; the forwards after it read one header byte."""
    write_checkpoint(tmp_path / "ckpt")
    ingest_checkpoint(tmp_path / "ckpt", tmp_path / "data", progress=False, layers=[1])
    text = json.loads((tmp_path / "ckpt" / "config.json").read_text())["text_config"]
    socket = tmp_path / "ts.sock"
    split = ("--split-layout", "all")
    with SidecarProcess(tmp_path / "data", socket, dram_budget="64MiB", extra_args=split):
        with sglang_plugins.loaded(TIERSTORE_SGLANG_SOCKET=socket):
            fed, _ = build_engram(sglang_engram, dict(root=tmp_path, text=text), 1)
    describes = []
    call = Client._call

    def counted(self, method, request, retry=True):
        describes.append(method) if method == "DescribeTable" else None
        return call(self, method, request, retry)

    monkeypatch.setattr(Client, "_call", counted)
    ids = torch.zeros(3, 9, dtype=torch.int64)
    x = torch.ones(3, text["hc_mult"], text["hidden_size"], dtype=torch.bfloat16)
    with SidecarProcess(tmp_path / "data", socket, dram_budget="64MiB", extra_args=split):
        with torch.no_grad():
            outs = [fed(x, ids, None, input_ids=ids[:, 0]) for _ in range(5)]
    assert describes == ["DescribeTable"]
    assert all(torch.equal(o, outs[0]) for o in outs)
