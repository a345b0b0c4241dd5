"""Writing table versions: stream rows to segment files, then commit atomically.

A version is written into a private staging directory under DATA/tmp (locked
with flock while its writer lives), fsynced, read back against its checksums,
then moved into place and made current in one catalog transaction. Until that
transaction commits, readers see the previous version; a killed writer leaves
only a staging directory that the next writer removes.

`ingest_file` turns one tensor of a checkpoint (safetensors, .npy, torch state
dict) into row chunks, read slice by slice so memory stays bounded.
"""
from __future__ import annotations

import errno
import fcntl
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterable

import numpy as np
import xxhash

from tierstore.catalog import (LOCK_NAME, Catalog, TableVersion, _fsync_dir, private_dirs, staging_guard,
                               validate_table_name)
from tierstore.errors import DataLoss, InvalidArgument, ResourceExhausted, SpecMismatch
from tierstore.formats import RowFormat
from tierstore.tiers import rowsum
from tierstore.tiers.nvme import SegmentReader, default_block_rows

__all__ = ["write_version", "ingest_file", "SEGMENT_BYTES"]

# Segments are capped at ~1 GiB so a 98 GB layer is ~100 files that copy,
# rsync and checksum in pieces; reads never cross a segment (whole blocks each).
SEGMENT_BYTES = 1 << 30
# one uint64 checksum per row (tierstore.tiers.rowsum), beside the segments
ROW_SUMS_FILE = "rowsums.u64"
# A checksum block is read and hashed whole; the default is ~16 KiB.
MAX_BLOCK_BYTES = 64 << 20
_DISK_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


class _Staging:
    """Segment files of one version being written, plus their block checksums
    and the row-checksum file (one uint64 per row, hashed as it is written)."""

    def __init__(self, data_dir: Path, table: str, rows: int, row_bytes: int, block_rows: int):
        tmp = private_dirs(data_dir, "tmp")
        with staging_guard(data_dir, exclusive=False):  # cleanup never sees the dir before its lock
            self.dir = Path(tempfile.mkdtemp(prefix=f"{table}.", dir=tmp))
            self._lock_fd = os.open(self.dir / LOCK_NAME, os.O_CREAT | os.O_RDWR, 0o600)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)  # "alive": cleanup skips held dirs
        self.rows, self.row_bytes, self.block_rows = rows, row_bytes, block_rows
        self.block_bytes = block_rows * row_bytes
        self.total = rows * row_bytes
        self.segment_rows = max(1, SEGMENT_BYTES // self.block_bytes) * block_rows
        self.segment_bytes = self.segment_rows * row_bytes
        self.n_blocks = -(-rows // block_rows)
        self.checksums = np.zeros(self.n_blocks, dtype=np.uint64)
        self.pos = 0
        self._fd: int | None = None
        self._seg = -1
        self._hash = xxhash.xxh3_64()
        self._block = 0
        self._sums_fd: int | None = os.open(self.dir / ROW_SUMS_FILE, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600)
        self._sums_hash = xxhash.xxh3_64()

    def write(self, data: memoryview) -> None:
        """Append whole rows (data is a byte view of uint8 [n, row_bytes])."""
        if self.pos + len(data) > self.total:
            raise SpecMismatch(f"the source yields more than the declared {self.rows} rows")
        self._checksum(data)
        self._row_sums(data)
        while len(data):
            seg = self.pos // self.segment_bytes
            if seg != self._seg:
                self._close_segment()
                self._fd = os.open(self.dir / f"seg-{seg:05d}.bin", os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600)
                self._seg = seg
            take = min(len(data), (seg + 1) * self.segment_bytes - self.pos)
            n = os.write(self._fd, data[:take])
            self.pos += n
            data = data[n:]

    def _checksum(self, data: memoryview) -> None:
        p = self.pos
        while len(data):
            end = min((self._block + 1) * self.block_bytes, self.total)
            take = min(len(data), end - p)
            if take == self.block_bytes:  # a whole block in hand: hash in one call
                self.checksums[self._block] = xxhash.xxh3_64_intdigest(data[:take])
            else:
                self._hash.update(data[:take])
                if p + take == end:
                    self.checksums[self._block] = self._hash.intdigest()
                    self._hash.reset()
            p += take
            data = data[take:]
            if p == end:
                self._block += 1

    def _row_sums(self, data: memoryview) -> None:
        first = self.pos // self.row_bytes
        rows = np.frombuffer(data, dtype=np.uint8).reshape(-1, self.row_bytes)
        sums = rowsum.row_sums(rows, np.arange(first, first + rows.shape[0], dtype=np.int64))
        raw = memoryview(sums.astype("<u8", copy=False)).cast("B")
        self._sums_hash.update(raw)
        while len(raw):
            raw = raw[os.write(self._sums_fd, raw):]

    @property
    def row_sums_meta(self) -> dict:
        return {"file": ROW_SUMS_FILE, "algo": rowsum.ALGO, "xxh3": self._sums_hash.intdigest()}

    def _close_segment(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None

    def finish(self) -> None:
        if self.pos != self.total:
            raise SpecMismatch(f"the source ended after {self.pos // self.row_bytes} rows; "
                               f"{self.rows} were declared")
        self._close_segment()
        os.fsync(self._sums_fd)
        os.close(self._sums_fd)
        self._sums_fd = None
        _fsync_dir(self.dir)

    def abort(self) -> None:
        import shutil

        for fd in (self._fd, self._sums_fd):
            if fd is not None:
                os.close(fd)
        self._fd = self._sums_fd = None
        shutil.rmtree(self.dir, ignore_errors=True)
        self.release()

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def write_version(data_dir, table: str, chunks: Iterable[np.ndarray], *, rows: int, row_format: str,
                  row_dim: int, spec: dict | None = None, layer_id: int | None = None, source: str = "",
                  block_rows: int | None = None, progress: bool = False,
                  expected_checksums: np.ndarray | None = None, verify: bool = True) -> TableVersion:
    """Write a new version of `table` from row chunks and make it current.

    chunks: uint8 arrays [n, row_bytes] in row order (any n), `rows` in total.
    row_format/row_dim: the rows' format (tierstore.formats) and values per row.
    spec/layer_id: the Engram spec dict and layer the table serves (stored as is).
    block_rows: rows per checksum block (default: about 16 KiB of rows).
    expected_checksums: when given (import), the computed block checksums must
        match them or nothing is committed (ChecksumError).
    verify: read the written files back against their checksums before commit.

    Memory use is one chunk plus constant. Raises InvalidArgument / SpecMismatch
    for bad input, ResourceExhausted for a full disk; on any failure the staged
    files are removed and the current version is unchanged.
    """
    from tqdm import tqdm

    data_dir = Path(data_dir)
    validate_table_name(table)
    fmt = RowFormat.parse(row_format)
    row_bytes = fmt.row_bytes(int(row_dim))
    if rows < 1:
        raise InvalidArgument(f"table {table!r} needs at least one row, got {rows}")
    block_rows = int(block_rows or default_block_rows(row_bytes))
    if block_rows < 1:
        raise InvalidArgument(f"block_rows must be >= 1, got {block_rows}")
    if block_rows * row_bytes > MAX_BLOCK_BYTES and rows * row_bytes <= MAX_BLOCK_BYTES:
        block_rows = rows  # the whole table is one block either way
    if block_rows * row_bytes > MAX_BLOCK_BYTES:
        raise InvalidArgument(f"--block-rows {block_rows} x {row_bytes} B rows makes {block_rows * row_bytes} B "
                              f"checksum blocks; at most {MAX_BLOCK_BYTES >> 20} MiB "
                              f"(--block-rows <= {MAX_BLOCK_BYTES // row_bytes})")
    with Catalog(data_dir) as cat:  # opening for writing cleans a killed writer's leftovers
        stage = _Staging(data_dir, table, rows, row_bytes, block_rows)
        try:
            bar = tqdm(total=rows * row_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                       desc=f"ingest {table}", file=sys.stderr, disable=not progress, mininterval=0.25)
            with bar:
                for chunk in chunks:
                    if not isinstance(chunk, np.ndarray) or chunk.dtype != np.uint8 or chunk.ndim != 2 \
                            or chunk.shape[1] != row_bytes:
                        raise InvalidArgument(f"row chunks must be uint8 [n, {row_bytes}] ({fmt.value} x {row_dim}), "
                                              f"got {getattr(chunk, 'dtype', type(chunk))} "
                                              f"{getattr(chunk, 'shape', '')}")
                    stage.write(memoryview(np.ascontiguousarray(chunk)).cast("B"))
                    bar.update(chunk.nbytes)
            stage.finish()
            if expected_checksums is not None:
                bad = np.flatnonzero(np.asarray(expected_checksums, dtype=np.uint64) != stage.checksums)
                if len(bad) or len(expected_checksums) != stage.n_blocks:
                    blk = int(bad[0]) if len(bad) else stage.n_blocks
                    raise DataLoss(f"table {table!r}: block {blk} of the incoming rows does not match its "
                                   f"checksum; the source is corrupt, nothing was committed")
            fields = dict(rows=rows, row_format=fmt.value, row_dim=int(row_dim), row_bytes=row_bytes,
                          block_rows=block_rows, n_blocks=stage.n_blocks, segment_rows=stage.segment_rows,
                          spec=spec, layer_id=layer_id, source=str(source), row_sums=stage.row_sums_meta)
            if verify:
                _verify_staged(data_dir, stage, table, fields)
            tv = cat.commit_version(table, stage.dir, fields, stage.checksums)
            stage.release()
            return tv
        except OSError as e:
            stage.abort()
            if e.errno in _DISK_FULL:
                raise ResourceExhausted(
                    f"disk full while writing table {table!r} to {data_dir} ({e.strerror}); free space "
                    f"or use another --data; the current version is unchanged") from e
            raise
        except BaseException:
            stage.abort()
            raise


def _verify_staged(data_dir: Path, stage: _Staging, table: str, fields: dict) -> None:
    n_segs = -(-stage.rows // stage.segment_rows)
    rel = stage.dir.relative_to(data_dir)
    tv = TableVersion(table=table, version=0, created_at=0.0,
                      segments=tuple(f"{rel}/seg-{i:05d}.bin" for i in range(n_segs)), **fields)
    with SegmentReader(data_dir, tv, stage.checksums) as reader:
        bad = reader.verify()
    if bad:
        raise DataLoss(f"table {table!r}: block {bad[0]} does not read back as written; check the disk "
                       f"under {data_dir}; nothing was committed")


class _Tensor:
    """One checkpoint tensor read lazily by row slices (as torch tensors)."""

    def __init__(self, name: str, shape, dtype, read):
        self.name, self.shape, self.dtype, self.read = name, tuple(shape), dtype, read


def _pread_rows(path: Path, offset: int, shape, dtype):
    """Row reader for a C-ordered tensor stored raw at `offset` in `path`.

    pread into a fresh buffer rather than slicing a memory map: pages of a
    mapped file count in the process's RSS once touched, so a mapped 98 GB table
    would look like 98 GB of memory use; read pages stay only in the page cache.
    """
    import torch

    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()

    def read(a: int, b: int):
        buf = np.empty((b - a) * row_bytes, dtype=np.uint8)
        got = 0
        with open(path, "rb") as f:
            while got < buf.nbytes:
                n = os.preadv(f.fileno(), [memoryview(buf)[got:]], offset + a * row_bytes + got)
                if n == 0:
                    break
                got += n
        if got != buf.nbytes:
            raise SpecMismatch(f"{path} is truncated: rows {a}..{b - 1} are missing")
        return torch.from_numpy(buf).view(dtype).reshape((b - a,) + tuple(shape[1:]))
    return read


def _open_tensors(src: Path) -> dict[str, _Tensor]:
    import json
    import struct

    import torch

    with open(src, "rb") as f:
        head = f.read(8)
    if head.startswith(b"\x93NUMPY"):
        arr = np.load(src, mmap_mode="r")
        dtype = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16,
                 np.dtype(np.uint8): torch.uint8}.get(arr.dtype)
        if dtype is None:
            raise SpecMismatch(f"{src} holds {arr.dtype} values; .npy tables must be float32, float16 or "
                               f"uint8 packed rows")
        if not arr.flags.c_contiguous:
            raise SpecMismatch(f"{src} is stored in Fortran order; save it C-ordered (np.ascontiguousarray)")
        return {src.stem: _Tensor(src.stem, arr.shape, dtype, _pread_rows(src, arr.offset, arr.shape, dtype))}
    if head.startswith(b"PK") or head[:2] == b"\x80\x02":
        # torch's zip format has no raw offsets to pread; mapped pages count in RSS
        # as they are read (they are page cache and reclaimable). Prefer safetensors.
        try:
            obj = torch.load(src, mmap=True, weights_only=True, map_location="cpu")
        except Exception as e:  # noqa: BLE001 - RuntimeError, UnpicklingError, zip errors: all "cannot read"
            why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            if head[:2] == b"\x80\x02":
                raise InvalidArgument(f"{src} is a torch.save file in the legacy (pre-1.6) format, which cannot be "
                                      f"read in bounded memory; save it again with torch.save's default (zip) "
                                      f"format or as safetensors") from None
            raise InvalidArgument(f"{src} is a zip file but not a torch state dict tierstore can load safely "
                                  f"({why}); give a safetensors, .npy or torch.save file") from None
        flat: dict[str, torch.Tensor] = {}

        def walk(prefix, o):
            if isinstance(o, torch.Tensor):
                flat[prefix or src.stem] = o
            elif isinstance(o, dict):
                for k, v in o.items():
                    walk(f"{prefix}.{k}" if prefix else str(k), v)
        walk("", obj)
        return {k: _Tensor(k, t.shape, t.dtype, lambda a, b, t=t: t[a:b].contiguous()) for k, t in flat.items()}
    from safetensors import safe_open

    try:
        with safe_open(str(src), framework="pt") as f:  # validates the file, gives torch dtypes
            meta = {k: (f.get_slice(k).get_shape(), f.get_slice(k)[0:0].dtype if f.get_slice(k).get_shape()
                        else f.get_tensor(k).dtype) for k in f.keys()}
    except Exception as e:
        raise InvalidArgument(f"{src} is not a safetensors file, a .npy file or a torch state dict ({e})") from None
    with open(src, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: _Tensor(k, shape, dtype, _pread_rows(src, 8 + n + header[k]["data_offsets"][0], shape, dtype))
            for k, (shape, dtype) in meta.items()}


_FORMAT_OF = {"float32": RowFormat.FP32, "bfloat16": RowFormat.BF16, "float16": RowFormat.FP16,
              "float8_e4m3fn": RowFormat.FP8_E4M3_UE8M0}


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _pick(tensors: dict[str, _Tensor], key, want, what: str, src) -> _Tensor:
    if key is not None:
        if key not in tensors:
            raise InvalidArgument(f"{src} has no tensor {key!r}; tensors are {sorted(tensors)}")
        return tensors[key]
    found = list(tensors.values()) if len(tensors) == 1 and what == "table" else [t for t in tensors.values() if want(t)]
    if len(found) != 1:
        raise InvalidArgument(f"{src} holds tensors {sorted(tensors)}; choose the {what} with "
                              f"{'--key' if what == 'table' else '--scale-key'}")
    return found[0]


def _raw_dim(fmt: RowFormat, row_bytes: int) -> int | None:
    dim = {RowFormat.FP32: row_bytes // 4, RowFormat.BF16: row_bytes // 2, RowFormat.FP16: row_bytes // 2,
           RowFormat.FP8_E4M3_UE8M0: row_bytes * 32 // 33}[fmt]
    try:
        return dim if dim > 0 and fmt.row_bytes(dim) == row_bytes else None
    except ValueError:
        return None


def ingest_file(src, data_dir, table=None, *, key=None, scale_key=None, row_format=None, preset=None,
                layer=None, scale=1, progress=True, block_rows=None, chunk_bytes=64 << 20) -> TableVersion:
    """Ingest one 2-D tensor of a checkpoint as a new version of `table`.

    src: a .safetensors file, a .npy file or a torch state dict (torch.save);
        read in slices of about `chunk_bytes`, so a table larger than RAM
        ingests in bounded memory.
    table: table name; default the preset's name for `layer` (e.g. "l1").
    key: the tensor to ingest (needed when src holds several 2-D float tensors).
    scale_key: fp8 values need their ue8m0 block scales [rows, dim/32]
        (uint8 or float8_e8m0fnu); found automatically when unambiguous.
    row_format: stored format; default inferred from the dtype (float32 -> fp32,
        bfloat16 -> bf16, float16 -> fp16, float8_e4m3fn + scales ->
        fp8-e4m3-ue8m0). A different format converts the values (lossy, named in
        the manifest's source); a uint8 tensor is taken as packed rows of this
        format, bit-exact.
    preset/layer/scale: rows and width must match the Engram spec, else
        SpecMismatch; the spec is stored in the manifest.
    """
    from tierstore.spec import preset as get_preset
    from tierstore.formats import decode_rows, encode_rows

    src = Path(src)
    if not src.is_file():
        raise FileNotFoundError(f"no such checkpoint file: {src}")
    tensors = _open_tensors(src)
    t = _pick(tensors, key, lambda t: len(t.shape) == 2 and _dtype_name(t.dtype) in _FORMAT_OF, "table", src)
    if len(t.shape) != 2:
        raise SpecMismatch(f"{src}:{t.name} has shape {list(t.shape)}; a table is 2-D [rows, dim]")
    n, width = t.shape
    dname = _dtype_name(t.dtype)
    target = RowFormat.parse(row_format) if row_format else None
    scales = None
    if dname == "uint8":
        if target is None:
            raise SpecMismatch(f"{src}:{t.name} is uint8; say which format its packed rows are in with --format")
        src_fmt, dim = target, _raw_dim(target, width)
        if dim is None:
            raise SpecMismatch(f"{src}:{t.name} rows are {width} bytes, not a whole {target.value} row")
    elif dname in _FORMAT_OF:
        src_fmt, dim = _FORMAT_OF[dname], width
        if src_fmt is RowFormat.FP8_E4M3_UE8M0:
            src_fmt.row_bytes(dim)
            scales = _pick(tensors, scale_key, lambda s: s is not t and len(s.shape) == 2
                           and _dtype_name(s.dtype) in ("uint8", "float8_e8m0fnu"), "scales", src)
            if tuple(scales.shape) != (n, dim // 32) or _dtype_name(scales.dtype) not in ("uint8", "float8_e8m0fnu"):
                raise SpecMismatch(f"{src}:{scales.name} is {_dtype_name(scales.dtype)} {list(scales.shape)}; "
                                   f"ue8m0 scales for {t.name} must be uint8 or float8_e8m0fnu [{n}, {dim // 32}]")
    else:
        raise SpecMismatch(f"{src}:{t.name} has dtype {dname}; tables are float32, bfloat16, float16, "
                           f"float8_e4m3fn (+ ue8m0 scales) or uint8 packed rows with --format")
    target = target or src_fmt
    spec_dict = None
    if preset is not None or layer is not None:
        if preset is None or layer is None:
            raise InvalidArgument("--preset and --layer go together")
        try:
            spec = get_preset(preset, int(scale))
            expected = spec.rows(int(layer))
            table = table or spec.table_name(int(layer))
        except (KeyError, ValueError) as e:
            raise InvalidArgument(e.args[0]) from None
        if n != expected or dim != spec.row_dim:
            raise SpecMismatch(f"{src}:{t.name} is [{n}, {dim}] but preset {preset!r} (scale {scale}) layer {layer} "
                               f"needs [{expected}, {spec.row_dim}]; check --preset/--layer/--scale or --key")
        spec_dict = spec.to_dict()
    if table is None:
        raise InvalidArgument("name the table with --table (or give --preset and --layer)")
    validate_table_name(table)
    target.row_bytes(dim)

    def chunks():
        step = max(1, chunk_bytes // max(1, target.row_bytes(dim)))
        for a in range(0, n, step):
            b = min(a + step, n)
            raw = t.read(a, b).view(_torch_uint8()).numpy().reshape(b - a, -1)
            if scales is not None:
                raw = np.concatenate([raw, scales.read(a, b).view(_torch_uint8()).numpy().reshape(b - a, -1)], axis=1)
            if target is not src_fmt:
                raw = encode_rows(decode_rows(raw, src_fmt, dim), target, first_row=a)
            yield raw

    note = f"{src}:{t.name}" + (f"+{scales.name}" if scales is not None else "")
    if target is not src_fmt:
        note += f" (converted {src_fmt.value} -> {target.value})"
    return write_version(data_dir, table, chunks(), rows=n, row_format=target.value, row_dim=dim, spec=spec_dict,
                         layer_id=None if layer is None else int(layer), source=note, block_rows=block_rows,
                         progress=progress)


def _torch_uint8():
    import torch

    return torch.uint8
