"""results.json: one file per output directory, one key per scenario.

Every run records what it ran on (CPU model, cores, RAM, kernel), the git
commit of the checkout, the seed, the command line and timestamps, so a number
can always be traced back to the machine and code that produced it. Running a
second scenario into the same directory adds its key and keeps the others.
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

__all__ = ["machine_info", "git_commit", "write_scenario", "load_results", "RESULTS_NAME"]

RESULTS_NAME = "results.json"


def machine_info() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {"cpu_model": cpu, "cores": os.cpu_count(), "cores_usable": usable, "ram_bytes": ram,
            "kernel": platform.release(), "os": platform.system(), "python": platform.python_version(),
            "hostname": platform.node()}


def git_commit(start: Path | None = None) -> str | None:
    """HEAD of the checkout holding this package, read from .git without running git."""
    d = Path(start or __file__).resolve()
    for p in [d, *d.parents]:
        g = p / ".git"
        if g.is_file():  # worktree: "gitdir: PATH"
            g = Path(g.read_text().split(":", 1)[1].strip())
        if not g.is_dir():
            continue
        try:
            head = (g / "HEAD").read_text().strip()
            if not head.startswith("ref: "):
                return head
            ref = head[5:]
            # a worktree's branch refs live in the main repository's git dir (its "commondir")
            common = g / "commondir"
            for base in (g, (g / common.read_text().strip()).resolve()) if common.exists() else (g,):
                if (base / ref).exists():
                    return (base / ref).read_text().strip()
                packed = base / "packed-refs"
                if packed.exists():
                    for line in packed.read_text().splitlines():
                        if line.endswith(" " + ref):
                            return line.split()[0]
        except OSError:
            return None
        return None
    return None


def load_results(out_dir) -> dict:
    """The results.json of `out_dir`; FileNotFoundError saying how to make one."""
    path = Path(out_dir) / RESULTS_NAME
    if not path.exists():
        raise FileNotFoundError(f"no {RESULTS_NAME} in {out_dir}; run `tierstore bench lookup --out {out_dir}` "
                                f"(or another scenario) first")
    return json.loads(path.read_text())


def write_scenario(out_dir, name: str, result: dict, *, seed: int, started: float) -> Path:
    """Add (or replace) scenario `name` in OUT/results.json, with its provenance."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS_NAME
    doc = json.loads(path.read_text()) if path.exists() else {"scenarios": {}}
    doc["machine"] = machine_info()
    doc["git_commit"] = git_commit()
    doc.setdefault("scenarios", {})[name] = {
        **result,
        "seed": seed,
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "started_unix_s": started,
        "finished_unix_s": time.time(),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "wall_s": time.time() - started,
    }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=_jsonable))
    os.replace(tmp, path)
    return path


def _jsonable(x):
    try:
        import numpy as np
        if isinstance(x, np.generic):
            return x.item()
        if isinstance(x, np.ndarray):
            return x.tolist()
    except ImportError:
        pass
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"cannot write {type(x).__name__} to JSON")
