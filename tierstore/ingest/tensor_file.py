"""`ingest_file`: one 2-D tensor of a checkpoint file -> a new current table version."""
from __future__ import annotations

from dataclasses import dataclass
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
    src = Path(src)
    if not src.is_file():
        raise FileNotFoundError(f"no such checkpoint file: {src}")
    rows = _TensorRows.open(src, key, scale_key, row_format)
    table, spec = _preset_spec(rows, table, preset, layer, scale)
    if table is None:
        raise InvalidArgument("name the table with --table (or give --preset and --layer)")
    validate_table_name(table)
    rows.target.row_bytes(rows.dim)
    return write_version(data_dir, table, rows.chunks(chunk_bytes), rows=rows.n, row_format=rows.target.value,
                         row_dim=rows.dim, spec=spec, layer_id=None if layer is None else int(layer),
                         source=rows.note, block_rows=block_rows, progress=progress)


@dataclass(frozen=True)
class _TensorRows:
    """The rows one tensor of a checkpoint file holds: `tensor` [n, width] in `fmt` (with
    fp8's ue8m0 `scales` [n, dim / 32] beside it), `dim` values a row, stored as `target`."""

    src: Path
    tensor: object
    scales: object | None
    fmt: RowFormat
    target: RowFormat
    n: int
    dim: int

    @classmethod
    def open(cls, src: Path, key, scale_key, row_format) -> "_TensorRows":
        """Pick the tensor (`key`, else the one 2-D float tensor) and, for fp8, its scales;
        SpecMismatch naming file and tensor for anything that is not a table's rows."""
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
            fmt, dim = target, _raw_dim(target, width)
            if dim is None:
                raise SpecMismatch(f"{src}:{t.name} rows are {width} bytes, not a whole {target.value} row")
        elif dname in _FORMAT_OF:
            fmt, dim = _FORMAT_OF[dname], width
            if fmt is RowFormat.FP8_E4M3_UE8M0:
                fmt.row_bytes(dim)
                scales = pick(tensors, scale_key, lambda s: s is not t and len(s.shape) == 2
                              and dtype_name(s.dtype) in ("uint8", "float8_e8m0fnu"), "scales", src)
                if tuple(scales.shape) != (n, dim // 32) or dtype_name(scales.dtype) not in ("uint8", "float8_e8m0fnu"):
                    raise SpecMismatch(f"{src}:{scales.name} is {dtype_name(scales.dtype)} {list(scales.shape)}; "
                                       f"ue8m0 scales for {t.name} must be uint8 or float8_e8m0fnu [{n}, {dim // 32}]")
        else:
            raise SpecMismatch(f"{src}:{t.name} has dtype {dname}; tables are float32, bfloat16, float16, "
                               f"float8_e4m3fn (+ ue8m0 scales) or uint8 packed rows with --format")
        return cls(src, t, scales, fmt, target or fmt, n, dim)

    @property
    def note(self) -> str:
        """The manifest's source: file, tensor (+ scales) and any conversion."""
        note = f"{self.src}:{self.tensor.name}" + (f"+{self.scales.name}" if self.scales is not None else "")
        if self.target is not self.fmt:
            note += f" (converted {self.fmt.value} -> {self.target.value})"
        return note

    def chunks(self, chunk_bytes: int):
        """The rows packed in `target`, about `chunk_bytes` at a time (converted where it differs)."""
        from tierstore.table.formats import decode_rows, encode_rows

        step = max(1, chunk_bytes // max(1, self.target.row_bytes(self.dim)))
        for a in range(0, self.n, step):
            b = min(a + step, self.n)
            raw = self.tensor.read(a, b).view(_torch_uint8()).numpy().reshape(b - a, -1)
            if self.scales is not None:
                raw = np.concatenate([raw, self.scales.read(a, b).view(_torch_uint8()).numpy().reshape(b - a, -1)],
                                     axis=1)
            if self.target is not self.fmt:
                raw = encode_rows(decode_rows(raw, self.fmt, self.dim), self.target, first_row=a)
            yield raw


def _preset_spec(rows: _TensorRows, table, preset, layer, scale) -> tuple[str | None, dict | None]:
    """(table name, spec dict to store): with `preset` and `layer`, the rows must have that
    layer's shape (SpecMismatch) and the table defaults to its name; neither: (table, None)."""
    from tierstore.table.spec import preset as get_preset

    if preset is None and layer is None:
        return table, None
    if preset is None or layer is None:
        raise InvalidArgument("--preset and --layer go together")
    try:
        spec = get_preset(preset, int(scale))
        expected = spec.rows(int(layer))
        table = table or spec.table_name(int(layer))
    except (KeyError, ValueError) as e:
        raise InvalidArgument(e.args[0]) from None
    if rows.n != expected or rows.dim != spec.row_dim:
        raise SpecMismatch(f"{rows.src}:{rows.tensor.name} is [{rows.n}, {rows.dim}] but preset {preset!r} (scale "
                           f"{scale}) layer {layer} needs [{expected}, {spec.row_dim}]; check --preset/--layer/--scale "
                           f"or --key")
    return table, spec.to_dict()


def _torch_uint8():
    import torch

    return torch.uint8
