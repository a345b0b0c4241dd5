"""sglang 0.5.23's real Engram modules fed by tierstore's row stager from a cache-mode sidecar, on CPU.

The checkpoint's tables are served by a real sidecar in cache mode (its
--dram-budget a quarter of the rows): they are not split-layout, so the plugin
stages them (client/engines/sglang_stager.py). The same `Engram` built twice
from one checkpoint: once loading its table itself, once staged (no rows
held; the checkpoint's rows checked against the sidecar's). The stager is what
sglang's own seam returns (`EngramRowStager.from_model`, hooked through
sglang's HookRegistry), fed real `ScheduleBatch`es of real `Req`s; its staged
rows reach the module through sglang's `ForwardBatch.engram_staged_rows` ->
`Engram.embed_rows` -> `dequant_staged`. An extend batch, then decode steps
whose rows partly missed (read from the segment files) and partly hit (the
rows the extend's misses promoted): identical bits every step.
"""
from __future__ import annotations

import json
import os
import sys
import time
from array import array
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sglang_engram import build_engram, shard_tensors, word_tokenizer  # noqa: E402
from segment_damage import flip_row_byte  # noqa: E402
from v41_checkpoint import write_checkpoint  # noqa: E402

from tierstore import errors
from tierstore.client.client import Client
from tierstore.client.engines import StagingError, checks
from tierstore.ingest.checkpoint import ingest_checkpoint
from tierstore.sidecar.launcher import SidecarProcess

LAYERS = (1, 3)
DECODE_STEPS = 6
HOST_TABLE_VARS = ("SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE", "SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT")


@pytest.fixture(scope="module")
def cache_model(tmp_path_factory, sglang_engram):
    """The checkpoint, its tables served in cache mode (a quarter of the rows fit), a tokenizer."""
    root = tmp_path_factory.mktemp("sglang_stager")
    arrays = write_checkpoint(root / "ckpt")
    ingest_checkpoint(root / "ckpt", root / "data", progress=False)
    text = json.loads((root / "ckpt" / "config.json").read_text())["text_config"]
    rows = sum(a["embed.weight"].shape[0] for a in arrays.values())
    with SidecarProcess(root / "data", dram_budget=str(rows * 264 // 4)) as sc:
        yield dict(root=root, arrays=arrays, text=text, tokenizer=word_tokenizer(root), socket=str(sc.socket))


def _stats(socket) -> dict:
    """{table: its sidecar stats}, counters as ints (the wire's JSON writes uint64 as strings)."""
    with Client(socket) as c:
        return {t["table"]: {k: (int(v) if k != "mode" and k != "table" else v) for k, v in t.items()}
                for t in c.stats()["tables"]}


@pytest.fixture(scope="module")
def staged(cache_model, sglang_engram):
    """{layer: (sglang loading its own table, sglang staged by tierstore)}, the stager sglang's
    seam returns, and sglang's EngramHasher."""
    from torch import nn

    from sglang.srt.layers.engram_staging import EngramRowStager

    from tierstore.client.engines import sglang_stager

    assert all(s["mode"] == "cache" for s in _stats(cache_model["socket"]).values())
    own = {L: build_engram(sglang_engram, cache_model, L)[0] for L in LAYERS}
    fed = _fed(cache_model, sglang_engram)
    layout = fed[1][1]
    text = cache_model["text"]
    hasher = sglang_engram[0].EngramHasher(layout, cache_model["tokenizer"], text["engram_pad_token_id"],
                                           text["engram_compressed_vocab_size"])
    hasher.init_history(4, "cpu")
    model = nn.ModuleList([fed[L][0] for L in LAYERS])
    stager = EngramRowStager.from_model(model, hasher, torch.device("cpu"))  # sglang's seam, hooked
    yield dict(modules={L: (own[L], fed[L][0]) for L in LAYERS}, stager=stager, hasher=hasher)
    sglang_stager.close()


def _fed(cache_model, sglang_engram, **env) -> dict:
    """{layer: (its Engram module, layout)} built by sglang with the plugin installed over
    `cache_model`'s sidecar (TIERSTORE_SGLANG_* `env` set while they are built)."""
    from tierstore.client.engines import checks
    from tierstore.client.engines import sglang as ts_sglang

    mp = pytest.MonkeyPatch()
    mp.setenv("TIERSTORE_SGLANG_SOCKET", cache_model["socket"])
    for name, value in env.items():
        mp.setenv(name, value)
    # the load checks a spread of 64 rows here: 4096 would be most of this small table, where on
    # V4.1's it is a few in a million, and the cache would start full of them
    mp.setattr(checks, "SAMPLE_ROWS", 64)
    ts_sglang.install()
    try:
        return {L: build_engram(sglang_engram, cache_model, L) for L in LAYERS}
    finally:
        mp.undo()
        for var in HOST_TABLE_VARS:
            os.environ.pop(var, None)


def _req(rid: str, tokens) -> object:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(rid, "", array("q", tokens), SamplingParams(max_new_tokens=64))
    req.refresh_fill_ids()
    return req


def _forward_batches(reqs, lens, step: int):
    """sglang's ForwardBatch of the extend (step 0) or the step-th decode step of `reqs`."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    bs = len(reqs)
    if step == 0:
        ids = torch.tensor(sum((list(r.origin_input_ids) for r in reqs), []), dtype=torch.int64)
        starts = torch.tensor([0, *np.cumsum(lens)[:-1].tolist()])
        return ids, ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=bs, input_ids=ids, req_pool_indices=torch.arange(bs),
            seq_lens=torch.tensor(lens), out_cache_loc=torch.arange(1, len(ids) + 1), seq_lens_sum=sum(lens),
            positions=torch.cat([torch.arange(n) for n in lens]), extend_seq_lens=torch.tensor(lens),
            extend_start_loc=starts, extend_seq_lens_cpu=list(lens),
            extend_prefix_lens=torch.zeros(bs, dtype=torch.int64), extend_prefix_lens_cpu=[0] * bs)
    ids = torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.int64)
    seq = [n + step for n in lens]
    return ids, ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=ids, req_pool_indices=torch.arange(bs),
        seq_lens=torch.tensor(seq), out_cache_loc=torch.arange(bs) + 1000 * step, seq_lens_sum=sum(seq),
        positions=torch.tensor(seq) - 1)


def _promoted(socket, steps: int, timeout: float = 10.0) -> dict:
    """The sidecar's stats once it has learned `steps` local steps of every table (notes are one-way)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = _stats(socket)
        if all(s["local_steps"] >= steps for s in stats.values()) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def test_staged_sglang_is_bit_identical_for_extend_and_decode_with_hits_and_misses(cache_model, staged):
    from tierstore.client.engines.sglang_stager import RowStager

    stager, hasher, modules = staged["stager"], staged["hasher"], staged["modules"]
    assert isinstance(stager, RowStager)
    text = cache_model["text"]
    # the token sampled last step, on the host (no overlap scheduler); it repeats the prompt, so later
    # steps' n-grams are the extend's again
    for step, batch, x, input_ids, fb in _extend_then_decode(hasher, text, 7, (40, 24), "r", lambda p, s: p[s - 1]):
        staged_rows = stager.stage(batch)  # ahead of the forward, as prepare_for_forward does
        hash_ids = hasher(input_ids, fb)  # the forward's own hash (and history commit)
        for L, a, b in _own_and_staged(modules, x, hash_ids, fb, input_ids, staged_rows):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"step {step}, layer {L}"
            assert not torch.equal(a, x)  # the gate opened: rows were read
        if step == 0:  # let the sidecar promote the extend's misses before the decode steps read
            stager.layers[0][1].client.flush()
            _promoted(cache_model["socket"], 1)
    stats = _promoted(cache_model["socket"], DECODE_STEPS + 1)
    for L in LAYERS:
        s = stats[f"l{L}"]
        assert s["hits"] > 0 and s["misses"] > 0, s
        local = stager.layers[LAYERS.index(L)][1].client.handle(f"l{L}").local_reads
        assert local.rows_cold > 0 and local.rows_resident > 0  # misses from the segment files, hits from the arena


def _extend_then_decode(hasher, text, seed: int, sizes, name: str, sampled):
    """An extend of prompts of `sizes` random tokens, then DECODE_STEPS decode steps, the token
    step s samples for prompt p `sampled(p, s)` (on the host): yields (step, its ScheduleBatch,
    the forward's input x, input ids, ForwardBatch) each step."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 512, n).tolist() for n in sizes]
    reqs = [_req(f"{name}{i}", p) for i, p in enumerate(prompts)]
    lens = [len(p) for p in prompts]
    batch = ScheduleBatch(reqs=reqs, forward_mode=ForwardMode.EXTEND, prefix_lens=[0] * len(lens),
                          extend_lens=list(lens))
    for step in range(DECODE_STEPS + 1):
        if step:
            for r, p in zip(reqs, prompts):
                r.output_ids.append(sampled(p, step))
            batch.forward_mode = ForwardMode.DECODE
            batch.seq_lens_cpu = torch.tensor([n + step for n in lens])
        input_ids, fb = _forward_batches(reqs, lens, step)
        x = torch.randn(len(input_ids), text["hc_mult"], text["hidden_size"],
                        generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
        yield step, batch, x, input_ids, fb


def _ready(staged: list) -> list:
    """A batch's staged entries with every later layer's (read on the stager's thread behind the
    forward: a PendingRows) waited for, as its layer's lookup waits for it."""
    from tierstore.client.engines.sglang_stager import PendingRows

    return [e[0].wait() if e is not None and isinstance(e[0], PendingRows) else e for e in staged]


def _own_and_staged(modules, x, hash_ids, fb, input_ids, staged_rows):
    """(layer, sglang's own module's output, the staged module's over `staged_rows`) of each layer
    for one forward batch `fb`."""
    for k, L in enumerate(LAYERS):
        own, fed = modules[L]
        with torch.no_grad():
            fb.engram_staged_rows = None
            a = own(x, hash_ids[:, k], fb, input_ids=input_ids)
            fb.engram_staged_rows = staged_rows
            yield L, a, fed(x, hash_ids[:, k], fb, input_ids=input_ids)


GRAPH_SIZES = [1, 2, 4]  # the decode graph batch sizes here, set in sglang's own CudaGraphConfig


def _graph_config(**decode):
    """sglang's default CudaGraphConfig (its own default_cuda_graph_config), decode batch sizes
    resolved to GRAPH_SIZES as a launch resolves them, and `decode` changes."""
    from sglang.srt.model_executor.cuda_graph_config import default_cuda_graph_config, with_phase

    return with_phase(default_cuda_graph_config(), "decode", **{"bs": GRAPH_SIZES, **decode})


def test_staged_decode_under_cuda_graphs_reads_the_persistent_buffers_bit_identical(cache_model, staged):
    """Decode under sglang's default decode graphs: the rows a captured graph reads are the
    persistent buffers' (the same storage every step), refilled by stage() before each replay.
    Batch sizes 4, 3, 3, 2, 1 against graphs captured at 1, 2, 4 (3 runs padded to 4): the
    layer the graph captured (its forward under sglang's capture mode, the code a replay
    re-executes on the same addresses) gives sglang's own module's bits for the batch's
    tokens and zero rows for the padded slots."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.runner_utils.capture_mode import model_capture_mode

    from tierstore.client.engines.sglang_stager import RowStager, decode_graph_batch

    hasher, modules = staged["hasher"], staged["modules"]
    fed_layers = [modules[L][1] for L in LAYERS]
    stager = RowStager(hasher, fed_layers, "cpu", graph_tokens=decode_graph_batch(_graph_config()))
    buffers, cols = stager.buffers, stager.cols
    assert buffers is not None and buffers.capacity == max(GRAPH_SIZES) * cols
    base = (buffers.weight.data_ptr(), buffers.scale.data_ptr())
    text = cache_model["text"]
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 512, n).tolist() for n in (20, 9, 14, 6)]
    reqs = [_req(f"g{i}", p) for i, p in enumerate(prompts)]
    lens = [len(p) for p in prompts]
    previous, RowStager.current = RowStager.current, stager
    try:
        extend = ScheduleBatch(reqs=reqs, forward_mode=ForwardMode.EXTEND, prefix_lens=[0] * 4, extend_lens=lens)
        rows = stager.stage(extend)  # staged per batch: extend batches do not replay decode graphs
        input_ids, fb = _forward_batches(reqs, lens, 0)
        hasher(input_ids, fb)
        assert all(r[0].data_ptr() != buffers.weight.data_ptr() for r in _ready(rows) if r is not None)
        for step, b in enumerate((4, 3, 3, 2, 1), start=1):
            live = reqs[:b]
            for r in live:
                r.output_ids.append(int(rng.integers(0, 512)))
            batch = ScheduleBatch(reqs=live, forward_mode=ForwardMode.DECODE,
                                  seq_lens_cpu=torch.tensor([n + step for n in lens[:b]]))
            rows = _ready(stager.stage(batch))  # before the replay, as prepare_for_forward runs it
            assert (buffers.weight.data_ptr(), buffers.scale.data_ptr()) == base
            for i, L in enumerate(LAYERS):
                k = fed_layers[i].layer_hash_index
                assert rows[k][0].data_ptr() == buffers.weight[i].data_ptr()
                assert rows[k][1].data_ptr() == buffers.scale[i].data_ptr()
                assert rows[k][0].shape[0] == b * cols
            assert not buffers.weight[:, b * cols:].any() and not buffers.scale[:, b * cols:].any()
            input_ids, fb = _forward_batches(live, lens[:b], step)
            hash_ids = hasher(input_ids, fb)
            padded = min(s for s in GRAPH_SIZES if s >= b)
            pad = padded - b
            ids_pad = torch.cat([input_ids, torch.zeros(pad, dtype=input_ids.dtype)])
            hash_pad = torch.cat([hash_ids, torch.zeros((pad, *hash_ids.shape[1:]), dtype=hash_ids.dtype)])
            x = torch.randn(padded, text["hc_mult"], text["hidden_size"],
                            generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
            _, graph_fb = _forward_batches(live, lens[:b], step)  # the capture's batch: no staged rows
            for i, L in enumerate(LAYERS):
                own, fed = modules[L]
                with torch.no_grad():
                    want_rows = own.embed(hash_ids[:, i])
                    want = own(x[:b], hash_ids[:, i], fb, input_ids=input_ids)
                    with model_capture_mode():
                        got_rows = fed.embed(hash_pad[:, i], graph_fb)
                        got = fed(x, hash_pad[:, i], graph_fb, input_ids=ids_pad)
                assert got_rows.shape == (padded, cols, fed.embed.dim)
                assert torch.equal(got_rows[:b].view(torch.int16), want_rows.view(torch.int16)), (step, L)
                assert not got_rows[b:].view(torch.int16).any(), (step, L)  # padded slots: zero rows
                assert torch.equal(got[:b].view(torch.int16), want.view(torch.int16)), (step, L)
    finally:
        RowStager.current = previous


def test_a_decode_batchs_buffered_rows_are_served_only_while_the_buffers_hold_them(cache_model, staged,
                                                                                   monkeypatch):
    """The fill guard under sglang: rows staged into the persistent buffers carry their batch's
    number. A batch's forward reads its rows (sglang's own module's bits); once the next batch is
    staged into the buffers (what the overlap scheduler would do before the forward), reading the
    first batch's rows raises StagingError instead of serving the second's; a batch whose fill of
    one layer was skipped raises when its rows are handed out, before any forward."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from tierstore.client.engines.sglang_stager import RowStager, decode_graph_batch

    hasher, modules = staged["hasher"], staged["modules"]
    fed_layers = [modules[L][1] for L in LAYERS]
    stager = RowStager(hasher, fed_layers, "cpu", graph_tokens=decode_graph_batch(_graph_config()))
    text = cache_model["text"]
    rng = np.random.default_rng(12)
    prompts = [rng.integers(0, 512, n).tolist() for n in (11, 7)]
    reqs = [_req(f"f{i}", p) for i, p in enumerate(prompts)]
    lens = [len(p) for p in prompts]
    previous, RowStager.current = RowStager.current, stager
    try:
        stager.stage(ScheduleBatch(reqs=reqs, forward_mode=ForwardMode.EXTEND, prefix_lens=[0, 0], extend_lens=lens))
        input_ids, fb = _forward_batches(reqs, lens, 0)
        hasher(input_ids, fb)

        def decode(step: int):
            for r in reqs:
                r.output_ids.append(int(rng.integers(0, 512)))
            batch = ScheduleBatch(reqs=reqs, forward_mode=ForwardMode.DECODE,
                                  seq_lens_cpu=torch.tensor([n + step for n in lens]))
            return stager.stage(batch)

        def forwards(step: int, rows):
            """(sglang's own module's output, the staged one's) of each layer for decode step `step`."""
            input_ids, fb = _forward_batches(reqs, lens, step)
            hash_ids = hasher(input_ids, fb)
            x = torch.ones(len(input_ids), text["hc_mult"], text["hidden_size"], dtype=torch.bfloat16)
            for _, want, got in _own_and_staged(modules, x, hash_ids, fb, input_ids, rows):
                yield want, got

        first = decode(1)
        for want, got in forwards(1, first):
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        decode(2)
        stager._drain()  # a later layer read behind has filled too: the buffers hold the second batch's rows
        with pytest.raises(StagingError, match="holds the rows of step 2, and the forward of step 1 reads it"):
            next(forwards(2, first))
        fill = stager.buffers.fill
        monkeypatch.setattr(stager.buffers, "fill", lambda layer, n, write: None if layer == 1 else fill(layer, n,
                                                                                                         write))
        with pytest.raises(StagingError, match="slot 1 holds the rows of step 2, and the forward of step 3"):
            _ready(decode(3))  # layer 1's rows, read behind the forward, raise at its lookup
    finally:
        RowStager.current = previous


def test_sglangs_default_graphs_size_the_buffers_through_its_own_config():
    """sglang's defaults as its own config code makes them (CudaGraphConfig): decode graphs on
    (staged into buffers for the largest captured batch), graphs off or unpublished stage
    decode per batch."""
    from tierstore.client.engines import StagingError
    from tierstore.client.engines.sglang_stager import decode_graph_batch

    assert decode_graph_batch(_graph_config()) == max(GRAPH_SIZES)  # the default decode backend captures
    assert decode_graph_batch(_graph_config(backend="breakable")) == max(GRAPH_SIZES)
    assert decode_graph_batch(_graph_config(backend="disabled")) == 0
    assert decode_graph_batch(None) == 0
    with pytest.raises(StagingError, match="--cuda-graph-max-bs-decode"):
        decode_graph_batch(_graph_config(bs=None))


def _readme_staged_commands() -> dict:
    """{"serve": argv, "sglang": argv} of the README's staged sglang block (continuations joined)."""
    import shlex

    text = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    block = text.split("Tables larger than RAM (cache mode, no `--split-layout`) are staged instead", 1)[1]
    block = block.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    lines = [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]
    return {argv[1]: argv for argv in lines}


def test_the_readmes_staged_sglang_commands_serve_and_pass_the_stagers_check(cache_model, tmp_path):
    """The README's two staged commands: its `tierstore serve` line run (the checkpoint's data, a
    socket and a budget that makes this small table cache mode here), serving every table in
    cache mode, none split-layout (so the plugin stages them); its sglang
    arguments parsed by sglang's own CLI parser (ServerArgs) and fed, with sglang's default
    graph config, to the stager's start-up check: accepted, decode graphs and the overlap scheduler on."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    from tierstore.client.engines.sglang_stager import decode_graph_batch

    cmds = _readme_staged_commands()
    serve = cmds["serve"]
    assert serve[:2] == ["tierstore", "serve"] and "--split-layout" not in serve
    assert serve[serve.index("--dram-budget") + 1].endswith("GiB")  # scaled here to a quarter of the small table
    rows = sum(a["embed.weight"].shape[0] for a in cache_model["arrays"].values())
    with SidecarProcess(cache_model["root"] / "data", tmp_path / "ts.sock", dram_budget=str(rows * 264 // 4)) as sc:
        with Client(sc.socket) as c:
            assert c.tables() and not any(c.handle(t["table"]).split for t in c.tables())
            assert all(t["mode"] == "cache" for t in c.stats()["tables"])
    sglang = cmds["sglang"]
    engine_args = [a.replace("$CKPT", str(cache_model["root"] / "ckpt")) for a in sglang[sglang.index("--") + 1:]]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(engine_args))
    assert args.cuda_graph_backend_decode is None and not args.disable_overlap_schedule  # sglang's defaults
    assert decode_graph_batch(_graph_config()) == max(GRAPH_SIZES)


def test_a_queued_requests_rows_are_prefetched_by_the_sidecar(cache_model, staged):
    stager = staged["stager"]
    before = {t: s["prefetched"] for t, s in _stats(cache_model["socket"]).items()}
    req = _req("queued", np.random.default_rng(99).integers(0, 512, 48).tolist())
    assert stager.prefetch(req, wait_steps=0) > 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = _stats(cache_model["socket"])
        if all(now[t]["prefetched"] > before[t] for t in before):
            break
        time.sleep(0.02)
    assert all(now[t]["prefetched"] > before[t] for t in before), (before, now)


def test_an_unstaged_batch_or_a_deferred_one_never_staged_is_refused_not_guessed(cache_model, staged):
    """A batch that reaches a staged layer without rows raises; so does a decode batch `stage`
    deferred (its newest token still on the device, as under the overlap scheduler) whose
    ForwardBatch was built without the hook that stages it."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from tierstore.client.engines import StagingError
    from tierstore.client.engines.sglang_stager import DEFERRED

    req = _req("late", [5, 6, 7, 8])
    input_ids, fb = _forward_batches([req], [4], 0)
    _, fed = staged["modules"][1]
    x = torch.zeros(4, cache_model["text"]["hc_mult"], cache_model["text"]["hidden_size"], dtype=torch.bfloat16)
    with pytest.raises(StagingError, match="EXTEND batch's rows were not staged"):
        fed(x, torch.zeros(4, 9, dtype=torch.int64), fb, input_ids=input_ids)
    # overlap scheduling: the decode step's token has not reached req.output_ids yet
    batch = ScheduleBatch(reqs=[req], forward_mode=ForwardMode.DECODE, seq_lens_cpu=torch.tensor([5]))
    assert staged["stager"].stage(batch) is DEFERRED
    fb.engram_staged_rows = DEFERRED
    with pytest.raises(StagingError, match=r"ForwardBatch.init_new\), which did not run"):
        fed(x, torch.zeros(4, 9, dtype=torch.int64), fb, input_ids=input_ids)


def test_a_checkpoint_that_differs_from_the_sidecars_rows_is_refused_at_load(cache_model, staged):
    from tierstore.client.engines.checks import CheckpointCheck, CheckpointMismatch

    fed = staged["modules"][1][1].embed
    assert fed.weight.shape[0] == 0  # a staged layer holds no rows
    t = shard_tensors(cache_model["root"], 1)
    source = fed.tierstore_table
    every = CheckpointCheck("sglang", 1, "l1", source.version, source.rows, source.dim, source.read, "all")
    every(fed.weight, t["embed.weight"])
    every(fed.scale, t["embed.scale"])
    bad = t["embed.scale"].view(torch.uint8).clone()
    bad[-3, 2] ^= 1
    row = len(bad) - 3
    with pytest.raises(CheckpointMismatch, match=f"embed.scale differs from tierstore table l1 v1 at row {row}"):
        every(fed.scale, bad.view(t["embed.scale"].dtype))


def test_stage_is_set_the_sglang_way(monkeypatch):
    from tierstore.client.engines.sglang import SglangConfig
    from tierstore.errors import InvalidArgument

    monkeypatch.setenv("TIERSTORE_SGLANG_SOCKET", "/s")
    assert SglangConfig.from_env().stage == "auto"  # stage what is not split-layout
    for given, want in (("1", "on"), ("0", "off"), ("ON", "on"), ("auto", "auto")):
        monkeypatch.setenv("TIERSTORE_SGLANG_STAGE", given)
        assert SglangConfig.from_env().stage == want
    monkeypatch.setenv("TIERSTORE_SGLANG_STAGE", "sometimes")
    with pytest.raises(InvalidArgument, match="TIERSTORE_SGLANG_STAGE is auto, on"):
        SglangConfig.from_env()
    monkeypatch.delenv("TIERSTORE_SGLANG_STAGE")
    assert SglangConfig.from_env().stage_form == "simple"  # the default: rows read on the host before the forward
    monkeypatch.setenv("TIERSTORE_SGLANG_STAGE_FORM", " Fast")
    assert SglangConfig.from_env().stage_form == "fast"
    monkeypatch.setenv("TIERSTORE_SGLANG_STAGE_FORM", "quick")
    with pytest.raises(InvalidArgument, match="TIERSTORE_SGLANG_STAGE_FORM='quick': use simple .* or fast"):
        SglangConfig.from_env()


def test_a_row_that_fails_its_checksum_stops_the_step_not_serves_it(tmp_path, sglang_engram, staged, monkeypatch):
    """A flipped byte in a cold row a batch needs: stage() raises StagingError (DATA_LOSS from the
    verified read), and no rows reach the forward."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from torch import nn

    from sglang.srt.layers.engram_staging import EngramRowStager

    from tierstore.client.engines import sglang as ts_sglang
    from tierstore.client.engines import StagingError
    from tierstore.client.engines.sglang_stager import RowStager
    from tierstore.store.catalog import Catalog

    write_checkpoint(tmp_path / "ckpt")
    ingest_checkpoint(tmp_path / "ckpt", tmp_path / "data", progress=False, layers=[1])
    text = json.loads((tmp_path / "ckpt" / "config.json").read_text())["text_config"]
    req = _req("bad", [11, 12, 13, 14, 15])
    tokens, positions = staged["stager"]._windows([(req, 0, 5)], "extend")
    bad = int(staged["stager"]._hash(tokens, positions)[2, 0, 4])  # layer 1, token 2, hash column 4
    with Catalog(tmp_path / "data", readonly=True) as cat:
        flip_row_byte(tmp_path / "data", cat.current("l1"), bad)
    with SidecarProcess(tmp_path / "data", dram_budget="256KiB") as sc:
        monkeypatch.setenv("TIERSTORE_SGLANG_SOCKET", str(sc.socket))
        monkeypatch.setenv("TIERSTORE_SGLANG_VERIFY", "off")
        ts_sglang.install()
        try:
            fed, _ = build_engram(sglang_engram, dict(root=tmp_path, text=text), 1)
        finally:
            for var in HOST_TABLE_VARS:
                os.environ.pop(var, None)
        stager = EngramRowStager.from_model(nn.ModuleList([fed]), staged["hasher"], torch.device("cpu"))
        assert isinstance(stager, RowStager)
        batch = ScheduleBatch(reqs=[req], forward_mode=ForwardMode.EXTEND, prefix_lens=[0], extend_lens=[5])
        with pytest.raises(StagingError, match=rf"checksum mismatch in block \d+ \(row {bad}\)") as e:
            stager.stage(batch)
        assert isinstance(e.value.__cause__, errors.DataLoss)


def test_a_batchs_layers_are_read_overlapped_under_direct_io_and_land_exact(tmp_path, sglang_engram, staged,
                                                                            monkeypatch):
    """Under `serve --direct-io` a stager that reads every layer before the forward reads a batch's
    two layers in one Client.lookup_many, overlapped (the client's `overlapped` counts the
    batches), each layer's staged rows exactly its own table's rows of its hash ids; a bad row
    stops the batch naming its own table."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from torch import nn

    from sglang.srt.layers.engram_staging import EngramRowStager

    from direct_sidecar import direct_sidecar
    from tierstore.client.engines import StagingError
    from tierstore.client.engines import sglang as ts_sglang
    from tierstore.store.catalog import Catalog

    monkeypatch.setattr(checks, "SAMPLE_ROWS", 64)
    arrays = write_checkpoint(tmp_path / "ckpt")
    ingest_checkpoint(tmp_path / "ckpt", tmp_path / "data", progress=False)
    text = json.loads((tmp_path / "ckpt" / "config.json").read_text())["text_config"]
    rows = sum(a["embed.weight"].shape[0] for a in arrays.values())
    sc = direct_sidecar(tmp_path / "data", budget=str(rows * 264 // 4))
    try:
        monkeypatch.setenv("TIERSTORE_SGLANG_SOCKET", str(sc.socket))
        ts_sglang.install()
        try:
            fed = [build_engram(sglang_engram, dict(root=tmp_path, text=text), L)[0] for L in LAYERS]
        finally:
            for var in HOST_TABLE_VARS:
                os.environ.pop(var, None)
        stager = EngramRowStager.from_model(nn.ModuleList(fed), staged["hasher"], torch.device("cpu"))
        stager.behind = "never"  # every layer before the forward: one read of both (the later one behind: below)
        client = stager.layers[0][1].client
        rng = np.random.default_rng(5)
        prompts = [rng.integers(0, 512, 48).tolist(), rng.integers(0, 512, 20).tolist()]
        reqs = [_req(f"o{i}", p) for i, p in enumerate(prompts)]
        lens = [len(p) for p in prompts]
        batch = ScheduleBatch(reqs=reqs, forward_mode=ForwardMode.EXTEND, prefix_lens=[0, 0], extend_lens=lens)
        before, steps = client.overlapped, 5
        for step in range(steps):
            if step:
                for r in reqs:
                    r.output_ids.append(int(rng.integers(0, 512)))
                batch.forward_mode = ForwardMode.DECODE
                batch.seq_lens_cpu = torch.tensor([n + step for n in lens])
            windows = stager._decode_windows(batch) if step else stager._extend_windows(batch)
            ids = stager._hash(*windows)
            got = _ready(stager.stage(batch))
            for k, L in enumerate(LAYERS):
                want = ids[:, k].reshape(-1)
                weight, scale, _ = got[k]
                assert np.array_equal(weight.numpy(), arrays[L]["embed.weight"].view(np.uint8)[want]), (step, L)
                assert np.array_equal(scale.numpy(), arrays[L]["embed.scale"].view(np.uint8)[want]), (step, L)
        assert client.overlapped - before == steps, "a batch's layers were read in turn"
        last = _req("bad", rng.integers(0, 512, 6).tolist())
        tokens, positions = stager._windows([(last, 0, 6)], "extend")
        with Catalog(tmp_path / "data", readonly=True) as cat:
            for bad in np.unique(stager._hash(tokens, positions)[:, 1]).tolist():
                flip_row_byte(tmp_path / "data", cat.current(f"l{LAYERS[1]}"), bad)
        bad_batch = ScheduleBatch(reqs=[last], forward_mode=ForwardMode.EXTEND, prefix_lens=[0], extend_lens=[6])
        with pytest.raises(StagingError, match=rf"rows of table l{LAYERS[1]} for this batch .*checksum mismatch"):
            stager.stage(bad_batch)
    finally:
        sc.cleanup()


def test_stage_on_stages_a_split_layout_table_too(tmp_path, sglang_engram, staged, monkeypatch):
    """TIERSTORE_SGLANG_STAGE=on: a full-resident split table is staged as well (its rows read
    with Client.lookup, interleaved whatever the arena's layout), bit-identical."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from torch import nn

    from sglang.srt.layers.engram_staging import EngramRowStager

    from tierstore.client.engines import sglang as ts_sglang

    write_checkpoint(tmp_path / "ckpt")
    ingest_checkpoint(tmp_path / "ckpt", tmp_path / "data", progress=False, layers=[1])
    m = dict(root=tmp_path, text=json.loads((tmp_path / "ckpt" / "config.json").read_text())["text_config"])
    own, _ = build_engram(sglang_engram, m, 1)
    with SidecarProcess(tmp_path / "data", dram_budget="64MiB", extra_args=("--split-layout", "all")) as sc:
        monkeypatch.setenv("TIERSTORE_SGLANG_SOCKET", str(sc.socket))
        monkeypatch.setenv("TIERSTORE_SGLANG_STAGE", "1")
        ts_sglang.install()
        try:
            fed, _ = build_engram(sglang_engram, m, 1)
        finally:
            for var in HOST_TABLE_VARS:
                os.environ.pop(var, None)
        assert fed.embed.weight.shape[0] == 0 and fed.embed.tierstore_table.full_resident
        hasher = staged["hasher"]
        stager = EngramRowStager.from_model(nn.ModuleList([fed]), hasher, torch.device("cpu"))
        req = _req("split", np.random.default_rng(3).integers(0, 512, 12).tolist())
        batch = ScheduleBatch(reqs=[req], forward_mode=ForwardMode.EXTEND, prefix_lens=[0], extend_lens=[12])
        for step in (0, 1):
            if step:
                req.output_ids.append(77)
                batch.forward_mode, batch.seq_lens_cpu = ForwardMode.DECODE, torch.tensor([13])
            rows = stager.stage(batch)
            input_ids, fb = _forward_batches([req], [12], step)
            hash_ids = hasher(input_ids, fb)
            x = torch.randn(len(input_ids), m["text"]["hc_mult"], m["text"]["hidden_size"],
                            generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
            with torch.no_grad():
                a = own(x, hash_ids[:, 0], fb, input_ids=input_ids)
                fb.engram_staged_rows = rows
                b = fed(x, hash_ids[:, 0], fb, input_ids=input_ids)
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), step


def test_windows_of_any_span_are_the_whole_sequences_windows(staged):
    """A chunk (prefix > 0), a decode token, a span across prompt and output: the windows built
    from the slice are the whole sequence's, positions included (0 before the start)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    stager = staged["stager"]

    @settings(max_examples=60, deadline=None)
    @given(st.integers(1, 30), st.integers(0, 10), st.data())
    def check(n_origin, n_output, data):
        rng = np.random.default_rng(n_origin * 31 + n_output)
        req = _req("w", rng.integers(0, 512, n_origin).tolist())
        req.output_ids.extend(rng.integers(0, 512, n_output).tolist())
        total = n_origin + n_output
        start = data.draw(st.integers(0, total - 1))
        length = data.draw(st.integers(1, total - start))
        whole, pos = stager._windows([(req, 0, total)], "extend")
        part, part_pos = stager._windows([(req, start, length)], "extend")
        assert np.array_equal(part, whole[start:start + length])
        assert np.array_equal(part_pos, pos[start:start + length])
        seq = np.concatenate([np.zeros(3, np.int64), np.asarray(list(req.origin_input_ids) + list(req.output_ids))])
        assert np.array_equal(whole[:, 0], seq[3:]) and np.array_equal(whole[:, 3], seq[:-3])

    check()


def _verify_batch(reqs, ids_2d: torch.Tensor, positions_2d: torch.Tensor):
    """sglang's target-verify ForwardBatch of `reqs` (slots 0..bs-1): DSpark's verify block of each
    request (its anchor, then its drafts) as DFlashVerifyInput.prepare_for_verify hands it over."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput

    bs, block = ids_2d.shape
    ids, pos = ids_2d.reshape(-1), positions_2d.reshape(-1)
    seq = positions_2d[:, -1] + 1
    return ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=ids, req_pool_indices=torch.arange(bs),
        seq_lens=seq, out_cache_loc=torch.arange(ids.numel()) + 1, seq_lens_sum=int(seq.sum()), positions=pos,
        spec_info=DFlashVerifyInput(draft_token=ids, positions=pos, draft_token_num=block))


@pytest.mark.parametrize("graphs", [False, True])
def test_the_overlap_schedulers_decode_batches_are_staged_at_their_forward_batch(cache_model, staged, graphs):
    """The overlap scheduler builds decode batch N+1 before N's sampled token reaches the host:
    `stage` defers it, and the ForwardBatch hook (init_forward_batch, around sglang's
    ForwardBatch.init_new) stages it from the batch's input ids and sglang's own history once
    they are final, before the forward. Bit-identical to sglang's own module every step, eager
    and into the decode graphs' persistent buffers; a draft worker's batch passes untouched."""
    from types import SimpleNamespace

    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    from tierstore.client.engines.sglang_stager import DEFERRED, RowStager, decode_graph_batch, init_forward_batch

    hasher, modules = staged["hasher"], staged["modules"]
    stager = RowStager(hasher, [modules[L][1] for L in LAYERS], "cpu",
                       graph_tokens=decode_graph_batch(_graph_config()) if graphs else 0)
    text = cache_model["text"]
    rng = np.random.default_rng(31)
    prompts = [rng.integers(0, 512, n).tolist() for n in (17, 8, 12)]
    reqs = [_req(f"o{i}", p) for i, p in enumerate(prompts)]
    lens = [len(p) for p in prompts]
    target, draft = SimpleNamespace(is_draft_worker=False), SimpleNamespace(is_draft_worker=True)
    previous, RowStager.current = RowStager.current, stager
    try:
        extend = ScheduleBatch(reqs=reqs, forward_mode=ForwardMode.EXTEND, prefix_lens=[0] * 3, extend_lens=lens)
        rows = stager.stage(extend)
        input_ids, fb = _forward_batches(reqs, lens, 0)
        hasher(input_ids, fb)
        pending = None  # the token the last step sampled: on the device only, until its result is processed
        for step in range(1, DECODE_STEPS + 1):
            if pending is not None:  # the step before last's result, processed a step late
                for r, t in zip(reqs, pending):
                    r.output_ids.append(t)
            pending = rng.integers(0, 512, len(reqs)).tolist()
            batch = ScheduleBatch(reqs=reqs, forward_mode=ForwardMode.DECODE,
                                  seq_lens_cpu=torch.tensor([n + step for n in lens]))
            assert stager.stage(batch) is DEFERRED  # prepare_for_forward, before the token is on the host
            seq = [n + step for n in lens]
            fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=3, input_ids=torch.tensor(pending),
                              req_pool_indices=torch.arange(3), seq_lens=torch.tensor(seq),
                              out_cache_loc=torch.arange(3) + 1000 * step, seq_lens_sum=sum(seq),
                              positions=torch.tensor(seq) - 1, engram_staged_rows=DEFERRED)
            assert init_forward_batch(lambda cls, b, mr: fb, ForwardBatch, batch, draft) is fb
            assert fb.engram_staged_rows is DEFERRED  # a draft worker's forward: DSpark's draft has no Engram
            assert init_forward_batch(lambda cls, b, mr: fb, ForwardBatch, batch, target) is fb
            rows = fb.engram_staged_rows
            assert rows is not DEFERRED
            if graphs:
                assert rows[0][0].data_ptr() == stager.buffers.weight[0].data_ptr()
            hash_ids = hasher(fb.input_ids, fb)  # the forward's own hash, after the stage (it commits history)
            x = torch.randn(3, text["hc_mult"], text["hidden_size"],
                            generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
            for L, a, b in _own_and_staged(modules, x, hash_ids, fb, fb.input_ids, rows):
                assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (step, L)
    finally:
        RowStager.current = previous


BLOCK = 4  # DSpark's verify window: an anchor and 3 drafts (gamma + 1)


@pytest.mark.parametrize("graphs", [False, True])
def test_dspark_target_verify_batches_are_bit_identical_to_sglangs_own_lookup(cache_model, staged, graphs):
    """Speculative decoding as sglang runs it for V4.1 (DSpark): after the prefill, each step's
    target-verify batch holds every request's anchor (the bonus token) and its drafts, proposed
    on the device; its rows are staged at its ForwardBatch from those ids and sglang's own
    committed history, then sglang's own commit_after_verify keeps the accepted drafts. The
    staged module's output is sglang's own module's over its own table, bit for bit, every
    step (eager, and into the verify graphs' buffers: bs x BLOCK tokens, with the capture's
    read of them at a padded size zero past the batch)."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.runner_utils.capture_mode import model_capture_mode

    from tierstore.client.engines.sglang_stager import DEFERRED, RowStager, decode_graph_batch

    hasher, modules = staged["hasher"], staged["modules"]
    fed_layers = [modules[L][1] for L in LAYERS]
    graph_tokens = decode_graph_batch(_graph_config()) * BLOCK if graphs else 0
    stager = RowStager(hasher, fed_layers, "cpu", graph_tokens=graph_tokens)
    text = cache_model["text"]
    rng = np.random.default_rng(41)
    prompts = [rng.integers(0, 512, n).tolist() for n in (15, 9, 22)]
    reqs = [_req(f"v{i}", p) for i, p in enumerate(prompts)]
    lens = [len(p) for p in prompts]
    bs = len(reqs)
    previous, RowStager.current = RowStager.current, stager
    try:
        extend = ScheduleBatch(reqs=reqs, forward_mode=ForwardMode.EXTEND, prefix_lens=[0] * bs, extend_lens=lens)
        stager.stage(extend)
        input_ids, fb = _forward_batches(reqs, lens, 0)
        hasher(input_ids, fb)  # commits each request's history, as the prefill's forward does
        anchor = torch.tensor(rng.integers(0, 512, bs))  # the prefill's sampled token
        start = torch.tensor(lens)  # the anchor's position
        for step in range(1, DECODE_STEPS + 1):
            decode = ScheduleBatch(reqs=reqs, forward_mode=ForwardMode.DECODE,
                                   seq_lens_cpu=torch.tensor(lens), spec_algorithm=_dspark())
            assert stager.stage(decode) is DEFERRED  # the verify block is built inside the worker
            ids_2d = torch.cat([anchor[:, None], torch.tensor(rng.integers(0, 512, (bs, BLOCK - 1)))], dim=1)
            pos_2d = start[:, None] + torch.arange(BLOCK)
            fb = _verify_batch(reqs, ids_2d, pos_2d)
            rows = stager.stage_forward(fb)  # what the init_new hook does for the target's verify batch
            if graphs:
                assert rows[0][0].data_ptr() == stager.buffers.weight[0].data_ptr()
            hash_ids = hasher(fb.input_ids, fb)  # sglang's own verify hash (history + the block)
            x = torch.randn(bs * BLOCK, text["hc_mult"], text["hidden_size"],
                            generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
            for L, a, b in _own_and_staged(modules, x, hash_ids, fb, fb.input_ids, rows):
                assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (step, L)
            if graphs:  # the verify graph captured at 4 requests reads the buffers: the batch, then zeros
                pad = (max(GRAPH_SIZES) - bs) * BLOCK
                hash_pad = torch.cat([hash_ids, torch.zeros((pad, *hash_ids.shape[1:]), dtype=hash_ids.dtype)])
                for i, L in enumerate(LAYERS):
                    own, fed = modules[L]
                    with torch.no_grad(), model_capture_mode():
                        got = fed.embed(hash_pad[:, i], _verify_batch(reqs, ids_2d, pos_2d))
                    want = own.embed(hash_ids[:, i])
                    assert torch.equal(got[:bs * BLOCK].view(torch.int16), want.view(torch.int16)), (step, L)
                    assert not got[bs * BLOCK:].view(torch.int16).any()
            accepted = torch.tensor(rng.integers(0, BLOCK, bs))  # drafts the target kept
            hasher.commit_after_verify(ids_2d, torch.arange(bs), accepted + 1)  # sglang's own commit
            anchor = torch.tensor(rng.integers(0, 512, bs))  # the bonus token: the next block's anchor
            start = start + accepted + 1
    finally:
        RowStager.current = previous


def _dspark():
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return SpeculativeAlgorithm.from_string("DSPARK")


def test_the_fast_form_looks_rows_up_from_sglangs_own_hash_ids_bit_identical(cache_model, sglang_engram, staged):
    """The fast form (TIERSTORE_SGLANG_STAGE_FORM=fast, the stager sglang's seam returns): `stage`
    stages nothing; each staged layer's forward looks up
    sglang's own hash ids itself (kernels.staged_gather's torch reference on CPU: the slot index
    probed, hits from the arena, misses filled by the layer's host thread through the fill
    channel), extend and decode alike: bit-identical to sglang's own module. A step whose fill
    fails is refused at the layer's next lookup, naming it."""
    from tierstore.client.engines import StagingError
    from tierstore.client.engines.sglang_stager import RowStager

    from sglang.srt.layers.engram_staging import EngramRowStager
    from torch import nn

    hasher = staged["hasher"]
    fast = _fed(cache_model, sglang_engram, TIERSTORE_SGLANG_STAGE_FORM="fast")  # the layers the plugin builds
    modules = {L: (staged["modules"][L][0], fast[L][0]) for L in LAYERS}  # (sglang's own, staged: the fast form)
    previous = RowStager.current
    stager = EngramRowStager.from_model(nn.ModuleList([modules[L][1] for L in LAYERS]), hasher, torch.device("cpu"))
    try:
        assert RowStager.current is stager
        assert stager.form == "fast"
        text = cache_model["text"]
        for step, batch, x, input_ids, fb in _extend_then_decode(hasher, text, 17, (36, 12), "f",
                                                                 lambda p, s: p[-s]):
            assert stager.stage(batch) is None
            hash_ids = hasher(input_ids, fb)
            for L, a, b in _own_and_staged(modules, x, hash_ids, fb, input_ids, None):
                assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"step {step}, layer {L}"
        layers = list(stager._device.values())
        assert len(layers) == len(LAYERS) and all(d.server.filled > 0 for d in layers)  # misses went to the host
        layers[0].server.read = lambda ids: 1 / 0  # the next fill fails: its missed rows are poisoned
        input_ids, fb = _forward_batches(batch.reqs, [36, 12], 0)
        x = torch.randn(len(input_ids), text["hc_mult"], text["hidden_size"]).to(torch.bfloat16)
        rows = stager.layers[0][1].rows
        fresh = torch.from_numpy(np.random.default_rng(1).integers(0, rows, (len(input_ids), hash_ids.shape[-1])))
        with torch.no_grad():
            fb.engram_staged_rows = None
            modules[LAYERS[0]][1](x, fresh, fb, input_ids=input_ids)
            with pytest.raises(StagingError, match="failed at its step .*ZeroDivisionError"):
                modules[LAYERS[0]][1](x, fresh, fb, input_ids=input_ids)
    finally:
        RowStager.current = previous
        stager.close()
