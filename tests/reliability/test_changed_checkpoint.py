"""A checkpoint changed after its table was ingested is refused when an engine loads it, never
served the table's old rows: vLLM's real Engram embedding built under the plugin, its weight
loaders handed the checkpoint's tensors as vLLM's safetensors iterator hands them (views of the
shard's mapping).

Sixteen changes of the kind a check of a fixed spread of 4,096 rows passed: 1, 10 and 59,251 of
layer 1's 63,347 rows (59,251: every row that spread never looks at) of its weight or its scale,
edited in place, the shard left with the edit's mtime or given its old one back (os.utime, as
`touch -r` does); an edited copy renamed over the shard, or copied over it with `cp -p`, its
mtime kept; a shard saved again, its header longer or a tensor added. Each on a checkpoint of its
own, ingested and served split-layout by a real sidecar; the unchanged checkpoint, the control,
loads.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM is first imported (vllm_engram.world)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client" / "engines"))
from v41_checkpoint import CONFIG, INDEX, edit_rows, write_checkpoint  # noqa: E402

from tierstore.client.engines import checks, vllm_plugin  # noqa: E402
from tierstore.ingest.checkpoint import ingest_checkpoint  # noqa: E402
from tierstore.sidecar.launcher import SidecarProcess  # noqa: E402

pytestmark = pytest.mark.reliability
VOCAB = 7000  # layer 1: 63,347 rows
ROWS = 63_347
# the rows a check of 4,096 evenly spaced rows never looks at
UNSEEN = np.setdiff1d(np.arange(ROWS), np.linspace(0, ROWS - 1, 4096).astype(np.int64))
ROW = r"differs from tierstore table l1 v1 at row \d+"  # where this start's sample drew a changed row


def _spread(k: int) -> np.ndarray:
    return UNSEEN[np.linspace(0, len(UNSEEN) - 1, k).astype(np.int64)]


def _shard(ckpt: Path) -> Path:
    return ckpt / json.loads((ckpt / INDEX).read_text())["weight_map"]["layers.1.engram.embed.weight"]


def _in_place(tensor: str, k: int, keep_mtime: bool):
    return lambda ckpt: edit_rows(ckpt, 1, tensor, _spread(k), keep_mtime=keep_mtime)


def _edited_copy(k: int, how):
    """The shard edited in a copy of the checkpoint (its times kept), then put in place by `how`."""
    def change(ckpt: Path):
        other = ckpt.parent / "edited"
        shutil.copytree(ckpt, other)
        edit_rows(other, 1, "embed.weight", _spread(k), keep_mtime=True)
        how(_shard(other), _shard(ckpt))
    return change


def _saved_again(metadata: dict, extra: bytes = b"", k: int = 0):
    """The shard written again (a new file renamed over it, as a save does), `metadata` in its
    header, `extra` bytes appended as one more tensor, and `k` weight rows edited."""
    def change(ckpt: Path):
        shard = _shard(ckpt)
        raw = shard.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header, body = json.loads(raw[8:8 + n]), raw[8 + n:]
        header["__metadata__"] = metadata
        if extra:
            header["layers.1.engram.extra"] = {"dtype": "U8", "shape": [len(extra)],
                                              "data_offsets": [len(body), len(body) + len(extra)]}
        head = json.dumps(header).encode()
        head += b" " * (-len(head) % 8)
        tmp = shard.with_suffix(".tmp")
        tmp.write_bytes(struct.pack("<Q", len(head)) + head + body + extra)
        os.replace(tmp, shard)
        if k:
            edit_rows(ckpt, 1, "embed.weight", _spread(k))
    return change


CHANGES = {
    **{f"{tensor[6:]}-{k}-row{'s' * (k > 1)}{'-mtime-put-back' * keep}":
       (_in_place(tensor, k, keep), r"but ctime_ns \d+ \(ingest: \d+\)" if keep else r"mtime_ns \d+ \(ingest: \d+\)")
       for tensor in ("embed.weight", "embed.scale") for keep in (False, True) for k in (1, 10, len(UNSEEN))},
    "edited-copy-renamed-over": (_edited_copy(1, os.replace), r"but ino \d+ \(ingest: \d+\), ctime_ns"),
    "edited-copy-cp-p-over": (_edited_copy(10, shutil.copy2), r"but ctime_ns \d+ \(ingest: \d+\)"),
    "saved-again-longer-header": (_saved_again({"format": "pt", "tuned": "x" * 40}),
                                  r"is not the tensor .*: size \d+ \(ingest: \d+\), offset \d+ \(ingest: \d+\)"),
    "saved-again-tensor-added": (_saved_again({"format": "pt"}, bytes(4096), k=10),
                                 r"is not the tensor .*: size \d+ \(ingest: \d+\)"),
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    d = tmp_path_factory.mktemp("changed") / "ckpt"
    write_checkpoint(d, engram_vocab_size=VOCAB)
    return d


@pytest.fixture(scope="module")
def world():
    pytest.importorskip("vllm", reason="vllm is not installed (make engine-deps-vllm)")
    import vllm_engram

    with vllm_engram.world() as w:
        yield w


def _load(world, socket, ckpt: Path):
    """Layer 1's embedding built under the plugin (verify sample, the default) and its two table
    tensors handed to its weight loaders, as vLLM loads them. Returns the check."""
    import vllm_engram

    vllm_plugin.install(vllm_plugin.VllmPluginConfig(str(socket)))
    try:
        emb = world.embedding(vllm_engram.layout(dict(CONFIG, engram_vocab_size=VOCAB)), 0, 1)
        assert emb.num_embeddings == ROWS
        weight, scale = vllm_engram.checkpoint_tensors(ckpt, 1)
        emb.weight.weight_loader(emb.weight, weight)
        emb.weight_scale_inv.weight_loader(emb.weight_scale_inv, scale)
        return emb._weight_loader
    finally:
        vllm_plugin.uninstall()


@pytest.mark.parametrize("change", ["unchanged", *CHANGES])
def test_a_checkpoint_changed_after_ingest_is_refused_at_load(pristine, world, tmp_path, change):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(pristine, ckpt)
    ingest_checkpoint(ckpt, tmp_path / "data", layers=[1], progress=False)
    with SidecarProcess(tmp_path / "data", dram_budget="64MiB", extra_args=("--split-layout", "all")) as sc:
        if change == "unchanged":
            assert sorted(_load(world, sc.socket, ckpt).checked) == ["scale", "weight"]
            return
        edit, differs = CHANGES[change]
        edit(ckpt)
        with pytest.raises(checks.CheckpointMismatch, match=rf"^vllm's Engram layer 1: checkpoint tensor embed\.") as e:
            _load(world, sc.socket, ckpt)
    msg = str(e.value)
    assert "ingest this checkpoint (`tierstore ingest-checkpoint`)" in msg, msg
    assert re.search(ROW, msg) or (re.search(differs, msg) and str(_shard(ckpt)) in msg), msg
