"""Fixtures of the engine tests: the engines' real modules, skipped (with the reason) where not installed."""
from __future__ import annotations

import os

import pytest
import torch

# vLLM resolves its platform once per process, when first imported: its CPU platform (what vLLM's
# own CPU runs set) is the one on which a VllmConfig, and so its Engram layer, can be built here.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# vLLM's CPU platform needs Triton, which vLLM turns off where no GPU driver is active unless the
# devices read as hidden (vllm/triton_utils/importing.py): on a host without a GPU, they are.
if not torch.cuda.is_available():
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture(scope="session")
def sglang_engram():
    """(sglang.srt.layers.engram, engram_staging), imported the narrow way tierstore imports them
    (tierstore.client.engines.sglang.import_engram), on a tp-1 parallel context."""
    from tierstore.client.engines.sglang import import_engram

    try:
        modules = import_engram()
    except ImportError as e:
        pytest.skip(f"sglang's Engram modules do not import here ({e}); `make engine-deps-sglang` installs them")
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(tp_size=1, tp_rank=0)
    return modules


@pytest.fixture(scope="module")
def vllm_world():
    """vllm_engram.World: vLLM's distributed world of one process and its CPU-platform VllmConfig,
    in which `vllm_world.embedding(...)` builds ParallelEngramEmbedding by its own __init__."""
    pytest.importorskip("vllm", reason="vllm is not installed (make engine-deps-vllm installs it)")
    import vllm_engram

    with vllm_engram.world() as world:
        yield world
