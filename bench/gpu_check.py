"""One prepared script for a machine with a GPU (the `device` tool): checks the
CUDA paths this CPU-only CI cannot, and takes the GPU numbers.

    python -m tierstore.bench.gpu_check --out $OUT [--rows 1000000]

1. Triton kernels on CUDA vs the torch reference on the same GPU: gather
   bit-exact for every row format and output dtype; gate within tolerance.
2. The shared arena read over UVA: a sidecar serves a table, the client maps
   and registers the arena (cudaHostRegister), gather_rows reads it from the
   GPU; rows must equal the reference gather from the same bytes.
3. Gather throughput (rows/s, fp8 264 B rows, 32k-id Zipf steps): from an HBM
   tensor, from the registered arena over UVA, and host gather + H2D copy.
4. Pages (check_pages; NOT YET RUN on a GPU: written on a host without one): the
   same table (--page-rows fp8 rows, 1.1 GB by default: past the reach of the GPU's
   TLB on 4 KiB pages) served by two sidecars at once, one with --arena-pages small,
   one with --arena-pages huge (where the host gives no huge pages and this is root,
   on a tmpfs mounted huge=within_size for it; else the part says why not), each
   holding it interleaved (table t) and split (table s). The lookup kernels read each
   arena over UVA with uniform random ids, the two sides timed in turn: tierstore's
   gather_rows (kernels/gather.py) over t, and over s the engines' own, vLLM's
   _engram_lookup_kernel and sglang's engram_gather (vllm_lookup, sglang_gather),
   where they import. Per kernel: rows/s on each side, the 2 MB side over the 4 KiB
   side (median of paired timings), the rows bit for bit equal on both; per side, the
   arena's bytes on huge pages in this process's map (/proc/self/smaps) and the page
   size its sidecar reports. About a minute, most of it writing the two tables.
Writes OUT/gpu_check.json; exits 1 if any check fails. On a machine without
CUDA it says so and exits 0 (nothing to check).

    python -m tierstore.bench.gpu_check --cpu-smoke --out DIR

runs the same parts on CPU at tiny sizes, so that a typo or a stale call fails
in CI, not in a GPU machine's scarce minutes (tests/bench/test_gpu_check.py runs
it): the kernels under Triton's interpreter (it sets TRITON_INTERPRET=1 and
CUDA_VISIBLE_DEVICES="" itself, before Triton is first imported), a real sidecar
and its real shared-memory arena, CPU tensors where the GPU run has device ones.
What exists only on CUDA (registration, the device's name) is recorded as
"skipped on CPU: <why>"; the rates it writes are the interpreter's, meaningless.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

FORMATS = {"fp32": 64, "bf16": 64, "fp16": 64, "fp8-e4m3-ue8m0": 256}
PARTS = ("kernels", "arena", "pages")  # the report's parts, in order
# What --cpu-smoke sets before Triton is imported: the interpreter, and no GPU seen even on a GPU host.
SMOKE_ENV = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}


@dataclass(frozen=True)
class Sizes:
    """How much each part reads: the GPU run's, or the CPU smoke's (Triton's interpreter
    runs one program at a time in numpy, so only tiny sizes finish)."""

    table_rows: int  # part 1: rows of each format's table
    slots: int  # part 1: ids gathered from it
    gate_tokens: int  # part 1: T of the gate's [T, 4, gate_dim]
    gate_dim: int
    arena_rows: int  # parts 2-3: the served table's rows (--rows)
    step_ids: int  # parts 2-4: ids of one step
    reps: int  # part 3: timed repetitions; part 4: paired timings per kernel
    page_rows: int  # part 4: the table's rows (--page-rows); two tables of them on each side


GPU_SIZES = Sizes(table_rows=5000, slots=3333, gate_tokens=777, gate_dim=1024, arena_rows=1_000_000,
                  step_ids=32768, reps=20, page_rows=1 << 22)
# 16,384 rows (4.3 MB): whole 2 MB pages, which a tmpfs mounted huge=within_size needs to give any
SMOKE_SIZES = Sizes(table_rows=50, slots=33, gate_tokens=7, gate_dim=64, arena_rows=2000, step_ids=64, reps=1,
                    page_rows=1 << 14)


def smoke_env(extra: dict | None = None) -> None:
    """This process's environment for a CPU smoke run (SMOKE_ENV, then `extra`); raises
    RuntimeError when Triton was imported before, too late for its interpreter."""
    os.environ.update({**SMOKE_ENV, **(extra or {})})
    from tierstore.kernels import dispatch

    if not dispatch.INTERPRET:
        raise RuntimeError("--cpu-smoke needs Triton's interpreter, but Triton was imported before it was set: "
                           "run the script in a fresh process, or with TRITON_INTERPRET=1 in its environment")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CPU work is done when a call returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke: Triton's interpreter)"


def _time(fn, device: torch.device, reps: int) -> float:
    fn()
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    synchronize(device)
    return (time.perf_counter() - t0) / reps


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN == NaN when their bits agree)."""
    view = torch.int32 if a.element_size() == 4 else torch.int16
    return bool(torch.equal(a.view(view), b.view(view)))


def check_kernels(rng, device: torch.device, sizes: Sizes) -> dict:
    from tierstore.table.formats import encode_rows
    from tierstore.kernels import engram_gate, gather_rows

    out = {}
    n = sizes.table_rows
    for fmt, dim in FORMATS.items():
        rows = torch.from_numpy(encode_rows(rng.standard_normal((n, dim)).astype(np.float32), fmt)).to(device)
        slots = torch.from_numpy(rng.integers(0, n, sizes.slots)).to(device)
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            a = gather_rows(slots, rows, None, fmt, dim, dt, backend="triton")
            b = gather_rows(slots, rows, None, fmt, dim, dt, backend="torch")
            out[f"gather {fmt}->{str(dt)[6:]}"] = _same_bits(a, b)
    T, M, D = sizes.gate_tokens, 4, sizes.gate_dim
    h, k = torch.randn(T, M, D, device=device), torch.randn(T, M, D, device=device)
    v, wh, wk = torch.randn(T, D, device=device), torch.rand(M, D, device=device), torch.rand(M, D, device=device)
    a = engram_gate(h, k, v, wh, wk, backend="triton")
    b = engram_gate(h, k, v, wh, wk, backend="torch")
    err = float((a - b).abs().max())
    out["gate fp32 max abs err"] = err
    out["gate fp32 within 1e-5"] = err <= 1e-5 * max(1.0, float(b.abs().max()))
    return out


def check_arena(rng, n_rows: int, device: torch.device, sizes: Sizes) -> dict:
    from tierstore.client.client import Client
    from tierstore.table.formats import encode_rows
    from tierstore.ingest.writer import write_version
    from tierstore.kernels import gather_rows
    from tierstore.sidecar.launcher import SidecarProcess

    fmt, dim = "fp8-e4m3-ue8m0", 256
    res = {}
    with tempfile.TemporaryDirectory() as d:
        chunks = (encode_rows(rng.standard_normal((min(65536, n_rows - a), dim)).astype(np.float32), fmt)
                  for a in range(0, n_rows, 65536))
        write_version(d, "t", chunks, rows=n_rows, row_format=fmt, row_dim=dim)
        with SidecarProcess(d, dram_budget=int(n_rows * 264 * 1.2) + (64 << 20)) as sc, Client(sc.socket) as c:
            arena = c.handle("t").arena  # maps (and, where CUDA is, registers)
            res["arena pinned (registered)"] = (bool(arena.is_pinned()) if device.type == "cuda" else
                                                "skipped on CPU: cudaHostRegister needs a CUDA device")
            hbm = arena.to(device, copy=True)  # the device's own copy (on CPU a second copy of the bytes)
            ranks = np.arange(1, n_rows + 1) ** -1.0
            ids = rng.choice(n_rows, size=sizes.step_ids, p=ranks / ranks.sum())
            slots_arena = torch.from_numpy(-ids - 1).to(device)
            slots_hbm = torch.from_numpy(ids).to(device)
            uva = gather_rows(slots_arena, None, arena, fmt, dim, torch.bfloat16)
            ref = gather_rows(slots_hbm, hbm, None, fmt, dim, torch.bfloat16)
            res["UVA gather == HBM gather"] = _same_bits(uva, ref)
            t_hbm = _time(lambda: gather_rows(slots_hbm, hbm, None, fmt, dim, torch.bfloat16), device, sizes.reps)
            t_uva = _time(lambda: gather_rows(slots_arena, None, arena, fmt, dim, torch.bfloat16), device,
                          sizes.reps)
            idx = torch.from_numpy(ids)
            t_copy = _time(lambda: arena.index_select(0, idx).to(device), device, sizes.reps)
            res["rows/s HBM"] = ids.size / t_hbm
            res["rows/s arena over UVA"] = ids.size / t_uva
            res["rows/s host gather + H2D copy (no dequant)"] = ids.size / t_copy
            res["UVA / HBM"] = t_hbm / t_uva
    return res


SKIP_NO_CUDA = "skipped on CPU: "
HEADS, DIM = 24, 256  # the engines' Engram lookups: [tokens, 24] ids, 256 fp8 values and 8 ue8m0 scales a row


def vllm_lookup(split, ids: torch.Tensor, out: torch.Tensor, rows: int) -> None:
    """vLLM's _engram_lookup_kernel (as ParallelEngramEmbedding.lookup launches it, one rank
    holding every head) over a split arena registered for CUDA (SplitTable.register_cuda):
    ids int32 [tokens, HEADS] in [0, rows), out bf16 [tokens, HEADS, DIM] (or uint8 [tokens,
    HEADS, DIM + DIM // 32]: packed rows)."""
    from vllm.models.deepseek_v41.common import engram

    w, s = split.tensors()
    weight = engram.get_accelerator_view_from_cpu_tensor(w)
    scales = engram.get_accelerator_view_from_cpu_tensor(s.view(torch.uint8))
    n = ids.numel()
    grid = min(-(-n // 16), torch.cuda.get_device_properties(ids.device).multi_processor_count)
    engram._engram_lookup_kernel[(grid,)](
        weight, scales, ids, ids, out, 0, rows, n, ids.stride(0), ids.stride(1),
        HEAD_START=0, LOCAL_HEADS=HEADS, TOTAL_HEADS=HEADS, DIM=DIM, QUANT_BLOCK=32, BLOCK_R=16, GRID=grid,
        SORTED=False, PACKED=out.dtype == torch.uint8, OUT_STRIDE=out.stride(0))


def sglang_gather(split, ids: torch.Tensor, out: torch.Tensor) -> None:
    """sglang's engram_gather over a split arena registered for CUDA: ids int64 [n] (CUDA),
    out bf16 [n, DIM]."""
    from sglang.kernels.ops.embeddings.engram_gather import engram_gather

    engram_gather(split.weight.ctypes.data, split.scale.ctypes.data, ids, out, DIM, 32)


def _paired(fns: dict, device: torch.device, reps: int, ids: int) -> dict:
    """{side: rows/s (median)} and the 2 MB side over the 4 KiB side (median of the ratios of
    timings taken in turn, so a slower minute of a shared host weighs on both sides)."""
    per = {side: [] for side in fns}
    for _ in range(max(reps, 1)):
        for side, fn in fns.items():
            per[side].append(_time(fn, device, 3))
    out = {f"rows/s {side}": ids / float(np.median(t)) for side, t in per.items()}
    if len(per) == 2:
        small, huge = per.values()
        out["2 MB / 4 KiB"] = float(np.median(np.array(small) / np.array(huge)))
    return out


@contextlib.contextmanager
def _huge_sidecar(data: Path, budget: int, args: list, work: Path):
    """A sidecar serving `data` with --arena-pages huge: where the host gives arenas no huge
    pages and this is root, on a tmpfs mounted huge=within_size under `work` (unmounted
    after). Yields (SidecarProcess, None) or (None, why not)."""
    from tierstore.sidecar.launcher import SidecarProcess

    sc = SidecarProcess(data, dram_budget=budget, extra_args=[*args, "--arena-pages", "huge"])
    try:
        sc.start()
    except RuntimeError:
        why = next((ln.split("no huge pages: ", 1)[1] for ln in sc.log().splitlines() if "no huge pages: " in ln),
                   sc.log()[-300:])
        sc.cleanup()
        if os.geteuid() != 0:
            yield None, f"skipped: the host gives no huge pages and this is not root to mount some: {why}"
            return
        point = work / "huge"
        point.mkdir(mode=0o700)
        mount = ["mount", "-t", "tmpfs", "-o", f"size={budget + (64 << 20)},mode=0700,huge=within_size", "tmpfs",
                 str(point)]
        if subprocess.run(mount, capture_output=True).returncode:
            yield None, f"skipped: the host gives no huge pages and `{' '.join(mount)}` failed: {why}"
            return
        try:
            with SidecarProcess(data, dram_budget=budget, extra_args=[*args, "--arena-pages", "huge",
                                                                      "--shm-dir", point]) as sc:
                yield sc, None
        finally:
            subprocess.run(["umount", "-l", str(point)], check=False)
        return
    try:
        yield sc, None
    finally:
        sc.cleanup()


def check_pages(rng, device: torch.device, sizes: Sizes, work: Path) -> dict:
    """Part 4 (the module docstring): the lookup kernels over a 4 KiB-page and a 2 MB-page arena."""
    from tierstore.client.client import Client
    from tierstore.ingest.writer import write_version
    from tierstore.kernels import gather_rows
    from tierstore.sidecar.launcher import SidecarProcess
    from tierstore.tiers.pages import huge_page_bytes

    fmt, n = "fp8-e4m3-ue8m0", sizes.page_rows
    data = work / "pages-data"
    for table in ("t", "s"):  # the same rows twice: interleaved for gather_rows, split for the engines
        write_version(data, table, _fp8_rows(n, seed=1), rows=n, row_format=fmt, row_dim=DIM, layer_id=1)
    budget, args = int(2 * n * 264 * 1.1) + (64 << 20), ["--split-layout", "s"]
    res: dict = {}
    with contextlib.ExitStack() as stack:
        small = stack.enter_context(SidecarProcess(data, dram_budget=budget, extra_args=[*args, "--arena-pages",
                                                                                         "small"]))
        huge, why = stack.enter_context(_huge_sidecar(data, budget, args, work))
        sides = {"4 KiB": small} if huge is None else {"4 KiB": small, "2 MB": huge}
        if huge is None:
            res["2 MB side"] = why
        clients = {side: stack.enter_context(Client(sc.socket)) for side, sc in sides.items()}
        arenas = {side: c.handle("t").arena for side, c in clients.items()}  # maps; registers where CUDA is
        splits = {side: stack.enter_context(c.split_table("s")) for side, c in clients.items()}
        if device.type == "cuda":
            for sp in splits.values():
                sp.register_cuda()
        ids = torch.from_numpy(rng.integers(0, n, (sizes.step_ids // HEADS + 1, HEADS)).astype(np.int32)).to(device)
        slots = (-ids.reshape(-1).long() - 1).to(device)  # gather_rows reads the arena at slot -s-1
        gathered = {side: gather_rows(slots, None, a, fmt, DIM, torch.bfloat16) for side, a in arenas.items()}
        res["gather_rows: same rows on every side"] = all(_same_bits(g, gathered["4 KiB"]) for g in gathered.values())
        res["gather_rows over UVA"] = _paired(
            {side: (lambda a=a: gather_rows(slots, None, a, fmt, DIM, torch.bfloat16, check_bounds=False))
             for side, a in arenas.items()}, device, sizes.reps, slots.numel())
        engines = (("vLLM _engram_lookup_kernel", _vllm_run), ("sglang engram_gather", _sglang_run))
        if device.type != "cuda":
            engines = ()
            res["engines' kernels"] = SKIP_NO_CUDA + "vLLM's and sglang's lookups read registered arenas over UVA"
        for name, run in engines:
            try:
                outs = {side: run(sp, ids, n) for side, sp in splits.items()}
            except Exception as e:  # noqa: BLE001 - not installed here, or its signature moved: say which
                res[name] = f"skipped: {type(e).__name__}: {e}"
                continue
            first = next(iter(outs.values()))[1]
            res[f"{name}: same rows on every side"] = all(_same_bits(o[1], first) for o in outs.values())
            res[name] = _paired({side: o[0] for side, o in outs.items()}, device, sizes.reps, ids.numel())
        # what each side read through, now that the kernels touched it (registration pins all of it)
        for side, c in clients.items():
            st = {t["table"]: t for t in c.stats()["tables"]}
            seen = [huge_page_bytes(c.handle(t)._arena_path) for t in ("t", "s")]
            res[f"{side}: page size the sidecar reports"] = int(st["t"]["arena_page_bytes"])
            res[f"{side}: bytes on huge pages / resident in this process"] = [sum(m[0] for m in seen),
                                                                             sum(m[1] for m in seen)]
        res["4 KiB: no huge page mapped"] = res["4 KiB: bytes on huge pages / resident in this process"][0] == 0
        if "2 MB" in sides:
            on_huge, resident = res["2 MB: bytes on huge pages / resident in this process"]
            res["2 MB: most of it on huge pages"] = on_huge >= resident // 2
    return res


def _fp8_rows(n: int, seed: int, chunk: int = 1 << 16):
    """n fp8-e4m3-ue8m0 rows of 264 B in chunks, the same for the same seed: random e4m3 bytes
    that are never NaN (bits 3 and 7 clear), every scale 2**0 (fast: part 4's table is 1 GiB)."""
    rng = np.random.default_rng(seed)
    for a in range(0, n, chunk):
        rows = rng.integers(0, 256, (min(chunk, n - a), DIM + DIM // 32), dtype=np.uint8)
        rows[:, :DIM] &= 0x77
        rows[:, DIM:] = 127
        yield rows


def _vllm_run(split, ids: torch.Tensor, rows: int):
    out = torch.empty(*ids.shape, DIM, dtype=torch.bfloat16, device=ids.device)
    vllm_lookup(split, ids, out, rows)
    return (lambda: vllm_lookup(split, ids, out, rows)), out.clone()


def _sglang_run(split, ids: torch.Tensor, rows: int):
    flat = ids.reshape(-1).long()
    out = torch.empty(flat.numel(), DIM, dtype=torch.bfloat16, device=ids.device)
    sglang_gather(split, flat, out)
    return (lambda: sglang_gather(split, flat, out)), out.clone()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--rows", type=int, default=None, help="the served table's rows (default 1000000; smoke 2000)")
    ap.add_argument("--page-rows", type=int, default=None,
                    help=f"part 4's table rows (default {GPU_SIZES.page_rows}: 1.1 GB; smoke {SMOKE_SIZES.page_rows})")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run every part's plumbing on CPU at tiny sizes (Triton's interpreter); see the docstring")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        smoke_env()
        device, sizes = torch.device("cpu"), SMOKE_SIZES
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check")
        return 0
    else:
        device, sizes = torch.device("cuda"), GPU_SIZES
    rows = args.rows or sizes.arena_rows
    if args.page_rows:
        sizes = dataclasses.replace(sizes, page_rows=args.page_rows)
    rng = np.random.default_rng(0)
    report = {"device": device_name(device), "torch": torch.__version__, "smoke": args.cpu_smoke}
    failed = []
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    parts = {"kernels": lambda: check_kernels(rng, device, sizes),
             "arena": lambda: check_arena(rng, rows, device, sizes),
             "pages": lambda: check_pages(rng, device, sizes, work)}
    try:
        for name in PARTS:
            try:
                report[name] = parts[name]()
                failed += [f"{name}: {k}" for k, v in report[name].items() if v is False]
            except Exception as e:  # noqa: BLE001 - report every part, then fail
                report[name] = {"error": f"{type(e).__name__}: {e}"}
                failed.append(f"{name}: {e}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["failed"] = failed
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_check.json").write_text(json.dumps(report, indent=1, default=float))
    print(json.dumps(report, indent=1, default=float))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
