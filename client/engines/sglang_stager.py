"""sglang 0.5.23's Engram rows staged from tierstore: tables larger than RAM (cache mode).

A cache-mode table cannot be sglang's host table (that is the whole table), so
a staged layer holds no rows at all. Ahead of each forward, in the scheduler,
`RowStager` hashes the batch's tokens on the host, reads every layer's rows from
the sidecar's client in one call (Client.lookup_many, step_reads.py: under `serve
--direct-io` the layers' tables read overlapped; resident rows copied from the cache arena,
each checked against its slot's sequence lock; misses read from the segment
files and verified by their row sums, or planned through the sidecar) into
split buffers, fp8 weights [n, 256] and ue8m0 scales [n, 8], pinned on CUDA,
and copies them to the GPU on a side stream. The layer only dequantises them.
It is `EngramRowStager`'s contract (sglang/srt/layers/engram_staging.py), for
extend and decode batches alike (sglang's own stages extend batches only and
leaves decode to the forward's gather from its host table, which a staged
layer does not have).

Seams (registered by the plugin, client/engines/sglang.py; each a no-op in a
process without a staged layer):
- `EngramEmbedding._init_host_table` (the plugin's hook, sglang.py's
  attach_staged): a staged layer gets
  empty placeholder parameters, a weight loader that checks the checkpoint's
  rows against the sidecar's (nothing is copied), and a forward that refuses
  to run: a batch whose rows were not staged raises instead of reading rows.
- `EngramRowStager.from_model` (AROUND), called by `NgramEmbeddingManager`
  when the model runner starts: a model with a staged layer gets a RowStager,
  whatever SGLANG_OPT_DSV41_ENGRAM_HOST_STAGING says; `prepare_for_forward`
  then puts `stage(batch)` on every batch (`batch.engram_staged_rows`), and
  `Engram.embed_rows` hands each layer's entry to `dequant_staged`.
- `EngramEmbedding.dequant_staged` (AROUND): on CUDA sglang's own (wait for the
  copy's event, `engram_gather` over the staged rows); rows on the host (a CPU
  run) are dequantised in torch with the arithmetic of sglang's CPU lookup.
- `Scheduler._add_request_to_queue` (AFTER): a request entering the waiting
  queue gets its prompt's rows prefetched (`Client.prefetch`) with its
  expected wait in steps (RowStager.prefetch).

Decode under CUDA graphs (sglang's default decode backend, FULL or breakable):
a captured graph replays the reads it recorded, so a decode batch that fits the
largest captured batch is staged into persistent buffers
(client/engines/staging_buffers.py: sized at start from sglang's resolved
CudaGraphConfig, the same storage every step), which the graph reads: at capture
the staged layer's forward reads them (`UnstagedForward`), and before each
replay `stage` refills them (rows past the batch's zero, so padded slots read
zero rows). Larger decode batches, and extend batches, are staged per batch.

At sglang's defaults (the simple form: one sync a step). The overlap scheduler
(on by default) builds decode batch N+1 before batch N's sampled tokens reach the
host, and speculative decoding (DSpark, the algorithm sglang serves V4.1 with)
verifies draft tokens proposed on the device inside the step. `stage` returns
DEFERRED for such a batch, and its rows are staged at its ForwardBatch
(`stage_forward`, from the plugin's AROUND hook on `ForwardBatch.init_new`, which
builds every forward's batch: a decode's after its input ids are resolved on the
device, a verify's after its drafts are, before any graph replays): one wait on
the current stream, then the batch's input ids, positions and each request's
committed history (sglang's own `EngramHasher.history`, what its forward hashes
from) copied to the host and hashed there by sglang's own
`EngramHasher._torch_hash_ids` (the host twin of its kernel), then read and put
into the buffers (decode and verify graphs, sized for the largest captured batch
of either) or tensors of their own. DSpark's draft model has no Engram layer: its
forwards (a draft worker's model runner) stage nothing. A DEFERRED entry read by
a layer (the hook missing) raises StagingError.

A step never uses rows it could not verify: a lookup that fails (DATA_LOSS, a
sidecar that cannot plan a miss, ...) raises StagingError from `stage`, in the
scheduler, before the forward; a table the sidecar now serves at another
version raises too (restart sglang; the model never mixes versions).

Not staged, and so refused with the fix where a staged layer would need it:
beam search rows and prefill context parallelism; an extend batch whose tokens are
still on the device (sglang's --enable-mixed-chunk under the overlap scheduler)
raises StagingError naming the flag.
"""
from __future__ import annotations

import logging
import threading
from array import array

import numpy as np

from tierstore.client.engines import StagingError, checks
from tierstore.client.engines.checks import FP8_BLOCK
from tierstore.client.engines.device_fill import FAST_TOKENS, device_layers
from tierstore.client.engines.slot_probe import SlotProbe
from tierstore.client.engines.staging_buffers import StagingBuffers
from tierstore.client.engines import step_reads
from tierstore.client.engines.step_reads import PREFETCH_TOKENS
from tierstore.client.row_scratch import RowScratch

__all__ = ["RowStager", "StagedTable", "StagedHostTable", "read_layers", "gather_layers", "UnstagedForward", "upload",
           "process_client", "decode_graph_batch", "dequant_rows", "from_model", "dequant_staged", "on_enqueue",
           "init_forward_batch", "Deferred", "DEFERRED", "PendingRows", "close"]

log = logging.getLogger("tierstore.client.engines.sglang")


# checks.FEATURES rows this module refuses
CONTEXT_PARALLEL = "prefill context parallelism (attn_cp_size > 1)"


class Deferred:
    """What `stage` hands a batch whose newest tokens are still on the device when it is
    scheduled (the overlap scheduler's decode batches, speculative decoding's): its rows are
    staged at its ForwardBatch (`init_forward_batch` -> RowStager.stage_forward). A layer that
    reads it instead of staged rows (the ForwardBatch was built without the hook) raises."""

    def __getitem__(self, layer):
        raise StagingError("this batch's Engram rows were to be staged at its ForwardBatch (tierstore's hook on "
                           "sglang's ForwardBatch.init_new), which did not run: no rows are served in place of its "
                           "own; restart sglang with tierstore's plugin loaded (TIERSTORE_SGLANG_SOCKET set)")


DEFERRED = Deferred()


# ---- one layer's table ----------------------------------------------------------------------------
_CLIENTS: dict[str, object] = {}  # socket -> the process's Client of it, shared by every staged layer
_LOCK = threading.Lock()


def process_client(socket: str, timeout: float):
    """This process's Client of the sidecar at `socket`, made once, shared by every staged layer."""
    from tierstore.client.client import Client

    with _LOCK:
        c = _CLIENTS.get(socket)
        if c is None:
            c = _CLIENTS[socket] = Client(socket, timeout=timeout)
        return c


def close() -> None:
    """Close this process's clients of the sidecar and forget its stager (tests, bench: a
    process that outlives the sglang model it staged for)."""
    with _LOCK:
        clients = list(_CLIENTS.values())
        _CLIENTS.clear()
    if RowStager.current is not None:
        RowStager.current.close()
    RowStager.current = None
    for c in clients:
        c.close()


class StagedTable:
    """The tierstore table of one staged layer, read row by row through the sidecar's client.

    version is the one served when the layer was built; a read that finds another raises
    StagingError (the checkpoint's rows were checked against this one). form: how the stager
    gets the layer's rows to the device (checks.STAGE_FORMS; the plugin's config.stage_form)."""

    def __init__(self, client, table: str, form: str = "simple"):
        h = client.handle(table)
        if h.row_format != "fp8-e4m3-ue8m0":
            raise StagingError(f"tierstore table {table} is {h.row_format}; sglang's Engram rows are "
                               f"fp8-e4m3-ue8m0 (ingest the checkpoint with tierstore ingest-checkpoint)")
        self.client, self.table, self.form = client, table, form
        self.version, self.rows, self.dim = h.version, h.rows, h.row_dim
        self.checkpoint = h.checkpoint  # the tensors the rows were ingested from (CheckpointCheck)
        self.full_resident = h.full_resident
        self.scratch = RowScratch(h.row_bytes)  # a batch's distinct rows land here (gather_layers)
        self.probe = SlotProbe(client, table)  # which of a batch's ids are resident (a later layer read behind)

    def shape(self, which: str) -> tuple[int, int]:
        return (self.rows, self.dim if which == "weight" else self.dim // FP8_BLOCK)

    def read(self, which: str, rows: np.ndarray) -> np.ndarray:
        """uint8 [len(rows), width] of the weights or the scales of `rows` (CheckpointCheck)."""
        got = read_layers([self], [np.ascontiguousarray(rows, dtype=np.int64)])[0]
        return got[:, :self.dim] if which == "weight" else got[:, self.dim:]

    def gather(self, ids: np.ndarray, weight: np.ndarray, scale: np.ndarray) -> None:
        """weight[k] = the fp8 bytes of row ids[k], scale[k] its ue8m0 bytes (gather_layers)."""
        gather_layers([self], [ids], [weight], [scale])


def read_layers(tables: list, ids: list, outs: list | None = None) -> list[np.ndarray]:
    """Rows uint8 [n, dim + dim / 32] of ids[i] (int64) of staged table tables[i], every layer's
    read at once (step_reads.read_layers: overlapped under --direct-io; into outs[i] where given),
    at the version its layer was built on. StagingError naming the table otherwise."""
    return step_reads.read_layers(
        tables, ids, outs,
        failed=lambda which, e: (f"tierstore could not give sglang's Engram rows of table "
                                 f"{', '.join(t.table for t in which)} for this batch ({type(e).__name__}: {e}); "
                                 f"no rows were staged"),
        moved=lambda t, v: (f"tierstore now serves table {t.table} at v{v}; this sglang process checked its "
                            f"checkpoint against v{t.version} and never mixes versions: restart sglang"))


def gather_layers(tables: list, ids: list, weights: list, scales: list) -> None:
    """weights[i][k] = the fp8 bytes of row ids[i][k] of staged table tables[i], scales[i][k] its
    ue8m0 bytes: every layer's rows in one read (read_layers) into its RowScratch, a row for every
    position (a lookup takes repeats, and tells the sidecar each step's distinct ids), then split
    into the two buffers. Not the distinct rows first: that costs a unique_inverse of every
    position, more than the repeats save, since Engram's hashed n-grams of real text repeat little
    within a step (docs/decisions.md, "The stagers read every position")."""
    got = read_layers(tables, ids, [t.scratch.take(np.size(i)) for t, i in zip(tables, ids)])
    for rows, weight, scale in zip(got, weights, scales):
        _split(rows, weight, scale)


def _split(rows: np.ndarray, weight: np.ndarray, scale: np.ndarray) -> None:
    """weight / scale = the fp8 / ue8m0 bytes of packed rows `rows` [n, dim + dim / 32]."""
    dim = weight.shape[1]
    weight[...] = rows[:, :dim]
    scale[...] = rows[:, dim:]


class StagedHostTable:
    """What sglang reads of a staged layer's `host_table` (its layout, finish_load): no rows
    here ("staged" is not sglang's "shared", so none of its gathers address it)."""

    layout = "staged"

    def __init__(self, staged: StagedTable):
        self.staged = staged
        self.dirty = False

    def finish_load(self, label: str) -> None:
        log.info("engram host table %s: tierstore table %s v%d, staged per batch (%s)", label, self.staged.table,
                 self.staged.version, "full-resident" if self.staged.full_resident else "cache mode")


class UnstagedForward:
    """A staged layer's EngramEmbedding.forward, which sglang calls only for a batch without
    staged rows: empty batches get empty rows; the capture of a decode graph reads the
    stager's persistent buffers (what every replay reads, refilled by `stage` before it); the
    capture of a piecewise prefill graph gets zero rows (its replays' eager segment reads the
    rows staged for them); any other batch raises."""

    def __init__(self, embed, table: str):
        self.embed, self.table = embed, table

    def __call__(self, indices, forward_batch=None, *, cp_all_tokens: bool = False):
        mode = getattr(forward_batch, "forward_mode", None)
        if indices.shape[0] == 0:
            return self.embed.new_rows(indices)
        stager = RowStager.current
        if stager is not None and stager.form == "fast":  # the device looks the rows up itself, graphs included
            return stager.fast_rows(self.embed, indices)
        if _capturing():
            if mode is not None and mode.is_extend_without_speculative():
                return self.embed.new_rows(indices).zero_()  # the replay's eager segment reads its staged rows
            graph = mode is not None and (mode.is_decode() or mode.is_target_verify())
            if graph and stager is not None and stager.buffers is not None:
                return stager.graph_rows(self.embed, indices)
            raise StagingError(f"sglang's Engram table {self.table} is staged by tierstore, which stages a captured "
                               f"graph's rows for decode and target-verify batches, into buffers sized from "
                               f"sglang's decode graph batch sizes; this {getattr(mode, 'name', 'unknown')} "
                               f"capture has none")
        raise StagingError(f"sglang's Engram table {self.table} is staged per batch by tierstore, and this "
                           f"{getattr(mode, 'name', 'unknown')} batch's rows were not staged (a forward that "
                           f"neither sglang's prepare_for_forward nor its ForwardBatch.init_new staged); no rows "
                           f"are served in place of its own")


def _capturing() -> bool:
    try:
        from sglang.srt.model_executor.runner_utils.capture_mode import get_is_capture_mode
    except ImportError:
        return False
    return bool(get_is_capture_mode())


# ---- the stager -------------------------------------------------------------------------------------
class PendingRows:
    """A later layer's staged rows, being read on the stager's host thread while the forward
    runs the layers before it: `wait()` (the layer's lookup, dequant_staged) gives its (rows,
    scales, copied) once read, or raises the read's StagingError; the seconds it blocked are
    the stager's `waited` (the part of the layer's read the forward did not hide)."""

    def __init__(self, stager: "RowStager", future):
        self.stager, self.future = stager, future

    def wait(self) -> tuple:
        import time

        t = time.perf_counter()
        try:
            return self.future.result()[0]
        finally:
            self.stager.waited += time.perf_counter() - t


class RowStager:
    """EngramRowStager's contract over tierstore: `stage(batch)` -> per Engram layer (by its
    layer_hash_index) (fp8 rows uint8 [n, dim], ue8m0 scales uint8 [n, dim / 32], the copy's
    CUDA event or None on the host), n = tokens x hash columns in the forward's order; None
    for a batch with nothing to stage (idle, empty, a mode the forward stages itself); DEFERRED
    for a decode batch whose newest tokens are still on the device (the overlap scheduler,
    speculative decoding), whose rows `stage_forward` stages at its ForwardBatch.

    Every Engram layer of the model is staged (from_model refuses a mix). Raises
    StagingError when rows cannot be had.

    graph_tokens: the largest batch (tokens) a captured decode or target-verify graph runs, 0
    when decode runs eagerly (decode_graph_batch's requests x the tokens each verifies). With
    it, decode and verify batches of up to that many tokens are staged into `buffers`
    (StagingBuffers, graph_tokens x hash columns rows a layer), whose entries `stage` and
    `stage_forward` return and `graph_rows` reads at capture. Batches are
    numbered (`step`); an entry of the buffers carries its batch's number (`tierstore_step` on
    its rows), and `dequant_staged` serves it only while the layer's buffer still holds that
    batch's rows (StagingBuffers.rows: StagingError otherwise, never another batch's rows).

    behind: step_reads.BEHIND (which later layers are read behind the forward). form:
    checks.STAGE_FORMS, "simple" (the above) or "fast" (`stage` stages nothing; each layer's
    forward looks its rows up on the device, `fast_rows`), its fill channels holding the misses
    of `step_tokens` tokens (the most a batch runs, `from_model`; FAST_TOKENS where 0), or of
    `graph_tokens`."""

    current: "RowStager | None" = None  # the process's stager, for the scheduler's prefetch hook

    def __init__(self, hasher, engrams: list, device, graph_tokens: int = 0, behind: str = "misses",
                 form: str = "simple", step_tokens: int = 0):
        import torch

        self.hasher, self.device = hasher, torch.device(device)
        self.n = hasher.max_ngram_size
        self.n_layers = int(hasher.primes.shape[0])
        self.cols = int(np.prod(hasher.primes.shape[1:]))  # hash columns a layer: (n - 1) x heads
        self.layers = [(m.layer_hash_index, m.embed.tierstore_table) for m in engrams]
        self.dim = int(engrams[0].embed.dim)
        self.cuda = self.device.type == "cuda"
        # the schedule stream waits on the running forward; a side stream's copies overlap it
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        # "fast": `stage` stages nothing and each layer's forward looks its rows up on the device (fast_rows)
        self.form = checks.check_stage_form(form, "TIERSTORE_SGLANG_STAGE_FORM")
        self.buffers = (StagingBuffers(len(self.layers), graph_tokens * self.cols, self.dim, FP8_BLOCK, self.device)
                        if graph_tokens > 0 and self.form == "simple" else None)
        self._slot = {id(table): i for i, (_, table) in enumerate(self.layers)}  # table -> its buffers' layer
        self.step = 0  # the number of the last batch staged into the buffers
        # which later layers are read on a host thread behind the forward (step_reads.BEHIND); the
        # thread, made at the first such batch; their fills not yet waited
        self.behind = step_reads.check_behind(behind)
        self._host = step_reads.HostThread()
        self._pending: list[PendingRows] = []
        self.waited = 0.0  # seconds the forward's lookups waited for later layers' fills
        tables = [t for _, t in self.layers]  # the fast form's DeviceLayer of each, by id(table)
        self._device = (device_layers(tables, read_layers, self.device,
                                      max(graph_tokens, step_tokens or FAST_TOKENS) * self.cols,
                                      [f"sglang's Engram table {t.table}" for t in tables])
                        if self.form == "fast" else {})

    @classmethod
    def from_model(cls, model, hasher, device) -> "RowStager | None":
        """A RowStager when any Engram layer of `model` is staged by tierstore, else None."""
        from sglang.srt.layers.engram import Engram
        from sglang.srt.runtime_context import get_parallel, get_schedule, get_spec, max_speculative_num_draft_tokens

        engrams = sorted((m for m in model.modules() if isinstance(m, Engram)), key=lambda m: m.layer_hash_index)
        staged = [getattr(m.embed, "tierstore_table", None) is not None for m in engrams]
        if not any(staged):
            return None
        if not all(staged):  # e.g. a sidecar whose --split-layout names some of the tables
            raise StagingError("some of sglang's Engram layers are staged by tierstore and others are mapped or "
                               "sglang's own: serve every Engram table split-layout (--split-layout all, when they "
                               "fit) or set TIERSTORE_SGLANG_STAGE=on to stage them all")
        try:
            cp = get_parallel().attn_cp_size
        except ValueError:  # no parallel config published: a module built outside a server (tests, bench)
            cp = 1
        try:  # a verify graph runs each request's draft tokens: the buffers hold the largest such batch
            per_request = (max_speculative_num_draft_tokens() or 1) if get_spec().speculative_algorithm else 1
        except ValueError:  # no spec published: a module built outside a server (tests, bench)
            per_request = 1
        graph_tokens = decode_graph_batch(_published_graph_config()) * per_request
        try:  # the most tokens an extend batch runs: its chunk, at most the prefill budget
            schedule = get_schedule()
            step_tokens = max(schedule.chunked_prefill_size or 0, schedule.max_prefill_tokens or 0)
        except ValueError:  # no schedule published: a module built outside a server (tests, bench)
            step_tokens = 0
        if cp > 1:
            raise checks.EngineRefused.of("sglang", CONTEXT_PARALLEL, f"attn_cp_size {cp}")
        stager = cls(hasher, engrams, device, graph_tokens, form=engrams[0].embed.tierstore_table.form,
                     step_tokens=step_tokens)
        RowStager.current = stager
        return stager

    # ---- a batch ----
    def stage(self, batch):
        mode = batch.forward_mode
        if mode is None or mode.is_idle() or not batch.reqs or self.form == "fast":
            return None  # the fast form: the layer's forward looks its rows up on the device (fast_rows)
        if mode.is_decode():
            spec = getattr(batch, "spec_algorithm", None)
            if (spec is not None and not spec.is_none()) or not self._on_host(batch):
                return DEFERRED  # staged at its ForwardBatch, once its tokens are final on the device
            tokens, positions = self._decode_windows(batch)
        elif mode.is_extend_without_speculative():
            tokens, positions = self._extend_windows(batch)
        else:
            return None  # target-verify, draft and prebuilt batches: a staged layer's forward refuses them
        if tokens.shape[0] == 0:
            return None
        return self._stage_ids(self._hash(tokens, positions), graph=mode.is_decode())

    def stage_forward(self, forward_batch) -> list:
        """The rows of a decode or target-verify ForwardBatch whose batch `stage` DEFERRED: one
        wait on the current stream (the last step's sampled tokens, a verify block's drafts and
        the history its commit wrote are all enqueued there before this batch's forward), its
        input ids, positions and requests' history rows (sglang's EngramHasher.history, what its
        forward hashes from) copied to the host, hashed there by sglang's own
        `_torch_hash_ids`, read, and staged as `stage` stages a decode batch."""
        import torch
        from sglang.srt.layers import engram

        mode = forward_batch.forward_mode
        if mode.is_target_verify():
            kmode, block = engram.MODE_VERIFY, int(forward_batch.spec_info.draft_token_num)
        elif mode.is_decode():
            kmode, block = engram.MODE_DECODE, 1
        else:
            raise StagingError(f"a {mode.name} batch's Engram rows were deferred to its forward: tierstore stages "
                               f"decode and target-verify batches there")
        input_ids = forward_batch.input_ids
        if input_ids.is_cuda:
            torch.cuda.current_stream(input_ids.device).synchronize()
        slots = forward_batch.req_pool_indices
        tokens, reqs = int(input_ids.shape[0]), int(slots.shape[0])
        if tokens != reqs * block:
            raise StagingError(f"a target-verify batch of {reqs} requests has {tokens} tokens, not {block} each (a "
                               f"ragged verify): sglang's Engram hash takes equal blocks; run DSpark's static verify")
        ids, _ = self.hasher._torch_hash_ids(input_ids.cpu(), forward_batch.positions.cpu(), kmode,
                                             self.hasher.history[slots].cpu(), tokens, block, None, None)
        return self._stage_ids(ids.numpy(), graph=True)

    def _stage_ids(self, ids: np.ndarray, graph: bool) -> list:
        """Stage hash ids `ids` [tokens, layers, hash columns]: into the persistent buffers for a
        batch a captured graph may run (`graph`) that fits them, else into tensors of its own.

        The first layer's rows are read now; a later layer's (step_reads.read_now, by `behind`:
        by default one whose ids the slot index does not all hold) on the stager's host thread while
        the forward runs the layers before it, its entry a PendingRows that the layer's lookup
        waits for (dequant_staged): only the first layer's misses are exposed. A batch a CUDA
        graph replays (buffers on CUDA) has every layer read now: a replay runs no host code
        between its layers."""
        self._drain()
        n = ids.shape[0] * self.cols
        buffered = graph and self.buffers is not None and self.buffers.fits(n)
        fill = self._fill_buffers if buffered else self._fill_own
        if buffered:
            self.step += 1
        slots = list(range(len(self.layers)))
        tables = [t for _, t in self.layers]
        now = slots if buffered and self.cuda else step_reads.read_now(self.behind, tables, self._layer_ids(ids, slots))
        staged = [None] * self.n_layers
        for i, entry in zip(now, fill(ids, now, n)):
            staged[self.layers[i][0]] = entry
        for i in (i for i in slots if i not in now):
            pending = PendingRows(self, self._host.submit(fill, ids, [i], n))
            self._pending.append(pending)
            staged[self.layers[i][0]] = (pending, None, None)
        return staged

    def _drain(self) -> None:
        """Wait for the later layers' fills still running (a forward that never reached them:
        their buffers must not be written by two steps at once); their errors were the
        forward's to raise."""
        for pending in self._pending:
            pending.future.exception()
        self._pending.clear()

    def _layer_ids(self, ids: np.ndarray, slots: list[int]) -> list[np.ndarray]:
        return [np.ascontiguousarray(ids[:, self.layers[i][0]].reshape(-1)) for i in slots]

    def _fill_buffers(self, ids: np.ndarray, slots: list[int], n: int) -> list:
        """Layers `slots` of a batch a captured graph may run: their rows read, then into the
        persistent buffers (rows past them zeroed), copied on the side stream; each entry's rows
        carry the batch's number."""
        tables = [self.layers[i][1] for i in slots]
        got = read_layers(tables, self._layer_ids(ids, slots), [t.scratch.take(n) for t in tables])
        for i, rows in zip(slots, got):
            self.buffers.fill(i, n, lambda weight, scale, rows=rows: _split(rows, weight, scale))
        _, _, copied = self.buffers.publish(n, self.step, self.copy_stream, layers=slots)
        out = []
        for i in slots:
            weight, scale = self.buffers.rows(i, n, self.step)
            weight.tierstore_step = self.step
            out.append((weight, scale, copied))
        return out

    def close(self) -> None:
        """Wait for the later layers' fills and stop the stager's host threads."""
        self._drain()
        self._host.close(self._device)

    def fast_rows(self, embed, indices):
        """The fast form's bf16 [*indices.shape, dim] of staged layer `embed` for sglang's own hash
        ids `indices` [tokens, hash columns] (on the device, read there), looked up by the layer's
        DeviceLayer (no host step, no device sync: a CUDA graph captures it), dequantised as
        `dequant_rows` does."""
        import torch

        rows = self._device[id(embed.tierstore_table)].lookup(indices.reshape(-1).to(torch.int64))
        return dequant_rows(embed, rows[:, :self.dim].contiguous(), rows[:, self.dim:].contiguous(), indices.shape)

    def check(self, embed, rows) -> None:
        """StagingError unless staged rows `rows` that layer `embed` reads are still its batch's:
        rows of the persistent buffers (they carry their batch's number) must be what the layer's
        buffer holds (StagingBuffers.rows); rows staged per batch are the batch's own."""
        step = getattr(rows, "tierstore_step", None)
        if step is not None:
            self.buffers.rows(self._slot[id(embed.tierstore_table)], rows.shape[0], step)

    def graph_rows(self, embed, indices):
        """What a captured decode graph's staged layer `embed` reads for hash ids `indices`
        [bs, hash columns] (their values unread: the rows are the ones `stage` put in the
        buffers before the replay): bf16 [bs, hash columns, dim], zero past the batch."""
        n = indices.numel()
        if not self.buffers.fits(n):
            raise StagingError(f"a captured decode graph of {indices.shape[0]} requests is larger than the "
                               f"{self.buffers.capacity // self.cols}-request staging buffers sized from sglang's "
                               f"decode graph batch sizes (tierstore read them at start): restart sglang")
        i = self._slot[id(embed.tierstore_table)]
        return dequant_rows(embed, self.buffers.weight[i, :n], self.buffers.scale[i, :n], indices.shape)

    def _fill_own(self, ids: np.ndarray, slots: list[int], n: int) -> list:
        """Layers `slots` of a batch staged into buffers of its own: their rows read at once, then
        one copy to the device on the side stream (each layer's entry a view of it)."""
        import torch

        weight = torch.empty((len(slots), n, self.dim), dtype=torch.uint8, pin_memory=self.cuda)
        scale = torch.empty((len(slots), n, self.dim // FP8_BLOCK), dtype=torch.uint8, pin_memory=self.cuda)
        gather_layers([self.layers[i][1] for i in slots], self._layer_ids(ids, slots), list(weight.numpy()),
                      list(scale.numpy()))
        copied = None
        if self.cuda:
            weight, scale, copied = upload(weight, scale, self.device, self.copy_stream)
        return [(weight[j], scale[j], copied) for j in range(len(slots))]

    def _hash(self, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """sglang's own hash of predecessor windows (EngramHasher.hash_windows, on the host):
        the ids its forward computes, [T, layers, hash columns]."""
        import torch

        t = torch.from_numpy(tokens)
        blocked = torch.from_numpy(positions[:, None] < np.arange(self.n))
        ids, _ = self.hasher.hash_windows(t, blocked)
        return ids.cpu().numpy()

    def _extend_windows(self, batch) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [T, n]: column s the s-th predecessor, 0 before the sequence start;
        positions [T]) of an extend batch's tokens in the forward's order."""
        from sglang.srt.model_executor.encoder_swa_replay import replay_len

        resets = batch.encoder_swa_reset or []
        spans = []
        for i, (req, prefix, extend) in enumerate(zip(batch.reqs, batch.prefix_lens, batch.extend_lens, strict=True)):
            head = replay_len(prefix) if i < len(resets) and resets[i] else 0  # an encoder SWA replay's head
            spans.append((req, prefix - head, extend + head))
        return self._windows(spans, "extend")

    def _decode_windows(self, batch) -> tuple[np.ndarray, np.ndarray]:
        """The windows of a decode batch: each request's newest token, at seq_len - 1."""
        seq = [int(v) for v in batch.seq_lens_cpu.tolist()]
        if len(seq) != len(batch.reqs):
            raise StagingError(f"a decode batch of {len(batch.reqs)} requests has {len(seq)} rows (beam search): "
                               f"tierstore's row stager does not stage those")
        return self._windows([(req, s - 1, 1) for req, s in zip(batch.reqs, seq)], "decode")

    @staticmethod
    def _on_host(batch) -> bool:
        """Whether every request's newest token of decode batch `batch` is on the host (its ids
        reach seq_len): not under the overlap scheduler, whose batch N+1 is built before N's
        sampled tokens are processed."""
        return all(int(s) <= _fill_len(req) for req, s in zip(batch.reqs, batch.seq_lens_cpu.tolist()))

    def _windows(self, spans, what: str) -> tuple[np.ndarray, np.ndarray]:
        """spans: (request, first position, tokens) in the forward's order. One slice of each
        request's ids (its look-back and its tokens), then one vectorised gather."""
        lookback = self.n - 1
        segs, lens, starts = [], [], []
        for req, start, length in spans:
            if length <= 0:
                continue
            lo = max(0, start - lookback)
            seg = _slice_ids(req, lo, start + length)
            if seg.size < start + length - lo:
                raise StagingError(f"a {what} batch's newest token of request {req.rid} is still on the device "
                                   f"(a decode request mixed into an extend batch under the overlap scheduler): "
                                   f"tierstore stages an extend batch from its tokens on the host; run sglang "
                                   f"without --enable-mixed-chunk")
            segs.append(np.zeros(lookback - (start - lo), np.int64))
            segs.append(seg)
            lens.append(length)
            starts.append(start)
        if not lens:
            return np.zeros((0, self.n), np.int64), np.zeros(0, np.int64)
        flat = np.concatenate(segs)
        lens_a, starts_a = np.asarray(lens), np.asarray(starts)
        seg_base = np.concatenate([[0], np.cumsum(lens_a + lookback)[:-1]])  # each request's slice in flat
        within = np.arange(lens_a.sum()) - np.repeat(np.cumsum(lens_a) - lens_a, lens_a)
        at = np.repeat(seg_base + lookback, lens_a) + within  # each token's own index in flat
        tokens = flat[at[:, None] - np.arange(self.n)]
        return tokens, np.repeat(starts_a, lens_a) + within

    # ---- a queued request ----
    def prefetch(self, req, wait_steps: int, run_steps: int = 1) -> int:
        """Prefetch the rows of queued request `req` (its first PREFETCH_TOKENS tokens) from every
        cache-mode table, for a request expected to run after `wait_steps` steps, for `run_steps`
        (step_reads.queued_hint: read now when that is within READ_AHEAD_STEPS steps, else only
        hinted). Returns the ids hinted; never raises a sidecar's error into the scheduler."""
        tables = [(k, t) for k, t in self.layers if not t.full_resident]
        if not tables:
            return 0
        tokens, positions = self._windows([(req, 0, min(_fill_len(req), PREFETCH_TOKENS))], "prefetch")
        if tokens.shape[0] == 0:
            return 0
        ids = self._hash(tokens, positions)
        return step_reads.prefetch_layers([t for _, t in tables], [ids[:, k] for k, _ in tables], wait_steps,
                                          run_steps, req.rid)


def decode_graph_batch(cuda_graph_config) -> int:
    """The largest decode batch (requests) sglang replays in a captured decode graph under its
    resolved `cuda_graph_config` (CudaGraphConfig; None: no graphs), 0 when decode runs eagerly:
    with the tokens each request verifies under speculative decoding, what the persistent
    staging buffers hold."""
    decode = None if cuda_graph_config is None else cuda_graph_config.decode
    if decode is None or decode.backend == "disabled":
        return 0
    sizes = [*(decode.bs or ()), *([decode.max_bs] if decode.max_bs else [])]
    if not sizes:
        raise StagingError("sglang's decode CUDA graph batch sizes are not resolved (cuda_graph_config.decode has "
                           "neither bs nor max_bs): tierstore sizes its staging buffers from them; set "
                           "--cuda-graph-max-bs-decode")
    return int(max(sizes))


def _published_graph_config():
    """sglang's resolved CudaGraphConfig, None when none is published (a module built outside
    a server: tests, bench)."""
    try:
        from sglang.srt.runtime_context import get_exec

        return get_exec().graph.cuda_graph_config
    except (ImportError, ValueError):
        return None


def dequant_rows(embed, rows, scales, hash_shape):
    """bf16 [*hash_shape, embed.dim] of staged rows (fp8 uint8 [n, dim], ue8m0 uint8 [n, dim / 32],
    n <= the rows of hash_shape), zero past them. On CUDA sglang's engram_gather, as its
    dequant_staged runs it (without the wait: the caller's stream is ordered after the copy);
    on the host sglang's CPU lookup's arithmetic (_owned_rows): fp32(e4m3) x fp32(e8m0),
    rounded once to bf16, which is also engram_gather's."""
    import torch

    if rows.is_cuda:
        from sglang.srt.layers import engram

        out = torch.empty(*hash_shape, embed.dim, dtype=torch.bfloat16, device=rows.device)
        flat = out.view(-1, embed.dim)
        engram.engram_gather(rows.data_ptr(), scales.data_ptr(),
                             torch.arange(flat.shape[0], dtype=torch.int32, device=rows.device), flat, embed.dim,
                             FP8_BLOCK, row_hi=rows.shape[0])
        return out
    out = torch.zeros(*hash_shape, embed.dim, dtype=torch.bfloat16)
    flat = out.view(-1, embed.dim)
    n = rows.shape[0]
    w = rows.view(torch.float8_e4m3fn).float().unflatten(-1, (-1, FP8_BLOCK))
    s = scales.view(torch.float8_e8m0fnu).float()
    flat[:n] = (w * s.unsqueeze(-1)).flatten(-2).to(torch.bfloat16)
    return out


def upload(weight, scale, device, stream):
    """(rows, scales, copied): pinned host buffers copied to `device` on `stream` (a side
    stream, so the copies overlap the forward running on the main one), `copied` the event
    the layer waits on before it reads them. The pinned buffers go back to torch's host
    allocator, which reuses them only once the copies that read them are done."""
    import torch

    with torch.cuda.stream(stream):
        rows = weight.to(device, non_blocking=True)
        scales = scale.to(device, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(stream)
    return rows, scales, copied


def _fill_len(req) -> int:
    return len(req.origin_input_ids) + len(req.output_ids)


def _slice_ids(req, lo: int, hi: int) -> np.ndarray:
    """int64 ids [lo, hi) of origin_input_ids + output_ids (fewer where the request has
    fewer), sliced without joining the whole prompt (it can be 100k tokens)."""
    origin, output = req.origin_input_ids, req.output_ids
    o = len(origin)
    parts = []
    if lo < o:
        parts.append(_as_int64(origin[lo:min(hi, o)]))
    if hi > o:
        parts.append(_as_int64(output[max(0, lo - o):hi - o]))
    return np.concatenate(parts) if len(parts) > 1 else (parts[0] if parts else np.zeros(0, np.int64))


def _as_int64(ids) -> np.ndarray:
    if isinstance(ids, array) and ids.typecode == "q":
        return np.frombuffer(ids, dtype=np.int64)  # sglang's ids are array("q"): no copy
    return np.asarray(ids, dtype=np.int64).reshape(-1)


# ---- the hooks ----------------------------------------------------------------------------------------
def from_model(original, cls, model, hasher, device):
    """AROUND EngramRowStager.from_model: tierstore's RowStager for a model with a staged
    layer; sglang's own stager otherwise."""
    stager = RowStager.from_model(model, hasher, device)
    return stager if stager is not None else original(cls, model, hasher, device)


def dequant_staged(original, embed, rows, scales, copied, hash_shape):
    """AROUND EngramEmbedding.dequant_staged: sglang's own on CUDA; rows staged on the host are
    dequantised by `dequant_rows` (sglang's CPU lookup's arithmetic). Rows past the staged
    ones are 0. Rows of the persistent buffers are checked to be still their batch's first
    (RowStager.check)."""
    if isinstance(rows, PendingRows):  # a later layer's rows, read while the layers before it ran
        rows, scales, copied = rows.wait()
    if RowStager.current is not None:
        RowStager.current.check(embed, rows)
    if rows.is_cuda:
        return original(embed, rows, scales, copied, hash_shape)
    return dequant_rows(embed, rows, scales, hash_shape)


def init_forward_batch(original, cls, batch, model_runner, **kwargs):
    """AROUND ForwardBatch.init_new (every forward's batch is built by it, before the forward or
    its graph replay): a target model's batch whose rows `stage` DEFERRED gets them here
    (RowStager.stage_forward), once its tokens are final on the device. A draft worker's
    forwards (DSpark's draft model has no Engram layer) and every other batch pass untouched."""
    forward_batch = original(cls, batch, model_runner, **kwargs)
    stager = RowStager.current
    if (stager is not None and forward_batch.engram_staged_rows is DEFERRED
            and not model_runner.is_draft_worker):
        forward_batch.engram_staged_rows = stager.stage_forward(forward_batch)
    return forward_batch


def on_enqueue(result, scheduler, req, is_retracted: bool = False):
    """AFTER Scheduler._add_request_to_queue: a request that joined the waiting queue has its
    rows prefetched, its wait estimated from the tokens queued ahead of it in prefill chunks
    (sglang's queue policy may reorder the queue: it is an estimate, and a hint). The earliest
    it can run: sglang runs a prefill before any decode while its queue holds work it can
    admit, so the estimate counts no decode steps (step_reads.queued_hint: a hint that ends
    early costs little, one that outlives its request a lot)."""
    stager = RowStager.current
    queue = getattr(scheduler, "waiting_queue", None)
    if stager is None or not queue or queue[-1] is not req:
        return result  # not queued here (aborted, disaggregated prefill's bootstrap queue)
    chunk = getattr(scheduler, "chunked_prefill_size", None) or PREFETCH_TOKENS
    ahead = sum(_fill_len(r) for r in queue[:-1])
    try:
        stager.prefetch(req, wait_steps=ahead // chunk, run_steps=-(-min(_fill_len(req), PREFETCH_TOKENS) // chunk))
    except Exception:  # noqa: BLE001 - a hint must never fail the scheduler
        log.exception("tierstore prefetch of request %s failed", req.rid)
    return result
