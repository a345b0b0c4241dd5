"""`ingest_file`: one 2-D tensor of a checkpoint file -> a new current table version."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tierstore.store.catalog import TableVersion, validate_table_name
from tierstore.errors import InvalidArgument, SpecMismatch
from tierstore.table.formats import RowFormat
from tierstore.ingest.writer import write_version
from tierstore.ingest.tensor_reader import dtype_name, open_tensors, pick

__all__ = ["ingest_file"]

_FORMAT_OF = {"float32": RowFormat.FP32, "bfloat16": RowFormat.BF16, "float16": RowFormat.FP16,
              "float8_e4m3fn": RowFormat.FP8_E4M3_UE8M0}


def _raw_dim(fmt: RowFormat, row_bytes: int) -> int | None:
    dim = {RowFormat.FP32: row_bytes // 4, RowFormat.BF16: row_bytes // 2, RowFormat.FP16: row_bytes // 2,
           RowFormat.FP8_E4M3_UE8M0: row_bytes * 32 // 33}[fmt]
    try:
        return dim if dim > 0 and fmt.row_bytes(dim) == row_bytes else None
    except ValueError:
        return None


def ingest_file(src, data_dir, table=None, *, key=None, scale_key=None, row_format=None, preset=None,
                layer=None, scale=1, progress=True, block_rows=None, chunk_bytes=16 << 20) -> TableVersion:
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
    from tierstore.table.spec import preset as get_preset
    from tierstore.table.formats import decode_rows, encode_rows

    src = Path(src)
    if not src.is_file():
        raise FileNotFoundError(f"no such checkpoint file: {src}")
    tensors = open_tensors(src)
    t = pick(tensors, key, lambda t: len(t.shape) == 2 and dtype_name(t.dtype) in _FORMAT_OF, "table", src)
    if len(t.shape) != 2:
        raise SpecMismatch(f"{src}:{t.name} has shape {list(t.shape)}; a table is 2-D [rows, dim]")
    n, width = t.shape
    dname = dtype_name(t.dtype)
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
            scales = pick(tensors, scale_key, lambda s: s is not t and len(s.shape) == 2
                           and dtype_name(s.dtype) in ("uint8", "float8_e8m0fnu"), "scales", src)
            if tuple(scales.shape) != (n, dim // 32) or dtype_name(scales.dtype) not in ("uint8", "float8_e8m0fnu"):
                raise SpecMismatch(f"{src}:{scales.name} is {dtype_name(scales.dtype)} {list(scales.shape)}; "
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
