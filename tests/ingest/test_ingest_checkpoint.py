"""`tierstore ingest-checkpoint` on a tiny checkpoint with DeepSeek-V4.1's exact layout:
rows served by a real sidecar are bit-exact with embed.weight || embed.scale of the
shard; `tierstore hash` ids match ids computed from config.json alone; malformed
checkpoints are refused naming file and tensor, leaving the data directory as it was."""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from v41_checkpoint import IMAGE_TOKEN, INDEX, edit_json, write_checkpoint, write_safetensors  # noqa: E402

from tierstore.store.catalog import Catalog
from tierstore.cli import main
from tierstore.client.client import Client
from tierstore.sidecar.launcher import SidecarProcess


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("v41")
    write_checkpoint(d)
    return d


@pytest.fixture(scope="module")
def ingested(ckpt, tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    assert main(["ingest-checkpoint", str(ckpt), "--data", str(data), "--quiet"]) == 0
    return data


@pytest.fixture(scope="module")
def client(ingested):
    with SidecarProcess(ingested, dram_budget="64MiB") as sc, Client(sc.socket) as c:
        yield c


def shard_rows(ckpt: Path, layer: int) -> np.ndarray:
    """weight || scale of a layer, read with the safetensors library (an independent reader)."""
    from safetensors import safe_open

    wm = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    name = f"layers.{layer}.engram.embed."
    with safe_open(str(ckpt / wm[name + "weight"]), "pt") as f:
        w = f.get_tensor(name + "weight").view(torch.uint8).numpy()
        s = f.get_tensor(name + "scale").view(torch.uint8).numpy()
    return np.concatenate([w, s], axis=1)


def hash_from_config(cfg_path: Path, layer: int, ids: list[int]) -> np.ndarray:
    """Row ids from config.json alone, written out plainly (no tierstore code)."""
    t = json.loads(cfg_path.read_text())["text_config"]
    N, K, C, pad = t["engram_max_ngram_size"], t["engram_n_heads"], t["engram_compressed_vocab_size"], 2
    image = json.loads(cfg_path.read_text())["image_token_id"]

    def prime(n):
        return n > 1 and all(n % p for p in range(2, int(n ** 0.5) + 1))
    seen, primes = set(), {}
    for L in t["engram_layer_ids"]:
        primes[L] = []
        for _ in range(N - 1):
            cur = t["engram_vocab_size"] - 1
            for _ in range(K):
                cur += 1
                while not prime(cur) or cur in seen:
                    cur += 1
                seen.add(cur)
                primes[L].append(cur)
    mult = np.random.default_rng(10007 * layer).integers(0, max(1, (2 ** 63 - 1) // C // 2), N, dtype=np.int64) * 2 + 1
    P = primes[layer]
    off = np.concatenate([[0], np.cumsum(P)[:-1]])
    out = []
    for pos in range(len(ids)):
        row, mix, blocked = [], 0, False
        for s in range(N):
            blocked |= pos - s < 0 or ids[pos - s] == image
            mix ^= (pad if blocked else ids[pos - s]) * int(mult[s])
            if s:
                row += [mix % P[(s - 1) * K + k] + off[(s - 1) * K + k] for k in range(K)]
        out.append(row)
    return np.asarray(out)


def test_tables_per_layer_with_spec_from_config(ingested):
    with Catalog(ingested, readonly=True) as cat:
        assert cat.tables() == ["l1", "l3"]
        tv = cat.current("l1")
    assert (tv.row_bytes, tv.row_format, tv.layer_id) == (264, "fp8-e4m3-ue8m0", 1)
    assert tv.spec["rms_norm_eps"] == 1e-20 and tv.spec["image_token_id"] == IMAGE_TOKEN
    assert tv.rows % 2 == 1  # a sum of 9 odd primes: a multiple of nothing convenient


def test_rows_served_by_sidecar_are_bit_exact_with_the_shard(ckpt, client, capsys):
    ids = [5, 17, 3, IMAGE_TOKEN, 4, 4, 498, 0, 1, 2]
    for L in (1, 3):
        want = shard_rows(ckpt, L)
        capsys.readouterr()
        assert main(["hash", "--checkpoint", str(ckpt), "--layer", str(L),
                     "--ids", ",".join(map(str, ids))]) == 0
        got = json.loads(capsys.readouterr().out)
        hashed = np.asarray(got["ids"])
        assert got["table"] == f"l{L}"
        assert np.array_equal(hashed, hash_from_config(ckpt / "config.json", L, ids))
        every = np.arange(len(want))
        for inline in (True, False):
            assert np.array_equal(client.lookup(got["table"], hashed.reshape(-1), inline=inline),
                                  want[hashed.reshape(-1)])
        assert np.array_equal(client.lookup(got["table"], every, inline=True), want)


@torch.no_grad()
def test_v41_layer_served_by_sidecar_equals_layer_on_shard_rows(ckpt, client):
    """README's model-side recipe: spec from config.json, layers from the checkpoint, rows from the sidecar."""
    from tierstore.client import InProcessTable, NgramHasher
    from tierstore.table.hf_config import spec_from_config
    from tierstore.client.model.v41_layer import V41EngramLayer

    spec = spec_from_config(ckpt)
    hasher = NgramHasher(spec)
    raw = np.random.default_rng(3).integers(0, 500, (2, 12))
    raw[1, 4] = IMAGE_TOKEN
    dead = hasher.dead_mask(raw)
    rows = hasher.hash_all(hasher.check_ids(raw), dead=dead)
    h = torch.randn(2, 12, spec.hc_mult, spec.hidden_size, generator=torch.Generator().manual_seed(0))
    local = InProcessTable(spec)
    for L in spec.layer_ids:
        local.add(f"l{L}", shard_rows(ckpt, L), row_format=spec.row_format, row_dim=spec.row_dim)
    want = {L: V41EngramLayer.from_checkpoint(ckpt, L, source=local)(h, rows[L], dead=dead) for L in spec.layer_ids}
    engram = {L: V41EngramLayer.from_checkpoint(ckpt, L, source=client) for L in spec.layer_ids}
    for L, layer in engram.items():
        layer.prepare(rows[L], dead=dead)
    got = {L: engram[L](h) for L in spec.layer_ids}
    for L in spec.layer_ids:
        assert torch.equal(got[L], want[L])
        assert torch.equal(got[L][1, 4], h[1, 4])


def test_rerun_skips_same_bytes_and_force_writes_a_new_version(ckpt, tmp_path):
    data = tmp_path / "d"
    assert main(["ingest-checkpoint", str(ckpt), "--data", str(data), "--quiet", "--layers", "3"]) == 0
    assert main(["ingest-checkpoint", str(ckpt), "--data", str(data), "--quiet"]) == 0
    with Catalog(data, readonly=True) as cat:
        assert [cat.current(t).number for t in ("l1", "l3")] == [1, 1]
    assert main(["ingest-checkpoint", str(ckpt), "--data", str(data), "--quiet", "--force", "--layers", "1"]) == 0
    with Catalog(data, readonly=True) as cat:
        assert cat.current("l1").number == 2


def test_interrupted_ingest_leaves_the_old_version_current(ckpt, tmp_path, monkeypatch):
    from tierstore.ingest import checkpoint

    data = tmp_path / "d"
    assert main(["ingest-checkpoint", str(ckpt), "--data", str(data), "--quiet", "--layers", "1"]) == 0
    before = _snapshot(data)
    calls = {"n": 0}
    real = checkpoint.TensorRows.read

    def dying(self, first_row, n):
        calls["n"] += 1
        if calls["n"] > 2:
            raise KeyboardInterrupt  # killed mid-table
        return real(self, first_row, n)
    monkeypatch.setattr(checkpoint.TensorRows, "read", dying)
    with pytest.raises(KeyboardInterrupt):
        from tierstore.ingest.checkpoint import ingest_checkpoint
        ingest_checkpoint(ckpt, data, force=True, progress=False, chunk_bytes=64 << 10)
    monkeypatch.undo()
    assert _snapshot(data) == before  # staging removed, v1 of l1 current, no l3
    assert main(["ingest-checkpoint", str(ckpt), "--data", str(data), "--quiet"]) == 0  # resumes
    with Catalog(data, readonly=True) as cat:
        assert (cat.current("l1").number, cat.current("l3").number) == (1, 1)


def test_each_version_records_its_tensors_shards_headers_and_digests(ckpt, ingested):
    """What the engines compare a checkpoint with: each Engram tensor's shard (size, mtime, inode,
    ctime), its header entry, and an xxh3-128 of its bytes (hashed as ingest read them; here
    against the bytes read apart, with the safetensors library)."""
    import xxhash

    from tierstore.table.checkpoint import TensorSource

    with Catalog(ingested, readonly=True) as cat:
        for L in (1, 3):
            rec = cat.current(f"l{L}").checkpoint_record()
            rows = shard_rows(ckpt, L)
            for which, cols in (("weight", slice(0, 256)), ("scale", slice(256, 264))):
                r = rec[which]
                st = os.stat(r.file)
                assert Path(r.file).parent == ckpt and r.tensor == f"layers.{L}.engram.embed.{which}"
                assert (r.size, r.mtime_ns, r.ino, r.ctime_ns) == (st.st_size, st.st_mtime_ns, st.st_ino,
                                                                   st.st_ctime_ns)
                assert (r.dtype, r.shape) == ({"weight": "F8_E4M3", "scale": "F8_E8M0"}[which], rows[:, cols].shape)
                assert r.xxh3_128 == xxhash.xxh3_128(np.ascontiguousarray(rows[:, cols])).hexdigest()
                assert TensorSource.at(r.file, r.offset) == TensorSource(**{**r.__dict__, "xxh3_128": None})


def test_a_rerun_ingests_again_a_layer_whose_shard_was_touched_or_recorded_nothing(ckpt, tmp_path):
    """The skip holds only while the record matches the shards as they are: a touch (the same bytes,
    a new mtime), a chmod (a new ctime), or a version that recorded no tensors (ingested before
    records were kept: its record dropped here) ingests the layer again."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "store"))
    from test_catalog import _tamper

    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    data = tmp_path / "d"
    args = ["ingest-checkpoint", str(copy), "--data", str(data), "--quiet", "--layers", "1"]
    shard = copy / json.loads((copy / INDEX).read_text())["weight_map"]["layers.1.engram.embed.weight"]

    def current() -> int:
        assert main(args) == 0
        with Catalog(data, readonly=True) as cat:
            return cat.current("l1").number
    assert [current(), current()] == [1, 1]
    os.utime(shard)
    assert [current(), current()] == [2, 2]
    os.chmod(shard, 0o640)
    assert [current(), current()] == [3, 3]
    _tamper(data, "l1", 3, {"checkpoint": None})
    with Catalog(data, readonly=True) as cat:  # what the source note of an older ingest still tells
        assert set(cat.current("l1").checkpoint_record()) == {"weight"}
    assert [current(), current()] == [4, 4]


def test_a_shard_written_while_it_is_read_commits_nothing(ckpt, tmp_path, monkeypatch):
    """The digest would not be the file's: the shard's stat after the read is not the one before it."""
    from tierstore.errors import SpecMismatch
    from tierstore.ingest import checkpoint
    from tierstore.ingest.checkpoint import ingest_checkpoint

    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    real = checkpoint.TensorRows.read

    def writer_meanwhile(self, first_row, n):
        if first_row:
            os.utime(self.ref.path, ns=(0, self.stat.st_mtime_ns + 1))
        return real(self, first_row, n)
    monkeypatch.setattr(checkpoint.TensorRows, "read", writer_meanwhile)
    with pytest.raises(SpecMismatch, match=r"model-00002-of-00003.safetensors:layers.1.engram.embed.weight: the "
                                           r"shard changed while it was ingested .* ingest again"):
        ingest_checkpoint(copy, tmp_path / "d", layers=[1], progress=False, chunk_bytes=64 << 10)
    assert _snapshot(tmp_path / "d") == {"current": {}}  # no table, no file left


def _snapshot(data: Path) -> dict:
    out = {}
    for p in sorted(data.rglob("*")):
        if p.is_file() and p.parent.name != "catalog":
            out[str(p.relative_to(data))] = p.stat().st_size
    if (data / "catalog").exists():
        with Catalog(data, readonly=True) as cat:
            out["current"] = {t: cat.current(t).number for t in cat.tables()}
    return out


def _drop_tensor(d: Path, name: str) -> None:
    from safetensors import safe_open

    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    path = d / wm[name]
    tensors = {}
    with safe_open(str(path), "pt") as f:
        for k in f.keys():
            if k != name:
                t = f.get_tensor(k)
                dt = {torch.float8_e4m3fn: "F8_E4M3", torch.float8_e8m0fnu: "F8_E8M0", torch.bfloat16: "BF16"}[t.dtype]
                tensors[k] = (dt, list(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
    write_safetensors(path, tensors)


def _no_scale(d):
    _drop_tensor(d, "layers.3.engram.embed.scale")


def _no_scale_in_index(d):
    edit_json(d / INDEX, lambda idx: idx["weight_map"].pop("layers.3.engram.embed.scale"))


def _wrong_rows(d):
    def edit(cfg):
        cfg["text_config"]["engram_num_embeddings"][1] += 1
    edit_json(d / "config.json", edit)


def _wrong_tensor_rows(d):
    write_checkpoint(d, engram_vocab_size=690)  # tensors of other primes ...
    shutil.copy(d.parent / "orig_config.json", d / "config.json")  # ... under the original config


def _truncated(d):
    path = d / "model-00003-of-00003.safetensors"
    os.truncate(path, path.stat().st_size - 100)


def _no_engram_fields(d):
    edit_json(d / "config.json", lambda cfg: cfg.update(
        text_config={k: v for k, v in cfg["text_config"].items() if not k.startswith("engram_")}))


def _edit_header(d: Path, edit, shard: str = "model-00003-of-00003.safetensors") -> None:
    """Rewrite a shard's header with edit(header) applied; the tensor bytes stay as they were."""
    import struct

    raw = (d / shard).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (d / shard).write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def _overlapping(d):
    def edit(h):  # embed.scale's bytes said to start inside embed.weight's (sizes still right)
        w, s = h["layers.3.engram.embed.weight"], h["layers.3.engram.embed.scale"]
        size = s["data_offsets"][1] - s["data_offsets"][0]
        s["data_offsets"] = [w["data_offsets"][0] + 8, w["data_offsets"][0] + 8 + size]
    _edit_header(d, edit)


def _fractional(d):
    def edit(h):
        w = h["layers.3.engram.embed.weight"]
        w["data_offsets"] = [w["data_offsets"][0] + 0.5, w["data_offsets"][1]]
    _edit_header(d, edit)


def _reversed(d):
    def edit(h):
        q = h["layers.3.engram.q_weight"]
        q["data_offsets"] = q["data_offsets"][::-1]
    _edit_header(d, edit)


def _bytes_after_the_tensors(d):
    with open(d / "model-00003-of-00003.safetensors", "ab") as f:
        f.write(b"\0" * 64)


def _nested_header(d):
    raw = b'{"layers.3.engram.q_weight": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    (d / "model-00003-of-00003.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)


def _nested_index(d):
    (d / "model.safetensors.index.json").write_text('{"weight_map": ' + "[" * 200_000 + "]" * 200_000 + "}")


def _nested_config(d):
    (d / "config.json").write_text('{"text_config": ' + "{\"a\": " * 100_000 + "1" + "}" * 100_001)


def _huge_config(d):
    (d / "config.json").write_text(json.dumps({"pad": " " * (5 << 20)}))


def _weight_map_as(value):
    return lambda d: edit_json(d / INDEX, lambda idx: idx.update(weight_map=value))


@pytest.mark.parametrize("breaks, names", [
    (_nested_header, r"model-00003-of-00003\.safetensors: not a safetensors file \(JSON nested 200001 levels deep, "
                     r"over the limit of 64\)"),
    (_nested_index, r"model\.safetensors\.index\.json: .*JSON nested 200001 levels deep, over the limit of 64"),
    (_nested_config, r"config\.json: .*JSON nested 100001 levels deep, over the limit of 64"),
    (_huge_config, r"config\.json: .*over the 4 MiB limit"),
    (_weight_map_as([1, 2]), r"model\.safetensors\.index\.json: weight_map is a JSON array, not an object"),
    (_weight_map_as("x"), r"model\.safetensors\.index\.json: weight_map is a JSON string, not an object"),
    (_weight_map_as({"layers.1.engram.embed.weight": 7}), r"weight_map\['layers\.1\.engram\.embed\.weight'\] is "
                                                          r"a JSON number, not a shard file name"),
], ids=["nested-header", "nested-index", "nested-config", "huge-config", "weight-map-list", "weight-map-string",
        "weight-map-number"])
def test_nested_huge_or_mistyped_json_is_refused_naming_file_and_limit(ckpt, ingested, tmp_path, capsys, breaks,
                                                                      names):
    test_malformed_checkpoint_refused_naming_file_and_tensor(ckpt, ingested, tmp_path, capsys, breaks, names)


@pytest.mark.parametrize("breaks, names", [
    (_no_scale, r"model-00003-of-00003\.safetensors.*layers\.3\.engram\.embed\.scale"),
    (_no_scale_in_index, r"model\.safetensors\.index\.json.*layers\.3\.engram\.embed\.scale"),
    (_wrong_rows, r"config\.json.*engram_num_embeddings.*layer 3"),
    (_wrong_tensor_rows, r"model-00002-of-00003\.safetensors:layers\.1\.engram\.embed\.weight.*\[\d+, 256\]"),
    (_truncated, r"model-00003-of-00003\.safetensors:layers\.3\.engram\.\S+ .*truncated"),
    (_no_engram_fields, r"config\.json: no engram_layer_ids"),
    (_overlapping, r"model-00003-of-00003\.safetensors: .*layers\.3\.engram\.embed\.(weight|scale).*overlap"),
    (_fractional, r"model-00003-of-00003\.safetensors:layers\.3\.engram\.embed\.weight: data_offsets.*integers"),
    (_reversed, r"model-00003-of-00003\.safetensors:layers\.3\.engram\.q_weight: data_offsets.*begin"),
    (_bytes_after_the_tensors, r"model-00003-of-00003\.safetensors: 64 bytes after the last tensor"),
], ids=["missing-scale", "missing-in-index", "wrong-row-count", "wrong-tensor-rows", "truncated", "no-engram-config",
        "overlapping-offsets", "fractional-offset", "reversed-offsets", "bytes-after-the-tensors"])
def test_malformed_checkpoint_refused_naming_file_and_tensor(ckpt, ingested, tmp_path, capsys, breaks, names):
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    shutil.copy(ckpt / "config.json", tmp_path / "orig_config.json")
    breaks(bad)
    data = tmp_path / "data"
    shutil.copytree(ingested, data)
    before = _snapshot(data)
    capsys.readouterr()
    assert main(["ingest-checkpoint", str(bad), "--data", str(data), "--quiet", "--force"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(names, err), err
    assert _snapshot(data) == before


def test_a_fifo_as_a_shard_is_refused_not_waited_on(ckpt, ingested, tmp_path):
    """Opening a FIFO for reading waits for a writer: the shard is checked to be a file first."""
    import subprocess

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    (bad / "model-00003-of-00003.safetensors").unlink()
    os.mkfifo(bad / "model-00003-of-00003.safetensors")
    data = tmp_path / "data"
    shutil.copytree(ingested, data)
    before = _snapshot(data)
    try:
        done = subprocess.run([sys.executable, "-m", "tierstore", "ingest-checkpoint", str(bad), "--data", str(data),
                               "--quiet", "--force"], capture_output=True, text=True, timeout=60, cwd="/")
    except subprocess.TimeoutExpired:  # run() has killed it
        pytest.fail("ingest-checkpoint waited on the FIFO")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert re.search(r"model-00003-of-00003\.safetensors: not a regular file \(a FIFO\)", done.stderr), done.stderr
    assert _snapshot(data) == before


def test_a_hugging_face_cache_snapshot_linking_into_its_blobs_is_read(ckpt, tmp_path):
    """The hub cache keeps files in `<repo>/blobs/` and links `<repo>/snapshots/<rev>/<name>` to
    them: that layout is the one place a checkpoint's files may resolve outside its directory."""
    repo = tmp_path / "models--deepseek-ai--tiny"
    snap, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in ckpt.iterdir():
        shutil.copy(f, blobs / f"sha-{f.name}")
        os.symlink(f"../../blobs/sha-{f.name}", snap / f.name)
    data = tmp_path / "data"
    assert main(["ingest-checkpoint", str(snap), "--data", str(data), "--quiet"]) == 0
    with Catalog(data, readonly=True) as cat:
        assert sorted(cat.tables()) == ["l1", "l3"]


@pytest.mark.slow
def test_memory_stays_bounded_whatever_the_shard_size(tmp_path):
    """Peak RSS growth during ingest is the pipeline's chunk buffers (~8 x 16 MiB), not the table
    (~500 MB). The compiled row-sum kernel (numba, loaded once per process) is loaded first."""
    import subprocess

    from v41_checkpoint import write_big_checkpoint

    rows = write_big_checkpoint(tmp_path / "ck", 210_000)
    assert rows * 264 > 450e6
    code = ("import sys, re\n"
            "from tierstore.ingest.checkpoint import ingest_checkpoint\n"
            "import tierstore.ingest.writer, tqdm, numpy as np\n"
            "from tierstore.tiers.nvme import rowsum\n"
            "rowsum.row_sums(np.zeros((1 << 13, 264), np.uint8), np.arange(1 << 13), rowsum.RowKey.of(0))\n"
            "hwm = lambda: int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
            "before = hwm()\n"
            "ingest_checkpoint(sys.argv[1], sys.argv[2], progress=False)\n"
            "print(before, hwm())\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ck"), str(tmp_path / "d")],
                         capture_output=True, text=True, check=True).stdout.split()
    before, after = int(out[0]), int(out[1])
    assert (after - before) * 1024 < 160 << 20, (before, after)


@pytest.mark.parametrize("cache", ["cold", "warm"])
def test_segments_sums_and_checksums_equal_a_golden_of_the_reference_path(ckpt, tmp_path, monkeypatch, cache):
    """What an ingest writes, byte for byte, is what the reference path makes of the shard's
    rows: the packed rows (weight || scale, read with the safetensors library), each followed
    by its numpy-reference sum under the version's salt; the catalog's block checksums are
    xxh3 of those bytes' blocks. Chunks of ~4.5k rows (the compiled pass) and their
    remainders (numpy) split checksum blocks and segments. A shard out of the page cache
    is read with O_DIRECT (where the filesystem has it), one in it with pread: same bytes."""
    import xxhash

    from tierstore.ingest import checkpoint, writer
    from tierstore.ingest.checkpoint import evict_from_page_cache, ingest_checkpoint
    from tierstore.table.checkpoint import Checkpoint
    from tierstore.tiers.nvme import rowsum

    ck = shutil.copytree(ckpt, tmp_path / "ck")
    refs = [r for L in (1, 3) for r in Checkpoint(ck).engram_tensors(L).values()]
    for r in refs:
        with open(r.path, "rb") as f:
            os.fsync(f.fileno())  # written back, so that eviction takes
    if cache == "cold":
        evict_from_page_cache(refs)
    else:
        for r in refs:
            r.path.read_bytes()
    direct = []
    real = checkpoint.TensorRows.__init__

    def spy(self, *a):
        real(self, *a)
        direct.append(self.direct)
    monkeypatch.setattr(checkpoint.TensorRows, "__init__", spy)
    monkeypatch.setattr(writer, "SEGMENT_BYTES", 256 << 10)
    done = ingest_checkpoint(ck, tmp_path / "d", progress=False, chunk_bytes=1_200_000)
    try:
        os.close(os.open(refs[0].path, os.O_RDONLY | os.O_DIRECT))
        has_direct = True
    except OSError:
        has_direct = False
    assert direct == [cache == "cold" and has_direct] * 4
    for tv, skipped in done:
        rows = shard_rows(ckpt, tv.layer_id)
        ids = np.arange(len(rows), dtype=np.int64)
        sums = rowsum.row_sums(rows, ids, rowsum.RowKey.of(tv.row_salt), compiled=False)
        golden = np.concatenate([rows, sums.astype("<u8").view(np.uint8).reshape(-1, 8)], axis=1).tobytes()
        assert not skipped and tv.segment_format == 2 and len(tv.segments) > 3
        assert (tv.rows, tv.row_bytes, tv.block_rows) == (len(rows), 264, 4096 // 272)
        on_disk = b"".join((tmp_path / "d" / seg).read_bytes() for seg in tv.segments)
        assert on_disk == golden
        bb = tv.block_rows * 272
        with Catalog(tmp_path / "d", readonly=True) as cat:
            got = cat.checksums(tv.table, tv.number)
        assert got.tolist() == [xxhash.xxh3_64_intdigest(golden[i:i + bb]) for i in range(0, len(golden), bb)]


def test_compare_read_times_a_plain_read_and_a_plain_copy_in_the_same_run(ckpt, tmp_path, capsys):
    """--compare-read reports ingest against a plain read and against a plain copy (read,
    write, fsync) of the same bytes; the copy's file is gone afterwards, and --drop-cache
    (evicting the shards before each timed pass) is taken."""
    data = tmp_path / "d"
    args = ["ingest-checkpoint", str(ckpt), "--data", str(data), "--quiet", "--compare-read", "--drop-cache"]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for what in ("read", "copy"):
        secs = out[f"plain_{what}_seconds"]
        assert secs > 0
        # seconds are rounded to 6 decimals (a small checkpoint's read is under a millisecond: it
        # came out 0.0 at 3), ratios to 3: the ratio lies within what those roundings allow
        lo = max(secs - 5e-4, 0) / (out["seconds"] + 5e-4) - 5e-4
        hi = (secs + 5e-4) / max(out["seconds"] - 5e-4, 1e-9) + 5e-4
        assert lo <= out[f"speed_vs_plain_{what}"] <= hi, (out, what)
    assert [p.name for p in (data / "tmp").iterdir()] == []
    assert main(args + ["--force"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"plain read of the same bytes [\d.]+ s -> [\d.]+x, plain copy \(read, write, fsync\) "
                     r"[\d.]+ s -> [\d.]+x", err), err
    assert [p.name for p in (data / "tmp").iterdir()] == []


def test_compare_read_on_a_full_disk_is_a_clear_error_that_leaves_nothing(ckpt, tmp_path, tierstore_full_disk):
    data = tmp_path / "d"
    out = tierstore_full_disk(256 << 10, "ingest-checkpoint", ckpt, "--data", data, "--quiet", "--compare-read")
    assert out.returncode == 1, out.stderr
    assert "disk full while timing a plain copy" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert [p.name for p in (data / "tmp").iterdir()] == []
    assert not (data / "tables").exists()
