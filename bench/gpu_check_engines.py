"""One prepared script for a machine with a GPU: the engines' Engram kernels reading
tierstore's split arena in place, bit-exact against the CPU path.

    python -m tierstore.bench.gpu_check_engines --out $OUT [--vllm-path DIR ...] [--rows 1048576] [--tokens 4096]
        [--restart-scale 96]

Every supported vLLM release in one run: the vLLM parts (2, 4 and 5) run once for the vLLM
this environment imports and once for each --vllm-path DIR (another release installed with
`pip install --no-deps --target DIR vllm==0.33.0`: vLLM 0.33 and 0.34 share their CUDA torch
2.14 and their kernels' imports), each in a process of its own (a process imports one vLLM),
their checks named "vLLM <version>: ..."; the report lists the supported releases it did not
check. A sidecar serves one synthetic fp8-e4m3-ue8m0 table (Engram layer 1) split-layout, then:
1. split arena: its tensors are the mapping, the scales right after the weights (the one
   range register_cuda pins); Client.split_table(...).register_cuda() (cudaHostRegister,
   read-only); torch must see the weights and scales as pinned (what vLLM's UVA views require).
2. vLLM (each release): with tierstore's vLLM plugin installed, a real
   ParallelEngramEmbedding(cpu_offload=True) is built (tensor-parallel world of one);
   its `_storage()` views must address the arena itself (UVA: device pointer == host
   pointer), and `lookup()` (vLLM's `_engram_lookup_kernel`) must give, for [tokens, 24]
   ids, the bf16 rows the CPU path decodes from the sidecar's interleaved rows, bit for
   bit, and in packed mode (EngramBatch.packed_rows' format) tierstore's 264-byte rows.
   The kernel is also launched directly over vLLM's UVA views of the arena (what is left
   to check when the module cannot be built: it says why).
3. sglang 0.5.23 (if installed): `engram_gather` over the registered arena pointers,
   the same bf16 rows bit for bit.
4. vLLM staged (each release; NOT YET RUN: written on a host without a GPU): the same
   table served again in cache mode (a quarter of the rows fit), a real staged
   ParallelEngramEmbedding (client/engines/vllm_stager.py, no rows held) and the process's
   StepStager with GRAPH_TOKENS-token persistent buffers: a CUDA graph captured at
   GRAPH_TOKENS tokens over the layer's lookup (after a dummy step, as vLLM captures after
   its profile run), replayed after each step of several sizes is staged
   (StepStager.stage_ids: rows read, copied on the side stream), must give each step's bf16
   rows bit for bit, zero padding, the buffers' storage unchanged; a step past the buffers,
   read on a side stream as Engram._start_prefetch runs it, the same bf16 and packed rows
   (ids outside the table included: zeros, as the kernel writes); vllm_stager.dequantize
   must equal `_engram_lookup_kernel` on the GPU for every e4m3 x ue8m0 byte pair (NaN equal
   to NaN: what the CPU test could not check under Triton's interpreter).
5. vLLM runner (each release; NOT YET RUN): the staged step hook's device path through
   vLLM's V2 runner state (the simple form at vLLM's defaults): the prompts written by
   vLLM's own kernel, a step's sampled tokens by its post_update, the next step's inputs by
   its own prepare kernels (a verify block: the sampled token, then drafts) and look-back
   windows, read by vllm_stager.step_windows after its one stream wait: every window the
   host expects.
6. sglang's row stager (NOT YET RUN): the same cache-mode sidecar's rows gathered by
   StagedTable (local reads, verified misses) into pinned split buffers and uploaded on a
   side stream (sglang_stager.upload, what RowStager does per layer) while a stand-in
   forward (bf16 matmuls) runs on the main stream: the device rows must equal the split
   arena's bytes, and the copies must overlap the forward (the time both take together
   against each alone, reported as the share of the shorter one hidden).
7. sglang graph staging (NOT YET RUN): the persistent staging buffers a captured decode
   graph reads (client/engines/staging_buffers.py, GRAPH_BATCH requests x 24 columns):
   a CUDA graph captured over the staged layer's read of them (sglang_stager.dequant_rows,
   sglang's engram_gather), then for batches of several sizes the rows gathered from the
   cache-mode sidecar into the host buffers, published (one side-stream copy per buffer,
   rows past the batch zeroed) and the graph replayed: each replay's rows must equal the
   CPU path's (dequant_rows over the same bytes on the host) bit for bit, its padded
   slots be zero, and the buffers keep their addresses.
8. engine restart time (CPU and this host's disk, no GPU needed): `tierstore bench engines`'
   restart cell (bench/engines.py restart_cell) on V4.1's Engram layout divided by
   --restart-scale (0: skipped; 6 is the 1/6 scale, which needs about 3 x 34 GB of disk):
   sglang's loader over the checkpoint with tierstore's loader filter against a model with
   no Engram (its dense stand-in as large as the tables), and without the filter; the check
   is the filtered restart within 1.2x of the one with no Engram.
9. vLLM's two forms (each release; NOT YET RUN: written on a host without a GPU): over the
   cache-mode sidecar, a staged layer's step in the simple form (StepStager.stage_ids, then
   the layer's lookup of the staged rows) and in the fast form (TIERSTORE_VLLM_STAGE_FORM=fast:
   the lookup alone, kernels/staged_gather.py on the device, misses filled by the layer's
   host thread) against vLLM's own lookup over its own table resident on the device: each
   bit for bit against the CPU path, then tokens/s and each form's ratio to vLLM's own. A
   form whose rows differ, or a fast form whose device side failed during its timed steps,
   reports no figure and fails the run. Then the fast form's lost host thread: its step's
   missed rows NaN (never another step's) and StagingError at the layer's next lookup.
10. sglang's two forms (NOT YET RUN): the same for sglang, against `engram_gather` over
   sglang's own resident host table (pinned, read over UVA): the simple form's rows gathered
   into pinned buffers, uploaded on a side stream and dequantised (dequant_rows), the fast
   form's by RowStager.fast_rows.
Writes OUT/gpu_check_engines.json (each vLLM release's own report under OUT/vllm-N/) and
exits 1 if any check fails; without CUDA it says so and exits 2 (nothing was checked). Sized
to finish, with two vLLM releases, well under the eight minutes of one device run: the vLLM
parts of a release take a process start, its vLLM import and a 1 M-row table of their own.

    python -m tierstore.bench.gpu_check_engines --cpu-smoke --out DIR

runs every part on CPU at tiny sizes (a 16,384-row table, 64 tokens, the restart cell
at 1/8000 for one round), so that a typo or a stale call fails in CI rather than in a
GPU machine's scarce minutes (tests/bench/test_gpu_check.py runs it). It sets, before
Triton or vLLM is first imported, Triton's interpreter (TRITON_INTERPRET=1),
CUDA_VISIBLE_DEVICES="" (vLLM keeps its Triton kernels real without a driver) and vLLM's
CPU platform (VLLM_TARGET_DEVICE=cpu). The sidecars, shared memory and clients are the
real ones; the engines' kernels run under the interpreter over CPU tensors. Stand-ins, on
CPU only: a device view of a host tensor is the tensor itself (vLLM's UVA views), the SM
count is 4, a captured graph's replay runs its work again, side-stream work runs inline,
vLLM's V2 runner buffers are host tensors (its UVA buffers need pinned memory). What has
no CPU equivalent (registration, sglang's engram_gather, which takes CUDA ids only, the
upload's overlap, the interpreter's NaN decode, the pinned token history) is recorded as
"skipped on CPU: <why>"; part 8's ratio at 1/8000 as skipped too (too small to mean
anything). Timings are the interpreter's and mean nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import torch

from tierstore.bench.gpu_check import device_name, smoke_env, synchronize

HEADS, DIM = 24, 256
GRAPH_TOKENS = 64  # tokens of the largest captured graph in part 4 (its persistent staging buffers)
GRAPH_BATCH = 64  # requests of the largest captured decode graph in part 7
PARTS = ("split arena", "vllm", "sglang", "vllm staged", "vllm runner", "sglang stager", "sglang graph staging",
         "restart", "vllm forms", "sglang forms")
VLLM_PARTS = ("vllm", "vllm staged", "vllm runner", "vllm forms")  # run once per vLLM release, in a child each
# What --cpu-smoke adds to gpu_check.SMOKE_ENV: vLLM's CPU platform, resolved when vLLM is first imported.
SMOKE_ENV = {"VLLM_TARGET_DEVICE": "cpu"}
SKIP_NO_CUDA = "skipped on CPU: "
# Part 8's ratio is judged at this layout (V4.1's / 160, the smallest docs/benchmarks.md measured it at)
# or larger; at smaller ones (--quick's 1/8000) the layers' build and the client's connection dominate it.
RESTART_JUDGED_AT = 160


@dataclass(frozen=True)
class Sizes:
    """What each part reads and how often it times it: the GPU run's, or the CPU smoke's."""

    rows: int  # the table's rows (--rows)
    tokens: int  # [tokens, HEADS] ids a step (--tokens); at least GRAPH_TOKENS and GRAPH_BATCH
    restart_scale: int  # part 8's V4.1 layout divided by this (--restart-scale)
    restart_rounds: int
    lookup_rounds: int  # timed lookups (parts 2 and 4)
    forward_dim: int  # part 6's stand-in forward: bf16 [forward_dim, forward_dim] matmuls


GPU_SIZES = Sizes(rows=1 << 20, tokens=4096, restart_scale=96, restart_rounds=3, lookup_rounds=20, forward_dim=4096)
# 16,384 rows: above about 5,300 the cache-mode budget (a quarter of the rows + 1 MiB) holds fewer than all
SMOKE_SIZES = Sizes(rows=1 << 14, tokens=64, restart_scale=8000, restart_rounds=1, lookup_rounds=1, forward_dim=64)


def _interpreter_takes_bools() -> None:
    """Triton 3.7's interpreter boxes a Python bool passed to a kernel argument that is not
    constexpr as int32 under an int1 type, and refuses it; vLLM passes SORTED=False that way.
    Boxed as the int it is, the kernel runs unmodified (CPU smoke only)."""
    import triton.runtime.interpreter as interpreter

    convert = interpreter._implicit_cvt
    interpreter._implicit_cvt = lambda arg: convert(int(arg) if isinstance(arg, bool) else arg)


@contextlib.contextmanager
def _vllm_on(device: torch.device, engram):
    """vLLM's Engram layer as it runs on `device`: on CUDA untouched; on CPU what it asks
    of a GPU answered, nothing else replaced: the SM count (its lookup's grid; 4) and a
    device view of a host tensor, which on the host is the tensor itself (UVA's view)."""
    if device.type == "cuda":
        yield
        return
    sms = SimpleNamespace(multi_processor_count=4)
    with mock.patch.object(torch.accelerator, "current_device_index", return_value=0), \
            mock.patch.object(torch.cuda, "get_device_properties", return_value=sms), \
            mock.patch.object(engram, "get_accelerator_view_from_cpu_tensor", lambda t: t):
        yield


@contextlib.contextmanager
def _side_stream(device: torch.device):
    """The block's work on a side stream ordered after the current one, the current stream
    waiting for it on exit (what Engram._start_prefetch does); on CPU the work runs inline."""
    if device.type != "cuda":
        yield
        return
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        yield
        done = torch.cuda.Event()
        done.record(side)
    torch.cuda.current_stream(device).wait_event(done)


def _capture(fn, device: torch.device):
    """replay() -> fn's output: on CUDA a graph captured over fn (warmed up by the caller),
    each replay rereading the addresses fn read and rewriting the tensor it returned; on CPU
    (no graphs) fn run again."""
    if device.type != "cuda":
        return fn
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay():
        graph.replay()
        return out

    return replay


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16)))


def _head_sizes(rows: int) -> tuple[int, ...]:
    base = rows // HEADS
    return tuple(base + (1 if h < rows - base * HEADS else 0) for h in range(HEADS))


def _ids(rng, sizes: tuple[int, ...], tokens: int) -> np.ndarray:
    """[tokens, HEADS] global row ids, head h's within its own range (as hashing makes them)."""
    offsets = np.cumsum((0,) + sizes[:-1])
    return (offsets + rng.integers(0, np.array(sizes), (tokens, HEADS))).astype(np.int32)


def _lookup_rate(emb, dev_ids: torch.Tensor, out: torch.Tensor, rows: int, rounds: int) -> float:
    """Rows a second of `rounds` of emb.lookup(dev_ids, out), the device synchronised around them."""
    synchronize(out.device)
    t0 = time.perf_counter()
    for _ in range(rounds):
        emb.lookup(dev_ids, out)
    synchronize(out.device)
    return rows * rounds / (time.perf_counter() - t0)


def _reference(packed: np.ndarray) -> torch.Tensor:
    """The CPU path: tierstore's decode of interleaved 264-byte rows, to bf16."""
    from tierstore.table.formats import decode_rows

    return torch.from_numpy(decode_rows(packed, "fp8-e4m3-ue8m0", DIM)).to(torch.bfloat16)


def check_split_arena(split, device: torch.device) -> dict:
    """Part 1: the split arena's tensors, one range (weights, then scales: what one registration
    covers), page-locked for CUDA and seen pinned by torch."""
    w, s = split.tensors()
    res = {"tensors are the mapping, scales right after the weights": (
        w.data_ptr() == split.weight.ctypes.data and s.data_ptr() == w.data_ptr() + w.nbytes)}
    if device.type != "cuda":
        res["registered"] = SKIP_NO_CUDA + "cudaHostRegister needs a CUDA device (SplitTable.register_cuda refuses)"
        return res
    split.register_cuda()
    return {**res, "registered (weights pinned)": bool(w.is_pinned()),
            "registered (scales pinned)": bool(s.is_pinned())}


def check_vllm(socket: str, table: str, rows: int, ids: np.ndarray, want: torch.Tensor,
               want_packed: np.ndarray, split, device: torch.device, sizes: Sizes) -> dict:
    try:
        from vllm.models.deepseek_v41.common import engram
    except Exception as e:  # noqa: BLE001 - report why, run the rest
        return {"skipped": f"vLLM's Engram module does not import here: {type(e).__name__}: {e}"}
    from tierstore.client.engines import vllm_plugin

    res: dict = {}
    dev_ids = torch.from_numpy(ids).to(device)
    with _vllm_on(device, engram):
        try:
            emb = _build_vllm_embedding(engram, vllm_plugin, socket, table, rows)
            weight, scales = emb._storage()
            res["_storage() views address the arena (UVA)"] = (
                weight.device.type == device.type and weight.data_ptr() == split.weight.ctypes.data
                and scales.data_ptr() == split.scale.ctypes.data)
            out = torch.empty(ids.shape[0], HEADS, DIM, dtype=torch.bfloat16, device=device)
            emb.lookup(dev_ids, out)
            res["ParallelEngramEmbedding.lookup bf16 == CPU path"] = _same_bits(out.cpu(), want)
            packed = torch.empty(ids.shape[0], HEADS, DIM + DIM // 32, dtype=torch.uint8, device=device)
            emb.lookup(dev_ids, packed)
            res["lookup packed == tierstore rows"] = bool(np.array_equal(packed.cpu().numpy(), want_packed))
            res["lookup rows/s over the arena"] = _lookup_rate(emb, dev_ids, out, ids.size, sizes.lookup_rounds)
        except Exception as e:  # noqa: BLE001 - the bare kernel below still runs; say why
            res["module route"] = f"not built: {type(e).__name__}: {e}"
        w, s = split.tensors()
        weight = engram.get_accelerator_view_from_cpu_tensor(w)
        scales = engram.get_accelerator_view_from_cpu_tensor(s.view(torch.uint8))
        res["UVA views address the arena"] = weight.data_ptr() == split.weight.ctypes.data
        n = ids.size
        grid = min(-(-n // 16), torch.cuda.get_device_properties(0).multi_processor_count)
    for name, out in (("bf16", torch.empty(ids.shape[0], HEADS, DIM, dtype=torch.bfloat16, device=device)),
                      ("packed", torch.empty(ids.shape[0], HEADS, DIM + DIM // 32, dtype=torch.uint8, device=device))):
        engram._engram_lookup_kernel[(grid,)](
            weight, scales, dev_ids, dev_ids, out, 0, rows, n, dev_ids.stride(0), dev_ids.stride(1),
            HEAD_START=0, LOCAL_HEADS=HEADS, TOTAL_HEADS=HEADS, DIM=DIM, QUANT_BLOCK=32, BLOCK_R=16, GRID=grid,
            SORTED=False, PACKED=out.dtype == torch.uint8, OUT_STRIDE=out.stride(0))
        ok = (_same_bits(out.cpu(), want) if name == "bf16" else bool(np.array_equal(out.cpu().numpy(), want_packed)))
        res[f"_engram_lookup_kernel {name} == CPU path"] = ok
    return res


def _build_vllm_embedding(engram, vllm_plugin, socket: str | None, table: str, rows: int, stage: str = "auto",
                          stage_form: str = "simple"):
    """A real ParallelEngramEmbedding over the arena: vLLM config, a TP world of one, the plugin
    (none where `socket` is None: vLLM's own layer, cpu_offload off)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    vllm_plugin.uninstall()  # a plugin installed for another sidecar keeps its tables otherwise
    if socket is not None:
        vllm_plugin.install(vllm_plugin.VllmPluginConfig(socket, {1: table}, stage=stage, stage_form=stage_form))
    config = VllmConfig()  # vLLM's defaults: async scheduling where the platform has it
    with set_current_vllm_config(config):
        if not ps.model_parallel_is_initialized():
            ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                            distributed_init_method=f"tcp://127.0.0.1:{29500 + os.getpid() % 1000}")
            ps.initialize_model_parallel(1, 1)
        with vllm_plugin.engram_layer(1):
            return engram.ParallelEngramEmbedding(rows, DIM, _head_sizes(rows), cpu_offload=socket is not None)


def check_vllm_staged(socket: str, table: str, rows: int, ids: np.ndarray, want: torch.Tensor,
                      want_packed: np.ndarray, device: torch.device, sizes: Sizes) -> dict:
    """Part 4 (not yet run on a GPU): staged rows in persistent buffers read by a captured graph."""
    try:
        from vllm.models.deepseek_v41.common import engram
    except Exception as e:  # noqa: BLE001
        return {"skipped": f"vLLM's Engram module does not import here: {type(e).__name__}: {e}"}
    from tierstore.client.engines import vllm_plugin, vllm_stager

    res: dict = {}
    with _vllm_on(device, engram):
        emb = _build_vllm_embedding(engram, vllm_plugin, socket, table, rows)
    res["staged: no rows held"] = emb.weight.shape[0] == 0 and emb.tierstore_staged is not None
    vllm_plugin.staged_tables().graph_tokens = GRAPH_TOKENS  # VllmConfig() without a model resolves no sizes
    stager = vllm_plugin.staged_tables().step_stager(device)
    ptrs = (stager.buffers.weight.data_ptr(), stager.buffers.scale.data_ptr())
    dev_ids = torch.from_numpy(ids).to(device)
    # a graph captured at the largest size over the staged layer's lookup, replayed per step
    out = torch.empty(GRAPH_TOKENS, HEADS, DIM, dtype=torch.bfloat16, device=device)
    stager.stage_none()  # vLLM captures after its profile run: a dummy batch through prepare_inputs
    emb.lookup(dev_ids[:GRAPH_TOKENS], out)  # warm-up outside the capture
    replay = _capture(lambda: emb.lookup(dev_ids[:GRAPH_TOKENS], out), device)
    if device.type != "cuda":
        res["CUDA graph"] = SKIP_NO_CUDA + "no graphs; each replay runs the staged lookup again"
    same, zero = True, True
    for size in (1, 3, 8, 17, GRAPH_TOKENS - 1, GRAPH_TOKENS, 5):
        stager.stage_ids({1: ids[:size]})
        replay()
        synchronize(device)
        same &= _same_bits(out[:size].cpu(), want[:size])
        zero &= bool((out[size:] == 0).all())
    res["graph replays read each step's staged rows (bf16 == CPU path)"] = same
    res["graph replays' padding is zero"] = zero
    res["buffers keep their storage"] = (stager.buffers.weight.data_ptr(), stager.buffers.scale.data_ptr()) == ptrs
    # a step past the buffers (eager), read on a side stream as Engram._start_prefetch runs it
    bad = ids.copy()
    bad[0, 0], bad[1, 3] = -1, rows + 9  # outside the table: zero rows, as the kernel writes
    want_bad, want_packed_bad = want.clone(), want_packed.copy()
    want_bad[0, 0] = want_bad[1, 3] = 0
    want_packed_bad[0, 0] = want_packed_bad[1, 3] = 0
    eager = torch.full((ids.shape[0], HEADS, DIM), 7.0, dtype=torch.bfloat16, device=device)
    packed = torch.empty(ids.shape[0], HEADS, DIM + DIM // 32, dtype=torch.uint8, device=device)
    for out in (eager, packed):  # two forwards of the step: a forward reads a step's rows once
        stager.stage_ids({1: bad})
        with _side_stream(device):
            emb.lookup(dev_ids, out, background=True)
    res["eager staged lookup bf16 == CPU path"] = _same_bits(eager.cpu(), want_bad)
    res["eager staged lookup packed == tierstore rows"] = bool(np.array_equal(packed.cpu().numpy(), want_packed_bad))
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(sizes.lookup_rounds):
        stager.stage_ids({1: ids})
        emb.lookup(dev_ids, eager)
    synchronize(device)
    res["staged step rows/s (cache mode: read, copy, dequantise)"] = (
        ids.size * sizes.lookup_rounds / (time.perf_counter() - t0))
    # every e4m3 byte under every ue8m0 byte: vLLM's kernel on the device against dequantize
    weight = torch.arange(256, dtype=torch.uint8).repeat(256, 1)
    scale = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 8)
    grid_ids = torch.arange(256, dtype=torch.int32, device=device)[:, None]
    kernel_out = torch.empty(256, 1, DIM, dtype=torch.bfloat16, device=device)
    engram._engram_lookup_kernel[(16,)](
        weight.to(device).view(torch.float8_e4m3fn), scale.to(device), grid_ids, grid_ids, kernel_out, 0, 256, 256,
        1, 1, HEAD_START=0, LOCAL_HEADS=1, TOTAL_HEADS=1, DIM=DIM, QUANT_BLOCK=32, BLOCK_R=16, GRID=16,
        SORTED=False, PACKED=False, OUT_STRIDE=kernel_out.stride(0))
    k = kernel_out.view(256, DIM).cpu()
    d = vllm_stager.dequantize(torch.cat([weight, scale], dim=1).to(device), DIM).cpu()
    nan = torch.isnan(k)
    res["dequantize == kernel for every byte pair (NaN as NaN)"] = bool(
        torch.equal(nan, torch.isnan(d)) and torch.equal(k[~nan].view(torch.int16), d[~nan].view(torch.int16)))
    res["byte pairs that differ"] = int(((k.view(torch.int16) != d.view(torch.int16)) & ~(nan & torch.isnan(d))).sum())
    if device.type != "cuda":  # tests/client/engines/test_vllm_stager.py checks every other pair under it
        res["dequantize == kernel for every byte pair (NaN as NaN)"] = SKIP_NO_CUDA + (
            "Triton's interpreter decodes the e4m3 NaN bytes as +-480 and rounds bf16 subnormals otherwise "
            "than the GPU; the count above is the interpreter's")
    vllm_plugin.uninstall()
    return res


def _tokens_per_s(step, tokens: int, rounds: int, device: torch.device) -> float:
    """Tokens a second of `rounds` calls of step() (a step of `tokens` tokens), the device
    synchronised around them."""
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(rounds):
        step()
    synchronize(device)
    return tokens * rounds / (time.perf_counter() - t0)


def _forms(steps: dict, want: torch.Tensor, tokens: int, device: torch.device, sizes: Sizes,
           layer=None) -> tuple[dict, dict]:
    """(checks, tokens/s by name) of each form's step (`steps`: name -> step() returning bf16
    [tokens, HEADS, DIM]), checked bit for bit against the CPU path `want`, then timed in
    tokens/s (after that first step: the cache has read its misses). A form whose rows differ,
    or the fast form whose device side failed during its timed steps (its DeviceLayer
    `layer`'s error words), gets no figure: its check fails instead."""
    res: dict = {}
    rates: dict = {}
    for name, step in steps.items():
        res[f"{name}: rows == CPU path"] = same = _same_bits(step().cpu(), want)
        if same:
            rates[name] = res[f"{name}: tokens/s"] = _tokens_per_s(step, tokens, sizes.lookup_rounds, device)
    if layer is not None:
        from tierstore.client.engines import StagingError

        try:
            layer.check()
            res["fast: no step failed on the device"] = True
        except StagingError as e:
            res["fast: no step failed on the device"] = False
            res["fast: the failure"] = str(e)
            rates.pop("fast", None)
            res.pop("fast: tokens/s", None)
    return res, rates


def _against_own(rates: dict, device: torch.device) -> dict:
    """Each form's tokens/s over the engine's own resident table's (`rates["own"]`)."""
    res = {f"{name} / own": rate / rates["own"] for name, rate in rates.items() if name != "own" and "own" in rates}
    if device.type != "cuda":
        res["timings"] = SKIP_NO_CUDA + "the interpreter's and the host's: they mean nothing"
    return res


def _lost_thread(layer, lookup, fresh: torch.Tensor) -> dict:
    """The fast form's DeviceLayer `layer` with its host thread stopped: a lookup (`lookup(ids)`
    -> its bf16 rows) of ids `fresh` that miss gives its missed rows NaN (POISON, never another
    step's rows) and the layer's next lookup raises StagingError naming the step."""
    from tierstore.client.engines import StagingError

    layer.server.stop()
    layer.timeout_s = 0.05
    rows = lookup(fresh)
    synchronize(rows.device)
    res = {"a lost host thread: its step's missed rows are NaN": bool(torch.isnan(rows.float()).any())}
    try:
        lookup(fresh)
        res["a lost host thread: StagingError at the layer's next lookup"] = False
    except StagingError as e:
        res["a lost host thread: StagingError at the layer's next lookup"] = "failed at its step" in str(e)
    return res


def check_vllm_forms(socket: str, table: str, rows: int, ids: np.ndarray, want: torch.Tensor,
                     table_packed: np.ndarray, device: torch.device, sizes: Sizes) -> dict:
    """Part 9 (each release; NOT YET RUN on a GPU): a staged layer's step in each form against
    vLLM's own lookup over its own table resident on the device (cpu_offload off): the simple
    form (StepStager.stage_ids, then the layer's lookup of the staged rows) and the fast form
    (TIERSTORE_VLLM_STAGE_FORM=fast: the lookup alone, on the device), each bit for bit
    against the CPU path, then tokens/s; and the fast form's lost host thread."""
    try:
        from vllm.models.deepseek_v41.common import engram
    except Exception as e:  # noqa: BLE001
        return {"skipped": f"vLLM's Engram module does not import here: {type(e).__name__}: {e}"}
    from tierstore.client.engines import vllm_plugin

    tokens = ids.shape[0]
    dev_ids = torch.from_numpy(ids).to(device)
    out = torch.empty(tokens, HEADS, DIM, dtype=torch.bfloat16, device=device)

    def staged(form: str):
        """The staged layer and the process's stager under `form` (a plugin installed afresh)."""
        emb = _build_vllm_embedding(engram, vllm_plugin, socket, table, rows, stage_form=form)
        vllm_plugin.staged_tables().graph_tokens = GRAPH_TOKENS  # VllmConfig() without a model resolves no sizes
        return emb, vllm_plugin.staged_tables().step_stager(device)

    with _vllm_on(device, engram):
        own = _build_vllm_embedding(engram, vllm_plugin, None, table, rows)
        own.weight = torch.nn.Parameter(torch.from_numpy(table_packed[:, :DIM].copy()).to(device)
                                        .view(torch.float8_e4m3fn), requires_grad=False)
        own.weight_scale_inv = torch.nn.Parameter(torch.from_numpy(table_packed[:, DIM:].copy()).to(device),
                                                  requires_grad=False)
        simple, stager = staged("simple")

        def simple_step():
            stager.stage_ids({1: ids})
            simple.lookup(dev_ids, out)
            return out

        res, rates = _forms({"own": lambda: (own.lookup(dev_ids, out), out)[1], "simple": simple_step}, want,
                            tokens, device, sizes)
        stager.close()
        fast, stager = staged("fast")
        try:
            res["fast: the stager stages nothing on the host"] = stager.form == "fast"
            layer = next(iter(stager._device.values()))
            got, fast_rate = _forms({"fast": lambda: (fast.lookup(dev_ids, out), out)[1]}, want, tokens, device,
                                    sizes, layer)
            res.update(got)
            res.update(_against_own({**rates, **fast_rate}, device))
            res["fast: steps whose misses the host thread filled"] = layer.server.filled
            fresh = torch.from_numpy(np.random.default_rng(7).permutation(rows)[:ids.size].reshape(ids.shape)
                                     .astype(np.int32)).to(device)
            res.update(_lost_thread(layer, lambda i: (fast.lookup(i, out), out)[1], fresh))
        finally:
            stager.close()
    vllm_plugin.uninstall()
    return res


def check_sglang_forms(socket: str, table: str, ids: np.ndarray, want: torch.Tensor, table_packed: np.ndarray,
                       device: torch.device, sizes: Sizes) -> dict:
    """Part 10 (NOT YET RUN on a GPU): a staged layer's rows of a step in each form against
    sglang's own lookup over its own resident host table (pinned: `engram_gather` over UVA; on
    CPU its torch path, dequant_rows): the simple form (StagedTable.gather into pinned buffers,
    the side-stream upload, dequant_rows) and the fast form (RowStager.fast_rows: the device
    looks the rows up), each bit for bit against the CPU path, then tokens/s; and the fast
    form's lost host thread. The stager's hasher is a stand-in (the fast form reads the
    engine's hash ids, here the step's ids)."""
    from tierstore.client.client import Client
    from tierstore.client.engines.sglang_stager import RowStager, StagedTable, dequant_rows, upload

    cuda = device.type == "cuda"
    tokens = ids.shape[0]
    embed = SimpleNamespace(dim=DIM)
    flat = np.ascontiguousarray(ids.reshape(-1), dtype=np.int64)
    dev_flat = torch.from_numpy(flat).to(device)
    host_w = torch.from_numpy(table_packed[:, :DIM].copy())
    host_s = torch.from_numpy(table_packed[:, DIM:].copy())
    if cuda:
        host_w, host_s = host_w.pin_memory(), host_s.pin_memory()
    weight = torch.empty((flat.size, DIM), dtype=torch.uint8, pin_memory=cuda)
    scale = torch.empty((flat.size, DIM // 32), dtype=torch.uint8, pin_memory=cuda)
    side = torch.cuda.Stream(device) if cuda else None

    def own_step():
        if not cuda:
            return dequant_rows(embed, host_w[dev_flat], host_s[dev_flat], ids.shape)
        from sglang.kernels.ops.embeddings.engram_gather import engram_gather

        out = torch.empty(flat.size, DIM, dtype=torch.bfloat16, device=device)
        engram_gather(host_w.data_ptr(), host_s.data_ptr(), dev_flat, out, DIM, 32)
        return out.view(*ids.shape, DIM)

    with Client(socket) as c:
        staged = StagedTable(c, table)

        def simple_step():
            staged.gather(flat, weight.numpy(), scale.numpy())
            if not cuda:
                return dequant_rows(embed, weight, scale, ids.shape)
            rows, scales, copied = upload(weight, scale, device, side)
            torch.cuda.current_stream(device).wait_event(copied)
            return dequant_rows(embed, rows, scales, ids.shape)

        hasher = SimpleNamespace(max_ngram_size=4, primes=np.zeros((1, 3, HEADS // 3)))  # 24 columns, one layer
        layer_embed = SimpleNamespace(dim=DIM, tierstore_table=staged)
        stager = RowStager(hasher, [SimpleNamespace(layer_hash_index=0, embed=layer_embed)], device, form="fast")
        try:
            fast_step = lambda: stager.fast_rows(layer_embed, dev_flat.view(ids.shape))  # noqa: E731
            layer = next(iter(stager._device.values()))
            res, rates = _forms({"own": own_step, "simple": simple_step, "fast": fast_step}, want, tokens, device,
                                sizes, layer)
            res.update(_against_own(rates, device))
            res["fast: steps whose misses the host thread filled"] = layer.server.filled
            fresh = torch.from_numpy(np.random.default_rng(8).permutation(staged.rows)[:flat.size]
                                     .reshape(ids.shape)).to(device)
            res.update(_lost_thread(layer, lambda i: stager.fast_rows(layer_embed, i), fresh))
        finally:
            stager.close()
    return res


def check_vllm_runner(device: torch.device, tokens: int) -> dict:
    """Part 5 (not yet run on a GPU): the staged step hook's device path through vLLM's V2 runner
    state, the simple form at vLLM's defaults: the prompts written into the token history by
    vLLM's own kernel (apply_staged_writes), a step's sampled tokens by vLLM's own post_update
    (as the last step's sampling writes them, still running under async scheduling), then the
    next step's inputs as vLLM's prepare_inputs writes them on the device (prepare_pos_seq_lens,
    combine_sampled_and_draft_tokens: the sampled token and a verify block's drafts from
    `draft_tokens`) and its look-back windows (DeepseekV41ModelState's _gather_lookback_kernel);
    vllm_stager.step_windows reads them after its one stream wait: every window the host
    expects, drafts included."""
    try:
        from vllm.models.deepseek_v41.nvidia.model_state import _gather_lookback_kernel
        from vllm.triton_utils import triton
        from vllm.v1.worker.gpu import buffer_utils
        from vllm.v1.worker.gpu.input_batch import (InputBatch, InputBuffers, combine_sampled_and_draft_tokens,
                                                    post_update, prepare_pos_seq_lens)
        from vllm.v1.worker.gpu.states import RequestState
    except Exception as e:  # noqa: BLE001
        return {"skipped": f"vLLM's V2 runner modules do not import here: {type(e).__name__}: {e}"}
    import dataclasses

    from tierstore.client.engines import vllm_stager

    reqs, depth, drafts = 64, 4, 2
    prompt = max(8, tokens // reqs)
    rng = np.random.default_rng(5)
    prompts = rng.integers(0, 1 << 17, (reqs, prompt)).astype(np.int32)
    res: dict = {}
    with contextlib.ExitStack() as stack:
        if device.type != "cuda":  # the GPU runner's UVA buffers need pinned memory: host tensors on CPU
            stack.enter_context(mock.patch.object(buffer_utils, "is_uva_available", lambda: False))
        req_states = RequestState(reqs, prompt + 8, reqs * prompt, drafts, 1 << 17, device)
        buffers = InputBuffers(reqs, reqs * prompt, device)
    history = req_states.all_token_ids
    for r in range(reqs):
        req_states.add_request(f"r{r}", prompt, prompts[r].tolist(), 0, 8)
    req_states.apply_staged_writes()  # vLLM's kernel writes the prompts through the device
    idx = np.array([req_states.req_id_to_index[f"r{r}"] for r in range(reqs)])
    idx_dev = torch.from_numpy(idx.astype(np.int64)).to(device)
    req_states.num_computed_tokens.gpu[idx_dev] = prompt  # the prefill ran: the sampled token is the next input
    sampled = rng.integers(0, 1 << 17, (reqs, 1))
    proposed = rng.integers(0, 1 << 17, (reqs, drafts))
    post_update(idx_dev, req_states.num_computed_tokens.gpu, req_states.last_sampled_tokens, None,
                torch.from_numpy(sampled).to(device), torch.ones(reqs, dtype=torch.int32, device=device),
                torch.zeros(reqs, dtype=torch.int32, device=device), None, history.gpu, req_states.total_len.gpu)
    req_states.draft_tokens[idx_dev] = torch.from_numpy(proposed).to(req_states.draft_tokens)
    # the verify step: each request's sampled token and its drafts, at the positions the device counts
    per = 1 + drafts
    start = np.arange(reqs + 1, dtype=np.int32) * per
    query_start_loc = torch.from_numpy(start).to(device)
    dummy = InputBatch.make_dummy(reqs, reqs * per, buffers)
    prepare_pos_seq_lens(idx_dev, query_start_loc, req_states.num_computed_tokens.gpu, buffers.positions,
                         buffers.seq_lens)
    combine_sampled_and_draft_tokens(buffers.input_ids, idx_dev, req_states.last_sampled_tokens, query_start_loc,
                                     buffers.seq_lens[:reqs], req_states.prefill_len.gpu, req_states.draft_tokens,
                                     query_start_loc, reqs * per)
    lookback = torch.full((reqs, depth - 1), -1, dtype=torch.int32, device=device)
    _gather_lookback_kernel[(reqs,)](lookback, idx_dev, query_start_loc, buffers.positions, history.gpu,
                                     history.gpu.stride(0), reqs, DEPTH=depth - 1,
                                     BLOCK_DEPTH=triton.next_power_of_2(depth - 1))
    batch = dataclasses.replace(dummy, req_ids=[f"r{r}" for r in range(reqs)], idx_mapping=idx_dev,
                                idx_mapping_np=idx, query_start_loc=query_start_loc, query_start_loc_np=start,
                                input_ids=buffers.input_ids[:reqs * per], positions=buffers.positions[:reqs * per])
    t0 = time.perf_counter()
    got = vllm_stager.step_windows(batch, lookback, depth)  # one wait, then the copies
    res["step_windows s (its one wait included)"] = time.perf_counter() - t0
    seq = np.concatenate([prompts, sampled, proposed], axis=1)  # each request's tokens through its drafts
    pos = prompt + np.arange(per)  # the block's positions: the sampled token's, then the drafts'
    want = np.stack([seq[:, p - np.arange(depth)] for p in pos], axis=1).reshape(reqs * per, depth)
    res["the verify step's windows (sampled token, drafts, their predecessors)"] = bool(np.array_equal(got, want))
    return res


def check_sglang_stager(socket: str, table: str, ids: np.ndarray, want_packed: np.ndarray,
                        device: torch.device, sizes: Sizes) -> dict:
    """Part 6 (not yet run on a GPU): the stager's side-stream upload overlapping a forward."""
    from tierstore.client.client import Client
    from tierstore.client.engines.sglang_stager import StagedTable, upload

    cuda = device.type == "cuda"
    flat = np.ascontiguousarray(ids.reshape(-1), dtype=np.int64)
    weight = torch.empty((flat.size, DIM), dtype=torch.uint8, pin_memory=cuda)
    scale = torch.empty((flat.size, DIM // 32), dtype=torch.uint8, pin_memory=cuda)
    with Client(socket) as c:
        StagedTable(c, table).gather(flat, weight.numpy(), scale.numpy())
    if not cuda:  # the stager stages host rows where they are (RowStager._stage_layers): no upload
        got = torch.cat([weight, scale], dim=1).numpy().reshape(want_packed.shape)
        return {"staged rows on the device == tierstore rows": bool(np.array_equal(got, want_packed)),
                "the upload overlaps the forward": SKIP_NO_CUDA + "the upload is a copy on a CUDA side stream"}
    side = torch.cuda.Stream()
    a = torch.randn(sizes.forward_dim, sizes.forward_dim, dtype=torch.bfloat16, device=device)

    def forward():
        for _ in range(8):
            torch.mm(a, a)

    def timed(fn) -> tuple:
        synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        synchronize(device)
        return time.perf_counter() - t0, out

    forward()  # warm the matmul and the copy path
    upload(weight, scale, device, side)
    t_fwd, _ = timed(forward)
    t_copy, _ = timed(lambda: upload(weight, scale, device, side))
    t_both, (rows, scales, copied) = timed(lambda: (upload(weight, scale, device, side), forward())[0])
    torch.cuda.current_stream().wait_event(copied)
    got = torch.cat([rows, scales], dim=1).cpu().numpy().reshape(want_packed.shape)
    hidden = (t_fwd + t_copy - t_both) / max(1e-9, min(t_fwd, t_copy))
    return {"staged rows on the device == tierstore rows": bool(np.array_equal(got, want_packed)),
            "forward s": t_fwd, "upload s": t_copy, "both s": t_both,
            "share of the shorter hidden (1 = full overlap)": hidden,
            "the upload overlaps the forward": hidden > 0.5}


def check_sglang_graph_staging(socket: str, table: str, ids: np.ndarray, device: torch.device) -> dict:
    """Part 7 (not yet run on a GPU): a CUDA graph over the persistent staging buffers,
    replayed after each batch is staged into them, against the CPU path bit for bit."""
    from tierstore.client.client import Client
    from tierstore.client.engines.sglang_stager import StagedTable, dequant_rows
    from tierstore.client.engines.staging_buffers import StagingBuffers

    embed = SimpleNamespace(dim=DIM)
    cap = GRAPH_BATCH * HEADS
    buffers = StagingBuffers(1, cap, DIM, 32, device)
    base = (buffers.weight.data_ptr(), buffers.scale.data_ptr())
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    out = {} if device.type == "cuda" else {"CUDA graph": SKIP_NO_CUDA + "no graphs; each replay runs dequant_rows "
                                                          "again (its host path, not sglang's engram_gather)"}
    with Client(socket) as c:
        staged = StagedTable(c, table)

        def stage(bs: int):
            flat = np.ascontiguousarray(ids[:bs].reshape(-1), dtype=np.int64)
            host = []
            buffers.fill(0, flat.size, lambda weight, scale: (staged.gather(flat, weight, scale),
                                                              host.extend((weight.copy(), scale.copy()))))
            buffers.publish(flat.size, bs, side)
            return host

        def read():
            return dequant_rows(embed, buffers.weight[0], buffers.scale[0], (GRAPH_BATCH, HEADS))

        stage(GRAPH_BATCH)
        with _side_stream(device):  # torch's advice: run once off the capture stream first
            read()
        replay = _capture(read, device)
        for bs in (GRAPH_BATCH, 1, 7, 33, 2, GRAPH_BATCH - 1):
            weight, scale = stage(bs)
            replayed = replay()
            synchronize(device)
            got = replayed.cpu()
            want = dequant_rows(embed, torch.from_numpy(weight), torch.from_numpy(scale), (bs, HEADS))
            out[f"replay of {bs} requests == CPU path"] = _same_bits(got[:bs], want)
            out[f"replay of {bs} requests: padded slots zero"] = not got[bs:].view(torch.int16).any().item()
    out["buffers kept their addresses"] = (buffers.weight.data_ptr(), buffers.scale.data_ptr()) == base
    return out


def check_sglang(ids: np.ndarray, want: torch.Tensor, split, device: torch.device) -> dict:
    try:
        from sglang.kernels.ops.embeddings.engram_gather import engram_gather
    except Exception as e:  # noqa: BLE001
        return {"skipped": f"sglang's engram_gather does not import here: {type(e).__name__}: {e}"}
    if device.type != "cuda":
        return {"engram_gather bf16 == CPU path": SKIP_NO_CUDA + "engram_gather takes CUDA ids only (it asserts so)"}
    flat = torch.from_numpy(ids.reshape(-1).astype(np.int64)).to(device)
    out = torch.empty(flat.numel(), DIM, dtype=torch.bfloat16, device=device)
    engram_gather(split.weight.ctypes.data, split.scale.ctypes.data, flat, out, DIM, 32)
    return {"engram_gather bf16 == CPU path": _same_bits(out.cpu().view(*ids.shape, DIM), want)}


def check_restart(work: Path, scale: int, rounds: int) -> dict:
    """Part 8: the restart cell of `tierstore bench engines` at V4.1's layout / `scale`."""
    from tierstore.bench.engines import restart_cell

    if not scale:
        return {"skipped": "--restart-scale 0"}
    try:
        r = restart_cell(work, scale=scale, rounds=rounds)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}
    within = (r["filtered_vs_dense"] <= 1.2 if scale <= RESTART_JUDGED_AT else
              f"skipped at 1/{scale}: the layers' build dominates so small a layout; judged at 1/{RESTART_JUDGED_AT} "
              f"or larger")
    return {**r, "filtered restart within 1.2x of no Engram": within}


def _vllm_releases(paths: list[str]) -> list[tuple[str, str | None]]:
    """(version, directory) of each vLLM to check: the one this environment imports (directory
    None), then the release in each of `paths` (a `pip install --no-deps --target DIR` of it)."""
    from importlib.metadata import PackageNotFoundError, distributions, version

    out = []
    try:
        out.append((version("vllm"), None))
    except PackageNotFoundError:
        pass
    for p in paths:
        found = [d.version for d in distributions(path=[p]) if d.metadata["Name"] == "vllm"]
        if not found:
            raise SystemExit(f"gpu_check_engines: --vllm-path {p} holds no vLLM (pip install --no-deps --target {p} "
                             f"vllm==VERSION)")
        out.append((found[0], p))
    return out


def _vllm_child(directory: str | None, out: Path, args) -> dict:
    """The vLLM parts run in a child process under the vLLM of `directory` (first on PYTHONPATH;
    None: this environment's): {part: {check: value}}, or an error part saying why not."""
    import subprocess

    env = dict(os.environ)
    if directory is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (directory, env.get("PYTHONPATH"))))
    cmd = [sys.executable, "-m", "tierstore.bench.gpu_check_engines", "--vllm-only", "--out", str(out),
           *(["--cpu-smoke"] if args.cpu_smoke else []), *(["--rows", str(args.rows)] if args.rows else []),
           *(["--tokens", str(args.tokens)] if args.tokens else [])]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    report = out / "gpu_check_engines.json"
    if not report.exists():
        return {part: {"error": f"the vLLM child exited {run.returncode}: {run.stderr[-2000:]}"} for part in VLLM_PARTS}
    return {part: json.loads(report.read_text())[part] for part in VLLM_PARTS}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--rows", type=int, default=None, help=f"the table's rows (default {GPU_SIZES.rows}; "
                                                           f"smoke {SMOKE_SIZES.rows})")
    ap.add_argument("--tokens", type=int, default=None, help=f"tokens a step (default {GPU_SIZES.tokens}; smoke "
                                                             f"{SMOKE_SIZES.tokens}; at least {GRAPH_TOKENS})")
    ap.add_argument("--restart-scale", type=int, default=None,
                    help=f"part 8's V4.1 layout divided by this (default {GPU_SIZES.restart_scale}: 2 x 4 M rows, "
                         f"2.1 GB; smoke {SMOKE_SIZES.restart_scale}; 0 skips it)")
    ap.add_argument("--vllm-path", action="append", default=[], metavar="DIR",
                    help="a directory holding another vLLM release (`pip install --no-deps --target DIR "
                         "vllm==0.33.0`): the vLLM parts run again under it; repeatable")
    ap.add_argument("--vllm-only", action="store_true", help=argparse.SUPPRESS)  # a child: the vLLM parts only
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run every part's plumbing on CPU at tiny sizes (Triton's interpreter); see the docstring")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        smoke_env(SMOKE_ENV)
        _interpreter_takes_bools()
        device, sizes = torch.device("cpu"), SMOKE_SIZES
    elif not torch.cuda.is_available():
        print(f"gpu_check_engines: torch {torch.__version__} sees no CUDA device; nothing was checked "
              f"(run it on a GPU host with a CUDA torch, or --cpu-smoke)", file=sys.stderr)
        return 2
    else:
        device, sizes = torch.device("cuda"), GPU_SIZES
    rows = args.rows or sizes.rows
    tokens = args.tokens or sizes.tokens
    restart_scale = sizes.restart_scale if args.restart_scale is None else args.restart_scale
    from tierstore.client.client import Client
    from tierstore.ingest.writer import write_version
    from tierstore.sidecar.launcher import SidecarProcess
    from tierstore.table.formats import encode_rows

    rng = np.random.default_rng(0)
    report: dict = {"device": device_name(device), "torch": torch.__version__, "rows": rows, "smoke": args.cpu_smoke}
    failed: list[str] = []
    parts: dict = {}
    vllm_only = args.vllm_only
    releases = [] if vllm_only else _vllm_releases(args.vllm_path)

    def run(name: str, fn) -> None:
        if vllm_only != (name in VLLM_PARTS):
            return
        try:
            parts[name] = fn()
        except Exception as e:  # noqa: BLE001 - report every part, then fail
            parts[name] = {"error": f"{type(e).__name__}: {e}"}

    with tempfile.TemporaryDirectory() as d:
        chunks = (encode_rows(rng.standard_normal((min(65536, rows - a), DIM)).astype(np.float32) * 3,
                              "fp8-e4m3-ue8m0") for a in range(0, rows, 65536))
        write_version(d, "l1", chunks, rows=rows, row_format="fp8-e4m3-ue8m0", row_dim=DIM, layer_id=1)
        budget = int(rows * 264 * 1.2) + (64 << 20)
        with SidecarProcess(d, dram_budget=budget, extra_args=("--split-layout", "all")) as sc, \
                Client(sc.socket) as c, c.split_table("l1") as split:
            ids = _ids(rng, _head_sizes(rows), tokens)
            want_packed = c.lookup("l1", ids.reshape(-1)).reshape(*ids.shape, DIM + DIM // 32)
            table_packed = c.lookup("l1", np.arange(rows, dtype=np.int64))  # the engines' own resident tables
            want = _reference(want_packed.reshape(-1, DIM + DIM // 32)).view(*ids.shape, DIM)
            run("split arena", lambda: check_split_arena(split, device))
            run("vllm", lambda: check_vllm(str(sc.socket), "l1", rows, ids, want, want_packed, split, device, sizes))
            run("sglang", lambda: check_sglang(ids, want, split, device))
        with SidecarProcess(d, dram_budget=rows * 264 // 4 + (1 << 20)) as sc:  # cache mode
            run("vllm staged", lambda: check_vllm_staged(str(sc.socket), "l1", rows, ids, want, want_packed, device,
                                                         sizes))
            run("vllm runner", lambda: check_vllm_runner(device, tokens))
            run("sglang stager", lambda: check_sglang_stager(str(sc.socket), "l1", ids, want_packed, device, sizes))
            run("sglang graph staging", lambda: check_sglang_graph_staging(str(sc.socket), "l1", ids, device))
            run("vllm forms", lambda: check_vllm_forms(str(sc.socket), "l1", rows, ids, want, table_packed, device,
                                                       sizes))
            run("sglang forms", lambda: check_sglang_forms(str(sc.socket), "l1", ids, want, table_packed, device,
                                                           sizes))
        run("restart", lambda: check_restart(Path(d), restart_scale, sizes.restart_rounds))
    if vllm_only:
        from importlib.metadata import version

        report["vllm"] = version("vllm")
    else:  # each vLLM release's parts in a process of its own (a process imports one vLLM)
        for name in VLLM_PARTS:
            parts[name] = {} if releases else {"skipped": "vLLM is not installed here (and no --vllm-path)"}
        for i, (ver, directory) in enumerate(releases):
            for name, part in _vllm_child(directory, Path(args.out) / f"vllm-{i}", args).items():
                parts[name].update({f"vLLM {ver}: {k}": v for k, v in part.items()})
        from tierstore.client.engines.checks import SUPPORTED

        report["vllm releases"] = [ver for ver, _ in releases]
        report["supported vLLM releases not checked"] = sorted(set(SUPPORTED["vllm"][1]) - {v for v, _ in releases})
    for name in (VLLM_PARTS if vllm_only else PARTS):
        report[name] = part = parts[name]
        failed += [f"{name}: {k}" for k, v in part.items() if v is False or k == "error" or k.endswith(": error")]
    report["failed"] = failed
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_check_engines.json").write_text(json.dumps(report, indent=1, default=float))
    print(json.dumps(report, indent=1, default=float))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
