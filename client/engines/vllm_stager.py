"""vLLM 0.32's Engram rows staged from tierstore: tables larger than RAM (cache mode).

A table the sidecar serves in cache mode has no split arena for vLLM's
`ParallelEngramEmbedding` parameters to view, and vLLM's own allocation (the
whole table in pinned host memory under cpu_offload) is what does not fit. So a
staged layer holds no rows at all: its `weight` / `weight_scale_inv` are
zero-row placeholders, and every read of the table -- `ParallelEngramEmbedding.lookup(indices,
out)`, the one method both of vLLM's callers use (`Engram.prepare_embeddings`:
bf16 rows into `Engram.staged_rows`; `EngramBatch._stage`: packed 264-byte rows
into `EngramBatch.packed_rows`) -- is answered by `StagedEngramTable.lookup`
from tierstore's client (Client.lookup: resident rows copied from the cache
arena under its seqlock, misses read from the segment files and verified by
their row sums, the step noted to the sidecar so it promotes them).

The plugin (client/engines/vllm_plugin.py) patches the class, as it patches
`_allocate_weights`: `lookup` and `_storage` dispatch on the instance's
`tierstore_staged` (this module's StagedEngramTable, or None for a mapped or
vLLM-owned table).

Invariants:
- `out` is written only once every row it needs was read and verified: a
  checksum failure (DATA_LOSS), a sidecar that is away or cannot plan a miss,
  or a table now served at another version raises StagingError naming the
  layer, and `out` keeps what it held.
- The output is what `_engram_lookup_kernel` writes for the same table: ids
  outside [vocab_start_idx, vocab_end_idx) and padded heads (head >=
  n_hash_cols) give zero rows; bf16 rows are fp32(e4m3) x 2^(ue8m0 - 127),
  the scale made as the kernel makes it (the byte shifted into the fp32
  exponent field: byte 0 is 0.0, byte 255 is inf), rounded once to bf16;
  packed rows are the 264 stored bytes. `dequantize` is that arithmetic.
- Each distinct id of a call is read once.

Costs and limits (docs/engines.md, "Staged rows"):
- On CUDA the ids are copied to the host inside `lookup` (`indices.cpu()`): a
  device sync on the stream vLLM runs the lookup on, so the prefetch stream's
  overlap with the decoder layers is lost for the read's duration. Hashing the
  scheduled tokens on the host ahead of the step (tierstore's NgramHasher
  agrees with vLLM's `_hash_ids_kernel`), fed by a scheduler hook, is the
  known next step; it is not built.
- The lookup is Python and host I/O: it cannot be captured in a CUDA graph. It
  runs each step under vLLM's breakable CUDA graphs (VLLM_USE_BREAKABLE_CUDAGRAPH=1,
  where both callers are eager breaks) or without graphs (--enforce-eager); a
  capture that would record it (cudagraph_mode FULL) raises StagingError.
- Nothing reads a staged table in place: `_storage()` raises StagingError
  (vLLM's Engram DP peer exchange reads tables that way).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from tierstore import errors
from tierstore.client.engines import StagingError, checks
from tierstore.jit import unique_inverse

if TYPE_CHECKING:
    import torch

__all__ = ["StagedEngramTable", "dequantize", "FP8_BLOCK", "ROW_FORMAT"]

log = logging.getLogger("tierstore.client.engines.vllm")
FP8_BLOCK = 32  # values per ue8m0 scale
ROW_FORMAT = "fp8-e4m3-ue8m0"


def dequantize(packed: "torch.Tensor", dim: int) -> "torch.Tensor":
    """bf16 [..., dim] of packed rows uint8 [..., dim + dim // 32], with `_engram_lookup_kernel`'s
    arithmetic: fp32(e4m3 value) x fp32 whose bits are (ue8m0 byte << 23), rounded once to bf16
    (round to nearest even). The torch reference of the kernel's PACKED=False branch."""
    import torch

    values = packed[..., :dim].view(torch.float8_e4m3fn).to(torch.float32)
    scale = (packed[..., dim:].to(torch.int32) << 23).view(torch.float32)
    out = values.unflatten(-1, (dim // FP8_BLOCK, FP8_BLOCK)) * scale.unsqueeze(-1)
    return out.flatten(-2).to(torch.bfloat16)


class StagedEngramTable:
    """The tierstore table of one staged Engram layer, read through this process's Client.

    client: the process's Client of the sidecar (vllm_plugin.TierstoreEngramTables owns it).
    version is the one served when the layer was built; a lookup that finds another served
    raises StagingError (the checkpoint was checked against this one, and a model never mixes
    versions: restart vLLM)."""

    def __init__(self, client, table: str, layer_id: int):
        h = client.handle(table)
        if h.row_format != ROW_FORMAT:
            raise errors.SpecMismatch(
                f"tierstore table {table!r} (Engram layer {layer_id}) is {h.row_format}; vLLM's Engram rows are "
                f"{ROW_FORMAT}: ingest the checkpoint with `tierstore ingest-checkpoint`")
        self.client, self.table, self.layer_id = client, table, layer_id
        self.version, self.rows, self.dim = h.version, h.rows, h.row_dim
        self.full_resident = h.full_resident

    def check_shape(self, num_embeddings: int, dim: int, block_size: int) -> None:
        """SpecMismatch unless the table is vLLM's layer: num_embeddings rows of dim fp8 values
        and dim / 32 ue8m0 scales."""
        if (self.rows, self.dim) != (num_embeddings, dim) or block_size != FP8_BLOCK:
            raise errors.SpecMismatch(
                f"tierstore table {self.table!r} holds {self.rows} rows x {self.dim} (+ {self.dim // FP8_BLOCK} "
                f"ue8m0 scales, blocks of 32); vLLM's Engram layer {self.layer_id} wants {num_embeddings} x {dim} "
                f"(blocks of {block_size}): ingest the checkpoint vLLM serves (`tierstore ingest-checkpoint`)")

    def check(self, start: int, end: int, verify: str) -> checks.CheckpointCheck:
        """The weight loader of this layer's two placeholders: the checkpoint's rows [start, end)
        checked against the rows read through tierstore (`verify`), never copied."""
        def read(which: str, ids: np.ndarray) -> np.ndarray:
            got = self.read(ids)
            return got[:, :self.dim] if which == "weight" else got[:, self.dim:]

        return checks.CheckpointCheck("vllm", self.layer_id, self.table, self.version, self.rows, self.dim, read,
                                      verify, start, end)

    def read(self, ids: np.ndarray) -> np.ndarray:
        """Rows uint8 [len(ids), dim + dim / 32] (weights then scales, the stored bytes) of
        table ids `ids`, verified; StagingError naming the layer if they cannot be had."""
        try:
            got = self.client.lookup(self.table, np.ascontiguousarray(ids, dtype=np.int64))
            served = self.client.handle(self.table).version
        except (errors.TierstoreError, OSError) as e:
            raise StagingError(
                f"tierstore could not give vLLM's Engram layer {self.layer_id} its rows of table {self.table} "
                f"({type(e).__name__}: {e}); the step stops before the rows are used") from e
        if served != self.version:
            raise StagingError(
                f"tierstore now serves table {self.table} (Engram layer {self.layer_id}) at v{served}; this vLLM "
                f"process checked its checkpoint against v{self.version} and never mixes versions: restart vLLM")
        return got

    def lookup(self, emb, indices: "torch.Tensor", out: "torch.Tensor") -> None:
        """`ParallelEngramEmbedding.lookup(indices, out)` of staged layer `emb`: out [tokens,
        part_n_hash_cols, dim] bf16, or uint8 [tokens, part_n_hash_cols, 264] packed (its
        token stride may be wider: EngramBatch.packed_rows[:, layer]), for this rank's heads
        of indices [tokens, n_hash_cols] (table row ids).

        On CUDA, `indices` is copied to the host here: a sync with the current stream. The
        distinct rows are read into a pinned buffer, copied to the device on the current
        stream, and dequantised (bf16) and gathered there. Raises StagingError before `out` is
        written when a row cannot be read (see `read`) or when a CUDA graph is capturing."""
        import torch

        tokens, part = indices.shape[0], emb.part_n_hash_cols
        if not tokens * part:
            return
        cuda = out.is_cuda
        if cuda and torch.cuda.is_current_stream_capturing():
            raise StagingError(
                f"vLLM's Engram layer {self.layer_id} is staged by tierstore (table {self.table}): its lookup reads "
                f"host rows each step and cannot be captured in a CUDA graph. Run vLLM with breakable CUDA graphs "
                f"(VLLM_USE_BREAKABLE_CUDAGRAPH=1, cudagraph_mode PIECEWISE) or --enforce-eager")
        ids = np.full((tokens, part), -1, dtype=np.int64)  # padded heads (past n_hash_cols) stay unowned
        cols = indices[:, emb.head_start:min(emb.head_start + part, emb.n_hash_cols)]
        ids[:, :cols.shape[1]] = cols.to(device="cpu", dtype=torch.int64).numpy()  # the device sync on CUDA
        flat = ids.reshape(-1)
        owned = (flat >= emb.vocab_start_idx) & (flat < emb.vocab_end_idx)
        uniq, inv = unique_inverse(np.ascontiguousarray(flat[owned]))
        got = self.read(uniq) if uniq.size else np.zeros((0, self.dim + self.dim // FP8_BLOCK), np.uint8)
        where = np.full(flat.size, uniq.size, dtype=np.int64)  # unowned rows read the zero row past the others
        where[owned] = inv
        width = got.shape[1]
        rows = torch.empty((uniq.size + 1, width), dtype=torch.uint8, pin_memory=cuda)
        rows.numpy()[:-1] = got
        rows[-1] = 0
        where_t = torch.from_numpy(where)
        if cuda:
            rows = rows.to(out.device, non_blocking=True)
            where_t = where_t.pin_memory().to(out.device, non_blocking=True)
        if out.dtype == torch.uint8:
            out.copy_(rows.index_select(0, where_t).view(tokens, part, width))
        else:  # distinct rows dequantised, then gathered: the fp32 intermediates are per distinct row
            out.copy_(dequantize(rows, self.dim).index_select(0, where_t).view(tokens, part, self.dim))
