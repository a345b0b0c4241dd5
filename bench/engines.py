"""`tierstore bench engines`: sglang's real Engram module on CPU, fed by its own host table vs by
tierstore full-resident (the sidecar's split arena, mapped through the sglang plugin's hook).

One fp8-e4m3-ue8m0 table with a V4.1 layout (3 orders x 8 heads, rows the sum of
the primes above `--vocab`), written once as a checkpoint shard (safetensors)
and ingested into a tierstore data directory. Measured side by side:
- engine start-up: sglang building the layer and loading the table itself
  from the shard (its own `_load_rows`, the shard's pages dropped from the page
  cache first, then again warm) vs building it over the sidecar's warm arena
  (map + the default sample check of the checkpoint's rows);
- step time: the same extend batches through both modules, interleaved
  rounds, median per module and their ratio; and whether the outputs are
  bit-identical.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

__all__ = ["run_engines_bench", "engines_line"]


def _spec(vocab: int, hidden: int):
    from tierstore.table.spec import EngramSpec

    return EngramSpec(name="bench-engines", layer_ids=(1,), max_ngram=4, n_heads=8, engram_vocab_size=vocab,
                      compressed_vocab_size=1000, row_dim=256, row_format="fp8-e4m3-ue8m0", hidden_size=hidden,
                      hc_mult=4, use_conv=False, rms_norm_eps=1e-20)


def _write_shard(path: Path, rows: int, spec, rng) -> tuple[np.ndarray, np.ndarray]:
    """embed.weight / embed.scale of layer 1 (valid e4m3 and ue8m0 bytes) plus wkv, q, k, as safetensors."""
    import torch
    from safetensors.torch import save_file

    w = rng.integers(0, 0x7E, (rows, 256), dtype=np.uint8)
    s = rng.integers(120, 130, (rows, 8), dtype=np.uint8)
    D, hc, E = spec.hidden_size, spec.hc_mult, spec.columns * 256
    p = "layers.1.engram."
    save_file({p + "embed.weight": torch.from_numpy(w).view(torch.float8_e4m3fn),
               p + "embed.scale": torch.from_numpy(s).view(torch.float8_e8m0fnu),
               p + "wkv.weight": (0.02 * torch.randn((hc + 1) * D, E)).to(torch.bfloat16),
               p + "q_weight": torch.ones(hc, D, dtype=torch.bfloat16),
               p + "k_weight": torch.ones(hc, D, dtype=torch.bfloat16)}, str(path))
    return w, s


def _config(spec):
    from transformers import PretrainedConfig

    return PretrainedConfig(engram_layer_ids=[1], engram_max_ngram_size=spec.max_ngram, engram_n_heads=spec.n_heads,
                            engram_vocab_size=spec.engram_vocab_size[0], engram_num_embeddings=[spec.rows(1)],
                            engram_head_dim=256, engram_pad_token_id=2, engram_compressed_vocab_size=1000,
                            hidden_size=spec.hidden_size, hc_mult=spec.hc_mult, rms_norm_eps=spec.rms_norm_eps)


def _build(engram, spec, shard: Path):
    """sglang's Engram for layer 1, loaded from the shard through sglang's loaders; (module, seconds)."""
    import torch
    from safetensors import safe_open

    t0 = time.perf_counter()
    config = _config(spec)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        m = engram.Engram(config, 1, engram.EngramLayout.from_config(config))
    finally:
        torch.set_default_dtype(before)
    p = "layers.1.engram."
    with safe_open(str(shard), "pt") as f:
        m.embed.weight.weight_loader(m.embed.weight, f.get_tensor(p + "embed.weight"))
        m.embed.scale.weight_loader(m.embed.scale, f.get_tensor(p + "embed.scale"))
        m.wkv.weight.weight_loader(m.wkv.weight, f.get_tensor(p + "wkv.weight"))
        with torch.no_grad():
            m.q_weight.copy_(f.get_tensor(p + "q_weight"))
            m.k_weight.copy_(f.get_tensor(p + "k_weight"))
    m.embed.finish_load("layer 1")
    return m.eval(), time.perf_counter() - t0


def _drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_engines_bench(out_dir, *, vocab: int | None = None, tokens: int = 512, rounds: int | None = None,
                      quick: bool = False, seed: int = 0, log=print) -> dict:
    """Returns the scenario's results.json entry (see the module docstring)."""
    import torch

    from tierstore.client.engines import sglang as ts_sglang
    from tierstore.ingest.writer import write_version
    from tierstore.sidecar.launcher import SidecarProcess

    engram, _ = ts_sglang.import_engram()
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(tp_size=1, tp_rank=0)
    vocab = vocab or (20_000 if quick else 200_000)
    rounds = rounds or (5 if quick else 15)
    spec = _spec(vocab, 256)
    rows = spec.rows(1)
    rng = np.random.default_rng(seed)
    work = Path(tempfile.mkdtemp(prefix="bench-engines-", dir=out_dir))
    shard = work / "model-00001-of-00001.safetensors"
    log(f"bench engines: writing a {rows} x 264 B table ({rows * 264 / 2**20:.0f} MiB) as a shard and a version")
    w, s = _write_shard(shard, rows, spec, rng)
    packed = np.concatenate([w, s], axis=1)
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
        os.environ["TIERSTORE_SGLANG_SOCKET"] = str(sc.socket)
        try:
            ts_sglang.install()
            fed, res["tierstore_start_s"] = _build(engram, spec, shard)
        finally:
            for var in ("TIERSTORE_SGLANG_SOCKET", "SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE",
                        "SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT"):
                os.environ.pop(var, None)
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
    (work / "result.json").write_text(json.dumps(res, indent=1))
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return res


def engines_line(res: dict) -> str:
    return (f"engines: sglang Engram on CPU, {res['rows']} rows ({res['table_mib']:.0f} MiB): step "
            f"{res['tierstore_step_ms']:.2f} ms fed by tierstore vs {res['own_step_ms']:.2f} ms own table "
            f"({res['step_ratio']:.2f}x), bit-exact {res['bit_exact']}; start-up {res['tierstore_start_s']:.3f} s "
            f"over the warm arena vs {res['own_start_cold_s']:.2f} s loading (cold page cache), "
            f"{res['own_start_warm_s']:.2f} s (warm)")
