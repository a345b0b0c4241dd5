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
Engram layer's fp8 weight and ue8m0 scale parameters: it compares the checkpoint tensor with
tierstore's rows (a spread of SAMPLE_ROWS rows, or all of them, read CHUNK_ROWS at a time)
and copies nothing. Either difference is a CheckpointMismatch naming the layer and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from tierstore import errors
from tierstore.client.engines import weight_filter

__all__ = ["SUPPORTED", "FEATURES", "Feature", "EngineRefused", "CheckpointMismatch", "CheckpointCheck",
           "check_shape", "check_version", "feature", "matrix", "SAMPLE_ROWS", "CHUNK_ROWS", "VERIFY_MODES",
           "FP8_BLOCK"]

# engine -> (distribution name, versions the plugin was written against and tested with)
SUPPORTED = {"sglang": ("sglang", ("0.5.23",)), "vllm": ("vllm", ("0.32.0",))}
SAMPLE_ROWS = 4096  # rows of each checkpoint tensor compared under verify "sample"
CHUNK_ROWS = 65536  # rows compared at a time under verify "all" (bounded memory at any table size)
VERIFY_MODES = ("sample", "all", "off")
FP8_BLOCK = 32  # fp8 values per ue8m0 scale in a tierstore Engram row

WORKS = "works (CPU tests)"
REFUSED = "refused"
NO_GPU = "not tested on GPU"
MODES = ("mapped", "staged")


@dataclass(frozen=True)
class Feature:
    """One row of the compatibility matrix: `engine`'s `name` under each mode, WORKS (run by
    the CPU tests), NO_GPU (written for CUDA, not run on a GPU yet) or REFUSED at start with
    `fix` (the message's remedy)."""

    engine: str
    name: str
    mapped: str
    staged: str
    fix: str = ""

    def status(self, mode: str) -> str:
        return self.mapped if mode == "mapped" else self.staged


_NO_SOCKET = {"sglang": "TIERSTORE_SGLANG_SOCKET", "vllm": "TIERSTORE_VLLM_SOCKET"}
FEATURES = (
    Feature("sglang", "CPU forward (sglang's torch path)", WORKS, WORKS),
    Feature("sglang", "CUDA forward (engram_gather over the registered arena, UVA)", NO_GPU, NO_GPU),
    Feature("sglang", "ROCm forward (device address from hipHostGetDevicePointer)", NO_GPU, NO_GPU),
    Feature("sglang", "tensor parallelism, shared host-table layout", WORKS, WORKS),
    Feature("sglang", "the overlap scheduler (sglang's default)", NO_GPU, REFUSED,
            "a staged batch's rows are read from its tokens on the host, and the overlap scheduler builds a decode "
            "batch before the last step's sampled tokens reach the host: start sglang with --disable-overlap-schedule "
            "(decode CUDA graphs stay on), or serve the tables split-layout with RAM for them"),
    Feature("sglang", "speculative decoding (--speculative-algorithm)", REFUSED, REFUSED,
            "tierstore's Engram rows serve extend and decode batches only, not target-verify or draft "
            "batches: start sglang without --speculative-algorithm, or unset TIERSTORE_SGLANG_SOCKET"),
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
    Feature("vllm", "CPU loading (allocation, weight loader, checkpoint check)", WORKS, WORKS),
    Feature("vllm", "CUDA lookup (_storage() UVA views / staged rows copied on a side stream)", NO_GPU, NO_GPU),
    Feature("vllm", "staged rows hashed on the host before the forward, no device sync (V1 model runner)",
            "n/a (vLLM hashes)", WORKS),
    Feature("vllm", "CUDA graphs, cudagraph_mode FULL_AND_PIECEWISE (vLLM's default; staged: persistent buffers "
            "sized from the resolved capture sizes)", NO_GPU, NO_GPU),
    Feature("vllm", "async scheduling (vLLM's default)", NO_GPU, REFUSED,
            "a staged step's rows are read from its tokens on the host before the forward, and async scheduling "
            "prepares a step before the last step's sampled tokens reach the host: start vLLM with "
            "--no-async-scheduling (CUDA graphs stay on), or serve the tables split-layout with RAM for them"),
    Feature("vllm", "the V2 model runner (vLLM's default where Triton is)", NO_GPU, REFUSED,
            "the V2 model runner keeps the token history on the device only; tierstore stages from the V1 "
            "runner's host token table: set VLLM_USE_V2_MODEL_RUNNER=0, or serve the tables split-layout with RAM "
            "for them"),
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
                            f"or unset {_NO_SOCKET[engine]} to run {engine} without tierstore")
    return have


def matrix() -> str:
    """docs/engines.md's compatibility matrix, a markdown table made from SUPPORTED and FEATURES."""
    lines = ["| engine | mode | feature | status |", "|---|---|---|---|"]
    for engine, (_, versions) in SUPPORTED.items():
        for mode in MODES:
            for f in (f for f in FEATURES if f.engine == engine):
                status = f.status(mode)
                cell = f"refused at start: {f.fix}" if status == REFUSED else status
                lines.append(f"| {engine} {', '.join(versions)} | {mode} | {f.name} | {cell} |")
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
    verify: "sample" (SAMPLE_ROWS rows spread over [start, end)), "all", or "off" (the shape only).

    `__call__(param, loaded)` (the engines' weight-loader call; `param` is the weight when it is
    float8_e4m3fn, else the scale) writes nothing, and raises CheckpointMismatch on a tensor of
    another shape or on the first row whose bytes differ. `mapped(...)` builds one over a
    split-layout table the engine maps (client/split_table.py)."""

    def __init__(self, engine: str, layer_id: int, table: str, version: int, rows: int, dim: int,
                 read: Callable[[str, np.ndarray], np.ndarray], verify: str, start: int = 0, end: int | None = None):
        if verify not in VERIFY_MODES:
            raise errors.InvalidArgument(f"verify is one of {', '.join(VERIFY_MODES)}, not {verify!r}")
        self.engine, self.layer_id, self.table, self.version = engine, layer_id, table, version
        self.rows, self.dim, self.read, self.verify = rows, dim, read, verify
        self.start, self.end = start, rows if end is None else end
        self.checked: list[str] = []

    @classmethod
    def mapped(cls, engine: str, layer_id: int, split, verify: str, start: int = 0,
               end: int | None = None) -> "CheckpointCheck":
        """The check of a layer whose host table is `split` (a SplitTable): rows read straight
        from its mapped weight and scale bytes."""
        def read(which: str, ids: np.ndarray) -> np.ndarray:
            return (split.weight if which == "weight" else split.scale)[ids]

        return cls(engine, layer_id, split.table, split.version, split.rows, split.row_dim, read, verify, start, end)

    def width(self, which: str) -> int:
        return self.dim if which == "weight" else self.dim // 32

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
        n = self.end - self.start
        if self.verify == "all" or n <= SAMPLE_ROWS:
            chunks = (np.arange(lo, min(lo + CHUNK_ROWS, n)) for lo in range(0, n, CHUNK_ROWS))
        else:
            chunks = (np.unique(np.linspace(0, n - 1, SAMPLE_ROWS).astype(np.int64)),)
        raw = loaded.detach().view(torch.uint8)
        for part in chunks:
            ids = part + self.start
            if self.verify == "sample":
                weight_filter.will_need(raw, ids)  # the sample's reads queued at once, not one fault at a time
            theirs = raw[torch.from_numpy(ids).to(raw.device)].cpu().numpy()
            differ = np.flatnonzero(np.any(theirs != self.read(which, ids), axis=1))
            if differ.size:
                raise CheckpointMismatch(
                    f"{self.engine}'s Engram layer {self.layer_id}: checkpoint tensor embed.{which} differs from "
                    f"tierstore table {self.table} v{self.version} at row {int(ids[differ[0]])}: the sidecar serves "
                    f"another checkpoint's table; ingest this checkpoint (`tierstore ingest-checkpoint`) and "
                    f"restart the sidecar, or start {self.engine} on the checkpoint that was ingested")


if __name__ == "__main__":
    print(matrix(), end="")
