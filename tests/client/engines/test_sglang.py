"""sglang 0.5.23's real Engram modules fed from a real sidecar's split arena, on CPU.

The same `Engram` / `EngramEmbedding` built twice from one synthetic V4.1
checkpoint: once loading the checkpoint's bytes itself (sglang's own loaders,
device parameters), once with the tierstore plugin's hook (its host table is
the sidecar's mapped split arena; the checkpoint's rows are checked, not
copied). Both get the hash ids of sglang's own `EngramHasher` for a real
extend batch and the decode batch after it, and must give identical bits.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import sglang_plugins  # noqa: E402
from sglang_engram import build_engram, shard_tensors, word_tokenizer  # noqa: E402
from v41_checkpoint import write_checkpoint  # noqa: E402

from tierstore.client.client import Client
from tierstore.ingest.checkpoint import ingest_checkpoint
from tierstore.sidecar.launcher import SidecarProcess
from tierstore.table.hasher import NgramHasher
from tierstore.table.tokenizer_map import build_compression_map

LAYERS = (1, 3)


@pytest.fixture(scope="module")
def model(tmp_path_factory, sglang_engram):
    """A checkpoint, its tables served split-layout by a real sidecar, and a tokenizer of its vocabulary."""
    root = tmp_path_factory.mktemp("sglang")
    arrays = write_checkpoint(root / "ckpt")
    ingest_checkpoint(root / "ckpt", root / "data", progress=False)
    tokenizer = word_tokenizer(root)
    text = json.loads((root / "ckpt" / "config.json").read_text())["text_config"]
    with SidecarProcess(root / "data", dram_budget="64MiB", extra_args=("--split-layout", "all")) as sc:
        yield dict(root=root, arrays=arrays, text=text, tokenizer=tokenizer, socket=str(sc.socket), sidecar=sc)


@pytest.fixture(scope="module")
def engines(model, sglang_engram):
    """{layer: (sglang loading its own table, sglang fed by tierstore)}, and the layout."""
    own = {L: build_engram(sglang_engram, model, L) for L in LAYERS}
    # sglang's load_plugins runs tierstore's entry point; its HookRegistry applies the hooks
    with sglang_plugins.loaded(TIERSTORE_SGLANG_SOCKET=model["socket"]):
        fed = {L: build_engram(sglang_engram, model, L) for L in LAYERS}
    return {L: (own[L][0], fed[L][0]) for L in LAYERS}, own[1][1]


def _batches(sg, m, layout):
    """sglang's EngramHasher over an extend batch of two requests, then their next decode step:
    [(mode name, input_ids, hash ids [T, layers, cols], forward batch, token sequences)]."""
    engram = sg[0]
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    text = m["text"]
    hasher = engram.EngramHasher(layout, m["tokenizer"], text["engram_pad_token_id"],
                                 text["engram_compressed_vocab_size"])
    hasher.init_history(4, "cpu")
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, 512, 9).tolist(), rng.integers(0, 512, 6).tolist()]
    lens = [len(s) for s in seqs]
    ids = torch.tensor(sum(seqs, []), dtype=torch.int64)
    extend = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=2, input_ids=ids,
                          req_pool_indices=torch.tensor([0, 1]), seq_lens=torch.tensor(lens),
                          out_cache_loc=torch.arange(1, len(ids) + 1), seq_lens_sum=sum(lens),
                          positions=torch.cat([torch.arange(n) for n in lens]), extend_seq_lens=torch.tensor(lens),
                          extend_start_loc=torch.tensor([0, lens[0]]), extend_seq_lens_cpu=lens,
                          extend_prefix_lens=torch.tensor([0, 0]), extend_prefix_lens_cpu=[0, 0])
    out = [("extend", ids, hasher(ids, extend), extend, [list(s) for s in seqs])]
    nxt = [int(v) for v in rng.integers(0, 512, 2)]
    for s, t in zip(seqs, nxt):
        s.append(t)
    step = torch.tensor(nxt, dtype=torch.int64)
    decode = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=2, input_ids=step,
                          req_pool_indices=torch.tensor([0, 1]), seq_lens=torch.tensor([n + 1 for n in lens]),
                          out_cache_loc=torch.tensor([len(ids) + 1, len(ids) + 2]), seq_lens_sum=sum(lens) + 2,
                          positions=torch.tensor(lens))
    out.append(("decode", step, hasher(step, decode), decode, [list(s) for s in seqs]))
    return out


def test_sglang_fed_by_tierstore_is_bit_identical_for_extend_and_decode(model, engines, sglang_engram):
    modules, layout = engines
    text = model["text"]
    for mode, input_ids, hash_ids, batch, _ in _batches(sglang_engram, model, layout):
        x = torch.randn(len(input_ids), text["hc_mult"], text["hidden_size"],
                        generator=torch.Generator().manual_seed(len(input_ids))).to(torch.bfloat16)
        for k, L in enumerate(LAYERS):
            own, fed = modules[L]
            with torch.no_grad():
                a = own(x, hash_ids[:, k], batch, input_ids=input_ids)
                b = fed(x, hash_ids[:, k], batch, input_ids=input_ids)
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{mode}, layer {L}"
            assert not torch.equal(a, x)  # the gate opened: rows were read


def test_the_fed_table_is_the_mapped_arena_not_a_copy(model, engines):
    modules, _ = engines
    arrays = model["arrays"]
    with Client(model["socket"]) as c:
        for L in LAYERS:
            own, fed = modules[L]
            t = c.split_table(f"l{L}")
            assert fed.embed.weight.data_ptr() == t.weight.ctypes.data  # one mapping per process
            assert fed.embed.scale.data_ptr() == t.scale.ctypes.data
            assert np.array_equal(fed.embed.weight.view(torch.uint8).numpy(), arrays[L]["embed.weight"])
            assert own.embed.weight.data_ptr() != fed.embed.weight.data_ptr()
            t.close()


def test_sglang_hashes_as_tierstore_does(model, engines, sglang_engram):
    """EngramHasher (sglang's torch path) and NgramHasher give the same row ids, extend and decode."""
    from tierstore.table.checkpoint import Checkpoint

    _, layout = engines
    spec = Checkpoint(model["root"] / "ckpt").spec
    ours = NgramHasher(spec, build_compression_map(model["root"] / "tokenizer.json"))
    for mode, input_ids, hash_ids, batch, seqs in _batches(sglang_engram, model, layout):
        for k, L in enumerate(LAYERS):
            want = [ours.hash(ours.map_raw(np.array([s])), L)[0] for s in seqs]
            want = np.concatenate(want) if mode == "extend" else np.stack([w[-1] for w in want])
            assert np.array_equal(hash_ids[:, k].numpy(), want), (mode, L)


def test_a_wrong_checkpoint_is_refused_at_load_not_copied(model, engines, sglang_engram):
    modules, _ = engines
    fed = modules[1][1].embed
    t = shard_tensors(model["root"], 1)
    bad = t["embed.weight"].view(torch.uint8).clone()
    bad[-1, 0] ^= 1
    from tierstore.client.engines.checks import CheckpointCheck, CheckpointMismatch

    with pytest.raises(CheckpointMismatch, match="sglang's Engram layer 1: .* differs from tierstore table l1"):
        fed.weight.weight_loader(fed.weight, bad.view(torch.float8_e4m3fn))

    sampled = fed.weight.weight_loader
    unsampled = next(r for r in range(len(bad)) if r not in set(sampled.sample()))
    bad = t["embed.weight"].view(torch.uint8).clone()
    bad[unsampled, 5] ^= 1
    # a row this start's sample does not draw: the tensor, a copy in memory (no shard's view), is
    # hashed whole against the digest ingest recorded
    with pytest.raises(CheckpointMismatch, match="embed.weight is not the tensor tierstore table l1 v1 was ingested "
                                                 "from .*its xxh3-128 is"):
        sampled(fed.weight, bad.view(torch.float8_e4m3fn))
    # a check with no record of the checkpoint (a table not ingested from one) compares every row
    every = CheckpointCheck("sglang", 1, "l1", sampled.version, sampled.rows, sampled.dim, sampled.read, "all")
    with pytest.raises(CheckpointMismatch, match=f"at row {unsampled}:"):
        every(fed.weight, bad.view(torch.float8_e4m3fn))
    every(fed.weight, t["embed.weight"])  # the checkpoint's own bytes pass, and nothing is written
    assert np.array_equal(fed.weight.view(torch.uint8).numpy(), model["arrays"][1]["embed.weight"])


def test_sidecar_down_is_a_clear_error_at_start(model, sglang_engram, tmp_path):
    from tierstore.client.engines import sglang as ts_sglang

    with sglang_plugins.loaded(TIERSTORE_SGLANG_SOCKET=tmp_path / "nobody.sock", TIERSTORE_SGLANG_TIMEOUT=2):
        with pytest.raises(ts_sglang.EngineAttachError, match="does not answer.*tierstore serve"):
            build_engram(sglang_engram, model, 1)


def _v41_vs_sglang(model, sglang_engram, dtype):
    """(tierstore's V41EngramLayer output, sglang's Engram output as float32, h) on the same
    weights (the checkpoint's), row ids and hidden states; a layer without image tokens."""
    from tierstore.client.model.in_process_table import InProcessTable
    from tierstore.client.model.v41_layer import V41EngramLayer

    module, _ = build_engram(sglang_engram, model, 1, dtype)
    layer = V41EngramLayer.from_checkpoint(model["root"] / "ckpt", 1)
    spec, a = layer.spec, model["arrays"][1]
    layer.source = InProcessTable(spec)
    layer.source.add("l1", np.concatenate([a["embed.weight"], a["embed.scale"]], axis=1),
                     row_format=spec.row_format, row_dim=spec.row_dim)
    rng = np.random.default_rng(11)
    ids = rng.integers(0, spec.compressed_vocab_size - 2, (1, 40))
    rows = NgramHasher(spec).hash(ids, 1)
    h = torch.randn(1, 40, spec.hc_mult, spec.hidden_size, generator=torch.Generator().manual_seed(2))
    h = h.to(torch.bfloat16).float()  # representable in both dtypes: the inputs are the same numbers
    with torch.no_grad():
        ours = layer(h, rows).numpy()[0]
        theirs = module(h[0].to(dtype), torch.from_numpy(rows[0]), None, input_ids=torch.from_numpy(ids[0]))
    return ours, theirs.float().numpy(), h[0].numpy()


def test_v41_engram_layer_agrees_with_sglangs_engram_in_bfloat16(model, sglang_engram):
    """sglang's Engram runs in bf16 only (its rows come out of the lookup as bf16, exactly: an
    e4m3 value times a power of two fits bf16's 8 significant bits), so wkv's output (kv) and
    the layer's output are rounded to bf16; tierstore's layer stays in float32. kv's rounding (2^-9
    relative, in key and value) reaches the output through the gate and the value term, whose size
    is the Engram's contribution |out - h|; the output's own rounding is 2^-9 |out|. Bound: each
    element within 2^-5 (|out| + |out - h|), i.e. four bf16 steps of the larger term (measured
    here: under 2^-6), and on average a hundredth of the Engram's contribution (measured: ~1/450)."""
    ours, theirs, h = _v41_vs_sglang(model, sglang_engram, torch.bfloat16)
    diff, contribution = np.abs(theirs - ours), np.abs(ours - h)
    assert (diff <= 2.0 ** -5 * (np.abs(ours) + contribution)).all()
    assert diff.mean() < contribution.mean() / 100



def test_the_launcher_refuses_to_start_sglang_without_a_sidecar(cli, tmp_path):
    code, out, err = cli("sglang", "--socket", tmp_path / "nobody.sock", "--", "--model-path", "/nowhere")
    assert code == 1
    assert "no tierstore sidecar answers" in err and "--split-layout all" in err


def test_the_launcher_refuses_a_sidecar_without_split_tables(cli, tmp_path):
    data = tmp_path / "data"
    rows = np.random.default_rng(0).integers(0, 256, (100, 264), dtype=np.uint8)
    from tierstore.ingest.writer import write_version

    write_version(data, "l1", [rows], rows=100, row_format="fp8-e4m3-ue8m0", row_dim=256)
    with SidecarProcess(data) as sc:
        code, out, err = cli("sglang", "--socket", sc.socket, "--stage", "off", "--", "--model-path", "/nowhere")
    assert code == 1 and "serves no split-layout table" in err


def test_a_reload_to_another_version_stops_the_forward_not_mixes_versions(tmp_path, sglang_engram):
    """After `tierstore reload` serves v2, a module mapping v1 refuses its next forward (restart
    sglang to map v2); the rows it had mapped were never changed under it."""
    from tierstore.client.engines import sglang as ts_sglang

    write_checkpoint(tmp_path / "ckpt")
    ingest_checkpoint(tmp_path / "ckpt", tmp_path / "data", progress=False, layers=[1])
    text = json.loads((tmp_path / "ckpt" / "config.json").read_text())["text_config"]
    m = dict(root=tmp_path, text=text)
    with SidecarProcess(tmp_path / "data", dram_budget="64MiB", extra_args=("--split-layout", "all")) as sc, \
            Client(sc.socket) as c:
        with sglang_plugins.loaded(TIERSTORE_SGLANG_SOCKET=sc.socket):
            fed, _ = build_engram(sglang_engram, m, 1)
        before = fed.embed.weight.view(torch.uint8).clone()
        ids = torch.zeros(3, 9, dtype=torch.int64)
        x = torch.ones(3, text["hc_mult"], text["hidden_size"], dtype=torch.bfloat16)
        with torch.no_grad():
            fed(x, ids, None, input_ids=ids[:, 0])  # v1 is current: serves
        write_checkpoint(tmp_path / "ckpt2", seed=1)
        ingest_checkpoint(tmp_path / "ckpt2", tmp_path / "data", progress=False, layers=[1])
        assert c.reload() == [("l1", 1, 2)]
        with pytest.raises(ts_sglang.EngineAttachError, match="now serves table l1 at v2.*restart sglang"):
            with torch.no_grad():
                fed(x, ids, None, input_ids=ids[:, 0])
        assert torch.equal(fed.embed.weight.view(torch.uint8), before)
