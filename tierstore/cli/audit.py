"""tierstore audit: does the model served by tierstore compute what was trained?

Runs the demo model (or your own, --module) over one token sequence through
every execution path (sidecar full / cache / cold, HBM cache, late plan, other
row formats, bf16 compute, another thread count, Triton kernels) and compares
the Engram layer outputs and logits with the in-process fp32 reference.
Prints a table, writes OUT/audit.json and OUT/audit.png. Exit code 1 when a
path that must be bit-exact (sidecar-full, sidecar-cache, sidecar-cold,
hbm-cache, late-plan) is not, naming it. --quick runs every path on a small
input (QUICK: a small demo table when --data holds none, one short sequence).
"""
from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run", "format_table", "rows", "plot", "COLUMNS", "SIZES", "QUICK"]

# the input's sizes: a full run, and --quick's (every path still runs); a flag given wins
SIZES = {"batch": 2, "seq": 128, "decode_tokens": 8, "d_model": 256, "scale": 64}
QUICK = {"batch": 1, "seq": 16, "decode_tokens": 1, "d_model": 64, "scale": 512}
COLUMNS = ("path", "bit-exact", "max abs err engram", "max rel err engram", "max abs err logits",
           "top-1 agree", "deterministic", "note")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tierstore.bench.audit import PATHS

    p.add_argument("--data", required=True, help="data directory; a demo table is created if it holds none")
    p.add_argument("--out", default="audit", help="folder for audit.json and audit.png (default ./audit)")
    p.add_argument("--json", help="also write the JSON report to this file")
    p.add_argument("--quick", action="store_true", help="every path on a small input (about a minute)")
    p.add_argument("--batch", type=int, help="sequences (default 2, quick 1)")
    p.add_argument("--seq", type=int, help="tokens per sequence in the prefill (default 128, quick 16)")
    p.add_argument("--decode-tokens", type=int, help="decode steps after the prefill (default 8, quick 1)")
    p.add_argument("--paths", nargs="+", choices=PATHS, metavar="PATH",
                   help=f"paths to run (default all): {', '.join(PATHS)}")
    p.add_argument("--module", help="pkg.mod:factory, factory(row_source) -> model (default: the demo model)")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="audit a DeepSeek-V4.1 checkpoint's real Engram layers (ingested into --data first when "
                        "--data holds no tables)")
    p.add_argument("--tokens", help=".npy of int token ids [B, T] or [T] (default: Zipf tokens from --seed)")
    p.add_argument("--seed", type=int, default=0, help="token and demo-model weight seed")
    p.add_argument("--d-model", type=int, help="demo model width (default 256, quick 64)")
    p.add_argument("--no-restart", action="store_true", help="skip re-running sidecar paths on a restarted sidecar")
    p.add_argument("--preset", default="engram-paper-demo", help="demo table preset when --data is empty")
    p.add_argument("--scale", type=int, help="demo table scale when --data is empty (default 64, quick 512)")


def _num(x) -> str:
    if x is None:
        return "-"
    return "0" if x == 0 else f"{x:.3g}"


def rows(report) -> list[tuple[str, ...]]:
    out = []
    for p in report.paths:
        exact = "yes" if p.bit_exact else ("NO (must be exact)" if p.expect_exact else "no")
        det = "-" if p.deterministic is None else ("yes" if p.deterministic else "no")
        top1 = "-" if p.top1_agree is None else f"{p.top1_agree:.3f}"
        out.append((p.name, exact, _num(p.engram_max_abs), _num(p.engram_max_rel), _num(p.logits_max_abs),
                    top1, det, p.note))
    return out


def format_table(report) -> str:
    body = rows(report)
    widths = [max(len(r[i]) for r in [COLUMNS, *body]) for i in range(len(COLUMNS) - 1)]
    line = lambda r: " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " | " + r[-1]  # noqa: E731
    sep = "-+-".join("-" * w for w in widths) + "-+-" + "-" * 4
    return "\n".join([line(COLUMNS), sep, *map(line, body)])


def plot(report, path) -> None:
    """Bar chart of max abs error per path (Engram output, logits), log scale; exact paths marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    paths = report.paths
    vals = np.array([[p.engram_max_abs or 0.0, p.logits_max_abs or 0.0] for p in paths], dtype=float)
    nonzero = vals[vals > 0]
    floor = float(nonzero.min()) / 10 if nonzero.size else 1e-9
    x = np.arange(len(paths))
    fig, ax = plt.subplots(figsize=(max(8, 0.75 * len(paths) + 2), 5))
    for j, color in enumerate(("tab:blue", "tab:orange")):
        zero = vals[:, j] == 0  # exact: nothing to draw on a log scale, so a grey stub at the floor
        ax.bar(x + (j - 0.5) * 0.38, np.where(zero, floor, vals[:, j]), 0.38,
               color=[("lightgrey" if z else color) for z in zero])
    for i, p in enumerate(paths):
        if p.error:
            mark, color = "failed", "tab:red"
        elif p.bit_exact:
            mark, color = "exact", "tab:green"
        elif p.expect_exact:
            mark, color = "NOT exact", "tab:red"
        else:
            continue
        ax.text(i, floor * 1.3, mark, rotation=90, ha="center", va="bottom", color=color, fontweight="bold")
    ax.set_yscale("log")
    ax.set_xticks(x, [p.name + (" *" if p.expect_exact else "") for p in paths], rotation=35, ha="right")
    ax.set_ylabel("max abs error vs fp32 in-process reference")
    ax.set_title("tierstore audit: max abs error per execution path (* must be bit-exact; grey = exactly 0)")
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color="tab:blue", label="Engram layer output"), Patch(color="tab:orange", label="logits"),
                       Patch(color="lightgrey", label="exactly 0")])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> int:
    import json
    import os
    import sys
    from pathlib import Path

    import numpy as np

    from tierstore.bench.audit import Audit
    from tierstore.cli.demo import ensure_demo_table

    for name, size in (QUICK if args.quick else SIZES).items():
        if getattr(args, name) is None:
            setattr(args, name, size)
    if args.module and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # a console script does not put the working directory on sys.path
    module, kwargs = args.module, None if args.module else {"d_model": args.d_model}
    if args.checkpoint:
        _ensure_checkpoint_tables(args.checkpoint, args.data)
        module = "tierstore.client.model.v41_model:audit_model"
        kwargs = {"checkpoint": str(Path(args.checkpoint).resolve()), "seed": args.seed}
    elif not args.module:
        ensure_demo_table(args.data, args.preset, args.scale)
    tokens = np.load(args.tokens) if args.tokens else None
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    with Audit(args.data, batch=args.batch, seq=args.seq, decode_tokens=args.decode_tokens, seed=args.seed,
               tokens=tokens, module=module, model_kwargs=kwargs,
               restart=not args.no_restart, log=log) as audit:
        report = audit.run(args.paths)
    cfg = report.config
    print(f"tierstore audit: {cfg['model']} model on {cfg['spec']}, {cfg['batch']} x {cfg['seq']} tokens + "
          f"{cfg['decode_tokens']} decode steps, vs the in-process fp32 reference (torch kernels)")
    print(format_table(report))
    for p in report.paths:
        if p.deterministic is False:
            print(f"  {p.name} is not deterministic: {p.nondeterminism}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = json.dumps(report.to_dict(), indent=2)
    (out / "audit.json").write_text(doc)
    if args.json:
        Path(args.json).write_text(doc)
    plot(report, out / "audit.png")
    print(f"wrote {out / 'audit.json'} and {out / 'audit.png'}")
    bad = report.offenders()
    if bad:
        print(f"FAIL: {', '.join(bad)} must be bit-exact and {'is' if len(bad) == 1 else 'are'} not")
        return 1
    exact = [p.name for p in report.paths if p.expect_exact]
    print(f"OK: {', '.join(exact) or 'no path that must be exact was run'}"
          f"{' bit-exact and deterministic' if exact else ''}")
    return 0


def _ensure_checkpoint_tables(checkpoint, data) -> None:
    """Ingest the checkpoint's Engram tables into `data` unless it holds tables already."""
    from tierstore.store.catalog import has_tables
    from tierstore.ingest.checkpoint import ingest_checkpoint

    if not has_tables(data):
        ingest_checkpoint(checkpoint, data, progress=True)
