"""tierstore as vLLM's Engram table store: a vLLM general plugin.

vLLM runs every `vllm.general_plugins` entry point in each process it starts;
tierstore's is `register` (pyproject.toml). It does nothing unless
TIERSTORE_VLLM_SOCKET names a sidecar's socket. Then each `ParallelEngramEmbedding`
of vLLM (a version checks.SUPPORTED lists; vllm/models/deepseek_v41/common/engram.py)
takes its `weight`
(float8_e4m3fn [rows, 256]) and `weight_scale_inv` (uint8 [rows, 8]) from the
sidecar's split arena of that layer's table (`tierstore serve --split-layout`,
`Client.split_table(...).tensors()`) instead of allocating pinned host memory,
and its weight loader leaves the checkpoint's `engram.embed.weight` /
`engram.embed.scale` where they lie: every worker of the host reads the one
copy the sidecar keeps warm, and a restart loads no table rows.

The seam. vLLM has no hook for Engram storage. `ParallelEngramEmbedding.__init__`
calls `self._allocate_weights()` and gives `self._weight_loader` to
`set_weight_attrs`; vLLM's own DP-shared host copy (`DPSharedEngramStorage`)
plugs in through exactly these two. The plugin replaces `_allocate_weights` on
the class (patch by plugin: the method's contract -- return (weight, scales)
for rows [vocab_start_idx, vocab_end_idx) -- is kept) and sets the instance's
`_weight_loader`. The embedding is told only sizes, so `Engram._create_embedding`
is wrapped to say which layer (`layout.layer_ids[layer_hash_index]`) is built.
vLLM's `_storage()` is untouched: on CUDA it makes UVA views of the arena,
which the plugin has registered (`SplitTable.register_cuda`) so the views read
the mapping in place instead of a private pinned copy. The loader's seam is the
safetensors iterator `DefaultModelLoader` calls (`default_loader.safetensors_weights_iterator`,
wrapped when that module first executes): through weight_filter.filtered a restart
reads of the checkpoint's Engram tables only the rows the loader checks. A model
built on the meta device (vLLM's `ipc_cache` weight-cache loader, whose daemon's
tensors then replace every parameter) is vLLM's own: `_allocate_weights` hands it
vLLM's meta tensors and tierstore serves none of its rows.

Staged layers (client/engines/vllm_stager.py). A table the sidecar serves in cache
mode (larger than its --dram-budget) has no split arena, and is what vLLM could not
allocate either. Under TIERSTORE_VLLM_STAGE ("auto": such tables; "on": every table;
"off": none) its layer is staged: `_allocate_weights` returns zero-row placeholders,
the loader checks the checkpoint's rows against tierstore's (Client.lookup) and copies
nothing, and the patched `ParallelEngramEmbedding.lookup` reads the rows tierstore
staged for the step: the wrapped `DeepseekV41ModelState.prepare_inputs` (the V2 model
runner builds every forward's inputs through it, dummy ones too) and
`prepare_dummy_inputs` (a graph capture's) stage each step before its forward.
`_storage()` of a staged layer raises: nothing can read its rows in place. The wrapped
`Scheduler.add_request` hints each queued prompt's rows to the sidecar
(vllm_stager.QueueHints, in the scheduler's process, whether or not it runs the model),
as sglang's plugin does.

Invariants (mapped layers):
- Zero copies: the parameters are views of the mapping; a rank's head shard
  (tensor / Engram-DP parallel) is the row range [vocab_start_idx,
  vocab_end_idx) of it. With dp_shared_memory the arena already is the host's
  one copy, so vLLM's DPSharedEngramStorage is never made.
- Nothing writes the arena: it is mapped PROT_READ. The loader never copies;
  it checks the checkpoint tensor's shape and, per TIERSTORE_VLLM_VERIFY, a few
  rows ("sample", the default), all of them ("all") or none ("off"); a
  mismatch is a checks.CheckpointMismatch naming the layer. `--load-format dummy` (which
  fills the parameters) is refused.
- Host tables only (EngramConfig.cpu_offload, vLLM's default): with the table
  in HBM vLLM would own it, so the plugin refuses instead of copying.
- One Client per process, opened where the model is built (vLLM starts its
  workers as new processes); the SplitTables live as long as the process.
- A table reloaded to a new version while vLLM runs is not picked up: the
  mapping keeps the old version's bytes (no longer scrubbed); restart vLLM.
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib.abc
import importlib.machinery
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tierstore import errors
from tierstore.client.engines import checks, seams, weight_filter

if TYPE_CHECKING:
    import torch

    from tierstore.client.engines.vllm_stager import QueueHints, StagedEngramTable, StepStager
    from tierstore.client.split_table import SplitTable

__all__ = ["VllmPluginConfig", "TierstoreEngramTables", "register", "install", "uninstall", "engram_layer"]

log = logging.getLogger("tierstore.client.engines.vllm")
ENGRAM_MODULE = "vllm.models.deepseek_v41.common.engram"
RUNNER_MODULE = "vllm.models.deepseek_v41.nvidia.model_state"  # the V2 runner's model state: staged steps' hook
LOADER_MODULE = "vllm.model_executor.model_loader.default_loader"
SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"  # the scheduler, whose queued requests are hinted
STAGE_MODES = ("auto", "on", "off")
# checks.FEATURES rows this module refuses
HBM_TABLES = "tables in HBM (engram cpu_offload off)"
DUMMY = "--load-format dummy"


@dataclass(frozen=True)
class VllmPluginConfig:
    """What the plugin serves from; built from the environment by `from_env`.

    socket: the sidecar's unix socket (TIERSTORE_VLLM_SOCKET).
    tables: Engram layer id -> table name (TIERSTORE_VLLM_TABLES="1=l1,14=l14");
        empty: each table the sidecar serves with a layer id (split-layout ones only under
        stage "off"), by the layer id ingest recorded.
    verify: how much of the checkpoint's Engram tensors the loader checks (TIERSTORE_VLLM_VERIFY):
        "sample" (checks.SAMPLE_ROWS rows of this rank's range, and the shard's identity), "all" (every
        byte), or "off" (checks.CheckpointCheck says what each promises).
    stage: which layers are staged (client/engines/vllm_stager.py: no rows held, each lookup
        read through tierstore) instead of mapped (TIERSTORE_VLLM_STAGE): "auto" (those whose
        table is not served split-layout, e.g. a cache-mode table larger than --dram-budget),
        "on" (every layer), "off" (none: every table must be split-layout); also 1 / 0.
    stage_form: how a staged step's rows reach the device (TIERSTORE_VLLM_STAGE_FORM,
        checks.STAGE_FORMS): "simple" (read on the host before the forward,
        after one stream wait) or "fast" (each layer's lookup looks them up on the device: for
        a GPU, not yet run on one).
    """

    socket: str
    tables: dict[int, str] = field(default_factory=dict)
    verify: str = "sample"
    stage: str = "auto"
    stage_form: str = "simple"

    def validate(self) -> "VllmPluginConfig":
        if not self.socket:
            raise errors.InvalidArgument("TIERSTORE_VLLM_SOCKET is empty; set it to the sidecar's --socket path")
        if self.verify not in checks.VERIFY_MODES:
            raise errors.InvalidArgument(
                f"TIERSTORE_VLLM_VERIFY={self.verify!r}; use one of {', '.join(checks.VERIFY_MODES)}")
        if self.stage not in STAGE_MODES:
            raise errors.InvalidArgument(f"TIERSTORE_VLLM_STAGE={self.stage!r}; use auto, on (1) or off (0)")
        checks.check_stage_form(self.stage_form, "TIERSTORE_VLLM_STAGE_FORM")
        return self

    @classmethod
    def from_env(cls, env=None) -> "VllmPluginConfig | None":
        """None when TIERSTORE_VLLM_SOCKET is unset (the plugin stays off)."""
        env = os.environ if env is None else env
        if "TIERSTORE_VLLM_SOCKET" not in env:
            return None
        tables = {}
        for item in filter(None, (s.strip() for s in env.get("TIERSTORE_VLLM_TABLES", "").split(","))):
            layer, sep, name = item.partition("=")
            if not sep or not layer.strip().isdigit() or not name.strip():
                raise errors.InvalidArgument(
                    f"TIERSTORE_VLLM_TABLES item {item!r} is not LAYER=TABLE (e.g. 1=l1,14=l14)")
            tables[int(layer)] = name.strip()
        stage = env.get("TIERSTORE_VLLM_STAGE", "auto").strip().lower()
        return cls(env["TIERSTORE_VLLM_SOCKET"], tables, env.get("TIERSTORE_VLLM_VERIFY", "sample"),
                   {"1": "on", "0": "off"}.get(stage, stage),
                   env.get("TIERSTORE_VLLM_STAGE_FORM", "simple").strip().lower()).validate()


class TierstoreEngramTables:
    """This process's Engram tables, by layer id: split tables mapped (and the loader that skips
    their rows), or staged tables read per lookup (vllm_stager.py), per config.stage."""

    def __init__(self, config: VllmPluginConfig):
        from tierstore.client.client import Client

        self.config, self.pid = config, os.getpid()
        self._lock = threading.Lock()
        self._client = Client(config.socket)
        self._by_layer = dict(config.tables)
        self._split: dict[int, "SplitTable"] = {}
        self._staged: dict[int, "StagedEngramTable"] = {}
        self.graph_tokens = 0  # the persistent staging buffers' tokens (vllm_stager.graph_tokens, set at build)
        self.step_tokens = 0  # the most tokens a step schedules (vllm_stager.step_tokens, set at build)
        self._stager = None  # the StepStager of the staged layers, made at its first use
        if not self._by_layer:
            for info in self._client.tables():
                handle = self._client.handle(info["table"])
                if handle.layer_id is not None and (handle.split or config.stage != "off"):
                    self._by_layer[handle.layer_id] = handle.table
        if not self._by_layer:
            raise errors.NotFound(
                f"the sidecar at {config.socket} serves no {'split-layout ' if config.stage == 'off' else ''}table "
                f"with a layer id; serve the ingested V4.1 tables (`tierstore serve --split-layout all`, or in "
                f"cache mode without it), or name them in TIERSTORE_VLLM_TABLES=LAYER=TABLE,...")

    def _table(self, layer_id: int) -> str:
        name = self._by_layer.get(layer_id)
        if name is None:
            raise errors.TableNotFound(
                f"no tierstore table for Engram layer {layer_id} (have layers {sorted(self._by_layer)}); ingest "
                f"it and serve it (--split-layout to map it, or in cache mode to stage it), or map it in "
                f"TIERSTORE_VLLM_TABLES")
        return name

    def staged(self, layer_id: int) -> bool:
        """Whether layer `layer_id` is staged (vllm_stager.py) rather than mapped: by config.stage,
        and under "auto" whether the sidecar serves its table anything but split-layout."""
        if self.config.stage != "auto":
            return self.config.stage == "on"
        return not self._client.handle(self._table(layer_id)).split

    def staged_table(self, layer_id: int) -> "StagedEngramTable":
        """Layer `layer_id`'s table as a staged layer reads it (one per layer per process)."""
        from tierstore.client.engines.vllm_stager import StagedEngramTable

        with self._lock:
            t = self._staged.get(layer_id)
            if t is None:
                t = self._staged[layer_id] = StagedEngramTable(self._client, self._table(layer_id), layer_id)
            return t

    def staged_layers(self) -> list["StagedEngramTable"]:
        """The staged layers built so far in this process (each bound to its embedding)."""
        with self._lock:
            return [t for t in self._staged.values() if t.part is not None]

    def step_stager(self, device) -> "StepStager":
        """The process's StepStager over the staged layers, made at its first use (a graph capture,
        vLLM's profile run or the first step: all after the model is built) on `device`, its
        persistent buffers `graph_tokens` tokens."""
        from tierstore.client.engines.vllm_stager import StepStager

        layers = self.staged_layers()
        with self._lock:
            if self._stager is None:
                if not layers:
                    raise errors.InvalidArgument("tierstore's vLLM plugin stages no Engram layer in this process")
                self._stager = StepStager(layers, self.graph_tokens, device, form=self.config.stage_form,
                                          step_tokens=self.step_tokens)
            return self._stager

    def split_table(self, layer_id: int) -> "SplitTable":
        """The split table of Engram layer `layer_id` (mapped once per process)."""
        with self._lock:
            t = self._split.get(layer_id)
            if t is None:
                t = self._split[layer_id] = self._client.split_table(self._table(layer_id))
            return t

    def storage(self, layer_id: int, num_embeddings: int, dim: int, block_size: int,
                start: int, end: int) -> tuple["torch.Tensor", "torch.Tensor"]:
        """(weight e4m3 [end-start, dim], scales uint8 [end-start, dim // block_size]): views of
        layer `layer_id`'s arena rows [start, end), which is what vLLM would have allocated."""
        import torch

        t = self.split_table(layer_id)
        checks.check_shape("vllm", layer_id, t.table, t.rows, t.row_dim, num_embeddings, dim, block_size)
        weight, scale = t.tensors()
        return weight[start:end], scale.view(torch.uint8)[start:end]

    def loader(self, layer_id: int, start: int, end: int) -> checks.CheckpointCheck:
        """The weight loader of a mapped layer's two parameters (rank rows [start, end)): checks
        the checkpoint's tensor against the arena (config.verify), never copies."""
        return checks.CheckpointCheck.mapped("vllm", layer_id, self.split_table(layer_id), self.config.verify,
                                             start, end)

    def close(self) -> None:
        with self._lock:
            for t in self._split.values():
                t.close()
            self._split.clear()
            self._staged.clear()
            self._stager = None
        self._client.close()


# ---- the patch ----------------------------------------------------------------
_LAYER = contextvars.ContextVar("tierstore_vllm_engram_layer", default=None)
_STATE: dict = {}  # "tables": TierstoreEngramTables of this process, "originals": what install replaced
_STATE_LOCK = threading.Lock()


def staged_tables() -> "TierstoreEngramTables | None":
    """This process's tables when the plugin is installed and has built them, else None."""
    with _STATE_LOCK:
        tables = _STATE.get("tables")
        return tables if tables is not None and tables.pid == os.getpid() else None


def _tables() -> TierstoreEngramTables:
    with _STATE_LOCK:
        tables = _STATE.get("tables")
        if tables is None or tables.pid != os.getpid():
            tables = _STATE["tables"] = TierstoreEngramTables(_STATE["config"])
        return tables


@contextlib.contextmanager
def engram_layer(layer_id: int):
    """Within it, a ParallelEngramEmbedding built is layer `layer_id`'s (the wrapped
    Engram._create_embedding opens it; the embedding itself is told only sizes)."""
    token = _LAYER.set(layer_id)
    try:
        yield
    finally:
        _LAYER.reset(token)


def _patch(engram) -> None:
    """Replace ParallelEngramEmbedding._allocate_weights, lookup and _storage, and wrap
    Engram._create_embedding. lookup and _storage are vLLM's own for a layer that is not
    staged (no `tierstore_staged` on the instance)."""
    emb_cls, engram_cls = engram.ParallelEngramEmbedding, engram.Engram
    if "originals" in _STATE:
        return
    alloc, create = emb_cls._allocate_weights, engram_cls._create_embedding
    lookup, storage = emb_cls.lookup, emb_cls._storage

    def _create_embedding(self, layout, layer_hash_index):
        with engram_layer(layout.layer_ids[layer_hash_index]):
            return create(self, layout, layer_hash_index)

    def _allocate_weights(self):
        import torch

        if torch.get_default_device().type == "meta":  # ipc_cache's build: its daemon's tensors replace these
            log.info("a ParallelEngramEmbedding built on the meta device is vLLM's own (its weight cache loader's): "
                     "tierstore serves none of its rows")
            return alloc(self)
        layer_id = _LAYER.get()
        if layer_id is None:
            raise errors.InvalidArgument(
                "tierstore's vLLM plugin met a ParallelEngramEmbedding built outside Engram._create_embedding, "
                "so it cannot tell the layer; unset TIERSTORE_VLLM_SOCKET to let vLLM allocate it")
        if not self.cpu_offload:
            raise checks.EngineRefused.of("vllm", HBM_TABLES, f"Engram layer {layer_id}")
        from vllm.config.vllm import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()  # set wherever vLLM builds a model
        if vllm_config is not None and "dummy" in str(vllm_config.load_config.load_format):
            raise checks.EngineRefused.of("vllm", DUMMY, f"load format {vllm_config.load_config.load_format}")
        tables = _tables()
        if tables.staged(layer_id):
            return _stage(self, tables, layer_id, vllm_config)
        weight, scales = tables.storage(layer_id, self.num_embeddings, self.dim, self.block_size,
                                        self.vocab_start_idx, self.vocab_end_idx)
        if engram.current_platform.is_cuda_alike():
            tables.split_table(layer_id).register_cuda()
        self._weight_loader = tables.loader(layer_id, self.vocab_start_idx, self.vocab_end_idx)
        return weight, scales

    def _lookup(self, indices, out, background=False):
        """vLLM's lookup, or for a staged layer the rows tierstore staged for the step before the
        forward (vllm_stager.py: no device sync, capturable in a CUDA graph)."""
        staged = getattr(self, "tierstore_staged", None)
        if staged is None:
            return lookup(self, indices, out, background)
        staged.lookup(self, indices, out, _tables().step_stager(out.device))

    def _storage(self):
        staged = getattr(self, "tierstore_staged", None)
        if staged is None:
            return storage(self)
        from tierstore.client.engines import StagingError

        raise StagingError(
            f"vLLM's Engram layer {staged.layer_id} is staged by tierstore (table {staged.table}, served in cache "
            f"mode): vLLM holds none of its rows, so nothing can read them in place. vLLM's Engram DP peer "
            f"exchange does: run with --engram-config '{{\"embedding_across_dp\": false}}', or serve the table "
            f"split-layout (tierstore serve --split-layout all) with RAM for it")

    emb_cls._allocate_weights = _allocate_weights
    emb_cls.lookup = _lookup
    emb_cls._storage = _storage
    engram_cls._create_embedding = _create_embedding
    _STATE["originals"] = (engram, alloc, create, lookup, storage)


def _stage(emb, tables: TierstoreEngramTables, layer_id: int, vllm_config=None):
    """_allocate_weights of a staged layer: the engine's settings checked (vllm_stager.check_engine:
    refused at start with the fix), zero-row placeholders (vLLM's loading accepts them; the loader
    checks the checkpoint's rows against tierstore's and copies nothing), the layer's table on
    the instance for the patched lookup, and the persistent staging buffers' size taken from
    vLLM's resolved CUDA-graph capture sizes."""
    import torch

    from tierstore.client.engines import vllm_stager

    vllm_stager.check_engine(vllm_config, emb, layer_id)
    tables.graph_tokens = vllm_stager.graph_tokens(vllm_config)
    tables.step_tokens = vllm_stager.step_tokens(vllm_config)
    staged = tables.staged_table(layer_id)
    checks.check_shape("vllm", layer_id, staged.table, staged.rows, staged.dim, emb.num_embeddings, emb.dim,
                       emb.block_size)
    staged.bind(emb)
    emb.tierstore_staged = staged
    emb._weight_loader = staged.check(emb.vocab_start_idx, emb.vocab_end_idx, tables.config.verify)
    log.info("Engram layer %d: tierstore table %s v%d staged per lookup (%s), rows [%d, %d) of this rank; no "
             "table allocated", layer_id, staged.table, staged.version,
             "full-resident" if staged.full_resident else "cache mode", emb.vocab_start_idx, emb.vocab_end_idx)
    return (torch.empty((0, emb.dim), dtype=torch.float8_e4m3fn, device="cpu"),
            torch.empty((0, emb.dim // emb.block_size), dtype=torch.uint8, device="cpu"))


def _patch_runner(runner_module) -> None:
    """Wrap DeepseekV41ModelState.prepare_inputs (the V2 model runner builds every forward's
    model inputs through it, on the host, before the forward: real steps and dummy runs) and
    prepare_dummy_inputs (a graph capture's) so that each forward's rows are staged for it
    (vllm_stager.stage_runner_step; a dummy forward a step of no rows); nothing without a
    staged layer."""
    state_cls = runner_module.DeepseekV41ModelState
    if "runner_original" in _STATE:
        return
    prepare, prepare_dummy = state_cls.prepare_inputs, state_cls.prepare_dummy_inputs

    def prepare_inputs(self, input_batch, req_states):
        result = prepare(self, input_batch, req_states)
        tables = staged_tables()
        if tables is not None and tables.staged_layers():
            from tierstore.client.engines import vllm_stager

            vllm_stager.stage_runner_step(tables.step_stager(self.device), self, input_batch, req_states)
        return result

    def prepare_dummy_inputs(self, num_reqs, num_tokens):
        result = prepare_dummy(self, num_reqs, num_tokens)
        tables = staged_tables()
        if tables is not None and tables.staged_layers():
            tables.step_stager(self.device).stage_none()
        return result

    state_cls.prepare_inputs, state_cls.prepare_dummy_inputs = prepare_inputs, prepare_dummy_inputs
    _STATE["runner_original"] = (runner_module, prepare, prepare_dummy)


def _patch_scheduler(scheduler_module) -> None:
    """Wrap Scheduler.__init__ and add_request so that a queued request's rows are hinted to the
    sidecar (vllm_stager.QueueHints, made with the scheduler: its token map costs a pass over
    the vocabulary; a process whose hints cannot be made logs why once and hints nothing)."""
    scheduler_cls = scheduler_module.Scheduler
    if "scheduler_original" in _STATE:
        return
    init, add = scheduler_cls.__init__, scheduler_cls.add_request

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _queue_hints(self.vllm_config)

    def add_request(self, request):
        result = add(self, request)
        hints = _queue_hints(self.vllm_config)
        if hints is not None:
            try:
                hints.on_add_request(self, request)
            except Exception:  # noqa: BLE001 - a hint must never fail the scheduler
                log.exception("tierstore prefetch of request %s failed", getattr(request, "request_id", "?"))
        return result

    scheduler_cls.__init__, scheduler_cls.add_request = __init__, add_request
    _STATE["scheduler_original"] = (scheduler_module, init, add)


def _queue_hints(vllm_config) -> "QueueHints | None":
    """This process's QueueHints over the staged layers of the model `vllm_config` names, made
    once; None when the plugin is off, no layer is staged or they cannot be made (logged)."""
    with _STATE_LOCK:
        if "config" not in _STATE:
            return None
        made = _STATE.get("hints")
        if made is not None and made[0] == os.getpid():
            return made[1]
    hints = None
    try:
        from tierstore.client.engines.vllm_stager import QueueHints

        layer_ids = getattr(vllm_config.model_config.hf_text_config, "engram_layer_ids", None) or []
        tables = _tables() if layer_ids else None  # a model without Engram layers: no sidecar asked
        staged = [tables.staged_table(L) for L in layer_ids if tables.staged(L)] if tables else []
        hints = QueueHints(staged, vllm_config) if staged else None
    except Exception as e:  # noqa: BLE001 - hints are an optimisation: the model's own checks stop a bad start
        log.warning("tierstore: queued requests' rows are not prefetched in this process (%s: %s)",
                    type(e).__name__, e)
    with _STATE_LOCK:
        _STATE["hints"] = (os.getpid(), hints)
    return hints


def _patch_loader(loader) -> None:
    """Wrap the safetensors iterator DefaultModelLoader calls (default_loader's name for it) in
    weight_filter.filtered: a restart reads of the Engram tables only the rows
    TIERSTORE_VLLM_VERIFY checks; every tensor is yielded as vLLM's iterator made it."""
    if "loader" in _STATE:
        return
    original = loader.safetensors_weights_iterator

    def safetensors_weights_iterator(hf_weights_files, use_tqdm_on_load, safetensors_load_strategy=None,
                                     *args, **kwargs):
        weights = original(hf_weights_files, use_tqdm_on_load, safetensors_load_strategy, *args, **kwargs)
        config = _STATE.get("config")
        if config is None:
            return weights
        whole = (f"--safetensors-load-strategy {safetensors_load_strategy}"
                 if safetensors_load_strategy in ("eager", "prefetch") else None)
        return weight_filter.filtered(weights, "vllm", config.verify == "sample", whole)

    loader.safetensors_weights_iterator = safetensors_weights_iterator
    _STATE["loader"] = (loader, original)


_ON_IMPORT = {ENGRAM_MODULE: _patch, RUNNER_MODULE: _patch_runner, LOADER_MODULE: _patch_loader,
              SCHEDULER_MODULE: _patch_scheduler}


class _PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Patches vLLM's Engram module, DeepSeek-V4.1's V2-runner model state, its scheduler and its
    default model loader right after each first executes (plugins load before models)."""

    def __init__(self):
        self._inner = {}

    def find_spec(self, name, path, target=None):
        if name not in _ON_IMPORT:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        self._inner[name] = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._inner[spec.name].create_module(spec)

    def exec_module(self, module):
        self._inner[module.__name__].exec_module(module)
        _ON_IMPORT[module.__name__](module)


def install(config: VllmPluginConfig) -> None:
    """Serve vLLM's Engram tables from tierstore in this process (idempotent).

    Patches vLLM's Engram module, DeepSeek-V4.1's V2-runner model state, its scheduler and its
    default model loader now where they are imported, else when they are."""
    with _STATE_LOCK:
        _STATE["config"] = config.validate()
    for name, patch in _ON_IMPORT.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not all(n in sys.modules for n in _ON_IMPORT) and not any(isinstance(f, _PatchOnImport)
                                                                  for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def uninstall() -> None:
    """Undo `install`: vLLM's own methods back, the finder removed, the tables closed."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PatchOnImport)]
    with _STATE_LOCK:
        originals = _STATE.pop("originals", None)
        loader = _STATE.pop("loader", None)
        tables = _STATE.pop("tables", None)
        _STATE.pop("config", None)
        runner = _STATE.pop("runner_original", None)
        scheduler = _STATE.pop("scheduler_original", None)
        _STATE.pop("hints", None)
    if runner is not None:
        state_cls = runner[0].DeepseekV41ModelState
        state_cls.prepare_inputs, state_cls.prepare_dummy_inputs = runner[1:]
    if scheduler is not None:
        scheduler[0].Scheduler.__init__, scheduler[0].Scheduler.add_request = scheduler[1:]
    if originals is not None:
        engram, alloc, create, lookup, storage = originals
        engram.ParallelEngramEmbedding._allocate_weights = alloc
        engram.ParallelEngramEmbedding.lookup = lookup
        engram.ParallelEngramEmbedding._storage = storage
        engram.Engram._create_embedding = create
    if loader is not None:
        module, original = loader
        module.safetensors_weights_iterator = original
    if tables is not None:
        tables.close()


def register() -> None:
    """The `vllm.general_plugins` entry point (vLLM's load_general_plugins() lets its errors
    through: they stop vLLM's start). Off without TIERSTORE_VLLM_SOCKET; with it, vLLM must be a
    version checks.SUPPORTED lists whose every seam the plugin touches is there (seams.check:
    EngineRefused naming what is not, before anything is patched) and the sidecar must answer now
    (a clear error at vLLM's start, not at the first layer)."""
    config = VllmPluginConfig.from_env()
    if config is None:
        return
    seams.check("vllm", checks.check_version("vllm"))
    from tierstore.client.client import Client

    try:
        with Client(config.socket, timeout=10) as c:
            c.tables()
    except Exception as e:
        raise errors.Unavailable(
            f"TIERSTORE_VLLM_SOCKET={config.socket}: no tierstore sidecar answers there ({e}); start it with "
            f"`tierstore serve --data DIR --socket {config.socket} --split-layout all` (tables that fit its "
            f"--dram-budget, mapped) or without --split-layout (cache mode: the layers are staged), or unset "
            f"TIERSTORE_VLLM_SOCKET to let vLLM load its Engram tables itself") from None
    install(config)
