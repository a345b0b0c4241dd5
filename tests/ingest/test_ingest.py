import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tierstore.store.catalog import Catalog
from tierstore.table.spec import preset
from tierstore.errors import InvalidArgument, SpecMismatch
from tierstore.table.formats import decode_rows, encode_rows
from tierstore.ingest.tensor_file import ingest_file
from tierstore.ingest.writer import write_version
from tierstore.tiers.nvme.reader import SegmentReader


def read_all(data_dir, table):
    with Catalog(data_dir, readonly=True) as cat:
        tv = cat.current(table)
        with SegmentReader(data_dir, tv, cat.checksums(table, tv.number)) as r:
            return tv, r.read_range(0, tv.rows)


def test_safetensors_fp32_reads_back_bit_exact(tmp_path, data_dir):
    w = torch.randn(5000, 64)
    save_file({"engram.table": w, "other.bias": torch.zeros(3)}, tmp_path / "m.safetensors")
    tv = ingest_file(tmp_path / "m.safetensors", data_dir, "emb", progress=False, chunk_bytes=100_000)
    assert (tv.row_format, tv.row_dim, tv.rows, tv.block_rows) == ("fp32", 64, 5000, 15)  # 15 x 264-B records
    _, rows = read_all(data_dir, "emb")
    assert np.array_equal(rows, w.numpy().view(np.uint8))
    with Catalog(data_dir, readonly=True) as cat, \
            SegmentReader(data_dir, tv, cat.checksums("emb", 1)) as r:
        ids = np.array([4999, 0, 1234])
        assert np.array_equal(r.read_rows(ids).view(np.float32), w.numpy()[ids])


@pytest.mark.parametrize("dtype,fmt", [(torch.bfloat16, "bf16"), (torch.float16, "fp16")])
def test_half_formats_inferred_from_dtype(tmp_path, data_dir, dtype, fmt):
    w = torch.randn(300, 32).to(dtype)
    save_file({"w": w}, tmp_path / "m.safetensors")
    tv = ingest_file(tmp_path / "m.safetensors", data_dir, "t", progress=False)
    assert tv.row_format == fmt and tv.row_bytes == 64
    assert np.array_equal(read_all(data_dir, "t")[1], w.view(torch.uint8).numpy())


@pytest.mark.parametrize("scale_dtype", [torch.uint8, torch.float8_e8m0fnu])
def test_fp8_values_with_ue8m0_scales(tmp_path, data_dir, scale_dtype):
    packed = encode_rows(np.random.default_rng(0).standard_normal((200, 64)).astype(np.float32), "fp8-e4m3-ue8m0")
    vals = torch.from_numpy(packed[:, :64].copy()).view(torch.float8_e4m3fn)
    scales = torch.from_numpy(packed[:, 64:].copy()).view(scale_dtype)
    save_file({"weight": vals, "weight_scale": scales}, tmp_path / "m.safetensors")
    tv = ingest_file(tmp_path / "m.safetensors", data_dir, "f8", progress=False)
    assert (tv.row_format, tv.row_dim, tv.row_bytes) == ("fp8-e4m3-ue8m0", 64, 66)
    assert np.array_equal(read_all(data_dir, "f8")[1], packed)


def test_fp8_scales_must_match(tmp_path, data_dir):
    vals = torch.zeros(10, 64, dtype=torch.float8_e4m3fn)
    save_file({"w": vals, "s": torch.zeros(10, 3, dtype=torch.uint8)}, tmp_path / "m.safetensors")
    with pytest.raises(SpecMismatch, match=r"must be uint8 or float8_e8m0fnu \[10, 2\]"):
        ingest_file(tmp_path / "m.safetensors", data_dir, "t", scale_key="s", progress=False)
    save_file({"w": vals}, tmp_path / "n.safetensors")
    with pytest.raises(InvalidArgument, match="--scale-key"):
        ingest_file(tmp_path / "n.safetensors", data_dir, "t", progress=False)


def test_npy_and_torch_state_dict(tmp_path, data_dir):
    a = np.random.default_rng(0).standard_normal((777, 16)).astype(np.float16)
    np.save(tmp_path / "t.npy", a)
    assert ingest_file(tmp_path / "t.npy", data_dir, "n", progress=False).row_format == "fp16"
    assert np.array_equal(read_all(data_dir, "n")[1], a.view(np.uint8))
    w = torch.randn(123, 8)
    torch.save({"model": {"engram": {"table": w}, "step": torch.tensor(3)}}, tmp_path / "sd.pt")
    ingest_file(tmp_path / "sd.pt", data_dir, "s", key="model.engram.table", progress=False)
    assert np.array_equal(read_all(data_dir, "s")[1], w.numpy().view(np.uint8))


def test_uint8_packed_rows_and_conversion(tmp_path, data_dir):
    packed = np.random.default_rng(0).integers(0, 256, (50, 264), dtype=np.uint8)
    np.save(tmp_path / "p.npy", packed)
    with pytest.raises(SpecMismatch, match="--format"):
        ingest_file(tmp_path / "p.npy", data_dir, "p", progress=False)
    tv = ingest_file(tmp_path / "p.npy", data_dir, "p", row_format="fp8-e4m3-ue8m0", progress=False)
    assert tv.row_dim == 256 and np.array_equal(read_all(data_dir, "p")[1], packed)
    w = np.random.default_rng(1).standard_normal((40, 32)).astype(np.float32)
    np.save(tmp_path / "w.npy", w)
    tv = ingest_file(tmp_path / "w.npy", data_dir, "c", row_format="bf16", progress=False)
    assert "converted fp32 -> bf16" in tv.source
    assert np.array_equal(read_all(data_dir, "c")[1], encode_rows(w, "bf16"))


def test_bad_checkpoints(tmp_path, data_dir):
    save_file({"a": torch.zeros(4, 8), "b": torch.zeros(4, 8), "v": torch.zeros(8),
               "i": torch.zeros(4, 8, dtype=torch.int32)}, tmp_path / "m.safetensors")
    src = tmp_path / "m.safetensors"
    with pytest.raises(InvalidArgument, match=r"holds tensors \['a', 'b', 'i', 'v'\]; choose the table with --key"):
        ingest_file(src, data_dir, "t", progress=False)
    with pytest.raises(InvalidArgument, match="has no tensor 'zz'"):
        ingest_file(src, data_dir, "t", key="zz", progress=False)
    with pytest.raises(SpecMismatch, match=r"shape \[8\]; a table is 2-D"):
        ingest_file(src, data_dir, "t", key="v", progress=False)
    with pytest.raises(SpecMismatch, match="dtype int32"):
        ingest_file(src, data_dir, "t", key="i", progress=False)
    with pytest.raises(InvalidArgument, match="invalid table name"):
        ingest_file(src, data_dir, "../evil", key="a", progress=False)
    (tmp_path / "junk.bin").write_bytes(b"not a checkpoint at all")
    with pytest.raises(InvalidArgument, match="not a safetensors file"):
        ingest_file(tmp_path / "junk.bin", data_dir, "t", progress=False)
    assert not (tmp_path / "evil").exists()


def test_preset_checks_rows_and_width(tmp_path, data_dir):
    spec = preset("engram-paper-demo", 4096)
    rows = spec.rows(1)
    save_file({"ok": torch.zeros(rows, 64), "short": torch.zeros(rows - 1, 64), "wide": torch.zeros(rows, 65)},
              tmp_path / "m.safetensors")
    src = tmp_path / "m.safetensors"
    tv = ingest_file(src, data_dir, key="ok", preset="engram-paper-demo", layer=1, scale=4096, progress=False)
    assert tv.table == "l1" and tv.layer_id == 1 and tv.spec == spec.to_dict()
    with pytest.raises(SpecMismatch, match=rf"is \[{rows - 1}, 64\] but preset 'engram-paper-demo' \(scale 4096\) "
                                           rf"layer 1 needs \[{rows}, 64\]"):
        ingest_file(src, data_dir, key="short", preset="engram-paper-demo", layer=1, scale=4096, progress=False)
    with pytest.raises(SpecMismatch, match=rf"needs \[{rows}, 64\]"):
        ingest_file(src, data_dir, key="wide", preset="engram-paper-demo", layer=1, scale=4096, progress=False)
    with pytest.raises(InvalidArgument, match="unknown preset"):
        ingest_file(src, data_dir, key="ok", preset="nope", layer=1, progress=False)
    with pytest.raises(InvalidArgument, match="no Engram layer 2"):
        ingest_file(src, data_dir, key="ok", preset="engram-paper-demo", layer=2, scale=4096, progress=False)


def test_failed_write_keeps_current_version(data_dir, make_table):
    tv, data = make_table("t", rows=100)
    with pytest.raises(SpecMismatch, match="ended after 50 rows; 100 were declared"):
        write_version(data_dir, "t", [data[:50]], rows=100, row_format="fp32", row_dim=16)
    with pytest.raises(SpecMismatch, match="more than the declared 10 rows"):
        write_version(data_dir, "t", [data[:50]], rows=10, row_format="fp32", row_dim=16)
    with pytest.raises(InvalidArgument, match=r"uint8 \[n, 64\]"):
        write_version(data_dir, "t", [data.view(np.float32)], rows=100, row_format="fp32", row_dim=16)
    got_tv, rows = read_all(data_dir, "t")
    assert got_tv == tv and np.array_equal(rows, data)
    assert list((data_dir / "tmp").iterdir()) == []
    assert sorted(p.name for p in (data_dir / "tables" / "t").iterdir()) == ["v1"]


def test_full_disk_is_a_clear_error(tmp_path, data_dir, make_table, tierstore_full_disk):
    tv, data = make_table("t", rows=100)
    np.save(tmp_path / "big.npy", np.ones((64 << 10, 16), dtype=np.float32))  # 4 MiB of rows
    out = tierstore_full_disk(2 << 20, "ingest", tmp_path / "big.npy", "--data", data_dir, "--table", "t", "--quiet")
    assert out.returncode == 1, out.stderr
    assert "disk full while writing table 't'" in out.stderr and "current version is unchanged" in out.stderr
    got_tv, rows = read_all(data_dir, "t")
    assert got_tv == tv and np.array_equal(rows, data)
    assert list((data_dir / "tmp").iterdir()) == []


KILL_SCRIPT = """
import sys, numpy as np
from tierstore.ingest.writer import write_version
rows, rb = 1_200_000, 256   # ~300 MB
def chunks():
    for i in range(0, rows, 20_000):
        yield np.full((min(20_000, rows - i), rb), i // 20_000 % 251, dtype=np.uint8)
write_version(sys.argv[1], "t", chunks(), rows=rows, row_format="fp32", row_dim=64, progress=True)
print("COMMITTED")
"""


def test_kill_9_mid_ingest_leaves_old_version_current(data_dir, make_table):
    tv, data = make_table("t", rows=1000)
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(data_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        seen, deadline = b"", time.monotonic() + 60
        while time.monotonic() < deadline:  # wait until the progress bar shows real progress
            seen += os.read(proc.stderr.fileno(), 4096)
            pct = [int(p) for p in re.findall(rb"(\d+)%\|", seen)]
            if pct and max(pct) >= 3:
                break
            assert proc.poll() is None, seen.decode(errors="replace")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL and max(pct) < 100
    staged = list((data_dir / "tmp").iterdir())
    assert staged, "the killed writer's staging directory should be left behind"
    got_tv, rows = read_all(data_dir, "t")
    assert got_tv == tv and np.array_equal(rows, data)
    with Catalog(data_dir):  # the next write open cleans up
        pass
    assert list((data_dir / "tmp").iterdir()) == []
    assert read_all(data_dir, "t")[0].number == 1


@pytest.mark.parametrize("fmt", ["fp8-e4m3-ue8m0", "bf16", "fp16"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_values_are_refused_for_lossy_formats(tmp_path, data_dir, cli, fmt, bad):
    w = torch.randn(300, 64)
    w[257, 33] = bad
    save_file({"w": w}, tmp_path / "m.safetensors")
    code, _, err = cli("ingest", tmp_path / "m.safetensors", "--data", data_dir, "--table", "t", "--format", fmt,
                       "--quiet")
    assert code == 2 and "row 257, column 33" in err and "not finite" in err and "Traceback" not in err
    assert not (data_dir / "tables" / "t").exists() or not list((data_dir / "tables" / "t").iterdir())
    w[257, 33] = 1.0  # the same file without the bad value ingests
    save_file({"w": w}, tmp_path / "m.safetensors")
    assert ingest_file(tmp_path / "m.safetensors", data_dir, "t", row_format=fmt, progress=False).number == 1


@pytest.mark.parametrize("fmt,big,ok", [("fp16", 65520.0, 65519.0), ("bf16", 3.3961775e38, 3.3961773e38)])
def test_finite_values_that_round_to_inf_are_refused(data_dir, fmt, big, ok):
    vals = np.zeros((4, 32), np.float32)
    vals[3, 7] = ok
    assert np.isfinite(decode_rows(encode_rows(vals, fmt), fmt, 32)).all()
    vals[3, 7] = -big
    with pytest.raises(InvalidArgument, match=f"row 3, column 7 rounds to inf in {fmt}"):
        encode_rows(vals, fmt)
    vals[3, 7] = np.inf  # fp32 stores it bit-exact: nothing is lost
    assert np.isinf(decode_rows(encode_rows(vals, "fp32"), "fp32", 32)[3, 7])


WRITER = """
import sys, numpy as np
from tierstore.ingest.writer import write_version
data, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
failed = 0
for i in range(n):
    try:
        write_version(data, name, [np.full((64, 16), i, np.uint8)], rows=64, row_format="fp32", row_dim=4)
    except Exception as e:
        failed += 1
        print(type(e).__name__, e, file=sys.stderr)
print(failed)
"""


def test_concurrent_writers_into_one_data_dir_all_succeed(data_dir):
    write_version(data_dir, "seed", [np.zeros((1, 16), np.uint8)], rows=1, row_format="fp32", row_dim=4)
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(data_dir), name, "25"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for name in ("a", "b", "a")]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [o[0].strip() for o in outs] == ["0", "0", "0"], [o[1][-2000:] for o in outs]
    with Catalog(data_dir, readonly=True) as cat:
        assert len(cat.versions("a")) == 50 and len(cat.versions("b")) == 25
    assert not list((data_dir / "tmp").iterdir())


def test_legacy_torch_files_and_foreign_zips_are_clear_errors(tmp_path, data_dir, cli):
    import zipfile

    torch.save({"w": torch.zeros(4, 8)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    with zipfile.ZipFile(tmp_path / "photos.zip", "w") as z:
        z.writestr("a.txt", "hello")
    for f, msg in (("old.pt", "legacy (pre-1.6) format"), ("photos.zip", "not a torch state dict")):
        code, _, err = cli("ingest", tmp_path / f, "--data", data_dir, "--table", "t", "--quiet")
        assert code == 2 and msg in err and "Traceback" not in err, err


def test_huge_block_rows_is_refused_before_any_allocation(tmp_path, data_dir, cli):
    with pytest.raises(InvalidArgument, match="at most 64 MiB"):  # 10^6 rows of 128 B: 23 TiB blocks
        write_version(data_dir, "t", iter(()), rows=10**6, row_format="fp32", row_dim=32, block_rows=10**11)
    assert not data_dir.exists()
    # a block larger than a small table is just the whole table
    np.save(tmp_path / "t.npy", np.zeros((2000, 58), np.float32))
    code, out, err = cli("ingest", tmp_path / "t.npy", "--data", data_dir, "--table", "t", "--quiet",
                         "--block-rows", "100000000000")
    assert code == 0, err
    with Catalog(data_dir, readonly=True) as cat:
        assert (cat.current("t").n_blocks, cat.current("t").block_rows) == (1, 2000)


def _unshare_ro():
    """argv prefix running a command with DATA mounted read-only, or None where we cannot."""
    import shutil

    if os.geteuid() != 0 or not shutil.which("unshare"):
        return None
    ok = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    return ["unshare", "-m", "sh", "-c"] if ok.returncode == 0 else None


def test_a_catalog_this_user_cannot_write_is_read_and_refused_for_ingest(tmp_path, data_dir, make_table):
    prefix = _unshare_ro()
    if prefix is None:
        pytest.skip("needs root and unshare -m for a read-only bind mount")
    make_table("t", rows=100)
    np.save(tmp_path / "t.npy", np.zeros((10, 4), np.float32))
    py = f"{sys.executable} -m tierstore"
    script = (f"mount --bind -o ro {data_dir} {data_dir} || exit 99; "
              f"{py} tables --data {data_dir} && {py} verify --data {data_dir} && "
              f"{py} ingest {tmp_path / 't.npy'} --data {data_dir} --table u --quiet; echo rc=$?")
    out = subprocess.run(prefix + [script], capture_output=True, text=True, timeout=300)
    if "rc=99" in out.stdout:
        pytest.skip("bind mounts are not allowed here")
    assert "t v1: ok" in out.stdout and "rc=2" in out.stdout, out.stdout + out.stderr
    assert "not writable by this user" in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize("chunk", [1, 7, 333, 4096])
def test_pipelined_write_is_bit_exact_across_blocks_and_segments(data_dir, monkeypatch, chunk):
    """Chunks that split checksum blocks and segments, from a source that reuses a
    ring of CHUNKS_IN_FLIGHT buffers (as row_chunks does): every row reads
    back as given, every block and row verifies."""
    from tierstore.ingest import writer

    monkeypatch.setattr(writer, "SEGMENT_BYTES", 64 << 10)  # 240-row segments: the table spans 38
    rows = 9_001
    data = np.random.default_rng(chunk).integers(0, 256, (rows, 264), dtype=np.uint8)
    ring = [np.empty((chunk, 264), np.uint8) for _ in range(writer.CHUNKS_IN_FLIGHT)]

    def source():
        for i, a in enumerate(range(0, rows, chunk)):
            buf = ring[i % len(ring)][:min(chunk, rows - a)]
            buf[:] = data[a:a + len(buf)]
            yield buf

    tv = write_version(data_dir, "t", source(), rows=rows, row_format="fp8-e4m3-ue8m0", row_dim=256)
    assert len(tv.segments) > 10
    with Catalog(data_dir, readonly=True) as cat, SegmentReader(data_dir, tv, cat.checksums("t", 1)) as r:
        assert r.verify() == []
        assert np.array_equal(r.read_range(0, rows), data)
        ids = np.random.default_rng(1).integers(0, rows, 500)
        assert np.array_equal(r.read_rows(ids), data[ids])
