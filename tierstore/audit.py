"""Execution-fidelity audit: does the model served by tierstore compute what was trained?

A model served through tierstore runs the same weights through different
execution paths: rows from the sidecar's full-resident arena, its cache-mode
arena or its NVMe tier, an HBM cache in front of it, a plan that arrived late,
rows stored in a narrower format, bf16 compute, Triton kernels. The audit runs
one model over one token sequence through each path and compares everything
it computes with the *reference*: the same weights, rows held in process
exactly as stored on disk (LocalTable), torch reference kernels, fp32 compute.

    from tierstore.audit import Audit

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
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from tierstore.errors import InvalidArgument

EXACT_PATHS = ("sidecar-full", "sidecar-cache", "sidecar-cold", "hbm-cache", "late-plan")
ROW_FORMAT_PATHS = {"rows-bf16": "bf16", "rows-fp16": "fp16", "rows-fp8": "fp8-e4m3-ue8m0"}
PATHS = ("in-process", *EXACT_PATHS, *ROW_FORMAT_PATHS, "bf16-engram", "bf16-model", "threads", "triton")
SIDECAR_OF = {"sidecar-full": "full", "sidecar-cache": "cache", "sidecar-cold": "cold",
              "hbm-cache": "cache", "late-plan": "cache"}

__all__ = ["Audit", "AuditReport", "CustomPath", "Outputs", "PathResult", "PATHS", "EXACT_PATHS",
           "compare", "execute", "run_audit"]


@dataclass
class Outputs:
    """What one run computed: {layer id: every Engram layer output, flat fp32}, logits fp32 [B, T+K, V]."""

    engram: dict[int, torch.Tensor]
    logits: torch.Tensor

    def equal(self, other: "Outputs") -> bool:
        return (self.engram.keys() == other.engram.keys() and torch.equal(self.logits, other.logits)
                and all(torch.equal(v, other.engram[k]) for k, v in self.engram.items()))


@dataclass
class CustomPath:
    """An extra path: the model served by `source` (any RowSource) as it is."""

    name: str
    source: object
    expect_exact: bool = True
    note: str = ""


@dataclass
class PathResult:
    """One path against the reference. bit_exact: every run equal to it, bit for bit; *_max_abs /
    *_max_rel: errors of the first run (None when the path did not run); top1_agree: fraction of
    positions with the reference's argmax token; deterministic: runs equal to each other (None: not
    run); note: what the path did (tiers hit, formats); error: why it failed, if it did."""

    name: str
    expect_exact: bool
    bit_exact: bool = False
    deterministic: bool | None = None
    engram_max_abs: float | None = None
    engram_max_rel: float | None = None
    logits_max_abs: float | None = None
    logits_max_rel: float | None = None
    top1_agree: float | None = None
    note: str = ""
    nondeterminism: str = ""   # why the runs differ, when they do
    error: str = ""

    @property
    def ok(self) -> bool:
        """False for a path that must be exact and is not (or failed)."""
        return not self.expect_exact or (self.bit_exact and self.deterministic is not False and not self.error)


@dataclass
class AuditReport:
    """Every path's result; `offenders()` names the paths that must be exact and are not."""

    config: dict
    paths: list[PathResult] = field(default_factory=list)

    def offenders(self) -> list[str]:
        return [p.name for p in self.paths if not p.ok]

    @property
    def exit_code(self) -> int:
        return 1 if self.offenders() else 0

    def to_dict(self) -> dict:
        return {"config": self.config, "exact_paths": [p.name for p in self.paths if p.expect_exact],
                "offenders": self.offenders(), "paths": [asdict(p) for p in self.paths]}


# ---------------------------------------------------------------- running a model

def engram_layers(model) -> dict:
    from tierstore.client.layer import EngramLayer

    layers = {m.layer_id: m for m in model.modules() if isinstance(m, EngramLayer)}
    if not layers:
        raise InvalidArgument(f"{type(model).__name__} has no EngramLayer modules; the audit compares "
                              "their outputs (attach them with tierstore.client.attach.attach_engram)")
    return dict(sorted(layers.items()))


def set_source(model, source) -> None:
    for layer in engram_layers(model).values():
        layer.reset()
        layer.source = source


@torch.no_grad()
def execute(model, ids: torch.Tensor, decode_ids: torch.Tensor | None = None, decode_tokens: int = 0):
    """Prefill `ids` [B, T], then decode (forced `decode_ids` [B, K], else `decode_tokens` greedy steps).

    Returns (Outputs, the decode tokens fed [B, K] or None)."""
    layers = engram_layers(model)
    got: dict[int, list] = {lid: [] for lid in layers}
    hooks = [layer.register_forward_hook(
        lambda mod, args, out, lid=lid: got[lid].append(out.detach().float().reshape(-1).cpu()))
        for lid, layer in layers.items()]
    device = next(model.parameters()).device
    try:
        can_decode = hasattr(model, "new_cache") and hasattr(model, "decode_step")
        cache = model.new_cache() if can_decode else None
        logits = model(ids.to(device), cache) if can_decode else model(ids.to(device))
        steps, fed = [logits.float().cpu()], []
        k = decode_ids.shape[1] if decode_ids is not None else decode_tokens
        nxt = logits[:, -1].argmax(-1)
        for j in range(k if can_decode else 0):
            if decode_ids is not None:
                nxt = decode_ids[:, j].to(device)
            fed.append(nxt.cpu())
            step = model.decode_step(nxt, cache)
            steps.append(step[:, None].float().cpu())
            nxt = step.argmax(-1)
    finally:
        for h in hooks:
            h.remove()
        for layer in layers.values():
            layer.reset()
    out = Outputs({lid: torch.cat(v) for lid, v in got.items()}, torch.cat(steps, dim=1))
    return out, (torch.stack(fed, dim=1) if fed else None)


def _errors(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    if x.shape != ref.shape:
        raise InvalidArgument(f"outputs of shape {tuple(x.shape)} do not match the reference {tuple(ref.shape)}")
    diff = (x - ref).abs()
    if not diff.numel():
        return 0.0, 0.0
    rms = float(ref.pow(2).mean().sqrt()) + 1e-30
    return float(diff.max()), float((diff / ref.abs().clamp_min(rms)).max())


def compare(out: Outputs, ref: Outputs) -> dict:
    """Error metrics of `out` against `ref` (max abs/rel over every Engram layer and the logits, top-1)."""
    e = [_errors(out.engram[k], v) for k, v in ref.engram.items()]
    la, lr = _errors(out.logits, ref.logits)
    top1 = float((out.logits.argmax(-1) == ref.logits.argmax(-1)).float().mean())
    return dict(bit_exact=out.equal(ref), engram_max_abs=max(a for a, _ in e), engram_max_rel=max(r for _, r in e),
                logits_max_abs=la, logits_max_rel=lr, top1_agree=top1)


class RecordingSource:
    """A RowSource wrapper that remembers the ids each plan asked for (hot ids, step sizes)."""

    def __init__(self, source):
        self.source, self.asked = source, {}

    def plan(self, table, ids):
        self.asked.setdefault(table, []).append(np.asarray(ids, dtype=np.int64).reshape(-1).copy())
        return self.source.plan(table, ids)

    def table_info(self, table):
        return self.source.table_info(table)

    def largest_plan(self, table) -> int:
        return max((a.size for a in self.asked.get(table, [])), default=0)

    def hot_ids(self, table) -> np.ndarray:
        """Ids asked for, most steps first (ties by id)."""
        if not self.asked.get(table):
            return np.zeros(0, np.int64)
        u, c = np.unique(np.concatenate(self.asked[table]), return_counts=True)
        return u[np.argsort(-c, kind="stable")]


def load_factory(module: str):
    """'pkg.mod:factory' -> the callable."""
    mod, _, name = module.partition(":")
    if not name:
        raise InvalidArgument(f"--module {module!r}: write it as package.module:factory")
    try:
        return getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise InvalidArgument(f"--module {module!r}: {e}; the factory must be importable") from None


def make_builder(data_dir, module: str | None, model_kwargs: dict):
    """source -> model in eval mode: the demo model (weights from model_kwargs['seed']) or a user factory."""
    if module:
        factory = load_factory(module)
        return lambda source: factory(source, **model_kwargs).eval()  # kwargs: e.g. --checkpoint DIR
    from tierstore.bench.e2e import spec_from_catalog
    from tierstore.client.demo_model import EngramDemoModel

    spec = spec_from_catalog(data_dir)
    return lambda source: EngramDemoModel(spec, source, **model_kwargs).eval()


def audit_tokens(vocab: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """Zipf-distributed token ids [batch, seq] (text-like repeats), fixed by `seed`."""
    g = torch.Generator().manual_seed(seed)
    p = torch.arange(1, vocab + 1, dtype=torch.float64) ** -1.1
    return torch.multinomial(p / p.sum(), batch * seq, replacement=True, generator=g).reshape(batch, seq)


@contextmanager
def _threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)



class _Sidecars:
    """The audit's sidecar processes by kind ("full", "cache", "cold"), started on first use."""

    def __init__(self, data_dir, budgets: dict[str, int]):
        self.data_dir, self.budgets = data_dir, budgets
        self.procs, self.clients = {}, {}

    def client(self, kind: str):
        if kind not in self.clients:
            from tierstore.client.sidecar import Client
            from tierstore.launcher import SidecarProcess

            proc = SidecarProcess(self.data_dir, dram_budget=str(self.budgets[kind]))
            try:
                proc.start()
            except BaseException:
                proc.cleanup()
                raise
            self.procs[kind] = proc
            self.clients[kind] = Client(proc.socket, client_name=f"audit-{kind}")
        return self.clients[kind]

    def start(self, kinds) -> None:
        """Start several sidecars at once (each start mostly waits for the child to come up)."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max(1, len(kinds))) as pool:
            for f in [pool.submit(self.client, k) for k in kinds]:
                f.result()

    def restart(self, kind: str):
        self.stop(kind)
        return self.client(kind)

    def counts(self, kind: str | None) -> dict:
        """{table: (mode, hits, misses)} of a running sidecar."""
        if kind not in self.clients:
            return {}
        return {t["table"]: (t["mode"], int(t["hits"]), int(t["misses"]))
                for t in self.clients[kind].stats()["tables"]}

    def flush(self, kind: str, keep: dict) -> None:
        """Fill a cache-mode arena with rows the audit does not read, so the next run starts cold."""
        client = self.client(kind)
        for t in client.stats()["tables"]:
            if t["mode"] == "full" or t["table"] not in keep:
                continue
            other = np.setdiff1d(np.arange(client.table_info(t["table"])["rows"]), keep[t["table"]])
            with client.plan(t["table"], other[: int(t["capacity"])]) as step:
                step.slots()

    def stop(self, kind: str) -> None:
        client, proc = self.clients.pop(kind, None), self.procs.pop(kind, None)
        if client is not None:
            client.close()
        if proc is not None:
            proc.cleanup()

    def close(self) -> None:
        for kind in list(self.procs):
            self.stop(kind)


def _tier_note(before: dict, after: dict) -> str:
    modes = {m for m, _, _ in after.values()}
    if modes == {"full"}:
        return "full-resident arena, every row from DRAM (slot == id)"
    hits = sum(after[t][1] - before.get(t, ("", 0, 0))[1] for t in after)
    miss = sum(after[t][2] - before.get(t, ("", 0, 0))[2] for t in after)
    total = max(1, hits + miss)
    return (f"cache-mode arena: 2 runs read {hits} rows from DRAM, {miss} promoted from NVMe "
            f"({100 * miss / total:.0f}% from NVMe)")


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
        from tierstore.bench.e2e import local_source, spec_from_catalog

        self.data_dir, self.module, self.restart, self.log = Path(data_dir), module, restart, log
        self.model_kwargs = dict(model_kwargs or {}) if module else {"seed": seed, **(model_kwargs or {})}
        self.triton_shape = triton_shape
        self.spec = spec_from_catalog(self.data_dir)
        self.local = local_source(self.data_dir, self.spec)
        self.build = make_builder(self.data_dir, module, self.model_kwargs)
        self._rec = RecordingSource(self.local)
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
        set_source(self.ref_model, self.local)
        twin = self.build(self.local).state_dict()
        ref = self.ref_model.state_dict()
        if twin.keys() != ref.keys() or any(not torch.equal(v, twin[k]) for k, v in ref.items()):
            raise InvalidArgument("the model factory built different weights on a second call; seed it (or load "
                                  "a checkpoint) so that every path runs the same weights")
        self.sidecars = _Sidecars(self.data_dir, self._budgets())
        self._outs: dict[str, Outputs] = {}
        self._tables: dict[str, object] = {}

    # ---- setup ---------------------------------------------------------------
    def hot_ids(self, table: str) -> np.ndarray:
        """Row ids of `table` the reference read, read by the most steps first."""
        return self._rec.hot_ids(table)

    def _budgets(self) -> dict[str, int]:
        """DRAM budgets: full fits everything; cold fits 1.2x the largest step; cache ~25% of the tables."""
        from tierstore.catalog import Catalog

        with Catalog(self.data_dir, readonly=True) as cat:
            sizes = {t: (cat.current(t).rows, cat.current(t).row_bytes) for t in cat.tables()}
        total = sum(r * b for r, b in sizes.values())
        frac = max(self._rec.largest_plan(t) / sizes[t][0] for t in self._rec.asked)
        cold = int(1.2 * frac * total) + 2 * max(b for _, b in sizes.values()) * len(sizes)
        return {"full": total + (1 << 20), "cold": cold, "cache": max(int(0.25 * total), 2 * cold)}

    def config(self) -> dict:
        return {"data_dir": str(self.data_dir), "spec": self.spec.name, "model": self.module or "demo",
                "model_kwargs": self.model_kwargs, "batch": int(self.ids.shape[0]), "seq": int(self.ids.shape[1]),
                "decode_tokens": 0 if self.decode_ids is None else int(self.decode_ids.shape[1]),
                "threads": torch.get_num_threads(), "cuda": torch.cuda.is_available(),
                "dram_budgets": self.sidecars.budgets, "restart_checked": self.restart,
                "table_bytes": sum(t.numel() for t in map(self.local.rows, self.local.tables()))}

    # ---- one path ------------------------------------------------------------
    def _measure(self, name: str, expect_exact: bool, source_fn, mutate=None, ctx=None, sidecar=None,
                 note: str = "", before_run=None, restart: bool = False) -> PathResult:
        """Build the model on source_fn(), mutate it, run it twice (and after a sidecar restart), compare."""
        res = PathResult(name, expect_exact, note=note)
        try:
            model = self.build(source_fn())
            extra = mutate(model) if mutate else None
            before = self.sidecars.counts(sidecar)
            with ctx() if ctx else nullcontext():
                runs = []
                for _ in range(2):
                    if before_run:
                        before_run()
                    runs.append(execute(model, self.ids, self.decode_ids)[0])
                after = self.sidecars.counts(sidecar)
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
            notes = [note, _tier_note(before, after) if sidecar else "", extra() if callable(extra) else extra or ""]
            res.note = "; ".join(n for n in notes if n)
        except Exception as e:  # a failing path is reported, the others still run
            res.error = f"{type(e).__name__}: {e}"
            res.bit_exact, res.note = False, "; ".join(n for n in (note, f"FAILED: {res.error}") if n)
        return res

    def _path(self, name: str) -> PathResult:
        from tierstore.bench.e2e import BlockingSource

        if name == "in-process":
            return self._measure(name, False, lambda: self.local, note="the reference source, rebuilt and rerun")
        if name in ("sidecar-full", "sidecar-cache"):
            kind = SIDECAR_OF[name]
            return self._measure(name, True, lambda: self.sidecars.client(kind), sidecar=kind, restart=True)
        if name == "sidecar-cold":
            keep = {t: self.hot_ids(t) for t in self._rec.asked}
            return self._measure(name, True, lambda: self.sidecars.client("cold"), sidecar="cold",
                                 before_run=lambda: self.sidecars.flush("cold", keep), restart=True,
                                 note="arena sized for one step and filled with other rows before each run")
        if name == "hbm-cache":
            return self._measure(name, True, lambda: self.sidecars.client("cache"), mutate=self._add_hbm_cache,
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
            return self._measure(name, False, lambda: self.local, mutate=_bf16_engram,
                                 note="Engram layers' weights and compute in bf16, backbone fp32")
        if name == "bf16-model":
            return self._measure(name, False, lambda: self.local, mutate=_bf16_model,
                                 note="whole model in bf16 (weights, activations, Engram compute)")
        if name == "threads":
            n, m = torch.get_num_threads(), (1 if torch.get_num_threads() > 1 else 2)
            return self._measure(name, False, lambda: self.local, ctx=lambda: _threads(m),
                                 note=f"{m} intra-op thread(s) instead of {n}: matmul summation order")
        if name == "triton":
            return self._triton_cuda() if torch.cuda.is_available() else self._triton_interpreter()
        raise InvalidArgument(f"unknown audit path {name!r}; paths are {', '.join(PATHS)}")

    def _add_hbm_cache(self, model):
        from tierstore.client.hbm_cache import HBMCache

        caches = []
        for layer in engram_layers(model).values():
            hot = self.hot_ids(layer.table)
            cap = max(1, hot.size // 2)
            layer.hbm_cache = HBMCache.from_source(layer.source, layer.table, cap, "cpu", hot_ids=hot)
            caches.append(layer.hbm_cache)

        def note():
            hits = sum(c.hits for c in caches)
            total = max(1, hits + sum(c.misses for c in caches))
            return (f"HBM cache (CPU tensor) seeded with half of the rows read, hottest first: "
                    f"{100 * hits / total:.0f}% of rows from the cache, the rest from the sidecar")
        return note

    def _row_format_path(self, name: str, fmt: str) -> PathResult:
        from tierstore.client.local import LocalTable
        from tierstore.formats import RowFormat, decode_rows, encode_rows

        stored = RowFormat.parse(self.spec.row_format)
        note = f"rows re-encoded from {stored.value} to {fmt}: quantisation drift, not a tierstore defect"
        if stored.value == fmt:
            return PathResult(name, False, note=f"skipped: the table is stored as {fmt}")
        if fmt == RowFormat.FP8_E4M3_UE8M0.value and self.spec.row_dim % 32:
            return PathResult(name, False, note=f"skipped: {fmt} needs row_dim % 32 == 0, got {self.spec.row_dim}")
        worst = 0.0
        if fmt not in self._tables:
            table = LocalTable(self.spec)
            for t in self.local.tables():
                values = decode_rows(self.local.rows(t).numpy(), stored, self.spec.row_dim)
                rows = encode_rows(values, fmt)
                worst = max(worst, float(np.abs(decode_rows(rows, fmt, self.spec.row_dim) - values).max()))
                table.add(t, rows, row_format=fmt, row_dim=self.spec.row_dim)
            self._tables[fmt] = table
            note += f" (row values off by up to {worst:.3g})"

        def as_format(model):
            for layer in engram_layers(model).values():
                layer.row_format = RowFormat(fmt)  # the gather kernel dequantises from this format
        return self._measure(name, False, lambda: self._tables[fmt], mutate=as_format, note=note)

    def _triton_cuda(self) -> PathResult:
        """Whole input on the GPU: Triton kernels, compared with the CPU reference and the GPU torch kernels."""
        from tierstore.client.local import LocalTable

        dev = torch.device("cuda")
        table = LocalTable(self.spec, device=dev)
        for t in self.local.tables():
            table.add(t, self.local.rows(t))
        gpu_torch = {}

        def to_gpu(model):
            model.to(dev)
            with _env(TIERSTORE_FORCE_TORCH="1"):
                gpu_torch["out"] = execute(model, self.ids, self.decode_ids)[0]
            return lambda: ("GPU; vs the torch kernels on the same GPU: logits max abs "
                            f"{compare(self._outs['triton'], gpu_torch['out'])['logits_max_abs']:.3g} "
                            "(the rest of the drift is GPU vs CPU matmuls)")
        return self._measure("triton", False, lambda: table, mutate=to_gpu,
                             ctx=lambda: _env(TIERSTORE_FORCE_TORCH="0"))

    def _triton_interpreter(self) -> PathResult:
        """No GPU: the Triton kernels in Triton's CPU interpreter, in a child process, on a small input."""
        b, t, k = self.triton_shape
        ids = self.ids[:b, :t]
        dec = None if self.decode_ids is None else self.decode_ids[:b, :k]
        res = PathResult("triton", False, note=f"no GPU: Triton interpreter on CPU (child process), small input "
                                               f"{ids.shape[0]}x{ids.shape[1]} + {0 if dec is None else dec.shape[1]} "
                                               "decode, vs the torch reference on the same input")
        try:
            ref = execute(self.ref_model, ids, dec)[0]
            with tempfile.TemporaryDirectory(prefix="tierstore-audit-") as tmp:
                cfg = {"data_dir": str(self.data_dir.resolve()), "module": self.module,
                       "model_kwargs": self.model_kwargs, "tokens": f"{tmp}/ids.npy",
                       "decode": None if dec is None else f"{tmp}/dec.npy", "out": f"{tmp}/out.pt", "runs": 2}
                np.save(cfg["tokens"], ids.numpy())
                if dec is not None:
                    np.save(cfg["decode"], dec.numpy())
                Path(f"{tmp}/cfg.json").write_text(json.dumps(cfg))
                env = {**os.environ, "TRITON_INTERPRET": "1"}
                env.pop("TIERSTORE_FORCE_TORCH", None)
                proc = subprocess.run([sys.executable, "-c", "import sys; from tierstore.audit import _triton_worker; "
                                       "_triton_worker(sys.argv[1])", f"{tmp}/cfg.json"],
                                      env=env, capture_output=True, text=True, timeout=600)
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


def _bf16_engram(model) -> None:
    for layer in engram_layers(model).values():
        layer.to(torch.bfloat16)
        layer.compute_dtype = torch.bfloat16


def _bf16_model(model) -> None:
    model.to(torch.bfloat16)
    _bf16_engram(model)


@contextmanager
def _env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_audit(data_dir, paths=None, extra: list[CustomPath] = (), **kw) -> AuditReport:
    """Audit(data_dir, **kw).run(paths, extra), stopping the sidecars afterwards."""
    with Audit(data_dir, **kw) as audit:
        return audit.run(paths, extra)


def _triton_worker(config_path: str) -> None:
    """Child process of the Triton interpreter path (TRITON_INTERPRET=1 set before any import)."""
    from tierstore.bench.e2e import local_source, spec_from_catalog
    from tierstore.kernels import choose_backend

    if choose_backend("auto", torch.zeros(1)) != "triton":
        raise SystemExit("Triton interpreter unavailable: TRITON_INTERPRET=1 must be set before tierstore.kernels "
                         "is imported, and the triton package installed")
    cfg = json.loads(Path(config_path).read_text())
    spec = spec_from_catalog(cfg["data_dir"])
    model = make_builder(cfg["data_dir"], cfg["module"], cfg["model_kwargs"])(local_source(cfg["data_dir"], spec))
    ids = torch.from_numpy(np.load(cfg["tokens"]))
    dec = torch.from_numpy(np.load(cfg["decode"])) if cfg["decode"] else None
    runs = [execute(model, ids, dec)[0] for _ in range(cfg["runs"])]
    torch.save([{"engram": r.engram, "logits": r.logits} for r in runs], cfg["out"])
