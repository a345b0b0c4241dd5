"""Deterministic synthetic tables with a preset's layout (tests, `make run`, bench).

Random bytes are drawn per fixed group of DEMO_GROUP_ROWS rows from a
generator seeded by (seed, layer, group), so a table depends only on the seed,
never on how it is chunked, and any row range can be recomputed without the
table (`demo_rows`, `demo_values`). The bytes become rows by table lookup, no
per-value arithmetic, so a table is generated about as fast as it is written:
- fp32 / bf16 / fp16: each value is one of 65,536 N(0, 1) quantiles picked by
  a uniform 16-bit draw, then encoded to the format;
- fp8-e4m3-ue8m0: the stored bytes directly: each e4m3 byte is one of 256
  N(0, 1) quantiles (x 128) and each 32-value block's ue8m0 scale one of 2^-9
  .. 2^-6, so blocks of N(0, sigma) values with sigma from 1/4 to 2, which
  exercises the fp8 block scales.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

from tierstore.store.catalog import TableVersion
from tierstore.errors import InvalidArgument
from tierstore.table.formats import RowFormat, encode_rows

__all__ = ["make_demo_tables", "demo_spec", "demo_values", "demo_rows", "DEMO_GROUP_ROWS"]

DEMO_GROUP_ROWS = 4096
_CHUNK_BYTES = 8 << 20  # bytes of rows generated per step: bounds memory
_E4M3_SCALE = 128.0  # e4m3 codes hold N(0, 1) quantiles x this (|x| <= 369 < 448, e4m3's largest)
_UE8M0_FIRST = 127 - 9  # block scales 2^-9 .. 2^-6: 2^-7 x _E4M3_SCALE = 1


@lru_cache(maxsize=None)
def _quantiles(levels: int) -> np.ndarray:
    """float64 [levels]: the N(0, 1) quantiles at (k + 1/2) / levels."""
    from statistics import NormalDist

    inv = NormalDist().inv_cdf
    return np.array([inv((k + 0.5) / levels) for k in range(levels)])


@lru_cache(maxsize=None)
def _fp8_tables() -> tuple[bytes, bytes]:
    """bytes.translate tables (one C pass over a draw): uniform byte -> the e4m3
    byte of an N(0, 1) quantile x _E4M3_SCALE, and -> a ue8m0 block scale."""
    import torch

    q = torch.from_numpy((_quantiles(256) * _E4M3_SCALE).astype(np.float32))
    codes = q.to(torch.float8_e4m3fn).view(torch.uint8).numpy().tobytes()
    return codes, bytes(_UE8M0_FIRST + (u & 3) for u in range(256))


def _draw(rng, nbytes: int) -> np.ndarray:
    """uint8 [nbytes] of the generator's raw stream (little-endian words): a few
    times faster than Generator.bytes."""
    raw = rng.bit_generator.random_raw(-(-nbytes // 8)).astype("<u8", copy=False)
    return raw.view(np.uint8)[:nbytes]


def _groups(spec, layer_id: int, start: int, stop: int, seed: int):
    """(rng, a, b, lo, hi) per DEMO_GROUP_ROWS group touching rows [start, stop):
    the group's generator, its rows [a, b) and the part [lo, hi) wanted."""
    rows = spec.rows(layer_id)
    if not 0 <= start <= stop <= rows:
        raise InvalidArgument(f"demo table l{layer_id} has {rows} rows; range [{start}, {stop}) is out of range")
    for g in range(start // DEMO_GROUP_ROWS, -(-stop // DEMO_GROUP_ROWS)):
        a, b = g * DEMO_GROUP_ROWS, min((g + 1) * DEMO_GROUP_ROWS, rows)
        yield np.random.default_rng([seed, layer_id, g]), a, b, max(a, start), min(b, stop)


def demo_spec(preset: str, scale: int = 1, *, row_format: str | None = None, row_dim: int | None = None):
    """The preset scaled by `scale`, with the row format/width optionally replaced."""
    from tierstore.table.spec import EngramSpec, preset as get_preset

    try:
        spec = get_preset(preset, int(scale))
    except (KeyError, ValueError) as e:
        raise InvalidArgument(e.args[0]) from None
    if row_format is None and row_dim is None:
        return spec
    d = spec.to_dict()
    d["row_format"] = RowFormat.parse(row_format or spec.row_format).value
    d["row_dim"] = int(row_dim or spec.row_dim)
    try:
        return EngramSpec.from_dict(d)
    except ValueError as e:
        raise InvalidArgument(str(e)) from None


def demo_values(spec, layer_id: int, start: int, stop: int, seed: int = 0) -> np.ndarray:
    """float32 [stop - start, row_dim]: the demo values of rows [start, stop) of a
    layer (for fp8, exactly the values the stored rows decode to)."""
    fmt = RowFormat.parse(spec.row_format)
    if fmt is RowFormat.FP8_E4M3_UE8M0:
        from tierstore.table.formats import decode_rows

        return decode_rows(demo_rows(spec, layer_id, start, stop, seed), fmt, spec.row_dim)
    dim, table = spec.row_dim, _quantiles(1 << 16).astype(np.float32)
    out = np.empty((stop - start, dim), dtype=np.float32)
    for rng, a, b, lo, hi in _groups(spec, layer_id, start, stop, seed):
        u = _draw(rng, 2 * (b - a) * dim).view("<u2").reshape(b - a, dim)
        np.take(table, u[lo - a:hi - a], out=out[lo - start:hi - start])
    return out


def demo_rows(spec, layer_id: int, start: int, stop: int, seed: int = 0) -> np.ndarray:
    """uint8 [stop - start, row_bytes]: the demo rows exactly as stored."""
    fmt = RowFormat.parse(spec.row_format)
    if fmt is not RowFormat.FP8_E4M3_UE8M0:
        return encode_rows(demo_values(spec, layer_id, start, stop, seed), fmt, first_row=start)
    dim = spec.row_dim
    nb = fmt.row_bytes(dim) - dim
    codes, scales = _fp8_tables()
    out = np.empty((stop - start, dim + nb), dtype=np.uint8)
    for rng, a, b, lo, hi in _groups(spec, layer_id, start, stop, seed):
        w = np.frombuffer(_draw(rng, (b - a) * dim).tobytes().translate(codes), np.uint8).reshape(b - a, dim)
        sc = np.frombuffer(_draw(rng, (b - a) * nb).tobytes().translate(scales), np.uint8).reshape(b - a, nb)
        out[lo - start:hi - start, :dim] = w[lo - a:hi - a]
        out[lo - start:hi - start, dim:] = sc[lo - a:hi - a]
    return out


def make_demo_tables(data_dir, preset: str, scale: int, *, seed: int = 0, row_format: str | None = None,
                     row_dim: int | None = None, progress=False) -> list[TableVersion]:
    """Write one table per Engram layer of `preset` (names `l<layer>`), scaled
    down by `scale`, as a new current version each. Memory stays at a few tens
    of MB whatever the table size. Same arguments, same bytes.

    Raises InvalidArgument for an unknown preset, a bad scale or format/width.
    """
    from tierstore.ingest.writer import write_version

    spec = demo_spec(preset, scale, row_format=row_format, row_dim=row_dim)
    row_bytes = RowFormat.parse(spec.row_format).row_bytes(spec.row_dim)
    step = max(DEMO_GROUP_ROWS, _CHUNK_BYTES // row_bytes // DEMO_GROUP_ROWS * DEMO_GROUP_ROWS)
    out = []
    for layer in spec.layer_ids:
        rows = spec.rows(layer)
        chunks = (demo_rows(spec, layer, a, min(a + step, rows), seed) for a in range(0, rows, step))
        out.append(write_version(
            Path(data_dir), spec.table_name(layer), chunks, rows=rows, row_format=spec.row_format,
            row_dim=spec.row_dim, spec=spec.to_dict(), layer_id=layer, progress=progress,
            source=f"demo-table preset={preset} scale={scale} seed={seed}"))
    return out
