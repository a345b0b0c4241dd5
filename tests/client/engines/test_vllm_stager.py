"""vLLM's real Engram classes over a table tierstore serves in cache mode, on CPU.

A real sidecar serves the synthetic V4.1-layout checkpoint's tables in cache
mode (its --dram-budget a quarter of the rows): they are not split-layout, so
the plugin stages them (client/engines/vllm_stager.py). A staged
`ParallelEngramEmbedding` (built by its own __init__ in vLLM's distributed world
of one process on its CPU platform: the `vllm_world` fixture, vllm_engram.py)
holds zero rows; the process's StepStager stages
each step's rows from a host token table (as the runner hook does from the V2
runner's token history) into persistent buffers, and the patched `lookup` reads
them. In the interpreter child, vLLM's own V2 runner state (its RequestState,
InputBatch and DeepseekV41ModelState, built on CPU: vllm_engram.runner_state) feeds
the hook the plugin installs through vLLM's own plugin loader. The reference is vLLM's own `lookup` over
the same table held in memory: its real `_engram_lookup_kernel`, run on CPU
tensors under Triton's interpreter in a child pytest run (TRITON_INTERPRET=1
must be set before Triton is first imported; CUDA_VISIBLE_DEVICES="" keeps
vLLM's Triton kernels real without a GPU driver, vllm/triton_utils/importing.py).
Triton 3.7's interpreter cannot pass a Python bool to a kernel argument that is
not constexpr (it boxes it as int32 under an int1 type and refuses); vLLM passes
SORTED=False that way, so the child teaches the interpreter's argument
conversion bools (`_interpreter_takes_bools`). The kernel itself runs unmodified.
"""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import inspect
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (make engine-deps-vllm installs it without CUDA)", allow_module_level=True)

CHILD = os.environ.get("TIERSTORE_VLLM_STAGER_CHILD") == "1"
if CHILD:
    def _interpreter_takes_bools() -> None:
        import triton.language as tl
        import triton.runtime.interpreter as interpreter

        convert = interpreter._implicit_cvt

        def implicit_cvt(arg):
            if isinstance(arg, bool):
                return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.bool_), tl.int1), tl.int1)
            return convert(arg)

        interpreter._implicit_cvt = implicit_cvt

    _interpreter_takes_bools()

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_engram  # noqa: E402
from segment_damage import flip_row_byte  # noqa: E402
from v41_checkpoint import CONFIG, IMAGE_TOKEN, write_checkpoint  # noqa: E402

from tierstore import errors  # noqa: E402
from tierstore.client.client import Client  # noqa: E402
from tierstore.client.engines import checks, vllm_plugin, vllm_stager  # noqa: E402
from tierstore.client.engines.device_fill import FAST_TOKENS  # noqa: E402
from tierstore.ingest.checkpoint import ingest_checkpoint  # noqa: E402
from tierstore.sidecar.launcher import SidecarProcess  # noqa: E402

engram = pytest.importorskip("vllm.models.deepseek_v41.common.engram")
interp = pytest.mark.skipif(not CHILD, reason="runs in the interpreter child of test_staged_lookup_is_vllms_own")
parent = pytest.mark.skipif(CHILD, reason="runs in the parent process (no interpreter needed)")
LAYERS = (1, 3)
SERVED_ENV = "TIERSTORE_VLLM_STAGER_SERVED"
SAMPLE_ROWS = 64  # rows the load checks here: 4096 would be most of this small table and fill its cache


@pytest.fixture(scope="module")
def cache_model(tmp_path_factory):
    """The checkpoint, its tables served in cache mode (a quarter of the rows fit). The
    interpreter child only reads them: it is handed its parent's (SERVED_ENV: the root and
    the sidecar's socket), its arrays read back from the checkpoint."""
    if CHILD and SERVED_ENV in os.environ:
        root, socket = os.environ[SERVED_ENV].split(os.pathsep)
        tensors = {L: vllm_engram.checkpoint_tensors(Path(root) / "ckpt", L) for L in LAYERS}
        arrays = {L: {"embed.weight": w.view(torch.uint8).numpy(), "embed.scale": s.view(torch.uint8).numpy()}
                  for L, (w, s) in tensors.items()}
        yield dict(root=Path(root), arrays=arrays, ckpt=Path(root) / "ckpt", socket=socket)
        return
    root = tmp_path_factory.mktemp("vllm_stager")
    arrays = write_checkpoint(root / "ckpt")
    ingest_checkpoint(root / "ckpt", root / "data", progress=False)
    rows = sum(a["embed.weight"].shape[0] for a in arrays.values())
    with SidecarProcess(root / "data", dram_budget=str(rows * 264 // 4)) as sc:
        with Client(sc.socket) as c:
            assert all(t["mode"] == "cache" for t in c.stats()["tables"])
        yield dict(root=root, arrays=arrays, ckpt=root / "ckpt", socket=str(sc.socket))


@contextlib.contextmanager
def _installed(cache_model, monkeypatch, config=None):
    """The plugin serving `cache_model`'s sidecar (with `config` where given), checking SAMPLE_ROWS
    rows at load."""
    monkeypatch.setattr(checks, "SAMPLE_ROWS", SAMPLE_ROWS)
    vllm_plugin.install(config or vllm_plugin.VllmPluginConfig(cache_model["socket"]))
    try:
        yield cache_model
    finally:
        vllm_plugin.uninstall()


@pytest.fixture
def plugin(cache_model, monkeypatch):
    with _installed(cache_model, monkeypatch) as served:
        yield served


def _staged(world, layout, index: int, shards: int = 1, rank: int = 0):
    emb = world.embedding(layout, index, layout.layer_ids[index], shards=shards, rank=rank)
    assert isinstance(emb.tierstore_staged, vllm_stager.StagedEngramTable)
    return emb


# ---- against vLLM's own kernel (the interpreter child) -------------------------------------------
@parent
def test_staged_lookup_is_vllms_own_kernel(cache_model):
    """Parent: run the interp_ tests below in a child with TRITON_INTERPRET=1, over this
    module's sidecar."""
    served = f"{cache_model['root']}{os.pathsep}{cache_model['socket']}"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", TIERSTORE_VLLM_STAGER_CHILD="1",
               **{SERVED_ENV: served})
    root = Path(__file__).resolve().parents[3]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "interp_",
                        __file__], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout.splitlines()[-1], r.stdout[-2000:]


def _stager(plugin, embs, capacity: int):
    """The process's StepStager over staged layers `embs`, made the way the runner hook makes
    it (TierstoreEngramTables.step_stager) with `capacity` graph tokens, hashing with tierstore's NgramHasher
    of the checkpoint's config (its compressed ids are the raw ids: C = 500)."""
    from tierstore.table.hasher import NgramHasher
    from tierstore.table.hf_config import spec_from_config

    vllm_plugin.staged_tables().graph_tokens = capacity
    stager = vllm_plugin.staged_tables().step_stager("cpu")
    assert {id(t) for t in stager.tables} == {id(e.tierstore_staged) for e in embs}
    stager.hasher = NgramHasher(spec_from_config(plugin["ckpt"]), np.arange(CONFIG["engram_compressed_vocab_size"]))
    return stager


def _token_steps(rng, sizes, max_len: int = 64):
    """A host token table [requests, max_len] (raw ids < 500, some image tokens) and, per step
    size, (starts, counts) of a batch of that many tokens: decode tokens and prefill chunks."""
    table = rng.integers(0, 499, (8, max_len))
    table[rng.random(table.shape) < 0.03] = IMAGE_TOKEN
    steps = []
    for size in sizes:
        counts = np.ones(min(size, 8), np.int64)
        counts[0] += size - counts.sum()
        starts = rng.integers(0, max_len - counts)
        steps.append((starts.astype(np.int64), counts))
    return table, steps


def _hash_ids(stager, table, starts, counts, L) -> torch.Tensor:
    """vLLM's hash ids of the step's tokens for layer L (int32 [tokens, n_hash_cols]): what its
    `_hash_ids_kernel` computes (tierstore's hasher agrees with it, test_hash_agreement_vllm.py)."""
    w = vllm_stager.windows(table, starts, counts, stager.hasher.order)
    return torch.from_numpy(stager._hash(w)[L].astype(np.int32))


@interp
@pytest.mark.parametrize("shards,rank", [(1, 0), (2, 1)])
def test_interp_bf16_and_packed_rows_equal_vllms_kernel_over_steps(cache_model, vllm_world, monkeypatch, shards,
                                                                  rank):
    """Steps of 1..30 tokens, both layers, staged before the "forward" from the host token
    table: each layer's lookup (bf16, and packed rows into one layer's slot of a [tokens,
    layers, heads, 264] buffer as EngramBatch does) is bit for bit what vLLM's lookup
    (`_engram_lookup_kernel`) writes over the table in memory for the same tokens' hash ids,
    for the whole table and for the second of two head shards (a padded head). Steps up to
    the 24 graph tokens go through the persistent buffers, larger ones through their own. A
    forward reads a step's rows once: the packed lookups read the same tokens staged again."""
    layout = vllm_engram.layout(CONFIG)
    arrays = cache_model["arrays"]
    # vLLM's own layers (its own allocation: built before the plugin is installed)
    owns = [vllm_engram.holding(vllm_world.embedding(layout, index, L, shards=shards, rank=rank, cpu_offload=False),
                                arrays[L]["embed.weight"], arrays[L]["embed.scale"])
            for index, L in enumerate(LAYERS)]
    with _installed(cache_model, monkeypatch) as plugin:
        embs = [_staged(vllm_world, layout, index, shards, rank) for index in range(len(LAYERS))]
        stager = _stager(plugin, embs, capacity=24)
        table, steps = _token_steps(np.random.default_rng(shards), [1, 5, 24, 30, 3])
        for step, (starts, counts) in enumerate(steps):
            stager.stage(vllm_stager.windows(table, starts, counts, 4))
            for emb, own, L in zip(embs, owns, LAYERS):
                ids = _hash_ids(stager, table, starts, counts, L)
                part = emb.part_n_hash_cols
                want = torch.full((len(ids), part, 256), 7.0, dtype=torch.bfloat16)
                got = want.clone()
                own.lookup(ids, want)  # vLLM's lookup: the kernel under the interpreter
                emb.lookup(ids, got)  # tierstore's: the class's patched method, from the staged rows
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"layer {L} step {step} bf16"
                assert (want != 0).any() and (want[:, part - 1] == 0).all() == (shards == 2)  # padded head: zeros
            stager.stage(vllm_stager.windows(table, starts, counts, 4))
            for emb, own, L in zip(embs, owns, LAYERS):
                ids = _hash_ids(stager, table, starts, counts, L)
                part = emb.part_n_hash_cols
                want_p = torch.full((len(ids), 2, part, 264), 9, dtype=torch.uint8)
                got_p = want_p.clone()
                own.lookup(ids, want_p[:, 1])
                emb.lookup(ids, got_p[:, 1])
                assert torch.equal(got_p, want_p), f"layer {L} step {step} packed"


@interp
def test_interp_dequantize_is_the_kernels_arithmetic_for_every_byte_pair(vllm_world):
    """vllm_stager.dequantize against `_engram_lookup_kernel` (PACKED=False) for all 256 e4m3
    bytes under all 256 ue8m0 bytes: bit for bit, zero and inf scales, overflow and NaNs from
    them included, but for what Triton's interpreter itself gets wrong, which is left out and
    counted: it decodes the e4m3 NaN bytes 0x7f / 0xff as +-480 (e4m3fn has no 480: torch and
    the GPU's cvt read NaN), and it rounds products in bf16's subnormal range (|x| < 2^-126,
    reached only with scale bytes under 10, 2^-118) otherwise than IEEE round-to-nearest-even
    (torch's). bench/gpu_check_engines.py compares every pair on a GPU."""
    emb = vllm_world.construct(256, (256,), None, cpu_offload=False)  # one head of 256 rows, vLLM's own
    weight = np.tile(np.arange(256, dtype=np.uint8), (256, 1))  # row s: every e4m3 byte...
    scale = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 8, axis=1)  # ...under scale byte s
    own = vllm_engram.holding(emb, weight, scale)
    want = torch.empty(256, 1, 256, dtype=torch.bfloat16)
    own.lookup(torch.arange(256, dtype=torch.int32)[:, None], want)
    w = want.view(256, 256)
    g = vllm_stager.dequantize(torch.from_numpy(np.concatenate([weight, scale], axis=1)), 256)

    def subnormal(x):
        return (x != 0) & (x.float().abs() < 2.0 ** -126)

    e4m3_nan = torch.from_numpy((weight & 0x7F) == 0x7F)
    left_out = e4m3_nan | subnormal(w) | subnormal(g)
    assert torch.isnan(g[e4m3_nan]).all()
    assert set(torch.nonzero(left_out & ~e4m3_nan)[:, 0].tolist()) <= set(range(1, 10))  # scale bytes 1..9
    assert int(left_out.sum()) < 1000  # of 65,536 pairs
    kept = ~left_out
    assert torch.equal(torch.isnan(w[kept]), torch.isnan(g[kept]))  # 0 x inf, inf - the NaN payload may differ
    same = kept & ~torch.isnan(w)
    assert torch.equal(w[same].view(torch.int16), g[same].view(torch.int16))
    assert torch.isnan(w[kept]).any() and torch.isinf(w[same]).any() and (w[same] == 0).any()


@interp
def test_interp_a_step_staged_through_vllms_v2_runner_is_vllms_own_lookup(cache_model, vllm_world, monkeypatch,
                                                                          tmp_path):
    """The whole path, per supported vLLM version: vLLM's own plugin loader
    (`load_general_plugins()`, TIERSTORE_VLLM_SOCKET set) installs the plugin; both Engram layers are
    built as vLLM's model builds them (`Engram._create_embedding` -> `ParallelEngramEmbedding.__init__`)
    and staged; vLLM's V2 runner state (RequestState holding the requests' tokens, written by vLLM's
    own kernel; DeepseekV41ModelState, the model's NgramHashState built from the tokenizer) runs
    steps of prefill chunks, fresh prompts, decode tokens and speculative verify blocks (drafts in the
    step's input ids, not in the token history) through its `prepare_inputs`, where the plugin stages
    each step from the inputs vLLM's hash reads. vLLM's own hash of the step (NgramHashState.forward over the
    `lookback_token_ids` that prepare_inputs gathered) looked up by vLLM's own kernel over the table
    in memory is, bit for bit, what each staged layer's lookup returns, bf16 and packed. A dummy
    batch (vLLM's profile and padding runs) stages no rows: zeros."""
    import vllm.plugins
    from vllm.config import EngramConfig, ModelConfig, SchedulerConfig
    from vllm.v1.worker.gpu.input_batch import InputBatch

    layout = vllm_engram.layout(CONFIG)
    arrays = cache_model["arrays"]
    owns = [vllm_engram.holding(vllm_world.embedding(layout, index, L, cpu_offload=False), arrays[L]["embed.weight"],
                                arrays[L]["embed.scale"]) for index, L in enumerate(LAYERS)]  # before the plugin
    tokenizer = _tokenizer(tmp_path / "tok", CONFIG["engram_compressed_vocab_size"])
    # the text model's architecture: vLLM's EngramConfig is checked against DeepseekV41ForCausalLM's
    model_config = ModelConfig(model=str(cache_model["ckpt"]), tokenizer=str(tokenizer), max_model_len=64,
                               dtype="bfloat16", limit_mm_per_prompt={"image": 0},
                               hf_overrides={"architectures": ["DeepseekV41ForCausalLM"]})
    config = vllm_engram.vllm_config(
        model_config=model_config, engram_config=EngramConfig(cpu_offload=True),
        scheduler_config=SchedulerConfig(max_model_len=64, is_encoder_decoder=False, max_num_batched_tokens=64,
                                         max_num_seqs=4, enable_chunked_prefill=True))
    monkeypatch.setattr(checks, "SAMPLE_ROWS", SAMPLE_ROWS)
    monkeypatch.setenv("TIERSTORE_VLLM_SOCKET", cache_model["socket"])
    vllm.plugins.load_general_plugins()
    try:
        assert engram.ParallelEngramEmbedding._allocate_weights.__module__ == vllm_plugin.__name__
        embs = [vllm_world.create_embedding(config, layout, index) for index in range(len(LAYERS))]
        assert all(isinstance(e.tierstore_staged, vllm_stager.StagedEngramTable) for e in embs)
        vllm_plugin.staged_tables().graph_tokens = 16  # persistent buffers, as a CUDA resolution sizes them
        model = vllm_engram.V41Model(config, layout)
        state, req_states, buffers = vllm_engram.runner_state(config, model)
        assert type(state).prepare_inputs.__module__ == vllm_plugin.__name__  # patched as its module loaded
        rng = np.random.default_rng(21)
        seqs = {f"r{i}": rng.integers(0, 499, n).tolist() for i, n in enumerate((40, 12, 30, 9))}
        for r, prompt in zip(seqs, (40, 12, 20, 9)):  # r2 resumed with 10 tokens of output
            req_states.add_request(r, prompt, seqs[r], 0, 8)
        req_states.apply_staged_writes()  # vLLM's kernel writes the token history
        forward = inspect.signature(engram.NgramHashState.forward).parameters
        v1_args = (None, None) if "slot_mapping" in forward else ()  # 0.33's forward takes the V1 slot cache
        # a verify step's drafts (DSpark's, proposed on the device) follow each request's last token in the
        # step's input ids only: the token history holds none of them (as under async scheduling it does not
        # yet hold the token the last step is still sampling)
        drafted = {r: t + rng.integers(0, 499, 2).tolist() for r, t in seqs.items()}
        # (request, tokens computed, tokens scheduled): a prefill chunk, a fresh prompt, chunks mid-way
        # through a resumed request, decode tokens, verify blocks; batches up to and past the 16 graph tokens
        for step, (plan, tokens) in enumerate([([("r0", 0, 12), ("r1", 0, 4)], seqs),
                                               ([("r0", 12, 20), ("r2", 0, 2)], seqs),
                                               ([("r0", 39, 1), ("r1", 4, 8), ("r2", 2, 27), ("r3", 0, 9)], seqs),
                                               ([("r2", 29, 1), ("r3", 8, 1)], seqs),
                                               ([("r2", 29, 3), ("r3", 8, 3), ("r1", 11, 3)], drafted)]):
            batch = vllm_engram.input_batch(buffers, req_states, plan, tokens)
            for packed in (False, True):  # two forwards of the batch, each through prepare_inputs
                inputs = state.prepare_inputs(batch, req_states)
                dead = torch.zeros_like(batch.input_ids, dtype=torch.bool)
                lookback = inputs["lookback_token_ids"]  # the persistent window, whole, as the model takes it
                ids = model.engram_hash(batch.input_ids, batch.positions, batch.query_start_loc, dead, lookback,
                                        torch.zeros_like(lookback, dtype=torch.bool), *v1_args)
                for k, (emb, own, L) in enumerate(zip(embs, owns, LAYERS)):
                    shape = (batch.num_tokens, emb.part_n_hash_cols, *((264,) if packed else (256,)))
                    want = torch.full(shape, 9, dtype=torch.uint8 if packed else torch.bfloat16)
                    got = want.clone()
                    own.lookup(ids[:, k], want)  # vLLM's lookup of vLLM's hash: its kernels
                    emb.lookup(ids[:, k], got)  # the staged layer's
                    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (step, L, packed)
                    assert (want != 0).any()
        dummy = InputBatch.make_dummy(2, 6, buffers)  # a profile or padding run: requests the runner does not hold
        state.prepare_inputs(dummy, req_states)
        got = torch.full((6, embs[0].part_n_hash_cols, 256), 9, dtype=torch.bfloat16)
        embs[0].lookup(torch.zeros((6, embs[0].n_hash_cols), dtype=torch.int32), got)
        assert not got.any()
    finally:
        vllm_plugin.uninstall()


# ---- in this process -------------------------------------------------------------------------------
@parent
def test_weight_loading_allocates_nothing_table_sized_and_copies_nothing(plugin, vllm_world):
    """vLLM's own loading path (safetensors_weights_iterator, the model's hf_to_vllm_mapper,
    AutoWeightsLoader) into staged layers: every aten op it runs is recorded, and none
    allocates or copies more than the sampled rows; the placeholders stay zero-row."""
    from torch import nn
    from torch.utils._python_dispatch import TorchDispatchMode
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
    from vllm.model_executor.models.utils import AutoWeightsLoader
    from vllm.models.deepseek_v41.nvidia.model import _make_deepseek_v4_weights_mapper

    layout = vllm_engram.layout(CONFIG)
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleDict()
    for index, L in enumerate(LAYERS):
        layer = nn.Module()
        layer.engram = nn.Module()
        layer.engram.embed_tokens = _staged(vllm_world, layout, index)
        model.model.layers[str(L)] = layer
    table_bytes = min(a["embed.weight"].nbytes for a in plugin["arrays"].values())

    class Recorder(TorchDispatchMode):
        largest, copies = 0, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    Recorder.largest = max(Recorder.largest, t.untyped_storage().nbytes() if func not in VIEWS
                                           else 0)
            if func in COPIES:
                Recorder.copies.append((func, tuple(args[0].shape)))
            return out

    VIEWS = {torch.ops.aten.view.default, torch.ops.aten.narrow.default, torch.ops.aten.slice.Tensor,
             torch.ops.aten.alias.default, torch.ops.aten.detach.default, torch.ops.aten.view.dtype,
             torch.ops.aten._reshape_alias.default, torch.ops.aten.as_strided.default}
    COPIES = {torch.ops.aten.copy_.default, torch.ops.aten.clone.default, torch.ops.aten._to_copy.default}
    files = [str(f) for f in sorted(plugin["ckpt"].glob("*.safetensors"))]
    # the iterator's tensors lie over the files' mappings (test_vllm_plugin.py); what is recorded is
    # what loading does with them
    weights = [(n, t) for n, t in safetensors_weights_iterator(files, use_tqdm_on_load=False) if ".engram.embed." in n]
    with Recorder():
        loaded = AutoWeightsLoader(model).load_weights(weights, mapper=_make_deepseek_v4_weights_mapper("fp8"))
    assert {f"model.layers.{L}.engram.embed_tokens.{p}" for L in LAYERS for p in ("weight", "weight_scale_inv")} \
        <= set(loaded)
    assert 0 < Recorder.largest <= SAMPLE_ROWS * 264 < table_bytes, Recorder.largest  # the sampled rows at most
    assert not [c for c in Recorder.copies if c[1] and c[1][0] > SAMPLE_ROWS], Recorder.copies
    for index, L in enumerate(LAYERS):
        emb = model.model.layers[str(L)].engram.embed_tokens
        assert emb.weight.shape == (0, 256) and emb.weight_scale_inv.shape == (0, 8)
        assert emb.weight.untyped_storage().nbytes() == 0


@parent
def test_a_checkpoint_that_differs_from_tierstores_rows_is_refused_at_load(plugin, vllm_world):
    layout = vllm_engram.layout(CONFIG)
    emb = _staged(vllm_world, layout, 1)
    weight, scale = vllm_engram.checkpoint_tensors(plugin["ckpt"], 3)
    bad = scale.view(torch.uint8).clone()
    bad[-1, 2] ^= 1  # the last row is always among the sampled ones
    with pytest.raises(checks.CheckpointMismatch, match=f"vllm's Engram layer 3: checkpoint tensor embed.scale "
                                                        f"differs from tierstore table l3 v1 at row {len(bad) - 1}:"):
        emb.weight_scale_inv.weight_loader(emb.weight_scale_inv, bad.view(torch.float8_e8m0fnu))
    with pytest.raises(checks.CheckpointMismatch, match="does not fit"):
        emb.weight.weight_loader(emb.weight, weight[:10])


@parent
def test_what_needs_the_real_parameters_is_refused_naming_the_layer(plugin, vllm_world):
    layout = vllm_engram.layout(CONFIG)
    emb = _staged(vllm_world, layout, 0)
    with pytest.raises(vllm_stager.StagingError, match="Engram layer 1 is staged by tierstore .*embedding_across_dp"):
        emb._storage()
    with pytest.raises(checks.EngineRefused, match="refuses tables in HBM .*turn cpu_offload on"):
        vllm_world.embedding(layout, 0, 1, cpu_offload=False)


def _reference(plugin, emb, L, ids: torch.Tensor) -> torch.Tensor:
    """bf16 [tokens, part, 256]: the rank's heads of hash ids `ids` over layer L's table in memory
    (the checkpoint's rows), dequantised by vllm_stager.dequantize, zero where the rank owns no
    row (the interpreter child holds this to vLLM's kernel)."""
    a = plugin["arrays"][L]
    packed = torch.from_numpy(np.concatenate([a["embed.weight"], a["embed.scale"]], axis=1))
    part = emb.part_n_hash_cols
    local = torch.full((ids.shape[0], part), -1, dtype=torch.int64)
    cols = ids[:, emb.head_start:min(emb.head_start + part, emb.n_hash_cols)].long()
    local[:, :cols.shape[1]] = cols
    owned = (local >= emb.vocab_start_idx) & (local < emb.vocab_end_idx)
    rows = vllm_stager.dequantize(packed[local.clamp(min=0)], 256)
    return torch.where(owned[..., None], rows, torch.zeros((), dtype=torch.bfloat16))


@parent
def test_every_step_size_lands_at_its_offsets_in_the_same_buffers_zero_padded(plugin, vllm_world):
    """Graph-sized steps (1..24 tokens, then smaller again) are staged into the same persistent
    storage (data_ptr never changes), and a lookup at each captured size at or above the step
    (what a graph replayed for it reads) gets the step's rows at their token offsets and zero
    rows for the padding; a step past the 24 graph tokens is staged into its own tensors and
    the buffers keep their storage. Each padded read is its own forward of the step (staged
    again: a forward reads a step's rows once)."""
    layout = vllm_engram.layout(CONFIG)
    embs = [_staged(vllm_world, layout, index) for index in range(len(LAYERS))]
    stager = _stager(plugin, embs, capacity=24)
    ptrs = (stager.buffers.weight.data_ptr(), stager.buffers.scale.data_ptr())
    stager.stage_none()  # vLLM's profile run: a dummy batch through prepare_inputs
    profile = torch.full((40, embs[0].part_n_hash_cols, 256), 7.0, dtype=torch.bfloat16)
    embs[0].lookup(torch.zeros((40, embs[0].n_hash_cols), dtype=torch.int32), profile)
    assert (profile == 0).all()
    captured = [1, 2, 4, 8, 16, 24]
    sizes = [*range(1, 25), 7, 1, 30, 2]
    table, steps = _token_steps(np.random.default_rng(7), sizes)
    for size, (starts, counts) in zip(sizes, steps):
        for padded in [p for p in captured if p >= size] or [size]:
            stager.stage(vllm_stager.windows(table, starts, counts, 4))
            assert (stager.buffers.weight.data_ptr(), stager.buffers.scale.data_ptr()) == ptrs
            for emb, L in zip(embs, LAYERS):
                want = _reference(plugin, emb, L, _hash_ids(stager, table, starts, counts, L))
                got = torch.full((padded, emb.part_n_hash_cols, 256), 7.0, dtype=torch.bfloat16)
                emb.lookup(torch.zeros((padded, emb.n_hash_cols), dtype=torch.int32), got)
                assert torch.equal(got[:size].view(torch.int16), want.view(torch.int16)), (L, size, padded)
                assert (got[size:] == 0).all(), (L, size, padded)
        if size <= 24:  # in the buffers (no tensors of its own), zero past the step in every layer
            filled = size * embs[0].part_n_hash_cols
            assert stager._own == [None, None] and (stager.buffers.filled == filled).all()
            assert not stager.buffers.host_weight[:, filled:].any()


@parent
def test_a_layer_whose_fill_was_skipped_raises_never_zeros_or_the_last_steps_rows(plugin, vllm_world, monkeypatch):
    """Every persistent buffer carries the step it was filled for: with one layer's fill skipped
    at the second step, that layer's lookup raises StagingError naming the step its buffer
    holds, while the other layer reads its own step's rows; a second forward of one staged step
    (a forward the hook did not stage) and a lookup before any step raise too."""
    layout = vllm_engram.layout(CONFIG)
    embs = [_staged(vllm_world, layout, index) for index in range(len(LAYERS))]
    stager = _stager(plugin, embs, capacity=24)
    table, steps = _token_steps(np.random.default_rng(13), [6, 6])

    def lookup(emb):
        out = torch.full((6, emb.part_n_hash_cols, 256), 7.0, dtype=torch.bfloat16)
        emb.lookup(torch.zeros((6, emb.n_hash_cols), dtype=torch.int32), out)
        return out

    with pytest.raises(vllm_stager.StagingError, match="holds the rows of step none, and the forward of step 0"):
        lookup(embs[0])
    stager.stage(vllm_stager.windows(table, *steps[0], 4))
    first = [lookup(emb) for emb in embs]
    fill = stager.buffers.fill
    monkeypatch.setattr(stager.buffers, "fill", lambda layer, n, write: None if layer == 1 else fill(layer, n, write))
    stager.stage(vllm_stager.windows(table, *steps[1], 4))
    got = lookup(embs[0])
    want = _reference(plugin, embs[0], LAYERS[0], _hash_ids(stager, table, *steps[1], LAYERS[0]))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)) and not torch.equal(got, first[0])
    with pytest.raises(vllm_stager.StagingError, match="slot 1 holds the rows of step 1, and the forward of step 2 "
                                                       "reads it: that step's fill of this layer did not happen"):
        lookup(embs[1])
    with pytest.raises(vllm_stager.StagingError, match=f"layer {LAYERS[0]} looked up 6 tokens at step 2, which "
                                                       f"tierstore staged for 6 tokens and this layer has read"):
        lookup(embs[0])


@parent
def test_the_windows_hash_as_whole_sequences_do(plugin, vllm_world):
    """The stager's hash of each scheduled token's window (gathered from the host token table
    at the runner's positions) is tierstore's NgramHasher over the whole sequence up to that
    token (which test_hash_agreement_vllm.py holds to vLLM's `_hash_ids_kernel`): pad before
    the sequence's start, image tokens dead, decode tokens and prefill chunks mid-sequence."""
    layout = vllm_engram.layout(CONFIG)
    embs = [_staged(vllm_world, layout, index) for index in range(len(LAYERS))]
    stager = _stager(plugin, embs, capacity=24)
    h = stager.hasher
    table, steps = _token_steps(np.random.default_rng(11), [1, 9, 30])
    table[2, :3] = IMAGE_TOKEN  # dead at the start, and a window reaching before position 0
    for starts, counts in steps:
        starts[0] = 0  # a fresh prefill
        w = vllm_stager.windows(table, starts, counts, 4)
        got = stager._hash(w)
        req = np.repeat(np.arange(counts.size), counts)
        pos = starts[req] + np.arange(req.size) - np.repeat(np.cumsum(counts) - counts, counts)
        assert np.array_equal(w[:, 0], table[req, pos])  # each scheduled token at its position
        for L in LAYERS:
            want = np.stack([h.hash(h.map_raw(table[r, :p + 1]), L, dead=table[r, :p + 1] == IMAGE_TOKEN)[-1]
                             for r, p in zip(req, pos)])
            assert np.array_equal(got[L], want), L


@parent
def test_the_lookup_never_reads_the_device_ids(plugin, vllm_world):
    """The layer's forward takes only the shape of its hash ids (host metadata): no op of the
    lookup reads `indices` (no .cpu() / .to() / .item() / .tolist() of them, each a device sync
    on CUDA), and none makes a Python scalar of a tensor; vLLM's main called `.cpu()` on them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    layout = vllm_engram.layout(CONFIG)
    embs = [_staged(vllm_world, layout, index) for index in range(len(LAYERS))]
    stager = _stager(plugin, embs, capacity=24)
    table, [(starts, counts)] = _token_steps(np.random.default_rng(3), [6])
    stager.stage(vllm_stager.windows(table, starts, counts, 4))
    ids = _hash_ids(stager, table, starts, counts, LAYERS[0])
    ptr = ids.untyped_storage().data_ptr()

    class Recorder(TorchDispatchMode):
        touched, scalars = [], []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            flat = [*args, *(kwargs or {}).values()]
            if any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == ptr for t in flat):
                Recorder.touched.append(func)
            if func is torch.ops.aten._local_scalar_dense.default:
                Recorder.scalars.append(func)
            return func(*args, **(kwargs or {}))

    out = torch.empty((8, embs[0].part_n_hash_cols, 256), dtype=torch.bfloat16)
    with Recorder():
        embs[0].lookup(ids, out[:6])
    assert not Recorder.touched and not Recorder.scalars, (Recorder.touched, Recorder.scalars)
    assert torch.equal(out[:6].view(torch.int16), _reference(plugin, embs[0], LAYERS[0], ids).view(torch.int16))


@parent
def test_settings_the_stager_cannot_serve_are_refused_at_build(plugin, vllm_world):
    """Engram DP-sharded tables (an Engram DP group of 2) stop the layer's build with the fix
    (the other refusals read vLLM's config:
    test_vllms_defaults_build_and_what_looks_up_part_of_a_step_is_refused_with_the_fix)."""
    with pytest.raises(checks.EngineRefused, match="refuses Engram DP-sharded tables .*embedding_across_dp\\\": "
                                                   "false"):
        vllm_world.embedding(vllm_engram.layout(CONFIG), 0, 1, engram_dp=2)


@parent
def test_a_steps_layers_are_read_overlapped_under_direct_io_and_land_exact(tmp_path, vllm_world, monkeypatch):
    """Under `serve --direct-io` a stager that reads every layer before the forward reads a step's
    two staged layers in one Client.lookup_many, overlapped (the client's `overlapped` counts the
    steps), and each layer's lookup still gets
    exactly its own table's rows; a bad row names its own layer, not the other."""
    from direct_sidecar import direct_sidecar
    from tierstore.store.catalog import Catalog

    monkeypatch.setattr(checks, "SAMPLE_ROWS", SAMPLE_ROWS)
    arrays = write_checkpoint(tmp_path / "ckpt")
    ingest_checkpoint(tmp_path / "ckpt", tmp_path / "data", progress=False)
    rows = sum(a["embed.weight"].shape[0] for a in arrays.values())
    sc = direct_sidecar(tmp_path / "data", budget=str(rows * 264 // 4))
    try:
        vllm_plugin.install(vllm_plugin.VllmPluginConfig(str(sc.socket)))
        served = dict(ckpt=tmp_path / "ckpt", arrays=arrays)
        layout = vllm_engram.layout(CONFIG)
        embs = [_staged(vllm_world, layout, index) for index in range(len(LAYERS))]
        stager = _stager(served, embs, capacity=24)
        stager.behind = "never"  # every layer before the forward: one read of both (the later one behind: elsewhere)
        client = stager.tables[0].client
        sizes = [16, 3, 24, 40, 1, 8]
        table, steps = _token_steps(np.random.default_rng(11), sizes)
        before = client.overlapped
        for size, (starts, counts) in zip(sizes, steps):
            stager.stage(vllm_stager.windows(table, starts, counts, 4))
            for emb, L in zip(embs, LAYERS):
                got = torch.empty((size, emb.part_n_hash_cols, 256), dtype=torch.bfloat16)
                emb.lookup(torch.zeros((size, emb.n_hash_cols), dtype=torch.int32), got)
                want = _reference(served, emb, L, _hash_ids(stager, table, starts, counts, L))
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (L, size)
        assert client.overlapped - before == len(sizes), "a step's layers were read in turn"
        # rows of the second layer no step has read (so none is resident), each with a byte flipped
        seen = {int(i) for starts, counts in steps
                for i in stager._hash(vllm_stager.windows(table, starts, counts, 4))[LAYERS[1]].reshape(-1)}
        fresh = np.random.default_rng(12).integers(0, 499, (1, 64))
        last = vllm_stager.windows(fresh, np.array([60]), np.array([1]), 4)
        with Catalog(tmp_path / "data", readonly=True) as cat:
            for bad in {int(i) for i in stager._hash(last)[LAYERS[1]].reshape(-1)} - seen:
                flip_row_byte(tmp_path / "data", cat.current(f"l{LAYERS[1]}"), bad)
        with pytest.raises(vllm_stager.StagingError, match=rf"Engram layer {LAYERS[1]} its rows of table "
                                                          rf"l{LAYERS[1]} .*checksum mismatch"):
            stager.stage(last)
    finally:
        vllm_plugin.uninstall()
        sc.cleanup()


@parent
def test_a_row_that_fails_its_checksum_stops_the_step_naming_the_layer(tmp_path, vllm_world):
    """A flipped byte in a cold row a step needs: staging the step raises StagingError naming the
    layer (DATA_LOSS from the verified read), before the forward, and the buffers keep the last
    step's rows. A sidecar that is gone fails the step the same way."""
    from tierstore.store.catalog import Catalog

    arrays = write_checkpoint(tmp_path / "ckpt")
    ingest_checkpoint(tmp_path / "ckpt", tmp_path / "data", progress=False, layers=[1])
    layout = vllm_engram.layout(CONFIG)
    rows = arrays[1]["embed.weight"].shape[0]
    sc = SidecarProcess(tmp_path / "data", dram_budget=str(rows * 264 // 4)).start()
    try:
        vllm_plugin.install(vllm_plugin.VllmPluginConfig(str(sc.socket), verify="off", tables={1: "l1"}))
        emb = _staged(vllm_world, layout, 0)
        stager = _stager(dict(ckpt=tmp_path / "ckpt"), [emb], capacity=8)
        table = np.array([[5, 6, 7, 8, 9, 10, 11, 12]])
        stager.stage(vllm_stager.windows(table, np.array([0]), np.array([4]), 4))
        before = stager.buffers.weight.clone()
        bad_ids = stager._hash(vllm_stager.windows(table, np.array([4]), np.array([1]), 4))[1]
        bad = int(bad_ids[0, 0])
        with Catalog(tmp_path / "data", readonly=True) as cat:
            flip_row_byte(tmp_path / "data", cat.current("l1"), bad)
        with pytest.raises(vllm_stager.StagingError, match=rf"Engram layer 1 .*checksum mismatch in block \d+ "
                                                          rf"\(row {bad}\)") as e:
            stager.stage(vllm_stager.windows(table, np.array([4]), np.array([1]), 4))
        assert isinstance(e.value.__cause__, errors.DataLoss)
        assert torch.equal(stager.buffers.weight, before)  # nothing of the step staged
        with pytest.raises(vllm_stager.StagingError, match="holds the rows of step 1, and the forward of step 2"):
            emb.lookup(torch.zeros((1, emb.n_hash_cols), dtype=torch.int32),
                       torch.empty((1, emb.part_n_hash_cols, 256), dtype=torch.bfloat16))  # not the last step's rows
        sc.stop()
        with pytest.raises(vllm_stager.StagingError, match="Engram layer 1 .*Unavailable"):
            stager.stage(vllm_stager.windows(table, np.array([5]), np.array([3]), 4))
        assert torch.equal(stager.buffers.weight, before)
    finally:
        vllm_plugin.uninstall()
        sc.cleanup()


@parent
def test_graph_tokens_are_vllms_resolved_largest_capture():
    """The buffers hold vLLM's largest captured batch as its VllmConfig resolved it: none where
    its platform captures no graphs (CPU: cudagraph_mode NONE), else max_cudagraph_capture_size
    (here the sizes a CUDA resolution leaves, set on the resolved config)."""
    from vllm.config import CompilationConfig, CUDAGraphMode

    config = vllm_engram.vllm_config(compilation_config=CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE"))
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert vllm_stager.graph_tokens(config) == 0
    cc = config.compilation_config
    cc.cudagraph_mode, cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size = (
        CUDAGraphMode.FULL_AND_PIECEWISE, [1, 2, 4, 8, 16, 24, 32], 32)
    assert vllm_stager.graph_tokens(config) == 32


@parent
def test_step_tokens_are_vllms_token_budget():
    """The fast form's fill channels hold the misses of vLLM's step budget (max_num_batched_tokens
    as its VllmConfig resolved it); none without a config."""
    from vllm.config import SchedulerConfig

    config = vllm_engram.vllm_config(scheduler_config=SchedulerConfig(
        max_model_len=256, is_encoder_decoder=False, max_num_batched_tokens=300, max_num_seqs=4,
        enable_chunked_prefill=True))
    assert vllm_stager.step_tokens(config) == 300 and vllm_stager.step_tokens(None) == 0


@parent
def test_vllms_defaults_build_and_what_looks_up_part_of_a_step_is_refused_with_the_fix(vllm_world, monkeypatch):
    """vLLM's defaults build a staged layer: async scheduling on and speculative decoding (DSpark,
    and a method keeping the token history on the device) pass the engine checks, since the stager
    reads each step's own inputs after one stream wait (test_interp_a_step_staged_through_vllms_v2_
    runner_is_vllms_own_lookup). Micro-batching or prefill context parallelism stops the build
    (vLLM's start) with the fix, and on vLLM 0.33 the V1 runner (VLLM_USE_V2_MODEL_RUNNER=0) too."""
    from types import SimpleNamespace

    emb = vllm_world.embedding(vllm_engram.layout(CONFIG), 0, None, cpu_offload=False)  # vLLM's own
    config = vllm_engram.vllm_config()
    vllm_stager.check_engine(config, emb, 1)
    monkeypatch.setattr(config.scheduler_config, "async_scheduling", True)  # vLLM's default on a GPU
    for method in ("dspark", "ngram"):
        monkeypatch.setattr(config, "speculative_config", SimpleNamespace(method=method))
        vllm_stager.check_engine(config, emb, 1)
    refused = [("parallel_config", "enable_dbo", True, "refuses micro-batching .*without --enable-dbo"),
               ("parallel_config", "ubatch_size", 2, "refuses micro-batching"),
               ("parallel_config", "prefill_context_parallel_size", 2,
                "refuses prefill context parallelism .*--prefill-context-parallel-size 1")]
    for part, name, value, match in refused:
        saved = getattr(getattr(config, part), name)
        setattr(getattr(config, part), name, value)  # what the flag resolves to
        with pytest.raises(checks.EngineRefused, match=match):
            vllm_stager.check_engine(config, emb, 1)
        setattr(getattr(config, part), name, saved)
    if "use_v2_model_runner" in dir(config):  # vLLM 0.33: the V1 runner is still there
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
        with pytest.raises(checks.EngineRefused, match="refuses the V1 model runner .*unset VLLM_USE_V2_MODEL_RUNNER"):
            vllm_stager.check_engine(config, emb, 1)


def _readme_staged_vllm_command() -> tuple[dict, list]:
    """(environment assignments, `vllm serve` arguments) of the README's staged vLLM command."""
    import shlex

    text = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    block = text.split("**vLLM 0.33 and 0.34**", 1)[1].split("speculative decoding\n(DSpark) included:", 1)[1]
    argv = shlex.split(block.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " "), comments=True)
    env = {}
    while "=" in argv[0] and not argv[0].startswith("-"):
        name, _, value = argv.pop(0).partition("=")
        env[name] = value
    assert argv[:2] == ["vllm", "serve"], argv
    return env, argv[2:]


@parent
def test_the_readmes_staged_vllm_command_is_one_vllm_accepts_and_the_stager_serves(cache_model, vllm_world,
                                                                                   monkeypatch, tmp_path):
    """The README's staged vLLM command, parsed by vLLM's own `vllm serve` parser and resolved by its
    own EngineArgs.create_engine_config for the checkpoint, under the command's environment (its
    socket this module's cache-mode sidecar's): vLLM validates the command's VLLM_* variables there
    (0.34 stops at VLLM_USE_V2_MODEL_RUNNER=0) and loads its general plugins, tierstore's among them
    (version, seams and sidecar checked); the command leaves vLLM's scheduling as vLLM sets it
    (async scheduling is its default on a GPU), the Engram tables on the host, and the stager's
    start-up check passes."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    env, argv = _readme_staged_vllm_command()
    assert "TIERSTORE_VLLM_SOCKET" in env, env
    monkeypatch.setattr(checks, "SAMPLE_ROWS", SAMPLE_ROWS)
    for name, value in env.items():
        monkeypatch.setenv(name, cache_model["socket"] if name == "TIERSTORE_VLLM_SOCKET" else value)
    argv = [a.replace("$CKPT", str(cache_model["ckpt"])) for a in argv]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    args.model = args.model_tag  # what `vllm serve` does with its positional model
    engine_args = AsyncEngineArgs.from_cli_args(args)
    assert engine_args.async_scheduling is None  # vLLM's default: resolved on at a GPU's start
    # the checkpoint here: its tokenizer, and the text model's architecture, which vLLM's EngramConfig checks
    engine_args.tokenizer = str(_tokenizer(tmp_path / "tok", CONFIG["engram_compressed_vocab_size"]))
    engine_args.hf_overrides = {"architectures": ["DeepseekV41ForCausalLM"]}
    engine_args.max_model_len = 256
    try:
        config = vllm_engram.engine_config(engine_args)
        assert vllm_plugin.staged_tables() is None and "config" in vllm_plugin._STATE  # installed, nothing built
    finally:
        vllm_plugin.uninstall()
    assert config.engram_config.cpu_offload
    emb = vllm_world.embedding(vllm_engram.layout(CONFIG), 0, None, cpu_offload=False)  # vLLM's own
    vllm_stager.check_engine(config, emb, 1)


@parent
def test_a_layer_built_under_vllms_config_is_staged_and_reads_the_staged_step(plugin, vllm_world):
    """vLLM's own `ParallelEngramEmbedding.__init__` under a real VllmConfig (vLLM's CPU platform:
    the V2 runner, no async scheduling, so the engine checks pass) builds a staged layer through
    the plugin: all the table's heads and rows on a world of one, zero-row placeholders whose
    weight loader is the check, and its lookup reads the staged step."""
    layout = vllm_engram.layout(CONFIG)
    heads = vllm_engram.heads(layout, 0)
    emb = _staged(vllm_world, layout, 0)
    assert (emb.n_hash_cols, emb.part_n_hash_cols, emb.head_start, emb.tp_size, emb.dp_size) == \
        (len(heads), len(heads), 0, 1, 1)
    assert (emb.vocab_start_idx, emb.vocab_end_idx, emb.num_embeddings) == (0, sum(heads), layout.num_embeddings[0])
    assert emb.weight.shape == (0, 256) and emb.weight_scale_inv.shape == (0, 8)
    assert isinstance(emb.weight.weight_loader, checks.CheckpointCheck)
    stager = _stager(plugin, [emb], capacity=0)
    table, [(starts, counts)] = _token_steps(np.random.default_rng(5), [7])
    stager.stage(vllm_stager.windows(table, starts, counts, 4))
    ids = _hash_ids(stager, table, starts, counts, 1)
    out = torch.empty((7, emb.part_n_hash_cols, 256), dtype=torch.bfloat16)
    emb.lookup(ids, out)
    assert torch.equal(out.view(torch.int16), _reference(plugin, emb, 1, ids).view(torch.int16))


def _prefetched(socket) -> dict:
    """{table: rows its sidecar has read in for hints} (the wire's JSON writes uint64 as strings)."""
    with Client(socket) as c:
        return {t["table"]: int(t["prefetched"]) for t in c.stats()["tables"]}


def _tokenizer(d: Path, size: int) -> Path:
    """A tokenizer of `size` whole-word tokens ("w0" ...), each its own compressed id, as the
    test checkpoint's config has it (engram_compressed_vocab_size), saved where
    transformers' AutoTokenizer loads it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    return d


def _scheduler(ckpt: Path, tokenizer: Path, budget: int):
    """vLLM's own V1 Scheduler, built on the CPU platform for the checkpoint's model (its config,
    `tokenizer`), a token budget of `budget` a step and a KV cache of one group."""
    from vllm.config import ModelConfig, SchedulerConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model = ModelConfig(model=str(ckpt), tokenizer=str(tokenizer), max_model_len=256, dtype="bfloat16",
                        limit_mm_per_prompt={"image": 0})
    config = vllm_engram.vllm_config(model_config=model, scheduler_config=SchedulerConfig(
        max_model_len=256, is_encoder_decoder=False, max_num_batched_tokens=budget, max_num_seqs=4,
        enable_chunked_prefill=True))
    config.cache_config.num_gpu_blocks = 64
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["attn"], spec)])
    return Scheduler(config, kv, StructuredOutputManager(config), block_size=16)


@parent
def test_a_queued_requests_rows_are_read_or_hinted_by_its_wait_in_vllms_scheduler(plugin, tmp_path):
    """vLLM's own Scheduler.add_request, wrapped by the plugin, in a process that holds no model
    (the scheduler's, with several ranks): the first request queued (nothing ahead of it) has
    its rows read in by the sidecar before it runs, exactly the rows its prompt's n-grams
    hash to; one queued behind more prompt tokens than READ_AHEAD_STEPS steps' budget is only
    hinted (nothing read). Uninstalling gives vLLM its own __init__ and add_request back."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched import scheduler as vllm_scheduler
    from vllm.v1.request import Request

    from tierstore.client.engines.step_reads import READ_AHEAD_STEPS
    from tierstore.table.hasher import NgramHasher
    from tierstore.table.hf_config import spec_from_config

    budget = 8
    sched = _scheduler(plugin["ckpt"], _tokenizer(tmp_path / "tok", CONFIG["engram_compressed_vocab_size"]), budget)
    rng = np.random.default_rng(17)

    def queue(name: str, tokens: int, wait: float) -> tuple[list, dict]:
        """Queue a request; the rows each table's sidecar read in for hints since, once every
        table has read some or `wait` s have passed (the sidecar reads hinted rows off its
        prefetch queue, one table after the other)."""
        before = _prefetched(plugin["socket"])
        prompt = rng.integers(0, 499, tokens).tolist()
        sched.add_request(Request(request_id=name, prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=4),
                                  pooling_params=None))
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not all(n > before[t] for t, n in _prefetched(plugin["socket"]).items()):
            time.sleep(0.02)
        return prompt, {t: n - before[t] for t, n in _prefetched(plugin["socket"]).items()}

    prompt, first = queue("first", (READ_AHEAD_STEPS + 2) * budget, wait=10)
    assert all(n > 0 for n in first.values()), first  # runs next: its misses read now, every table
    h = NgramHasher(spec_from_config(plugin["ckpt"]), np.arange(CONFIG["engram_compressed_vocab_size"]))
    with Client(plugin["socket"]) as c:
        for L in LAYERS:  # the prompt's rows are resident now: a lookup of them reads none from disk
            handle = c.handle(vllm_plugin.staged_tables()._table(L))
            ids = np.unique(h.hash(h.map_raw(np.asarray(prompt)), L))
            c.lookup(handle.table, ids)
            assert (handle.local_reads.rows_resident, handle.local_reads.rows_cold) == (ids.size, 0), L
    _, behind = queue("behind", 64, wait=2)
    assert behind == {t: 0 for t in first}  # READ_AHEAD_STEPS + 2 steps of prompt ahead: hinted only
    assert [r.request_id for r in sched.waiting] == ["first", "behind"]  # vLLM's queue as vLLM keeps it
    other = copy.copy(sched.vllm_config)  # a tokenizer that is not the model's: no hints, and why
    other.model_config = copy.copy(other.model_config)
    other.model_config.tokenizer = str(_tokenizer(tmp_path / "other", 400))
    with pytest.raises(errors.SpecMismatch, match="compressed vocabulary is 400 ids and the config's 500"):
        vllm_stager.QueueHints(vllm_plugin.staged_tables().staged_layers(), other)
    vllm_plugin.uninstall()
    assert {f.__module__ for f in (vllm_scheduler.Scheduler.__init__, vllm_scheduler.Scheduler.add_request)} == \
        {"vllm.v1.core.sched.scheduler"}


@parent
def test_stage_is_set_the_sglang_way():
    from_env = vllm_plugin.VllmPluginConfig.from_env
    assert from_env({"TIERSTORE_VLLM_SOCKET": "/s"}).stage == "auto"
    for given, want in (("1", "on"), ("0", "off"), ("ON", "on"), ("auto", "auto")):
        assert from_env({"TIERSTORE_VLLM_SOCKET": "/s", "TIERSTORE_VLLM_STAGE": given}).stage == want
    with pytest.raises(errors.InvalidArgument, match="TIERSTORE_VLLM_STAGE='sometimes'; use auto, on"):
        from_env({"TIERSTORE_VLLM_SOCKET": "/s", "TIERSTORE_VLLM_STAGE": "sometimes"})
    assert from_env({"TIERSTORE_VLLM_SOCKET": "/s"}).stage_form == "simple"  # rows read on the host before the forward
    assert from_env({"TIERSTORE_VLLM_SOCKET": "/s", "TIERSTORE_VLLM_STAGE_FORM": "FAST "}).stage_form == "fast"
    with pytest.raises(errors.InvalidArgument, match="TIERSTORE_VLLM_STAGE_FORM='quick': use simple .* or fast"):
        from_env({"TIERSTORE_VLLM_SOCKET": "/s", "TIERSTORE_VLLM_STAGE_FORM": "quick"})


@parent
@pytest.mark.parametrize("shards,rank", [(1, 0), (2, 1)])
def test_the_fast_form_looks_rows_up_from_vllms_own_hash_ids(cache_model, vllm_world, monkeypatch, shards, rank):
    """TIERSTORE_VLLM_STAGE_FORM=fast: the runner hook stages nothing; each layer's lookup reads vLLM's
    own hash ids on the device and looks them up there (kernels.staged_gather's torch reference
    on CPU: the slot index probed, hits from the arena, misses filled by the layer's host thread),
    bf16 and packed, for the whole table and the second of two head shards (a padded head): the
    rank's rows of the table in memory, zero where it owns none (the interpreter child holds
    the Triton kernel to vLLM's own lookup: test_interp_the_fast_form_is_vllms_own_lookup)."""
    _fast_form_steps(cache_model, vllm_world, monkeypatch, shards, rank,
                     lambda plugin, emb, L, ids: _reference(plugin, emb, L, ids))


@interp
def test_interp_the_fast_form_is_vllms_own_lookup(cache_model, vllm_world, monkeypatch):
    """The fast form through kernels.staged_gather's Triton kernels (Triton's interpreter: probe,
    ring and spin on the host thread's DONE, fill), for the second of two head shards: bit for
    bit what vLLM's own lookup (`_engram_lookup_kernel`) writes over the table in memory."""
    layout = vllm_engram.layout(CONFIG)
    arrays = cache_model["arrays"]
    owns = {L: vllm_engram.holding(vllm_world.embedding(layout, index, L, shards=2, rank=1, cpu_offload=False),
                                   arrays[L]["embed.weight"], arrays[L]["embed.scale"])
            for index, L in enumerate(LAYERS)}

    def own(plugin, emb, L, ids):
        want = torch.full((len(ids), emb.part_n_hash_cols, 256), 7.0, dtype=torch.bfloat16)
        owns[L].lookup(ids, want)
        return want
    _fast_form_steps(cache_model, vllm_world, monkeypatch, 2, 1, own, sizes=(4, 26))


def _fast_form_steps(cache_model, vllm_world, monkeypatch, shards: int, rank: int, want_of,
                     sizes=(16, 3, 24, 40, 1)) -> None:
    """Steps of `sizes` tokens through the fast form's lookups of both layers (bf16 and packed),
    each held to `want_of(plugin, emb, L, ids)`; some misses filled by the layers' host threads."""
    layout = vllm_engram.layout(CONFIG)
    config = vllm_plugin.VllmPluginConfig.from_env({"TIERSTORE_VLLM_SOCKET": cache_model["socket"],
                                                    "TIERSTORE_VLLM_STAGE_FORM": "fast"})
    with _installed(cache_model, monkeypatch, config) as plugin:
        embs = [_staged(vllm_world, layout, index, shards=shards, rank=rank) for index in range(len(LAYERS))]
        stager = _stager(plugin, embs, capacity=24)
        try:
            assert stager.form == "fast" and stager.buffers is None  # nothing staged on the host
            budget = max(24, vllm_plugin.staged_tables().step_tokens or FAST_TOKENS) * embs[0].part_n_hash_cols
            assert all(d.channel.capacity == budget for d in stager._device.values())  # a step's ids may all miss
            table, steps = _token_steps(np.random.default_rng(23 + shards), list(sizes))
            for size, (starts, counts) in zip(sizes, steps):
                for emb, L in zip(embs, LAYERS):
                    ids = _hash_ids(stager, table, starts, counts, L)
                    want = want_of(plugin, emb, L, ids)
                    got = torch.full((size, emb.part_n_hash_cols, 256), 7.0, dtype=torch.bfloat16)
                    emb.lookup(ids, got)
                    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (L, size)
                    packed = torch.zeros((size, emb.part_n_hash_cols, 264), dtype=torch.uint8)
                    emb.lookup(ids, packed)
                    assert torch.equal(vllm_stager.dequantize(packed, 256).view(torch.int16),
                                       want.view(torch.int16))
            assert sum(d.server.filled for d in stager._device.values()) > 0  # misses went to the host threads
        finally:
            stager.close()
