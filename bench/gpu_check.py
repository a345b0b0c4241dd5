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
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

FORMATS = {"fp32": 64, "bf16": 64, "fp16": 64, "fp8-e4m3-ue8m0": 256}


def _time(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN == NaN when their bits agree)."""
    view = torch.int32 if a.element_size() == 4 else torch.int16
    return bool(torch.equal(a.view(view), b.view(view)))


def check_kernels(rng) -> dict:
    from tierstore.table.formats import encode_rows
    from tierstore.kernels import engram_gate, gather_rows

    out = {}
    for fmt, dim in FORMATS.items():
        rows = torch.from_numpy(encode_rows(rng.standard_normal((5000, dim)).astype(np.float32), fmt)).cuda()
        slots = torch.from_numpy(rng.integers(0, 5000, 3333)).cuda()
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            a = gather_rows(slots, rows, None, fmt, dim, dt, backend="triton")
            b = gather_rows(slots, rows, None, fmt, dim, dt, backend="torch")
            out[f"gather {fmt}->{str(dt)[6:]}"] = _same_bits(a, b)
    T, M, D = 777, 4, 1024
    h, k = torch.randn(T, M, D, device="cuda"), torch.randn(T, M, D, device="cuda")
    v, wh, wk = torch.randn(T, D, device="cuda"), torch.rand(M, D, device="cuda"), torch.rand(M, D, device="cuda")
    a = engram_gate(h, k, v, wh, wk, backend="triton")
    b = engram_gate(h, k, v, wh, wk, backend="torch")
    err = float((a - b).abs().max())
    out["gate fp32 max abs err"] = err
    out["gate fp32 within 1e-5"] = err <= 1e-5 * max(1.0, float(b.abs().max()))
    return out


def check_arena(rng, n_rows: int) -> dict:
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
            arena = c.handle("t").arena  # maps and registers
            res["arena pinned (registered)"] = bool(arena.is_pinned())
            hbm = arena.cuda()
            ranks = np.arange(1, n_rows + 1) ** -1.0
            ids = rng.choice(n_rows, size=32768, p=ranks / ranks.sum())
            slots_arena = torch.from_numpy(-ids - 1).cuda()
            slots_hbm = torch.from_numpy(ids).cuda()
            uva = gather_rows(slots_arena, None, arena, fmt, dim, torch.bfloat16)
            ref = gather_rows(slots_hbm, hbm, None, fmt, dim, torch.bfloat16)
            res["UVA gather == HBM gather"] = _same_bits(uva, ref)
            t_hbm = _time(lambda: gather_rows(slots_hbm, hbm, None, fmt, dim, torch.bfloat16))
            t_uva = _time(lambda: gather_rows(slots_arena, None, arena, fmt, dim, torch.bfloat16))
            idx = torch.from_numpy(ids)
            t_copy = _time(lambda: arena.index_select(0, idx).cuda())
            res["rows/s HBM"] = ids.size / t_hbm
            res["rows/s arena over UVA"] = ids.size / t_uva
            res["rows/s host gather + H2D copy (no dequant)"] = ids.size / t_copy
            res["UVA / HBM"] = t_hbm / t_uva
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--rows", type=int, default=1_000_000)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check")
        return 0
    rng = np.random.default_rng(0)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    failed = []
    for name, fn in (("kernels", lambda: check_kernels(rng)), ("arena", lambda: check_arena(rng, args.rows))):
        try:
            report[name] = fn()
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
