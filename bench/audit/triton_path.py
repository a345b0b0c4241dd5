"""The audit's `triton` path: the Triton kernels on a GPU, or in Triton's CPU interpreter (a child
process, since TRITON_INTERPRET must be set before anything imports triton)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from tierstore.bench.audit.model import make_builder
from tierstore.bench.audit.outputs import Outputs, compare, execute
from tierstore.bench.audit.report import PathResult
from tierstore.bench.audit.variants import env

__all__ = ["triton_cuda", "triton_interpreter", "triton_worker"]

def triton_cuda(audit) -> PathResult:
    """Whole input on the GPU: Triton kernels, compared with the CPU reference and the GPU torch kernels."""
    from tierstore.client.model.in_process_table import InProcessTable

    dev = torch.device("cuda")
    table = InProcessTable(audit.spec, device=dev)
    for t in audit.in_process.tables():
        table.add(t, audit.in_process.rows(t))
    gpu_torch = {}

    def to_gpu(model):
        model.to(dev)
        with env(TIERSTORE_FORCE_TORCH="1"):
            gpu_torch["out"] = execute(model, audit.ids, audit.decode_ids)[0]
        return lambda: ("GPU; vs the torch kernels on the same GPU: logits max abs "
                        f"{compare(audit._outs['triton'], gpu_torch['out'])['logits_max_abs']:.3g} "
                        "(the rest of the drift is GPU vs CPU matmuls)")
    return audit._measure("triton", False, lambda: table, mutate=to_gpu,
                          ctx=lambda: env(TIERSTORE_FORCE_TORCH="0"))

def triton_interpreter(audit) -> PathResult:
    """No GPU: the Triton kernels in Triton's CPU interpreter, in a child process, on a small input."""
    b, t, k = audit.triton_shape
    ids = audit.ids[:b, :t]
    dec = None if audit.decode_ids is None else audit.decode_ids[:b, :k]
    res = PathResult("triton", False, note=f"no GPU: Triton interpreter on CPU (child process), small input "
                                           f"{ids.shape[0]}x{ids.shape[1]} + {0 if dec is None else dec.shape[1]} "
                                           "decode, vs the torch reference on the same input")
    try:
        ref = execute(audit.ref_model, ids, dec)[0]
        with tempfile.TemporaryDirectory(prefix="tierstore-audit-") as tmp:
            cfg = {"data_dir": str(audit.data_dir.resolve()), "module": audit.module,
                   "model_kwargs": audit.model_kwargs, "tokens": f"{tmp}/ids.npy",
                   "decode": None if dec is None else f"{tmp}/dec.npy", "out": f"{tmp}/out.pt", "runs": 2}
            np.save(cfg["tokens"], ids.numpy())
            if dec is not None:
                np.save(cfg["decode"], dec.numpy())
            Path(f"{tmp}/cfg.json").write_text(json.dumps(cfg))
            child_env = {**os.environ, "TRITON_INTERPRET": "1"}
            child_env.pop("TIERSTORE_FORCE_TORCH", None)
            proc = subprocess.run([sys.executable, "-c", "import sys; from tierstore.bench.audit.triton_path import "
                                   "triton_worker; triton_worker(sys.argv[1])", f"{tmp}/cfg.json"],
                                  env=child_env, capture_output=True, text=True, timeout=600)
            if proc.returncode:
                raise RuntimeError(f"Triton interpreter child exited {proc.returncode}: "
                                   f"{proc.stderr.strip()[-600:]}")
            runs = [Outputs(r["engram"], r["logits"]) for r in torch.load(cfg["out"])]
        res.__dict__.update(compare(runs[0], ref))
        res.bit_exact = all(r.equal(ref) for r in runs)
        res.deterministic = all(r.equal(runs[0]) for r in runs)
        if not res.deterministic:
            res.nondeterminism = "run 2 of the interpreter differs from run 1"
    except Exception as e:
        res.error = f"{type(e).__name__}: {e}"
        res.note += f"; FAILED: {res.error}"
    return res

def triton_worker(config_path: str) -> None:
    """Child process of the Triton interpreter path (TRITON_INTERPRET=1 set before any import)."""
    from tierstore.bench.e2e import in_process_source, spec_from_catalog
    from tierstore.kernels import choose_backend

    if choose_backend("auto", torch.zeros(1)) != "triton":
        raise SystemExit("Triton interpreter unavailable: TRITON_INTERPRET=1 must be set before tierstore.kernels "
                         "is imported, and the triton package installed")
    cfg = json.loads(Path(config_path).read_text())
    spec = spec_from_catalog(cfg["data_dir"])
    model = make_builder(cfg["data_dir"], cfg["module"], cfg["model_kwargs"])(in_process_source(cfg["data_dir"], spec))
    ids = torch.from_numpy(np.load(cfg["tokens"]))
    dec = torch.from_numpy(np.load(cfg["decode"])) if cfg["decode"] else None
    runs = [execute(model, ids, dec)[0] for _ in range(cfg["runs"])]
    torch.save([{"engram": r.engram, "logits": r.logits} for r in runs], cfg["out"])
