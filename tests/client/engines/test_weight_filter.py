"""An engine restart over tierstore reads of the checkpoint's Engram tables only the rows the
check samples (client/engines/weight_filter.py), through the engines' real model loaders.

A one-layer V4.1-layout checkpoint whose table (~238 MB) is far larger than what the sampled
check needs, served split-layout by a real sidecar; each engine's plugin loaded as the engine
loads it. Each test drops the shard's pages from the page cache (posix_fadvise DONTNEED, the
shard only), runs the engine's own `DefaultModelLoader._get_weights_iterator` and routes its
tensors as the model's load_weights does (the Engram table tensors to the layer's weight
loaders: the plugin's check; every other tensor copied, as a dense layer's loader copies it),
and counts the bytes this process read from the device (/proc/self/io read_bytes).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import sglang_plugins  # noqa: E402
from sglang_engram import config as engram_config  # noqa: E402
from v41_checkpoint import write_big_checkpoint  # noqa: E402

from tierstore.client.engines import checks, weight_filter  # noqa: E402
from tierstore.ingest.checkpoint import ingest_checkpoint  # noqa: E402
from tierstore.sidecar.launcher import SidecarProcess  # noqa: E402

VOCAB = 100_000  # ~900 k rows: 230 MB of weights, 7 MB of scales
P = "layers.1.engram."


def read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(ln for ln in f if ln.startswith("read_bytes")).split()[1])


def drop_page_cache(ckpt: Path) -> None:
    for f in ckpt.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """The checkpoint (one layer, VOCAB), ingested and served split-layout by a real sidecar."""
    root = tmp_path_factory.mktemp("restart")
    rows = write_big_checkpoint(root / "ckpt", VOCAB)
    cfg = json.loads((root / "ckpt" / "config.json").read_text())  # named as the real one names it
    (root / "ckpt" / "config.json").write_text(json.dumps({"architectures": ["DeepseekV41ForConditionalGeneration"],
                                                           **cfg}))
    ingest_checkpoint(root / "ckpt", root / "data", progress=False)
    text = json.loads((root / "ckpt" / "config.json").read_text())["text_config"]
    with SidecarProcess(root / "data", dram_budget=f"{rows * 264 * 2 >> 20}MiB",
                        extra_args=("--split-layout", "all")) as sc:
        yield dict(root=root, ckpt=root / "ckpt", rows=rows, text=text, socket=str(sc.socket))
    shutil.rmtree(root)  # half a GB: not left for pytest's rotation


def engram_bound(ckpt: Path, rows: int) -> int:
    """What the sampled check may read of the two table tensors, plus one read-around window
    of the shard's start (safe_open reads the header, and the table tensors follow it)."""
    dev = os.stat(ckpt).st_dev
    ra = Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
    window = int(ra.read_text()) << 10 if ra.exists() else max(
        int(p.read_text()) for p in Path("/sys/class/bdi").glob("*/read_ahead_kb")) << 10
    n = checks.SAMPLE_ROWS
    return weight_filter.sample_read_bound(rows, 256, n) + weight_filter.sample_read_bound(rows, 8, n) + window


def load(weights, embed) -> tuple[list[tuple[str, bytes]], int]:
    """Route an engine iterator's tensors as the model's load_weights does: the Engram table
    tensors to `embed`'s weight loaders, every other one copied. Returns ([(name, bytes) of
    the others, in order], bytes read from the device meanwhile)."""
    r0 = read_bytes()
    dense = []
    for name, tensor in weights:
        if name == P + "embed.weight":
            embed.weight.weight_loader(embed.weight, tensor)
        elif name == P + "embed.scale":
            embed.scale.weight_loader(embed.scale, tensor)
        else:
            dense.append((name, tensor.contiguous().view(torch.uint8).numpy().tobytes()))
    return dense, read_bytes() - r0


# ---- sglang --------------------------------------------------------------------------------------
@contextlib.contextmanager
def sglang_weights(ckpt: Path, multithread: bool):
    """sglang's DefaultModelLoader's iterator over the checkpoint folder, as its load_model
    makes it (files from its _prepare_weights), under a runtime context of sglang's own
    ServerArgs for the folder (sglang's defaults, CPU), restored on exit."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.server_args import ServerArgs

    with use_context(create_context(ServerArgs(model_path=str(ckpt), device="cpu"), role="scheduler")):
        loader = DefaultModelLoader(LoadConfig(model_loader_extra_config={"enable_multithread_load": multithread}))
        yield loader._get_weights_iterator(DefaultModelLoader.Source(str(ckpt), None))


def _sglang_embed(sglang_engram, big):
    """sglang's EngramEmbedding of layer 1 as its Engram builds it, the plugin's hook making its
    host table the sidecar's arena and its loaders the check."""
    eng = sglang_engram[0]
    cfg = engram_config(big["text"])
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return eng.Engram(cfg, 1, eng.EngramLayout.from_config(cfg)).embed
    finally:
        torch.set_default_dtype(before)


@pytest.mark.parametrize("multithread", [True, False], ids=["sglang-default-multithread", "sglang-single-thread"])
def test_an_sglang_restart_reads_only_the_checked_rows_of_the_table(big, sglang_engram, multithread):
    from sglang.srt.model_loader import weight_utils

    with sglang_plugins.loaded(TIERSTORE_SGLANG_SOCKET=big["socket"]):
        embed = _sglang_embed(sglang_engram, big)
        assert isinstance(embed._load_rows, checks.CheckpointCheck)
        drop_page_cache(big["ckpt"])
        with sglang_weights(big["ckpt"], multithread) as weights:
            dense, read = load(weights, embed)
    assert sorted(embed._load_rows.checked) == ["scale", "weight"]
    dense_bytes = sum(len(b) for _, b in dense)
    table_bytes = big["rows"] * 264
    assert read <= dense_bytes + engram_bound(big["ckpt"], big["rows"]) < table_bytes / 4, (read, table_bytes)
    # every other tensor as sglang's own iterator gives it, bit for bit and in its order
    own = weight_utils.buffered_multi_thread_safetensors_weights_iterator if multithread else \
        weight_utils.safetensors_weights_iterator
    files = sorted(str(f) for f in big["ckpt"].glob("*.safetensors"))
    args = (files, 8) if multithread else (files,)
    own = getattr(own, "__wrapped__", own)  # under the plugin's hook: sglang's function itself
    want = [(n, t.contiguous().view(torch.uint8).numpy().tobytes()) for n, t in own(*args)
            if not weight_filter.is_engram_table(n)]
    assert [n for n, _ in dense] == [n for n, _ in want] and dense == want


def test_an_sglang_checkpoint_that_is_not_the_served_table_still_fails_loudly(big, sglang_engram, tmp_path):
    """A copy of the checkpoint whose sampled rows differ from the served table (one byte of the
    last row of its weight and of its scale, which every sample holds): CheckpointMismatch at
    load, having read no more of the table than the check's rows. A copy, so the served
    checkpoint's shard stays the one ingested (its ctime too) for the other tests."""
    from tierstore.table.checkpoint import read_header

    ckpt = tmp_path / "ckpt"
    shutil.copytree(big["ckpt"], ckpt)
    try:
        shard = next(ckpt.glob("*.safetensors"))
        header = read_header(shard)
        with open(shard, "r+b") as f:
            for name, width in (("embed.weight", 256), ("embed.scale", 8)):
                f.seek(header[P + name].offset + (big["rows"] - 1) * width)
                byte = f.read(1)[0]
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte ^ 1]))
        with sglang_plugins.loaded(TIERSTORE_SGLANG_SOCKET=big["socket"]):
            embed = _sglang_embed(sglang_engram, big)
            drop_page_cache(ckpt)
            r0 = read_bytes()
            with pytest.raises(checks.CheckpointMismatch,
                               match=f"differs from tierstore table l1 v1 at row {big['rows'] - 1}"):
                with sglang_weights(ckpt, True) as weights:
                    load(weights, embed)
            read = read_bytes() - r0
        dense_bytes = shard.stat().st_size - big["rows"] * 264
        assert read <= dense_bytes + engram_bound(ckpt, big["rows"]) < big["rows"] * 264 / 4, read
    finally:
        shutil.rmtree(ckpt)  # a quarter of a GB: not left for pytest's rotation


# ---- vLLM ----------------------------------------------------------------------------------------
vllm_missing = importlib.util.find_spec("vllm") is None


@pytest.mark.skipif(vllm_missing, reason="vllm is not installed (make engine-deps-vllm)")
def test_a_vllm_restart_reads_only_the_checked_rows_of_the_table(big, vllm_world):
    import vllm_engram
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import default_loader

    from tierstore.client.engines import vllm_plugin

    vllm_plugin.install(vllm_plugin.VllmPluginConfig(big["socket"]))
    try:
        emb = vllm_world.embedding(vllm_engram.layout(big["text"]), 0, 1)
        embed = SimpleNamespace(weight=emb.weight, scale=emb.weight_scale_inv)  # the names load() routes to
        loader = default_loader.DefaultModelLoader(LoadConfig())
        drop_page_cache(big["ckpt"])
        dense, read = load(loader._get_weights_iterator(default_loader.DefaultModelLoader.Source(
            str(big["ckpt"]), None)), embed)
        assert sorted(emb._weight_loader.checked) == ["scale", "weight"]
    finally:
        vllm_plugin.uninstall()
    dense_bytes = sum(len(b) for _, b in dense)
    assert read <= dense_bytes + engram_bound(big["ckpt"], big["rows"]) < big["rows"] * 264 / 4, (read, dense_bytes)
    files = sorted(str(f) for f in big["ckpt"].glob("*.safetensors"))
    own = default_loader.safetensors_weights_iterator  # vLLM's again, after uninstall()
    want = [(n, t.contiguous().view(torch.uint8).numpy().tobytes())
            for n, t in own(files, False) if not weight_filter.is_engram_table(n)]
    assert dense == want
