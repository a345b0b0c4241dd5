"""Deterministic synthetic tables with a preset's layout (tests, `make run`, bench).

Values are N(0, 1) float32 drawn per fixed group of DEMO_GROUP_ROWS rows from
a generator seeded by (seed, layer, group), so the bytes depend only on the
seed, never on how the table is chunked, and any row range can be recomputed
without the table (`demo_values`). Rows are then encoded to the row format
(N(0, 1) values spread over several binary exponents, which exercises the
fp8 block scales).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tierstore.store.catalog import TableVersion
from tierstore.errors import InvalidArgument
from tierstore.table.formats import RowFormat, encode_rows

__all__ = ["make_demo_tables", "demo_spec", "demo_values", "demo_rows", "DEMO_GROUP_ROWS"]

DEMO_GROUP_ROWS = 4096
_CHUNK_BYTES = 32 << 20  # float32 values generated per step: bounds memory


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
    """float32 [stop - start, row_dim]: the demo values of rows [start, stop) of a layer."""
    rows = spec.rows(layer_id)
    if not 0 <= start <= stop <= rows:
        raise InvalidArgument(f"demo table l{layer_id} has {rows} rows; range [{start}, {stop}) is out of range")
    out = np.empty((stop - start, spec.row_dim), dtype=np.float32)
    g0, g1 = start // DEMO_GROUP_ROWS, -(-stop // DEMO_GROUP_ROWS)
    for g in range(g0, g1):  # one step per 4096-row group
        a, b = g * DEMO_GROUP_ROWS, min((g + 1) * DEMO_GROUP_ROWS, rows)
        rng = np.random.default_rng([seed, layer_id, g])
        vals = rng.standard_normal((b - a, spec.row_dim), dtype=np.float32)
        lo, hi = max(a, start), min(b, stop)
        out[lo - start:hi - start] = vals[lo - a:hi - a]
    return out


def demo_rows(spec, layer_id: int, start: int, stop: int, seed: int = 0) -> np.ndarray:
    """uint8 [stop - start, row_bytes]: the demo rows exactly as stored."""
    return encode_rows(demo_values(spec, layer_id, start, stop, seed), spec.row_format)


def make_demo_tables(data_dir, preset: str, scale: int, *, seed: int = 0, row_format: str | None = None,
                     row_dim: int | None = None, progress=False) -> list[TableVersion]:
    """Write one table per Engram layer of `preset` (names `l<layer>`), scaled
    down by `scale`, as a new current version each. Memory stays at a few tens
    of MB whatever the table size. Same arguments, same bytes.

    Raises InvalidArgument for an unknown preset, a bad scale or format/width.
    """
    from tierstore.ingest.writer import write_version

    spec = demo_spec(preset, scale, row_format=row_format, row_dim=row_dim)
    step = max(DEMO_GROUP_ROWS, _CHUNK_BYTES // (4 * spec.row_dim) // DEMO_GROUP_ROWS * DEMO_GROUP_ROWS)
    out = []
    for layer in spec.layer_ids:
        rows = spec.rows(layer)
        chunks = (demo_rows(spec, layer, a, min(a + step, rows), seed) for a in range(0, rows, step))
        out.append(write_version(
            Path(data_dir), spec.table_name(layer), chunks, rows=rows, row_format=spec.row_format,
            row_dim=spec.row_dim, spec=spec.to_dict(), layer_id=layer, progress=progress,
            source=f"demo-table preset={preset} scale={scale} seed={seed}"))
    return out
