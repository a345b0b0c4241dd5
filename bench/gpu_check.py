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
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

FORMATS = {"fp32": 64, "bf16": 64, "fp16": 64, "fp8-e4m3-ue8m0": 256}
PARTS = ("kernels", "arena")  # the report's parts, in order
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
    step_ids: int  # parts 2-3: ids of one Zipf step
    reps: int  # part 3: timed repetitions


GPU_SIZES = Sizes(table_rows=5000, slots=3333, gate_tokens=777, gate_dim=1024, arena_rows=1_000_000,
                  step_ids=32768, reps=20)
SMOKE_SIZES = Sizes(table_rows=50, slots=33, gate_tokens=7, gate_dim=64, arena_rows=2000, step_ids=64, reps=1)


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--rows", type=int, default=None, help="the served table's rows (default 1000000; smoke 2000)")
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
    rng = np.random.default_rng(0)
    report = {"device": device_name(device), "torch": torch.__version__, "smoke": args.cpu_smoke}
    failed = []
    parts = {"kernels": lambda: check_kernels(rng, device, sizes),
             "arena": lambda: check_arena(rng, rows, device, sizes)}
    for name in PARTS:
        try:
            report[name] = parts[name]()
            failed += [f"{name}: {k}" for k, v in report[name].items() if v is False]
        except Exception as e:  # noqa: BLE001 - report every part, then fail
            report[name] = {"error": f"{type(e).__name__}: {e}"}
            failed.append(f"{name}: {e}")
    report["failed"] = failed
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_check.json").write_text(json.dumps(report, indent=1, default=float))
    print(json.dumps(report, indent=1, default=float))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
