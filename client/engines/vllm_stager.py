"""vLLM's Engram rows staged from tierstore: tables larger than RAM (cache mode).

A table the sidecar serves in cache mode has no split arena for vLLM's
`ParallelEngramEmbedding` parameters to view, and vLLM's own allocation (the
whole table in pinned host memory under cpu_offload) is what does not fit. So a
staged layer holds no rows at all: its `weight` / `weight_scale_inv` are
zero-row placeholders, and every read of the table -- `ParallelEngramEmbedding.lookup(indices,
out)`, the one method both of vLLM's callers use (`Engram.prepare_embeddings`:
bf16 rows into `Engram.staged_rows`; `EngramBatch._stage`: packed 264-byte rows
into `EngramBatch.packed_rows`) -- reads rows tierstore staged for the step
before the forward.

The step. vLLM's V2 model runner (its only runner from 0.34, the default before)
builds every forward's model inputs through the model's state,
`DeepseekV41ModelState.prepare_inputs(input_batch, req_states)`, on the host before
`execute_model` runs the forward: its kernels write the step's input ids (the last step's
sampled tokens and, under speculative decoding, the drafts, both from device state),
positions and each request's look-back window (`lookback_token_ids`, gathered from the
token history), which vLLM's hash (`_hash_ids_kernel`) reads. The plugin
(client/engines/vllm_plugin.py) wraps that method; `stage_runner_step` waits once for the
stream that writes them (the simple form at vLLM's defaults: under async scheduling the
step is prepared while the last one still runs, so this wait is for its sampled tokens),
copies them to the host and builds each token's n-gram window from them (`step_windows`),
and `StepStager.stage` hashes them on the host (tierstore's NgramHasher over vLLM's own
compression map, checked against vLLM's multipliers; it agrees with `_hash_ids_kernel`,
tests/client/engines/test_hash_agreement_vllm.py), reads each staged layer's rows through
tierstore's client, every layer's in one call (Client.lookup_many, step_reads.py: under
`serve --direct-io` the layers' tables read overlapped; resident rows copied from the cache
arena under its seqlock, misses read from the segment files and verified by their row sums)
and copies them to the device on a side stream, the forward's stream waiting for the copy.
The layer's lookup only reads them: no `.cpu()`, no device sync, nothing a CUDA graph
cannot capture. A dummy forward (vLLM's profile run, a data-parallel rank's padding run, a
graph capture: its requests are none the runner holds) is a step of zero rows.

CUDA graphs (vLLM's default FULL_AND_PIECEWISE: FULL graphs for uniform decode
batches, which record the lookup itself). A step of at most `graph_tokens`
tokens (the largest batch vLLM captures, from its resolved CompilationConfig) is
staged into persistent StagingBuffers (client/engines/staging_buffers.py): the same
storage every step, rows past the step's zero, so a graph captured at any size
reads the step's rows, then zero rows for its padding. Larger steps (prefill
chunks past the largest graph: eager) get tensors of their own.

Served at vLLM's defaults: async scheduling and speculative decoding (DSpark, the method
vLLM serves V4.1 with; its draft model has no Engram layer, and the verify step's drafts
are read from its input ids) are staged from the step's own inputs, as above. Refused at
start (check_engine, checks.FEATURES): micro-batching and prefill context parallelism (a
forward that looks up part of the step), Engram DP-sharded tables (a rank's lookup reads
the other ranks' gathered hash ids) and, on vLLM 0.33, the V1 model runner
(VLLM_USE_V2_MODEL_RUNNER=0: the plugin stages from the V2 runner's seam).

Invariants:
- A step never reads rows that were not verified: a checksum failure
  (DATA_LOSS), a sidecar that is away or cannot plan a miss, or a table now
  served at another version raises StagingError naming the layer, from `stage`
  for the first layer (before the forward, nothing of the step staged) and from
  its lookup for a later one (read on the stager's thread behind the forward:
  `StepStager.stage_ids`), before any of its rows are used.
- The output is what `_engram_lookup_kernel` writes for the same table: ids
  outside [vocab_start_idx, vocab_end_idx) and padded heads (head >=
  n_hash_cols) give zero rows; bf16 rows are fp32(e4m3) x 2^(ue8m0 - 127),
  the scale made as the kernel makes it (the byte shifted into the fp32
  exponent field: byte 0 is 0.0, byte 255 is inf), rounded once to bf16;
  packed rows are the 264 stored bytes. `dequantize` is that arithmetic.
- Each distinct id of a layer's step is read once.
- Nothing reads a staged table in place: `_storage()` raises StagingError
  (vLLM's Engram DP peer exchange reads tables that way).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from tierstore import errors
from tierstore.client.engines import StagingError, checks
from tierstore.client.engines.checks import FP8_BLOCK
from tierstore.client.engines.device_fill import FAST_TOKENS, device_layers
from tierstore.client.engines.slot_probe import SlotProbe
from tierstore.client.engines.staging_buffers import StagingBuffers
from tierstore.client.engines import step_reads
from tierstore.client.engines.step_reads import PREFETCH_TOKENS
from tierstore.client.row_scratch import RowScratch

if TYPE_CHECKING:
    import torch

__all__ = ["StagedEngramTable", "StepStager", "dequantize", "dequantize_split", "graph_tokens", "check_engine",
           "windows", "step_windows", "stage_runner_step", "hash_windows", "hasher_of", "QueueHints", "ROW_FORMAT"]

log = logging.getLogger("tierstore.client.engines.vllm")
ROW_FORMAT = "fp8-e4m3-ue8m0"
# checks.FEATURES rows this module refuses
RUNNER_V1 = "the V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0, vLLM 0.33)"
MICRO_BATCHES = "micro-batching (--enable-dbo, --ubatch-size)"
CONTEXT_PARALLEL = "prefill context parallelism (--prefill-context-parallel-size)"
ENGRAM_DP = "Engram DP-sharded tables (embedding_across_dp)"


def dequantize(packed: "torch.Tensor", dim: int) -> "torch.Tensor":
    """bf16 [..., dim] of packed rows uint8 [..., dim + dim // 32], with `_engram_lookup_kernel`'s
    arithmetic: fp32(e4m3 value) x fp32 whose bits are (ue8m0 byte << 23), rounded once to bf16
    (round to nearest even). The torch reference of the kernel's PACKED=False branch."""
    return dequantize_split(packed[..., :dim], packed[..., dim:], dim)


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
        self.checkpoint = h.checkpoint  # the tensors the rows were ingested from (CheckpointCheck)
        self.full_resident = h.full_resident
        self.part = None  # the rank's heads, set by `bind`
        # a step's rows land here (every owned position), then the zero row a padded head reads
        self.scratch = RowScratch(h.row_bytes, spare=1)
        self.probe = SlotProbe(client, table)  # which of a step's ids are resident (a later layer read behind)

    def check(self, start: int, end: int, verify: str) -> checks.CheckpointCheck:
        """The weight loader of this layer's two placeholders: the checkpoint's rows [start, end)
        checked against the rows read through tierstore (`verify`), never copied."""
        def read(which: str, ids: np.ndarray) -> np.ndarray:
            got = self.read(ids)
            return got[:, :self.dim] if which == "weight" else got[:, self.dim:]

        return checks.CheckpointCheck("vllm", self.layer_id, self.table, self.version, self.rows, self.dim, read,
                                      verify, start, end, checkpoint=self.checkpoint)

    def read(self, ids: np.ndarray) -> np.ndarray:
        """Rows uint8 [len(ids), dim + dim / 32] (weights then scales, the stored bytes) of
        table ids `ids`, verified; StagingError naming the layer if they cannot be had."""
        return read_layers([self], [np.ascontiguousarray(ids, dtype=np.int64)])[0]

    def bind(self, emb) -> None:
        """Record the rank's share of the table that staged layer `emb` (a ParallelEngramEmbedding)
        reads: its heads [head_start, head_start + part_n_hash_cols) of n_hash_cols (heads past
        n_hash_cols are padding) and its rows [vocab_start_idx, vocab_end_idx)."""
        self.head_start, self.part, self.n_hash_cols = emb.head_start, emb.part_n_hash_cols, emb.n_hash_cols
        self.vocab = (emb.vocab_start_idx, emb.vocab_end_idx)

    def want(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(mine int64, where int64 [tokens x part]) of hash ids `ids` [tokens, n_hash_cols]
        (table row ids): the row of every (token, head) of this rank's heads that is in the
        rank's rows, token-major, repeats kept, and each (token, head)'s place among them,
        len(mine) for a padded head or an id outside the rank's rows (they read the zero row
        the scratch keeps after the rows: what `_engram_lookup_kernel` writes for them). Not
        the distinct rows: a unique_inverse of every position costs more than the repeats of
        real text's n-grams save (a lookup takes repeats: docs/decisions.md, "The stagers read every position")."""
        tokens = ids.shape[0]
        heads = np.full((tokens, self.part), -1, dtype=np.int64)  # padded heads stay unowned
        cols = ids[:, self.head_start:min(self.head_start + self.part, self.n_hash_cols)]
        heads[:, :cols.shape[1]] = cols
        flat = heads.reshape(-1)
        owned = (flat >= self.vocab[0]) & (flat < self.vocab[1])
        mine = np.ascontiguousarray(flat[owned])
        where = np.full(flat.size, mine.size, dtype=np.int64)
        where[owned] = np.arange(mine.size)
        return mine, where

    def fill(self, fetched: tuple[np.ndarray, np.ndarray], weight: np.ndarray, scale: np.ndarray) -> None:
        """weight [n, dim] / scale [n, dim / 32] = the fp8 / ue8m0 bytes of `fetched`'s rows in order."""
        rows, where = fetched
        # mode "clip": `where` is in range, and "raise" gathers into a temporary first
        np.take(rows[:, :self.dim], where, axis=0, out=weight, mode="clip")
        np.take(rows[:, self.dim:], where, axis=0, out=scale, mode="clip")

    def lookup(self, emb, indices: "torch.Tensor", out: "torch.Tensor", stager: "StepStager") -> None:
        """`ParallelEngramEmbedding.lookup(indices, out)` of staged layer `emb`: out [tokens,
        part_n_hash_cols, dim] bf16, or uint8 [tokens, part_n_hash_cols, 264] packed (its token
        stride may be wider: EngramBatch.packed_rows[:, layer]), from the rows the process's
        StepStager `stager` staged for this step's tokens before the forward. `indices` is not read (the
        stager hashed the same tokens on the host): only its shape, host metadata, so the lookup
        never syncs the device and a CUDA graph can capture it (it reads the persistent buffers
        at fixed addresses). Tokens past the step's (a graph's padding) get zero rows."""
        import torch

        tokens, part = indices.shape[0], emb.part_n_hash_cols
        if not tokens * part:
            return
        if stager.form == "fast":  # the device looks the rows up itself (DeviceLayer)
            weight, scale = stager.fast_rows(self, indices)
        else:
            weight, scale = stager.rows(self, tokens)
        weight, scale = weight.view(tokens, part, self.dim), scale.view(tokens, part, self.dim // FP8_BLOCK)
        if out.dtype == torch.uint8:
            out[..., :self.dim].copy_(weight)
            out[..., self.dim:].copy_(scale)
        else:
            out.copy_(dequantize_split(weight, scale, self.dim))


def read_layers(tables: list, ids: list, outs: list | None = None) -> list[np.ndarray]:
    """Rows uint8 [n, dim + dim / 32] of ids[i] (int64) of staged layer tables[i], every layer's
    read at once (step_reads.read_layers: overlapped under --direct-io; into outs[i] where given),
    at the version its layer was built on. StagingError naming the layer otherwise."""
    return step_reads.read_layers(
        tables, ids, outs,
        failed=lambda which, e: (f"tierstore could not give vLLM's Engram layer "
                                 f"{', '.join(str(t.layer_id) for t in which)} its rows of table "
                                 f"{', '.join(t.table for t in which)} ({type(e).__name__}: {e}); the step stops "
                                 f"before the rows are used"),
        moved=lambda t, v: (f"tierstore now serves table {t.table} (Engram layer {t.layer_id}) at v{v}; this vLLM "
                            f"process checked its checkpoint against v{t.version} and never mixes versions: "
                            f"restart vLLM"))


def dequantize_split(weight: "torch.Tensor", scale: "torch.Tensor", dim: int) -> "torch.Tensor":
    """`dequantize` of rows held as fp8 bytes uint8 [..., dim] and ue8m0 bytes [..., dim / 32]."""
    import torch

    values = weight.view(torch.float8_e4m3fn).to(torch.float32)
    factor = (scale.to(torch.int32) << 23).view(torch.float32)
    out = values.unflatten(-1, (dim // FP8_BLOCK, FP8_BLOCK)) * factor.unsqueeze(-1)
    return out.flatten(-2).to(torch.bfloat16)


# ---- the step's rows ----------------------------------------------------------------------------------
def step_tokens(vllm_config) -> int:
    """The most tokens vLLM schedules in one step (`scheduler_config.max_num_batched_tokens`):
    what the fast form's fill channels hold the misses of. 0 without a config (a model built
    outside vLLM's engine: tests, bench)."""
    return 0 if vllm_config is None else int(vllm_config.scheduler_config.max_num_batched_tokens)


def graph_tokens(vllm_config) -> int:
    """The largest batch (tokens) vLLM replays in a captured CUDA graph under its resolved
    `vllm_config.compilation_config` (`max_cudagraph_capture_size`, set by VllmConfig's own
    `_set_cudagraph_sizes`), 0 when it captures none (cudagraph_mode NONE, --enforce-eager):
    what the persistent staging buffers hold. None (no config: a model built outside vLLM's
    engine, tests, bench) is 0."""
    if vllm_config is None:
        return 0
    from vllm.config import CUDAGraphMode

    cc = vllm_config.compilation_config
    if cc.cudagraph_mode is None or cc.cudagraph_mode == CUDAGraphMode.NONE:
        return 0
    sizes = [*(cc.cudagraph_capture_sizes or ()), *([cc.max_cudagraph_capture_size] if cc.max_cudagraph_capture_size
                                                    else [])]
    return int(max(sizes, default=0))


def check_engine(vllm_config, emb, layer_id: int) -> None:
    """EngineRefused (at model build, vLLM's start) for the settings under which the stager cannot
    stage a step's rows for its forward: micro-batching and prefill context parallelism (a
    forward that looks up part of the step's tokens), Engram DP-sharded tables (a rank's lookup
    reads the other ranks' gathered hash ids, whose tokens it does not hold), and vLLM 0.33's
    V1 model runner (the step hook is the V2 runner's). Async scheduling and speculative
    decoding are served (stage_runner_step). None: nothing to check (a model built outside
    vLLM's engine)."""
    found = f"Engram layer {layer_id}"
    if emb.dp_size > 1:
        raise checks.EngineRefused.of("vllm", ENGRAM_DP, f"{found}: Engram DP of {emb.dp_size}")
    if vllm_config is None:
        return
    parallel = vllm_config.parallel_config
    if parallel.enable_dbo or parallel.ubatch_size > 1:
        raise checks.EngineRefused.of("vllm", MICRO_BATCHES, f"{found}: enable_dbo {parallel.enable_dbo}, "
                                      f"ubatch_size {parallel.ubatch_size}")
    if (pcp := parallel.prefill_context_parallel_size) > 1:
        raise checks.EngineRefused.of("vllm", CONTEXT_PARALLEL, f"{found}: prefill_context_parallel_size {pcp}")
    # last: vLLM 0.33 falls back to its V1 runner for some of the settings above (0.34 has the V2 runner only)
    if not getattr(vllm_config, "use_v2_model_runner", True):
        raise checks.EngineRefused.of("vllm", RUNNER_V1, f"{found}: vLLM's V1 model runner")


class StepStager:
    """The rows of every staged Engram layer of this process for the step vLLM runs next.

    `stage(windows)` (the runner's hook, before the forward, on the host): hash the step's
    tokens with `hasher` (NgramHasher, bit-identical to vLLM's `_hash_ids_kernel`), read each
    staged layer's rows through tierstore and put them where the layers' lookups read them
    (`rows`). A step of at most `capacity` tokens (graph_tokens: the largest captured batch)
    is staged into the persistent StagingBuffers, the storage every captured graph reads;
    a larger one (eager: no graph runs it) into tensors of its own. On CUDA the rows are
    copied on a side stream and the current stream (the forward's) waits for the copy.
    `stage_none()`: a forward whose rows nothing reads (vLLM's dummy runs, graph captures),
    a step of zero rows.

    Steps are numbered (`step`); the rows of a step carry its number (StagingBuffers.steps,
    and the own tensors of a step past capacity), and `rows` serves a layer only the rows
    staged for the current step: a layer whose fill was skipped, a step that failed half way,
    or a second forward of one staged step (a forward vLLM ran without the hook: each layer
    reads a real step's rows once) raises StagingError, never zeros or the last step's rows.

    tables: the staged layers' StagedEngramTables (each bound to its embedding), one per layer.
    form: checks.STAGE_FORMS, "simple" (the above) or "fast" (`fast_rows`: the layers look their
    rows up on the device, no step staged on the host); its fill channels hold the misses of
    `step_tokens` tokens (`step_tokens(vllm_config)`; FAST_TOKENS where 0), or of `capacity`."""

    def __init__(self, tables: list, capacity: int, device, hasher=None, form: str = "simple", step_tokens: int = 0):
        import torch

        parts = {t.part for t in tables}
        if len(parts) != 1 or len({t.dim for t in tables}) != 1:
            raise StagingError(f"tierstore's staged Engram layers differ in heads or width ({sorted(parts)} heads): "
                               f"vLLM builds every layer alike; serve the tables one checkpoint was ingested to")
        self.tables = sorted(tables, key=lambda t: t.layer_id)
        self.slot = {id(t): i for i, t in enumerate(self.tables)}
        self.part, self.dim = parts.pop(), self.tables[0].dim
        self.capacity, self.device = capacity, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        # "fast": the runner hook stages nothing and each layer's lookup looks its rows up on the device (fast_rows)
        self.form = checks.check_stage_form(form, "TIERSTORE_VLLM_STAGE_FORM")
        self.buffers = (StagingBuffers(len(self.tables), capacity * self.part, self.dim, FP8_BLOCK, self.device)
                        if capacity > 0 and self.form == "simple" else None)
        self.hasher = hasher
        self.step = 0  # the current step's number: 0 before the first
        self.real = False  # whether the current step has tokens (not a dummy forward's)
        self.tokens = 0  # tokens of the current step
        self._own = None  # per layer (weights, scales, copied) [tokens x part, ...] of a step past capacity
        # which later layers are read on a host thread behind the forward (step_reads.BEHIND); the
        # thread, made at the first such step; each later layer's fill
        self.behind = "misses"
        self._host = step_reads.HostThread()
        self._pending: dict = {}
        self.waited = 0.0  # seconds the forward's lookups waited for later layers' fills
        self._read = np.zeros(len(self.tables), dtype=np.int64)  # the real step each layer last read
        self._device = (device_layers(self.tables, read_layers, self.device,
                                      max(capacity, step_tokens or FAST_TOKENS) * self.part,
                                      [f"vLLM's Engram layer {t.layer_id}" for t in self.tables])
                        if self.form == "fast" else {})  # the fast form's DeviceLayer of each layer, by id(table)

    def stage(self, windows: np.ndarray) -> None:
        """Stage the step whose tokens' n-gram windows are `windows` int64 [tokens, max_ngram]
        (raw token ids in the forward's order; column s the s-th predecessor, -1 before the
        sequence's start). Raises StagingError (nothing staged) when a row cannot be had."""
        if self.hasher is None:
            raise StagingError("tierstore's vLLM stager has no hasher: the runner hook builds it from the model")
        self.stage_ids(self._hash(windows))

    def stage_ids(self, ids: dict[int, np.ndarray]) -> None:
        """`stage` of hash ids already made: {layer id: table row ids [tokens, n_hash_cols]} of
        every staged layer, one token count. The first layer's rows are read now; a later layer's
        (step_reads.read_now, by `behind`: by default one whose ids the slot index does not all
        hold) on the stager's host thread while the forward runs the layers before it, waited
        for at its lookup (`rows`). A step a CUDA graph may replay (persistent buffers
        on CUDA) has every layer read now: a replay runs no host code between layers."""
        self._drain()
        self._begin(real=True)
        tokens = next(iter(ids.values())).shape[0]
        n = tokens * self.part
        buffered = self.buffers is not None and self.buffers.fits(n)
        wanted = [t.want(ids[t.layer_id]) for t in self.tables]
        slots = list(range(len(self.tables)))
        now = slots if buffered and self.cuda else step_reads.read_now(self.behind, self.tables,
                                                                         [w[0] for w in wanted])
        self._own = [None] * len(self.tables)
        for i, own in zip(now, self._fill(wanted, now, n, buffered)):
            self._own[i] = own
        for i in (i for i in slots if i not in now):
            self._pending[i] = self._host.submit(self._fill, wanted, [i], n, buffered)
        self.tokens = tokens

    def _fill(self, wanted: list, slots: list[int], n: int, buffered: bool) -> list:
        """Layers `slots` of the step: their rows read at once, before any write, into their
        scratch (RowScratch), then into the persistent buffers (published for the step) or
        tensors of their own (copied on the side stream on CUDA). Returns each layer's own
        (weight, scale, copied), None for a buffered one."""
        import torch

        tables = [self.tables[i] for i in slots]
        rows = [t.scratch.take(wanted[i][0].size) for i, t in zip(slots, tables)]  # then a zero row
        read_layers(tables, [wanted[i][0] for i in slots], [r[:-1] for r in rows])
        out = []
        for i, t, r in zip(slots, tables, rows):
            got = (r, wanted[i][1])
            if buffered:
                self.buffers.fill(i, n, lambda weight, scale, t=t, got=got: t.fill(got, weight, scale))
                out.append(None)
                continue
            weight = torch.empty((n, self.dim), dtype=torch.uint8, pin_memory=self.cuda)
            scale = torch.empty((n, self.dim // FP8_BLOCK), dtype=torch.uint8, pin_memory=self.cuda)
            t.fill(got, weight.numpy(), scale.numpy())
            copied = None
            if self.cuda:
                from tierstore.client.engines.sglang_stager import upload

                weight, scale, copied = upload(weight, scale, self.device, self.copy_stream)
            out.append((weight, scale, copied))
        if buffered:
            self.buffers.publish(n, self.step, self.copy_stream, layers=slots)
        return out

    def _drain(self) -> None:
        """Wait for the later layers' fills still running (a forward that never reached them:
        the buffers must not be written by two steps at once); their errors were the
        forward's to raise."""
        for future in self._pending.values():
            future.exception()
        self._pending.clear()

    def close(self) -> None:
        """Wait for the later layers' fills and stop the stager's host threads."""
        self._drain()
        self._host.close(self._device)

    def stage_none(self) -> None:
        """A forward whose rows nothing reads (vLLM's profile and dummy runs, a graph capture's):
        a step of no tokens, every layer's lookup zero rows (the persistent buffers zeroed, so a
        graph replayed for it reads zeros too)."""
        self._drain()
        self._begin(real=False)
        if self.buffers is not None:
            for i in range(len(self.tables)):
                self.buffers.fill(i, 0, lambda weight, scale: None)
            self.buffers.publish(0, self.step, self.copy_stream)

    def _begin(self, real: bool) -> None:
        """Number a new step before any of it is staged: a step that fails half way leaves no
        layer filled for the current step, so its lookups raise."""
        self.step += 1
        self.real, self.tokens, self._own = real, 0, None

    def rows(self, table: StagedEngramTable, tokens: int) -> tuple["torch.Tensor", "torch.Tensor"]:
        """(fp8 bytes [tokens x part, dim], ue8m0 bytes [tokens x part, dim / 32]) of `table`'s
        layer for a lookup of `tokens` tokens (the forward's, padding included): the current
        step's rows, zero past them. Under a capture, views of the persistent buffers (what every
        replay reads, refilled by each step). StagingError (StagingBuffers.rows) for a layer not
        filled for the current step, a real step's layer read a second time, or a lookup of
        fewer tokens than the step staged: a forward tierstore did not stage."""
        import torch

        i, n = self.slot[id(table)], tokens * self.part
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            if self.buffers is None or not self.buffers.fits(n):
                raise StagingError(
                    f"a captured CUDA graph of {tokens} tokens is larger than the {self.capacity}-token staging "
                    f"buffers tierstore sized from vLLM's resolved cudagraph capture sizes at start: restart vLLM")
            return self.buffers.weight[i, :n], self.buffers.scale[i, :n]
        if self.real:
            again = self._read[i] == self.step
            if again or tokens < self.tokens:
                raise StagingError(
                    f"vLLM's Engram layer {table.layer_id} looked up {tokens} tokens at step {self.step}, which "
                    f"tierstore staged for {self.tokens} tokens{' and this layer has read' if again else ''}: vLLM "
                    f"ran a forward whose rows tierstore did not stage (a runner path that bypasses "
                    f"DeepseekV41ModelState.prepare_inputs); no rows are served in place of its own")
            self._read[i] = self.step
        if i in self._pending:  # a later layer's rows, read while the layers before it ran
            t = time.perf_counter()
            try:
                self._own[i] = self._pending.pop(i).result()[0]
            finally:
                self.waited += time.perf_counter() - t
        own = None if self._own is None else self._own[i]
        if own is not None:
            weight, scale, copied = own
            if copied is not None:
                torch.cuda.current_stream(self.device).wait_event(copied)
        elif self.buffers is not None:  # rows past the step's are zero up to the capacity
            weight, scale = self.buffers.rows(i, min(n, self.buffers.capacity), self.step)
        elif self.step == 0:
            raise StagingError(f"vLLM's Engram layer {table.layer_id} looked up rows before tierstore staged any "
                               f"step: vLLM ran a forward without DeepseekV41ModelState.prepare_inputs")
        else:  # a step of no rows
            weight = scale = None
        return _padded(weight, scale, n, self.dim, self.device)

    def _hash(self, windows: np.ndarray) -> dict[int, np.ndarray]:
        return hash_windows(self.hasher, windows, [t.layer_id for t in self.tables])

    def fast_rows(self, table: StagedEngramTable, indices: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
        """The fast form's (fp8 bytes [tokens x part, dim], ue8m0 bytes [..., dim / 32]) of `table`'s
        layer for vLLM's own hash ids `indices` [tokens, n_hash_cols] (on the device, read there):
        the rank's heads of its rows, a padded head or an id outside its rows a zero row, as
        `_engram_lookup_kernel` reads them; looked up by the layer's DeviceLayer (no host step,
        no device sync: a CUDA graph captures it)."""
        import torch

        tokens = indices.shape[0]
        cols = indices[:, table.head_start:min(table.head_start + self.part, table.n_hash_cols)].to(torch.int64)
        ids = torch.full((tokens, self.part), -1, dtype=torch.int64, device=indices.device)
        ids[:, :cols.shape[1]] = cols
        ids = torch.where((ids >= table.vocab[0]) & (ids < table.vocab[1]), ids, -1)
        rows = self._device[id(table)].lookup(ids.reshape(-1))
        return rows[:, :self.dim], rows[:, self.dim:]


def _padded(weight, scale, n: int, dim: int, device) -> tuple["torch.Tensor", "torch.Tensor"]:
    """(weight, scale) with zero rows past theirs up to n rows (padding past a step: a graph's,
    or DP ranks padded alike); None: n zero rows."""
    import torch

    have = 0 if weight is None else weight.shape[0]
    if have >= n:
        return weight[:n], scale[:n]
    zeros = (torch.zeros((n - have, dim), dtype=torch.uint8, device=device),
             torch.zeros((n - have, dim // FP8_BLOCK), dtype=torch.uint8, device=device))
    if weight is None:
        return zeros
    return torch.cat([weight, zeros[0]]), torch.cat([scale, zeros[1]])


def windows(token_ids: np.ndarray, starts: np.ndarray, counts: np.ndarray, n: int,
            rows: np.ndarray | None = None) -> np.ndarray:
    """int64 [sum(counts), n]: the n-gram windows of a step's tokens in the forward's order, from
    the token table `token_ids` [table rows, max_len] (the V2 runner's host token history):
    request r's tokens are positions [starts[r], starts[r] + counts[r]) of table row rows[r]
    (r itself without `rows`); column s is the s-th predecessor, -1 before position 0. One
    vectorised gather."""
    req = np.repeat(np.arange(counts.size), counts)
    first = np.cumsum(counts) - counts
    pos = starts[req] + (np.arange(req.size) - first[req])
    back = pos[:, None] - np.arange(n)
    row = req if rows is None else np.asarray(rows, dtype=np.int64)[req]
    out = token_ids[row[:, None], np.maximum(back, 0)].astype(np.int64)
    out[back < 0] = -1
    return out


def step_windows(input_batch, lookback_token_ids: "torch.Tensor", n: int) -> np.ndarray:
    """int64 [tokens, n]: the n-gram windows of the step vLLM's V2 runner prepared, in the
    forward's order, from the inputs its hash reads (`_hash_ids_kernel`): `input_batch`'s
    input ids, positions and query_start_loc and the model state's `lookback_token_ids` (each
    request's n - 1 tokens before its chunk, gathered on the device from the token history).
    Column s is the s-th predecessor: a token of the request's chunk, else its look-back
    window's, -1 before the sequence's start (and where the window holds none, which the
    kernel also reads as the pad id).

    One wait on the current stream first, then the copies: vLLM writes these inputs with
    kernels (the last step's sampled tokens, under async scheduling still being sampled when
    the step is prepared; draft tokens proposed on the device under speculative decoding; the
    positions from the device's computed-token counts), so the host reads them once they are
    final. The simple form of staging at vLLM's defaults: one sync a step."""
    import torch

    tokens, reqs = int(input_batch.num_tokens), int(input_batch.num_reqs)
    device = input_batch.input_ids.device
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    ids = input_batch.input_ids[:tokens].cpu().numpy().astype(np.int64)
    pos = input_batch.positions[:tokens].cpu().numpy().astype(np.int64)
    starts = input_batch.query_start_loc[:reqs + 1].cpu().numpy().astype(np.int64)
    back = lookback_token_ids[:reqs].cpu().numpy().astype(np.int64)
    t = np.arange(tokens)
    req = np.searchsorted(starts[1:], t, side="right")  # each token's request
    chunk = pos[starts[req]]  # the position of its request's first token this step
    shift = np.arange(n)
    q = pos[:, None] - shift  # the predecessor's position
    in_chunk = q >= chunk[:, None]
    col = np.clip(chunk[:, None] - 1 - q, 0, back.shape[1] - 1)  # its column of the look-back window
    out = np.where(in_chunk, ids[np.maximum(t[:, None] - shift, 0)], back[req[:, None], col])
    out[q < 0] = -1
    return out


def stage_runner_step(stager: "StepStager", model_state, input_batch, req_states) -> None:
    """Stage the step vLLM's V2 runner prepared (the plugin calls it from
    `DeepseekV41ModelState.prepare_inputs`, after vLLM's own, before `execute_model` runs the
    forward): the step's windows from the inputs vLLM's hash reads (`step_windows`, one wait
    on the stream that writes them), so a step of tokens still on the device when it was
    scheduled (async scheduling, draft tokens) is staged as vLLM hashes it. A batch of requests
    the runner does not hold (`InputBatch.make_dummy`'s: a profile or padding run) is a step of
    no rows. The hasher is made at the first step."""
    if stager.form == "fast":
        return  # the layers look their rows up on the device (StepStager.fast_rows)
    count = input_batch.num_reqs
    if count == 0 or input_batch.req_ids[0] not in req_states.req_id_to_index:
        stager.stage_none()
        return
    if stager.hasher is None:
        stager.hasher = hasher_of(model_state.model, model_state.vllm_config)
    stager.stage(step_windows(input_batch, model_state.lookback_token_ids, stager.hasher.order))


def hash_windows(hasher, windows: np.ndarray, layer_ids) -> dict[int, np.ndarray]:
    """{layer id: table row ids [tokens, columns]} of the windows' last tokens (`windows`
    int64 [tokens, max_ngram], as `windows` makes them), as vLLM's `_hash_ids_kernel` computes
    them: ids before the sequence's start read the pad id, and an image token (dead) and
    every token before it too."""
    seq = windows[:, ::-1]  # oldest first
    before = seq < 0
    ids = np.where(before, 0, seq)
    dead = hasher.dead_mask(ids)
    ids = hasher.map_raw(ids)
    ids[before] = hasher.pad
    if dead is not None:
        dead &= ~before
    return {L: np.ascontiguousarray(hasher.hash(ids, L, dead=dead)[:, -1]) for L in layer_ids}


def hasher_of(model, vllm_config):
    """tierstore's NgramHasher of vLLM's model: its NgramHashState's layout and token map (the
    compression map vLLM built from the tokenizer, read once), checked against vLLM's own
    primes and multipliers (SpecMismatch if they differ)."""
    from vllm.models.deepseek_v41.common.engram import NgramHashState

    state = next((m for m in model.modules() if isinstance(m, NgramHashState)), None)
    if state is None:
        raise StagingError("vLLM's model has staged Engram layers and no NgramHashState: tierstore hashes as it "
                           "does, and found nothing to hash like")
    hasher = _hasher(state.layout, state.token_map.cpu().numpy(), vllm_config)
    ours = [(hasher.spec.primes(L).tolist(), hasher.spec.multipliers(L).tolist()) for L in state.layout.layer_ids]
    theirs = [([p for order in primes for p in order], m) for primes, m in
              zip(state.layout.primes, state.multipliers.cpu().tolist())]
    if ours != theirs:
        raise errors.SpecMismatch("tierstore's Engram primes or hash multipliers differ from vLLM's for this model: "
                                  "the config's engram fields do not describe the tables vLLM hashes into")
    return hasher


def _hasher(layout, token_map: np.ndarray, vllm_config):
    """NgramHasher of vLLM's EngramLayout `layout` and token map (token id -> compressed id); its
    dead token is the one vLLM's model masks (`image_sentinel_mask`: IMAGE_SENTINEL_BASE_ID, the
    V4.1 config's image_token_id)."""
    from vllm.models.deepseek_v41.common.mm_preprocess import IMAGE_SENTINEL_BASE_ID

    from tierstore.client import EngramSpec, NgramHasher

    evs = vllm_config.model_config.hf_text_config.engram_vocab_size
    spec = EngramSpec(name="vllm", layer_ids=tuple(layout.layer_ids), max_ngram=layout.max_ngram_size,
                      n_heads=layout.n_heads, engram_vocab_size=tuple(evs) if isinstance(evs, list) else evs,
                      compressed_vocab_size=layout.compressed_vocab_size, row_dim=layout.head_dim,
                      row_format=ROW_FORMAT, pad_id=layout.pad_token_id, use_conv=False,
                      image_token_id=IMAGE_SENTINEL_BASE_ID)
    return NgramHasher(spec, np.asarray(token_map, dtype=np.int64))


class QueueHints:
    """The hints of vLLM's queued requests, in its scheduler's process: after
    `Scheduler.add_request` (the plugin wraps it), `on_add_request` hashes the request's prompt
    (its first PREFETCH_TOKENS tokens, every head: the ranks of a host share one sidecar) and
    hints the rows to each cache-mode layer's sidecar (step_reads.prefetch_layers). That
    process need not hold the model (with several ranks it does not), so the hasher is built
    by vLLM's own functions from the config (EngramLayout) and the tokenizer
    (build_compressed_token_map), as the model's NgramHashState builds it.

    layers: the plugin's StagedEngramTables of the staged layers (those in cache mode are
    hinted). Raises SpecMismatch when the tokenizer's compressed vocabulary is not the config's."""

    def __init__(self, layers: list, vllm_config):
        from transformers import AutoTokenizer
        from vllm.models.deepseek_v41.common.engram import EngramLayout, build_compressed_token_map

        model = vllm_config.model_config
        layout = EngramLayout.from_config(model.hf_text_config)
        tokenizer = AutoTokenizer.from_pretrained(model.tokenizer, trust_remote_code=model.trust_remote_code,
                                                  revision=model.revision)
        token_map, size = build_compressed_token_map(tokenizer)
        if size != layout.compressed_vocab_size:
            raise errors.SpecMismatch(f"the tokenizer's compressed vocabulary is {size} ids and the config's "
                                      f"{layout.compressed_vocab_size}: vLLM refuses this model as well")
        self.hasher = _hasher(layout, token_map, vllm_config)
        self.layers = [t for t in layers if not t.full_resident and t.layer_id in layout.layer_ids]

    def on_add_request(self, scheduler, request) -> int:
        """A request that joined `scheduler`'s waiting queue: its prompt's rows hinted, its wait
        estimated from the prompt tokens queued beside it in steps of the scheduler's token
        budget (its queue policy may reorder them: an estimate, and a hint): read in now
        within READ_AHEAD_STEPS steps, else only kept for it until its hinted prompt chunks
        have run (step_reads.queued_hint). Returns the ids hinted; none for
        a streamed request's next input chunk, one not queued, or a prompt of embeddings."""
        if not self.layers or request.prompt_token_ids is None or \
                scheduler.requests.get(request.request_id) is not request or request not in scheduler.waiting:
            return 0
        tokens = np.asarray(request.prompt_token_ids[:PREFETCH_TOKENS], dtype=np.int64)
        if tokens.size == 0:
            return 0
        ahead = sum(r.num_prompt_tokens - r.num_computed_tokens for r in scheduler.waiting if r is not request)
        w = windows(tokens[None], np.zeros(1, np.int64), np.array([tokens.size]), self.hasher.order)
        ids = hash_windows(self.hasher, w, [t.layer_id for t in self.layers])
        budget = max(1, scheduler.max_num_scheduled_tokens)  # the earliest: as if running decodes took none
        return step_reads.prefetch_layers(self.layers, [ids[t.layer_id] for t in self.layers], ahead // budget,
                                          -(-tokens.size // budget), request.request_id)
