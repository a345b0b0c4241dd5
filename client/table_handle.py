"""TableHandle: what a sidecar client knows about one served table (from DescribeTable), and how it reads it.

A lookup on the sidecar's host reads rows through the handle (TableHandle.begin, then
MissBatch.finish), by the one route the handle chose when it was made; see TableHandle.begin.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

import numpy as np

from tierstore import errors
from tierstore.client.arena_map import MappedArena
from tierstore.client.local_reads import LocalReads
from tierstore.proto import tierstore_pb2 as pb
from tierstore.table.checkpoint import TensorSource
from tierstore.tiers.nvme.miss_batch import MissBatch

if TYPE_CHECKING:
    import torch

    from tierstore.client.client import Client

__all__ = ["TableHandle"]


class TableHandle:
    """What a client knows about one served table; its arena is mapped on first use.

    A handle describes one version in one sidecar instance: when its arena is retired
    (`stale`: a version swap, a restart) the client describes the table again and
    makes a new handle, closing this one."""

    def __init__(self, info: pb.TableInfo, client: "Client | None" = None):
        self.table, self.version, self.rows = info.table, info.version, info.rows
        self.row_format, self.row_dim, self.row_bytes = info.row_format, info.row_dim, info.row_bytes
        self.spec = json.loads(info.spec_json) if info.spec_json else None
        self.layer_id = None if info.layer_id < 0 else info.layer_id
        # {"weight" / "scale": TensorSource} the rows were ingested from, or None (client/engines/checks.py)
        self.checkpoint = ({k: TensorSource.from_dict(v) for k, v in json.loads(info.checkpoint_json).items()}
                           if info.checkpoint_json else None)
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
        self.local_reads: LocalReads | None = None  # the local-reads route's reader, made on its first read
        self._client = client
        self._mapped: MappedArena | None = None
        # the read route, chosen once (begin() says which serves what)
        self._route = self._take if self.full_resident else self._read_local if self.index_path else self._read_planned

    def begin(self, ids: np.ndarray, out: np.ndarray | None = None, ahead: np.ndarray | None = None) -> MissBatch:
        """A lookup of int64 `ids` (in range: the caller checked them; any order, repeats fine)
        begun by the route chosen when the handle was made; MissBatch.finish(), in this thread,
        returns the rows uint8 [n, row_bytes], bit-exact as stored, in `out` where given
        (checked by the caller: Client.lookup), and raises what the route raises:

        - full-resident: taken straight from the mapped arena (slot == id), now;
        - cache mode with local reads (the sidecar published its slot index): resident
          rows copied from the arena and checked against their sequence numbers, misses
          read from the segment files and verified (client/local_reads.py: in flight when
          this returns), the step noted to the sidecar as the batch finishes;
        - cache mode without (`serve --no-local-reads`): planned and copied out of the
          arena under the step's lease (Client.plan, StepPlan.rows), now.

        The local-reads route falls back to a planned copy for one call, decided in one place
        (_read_local), in two cases: its reader cannot be made (StaleArena: the index was
        retired meanwhile, so the next lookup describes the table again), or the step
        has misses and this process reads none itself (no cold_dir offered: Mooncake, a
        version without row sums; or the segment files would not open here, warned once).
        ahead: the next step's ids (checked by the caller), known ahead: on the local-reads
        route their misses are read behind this step's and kept in flight for this
        thread's next lookup (LocalReads.begin); on the others, nothing (a hint).
        Raises what the planned route raises (ResourceExhausted, Unavailable, StaleRows);
        finish raises DataLoss for a miss that fails its checksum."""
        return self._route(ids, out, ahead)

    def _take(self, ids: np.ndarray, out: np.ndarray | None, ahead=None) -> MissBatch:
        return MissBatch.done(self.mapped.take(ids, out))  # interleaved rows, whatever the arena's layout

    def _read_local(self, ids: np.ndarray, out: np.ndarray | None, ahead=None) -> MissBatch:
        reads = self.local_reads
        if reads is None:
            try:
                reads = self.local_reads = LocalReads(self, self._client.step_channel.note,
                                                         self._client.miss_clock)
            except errors.StaleArena:
                pass  # the index is gone with its arena: this call is planned
        batch = reads.begin(ids, out, ahead) if reads is not None else None
        return batch if batch is not None else self._read_planned(ids, out)

    def _read_planned(self, ids: np.ndarray, out: np.ndarray | None, ahead=None) -> MissBatch:
        with self._client.plan(self.table, ids) as step:
            return MissBatch.done(step.rows(out))

    def close(self) -> None:
        """Let the local-reads route's reader go (its segment files, its miss flights)."""
        if self.local_reads is not None:
            self.local_reads.close()

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
