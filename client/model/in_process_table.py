"""InProcessTable: a RowSource that holds whole tables in process memory.

The in-process ceiling the sidecar is measured against, and the source the
tests and the demo use. Every row of a table lives in one uint8 tensor
[rows, row_bytes] (the serving format, bit-exact), so `slot == id` and
`plan()` has nothing to wait for: the handle's `arena` *is* the table.

Example::

    from tierstore.client.model.in_process_table import InProcessTable
    from tierstore.table.spec import preset

    spec = preset("engram-paper-demo", scale=64)
    source = InProcessTable.synthetic(spec, seed=0)        # random rows, every layer
    h = source.plan("l1", np.array([5, 7, 5]))
    h.slots()            # array([5, 7, 5]); rows are h.arena[slots]
    h.release()

Tables can also come from numpy arrays (`add`) or `.npy` files (`load_npy`):
either encoded rows (uint8 [rows, row_bytes]) or float values [rows, row_dim]
that are encoded into the table's row format on the way in.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tierstore.client.model.source import RowSource
from tierstore.errors import InvalidArgument, SpecMismatch, TableNotFound
from tierstore.table.formats import RowFormat, encode_rows
from tierstore.tiers.base import check_ids

__all__ = ["InProcessTable", "InProcessHandle"]


class InProcessHandle:
    """PlanHandle of an InProcessTable: slot == id, nothing is leased."""

    __slots__ = ("table", "arena", "_slots")

    def __init__(self, table: str, arena: torch.Tensor, slots: np.ndarray):
        self.table, self.arena, self._slots = table, arena, slots

    def slots(self) -> np.ndarray:
        return self._slots

    def valid(self) -> bool:
        return True  # the table never changes under a step

    def replan(self) -> None:
        pass

    def release(self) -> None:
        pass


class InProcessTable(RowSource):
    """In-process RowSource: {table name -> uint8 tensor [rows, row_bytes]}.

    spec: optional EngramSpec; when given, `add` checks each table's row count
        against `spec.rows(layer)` for tables named like `spec.table_name(layer)`,
        and `table_info` reports it.
    device: where the tables live ("cpu" by default; a CUDA device makes the
        gather read rows from HBM, as a fully-resident HBM tier would).
    pin_memory: page-lock CPU tables so a CUDA gather reads them over UVA, as
        it reads the sidecar's registered arena (needs CUDA).
    """

    def __init__(self, spec=None, device: str | torch.device = "cpu", pin_memory: bool = False):
        self.spec = spec
        self.device = torch.device(device)
        self.pin_memory = bool(pin_memory) and self.device.type == "cpu"
        self._tables: dict[str, tuple[torch.Tensor, RowFormat, int, int]] = {}

    # ---- building --------------------------------------------------------
    def add(self, name: str, rows, row_format: str | RowFormat | None = None,
            row_dim: int | None = None, version: int = 1) -> "InProcessTable":
        """Add (or replace) table `name`.

        rows: uint8 [n, row_bytes] encoded rows (numpy, memmap or tensor), or
            float [n, row_dim] values, encoded into `row_format` here.
        row_format / row_dim: default to the spec's. Raises SpecMismatch when
            the shape does not fit the format or the spec's row count.
        """
        spec = self.spec
        if row_format is None and spec is None:
            raise InvalidArgument(f"table {name!r}: pass row_format (no spec to take it from)")
        fmt = RowFormat.parse(row_format or spec.row_format)
        dim = int(row_dim or (spec.row_dim if spec else 0))
        if not dim:
            raise InvalidArgument(f"table {name!r}: pass row_dim (no spec to take it from)")
        rb = fmt.row_bytes(dim)
        if isinstance(rows, torch.Tensor):
            t = rows.detach()
        else:
            arr = np.ascontiguousarray(rows)
            t = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
        if t.dtype != torch.uint8:
            if t.ndim != 2 or t.shape[1] != dim:
                raise SpecMismatch(f"table {name!r}: values must be [rows, {dim}], got {tuple(t.shape)}")
            t = torch.from_numpy(encode_rows(t.float().cpu().numpy(), fmt))
        if t.ndim != 2 or t.shape[1] != rb:
            raise SpecMismatch(
                f"table {name!r}: {fmt.value} rows of width {dim} are {rb} bytes; got uint8 shape {tuple(t.shape)}")
        expect = self._spec_rows(name)
        if expect is not None and t.shape[0] != expect:
            raise SpecMismatch(f"table {name!r}: spec {spec.name!r} says {expect} rows, got {t.shape[0]}")
        t = t.to(self.device).contiguous()
        self._tables[name] = (t.pin_memory() if self.pin_memory else t, fmt, dim, int(version))
        return self

    def load_npy(self, name: str, path: str | Path, **kw) -> "InProcessTable":
        """Add a table from a .npy file (memory-mapped, then copied into memory)."""
        return self.add(name, np.load(path, mmap_mode="r"), **kw)

    @classmethod
    def synthetic(cls, spec, seed: int = 0, std: float = 1.0, device="cpu",
                  pin_memory: bool = False) -> "InProcessTable":
        """Deterministic random tables for every layer of `spec` (demo, tests).

        Layer L's values are N(0, std^2) from numpy default_rng(seed + L),
        encoded in spec.row_format; a scaled spec keeps this small."""
        src = cls(spec, device, pin_memory)
        for layer in spec.layer_ids:
            rng = np.random.default_rng(seed + layer)
            vals = rng.standard_normal((spec.rows(layer), spec.row_dim), dtype=np.float32) * std
            src.add(spec.table_name(layer), encode_rows(vals, spec.row_format))
        return src

    def _spec_rows(self, name: str) -> int | None:
        if self.spec is None:
            return None
        for layer in self.spec.layer_ids:
            if self.spec.table_name(layer) == name:
                return self.spec.rows(layer)
        return None

    # ---- RowSource -------------------------------------------------------
    def _get(self, table: str):
        try:
            return self._tables[table]
        except KeyError:
            raise TableNotFound(f"table {table!r} not found; tables are {sorted(self._tables)}") from None

    def plan(self, table: str, ids) -> InProcessHandle:
        """Slots of `ids` (== ids). Raises TableNotFound / IdOutOfRange at once."""
        rows = self._get(table)[0]
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().cpu().numpy()
        return InProcessHandle(table, rows, check_ids(ids, rows.shape[0], table))

    def table_info(self, table: str) -> dict:
        rows, fmt, dim, version = self._get(table)
        return {"rows": int(rows.shape[0]), "row_bytes": int(rows.shape[1]), "row_format": fmt.value,
                "row_dim": dim, "spec": self.spec.to_dict() if self.spec else None, "version": version}

    def rows(self, table: str) -> torch.Tensor:
        """The whole encoded table, uint8 [rows, row_bytes] (no copy)."""
        return self._get(table)[0]

    def tables(self) -> list[str]:
        return sorted(self._tables)
