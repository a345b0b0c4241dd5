"""tierstore's vLLM plugin with vLLM's real Engram module and a real sidecar serving a
synthetic V4.1-layout checkpoint split-layout.

Every `ParallelEngramEmbedding` here is built by its own __init__ in vLLM's distributed
world of one process on its CPU platform (the `vllm_world` fixture, vllm_engram.py): the
plugin's allocation, the weight loader vLLM hands the checkpoint tensors to, vLLM's plugin
loader and entry point, and the checkpoint read through safetensors as vLLM's loader reads
it. Not on CPU: `_storage()` turns host tables into CUDA UVA views with vLLM's compiled `_C`
op; bench/gpu_check_engines.py runs it and `_engram_lookup_kernel` over the arena on a GPU.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (make engine-deps-vllm installs it without CUDA)", allow_module_level=True)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_engram  # noqa: E402
from v41_checkpoint import CONFIG, INDEX, edit_rows, write_checkpoint  # noqa: E402

from tierstore import errors  # noqa: E402
from tierstore.client.client import Client  # noqa: E402
from tierstore.client.engines import checks, vllm_plugin  # noqa: E402
from tierstore.ingest.checkpoint import ingest_checkpoint  # noqa: E402
from tierstore.sidecar.launcher import SidecarProcess  # noqa: E402

engram = pytest.importorskip("vllm.models.deepseek_v41.common.engram")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A sidecar serving both Engram layers of one synthetic checkpoint split-layout."""
    root = tmp_path_factory.mktemp("vllm")
    arrays = write_checkpoint(root / "ckpt")
    ingest_checkpoint(root / "ckpt", root / "data", progress=False)
    with SidecarProcess(root / "data", dram_budget="64MiB", extra_args=("--split-layout", "all")) as sc:
        yield sc, arrays, root / "ckpt"


@pytest.fixture
def plugin(served):
    sc, arrays, ckpt = served
    vllm_plugin.install(vllm_plugin.VllmPluginConfig(str(sc.socket)))
    yield sc, arrays, ckpt
    vllm_plugin.uninstall()


def _mapped_file(ptr: int) -> str:
    """The file whose mapping in this process holds address `ptr` ('' if anonymous)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= ptr < hi:
            return parts[5] if len(parts) > 5 else ""
    return ""


def test_the_embedding_is_built_in_vllms_tensor_parallel_group(vllm_world, monkeypatch):
    """__init__ reads vLLM's tensor-parallel group, which the vllm_world fixture makes: without
    it (as before initialize_model_parallel) vLLM's constructor stops."""
    from vllm.distributed import parallel_state as ps

    layout = vllm_engram.layout(CONFIG)
    monkeypatch.setattr(ps, "_TP", None)
    with pytest.raises(AssertionError, match="tensor model parallel group is not initialized"):
        engram.ParallelEngramEmbedding(layout.num_embeddings[0], 256, vllm_engram.heads(layout, 0), cpu_offload=True)


@pytest.mark.parametrize("index", [0, 1])
def test_the_embedding_storage_is_the_arena_byte_for_byte_and_in_place(plugin, vllm_world, index):
    sc, arrays, ckpt = plugin
    layout = vllm_engram.layout(CONFIG)
    L = layout.layer_ids[index]
    emb = vllm_world.embedding(layout, index, L)
    w, s = arrays[L]["embed.weight"], arrays[L]["embed.scale"]
    assert emb.weight.dtype == torch.float8_e4m3fn and emb.weight_scale_inv.dtype == torch.uint8
    assert tuple(emb.weight.shape) == w.shape and tuple(emb.weight_scale_inv.shape) == s.shape
    assert np.array_equal(emb.weight.data.view(torch.uint8).numpy(), w)
    assert np.array_equal(emb.weight_scale_inv.data.numpy(), s)
    # no copy: both live in the sidecar's arena file, weights then scales, one buffer
    arena = next(f for f in sc.arena_files() if f".l{L}." in f.name)
    assert _mapped_file(emb.weight.data_ptr()) == str(arena)
    assert _mapped_file(emb.weight_scale_inv.data_ptr()) == str(arena)
    assert emb.weight_scale_inv.data_ptr() == emb.weight.data_ptr() + w.nbytes
    with pytest.raises(ValueError, match="not supported"):
        emb._storage()  # host tables become CUDA UVA views: vLLM's _C op, CUDA only


def test_a_head_shard_is_its_row_range_of_the_same_arena(plugin, vllm_world):
    """Each of two tensor-parallel ranks holds the rows of its ceil(heads / 2) heads (the last
    rank's last head slot padded where the heads are odd): its row range of the same arena,
    in place."""
    sc, arrays, ckpt = plugin
    layout = vllm_engram.layout(CONFIG)
    heads = vllm_engram.heads(layout, 0)
    full = vllm_world.embedding(layout, 0, 1)
    per = -(-len(heads) // 2)
    for rank in (0, 1):
        part = vllm_world.embedding(layout, 0, 1, shards=2, rank=rank)
        start, end = part.vocab_start_idx, part.vocab_end_idx
        assert (part.head_start, part.part_n_hash_cols, part.tp_size) == (rank * per, per, 2)
        assert (start, end) == (sum(heads[:rank * per]), sum(heads[:(rank + 1) * per]))
        assert 0 < end - start < full.num_embeddings
        assert part.weight.data_ptr() == full.weight.data_ptr() + start * 256
        assert np.array_equal(part.weight.data.view(torch.uint8).numpy(), arrays[1]["embed.weight"][start:end])
        assert np.array_equal(part.weight_scale_inv.data.numpy(), arrays[1]["embed.scale"][start:end])


def test_loading_the_checkpoint_checks_its_rows_and_copies_none(plugin, vllm_world):
    sc, arrays, ckpt = plugin
    layout = vllm_engram.layout(CONFIG)
    emb = vllm_world.embedding(layout, 1, 3)
    weight, scale = vllm_engram.checkpoint_tensors(ckpt, 3)
    before = emb.weight.data_ptr()
    emb.weight.weight_loader(emb.weight, weight)
    emb.weight_scale_inv.weight_loader(emb.weight_scale_inv, scale.view(torch.float8_e8m0fnu))
    assert emb.weight.data_ptr() == before
    assert np.array_equal(emb.weight.data.view(torch.uint8).numpy(), arrays[3]["embed.weight"])
    # a checkpoint that is not the table the sidecar serves is refused, naming the fix
    other = weight.view(torch.uint8).clone()
    other[-1] ^= 1
    with pytest.raises(checks.CheckpointMismatch, match="ingest this checkpoint"):
        emb.weight.weight_loader(emb.weight, other.view(torch.float8_e4m3fn))
    with pytest.raises(checks.CheckpointMismatch, match="does not fit"):
        emb.weight.weight_loader(emb.weight, weight[:10])


def test_what_the_plugin_refuses_says_what_to_do(plugin, vllm_world):
    sc, arrays, ckpt = plugin
    layout = vllm_engram.layout(CONFIG)
    with pytest.raises(checks.EngineRefused, match="refuses tables in HBM .*turn cpu_offload on"):
        vllm_world.embedding(layout, 0, 1, cpu_offload=False)
    with pytest.raises(errors.TableNotFound, match="no tierstore table for Engram layer 7"):
        vllm_world.embedding(layout, 0, 7)
    with pytest.raises(checks.CheckpointMismatch, match="ingest the checkpoint vLLM serves"):
        vllm_world.embedding(layout, 0, 3)  # layer 1's sizes against layer 3's table
    with pytest.raises(errors.InvalidArgument, match="outside Engram._create_embedding"):
        vllm_world.embedding(layout, 0, None)


@pytest.mark.parametrize("stage", ["auto", "on"])
def test_a_layer_built_on_the_meta_device_is_vllms_own(served, vllm_world, stage):
    """vLLM's ipc_cache weight-cache loader builds the model under torch.device("meta") and puts its
    daemon's tensors in every parameter: the plugin hands such a layer vLLM's own meta tensors,
    mapping no arena and staging nothing, whether the table would be mapped or staged."""
    sc, arrays, ckpt = served
    vllm_plugin.install(vllm_plugin.VllmPluginConfig(str(sc.socket), verify="off", stage=stage))
    try:
        layout = vllm_engram.layout(CONFIG)
        with torch.device("meta"):
            emb = vllm_world.embedding(layout, 0, 1)
        assert emb.weight.is_meta and emb.weight_scale_inv.is_meta
        assert tuple(emb.weight.shape) == arrays[1]["embed.weight"].shape
        assert not hasattr(emb, "tierstore_staged") and vllm_plugin.staged_tables() is None  # no sidecar asked
    finally:
        vllm_plugin.uninstall()


def test_config_from_the_environment():
    assert vllm_plugin.VllmPluginConfig.from_env({}) is None
    c = vllm_plugin.VllmPluginConfig.from_env({"TIERSTORE_VLLM_SOCKET": "/s", "TIERSTORE_VLLM_TABLES": "1=l1, 14=l14"})
    assert (c.socket, c.tables, c.verify) == ("/s", {1: "l1", 14: "l14"}, "sample")
    with pytest.raises(errors.InvalidArgument, match="LAYER=TABLE"):
        vllm_plugin.VllmPluginConfig.from_env({"TIERSTORE_VLLM_SOCKET": "/s", "TIERSTORE_VLLM_TABLES": "l1"})
    with pytest.raises(errors.InvalidArgument, match="sample, all, off"):
        vllm_plugin.VllmPluginConfig.from_env({"TIERSTORE_VLLM_SOCKET": "/s", "TIERSTORE_VLLM_VERIFY": "some"})


_CHILD = """
import sys
import vllm.plugins
vllm.plugins.load_general_plugins()
from vllm.models.deepseek_v41.common import engram
print(engram.ParallelEngramEmbedding._allocate_weights.__module__)
print(engram.Engram._create_embedding.__module__)
"""


def _children(*envs: dict) -> list[subprocess.CompletedProcess]:
    """_CHILD run in one process per environment (os.environ with `env` over it, None unset),
    all at once: each spends its time importing vLLM."""
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={k: v for k, v in {**os.environ, **env}.items() if v is not None})
             for env in envs]
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


def test_vllm_loads_the_plugin_from_its_entry_point(served, tmp_path):
    sc, arrays, ckpt = served
    on, off, down = _children({"TIERSTORE_VLLM_SOCKET": str(sc.socket)}, {"TIERSTORE_VLLM_SOCKET": None},
                              {"TIERSTORE_VLLM_SOCKET": str(tmp_path / "nobody.sock")})
    assert on.returncode == 0, on.stderr[-3000:]
    assert on.stdout.split() == ["tierstore.client.engines.vllm_plugin"] * 2
    assert off.returncode == 0, off.stderr[-3000:]
    assert off.stdout.split() == [engram.__name__] * 2  # vLLM's own methods without the variable
    assert down.returncode != 0 and "no tierstore sidecar answers there" in down.stderr
    assert "tierstore serve" in down.stderr


def test_another_vllm_version_stops_its_start_naming_the_supported_ones(served):
    """vLLM's load_general_plugins() lets a plugin's error through: the check stops the start."""
    from importlib.metadata import version

    sc, arrays, ckpt = served
    script = ("from tierstore.client.engines import checks\n"
              "checks.SUPPORTED['vllm'] = ('vllm', ('0.31.0',))\n" + _CHILD)
    env = {**os.environ, "TIERSTORE_VLLM_SOCKET": str(sc.socket)}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and run.stdout == ""
    assert f"EngineRefused: tierstore's vllm plugin supports vllm 0.31.0, found {version('vllm')}" in run.stderr
    assert "unset TIERSTORE_VLLM_SOCKET" in run.stderr


def test_a_seam_missing_from_vllm_stops_its_start_naming_it_before_anything_is_patched(served):
    """vLLM's load_general_plugins() runs the manifest check (seams.py) first: with the V2 runner's
    step hook renamed in vLLM's source (as the check reads it), the start fails naming that seam,
    the version and the fix, and vLLM's Engram module keeps its own methods."""
    from importlib.metadata import version

    sc, arrays, ckpt = served
    script = ("import re\n"
              "from tierstore.client.engines import seams\n"
              "read = seams.source_of\n"
              "def renamed(module):\n"
              "    text = read(module)\n"
              "    return re.sub(r'\\bprepare_inputs\\b', 'prepare_inputs_v2', text) "
              "if module.endswith('nvidia.model_state') else text\n"
              "seams.source_of = renamed\n"
              "import vllm.plugins\n"
              "try:\n"
              "    vllm.plugins.load_general_plugins()\n"
              "finally:\n"
              "    from vllm.models.deepseek_v41.common import engram\n"
              "    print(engram.ParallelEngramEmbedding._allocate_weights.__module__)\n")
    env = {**os.environ, "TIERSTORE_VLLM_SOCKET": str(sc.socket)}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and run.stdout.split() == [engram.__name__], run.stderr[-3000:]
    have = version("vllm")
    assert (f"EngineRefused: tierstore's vllm plugin hooks and reads these parts of vllm {have}, and this install of "
            f"vllm {have} lacks or changed 1 of them: vllm.models.deepseek_v41.nvidia.model_state:"
            f"DeepseekV41ModelState.prepare_inputs(self, input_batch, req_states): not defined") in run.stderr
    assert "unset TIERSTORE_VLLM_SOCKET" in run.stderr


def test_stage_on_stages_a_split_layout_table_too(served, vllm_world):
    """TIERSTORE_VLLM_STAGE=on: a split table's layer is staged as well (no rows held), its
    lookup the stored rows of the step staged before it (read with Client.lookup, interleaved
    whatever the arena's layout)."""

    sc, arrays, ckpt = served
    vllm_plugin.install(vllm_plugin.VllmPluginConfig(str(sc.socket), verify="off", stage="on"))
    try:
        emb = vllm_world.embedding(vllm_engram.layout(CONFIG), 0, 1)
        assert emb.weight.shape[0] == 0 and emb.tierstore_staged.full_resident
        ids = np.random.default_rng(3).integers(0, emb.num_embeddings, (5, emb.n_hash_cols))
        out = torch.empty(5, emb.n_hash_cols, 264, dtype=torch.uint8)
        vllm_plugin.staged_tables().step_stager("cpu").stage_ids({1: ids})  # the runner hook, before the forward
        emb.lookup(torch.from_numpy(ids), out)
        rows = np.concatenate([arrays[1]["embed.weight"], arrays[1]["embed.scale"]], axis=1)
        assert np.array_equal(out.numpy(), rows[ids])
    finally:
        vllm_plugin.uninstall()


@pytest.fixture
def own(tmp_path):
    """A checkpoint of the test's own (it changes its files), layer 1 ingested and served split-layout."""
    write_checkpoint(tmp_path / "ckpt")
    ingest_checkpoint(tmp_path / "ckpt", tmp_path / "data", layers=[1], progress=False)
    with SidecarProcess(tmp_path / "data", dram_budget="64MiB", extra_args=("--split-layout", "all")) as sc:
        yield sc, tmp_path / "ckpt", tmp_path / "data"


def _load(world, socket, ckpt: Path, verify: str = "sample"):
    """Layer 1's ParallelEngramEmbedding built under the plugin (`verify`), then loaded from `ckpt` by
    vLLM's own weights iterator (DefaultModelLoader's, the plugin's filter around it): its Engram table
    tensors handed to the embedding's weight loaders as the model's load_weights hands them. Returns it."""
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import default_loader

    vllm_plugin.install(vllm_plugin.VllmPluginConfig(str(socket), verify=verify))
    try:
        emb = _layer_1(world)
        weights = default_loader.DefaultModelLoader(LoadConfig())._get_weights_iterator(
            default_loader.DefaultModelLoader.Source(str(ckpt), None))
        for name, tensor in weights:
            if name == "layers.1.engram.embed.weight":
                emb.weight.weight_loader(emb.weight, tensor)
            elif name == "layers.1.engram.embed.scale":
                emb.weight_scale_inv.weight_loader(emb.weight_scale_inv, tensor)
        return emb
    finally:
        vllm_plugin.uninstall()


def _layer_1(world):
    return world.embedding(vllm_engram.layout(CONFIG), 0, 1)


def test_a_checkpoint_edited_in_place_is_refused_at_load_though_its_size_and_mtime_are_put_back(own, vllm_world):
    """One row that this start's sample does not draw, changed in the ingested shard, which then gets
    its mtime back (`touch -r`): vLLM's load stops at the shard's ctime, naming the layer, the file,
    what differs and both fixes; the old rows are never served."""
    sc, ckpt, data = own
    vllm_plugin.install(vllm_plugin.VllmPluginConfig(str(sc.socket)))
    try:
        drawn = set(_layer_1(vllm_world)._weight_loader.sample())
    finally:
        vllm_plugin.uninstall()
    row = next(r for r in range(len(drawn) + 1) if r not in drawn)
    shard = ckpt / json.loads((ckpt / INDEX).read_text())["weight_map"]["layers.1.engram.embed.weight"]
    before = shard.stat()
    edit_rows(ckpt, 1, "embed.weight", [row], keep_mtime=True)
    after = shard.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)
    with pytest.raises(checks.CheckpointMismatch) as e:
        _load(vllm_world, sc.socket, ckpt)
    msg = str(e.value)
    assert msg.startswith("vllm's Engram layer 1: checkpoint tensor embed.")
    assert f"in {shard}) has the size and header of the tensor tierstore table l1 v1 was ingested from" in msg
    assert f"ctime_ns {after.st_ctime_ns} (ingest: {before.st_ctime_ns})" in msg and "mtime_ns" not in msg
    assert "start with TIERSTORE_VLLM_VERIFY=all" in msg
    assert "ingest this checkpoint (`tierstore ingest-checkpoint`)" in msg


def test_an_unchanged_copy_with_new_times_is_refused_sampled_starts_under_all_and_binds_once_ingested(
        own, vllm_world, tmp_path, caplog):
    """The ingested checkpoint copied (another host, a restore): the same bytes in other files with
    other times. A sampled start refuses it, naming verify=all; under all it starts (its digest is
    ingest's) with a warning that re-ingesting binds the table to it; re-ingested, sampled starts
    accept it."""
    sc, ckpt, data = own
    copy = tmp_path / "copy"
    shutil.copytree(ckpt, copy, copy_function=shutil.copyfile)
    with pytest.raises(checks.CheckpointMismatch, match=r"has the size and header .* but mtime_ns \d+ \(ingest: "
                                                        r"\d+\), ino \d+ \(ingest: \d+\), ctime_ns .* A copy: start "
                                                        r"with TIERSTORE_VLLM_VERIFY=all"):
        _load(vllm_world, sc.socket, copy)
    with caplog.at_level(logging.WARNING, logger="tierstore.client.engines.checks"):
        emb = _load(vllm_world, sc.socket, copy, verify="all")
    assert sorted(emb._weight_loader.checked) == ["scale", "weight"]
    assert "every byte is the one ingested, but mtime_ns" in caplog.text and "to bind the table to it" in caplog.text
    [(tv, skipped)] = ingest_checkpoint(copy, data, layers=[1], progress=False)
    assert (tv.number, skipped) == (2, False)
    with Client(sc.socket) as c:
        assert c.reload() == [("l1", 1, 2)]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tierstore.client.engines.checks"):
        emb = _load(vllm_world, sc.socket, copy)
    assert sorted(emb._weight_loader.checked) == ["scale", "weight"] and emb._weight_loader.version == 2
    assert caplog.text == ""
