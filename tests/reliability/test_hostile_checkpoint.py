"""Hostile checkpoints against `tierstore ingest-checkpoint`, run as a user runs it (a
process): a shard named outside the checkpoint (`..`, an absolute path, a symlink) is
never ingested, and config numbers that would start an endless prime search are refused
at once. Each ends rc 2 with the file and the fix named, no traceback, the data
directory untouched."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from v41_checkpoint import INDEX, edit_json, write_checkpoint  # noqa: E402

pytestmark = pytest.mark.reliability
SHARD = "model-00003-of-00003.safetensors"  # layer 3's six tensors


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile_ckpt") / "ckpt"
    write_checkpoint(d)
    return d


def _retarget(d: Path, target: str) -> None:
    """Point every index entry of SHARD at `target` (the bytes moved there beside the checkpoint)."""
    edit_json(d / INDEX, lambda idx: idx.update(weight_map={k: (target if v == SHARD else v)
                                                            for k, v in idx["weight_map"].items()}))


def _dotdot(d):
    (d.parent / "elsewhere").mkdir()
    shutil.move(d / SHARD, d.parent / "elsewhere" / "x.safetensors")
    _retarget(d, "../elsewhere/x.safetensors")


def _absolute(d):
    shutil.move(d / SHARD, d.parent / "x.safetensors")
    _retarget(d, str(d.parent / "x.safetensors"))


def _symlink(d):
    shutil.move(d / SHARD, d.parent / SHARD)
    os.symlink(d.parent / SHARD, d / SHARD)


def _config(**text):
    return lambda d: edit_json(d / "config.json", lambda cfg: cfg["text_config"].update(text))


@pytest.mark.parametrize("attack, names", [
    (_dotdot, r"shard '\.\./elsewhere/x\.safetensors' resolves to \S+/elsewhere/x\.safetensors, outside the "
              r"checkpoint directory"),
    (_absolute, r"shard '/\S+/x\.safetensors' is not a relative file name"),
    (_symlink, rf"shard '{SHARD}' resolves to \S+, outside the checkpoint directory"),
    (_config(engram_n_heads=10 ** 7), r"config\.json: bad Engram fields \(n_heads = 10000000 is outside 1\.\.256"),
    (_config(engram_vocab_size=int("9" * 4000)), r"config\.json: bad Engram fields \(engram_vocab_size = a "
                                                 r"4000-digit number is outside 2\.\.1099511627776"),
    (_config(engram_layer_ids=list(range(500)), engram_num_embeddings=[1] * 500),
     r"config\.json: bad Engram fields \(500 layers x 3 n-gram orders x 3 heads is 4500 hash buckets"),
], ids=["dotdot", "absolute", "symlink", "n-heads-1e7", "vocab-4000-digits", "500-layers"])
def test_a_hostile_checkpoint_is_refused_quickly_and_writes_nothing(ckpt, tmp_path, attack, names):
    bad = tmp_path / "ckpt"
    shutil.copytree(ckpt, bad)
    attack(bad)
    data = tmp_path / "data"
    t0 = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "tierstore", "ingest-checkpoint", str(bad), "--data", str(data),
                               "--quiet"], capture_output=True, text=True, timeout=60, cwd="/")
    except subprocess.TimeoutExpired:  # run() has killed it
        pytest.fail("ingest-checkpoint ran for a minute on a hostile checkpoint")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert re.search(names, done.stderr), done.stderr
    assert time.perf_counter() - t0 < 30
    assert not data.exists()
