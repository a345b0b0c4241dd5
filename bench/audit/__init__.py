"""Execution-fidelity audit: does the model served by tierstore compute what was trained?

A package because the audit holds several things: report.py (paths, results),
outputs.py (running a model, comparing runs), model.py (building it), sidecars.py,
variants.py (what each path changes), triton_path.py, audit.py (the Audit itself).
It lives beside the benchmarks because, like them, it runs the whole stack:
sidecar processes, client layers, kernels.

A model served through tierstore runs the same weights through different
execution paths: rows from the sidecar's full-resident arena, its cache-mode
arena or its NVMe tier, an HBM cache in front of it, a plan that arrived late,
rows stored in a narrower format, bf16 compute, Triton kernels. The audit runs
one model over one token sequence through each path and compares everything
it computes with the *reference*: the same weights, rows held in process
exactly as stored on disk (InProcessTable), torch reference kernels, fp32 compute.

    from tierstore.bench.audit import Audit

    with Audit("/data/tierstore", batch=2, seq=128, decode_tokens=8) as audit:
        report = audit.run()              # every path in PATHS
    print(report.offenders())             # [] when every path that must be exact is

Per path: bit-exact (every run equals the reference, Engram layer outputs and
logits); max abs / max relative error of the Engram layer outputs (captured with
forward hooks on every EngramLayer) and of the logits; top-1 agreement (fraction
of positions whose argmax token equals the reference's); deterministic (runs
repeated in one process, and for sidecar-full/-cache/-cold after a sidecar
restart, are bit-identical). Relative error is |x - ref| / max(|ref|, rms(ref)):
relative to each value, but never to less than the RMS of the reference, so
values near zero do not blow it up. Decode steps are teacher-forced with the
reference's greedy tokens, so every path is compared position by position
even after it would have chosen another token.

Paths that must be exact (EXACT_PATHS): serving moves bytes, never values, so
a sidecar path that differs from the reference by one bit is a defect. The
others drift by design (quantisation, bf16 rounding, kernel summation order);
the audit measures how much.

Models: the demo model (EngramDemoModel, weights from `seed`) by default, or
any `factory(source) -> nn.Module` (`module="pkg.mod:factory"`): the model must
contain EngramLayer modules, take token ids [B, T] as its first argument and
return logits; `new_cache()` + `decode_step(ids [B], cache)` enable decode
steps. The factory must build the same weights on every call.
"""
from tierstore.bench.audit.audit import Audit, run_audit
from tierstore.bench.audit.model import RecordingSource, audit_tokens, load_factory, make_builder
from tierstore.bench.audit.outputs import Outputs, compare, engram_layers, execute, set_source
from tierstore.bench.audit.report import (EXACT_PATHS, PATHS, ROW_FORMAT_PATHS, SIDECAR_OF, AuditReport, CustomPath,
                                          PathResult)

__all__ = ["Audit", "AuditReport", "CustomPath", "Outputs", "PathResult", "PATHS", "EXACT_PATHS", "ROW_FORMAT_PATHS",
           "SIDECAR_OF", "compare", "execute", "run_audit", "engram_layers", "set_source", "RecordingSource",
           "audit_tokens", "load_factory", "make_builder"]
