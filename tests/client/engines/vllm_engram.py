"""vLLM's real Engram classes, built by their own constructors on CPU (shared by the vLLM tests).

`ParallelEngramEmbedding.__init__` asks vLLM's tensor-parallel (and Engram DP) group for
its size and rank, reads the current `VllmConfig` through the plugin's allocation, and the
device's SM count (the lookup kernel's grid) from torch.cuda. `World` is what vLLM's worker
makes before it builds a model: a distributed world of one process over gloo, its
model-parallel groups (`initialize_model_parallel`) and a `VllmConfig` of vLLM's CPU platform
(VLLM_TARGET_DEVICE=cpu, which the engines' conftest sets before vLLM is imported: vLLM
resolves its platform once per process). `World.embedding` runs the real __init__ in it.
Two things are answered for it, nothing else of vLLM replaced: the SM count (a CPU torch has
no device to ask: 4), and, for a head shard other than a world of one's, the group's size
and rank (the tensor-parallel group's GroupCoordinator answering as rank `rank` of `shards`,
and an Engram DP group of `engram_dp`), read by __init__ only.

The V2 model runner's own state (`runner_state`): vLLM's `RequestState` (the token history),
`InputBuffers` and DeepSeek-V4.1's `DeepseekV41ModelState`, built by their constructors on a CPU
device, with one thing answered: vLLM's `is_uva_available` answers False while they are built
(it answers True on the CPU platform, whose own runner keeps its own host tables; the GPU
runner's UVA buffers need pinned memory, which a CPU torch has not), so their tensors are plain
host tensors: the token history `all_token_ids.gpu` is the host table itself. Their kernels
(the token table's writes, the lookback gather) are Triton's: they run under the interpreter.
"""
from __future__ import annotations

import contextlib
import copy
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from tierstore.client.engines import vllm_plugin


def engram_module():
    from vllm.models.deepseek_v41.common import engram

    return engram


def layout(config: dict):
    """vLLM's EngramLayout of the synthetic checkpoint's text config (v41_checkpoint.CONFIG)."""
    engram = engram_module()
    cfg = dict(config, engram_num_embeddings=[0] * len(config["engram_layer_ids"]))
    probe = engram.EngramLayout(SimpleNamespace(**cfg))
    cfg["engram_num_embeddings"] = [sum(p for order in layer for p in order) for layer in probe.primes]
    return engram.EngramLayout(SimpleNamespace(**cfg))


def heads(layout, index: int) -> tuple[int, ...]:
    """The head sizes (rows per hash head) of the layout's `index`-th Engram layer, as
    Engram._create_embedding passes them."""
    return tuple(size for order in layout.primes[index] for size in order)


def vllm_config(**kwargs):
    """A VllmConfig(**kwargs) as vLLM resolves it on its CPU platform. Resolving it writes the
    CPU executor's variables into os.environ (LD_PRELOAD, LOCAL_WORLD_SIZE, ...); they are put
    back, so that no later child process (a sidecar, a test child) inherits them."""
    from vllm.config import VllmConfig

    env = dict(os.environ)
    try:
        return VllmConfig(**kwargs)
    finally:
        os.environ.clear()
        os.environ.update(env)


def engine_config(engine_args):
    """`engine_args.create_engine_config()` (vLLM's resolution of its CLI's arguments) on its CPU
    platform, the environment put back as `vllm_config` does."""
    env = dict(os.environ)
    try:
        return engine_args.create_engine_config()
    finally:
        os.environ.clear()
        os.environ.update(env)


@contextlib.contextmanager
def _sm_count(count: int):
    """torch.cuda's device properties answering `count` SMs (all __init__ asks of a device)."""
    saved = torch.accelerator.current_device_index, torch.cuda.get_device_properties
    torch.accelerator.current_device_index = lambda: 0
    torch.cuda.get_device_properties = lambda *_: SimpleNamespace(multi_processor_count=count)
    try:
        yield
    finally:
        torch.accelerator.current_device_index, torch.cuda.get_device_properties = saved


class World:
    """vLLM's distributed state of a one-process world and the VllmConfig a model is built under.

    Open from `world()` until it closes; one at a time per process (vLLM's groups are globals)."""

    def __init__(self, config, parallel_state):
        self.config = config
        self._ps = parallel_state

    def embedding(self, layout, index: int, layer: int | None, **kwargs):
        """The layout's `index`-th Engram layer's ParallelEngramEmbedding (`construct`)."""
        return self.construct(layout.num_embeddings[index], heads(layout, index), layer, dim=layout.head_dim,
                              **kwargs)

    def construct(self, num_embeddings: int, head_sizes: tuple[int, ...], layer: int | None, *, dim: int = 256,
                  shards: int = 1, rank: int = 0, engram_dp: int = 1, cpu_offload: bool = True):
        """ParallelEngramEmbedding(num_embeddings, dim, head_sizes, cpu_offload=cpu_offload) by its own
        __init__, under this world's VllmConfig, as Engram._create_embedding builds layer `layer`'s
        (None: outside it, as no vLLM model builds one), for tensor-parallel rank `rank` of `shards`
        and an Engram DP group of `engram_dp` (rank 0). What __init__ raises is raised."""
        from vllm.config import set_current_vllm_config

        ps = self._ps
        saved = ps._TP, ps._ENGRAM_DP
        tp = copy.copy(ps._TP)
        tp.world_size, tp.rank_in_group = shards, rank
        dp = None
        if engram_dp > 1:
            dp = copy.copy(ps._TP)
            dp.world_size, dp.rank_in_group = engram_dp, 0
        ps._TP, ps._ENGRAM_DP = tp, dp
        try:
            with set_current_vllm_config(self.config), _sm_count(4), \
                    (vllm_plugin.engram_layer(layer) if layer is not None else contextlib.nullcontext()):
                return engram_module().ParallelEngramEmbedding(num_embeddings, dim, head_sizes,
                                                               cpu_offload=cpu_offload)
        finally:
            ps._TP, ps._ENGRAM_DP = saved

    def create_embedding(self, config, layout, index: int):
        """The layout's `index`-th Engram layer's ParallelEngramEmbedding as vLLM's model builds it:
        by `Engram._create_embedding` (of an Engram not otherwise built: its CUDA streams) under
        VllmConfig `config` (its engram_config), in this world."""
        from vllm.config import set_current_vllm_config

        engram = engram_module()
        with set_current_vllm_config(config), _sm_count(4):
            return engram.Engram._create_embedding(object.__new__(engram.Engram), layout, index)


@contextlib.contextmanager
def world():
    """A World: vLLM's distributed environment of one process (gloo, a loopback TCP rendezvous)
    and its model-parallel groups of one, made under a CPU-platform VllmConfig as vLLM's worker
    makes them, destroyed on exit."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise RuntimeError(f"vLLM resolved the {current_platform.device_name!r} platform: VLLM_TARGET_DEVICE=cpu "
                           "must be set before vLLM is first imported (tests/client/engines/conftest.py sets it)")
    config = vllm_config()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(config):
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                        distributed_init_method=f"tcp://127.0.0.1:{port}")
        try:
            ps.initialize_model_parallel(1, 1)
            yield World(config, ps)
        finally:
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()


class V41Model(nn.Module):
    """What DeepseekV41ModelState reads of vLLM's DeepseekV41ForCausalLM: its Engram hash state,
    vLLM's own NgramHashState (built by its constructor from the config's tokenizer), the
    lookback depth the model derives from it, and no decoder replay layers. The decoder layers
    themselves are CUDA kernels, not built here."""

    decoder_replay_layers = None

    def __init__(self, config, layout):
        super().__init__()
        swa = SimpleNamespace(block_size=64, kv_cache=torch.zeros(1))  # a bound sliding-window KV cache
        self.engram_hash = engram_module().NgramHashState(config, layout, swa)

    @property
    def token_lookback_depth(self) -> int:
        return self.engram_hash.lookback_depth


def runner_state(config, model: nn.Module):
    """(DeepseekV41ModelState, RequestState, InputBuffers) of vLLM's V2 model runner for VllmConfig
    `config` and `model`, built by their constructors on a CPU device (module docstring)."""
    from vllm.models.deepseek_v41.nvidia.model_state import DeepseekV41ModelState
    from vllm.v1.worker.gpu import buffer_utils
    from vllm.v1.worker.gpu.input_batch import InputBuffers
    from vllm.v1.worker.gpu.states import RequestState

    sched, device = config.scheduler_config, torch.device("cpu")
    saved = buffer_utils.is_uva_available
    buffer_utils.is_uva_available = lambda: False
    try:
        state = DeepseekV41ModelState(config, model, None, device)
        req_states = RequestState(sched.max_num_seqs, config.model_config.max_model_len, sched.max_num_batched_tokens,
                                  0, config.model_config.get_vocab_size(), device)
        buffers = InputBuffers(sched.max_num_seqs, sched.max_num_batched_tokens, device)
    finally:
        buffer_utils.is_uva_available = saved
    return state, req_states, buffers


def input_batch(buffers, req_states, plan: list[tuple[str, int, int]], seqs: dict[str, list[int]]):
    """vLLM's InputBatch of one step as the V2 runner's prepare_inputs makes it (InputBatch.make_dummy's
    batch with the step's requests in place of the dummy ones): plan is [(request id, tokens computed,
    tokens scheduled)] in batch order, seqs each request's token ids."""
    import dataclasses

    import numpy as np
    from vllm.v1.worker.gpu.input_batch import InputBatch

    ids = [r for r, _, _ in plan]
    computed = np.array([c for _, c, _ in plan], dtype=np.int32)
    counts = np.array([n for _, _, n in plan], dtype=np.int32)
    idx = np.array([req_states.req_id_to_index[r] for r in ids], dtype=np.intp)
    start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    positions = np.concatenate([np.arange(c, c + n) for _, c, n in plan])
    tokens = np.concatenate([np.asarray(seqs[r][c:c + n]) for r, c, n in plan]).astype(np.int32)
    dummy = InputBatch.make_dummy(len(plan), int(counts.sum()), buffers)
    return dataclasses.replace(
        dummy, req_ids=ids, idx_mapping=torch.from_numpy(idx.astype(np.int64)), idx_mapping_np=idx,
        expanded_idx_mapping=torch.from_numpy(idx.astype(np.int64)), num_scheduled_tokens=counts,
        num_computed_tokens_np=computed, query_start_loc=torch.from_numpy(start), query_start_loc_np=start,
        seq_lens=torch.from_numpy(computed + counts), input_ids=torch.from_numpy(tokens),
        positions=torch.from_numpy(positions.astype(np.int64)))


def holding(emb, weight, scale):
    """`emb` (cpu_offload off, so vLLM's `_storage()` is its parameters) holding table rows
    [vocab_start_idx, vocab_end_idx) of weight uint8 [rows, 256] / scale uint8 [rows, 8]:
    vLLM's own table in memory, which its own lookup (`_engram_lookup_kernel`) reads."""
    lo, hi = emb.vocab_start_idx, emb.vocab_end_idx
    w = torch.from_numpy(weight[lo:hi].copy()).view(torch.float8_e4m3fn)
    emb.weight = nn.Parameter(w, requires_grad=False)
    emb.weight_scale_inv = nn.Parameter(torch.from_numpy(scale[lo:hi].copy()), requires_grad=False)
    return emb


def checkpoint_tensors(ckpt: Path, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoint's Engram tensors as vLLM's safetensors iterator yields them (safe_open)."""
    from safetensors import safe_open

    for f in sorted(Path(ckpt).glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            if f"layers.{layer_id}.engram.embed.weight" in st.keys():
                return (st.get_tensor(f"layers.{layer_id}.engram.embed.weight"),
                        st.get_tensor(f"layers.{layer_id}.engram.embed.scale"))
    raise AssertionError(layer_id)
