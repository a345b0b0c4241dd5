"""Client.split_table: a real sidecar serving a synthetic V4.1 checkpoint split-layout.

What an engine maps must be the checkpoint's own `embed.weight` and
`embed.scale` tensors, byte for byte, one buffer weights first; every other
route (lookup, inline lookup, plan) still reads interleaved 264-byte rows.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from v41_checkpoint import write_checkpoint  # noqa: E402

from tierstore import errors
from tierstore.client.client import Client
from tierstore.client.split_table import CudaRegistrationError
from tierstore.ingest.checkpoint import ingest_checkpoint
from tierstore.ingest.writer import write_version
from tierstore.sidecar.launcher import SidecarProcess
from tierstore.tiers.dram import HEADER_BYTES


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A sidecar serving l1 split-layout and l3 interleaved, from one synthetic checkpoint."""
    root = tmp_path_factory.mktemp("split")
    arrays = write_checkpoint(root / "ckpt")
    ingest_checkpoint(root / "ckpt", root / "data", progress=False)
    with SidecarProcess(root / "data", dram_budget="64MiB", extra_args=("--split-layout", "l1")) as sc, \
            Client(sc.socket, timeout=10) as c:
        yield sc, c, arrays


def _packed(arrays, L):
    return np.concatenate([arrays[L]["embed.weight"], arrays[L]["embed.scale"]], axis=1)


def test_the_split_arena_is_the_checkpoint_tensors_byte_for_byte(served):
    sc, c, arrays = served
    with c.split_table("l1") as t:
        assert np.array_equal(t.weight, arrays[1]["embed.weight"])
        assert np.array_equal(t.scale, arrays[1]["embed.scale"])
        assert t.weight.shape == (t.rows, 256) and t.scale.shape == (t.rows, 8)
        assert t.scale.ctypes.data == t.weight.ctypes.data + t.weight.nbytes  # one buffer, weights first
        assert not t.weight.flags.writeable and not t.scale.flags.writeable
        arena = next(f for f in sc.arena_files() if ".l1." in f.name)
        body = np.fromfile(arena, np.uint8)[HEADER_BYTES:HEADER_BYTES + t.rows * 264]
        want = np.concatenate([arrays[1]["embed.weight"].ravel(), arrays[1]["embed.scale"].ravel()])
        assert np.array_equal(body, want)  # the file itself, not only the views


def test_tensors_share_the_mapping_in_the_engines_dtypes(served):
    sc, c, arrays = served
    with c.split_table("l1") as t:
        w, s = t.tensors()
        assert w.dtype == torch.float8_e4m3fn and w.shape == (t.rows, 256)
        assert s.dtype == getattr(torch, "float8_e8m0fnu", torch.uint8) and s.shape == (t.rows, 8)
        assert w.data_ptr() == t.weight.ctypes.data and s.data_ptr() == t.scale.ctypes.data
        assert torch.equal(w.view(torch.uint8), torch.from_numpy(arrays[1]["embed.weight"]))


def test_lookups_and_plans_of_a_split_table_are_interleaved_rows(served):
    sc, c, arrays = served
    rows = len(arrays[1]["embed.weight"])
    ids = np.random.default_rng(3).integers(0, rows, 777)
    want = _packed(arrays, 1)[ids]
    assert np.array_equal(c.lookup("l1", ids), want)
    assert np.array_equal(c.lookup("l1", ids, inline=True), want)
    with c.plan("l1", ids) as step:
        assert np.array_equal(step.rows(), want)
    for inline in (False, True):  # into a caller's buffer, split or not (Client.lookup(out=))
        out = np.zeros_like(want)
        assert c.lookup("l1", ids, inline=inline, out=out) is out and np.array_equal(out, want)
    assert np.array_equal(c.lookup("l3", ids[ids < len(arrays[3]["embed.weight"])]),
                          _packed(arrays, 3)[ids[ids < len(arrays[3]["embed.weight"])]])


def test_an_interleaved_table_is_refused_with_the_flag_to_set(served):
    sc, c, arrays = served
    with pytest.raises(errors.InvalidArgument, match="--split-layout l3"):
        c.split_table("l3")
    with pytest.raises(errors.InvalidArgument, match="split-layout"):
        c.plan("l1", [0, 1]).arena  # tierstore's own gather kernels read interleaved arenas


def test_register_cuda_without_a_device_is_a_typed_error_and_close_is_idempotent(served):
    sc, c, arrays = served
    t = c.split_table("l1")
    other = c.split_table("l1")  # the same mapping in this process
    assert other.weight.ctypes.data == t.weight.ctypes.data
    if not torch.cuda.is_available():
        with pytest.raises(CudaRegistrationError, match="no CUDA device"):
            t.register_cuda()
    t.close()
    t.close()
    assert np.array_equal(other.weight[:3], arrays[1]["embed.weight"][:3])  # still mapped for the other user
    other.close()
    with pytest.raises(errors.InvalidArgument, match="closed"):
        other.tensors()


def test_a_table_that_cannot_be_split_fails_the_start_with_the_fix(tmp_path):
    data = tmp_path / "data"
    rows = np.random.default_rng(0).integers(0, 256, (100, 64), dtype=np.uint8)
    write_version(data, "f32", [rows], rows=100, row_format="fp32", row_dim=16)
    sc = SidecarProcess(data, extra_args=("--split-layout", "f32"))
    try:
        with pytest.raises(RuntimeError, match="only fp8-e4m3-ue8m0"):
            sc.start()
        assert not sc.shm_files()  # nothing left behind
    finally:
        sc.cleanup()


def test_a_split_table_over_the_budget_fails_the_start_with_the_fix(tmp_path):
    root = tmp_path
    write_checkpoint(root / "ckpt")
    ingest_checkpoint(root / "ckpt", root / "data", progress=False, layers=[1])
    sc = SidecarProcess(root / "data", dram_budget="100KiB", extra_args=("--split-layout", "all"))
    try:
        with pytest.raises(RuntimeError, match="raise --dram-budget"):
            sc.start()
        assert not sc.shm_files()
    finally:
        sc.cleanup()
