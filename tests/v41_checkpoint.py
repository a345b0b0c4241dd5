"""A tiny DeepSeek-V4.1 checkpoint with exactly the real layout, written byte by byte.

Nested config.json (Engram fields under text_config, image_token_id and an fp8
32x32 ue8m0 quantization_config at the top), model.safetensors.index.json, three
shards with real dtypes (F8_E4M3, F8_E8M0, BF16); every Engram layer's six
tensors sit in their own shard, as layer 1 / 14 do in shards 47 / 48 of the real
one. Sizes are small (engram_vocab_size ~700 so primes are ~700 and row counts
are sums of primes, multiples of nothing convenient) but rows are the real
264-byte packed rows (head_dim 256).
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import torch

from tierstore.table.formats import encode_rows

CONFIG = dict(hidden_size=64, hc_mult=4, rms_norm_eps=1e-20, engram_layer_ids=[1, 3], engram_max_ngram_size=4,
              engram_n_heads=3, engram_head_dim=256, engram_vocab_size=700, engram_pad_token_id=2,
              engram_compressed_vocab_size=500)
IMAGE_TOKEN = 499
INDEX = "model.safetensors.index.json"


def quantize_blocks(w: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """float32 [O, I] -> (e4m3 bytes [O, I], ue8m0 bytes [ceil(O/32), ceil(I/32)])."""
    O, I = w.shape
    bo, bi = -(-O // block), -(-I // block)
    pad = np.zeros((bo * block, bi * block), np.float32)
    pad[:O, :I] = w
    blocks = np.abs(pad).reshape(bo, block, bi, block).max(axis=(1, 3))
    exp = np.ceil(np.log2(np.maximum(blocks, 1e-30) / 448.0)).clip(-127, 127).astype(np.int32)
    scale = np.repeat(np.repeat(np.exp2(exp.astype(np.float32)), block, 0), block, 1)[:O, :I]
    q = torch.from_numpy(w / scale).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    return q, (exp + 127).astype(np.uint8)


def edit_json(path: Path, edit) -> None:
    """Rewrite the JSON file at `path` after `edit(value)` has changed its parsed value in
    place: how a test breaks one field of a checkpoint's config.json or index."""
    value = json.loads(path.read_text())
    edit(value)
    path.write_text(json.dumps(value))


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    header, blobs, pos = {"__metadata__": {"format": "pt"}}, [], 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + len(data)]}
        blobs.append(data)
        pos += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for b in blobs:
            f.write(b)


def write_checkpoint(d: Path, seed: int = 0, **overrides) -> dict:
    """Write the checkpoint into `d`; returns {layer: {tensor suffix: numpy array}}."""

    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    text = {**CONFIG, **overrides}
    probe = dict(text, engram_num_embeddings=[0] * len(text["engram_layer_ids"]))
    spec_rows = _rows(probe)
    text["engram_num_embeddings"] = [spec_rows[L] for L in text["engram_layer_ids"]]
    cfg = {"architectures": ["DeepseekV41ForConditionalGeneration"], "model_type": "deepseek_v41",
           "image_token_id": IMAGE_TOKEN, "torch_dtype": "bfloat16",
           "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": [32, 32], "scale_fmt": "ue8m0"},
           "text_config": {"model_type": "deepseek_v41_text", "vocab_size": 512, **text}}
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    rng = np.random.default_rng(seed)
    D, hc, dim = text["hidden_size"], text["hc_mult"], text["engram_head_dim"]
    cols = (text["engram_max_ngram_size"] - 1) * text["engram_n_heads"]
    layers = text["engram_layer_ids"]
    n_shards = len(layers) + 1
    shard = [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]
    emb = rng.standard_normal((512, D)).astype(np.float32)
    files = {shard[0]: {"embed.weight": ("BF16", [512, D], _bf16(emb))}}
    arrays = {}
    for i, L in enumerate(layers):
        rows = spec_rows[L]
        packed = encode_rows(rng.standard_normal((rows, dim)).astype(np.float32) * 3, "fp8-e4m3-ue8m0")
        wkv, wkv_s = quantize_blocks(rng.standard_normal(((hc + 1) * D, cols * dim)).astype(np.float32) * 0.05)
        q = (1 + 0.1 * rng.standard_normal((hc, D))).astype(np.float32)
        k = (1 + 0.1 * rng.standard_normal((hc, D))).astype(np.float32)
        p = f"layers.{L}.engram."
        arrays[L] = {"embed.weight": packed[:, :dim].copy(), "embed.scale": packed[:, dim:].copy(),
                     "wkv.weight": wkv, "wkv.scale": wkv_s, "q_weight": _bf16_round(q), "k_weight": _bf16_round(k)}
        files[shard[i + 1]] = {
            p + "embed.weight": ("F8_E4M3", [rows, dim], packed[:, :dim].tobytes()),
            p + "embed.scale": ("F8_E8M0", [rows, dim // 32], packed[:, dim:].tobytes()),
            p + "wkv.weight": ("F8_E4M3", list(wkv.shape), wkv.tobytes()),
            p + "wkv.scale": ("F8_E8M0", list(wkv_s.shape), wkv_s.tobytes()),
            p + "q_weight": ("BF16", [hc, D], _bf16(q)),
            p + "k_weight": ("BF16", [hc, D], _bf16(k)),
        }
    weight_map = {}
    for name, tensors in files.items():
        write_safetensors(d / name, tensors)
        weight_map.update({t: name for t in tensors})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0},
                                                               "weight_map": weight_map}, indent=2))
    return arrays


def edit_rows(ckpt: Path, layer: int, tensor: str, rows, keep_mtime: bool = False) -> Path:
    """Flip the low bit of the first byte of `rows` of layer `layer`'s `tensor` ("embed.weight"
    or "embed.scale") in its shard, in place (the same file: a new mtime and ctime); with
    `keep_mtime` the shard's atime and mtime are then put back (os.utime, as `touch -r` does),
    so only its ctime and bytes tell. Returns the shard's path."""
    from tierstore.table.checkpoint import read_header

    name = f"layers.{layer}.engram.{tensor}"
    shard = Path(ckpt) / json.loads((Path(ckpt) / INDEX).read_text())["weight_map"][name]
    ref = read_header(shard)[name]
    before = shard.stat()
    with open(shard, "r+b") as f:
        f.seek(ref.offset)
        data = np.frombuffer(f.read(ref.nbytes), np.uint8).reshape(ref.shape[0], ref.row_bytes).copy()
        data[np.asarray(rows, dtype=np.int64), 0] ^= 1
        f.seek(ref.offset)
        f.write(data.tobytes())
    if keep_mtime:
        os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    return shard


def _rows(text: dict) -> dict[int, int]:
    from tierstore.table.spec import EngramSpec

    spec = EngramSpec(name="probe", layer_ids=tuple(text["engram_layer_ids"]), max_ngram=text["engram_max_ngram_size"],
                      n_heads=text["engram_n_heads"], engram_vocab_size=text["engram_vocab_size"],
                      compressed_vocab_size=text["engram_compressed_vocab_size"], row_dim=text["engram_head_dim"],
                      row_format="fp8-e4m3-ue8m0")
    return {L: spec.rows(L) for L in spec.layer_ids}


def _bf16(x: np.ndarray) -> bytes:
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16).view(torch.uint16).numpy().tobytes()


def _bf16_round(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16).float().numpy()


def write_big_checkpoint(d: Path, vocab: int) -> int:
    """One Engram layer whose table is ~vocab * 9 * 264 bytes, written in pieces
    (valid e4m3 / ue8m0 bytes, no NaNs) so the writer stays small. Returns the rows."""
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    text = {**CONFIG, "engram_vocab_size": vocab, "engram_layer_ids": [1]}
    rows = _rows(dict(text, engram_num_embeddings=[0]))[1]
    text["engram_num_embeddings"] = [rows]
    (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v41", "image_token_id": IMAGE_TOKEN,
                                               "text_config": text}))
    D, hc, dim = text["hidden_size"], text["hc_mult"], text["engram_head_dim"]
    E = (text["engram_max_ngram_size"] - 1) * text["engram_n_heads"] * dim
    p = "layers.1.engram."
    spec = [(p + "embed.weight", "F8_E4M3", [rows, dim]), (p + "embed.scale", "F8_E8M0", [rows, dim // 32]),
            (p + "wkv.weight", "F8_E4M3", [(hc + 1) * D, E]), (p + "wkv.scale", "F8_E8M0", [-(-(hc + 1) * D // 32), E // 32]),
            (p + "q_weight", "BF16", [hc, D]), (p + "k_weight", "BF16", [hc, D])]
    header, pos = {}, 0
    for name, dt, shape in spec:
        n = int(np.prod(shape)) * (2 if dt == "BF16" else 1)
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    shard = "model-00001-of-00001.safetensors"
    rng = np.random.default_rng(0)
    with open(d / shard, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, dt, shape in spec:
            left = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
            while left:
                n = min(left, 16 << 20)
                if dt == "BF16":
                    f.write(np.full(n // 2, 0x3F80, np.uint16).tobytes())  # 1.0
                else:
                    lo, hi = (0, 0x7E) if dt == "F8_E4M3" else (120, 130)
                    f.write(rng.integers(lo, hi, n, dtype=np.uint8).tobytes())
                left -= n
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: shard for n, _, _ in spec}}))
    return rows
