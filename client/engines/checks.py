"""What tierstore's engine plugins check: the engine's version and settings at start, and the
checkpoint's Engram tensors against tierstore's rows at load.

`FEATURES` is the one table of what each plugin serves, refuses (with the fix) or has not run
on a GPU, per mode ("mapped": a split-layout arena the engine reads in place; "staged": rows
read through tierstore per batch, a cache-mode table larger than RAM). The plugins raise
`EngineRefused.of(engine, feature, ...)`, whose fix is the table's, and docs/engines.md's
compatibility matrix is `matrix()` printed (`python -m tierstore.client.engines.checks`; a
test holds the page to it).

`check_shape` is what both plugins check first, when a layer is built: the table tierstore
serves is that layer's shape. `CheckpointCheck` is the weight loader both plugins give an
Engram layer's fp8 weight and ue8m0 scale parameters: it checks that the checkpoint tensor is
the one the table was ingested from (what each verify mode compares: its docstring) and
copies nothing. Any difference is a CheckpointMismatch naming the layer and the fix.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

import numpy as np

from tierstore import errors
from tierstore.client.engines import weight_filter
from tierstore.table.checkpoint import TensorSource, tensor_digest

__all__ = ["SUPPORTED", "NO_SOCKET", "FEATURES", "Feature", "EngineRefused", "CheckpointMismatch", "CheckpointCheck",
           "check_shape", "check_stage_form", "check_version", "feature", "matrix", "SAMPLE_ROWS", "CHUNK_ROWS",
           "VERIFY_MODES", "STAGE_FORMS", "FP8_BLOCK"]

# engine -> (distribution name, versions the plugin was written against and tested with: an engine's
# newest release and the one before, oldest first; client/engines/seams.py holds each one's seams)
SUPPORTED = {"sglang": ("sglang", ("0.5.23",)), "vllm": ("vllm", ("0.33.0", "0.34.0"))}
SAMPLE_ROWS = 4096  # rows of each checkpoint tensor compared under verify "sample"
CHUNK_ROWS = 65536  # rows compared or hashed at a time under verify "all" (bounded memory at any table size)
VERIFY_MODES = ("sample", "all", "off")
# how a staged step's rows reach the device, the first the default (docs/decisions.md, "The simple form is the
# stagers' default"): read on the host before the forward, or looked up by the device itself (device_fill.py)
STAGE_FORMS = ("simple", "fast")
FP8_BLOCK = 32  # fp8 values per ue8m0 scale in a tierstore Engram row

log = logging.getLogger("tierstore.client.engines.checks")
REINGEST = "ingest the checkpoint again (`tierstore ingest-checkpoint CKPT --data DIR`, then restart the sidecar)"
WORKS = "works (CPU tests)"
REFUSED = "refused"
NO_GPU = "not tested on GPU"
ENGINES_OWN = "the engine's own (tierstore serves none of its rows; CPU tests)"
MODES = ("mapped", "staged")


@dataclass(frozen=True)
class Feature:
    """One row of the compatibility matrix: `engine`'s `name` under each mode, WORKS (run by
    the CPU tests), NO_GPU (written for CUDA, not run on a GPU yet), ENGINES_OWN (passed to
    the engine untouched) or REFUSED at start with `fix` (the message's remedy); for the
    `versions` of the engine it names (None: every supported one)."""

    engine: str
    name: str
    mapped: str
    staged: str
    fix: str = ""
    versions: tuple[str, ...] | None = None

    def status(self, mode: str) -> str:
        return self.mapped if mode == "mapped" else self.staged


NO_SOCKET = {"sglang": "TIERSTORE_SGLANG_SOCKET", "vllm": "TIERSTORE_VLLM_SOCKET"}  # what turns a plugin on
FEATURES = (
    Feature("sglang", "CPU forward (sglang's torch path)", WORKS, WORKS),
    Feature("sglang", "CUDA forward (engram_gather over the registered arena, UVA)", NO_GPU, NO_GPU),
    Feature("sglang", "ROCm forward (device address from hipHostGetDevicePointer)", NO_GPU, NO_GPU),
    Feature("sglang", "tensor parallelism, shared host-table layout", WORKS, WORKS),
    Feature("sglang", "the overlap scheduler (sglang's default; staged: a decode batch's rows staged at its "
            "ForwardBatch, after one stream wait)", NO_GPU, WORKS),
    Feature("sglang", "speculative decoding (--speculative-algorithm DSPARK, the one V4.1 runs; staged: the "
            "target-verify batch's rows staged at its ForwardBatch, after one stream wait)", NO_GPU, WORKS),
    Feature("sglang", "the fast form (TIERSTORE_SGLANG_STAGE_FORM=fast: each staged layer's forward probes the slot "
            "index on the device and gathers its hits, a host thread fills its misses; no host step, the CPU never "
            "blocks; written for a GPU, run on CPU through the torch reference and Triton's interpreter)",
            "n/a (sglang reads the arena in place)", WORKS),
    Feature("sglang", "an extend batch with a decode request's token still on the device (--enable-mixed-chunk "
            "under the overlap scheduler)", NO_GPU,
            "the simple form refuses the batch (StagingError: it hashes an extend batch's tokens on the host; run "
            "without --enable-mixed-chunk); the fast form hashes on the device: not tested"),
    Feature("sglang", "beam search (a decode batch of more rows than requests)", NO_GPU,
            "the simple form refuses the batch (StagingError: it stages a decode batch from one window a request); "
            "the fast form reads the engine's hash ids: not tested"),
    Feature("sglang", "prefill context parallelism (attn_cp_size > 1)", NO_GPU, REFUSED,
            "a staged batch's rows are the whole batch's, in its order, and each context-parallel rank hashes the "
            "whole prompt: run sglang without prefill context parallelism, or serve the tables split-layout "
            "(tierstore serve --split-layout all) with RAM for them"),
    Feature("sglang", "--load-format dummy", REFUSED, REFUSED,
            "the dummy initialiser writes every parameter and tierstore's arena is mapped read-only: "
            "unset TIERSTORE_SGLANG_SOCKET for dummy-weight runs"),
    Feature("sglang", "peer shards (SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS)", REFUSED, REFUSED,
            "peer shards keep the rows in device memory and never build a host table for tierstore to "
            "serve: unset SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS (the arena is already one copy per host), or "
            "unset TIERSTORE_SGLANG_SOCKET"),
    Feature("sglang", "per_rank host-table layout (SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT)", REFUSED, REFUSED,
            "tierstore's arena is sglang's shared layout (every rank maps the whole table): unset "
            "SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT or set it to shared"),
    Feature("sglang", "numa_shared host-table layout (SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT=numa_shared, proposed "
            "for a later sglang)", REFUSED, REFUSED,
            "tierstore's arena is one shared mapping of the whole table that every rank reads, not a copy per NUMA "
            "node: unset SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT or set it to shared"),
    Feature("vllm", "CPU loading (allocation, weight loader, checkpoint check)", WORKS, WORKS),
    Feature("vllm", "CUDA lookup (_storage() UVA views / staged rows copied on a side stream)", NO_GPU, NO_GPU),
    Feature("vllm", "staged rows hashed on the host before the forward (the V2 model runner's "
            "DeepseekV41ModelState.prepare_inputs: the step's input ids, positions and look-back windows, after one "
            "stream wait)", "n/a (vLLM hashes)", WORKS),
    Feature("vllm", "CUDA graphs, cudagraph_mode FULL_AND_PIECEWISE (vLLM's default; staged: persistent buffers "
            "sized from the resolved capture sizes)", NO_GPU, NO_GPU),
    Feature("vllm", "async scheduling (vLLM's default; staged: the step's inputs read after one stream wait)", NO_GPU,
            WORKS),
    Feature("vllm", "the V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0, vLLM 0.33)", NO_GPU, REFUSED,
            "tierstore stages a step where the V2 model runner (vLLM's default, its only runner from 0.34) builds "
            "the forward's inputs, from its token history in pinned host memory: unset VLLM_USE_V2_MODEL_RUNNER, "
            "or serve the tables split-layout with RAM for them", ("0.33.0",)),
    Feature("vllm", "speculative decoding (--speculative-config; DSpark for V4.1: staged, the verify step's drafts "
            "read from its input ids)", NO_GPU, WORKS),
    Feature("vllm", "the fast form (TIERSTORE_VLLM_STAGE_FORM=fast: each staged layer's lookup probes the slot "
            "index on the device from vLLM's own hash ids and gathers its hits, a host thread fills its misses; no "
            "host step, the CPU never blocks; written for a GPU, run on CPU through the torch reference and "
            "Triton's interpreter)", "n/a (vLLM reads the arena in place)", WORKS),
    Feature("vllm", "micro-batching (--enable-dbo, --ubatch-size)", NO_GPU, REFUSED,
            "a staged step's rows are the whole batch's, in its order, and each micro-batch's forward looks up a "
            "part of it: start vLLM without --enable-dbo and --ubatch-size, or serve the tables split-layout with "
            "RAM for them"),
    Feature("vllm", "prefill context parallelism (--prefill-context-parallel-size)", NO_GPU, REFUSED,
            "a staged step's rows are the whole batch's, in its order, and each context-parallel rank's forward "
            "holds a part of the prompt: run with --prefill-context-parallel-size 1, or serve the tables "
            "split-layout with RAM for them"),
    Feature("vllm", "Engram DP-sharded tables (embedding_across_dp)", NO_GPU, REFUSED,
            "a DP-sharded lookup reads the other DP ranks' hash ids, whose tokens this rank does not hold: run with "
            "--engram-config '{\"cpu_offload\": true, \"embedding_across_dp\": false}', or serve the tables "
            "split-layout with RAM for them"),
    Feature("vllm", "host tables (engram cpu_offload on, vLLM's default)", WORKS, WORKS),
    Feature("vllm", "tables in HBM (engram cpu_offload off)", REFUSED, REFUSED,
            "tierstore serves host tables; with cpu_offload off vLLM keeps the table in HBM itself: turn "
            "cpu_offload on or unset TIERSTORE_VLLM_SOCKET"),
    Feature("vllm", "--load-format dummy", REFUSED, REFUSED,
            "the dummy initialiser fills the Engram parameters and tierstore's arena is read-only: unset "
            "TIERSTORE_VLLM_SOCKET for dummy-weight runs"),
    Feature("vllm", "a model built on the meta device (--load-format ipc_cache: the weight-cache daemon's tensors)",
            ENGINES_OWN, ENGINES_OWN),
)


def feature(engine: str, name: str) -> Feature:
    for f in FEATURES:
        if f.engine == engine and f.name == name:
            return f
    raise KeyError((engine, name))


class EngineRefused(errors.TierstoreError):
    """An engine, or an engine setting, that tierstore's plugin does not serve; the message names
    what was found and the fix. Raised at the engine's start, before any table is built."""

    GRPC_CODE = "FAILED_PRECONDITION"

    @classmethod
    def of(cls, engine: str, name: str, found: str) -> "EngineRefused":
        f = feature(engine, name)
        assert REFUSED in (f.mapped, f.staged), f
        return cls(f"tierstore's {engine} plugin refuses {name} ({found}): {f.fix}")


def check_version(engine: str) -> str:
    """The installed version of `engine` ("sglang" / "vllm"); EngineRefused unless SUPPORTED lists it."""
    from importlib.metadata import PackageNotFoundError, version

    dist, versions = SUPPORTED[engine]
    try:
        have = version(dist)
    except PackageNotFoundError:
        have = None
    if have not in versions:
        raise EngineRefused(f"tierstore's {engine} plugin supports {engine} {', '.join(versions)}, found "
                            f"{have or 'none'}: install {engine} {versions[-1]} (`pip install tierstore[{engine}]`), "
                            f"or unset {NO_SOCKET[engine]} to run {engine} without tierstore")
    return have


def check_stage_form(form: str, variable: str) -> str:
    """`form` if it is one of STAGE_FORMS: "simple" (a staged step's rows read on the host before
    the forward, after one stream wait where the engine builds the step on the device) or "fast"
    (client/engines/device_fill.py: the device looks them up itself and the CPU never blocks;
    written for a GPU, not yet run on one). InvalidArgument naming `variable`, the setting that
    gave it, otherwise."""
    if form not in STAGE_FORMS:
        raise errors.InvalidArgument(f"{variable}={form!r}: use simple (the default: rows read on the host before "
                                     f"the forward) or fast (the device looks them up: for a GPU)")
    return form


def matrix() -> str:
    """docs/engines.md's compatibility matrix, a markdown table made from SUPPORTED and FEATURES."""
    lines = ["| engine | mode | feature | status |", "|---|---|---|---|"]
    for engine, (_, versions) in SUPPORTED.items():
        for version in versions:
            for mode in MODES:
                for f in (f for f in FEATURES if f.engine == engine and version in (f.versions or versions)):
                    status = f.status(mode)
                    cell = f"refused at start: {f.fix}" if status == REFUSED else status
                    lines.append(f"| {engine} {version} | {mode} | {f.name} | {cell} |")
    return "\n".join(lines) + "\n"


class CheckpointMismatch(errors.SpecMismatch):
    """A checkpoint's Engram layer is not the table tierstore serves (its shape, or a row's bytes)."""


_SHOWN = {"sglang": "sglang", "vllm": "vLLM"}


def check_shape(engine: str, layer_id: int, table: str, rows: int, dim: int, want_rows: int, want_dim: int,
                block_size: int = FP8_BLOCK) -> None:
    """CheckpointMismatch unless tierstore table `table` (rows x dim fp8 values and dim / 32
    ue8m0 scales) is `engine`'s Engram layer `layer_id`: want_rows rows of want_dim values,
    scales in blocks of `block_size`. Checked when the layer is built, before any row is read."""
    if (rows, dim) != (want_rows, want_dim) or block_size != FP8_BLOCK:
        name = _SHOWN[engine]
        raise CheckpointMismatch(
            f"tierstore table {table!r} holds {rows} rows x {dim} (+ {dim // FP8_BLOCK} ue8m0 scales, blocks of "
            f"{FP8_BLOCK}); {name}'s Engram layer {layer_id} wants {want_rows} x {want_dim} (blocks of "
            f"{block_size}): the sidecar serves another model's tables, or under other names; ingest the "
            f"checkpoint {name} serves (`tierstore ingest-checkpoint`)")


class CheckpointCheck:
    """The check-not-copy weight loader of one Engram layer's two parameters.

    engine: "sglang" / "vllm" (the messages' subject). table, version: the tierstore table and
    the version served. rows: the table's row count (the checkpoint tensor must have exactly
    these rows); start, end: the rows this rank holds, the only ones compared. read(which, ids)
    -> uint8 [len(ids), width]: tierstore's stored bytes of "weight" (width dim) or "scale"
    (dim / 32) for table rows `ids` (a mapped arena's, or read through the client, verified).
    checkpoint: {"weight" / "scale": TensorSource}, the tensors the served version was ingested
    from (TableHandle.checkpoint), or None: a table with no record. seed: the sample's draw
    (default: fresh from os.urandom, so each start draws other rows; logged, and named in a
    refusal, so the same rows can be drawn again).

    `__call__(param, loaded)` (the engines' weight-loader call; `param` is the weight when it is
    float8_e4m3fn, else the scale) writes nothing. It raises CheckpointMismatch on a tensor of
    another shape, and then by `verify`:

    - "sample" (the default; reads SAMPLE_ROWS rows of the tensor and the shard's header):
      1. SAMPLE_ROWS rows of [start, end) equal the table's: the first, the last (a shifted or
         cut tensor shows there) and the rest drawn at random, a fresh draw each start, so no
         fixed set of rows is ever the only one looked at; the first row that differs is
         refused. A change to k of n rows escapes one start's draw with chance about
         (1 - SAMPLE_ROWS / n) ** k: sampling alone cannot promise to see a small edit.
      2. The tensor is the one ingested. Where it is a view of a shard's mapping (the engines'
         default loaders), its shard's size, mtime, inode and ctime and its header entry are
         compared with the record (a stat and the header, no more of the tensor read): a
         different size or header entry is refused outright (the checkpoint changed); a
         different mtime, inode or ctime is refused with both fixes named, since only the bytes
         tell an edit from a copy (another host, a restore, `cp -p`), and reading them all is
         what "all" does, never done unasked. An edit put back to its old size and mtime
         (`touch -r`, `os.utime`) moves the ctime, which no user can set back. Where the tensor
         is not a shard's view (an eager or prefetched load, a copy) its xxh3-128 is compared
         with the record's, hashed from memory.
    - "all" (reads the tensor whole): every byte. Its xxh3-128 against the one ingest recorded
      (none of the table is read), or, for a table with no digest recorded, every row of
      [start, end) against the table's, CHUNK_ROWS at a time. So a copy of the ingested
      checkpoint starts; a warning says when its shard differs from the record (sampled starts
      would refuse it) and that re-ingesting it binds the table to these files.
    - "off": the shape only.

    A table without a full record still starts under "sample" and "all", with a warning that
    names re-ingesting as the fix: one ingested before records were kept compares the weight
    shard's size and mtime (what its source note kept) and the sampled rows; one not ingested
    from a checkpoint (`tierstore ingest`, `demo-table`), the sampled rows only.
    `mapped(...)` builds one over a split-layout table the engine maps (client/split_table.py)."""

    def __init__(self, engine: str, layer_id: int, table: str, version: int, rows: int, dim: int,
                 read: Callable[[str, np.ndarray], np.ndarray], verify: str, start: int = 0, end: int | None = None,
                 checkpoint: dict[str, TensorSource] | None = None, seed: int | None = None):
        if verify not in VERIFY_MODES:
            raise errors.InvalidArgument(f"verify is one of {', '.join(VERIFY_MODES)}, not {verify!r}")
        self.engine, self.layer_id, self.table, self.version = engine, layer_id, table, version
        self.rows, self.dim, self.read, self.verify = rows, dim, read, verify
        self.start, self.end = start, rows if end is None else end
        self.checkpoint = checkpoint
        self.seed = int.from_bytes(os.urandom(8), "little") if seed is None else seed
        self.checked: list[str] = []

    @classmethod
    def mapped(cls, engine: str, layer_id: int, split, verify: str, start: int = 0,
               end: int | None = None) -> "CheckpointCheck":
        """The check of a layer whose host table is `split` (a SplitTable): rows read straight
        from its mapped weight and scale bytes."""
        def read(which: str, ids: np.ndarray) -> np.ndarray:
            return (split.weight if which == "weight" else split.scale)[ids]

        return cls(engine, layer_id, split.table, split.version, split.rows, split.row_dim, read, verify, start, end,
                   checkpoint=split.checkpoint)

    def width(self, which: str) -> int:
        return self.dim if which == "weight" else self.dim // 32

    def sample(self) -> np.ndarray:
        """The rows a sampled check compares, as offsets into [start, end), ascending: every row
        where there are at most SAMPLE_ROWS, else the first, the last and SAMPLE_ROWS - 2 others
        drawn without repeats by `seed`."""
        n = self.end - self.start
        if n <= SAMPLE_ROWS:
            return np.arange(n)
        drawn = np.random.default_rng(self.seed).choice(n - 2, SAMPLE_ROWS - 2, replace=False) + 1
        return np.concatenate([[0], np.sort(drawn), [n - 1]])

    def __call__(self, param, loaded) -> None:
        import torch

        which = "weight" if param.dtype == torch.float8_e4m3fn else "scale"
        want = (self.rows, self.width(which))
        if tuple(loaded.shape) != want:
            raise CheckpointMismatch(
                f"{self.engine}'s Engram layer {self.layer_id}: checkpoint tensor embed.{which} is "
                f"{tuple(loaded.shape)}, tierstore table {self.table} holds {want}: it does not fit; serve the "
                f"table ingested from this checkpoint (`tierstore ingest-checkpoint`)")
        self.checked.append(which)
        if self.verify == "off":
            return
        raw = loaded.detach().view(torch.uint8)
        rec = (self.checkpoint or {}).get(which)
        if self.verify == "all":
            n = self.end - self.start
            if rec is not None and rec.xxh3_128 is not None:
                self._digest(which, raw, rec)
            else:
                self._rows(which, raw, (np.arange(lo, min(lo + CHUNK_ROWS, n)) for lo in range(0, n, CHUNK_ROWS)))
            self._identity(which, raw, rec, checked=True)
            return
        rows = self.sample()
        log.info("tierstore: %s's Engram layer %d: comparing %d of the %d rows of embed.%s with table %s v%d "
                 "(seed %d)", self.engine, self.layer_id, len(rows), self.end - self.start, which, self.table,
                 self.version, self.seed)
        weight_filter.will_need(raw, rows + self.start)  # the sample's reads queued at once, not one fault at a time
        self._rows(which, raw, (rows,))
        self._identity(which, raw, rec, checked=False)

    def _rows(self, which: str, raw, chunks) -> None:
        """CheckpointMismatch at the first row of `chunks` (offsets into [start, end)) whose bytes
        in `raw` differ from the table's."""
        import torch

        for part in chunks:
            ids = part + self.start
            theirs = raw[torch.from_numpy(ids).to(raw.device)].cpu().numpy()
            differ = np.flatnonzero(np.any(theirs != self.read(which, ids), axis=1))
            if differ.size:
                drawn = f" (the sample's seed: {self.seed})" if self.verify == "sample" else ""
                raise CheckpointMismatch(
                    f"{self._tensor(which)} differs from tierstore table {self.table} v{self.version} at row "
                    f"{int(ids[differ[0]])}: the sidecar serves another checkpoint's table; {self._fix()}{drawn}")

    def _digest(self, which: str, raw, rec: TensorSource) -> None:
        """CheckpointMismatch unless the xxh3-128 of every byte of `raw`, read in order, is `rec`'s."""
        weight_filter.sequential_access(raw)
        h = tensor_digest()
        for lo in range(0, raw.shape[0], CHUNK_ROWS):
            h.update(np.ascontiguousarray(raw[lo:lo + CHUNK_ROWS].cpu().numpy()))
        if h.hexdigest() != rec.xxh3_128:
            raise CheckpointMismatch(
                f"{self._tensor(which)} is not the tensor tierstore table {self.table} v{self.version} was ingested "
                f"from ({rec.tensor} in {rec.file}): its xxh3-128 is {h.hexdigest()}, ingest's {rec.xxh3_128}; "
                f"the checkpoint changed (a fine-tune, a new release?): {self._fix()}")

    def _identity(self, which: str, raw, rec: TensorSource | None, checked: bool) -> None:
        """Step 2 of a sampled check (the class docstring); under "all" (`checked`: every byte
        already found equal) only its warnings."""
        tensor = self._tensor(which)
        if rec is None:
            compared = "every row was compared" if checked else f"only {SAMPLE_ROWS} rows were compared"
            log.warning("tierstore: %s: tierstore table %s v%d records no checkpoint tensor it was ingested from "
                        "(ingested before such records were kept, or not from a checkpoint): %s; %s to record it",
                        tensor, self.table, self.version, compared, REINGEST)
            return
        where = weight_filter.mapped_file(raw)
        try:
            now = None if where is None else TensorSource.at(*where)
        except (OSError, errors.SpecMismatch) as e:
            raise CheckpointMismatch(f"{tensor}: its shard {where[0]} cannot be read as it was ingested ({e}); "
                                     f"{self._fix()}") from None
        if now is None:  # a copy in memory (or a shard replaced since it was mapped): only its bytes tell
            if not checked and rec.xxh3_128 is not None:
                log.info("tierstore: %s is not a view of its shard's mapping: hashing its %d rows in memory",
                         tensor, raw.shape[0])
                self._digest(which, raw, rec)
            elif not checked:
                log.warning("tierstore: %s is not a view of its shard's mapping and tierstore table %s v%d records no "
                            "digest of it (ingested before digests were kept): only %d rows were compared; %s to "
                            "record one", tensor, self.table, self.version, SAMPLE_ROWS, REINGEST)
            return
        changed, touched = rec.differences(now)
        shard = f"{tensor} ({now.tensor} in {where[0]})"
        if checked:
            if changed or touched:
                log.warning("tierstore: %s: every byte is the one ingested, but %s: a sampled start refuses this "
                            "shard; %s to bind the table to it", shard, ", ".join(changed + touched), REINGEST)
            return
        if changed:
            raise CheckpointMismatch(
                f"{shard} is not the tensor tierstore table {self.table} v{self.version} was ingested from "
                f"({rec.tensor} in {rec.file}): {', '.join(changed)}; the checkpoint changed (a fine-tune, a new "
                f"release?): {self._fix()}")
        if touched:
            raise CheckpointMismatch(
                f"{shard} has the size and header of the tensor tierstore table {self.table} v{self.version} was "
                f"ingested from ({rec.tensor} in {rec.file}), but {', '.join(touched)}: the shard was rewritten or "
                f"touched since, or it is a copy (another host, a restore), which only its bytes can tell. A copy: "
                f"start with {self._variable()}=all, which reads the tensor whole and starts if every byte is the "
                f"one ingested, and ingest this checkpoint (`tierstore ingest-checkpoint`) to make sampled starts "
                f"accept these files again. Otherwise {self._fix()}")
        if rec.ino is None:
            log.warning("tierstore: %s: tierstore table %s v%d was ingested before checkpoint digests were kept: its "
                        "shard's size and mtime and %d rows were compared, not its inode, ctime or header; %s to "
                        "record them", shard, self.table, self.version, SAMPLE_ROWS, REINGEST)

    def _tensor(self, which: str) -> str:
        return f"{self.engine}'s Engram layer {self.layer_id}: checkpoint tensor embed.{which}"

    def _variable(self) -> str:
        return f"TIERSTORE_{self.engine.upper()}_VERIFY"

    def _fix(self) -> str:
        return (f"ingest this checkpoint (`tierstore ingest-checkpoint`) and restart the sidecar, or start "
                f"{self.engine} on the checkpoint that was ingested")


if __name__ == "__main__":
    print(matrix(), end="")
