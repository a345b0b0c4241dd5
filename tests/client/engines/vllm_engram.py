"""vLLM 0.32's real Engram classes, built by their own constructors on CPU (shared by the vLLM tests).

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
