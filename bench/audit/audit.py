"""The Audit: one model, one token sequence, every execution path, compared with the reference."""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from tierstore.bench.audit.model import RecordingSource, audit_tokens, make_builder
from tierstore.bench.audit.outputs import Outputs, compare, engram_layers, execute, set_source
from tierstore.bench.audit.report import PATHS, ROW_FORMAT_PATHS, SIDECAR_OF, AuditReport, CustomPath, PathResult
from tierstore.bench.audit.sidecars import Sidecars, tier_note
from tierstore.bench.audit.triton_path import triton_cuda, triton_interpreter
from tierstore.bench.audit.variants import add_hbm_cache, bf16_engram, bf16_model, reencoded_table, threads
from tierstore.errors import InvalidArgument

__all__ = ["Audit", "run_audit"]

class Audit:
    """Runs one model over one token sequence through tierstore's execution paths.

    data_dir: tierstore data directory holding the model's Engram tables (one
        spec, as written by `tierstore demo-table` or `tierstore ingest`).
    batch, seq: shape of the token ids [batch, seq] (Zipf-distributed, fixed by
        `seed`) unless `tokens` (int array [B, T] or [T]) is given.
    decode_tokens: decode steps after the prefill (teacher-forced with the
        reference's greedy tokens on every path).
    module: 'pkg.mod:factory' building the model from a RowSource (default:
        the demo model, built with `model_kwargs` such as d_model, and `seed`).
    restart: also re-run sidecar-full/-cache/-cold on a freshly started sidecar.
    triton_shape: (batch, seq, decode) of the small input the Triton
        interpreter runs on CPU (it is slow); the whole input on a GPU.

    The reference runs in the constructor. Starts sidecar processes on demand;
    `close()` (or the context manager) stops them and removes their files.
    Raises InvalidArgument for tokens outside the model's vocabulary, a model
    without EngramLayers, or a factory that builds different weights each call.
    """

    def __init__(self, data_dir, *, batch: int = 2, seq: int = 128, decode_tokens: int = 8, seed: int = 0,
                 tokens=None, module: str | None = None, model_kwargs: dict | None = None,
                 restart: bool = True, triton_shape: tuple[int, int, int] = (2, 32, 2), log=print):
        from tierstore.bench.e2e import in_process_source, spec_from_catalog

        self.data_dir, self.module, self.restart, self.log = Path(data_dir), module, restart, log
        self.model_kwargs = dict(model_kwargs or {}) if module else {"seed": seed, **(model_kwargs or {})}
        self.triton_shape = triton_shape
        self.spec = spec_from_catalog(self.data_dir)
        self.in_process = in_process_source(self.data_dir, self.spec)
        self.build = make_builder(self.data_dir, module, self.model_kwargs)
        self._rec = RecordingSource(self.in_process)
        self.ref_model = self.build(self._rec)
        if tokens is None:
            vocab = getattr(self.ref_model, "vocab_size", None)
            if not vocab:
                raise InvalidArgument("the model has no vocab_size attribute; pass the token ids (--tokens FILE.npy)")
            self.ids = audit_tokens(int(vocab), batch, seq, seed)
        else:
            ids = torch.as_tensor(np.asarray(tokens)).long()
            self.ids = ids[None] if ids.ndim == 1 else ids
            if self.ids.ndim != 2 or not self.ids.numel():
                raise InvalidArgument(f"tokens must be int [B, T] or [T], got shape {tuple(np.shape(tokens))}")
        self.reference, self.decode_ids = execute(self.ref_model, self.ids, decode_tokens=decode_tokens)
        set_source(self.ref_model, self.in_process)
        twin = self.build(self.in_process).state_dict()
        ref = self.ref_model.state_dict()
        if twin.keys() != ref.keys() or any(not torch.equal(v, twin[k]) for k, v in ref.items()):
            raise InvalidArgument("the model factory built different weights on a second call; seed it (or load "
                                  "a checkpoint) so that every path runs the same weights")
        self.sidecars = Sidecars(self.data_dir, self._budgets())
        self._outs: dict[str, Outputs] = {}
        self._tables: dict[str, object] = {}

    # ---- setup ---------------------------------------------------------------
    def hot_ids(self, table: str) -> np.ndarray:
        """Row ids of `table` the reference read, read by the most steps first."""
        return self._rec.hot_ids(table)

    def _budgets(self) -> dict[str, int]:
        """DRAM budgets: full fits every table; cold gives each table the arena its largest step
        needs, as a user sizes one for a single client (leases.arena_for_step: the step, and the
        reserve a client alone may not lease), no more; cache about 25% of the tables."""
        from tierstore.cache.leases import arena_for_step
        from tierstore.store.catalog import Catalog

        with Catalog(self.data_dir, readonly=True) as cat:
            sizes = {t: (cat.current(t).rows, cat.current(t).row_bytes) for t in cat.tables()}
        total = sum(r * b for r, b in sizes.values())
        # the sidecar splits its budget by the tables' bytes: table t gets budget * rows_t / total
        # slots, rounded down (one more slot asked for the rounding)
        cold = max(-(-(arena_for_step(self._rec.largest_plan(t)) + 1) * total // sizes[t][0])
                   for t in self._rec.asked)
        return {"full": total + (1 << 20), "cold": cold, "cache": max(int(0.25 * total), 2 * cold)}

    def config(self) -> dict:
        return {"data_dir": str(self.data_dir), "spec": self.spec.name, "model": self.module or "demo",
                "model_kwargs": self.model_kwargs, "batch": int(self.ids.shape[0]), "seq": int(self.ids.shape[1]),
                "decode_tokens": 0 if self.decode_ids is None else int(self.decode_ids.shape[1]),
                "threads": torch.get_num_threads(), "cuda": torch.cuda.is_available(),
                "dram_budgets": self.sidecars.budgets, "restart_checked": self.restart,
                "table_bytes": sum(t.numel() for t in map(self.in_process.rows, self.in_process.tables()))}

    # ---- one path ------------------------------------------------------------
    def _measure(self, name: str, expect_exact: bool, source_fn, mutate=None, ctx=None, sidecar=None,
                 note: str = "", before_run=None, restart: bool = False) -> PathResult:
        """Build the model on source_fn(), mutate it, run it twice (and after a sidecar restart), compare."""
        res = PathResult(name, expect_exact, note=note)
        try:
            model = self.build(source_fn())
            extra = mutate(model) if mutate else None
            served: dict = {}  # what the sidecar served the two runs (not what before_run asked of it)
            with ctx() if ctx else nullcontext():
                runs = []
                for _ in range(2):
                    if before_run:
                        before_run()
                    runs.append(self.sidecars.served(sidecar, lambda: execute(model, self.ids, self.decode_ids)[0],
                                                     served))
                labels = ["run 2 (same process, same inputs: a kernel whose reduction order varies run to run, "
                          "e.g. GPU atomics or thread scheduling)"]
                if sidecar and restart and self.restart:
                    self.sidecars.restart(sidecar)
                    set_source(model, source_fn())
                    runs.append(execute(model, self.ids, self.decode_ids)[0])
                    labels.append("the run after a sidecar restart (the restarted sidecar served other bytes)")
            res.__dict__.update(compare(runs[0], self.reference))
            res.bit_exact = all(r.equal(self.reference) for r in runs)
            bad = [(lab, r) for lab, r in zip(labels, runs[1:]) if not r.equal(runs[0])]
            res.deterministic = not bad
            res.nondeterminism = "; ".join(
                f"{lab} differs from run 1 (logits max abs {compare(r, runs[0])['logits_max_abs']:.3g})"
                for lab, r in bad)
            self._outs[name] = runs[0]
            notes = [note, tier_note(served) if sidecar else "", extra() if callable(extra) else extra or ""]
            res.note = "; ".join(n for n in notes if n)
        except Exception as e:  # a failing path is reported, the others still run
            res.error = f"{type(e).__name__}: {e}"
            res.bit_exact, res.note = False, "; ".join(n for n in (note, f"FAILED: {res.error}") if n)
        return res

    def _path(self, name: str) -> PathResult:
        from tierstore.bench.e2e import BlockingSource

        if name == "in-process":
            return self._measure(name, False, lambda: self.in_process, note="the reference source, rebuilt and rerun")
        if name in ("sidecar-full", "sidecar-cache"):
            kind = SIDECAR_OF[name]
            return self._measure(name, True, lambda: self.sidecars.client(kind), sidecar=kind, restart=True)
        if name == "sidecar-cold":
            keep = {t: self.hot_ids(t) for t in self._rec.asked}
            return self._measure(name, True, lambda: self.sidecars.client("cold"), sidecar="cold",
                                 before_run=lambda: self.sidecars.flush("cold", keep), restart=True,
                                 note="arena sized for one step and filled with other rows before each run")
        if name == "hbm-cache":
            return self._measure(name, True, lambda: self.sidecars.client("cache"), mutate=lambda m: add_hbm_cache(m, self.hot_ids),
                                 sidecar="cache")
        if name == "late-plan":
            res = self._measure(name, True, lambda: BlockingSource(self.sidecars.client("cache")),
                                sidecar="cache", note="each plan awaited before the model goes on")
            if name in self._outs and "sidecar-cache" in self._outs:
                same = self._outs[name].equal(self._outs["sidecar-cache"])
                res.note += f"; identical to the overlapped sidecar-cache run: {'yes' if same else 'NO'}"
                res.bit_exact = res.bit_exact and same
            return res
        if name in ROW_FORMAT_PATHS:
            return self._row_format_path(name, ROW_FORMAT_PATHS[name])
        if name == "bf16-engram":
            return self._measure(name, False, lambda: self.in_process, mutate=bf16_engram,
                                 note="Engram layers' weights and compute in bf16, backbone fp32")
        if name == "bf16-model":
            return self._measure(name, False, lambda: self.in_process, mutate=bf16_model,
                                 note="whole model in bf16 (weights, activations, Engram compute)")
        if name == "threads":
            n, m = torch.get_num_threads(), (1 if torch.get_num_threads() > 1 else 2)
            return self._measure(name, False, lambda: self.in_process, ctx=lambda: threads(m),
                                 note=f"{m} intra-op thread(s) instead of {n}: matmul summation order")
        if name == "triton":
            return triton_cuda(self) if torch.cuda.is_available() else triton_interpreter(self)
        raise InvalidArgument(f"unknown audit path {name!r}; paths are {', '.join(PATHS)}")

    def _row_format_path(self, name: str, fmt: str) -> PathResult:
        from tierstore.table.formats import RowFormat

        stored = RowFormat.parse(self.spec.row_format)
        note = f"rows re-encoded from {stored.value} to {fmt}: quantisation drift, not a tierstore defect"
        if stored.value == fmt:
            return PathResult(name, False, note=f"skipped: the table is stored as {fmt}")
        if fmt == RowFormat.FP8_E4M3_UE8M0.value and self.spec.row_dim % 32:
            return PathResult(name, False, note=f"skipped: {fmt} needs row_dim % 32 == 0, got {self.spec.row_dim}")
        if fmt not in self._tables:
            self._tables[fmt], worst = reencoded_table(self.in_process, self.spec, stored, fmt)
            note += f" (row values off by up to {worst:.3g})"

        def as_format(model):
            for layer in engram_layers(model).values():
                layer.row_format = RowFormat(fmt)  # the gather kernel dequantises from this format
        return self._measure(name, False, lambda: self._tables[fmt], mutate=as_format, note=note)

    # ---- all paths -----------------------------------------------------------
    def run(self, paths=None, extra: list[CustomPath] = ()) -> AuditReport:
        """Run `paths` (default PATHS, in that order) and the `extra` paths; returns the report."""
        names = list(PATHS if paths is None else paths)
        unknown = [n for n in names if n not in PATHS]
        if unknown:
            raise InvalidArgument(f"unknown audit path(s) {unknown}; paths are {', '.join(PATHS)}")
        report = AuditReport(self.config())
        kinds = sorted({SIDECAR_OF[n] for n in names if n in SIDECAR_OF})
        try:
            self.sidecars.start(kinds)
        except Exception as e:  # reported by each path that needs the sidecar
            self.log(f"audit: starting sidecars failed: {e}")
        for name in names:
            self.log(f"audit: {name} ...")
            report.paths.append(self._path(name))
        for cp in extra:
            self.log(f"audit: {cp.name} ...")
            report.paths.append(self._measure(cp.name, cp.expect_exact, lambda cp=cp: cp.source, note=cp.note))
        return report

    def close(self) -> None:
        self.sidecars.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

def run_audit(data_dir, paths=None, extra: list[CustomPath] = (), **kw) -> AuditReport:
    """Audit(data_dir, **kw).run(paths, extra), stopping the sidecars afterwards."""
    with Audit(data_dir, **kw) as audit:
        return audit.run(paths, extra)
