"""A Hugging Face checkpoint directory, read the way DeepSeek-V4.1 lays it out.

config.json (Engram fields under text_config) + model.safetensors.index.json
(tensor name -> shard, names without a `model.` prefix) + shards. Per Engram
layer L six tensors, `layers.{L}.engram.`:

    embed.weight  F8_E4M3 [rows, head_dim]      the fused table (24 prime segments)
    embed.scale   F8_E8M0 [rows, head_dim/32]   weight || scale = the packed row
    wkv.weight    F8_E4M3 [(hc+1)*hidden, columns*head_dim]   4 keys + 1 value
    wkv.scale     F8_E8M0 [ceil(out/32), ceil(in/32)]         32x32 blocks
    q_weight, k_weight  BF16 [hc, hidden]

Only safetensors headers are parsed here (8-byte length + JSON); tensor bytes
are located by offset and read with pread, so nothing is mapped and a 100 GB
shard costs no memory. A header is checked as the format defines it (and as
safetensors' own parser does) before any offset is used: integer offsets,
begin <= end, each tensor's size its shape times its dtype, and the tensors
tiling the data section exactly (no overlap, no gap, nothing past the end).
A shard is opened only once it is known to be a regular file. Every check
names the file and the tensor.

Every file read (config.json, the index, each shard) must lie inside the
checkpoint directory once `..` and symlinks are resolved: a shard's bytes
become served rows, so an index entry `../other/x.safetensors` (or a symlink
to it) would publish a file from elsewhere. The one exception is the Hugging
Face hub cache's own layout, `snapshots/<rev>/` whose files link into the
sibling `blobs/`. JSON (headers, index, config) is parsed with
tierstore.bounded_json's size and depth limits.

`TensorSource` is one tensor's identity as ingest read it (its shard's size,
mtime, inode and ctime, its header entry, an xxh3-128 digest of its bytes):
the table version records it (TableVersion.checkpoint), `ingest-checkpoint`
skips a layer whose files still match it, and the engines' check compares
the checkpoint an engine loads with it (client/engines/checks.py).
"""
from __future__ import annotations

import os
import stat
import struct
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import xxhash

from tierstore import bounded_json
from tierstore.errors import SpecMismatch

__all__ = ["Checkpoint", "TensorRef", "TensorSource", "INDEX_NAME", "open_shard", "read_header", "tensor_digest"]

INDEX_NAME = "model.safetensors.index.json"
# bits per element of each safetensors dtype
_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16,
         "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4,
         "F6_E2M3": 6, "F6_E3M2": 6}
_MAX_HEADER = 100 << 20  # safetensors' own limit
MAX_INDEX_BYTES = 64 << 20  # a 1T-parameter model's index is a few MB


def open_shard(path: Path) -> int:
    """A read-only fd of `path`, refused (SpecMismatch) unless it is a regular file.

    O_NONBLOCK: opening a FIFO for reading would wait for a writer, and reading
    one (or a device) would never end; the flag is cleared once it is a file.
    Raises FileNotFoundError when there is nothing at `path`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:  # ENXIO: a unix socket
        raise SpecMismatch(f"{path}: cannot open it as a shard ({e.strerror}); "
                           f"put the .safetensors file itself there") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a file")
        raise SpecMismatch(f"{path}: not a regular file ({kind}); put the .safetensors file itself there")
    os.set_blocking(fd, True)
    return fd


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor's bytes are: `nbytes` at absolute `offset` of `path`."""

    name: str
    path: Path
    dtype: str  # safetensors dtype name, e.g. "F8_E4M3"
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else 0

    def where(self) -> str:
        return f"{self.path.name}:{self.name}"

    def pread(self, out: np.ndarray, first_row: int = 0) -> np.ndarray:
        """Fill uint8 `out` with the bytes of rows first_row.. (as many as fit)."""
        flat = out.reshape(-1).view(np.uint8)
        start = self.offset + first_row * self.row_bytes
        got = 0
        fd = open_shard(self.path)
        try:
            while got < flat.nbytes:
                n = os.preadv(fd, [memoryview(flat)[got:]], start + got)
                if n == 0:
                    raise SpecMismatch(f"{self.where()}: the shard ends {flat.nbytes - got} bytes early "
                                       "(truncated download?); re-fetch the file")
                got += n
        finally:
            os.close(fd)
        return out

    def read(self) -> np.ndarray:
        """The whole tensor as uint8 [shape[0], row_bytes] (small tensors only)."""
        return self.pread(np.empty((self.shape[0], self.row_bytes), np.uint8))

    def torch(self):
        """The whole tensor as a torch tensor of its dtype (small tensors only)."""
        import torch

        dt = {"F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.uint8, "BF16": torch.bfloat16, "F16": torch.float16,
              "F32": torch.float32, "U8": torch.uint8}[self.dtype]
        return torch.from_numpy(self.read()).view(dt).reshape(self.shape)


def tensor_digest():
    """A new digest of a tensor's bytes, fed in order with update(buffer): xxh3-128, whose
    hexdigest() TensorSource records. It is computed as ingest's source stage reads the
    tensor, so its speed is the ingest's: xxh3 hashes at memory speed (and releases the GIL),
    where the standard library's cryptographic hashes (blake2b, sha256) would hold the source
    stage below an NVMe disk's speed. It guards against a changed checkpoint, not a forger
    (who could as well write the checkpoint's rows)."""
    return xxhash.xxh3_128()


@dataclass(frozen=True)
class TensorSource:
    """One checkpoint tensor as ingest read it: its shard (`file` as opened, `size` in bytes,
    `mtime_ns`, `ino` and `ctime_ns`), its header entry (`tensor` name, `dtype`, `shape`,
    absolute data `offset`) and `xxh3_128`, the hex tensor_digest() of its bytes.

    A record parsed from an older ingest's source note has file, tensor, size and mtime_ns
    only (the other fields None): `differences` then compares what it has.

    The ctime is the one stamp a user cannot set: an edit put back to its old size and mtime
    (`touch -r`, `os.utime`, `cp -p` over the file) moves it, as a copy (another inode) does."""

    file: str
    tensor: str
    size: int
    mtime_ns: int
    ino: int | None = None
    ctime_ns: int | None = None
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    offset: int | None = None
    xxh3_128: str | None = None

    @classmethod
    def of(cls, ref: TensorRef, st: os.stat_result, xxh3_128: str | None = None) -> "TensorSource":
        """Tensor `ref` of a shard whose os.stat is `st` (with its digest, where read)."""
        return cls(str(ref.path), ref.name, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns, ref.dtype,
                   tuple(ref.shape), ref.offset, xxh3_128)

    @classmethod
    def at(cls, path, position: int) -> "TensorSource | None":
        """The tensor whose data begins at byte `position` of shard `path` as it is now (its
        header read, the file stat'ed), or None where no tensor of the header begins there.
        Raises SpecMismatch for a file that is not a safetensors shard, OSError as os.stat."""
        st = os.stat(path)
        for ref in read_header(Path(path)).values():
            if ref.offset == position:
                return cls.of(ref, st)
        return None

    def differences(self, now: "TensorSource") -> tuple[list[str], list[str]]:
        """(changed, touched): what of `now` (the same tensor's shard as it is now) differs from
        this record, each as "what is now (ingest: what was)". changed: the shard's size or the
        tensor's header entry; the bytes may be anything. touched: only its mtime, inode or
        ctime; the bytes may be the same (a copy, a restore) or not (an edit)."""
        def diff(names):
            return [f"{n} {getattr(now, n)} (ingest: {getattr(self, n)})" for n in names
                    if getattr(self, n) is not None and getattr(now, n) != getattr(self, n)]
        return (diff(("size", "tensor", "dtype", "shape", "offset")), diff(("mtime_ns", "ino", "ctime_ns")))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shape"] = None if self.shape is None else list(self.shape)
        return d

    @classmethod
    def from_dict(cls, d) -> "TensorSource":
        """A record from its stored form (to_dict); ValueError naming the field where it is malformed."""
        names = {f.name for f in fields(cls)}
        if not isinstance(d, dict) or not {"file", "tensor", "size", "mtime_ns"} <= set(d) <= names:
            raise ValueError(f"a checkpoint tensor record has fields {sorted(names)}, got "
                             f"{sorted(d) if isinstance(d, dict) else type(d).__name__}")
        for k in ("size", "mtime_ns", "ino", "ctime_ns", "offset"):
            v = d.get(k)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise ValueError(f"checkpoint tensor record: {k} = {v!r} is not an integer")
        for k in ("file", "tensor", "dtype", "xxh3_128"):
            if d.get(k) is not None and not isinstance(d[k], str):
                raise ValueError(f"checkpoint tensor record: {k} = {d[k]!r} is not a string")
        shape = d.get("shape")
        if shape is not None and not (isinstance(shape, list) and all(_is_count(v) for v in shape)):
            raise ValueError(f"checkpoint tensor record: shape = {shape!r} is not a list of sizes")
        return cls(**{**d, "shape": None if shape is None else tuple(shape)})


class Checkpoint:
    """One checkpoint directory: its Engram spec and where every tensor lives.

    Raises SpecMismatch (naming file and tensor) for a missing config field,
    index entry, shard, tensor, a wrong dtype/shape, or a shard shorter than
    its header says."""

    def __init__(self, directory, name: str | None = None):
        from tierstore.table.hf_config import spec_from_config

        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise SpecMismatch(f"{self.dir}: not a directory; give the checkpoint directory (config.json, "
                               f"{INDEX_NAME}, shards)")
        self._roots = _roots(self.dir)
        self.spec = spec_from_config(self._file("config.json", "the checkpoint"), name)
        self._headers: dict[str, dict[str, TensorRef]] = {}
        self.weight_map = self._weight_map()

    def _file(self, name, named_by: str) -> Path:
        """Path of the checkpoint's file `name`, refused (SpecMismatch) unless it is a relative
        path that stays inside the checkpoint directory, symlinks resolved (module docstring)."""
        where = f"{self.dir / INDEX_NAME}: shard {name!r}" if named_by == INDEX_NAME else f"{self.dir}: {name!r}"
        if not isinstance(name, str) or not name or "\0" in name or Path(name).is_absolute():
            raise SpecMismatch(f"{where} is not a relative file name; an index names its shards relative to "
                               f"the checkpoint directory")
        path = self.dir / name
        real = Path(os.path.realpath(path))
        if not any(real.is_relative_to(r) for r in self._roots):
            raise SpecMismatch(f"{where} resolves to {real}, outside the checkpoint directory {self._roots[0]}; "
                               f"tierstore reads only files inside it: copy the shard into the directory (a "
                               f"checkpoint from an untrusted source may be trying to publish another file)")
        return path

    def _weight_map(self) -> dict[str, str]:
        index = self.dir / INDEX_NAME
        if index.is_file():
            index = self._file(INDEX_NAME, "the checkpoint")
            try:
                wm = bounded_json.loads(index.read_bytes(), max_bytes=MAX_INDEX_BYTES)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise SpecMismatch(f"{index}: not a safetensors index with a weight_map ({e}); "
                                   f"re-fetch the checkpoint's {INDEX_NAME}") from None
            if not isinstance(wm, dict):
                raise SpecMismatch(f"{index}: weight_map is a JSON {_json_type(wm)}, not an object of tensor name "
                                   f"-> shard file; re-fetch the checkpoint's {INDEX_NAME}")
            for k, v in wm.items():
                if not isinstance(v, str):
                    raise SpecMismatch(f"{index}: weight_map[{k!r}] is a JSON {_json_type(v)}, not a shard file "
                                       f"name; re-fetch the checkpoint's {INDEX_NAME}")
            for shard in set(wm.values()):
                self._file(shard, INDEX_NAME)
            return wm
        if (self.dir / "model.safetensors").is_file():
            single = self._file("model.safetensors", "the checkpoint").name
            return {k: single for k in self._header(single)}
        raise SpecMismatch(f"{self.dir}: no {INDEX_NAME} and no model.safetensors")

    def _header(self, shard: str) -> dict[str, TensorRef]:
        if shard not in self._headers:
            try:
                self._headers[shard] = read_header(self.dir / shard)
            except FileNotFoundError:
                raise SpecMismatch(f"{self.dir / shard}: shard named by {INDEX_NAME} is missing") from None
        return self._headers[shard]

    def tensor(self, name: str) -> TensorRef:
        """Locate tensor `name` (its shard's header checked, its bytes all in the shard)."""
        shard = self.weight_map.get(name)
        if shard is None:
            raise SpecMismatch(f"{self.dir / INDEX_NAME}: no tensor {name!r}; the checkpoint is incomplete")
        ref = self._header(shard).get(name)
        if ref is None:
            raise SpecMismatch(f"{self.dir / shard}: no tensor {name!r} although the index puts it in this shard")
        if ref.dtype not in _BITS:
            raise SpecMismatch(f"{ref.path}:{name}: unknown safetensors dtype {ref.dtype!r}")
        return ref

    def _expect(self, name: str, dtype: str, shape: tuple[int, ...]) -> TensorRef:
        ref = self.tensor(name)
        if ref.dtype != dtype or ref.shape != shape:
            raise SpecMismatch(f"{ref.path}:{name} is {ref.dtype} {list(ref.shape)}; config.json says it must be "
                               f"{dtype} {list(shape)}")
        return ref

    def engram_tensors(self, layer_id: int) -> dict[str, TensorRef]:
        """The six Engram tensors of one layer, checked against the spec:
        {'weight', 'scale', 'wkv', 'wkv_scale', 'q_weight', 'k_weight'}."""
        s = self.spec
        try:
            rows = s.rows(layer_id)
        except KeyError as e:
            raise SpecMismatch(f"{self.dir / 'config.json'}: {e.args[0]}") from None
        p = f"layers.{layer_id}.engram."
        D, hc, E = s.hidden_size, s.hc_mult, s.columns * s.row_dim
        out_f = (hc + 1) * D
        return {
            "weight": self._expect(p + "embed.weight", "F8_E4M3", (rows, s.row_dim)),
            "scale": self._expect(p + "embed.scale", "F8_E8M0", (rows, s.row_dim // 32)),
            "wkv": self._expect(p + "wkv.weight", "F8_E4M3", (out_f, E)),
            "wkv_scale": self._expect(p + "wkv.scale", "F8_E8M0", (-(-out_f // 32), -(-E // 32))),
            "q_weight": self._expect(p + "q_weight", "BF16", (hc, D)),
            "k_weight": self._expect(p + "k_weight", "BF16", (hc, D)),
        }

    def table_name(self, layer_id: int, prefix: str = "") -> str:
        return f"{prefix}l{layer_id}"


def read_header(path: Path) -> dict[str, TensorRef]:
    """Every tensor of safetensors file `path` (name -> TensorRef), the header checked as a whole.

    Raises SpecMismatch (naming file and tensor) for a file that is not regular or
    a header the format refuses; FileNotFoundError when `path` does not exist."""
    fd = open_shard(path)
    try:
        with os.fdopen(fd, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > _MAX_HEADER:
                raise ValueError(f"header length {n} is over safetensors' {_MAX_HEADER >> 20} MiB limit")
            head = bounded_json.loads(f.read(n), max_bytes=_MAX_HEADER)
            size = os.fstat(f.fileno()).st_size
    except (OSError, ValueError, struct.error) as e:
        raise SpecMismatch(f"{path}: not a safetensors file ({e}); re-fetch it or re-export it with "
                           f"safetensors") from None
    return _tensor_refs(path, head, 8 + n, size)


def _tensor_refs(path: Path, head, data_start: int, file_size: int) -> dict[str, TensorRef]:
    """The tensors of a parsed safetensors header, refused (SpecMismatch) unless the header
    is one the format allows: a read through a bad offset would ingest other bytes as rows."""
    if not isinstance(head, dict):
        raise SpecMismatch(f"{path}: not a safetensors file (its header is not a JSON object)")
    refs = []
    for name, meta in head.items():
        if name == "__metadata__":
            continue
        where = f"{path}:{name}"
        if not isinstance(meta, dict):
            raise SpecMismatch(f"{where}: malformed header entry (not an object)")
        offsets, shape, dtype = meta.get("data_offsets"), meta.get("shape"), meta.get("dtype")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(v) for v in offsets)):
            raise SpecMismatch(f"{where}: data_offsets must be two integers [begin, end] >= 0, got {offsets!r}; "
                               f"the shard is malformed (re-export it with safetensors)")
        if not (isinstance(shape, list) and all(_is_count(v) for v in shape)) or not isinstance(dtype, str):
            raise SpecMismatch(f"{where}: malformed header entry (dtype {dtype!r}, shape {shape!r})")
        a, b = offsets
        if a > b:
            raise SpecMismatch(f"{where}: data_offsets {offsets}: begin is after end; the shard is malformed")
        if dtype in _BITS:  # an unknown dtype is refused only if its tensor is read (tensor())
            bits = int(np.prod(shape, dtype=object)) * _BITS[dtype]
            if bits % 8 or b - a != bits // 8:
                want = f"{bits // 8} expected" if bits % 8 == 0 else f"{bits} bits expected, not whole bytes"
                raise SpecMismatch(f"{where}: header says {b - a} bytes for {dtype} {shape} ({want})")
        refs.append(TensorRef(name, path, dtype, tuple(shape), data_start + a, b - a))
    # the format: tensors tile the data section, in offset order, with nothing over, between or after
    end, prev = 0, None
    for r in sorted(refs, key=lambda r: (r.offset, r.nbytes)):
        a = r.offset - data_start
        if a < end:
            raise SpecMismatch(f"{path}: tensors {prev.name} and {r.name} overlap (data_offsets "
                               f"[{prev.offset - data_start}, {end}] and [{a}, {a + r.nbytes}]); the shard is "
                               f"malformed (re-export it with safetensors)")
        if a > end:
            raise SpecMismatch(f"{path}: {a - end} bytes {'after ' + prev.name if prev else 'at the start'} and "
                               f"before {r.name} belong to no tensor; the shard is malformed")
        if r.offset + r.nbytes > file_size:
            raise SpecMismatch(f"{path}:{r.name}: the shard is truncated ({file_size} bytes, the tensor ends at "
                               f"{r.offset + r.nbytes}); re-fetch the file")
        end, prev = a + r.nbytes, r
    if data_start + end < file_size:
        raise SpecMismatch(f"{path}: {file_size - data_start - end} bytes after the last tensor belong to no "
                           f"tensor; the shard is malformed (or not the file its header describes); re-fetch it")
    return {r.name: r for r in refs}


def _roots(directory: Path) -> tuple[Path, ...]:
    """The directories a checkpoint's files may resolve into: its own, and for a
    Hugging Face hub cache snapshot (`<repo>/snapshots/<rev>`) the repo's `blobs/`."""
    real = Path(os.path.realpath(directory))
    blobs = real.parent.parent / "blobs"
    return (real, blobs) if real.parent.name == "snapshots" and blobs.is_dir() else (real,)


def _json_type(v) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(v), "number")


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0
