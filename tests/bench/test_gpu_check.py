"""The two prepared GPU scripts (bench/gpu_check.py, bench/gpu_check_engines.py) run in their
CPU smoke mode (--cpu-smoke), so that a typo, an import moved or a call left stale fails here
rather than in a GPU machine's few minutes.

Each runs as a child process, as on the GPU host: the script sets Triton's interpreter
before Triton is first imported, which only a fresh process allows. The child starts its own
session (every process it leaves behind is found by the group), its temporary files go to a
TMPDIR of the test's own, and /dev/shm is compared before and after: what the scripts start
and make, they must stop and remove. The report must name every part the script defines
(PARTS), none with an error or a failed check, each with at least one check that passed;
"skipped on CPU: <why>" is what a check that only CUDA has reads.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tierstore.bench import gpu_check, gpu_check_engines

SHM = Path("/dev/shm")


def _segments() -> set[str]:
    return {p.name for p in SHM.glob(f"tierstore.{os.getuid()}.*")}


def _tag(name: str) -> str:
    return name.split(".")[2]  # tierstore.<uid>.<tag>.<...>: one sidecar's files share the tag


def _live_tags() -> set[str]:
    """The tags of the segments a live process of this user maps: another sidecar on this host
    (another test's, run beside this one), not the child's (its group is gone by now)."""
    maps = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                maps.append((proc / "maps").read_text())
            except OSError:
                pass
    prefix = f"{SHM}/tierstore.{os.getuid()}."
    return {_tag(line[line.index(prefix) + len(str(SHM)) + 1:]) for text in maps for line in text.splitlines()
            if prefix in line}


def _left_behind(before: set[str]) -> set[str]:
    """Segments made since `before` whose sidecar nobody runs: none of its files mapped by a live
    process, and still there a moment later (another test's sidecar may be starting or stopping)."""
    left = set()
    for _ in range(20):
        live = _live_tags()
        left = {n for n in _segments() - before if _tag(n) not in live}
        if not left:
            break
        time.sleep(0.1)
    return left


def _smoke(module: str, tmp_path: Path, timeout: float = 240) -> dict:
    """Run `python -m module --cpu-smoke --out OUT` and return its report, having checked that it
    exited 0 and left no process, shm segment or temporary file of its own behind."""
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    tmp.mkdir()
    before = _segments()
    proc = subprocess.Popen([sys.executable, "-m", module, "--cpu-smoke", "--out", str(out)],
                            cwd=tmp_path, env=dict(os.environ, TMPDIR=str(tmp)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
        proc.wait()
        stragglers = _stop_group(proc.pid)
    assert proc.returncode == 0, log[-8000:]
    assert not stragglers, f"{module} left processes of its group running (killed now)"
    left = _left_behind(before)
    assert not left, f"{module} left shm segments: {sorted(left)}"
    # torch's inductor names a cache directory there on import; everything else is the scripts'
    assert [p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_")] == [], log[-4000:]
    return json.loads((out / f"{module.rsplit('.', 1)[1]}.json").read_text())


def _stop_group(pgid: int) -> bool:
    """Kill what is left of the child's process group; True if anything was."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def _assert_passed(report: dict, parts: tuple[str, ...]) -> None:
    """Every part in order, no check failed, every skip with its reason."""
    assert [k for k in report if k in parts] == list(parts)  # every part, in order: none dropped
    bad = [f"{p}: {k} = {v}" for p in parts for k, v in report[p].items()
           if v is False or k == "error" or k.endswith(": error")]
    assert not bad and report["failed"] == [], bad or report["failed"]
    skips = [(p, v) for p in parts for v in report[p].values() if isinstance(v, str) and v.startswith("skipped")]
    assert all(": " in v and v.split(": ", 1)[1] for _, v in skips), f"a skip without its reason: {skips}"


def test_gpu_check_smoke_runs_every_part(tmp_path):
    report = _smoke("tierstore.bench.gpu_check", tmp_path)
    _assert_passed(report, gpu_check.PARTS)
    assert report["smoke"] is True and report["device"].startswith("cpu")
    kernels = report["kernels"]
    # every format x output dtype through the Triton kernel (the interpreter's), bit for bit
    assert sum(k.startswith("gather ") and v is True for k, v in kernels.items()) == 4 * 3
    assert kernels["gate fp32 within 1e-5"] is True
    assert report["arena"]["UVA gather == HBM gather"] is True
    assert report["arena"]["arena pinned (registered)"].startswith("skipped on CPU: ")
    # the 4 KiB vs 2 MB A/B: both sides served at once, read by the same kernel, the same rows
    pages = report["pages"]
    assert pages["4 KiB: page size the sidecar reports"] == 4096 and pages["4 KiB: no huge page mapped"] is True
    assert pages["gather_rows: same rows on every side"] is True
    assert pages["engines' kernels"].startswith("skipped on CPU: ")
    if "2 MB side" in pages:  # a host with no huge pages for it, and no root to mount some: it says why
        assert pages["2 MB side"].startswith("skipped: the host gives no huge pages")
        assert set(pages["gather_rows over UVA"]) == {"rows/s 4 KiB"}
    else:
        assert pages["2 MB: page size the sidecar reports"] == 2 << 20
        assert pages["2 MB: most of it on huge pages"] is True
        assert set(pages["gather_rows over UVA"]) == {"rows/s 4 KiB", "rows/s 2 MB", "2 MB / 4 KiB"}


def test_gpu_check_engines_smoke_runs_every_part(tmp_path):
    """Every part, the vLLM ones (2, 4, 5, 9) in a child process under the installed vLLM, their
    checks named by its version; `make test-engines` runs this under each supported release."""
    from importlib.metadata import version

    missing = [f"{name} is not installed" for name in ("vllm", "sglang") if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"{'; '.join(missing)} (make engine-deps installs both without CUDA)")
    report = _smoke("tierstore.bench.gpu_check_engines", tmp_path, timeout=420)
    _assert_passed(report, gpu_check_engines.PARTS)
    # both engines are installed: no part may have stepped aside
    assert not {p: k for p in gpu_check_engines.PARTS for k in report[p] if k.endswith("skipped")}
    v = version("vllm")
    assert report["vllm releases"] == [v] and v not in report["supported vLLM releases not checked"]
    assert report["split arena"]["tensors are the mapping, scales right after the weights"] is True
    vllm = report["vllm"]
    assert f"vLLM {v}: module route" not in vllm, vllm  # vLLM's real layer was built, not only its kernel
    assert vllm[f"vLLM {v}: ParallelEngramEmbedding.lookup bf16 == CPU path"] is True
    assert vllm[f"vLLM {v}: _engram_lookup_kernel packed == CPU path"] is True
    # sglang's engram_gather takes CUDA ids only: part 3 has nothing to run here but its import
    assert list(report["sglang"].values()) == ["skipped on CPU: engram_gather takes CUDA ids only (it asserts so)"]
    staged = report["vllm staged"]
    assert staged[f"vLLM {v}: graph replays read each step's staged rows (bf16 == CPU path)"] is True
    assert staged[f"vLLM {v}: eager staged lookup packed == tierstore rows"] is True
    runner = report["vllm runner"]
    assert runner[f"vLLM {v}: the verify step's windows (sampled token, drafts, their predecessors)"] is True
    assert report["sglang stager"]["staged rows on the device == tierstore rows"] is True
    assert report["sglang graph staging"]["replay of 33 requests == CPU path"] is True
    assert report["sglang graph staging"]["buffers kept their addresses"] is True
    for name, forms in (("vllm forms", report["vllm forms"]), ("sglang forms", report["sglang forms"])):
        prefix = f"vLLM {v}: " if name == "vllm forms" else ""
        for form in ("own", "simple", "fast"):  # each form's rows, bit for bit, then its figure
            assert forms[f"{prefix}{form}: rows == CPU path"] is True and forms[f"{prefix}{form}: tokens/s"] > 0
        assert forms[f"{prefix}fast: no step failed on the device"] is True
        assert forms[f"{prefix}a lost host thread: its step's missed rows are NaN"] is True  # ids that missed
        assert forms[f"{prefix}a lost host thread: StagingError at the layer's next lookup"] is True
    restart = report["restart"]  # all three restarts ran through sglang's loader; 1/8000 is too small to judge
    assert restart["rounds"] == 1 and all(restart[k]["s"] > 0 for k in ("dense", "filtered", "unfiltered"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the scripts would check it")
def test_without_cuda_or_the_flag_the_scripts_say_so_and_write_nothing(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path / "a")]) == 0  # documented: nothing to check
    assert gpu_check_engines.main(["--out", str(tmp_path / "b")]) == 2  # documented: nothing was checked
    out = capsys.readouterr()
    assert "no CUDA device" in out.out and "--cpu-smoke" in out.err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_cpu_smoke_refuses_a_triton_imported_without_its_interpreter(tmp_path, monkeypatch):
    from tierstore.kernels import dispatch

    if dispatch.INTERPRET:
        pytest.skip("this process imported Triton under its interpreter")
    for name in gpu_check.SMOKE_ENV:  # restored after the test: smoke_env sets them in this process
        monkeypatch.setenv(name, os.environ.get(name, ""))
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        gpu_check.main(["--cpu-smoke", "--out", str(tmp_path)])
