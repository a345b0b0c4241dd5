"""TableHandle: what a sidecar client knows about one served table (from DescribeTable)."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

import numpy as np

from tierstore.client.arena_map import MappedArena
from tierstore.proto import tierstore_pb2 as pb

if TYPE_CHECKING:
    import torch

    from tierstore.client.client import Client

__all__ = ["TableHandle"]


class TableHandle:
    """What a client knows about one served table; its arena is mapped on first use."""

    def __init__(self, info: pb.TableInfo, client: "Client | None" = None):
        self.table, self.version, self.rows = info.table, info.version, info.rows
        self.row_format, self.row_dim, self.row_bytes = info.row_format, info.row_dim, info.row_bytes
        self.spec = json.loads(info.spec_json) if info.spec_json else None
        self.layer_id = None if info.layer_id < 0 else info.layer_id
        self.full_resident = info.arena.full_resident
        self._arena_path, self._arena_slots = info.arena.path, info.arena.slots
        self.instance = info.arena.instance
        self.lease_board, self.lease_board_entries = info.arena.lease_board, info.arena.lease_board_entries
        # cache mode with local reads (client/local_reads.py): the slot index, and where misses may be read
        self.index_path, self.cold_dir = info.arena.index, info.arena.cold_dir
        self.cold_direct = info.arena.cold_direct  # read misses with O_DIRECT, as the sidecar does
        self.max_prefetch_steps = info.max_prefetch_steps  # 0: the sidecar did not say
        # split-layout arena (all weights, then all scales; client/split_table.py): a row's weight bytes, else 0
        self.split = info.arena.split_bytes if info.arena.layout == "split" else 0
        self.local = None  # its LocalReads, made on the first lookup
        self._client = client
        self._mapped: MappedArena | None = None

    @property
    def mapped(self) -> MappedArena:
        if self._mapped is None:
            # mapped on first use: a remote client that only uses inline lookups never maps
            self._mapped = (self._client.arena(self._arena_path, self._arena_slots, self.row_bytes, self.instance,
                                               split=self.split)
                            if self._client is not None else
                            MappedArena(self._arena_path, self._arena_slots, self.row_bytes, self.instance,
                                        split=self.split))
        return self._mapped

    @property
    def arena_np(self) -> np.ndarray:
        return self.mapped.rows

    @property
    def arena(self) -> "torch.Tensor":
        return self.mapped.tensor

    @property
    def stale(self) -> bool:
        """The arena was retired (version swap, restart): describe the table again."""
        return self._mapped is not None and self._mapped.retired

    def info(self) -> dict:
        return dict(rows=self.rows, row_bytes=self.row_bytes, row_format=self.row_format, row_dim=self.row_dim,
                    spec=self.spec, version=self.version, layer_id=self.layer_id, full_resident=self.full_resident)
