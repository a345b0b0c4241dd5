"""sglang 0.5.23 over tierstore: sglang's Engram host table is tierstore's split arena.

sglang keeps each DeepSeek-V4.1 Engram table in a host table it allocates
(`_HostTable`: a memfd or anonymous map, cudaHostRegister) and fills from the
checkpoint (`EngramEmbedding._load_rows`), laid out by
`EngramEmbedding._init_host_table`: all fp8 weights [rows, 256], then all
ue8m0 scales [rows, 8]. A split-layout arena (`serve --split-layout`) is that
buffer byte for byte, so this module hands sglang the arena instead:

- seam: an AROUND hook on `EngramEmbedding._init_host_table`, registered
  through sglang's own general-plugin framework (entry point group
  `sglang.srt.plugins`, loaded in every sglang process; `HookRegistry`).
  Nothing of sglang is forked or copied. The hook maps table
  `{TIERSTORE_SGLANG_PREFIX}l{layer}` (Client.split_table), makes sglang's
  `weight` / `scale` parameters views of it, and replaces the loader of those
  two parameters only (checks.CheckpointCheck): the checkpoint's Engram tensors
  are checked against the arena and ingest's record of them (sampled rows and the
  shard's identity; every byte with TIERSTORE_SGLANG_VERIFY=all), never copied
  (the mapping is read-only).
- restart: sglang's safetensors iterators (weight_utils, AROUND hooks) yield
  every tensor through weight_filter.filtered, so of the checkpoint's Engram
  tables only the rows the check compares are read from disk.
- on CUDA (the layer built under a CUDA default device, as sglang's loader
  builds it) the mapping is registered once per process (SplitTable.register_cuda)
  and sglang's own kernels read it over UVA as they read their host table
  (`engram_gather`, and `EngramRowStager` where sglang stages rows); on CPU
  sglang's torch path (`_owned_rows`) reads the same views.
- turned on by TIERSTORE_SGLANG_SOCKET (the sidecar's socket); `tierstore sglang
  --socket S -- <sglang args>` sets it and starts sglang's server. Without it the
  plugin registers nothing and sglang loads its tables itself.
- sidecar down at start: EngineAttachError naming the socket and the fix,
  raised from the layer's construction (sglang's start fails; nothing is
  served). While serving, the rows are the sidecar's verified and scrubbed
  pages; each forward checks the arena's header (one byte): once the sidecar
  retires it for another version, the forward raises EngineAttachError
  (restart sglang: the model never mixes versions); retired by a sidecar
  restart that serves the same version, the mapped rows (verified at load, the
  same bytes) keep serving and one warning says so.

Tables larger than RAM (the sidecar in cache mode) cannot be mapped: sglang's
host table would be the whole table. Such a layer is *staged*
(client/engines/sglang_stager.py): its parameters are empty placeholders, the
checkpoint's rows are checked against the sidecar's, and every extend and
decode batch's rows are read from tierstore ahead of the forward by
`RowStager`, which takes the place of sglang's `EngramRowStager`
(TIERSTORE_SGLANG_STAGE: auto, the default, stages the layers whose table is
not served split-layout; on stages every layer; off stages none).

Importing sglang's Engram modules without a GPU install (CPU tests, bench):
`import_engram()` imports `sglang.srt.layers.engram` and `engram_staging`
without running `sglang/__init__.py` (sglang.lang, HF patches), and, where
torchvision is absent, lets the one module of that chain that imports it at
module level (`sglang.srt.multimodal.internvl_utils`, reached through
`sglang.srt.configs`) import against a stand-in, removed again at once;
Engram never calls into it (docs/engines.md).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
import threading
import types
from dataclasses import dataclass

from tierstore import errors
from tierstore.client.engines import checks, seams, weight_filter

__all__ = ["SglangConfig", "EngineAttachError", "StartRefused", "import_engram", "plugin", "install", "HOOK_TARGET", "launch"]

log = logging.getLogger("tierstore.client.engines.sglang")
HOOK_TARGET = "sglang.srt.layers.engram.EngramEmbedding._init_host_table"
STAGER_TARGET = "sglang.srt.layers.engram_staging.EngramRowStager.from_model"
DEQUANT_TARGET = "sglang.srt.layers.engram.EngramEmbedding.dequant_staged"
ENQUEUE_TARGET = "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue"
ARGS_TARGET = "sglang.srt.server_args.ServerArgs.check_server_args"
FORWARD_BATCH_TARGET = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
LOADER_TARGETS = ("sglang.srt.model_loader.weight_utils.safetensors_weights_iterator",
                  "sglang.srt.model_loader.weight_utils.buffered_multi_thread_safetensors_weights_iterator")
# the start is refused without any of them
REQUIRED = (HOOK_TARGET, ARGS_TARGET, STAGER_TARGET, DEQUANT_TARGET, FORWARD_BATCH_TARGET)
# checks.FEATURES rows this module refuses
DUMMY = "--load-format dummy"
PEER_SHARDS = "peer shards (SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS)"
PER_RANK = "per_rank host-table layout (SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT)"
NUMA_SHARED = ("numa_shared host-table layout (SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT=numa_shared, proposed for a "
               "later sglang)")
# what is lost where an optional hook's target is missing
OPTIONAL = {ENQUEUE_TARGET: "queued requests' rows are not prefetched",
            **{t: "a restart reads the checkpoint's Engram tables through sglang's iterator" for t in LOADER_TARGETS}}


class EngineAttachError(errors.TierstoreError):
    """sglang's Engram layer cannot be fed from the sidecar (down, table missing, retired); a table
    of another shape is a checks.CheckpointMismatch, as under vLLM."""

    GRPC_CODE = "FAILED_PRECONDITION"


@dataclass(frozen=True)
class SglangConfig:
    """The integration's settings; `from_env()` maps the TIERSTORE_SGLANG_* variables onto it.

    socket: the sidecar's unix socket. prefix: table name prefix (`ingest-checkpoint
    --prefix`); layer L is table `{prefix}l{L}`. verify: "sample" (checks.SAMPLE_ROWS rows of each
    checkpoint tensor and its shard's identity), "all" (every byte: reads the checkpoint's
    Engram tensors in full) or "off" (the shape only): checks.CheckpointCheck says what each
    promises. timeout: seconds a sidecar call may take.
    stage: which layers tierstore's row stager serves instead of a mapped host table
    (client/engines/sglang_stager.py): "auto" (those whose table is not served split-layout:
    cache mode, tables larger than RAM), "on" (every layer) or "off" (none: every table
    must be split-layout). TIERSTORE_SGLANG_STAGE also takes 1 / 0 for on / off.
    stage_form: how a staged batch's rows reach the device (TIERSTORE_SGLANG_STAGE_FORM,
    checks.STAGE_FORMS): "simple" (read on the host before the forward, after
    one stream wait where the batch is built on the device) or "fast" (each layer's forward looks
    them up on the device: for a GPU, not yet run on one)."""

    socket: str
    prefix: str = ""
    verify: str = "sample"
    timeout: float = 30.0
    stage: str = "auto"
    stage_form: str = "simple"

    def __post_init__(self):
        if self.verify not in checks.VERIFY_MODES:
            raise errors.InvalidArgument(
                f"TIERSTORE_SGLANG_VERIFY={self.verify!r}; use one of {', '.join(checks.VERIFY_MODES)}")
        if not self.socket:
            raise errors.InvalidArgument("TIERSTORE_SGLANG_SOCKET is empty; set it to the sidecar's --socket")
        if self.stage not in ("auto", "on", "off"):
            raise errors.InvalidArgument(f"TIERSTORE_SGLANG_STAGE is auto, on (1) or off (0), not {self.stage!r}")
        checks.check_stage_form(self.stage_form, "TIERSTORE_SGLANG_STAGE_FORM")

    @classmethod
    def from_env(cls) -> "SglangConfig | None":
        """None unless TIERSTORE_SGLANG_SOCKET is set (the integration is off)."""
        socket = os.environ.get("TIERSTORE_SGLANG_SOCKET")
        if socket is None:
            return None
        stage = os.environ.get("TIERSTORE_SGLANG_STAGE", "auto").strip().lower()
        return cls(socket=socket, prefix=os.environ.get("TIERSTORE_SGLANG_PREFIX", ""),
                   verify=os.environ.get("TIERSTORE_SGLANG_VERIFY", "sample"),
                   timeout=float(os.environ.get("TIERSTORE_SGLANG_TIMEOUT", "30")),
                   stage={"1": "on", "0": "off"}.get(stage, stage),
                   stage_form=os.environ.get("TIERSTORE_SGLANG_STAGE_FORM", "simple").strip().lower())

    def table(self, layer_id: int) -> str:
        return f"{self.prefix}l{layer_id}"


# ---- importing sglang's Engram modules ---------------------------------------------------------
def import_engram() -> tuple[types.ModuleType, types.ModuleType]:
    """(sglang.srt.layers.engram, sglang.srt.layers.engram_staging), imported as narrowly as
    they allow (module docstring). Raises ImportError naming the install command."""
    if "sglang.srt.layers.engram" not in sys.modules:
        try:
            checks.check_version("sglang")
        except checks.EngineRefused as e:
            raise ImportError(f"{e} (CPU: `make engine-deps-sglang`)") from None
        if "sglang" not in sys.modules:
            _bare_package("sglang")
        with _torchvision_stand_in():
            importlib.import_module("sglang.srt.layers.engram")
            importlib.import_module("sglang.srt.layers.engram_staging")
    return sys.modules["sglang.srt.layers.engram"], sys.modules["sglang.srt.layers.engram_staging"]


def _bare_package(name: str) -> None:
    """Register package `name` with its path but without running its __init__."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{name} is not installed")
    bare = importlib.machinery.ModuleSpec(name, None, is_package=True)
    bare.submodule_search_locations = list(spec.submodule_search_locations)
    module = importlib.util.module_from_spec(bare)
    module.__path__ = list(spec.submodule_search_locations)
    sys.modules[name] = module


class _StandIn(types.ModuleType):
    """A module-level name of torchvision, for an import that Engram never calls into."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {"__module__": self.__name__})


class _torchvision_stand_in:
    """While importing sglang's Engram chain without torchvision: stand-ins for the three
    torchvision modules internvl_utils imports at module level, removed afterwards (so
    `find_spec("torchvision")` is None again). transformers is imported first, so its
    availability checks have already seen torchvision missing."""

    NAMES = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")

    def __enter__(self):
        self.active = importlib.util.find_spec("torchvision") is None
        if self.active:
            from transformers.utils import import_utils

            import_utils.is_torchvision_available()
            for n in self.NAMES:
                sys.modules[n] = _StandIn(n)

    def __exit__(self, *exc):
        if self.active:
            for n in self.NAMES:
                sys.modules.pop(n, None)


# ---- the plugin ---------------------------------------------------------------------------------
class StartRefused(SystemExit):
    """tierstore's refusal of this sglang process's start, raised out of `plugin()`.

    sglang's load_plugins() logs and drops any Exception a plugin raises, and HookRegistry
    any failure to apply a hook; sglang would then start without tierstore (with the
    host-table flags set: its own full host table). A SystemExit is not an Exception, so it
    leaves load_plugins() and the process exits with this message (status 1)."""

    def __init__(self, error: errors.TierstoreError):
        self.error = error
        super().__init__(f"tierstore: {type(error).__name__}: {error}")


def plugin() -> None:
    """sglang general plugin (entry point `tierstore` in group `sglang.srt.plugins`), run by
    sglang's load_plugins() in every process: with TIERSTORE_SGLANG_SOCKET set, check sglang's
    version and Engram settings, register the hooks, check each target is there to be hooked,
    and only then turn on sglang's host-table path (shared layout); else do nothing. Any
    refusal raises StartRefused (module checks.FEATURES lists them with the fix).

    Hooks (REQUIRED: without one of them the process refuses to start): _init_host_table
    (AROUND: the mapped arena, or a staged layer); ServerArgs.check_server_args (BEFORE: the
    settings refused at start, and that every hook was applied); the seams of staged layers
    (sglang_stager.py), each a no-op where no layer is staged: EngramRowStager.from_model
    (AROUND: tierstore's RowStager), EngramEmbedding.dequant_staged (AROUND: its CPU twin where
    the staged rows are on the host), ForwardBatch.init_new (AROUND: the rows of a batch whose
    tokens were still on the device when it was scheduled, the overlap scheduler's and
    speculative decoding's, staged once they are final). Optional, a warning where the target does not import
    (OPTIONAL says what is lost): Scheduler._add_request_to_queue (AFTER: prefetch a queued
    request's rows); weight_utils' two safetensors iterators (AROUND: weights_iterator, the
    restart reads only the checked rows of the Engram tables; weight_filter.py)."""
    config = SglangConfig.from_env()
    if config is None:
        return
    try:
        _start()
    except errors.TierstoreError as e:
        raise StartRefused(e) from e
    log.info("tierstore: sglang's Engram host tables come from the sidecar at %s", config.socket)


def _start() -> None:
    from sglang.srt.environ import envs
    from sglang.srt.plugins.hook_registry import HookType

    from tierstore.client.engines import sglang_stager

    version = checks.check_version("sglang")
    seams.check("sglang", version)
    if envs.SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS.get():
        raise checks.EngineRefused.of("sglang", PEER_SHARDS, "SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS is set")
    layout = os.environ.get("SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT", "shared")
    if layout != "shared":
        raise checks.EngineRefused.of("sglang", NUMA_SHARED if layout == "numa_shared" else PER_RANK,
                                      f"SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT={layout}")
    try:
        import_engram()
    except ImportError as e:
        raise checks.EngineRefused(f"sglang's Engram modules do not import ({e}): tierstore's plugin cannot hook "
                                   f"them; fix the sglang install, or unset TIERSTORE_SGLANG_SOCKET") from None
    hooks = {HOOK_TARGET: (init_host_table, HookType.AROUND), ARGS_TARGET: (check_server_args, HookType.BEFORE),
             STAGER_TARGET: (sglang_stager.from_model, HookType.AROUND),
             DEQUANT_TARGET: (sglang_stager.dequant_staged, HookType.AROUND),
             FORWARD_BATCH_TARGET: (sglang_stager.init_forward_batch, HookType.AROUND),
             ENQUEUE_TARGET: (sglang_stager.on_enqueue, HookType.AFTER),
             **{t: (weights_iterator, HookType.AROUND) for t in LOADER_TARGETS}}
    for target, (hook, kind) in hooks.items():
        missing = _unresolved(target)
        if missing is None:
            _register(target, hook, kind)
        elif target in REQUIRED:
            raise checks.EngineRefused(
                f"sglang {version} has no {target} ({missing}) for tierstore's plugin to hook, so sglang would "
                f"allocate and load its own full Engram host table: run sglang "
                f"{', '.join(checks.SUPPORTED['sglang'][1])}, or unset TIERSTORE_SGLANG_SOCKET")
        else:
            log.warning("tierstore: no %s here (%s): %s", target, missing, OPTIONAL[target])
    os.environ["SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE"] = "1"
    os.environ["SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT"] = "shared"


def _unresolved(target: str) -> str | None:
    """None if `target` resolves as HookRegistry resolves it (module or class, then the
    attribute), else why not."""
    import pkgutil

    owner, _, attr = target.rpartition(".")
    try:
        obj = pkgutil.resolve_name(owner)
    except Exception as e:  # noqa: BLE001 - whatever the import raised is the reason
        return f"{type(e).__name__}: {e}"
    return None if hasattr(obj, attr) else f"{owner} has no {attr}"


def _register(target: str, hook, kind) -> None:
    """HookRegistry.register, once per process however often the plugin runs."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    if not any(h is hook for _, h, _ in HookRegistry._hooks.get(target, ())):
        HookRegistry.register(target, hook, kind)


def install() -> None:
    """plugin() and HookRegistry.apply_hooks() now, in this process, as sglang's load_plugins()
    runs them: for the bench, which builds sglang's modules itself and twice in one process
    (load_plugins runs once a process)."""
    plugin()
    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry.apply_hooks()


def check_server_args(server_args) -> None:
    """BEFORE hook of ServerArgs.check_server_args (sglang's start, before any process is spawned,
    and before sglang's own checks): every REQUIRED hook was applied, and no setting
    checks.FEATURES refuses is on. Raised here, a refusal stops sglang's start."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    if SglangConfig.from_env() is None:
        return
    unapplied = [t for t in REQUIRED if t not in HookRegistry._patched]
    if unapplied:
        raise checks.EngineRefused(
            f"sglang's HookRegistry did not apply tierstore's hooks on {', '.join(unapplied)} (its log says why), so "
            f"sglang would load its own full Engram host tables: run sglang "
            f"{', '.join(checks.SUPPORTED['sglang'][1])}, or unset TIERSTORE_SGLANG_SOCKET")
    if str(server_args.load_format) == "dummy":
        raise checks.EngineRefused.of("sglang", DUMMY, "--load-format dummy")


_TABLES: dict[tuple[str, str], object] = {}  # (socket, table) -> SplitTable, one per process
_LOCK = threading.Lock()


def _split_table(config: SglangConfig, table: str):
    with _LOCK:
        t = _TABLES.get((config.socket, table))
        if t is not None and not t.retired:
            return t
        with _sidecar(config, table, " --split-layout all") as c:
            t = c.split_table(table)
        _TABLES[(config.socket, table)] = t
        return t


def _staged(config: SglangConfig, table: str) -> bool:
    """Whether layer table `table` is staged (sglang_stager.py) rather than mapped: by
    config.stage, and under "auto" whether the sidecar serves it anything but split-layout."""
    if config.stage != "auto":
        return config.stage == "on"
    with _sidecar(config, table) as c:
        return not c.handle(table).split


@contextlib.contextmanager
def _sidecar(config: SglangConfig, table: str, serve_flags: str = ""):
    """A Client of the sidecar, its errors as EngineAttachError naming table `table` and,
    for a sidecar that does not answer, the command that starts one (with `serve_flags`)."""
    from tierstore.client.client import Client

    try:
        with Client(config.socket, timeout=config.timeout) as c:
            yield c
    except errors.Unavailable as e:
        raise EngineAttachError(f"sglang's Engram table {table} comes from the tierstore sidecar at "
                                f"{config.socket}, which does not answer ({e}); start it first: `tierstore serve "
                                f"--data DIR --socket {config.socket}{serve_flags}`") from None
    except errors.TierstoreError as e:
        raise EngineAttachError(f"sglang's Engram table {table} from the sidecar at {config.socket}: {e}") from None


def weights_iterator(original, hf_weights_files, *args, **kwargs):
    """AROUND hook of sglang's safetensors iterators (DefaultModelLoader's default path): the
    checkpoint's tensors through weight_filter.filtered, so a restart reads of the Engram tables
    only the rows TIERSTORE_SGLANG_VERIFY checks. Off (TIERSTORE_SGLANG_SOCKET unset): sglang's."""
    weights = original(hf_weights_files, *args, **kwargs)
    config = SglangConfig.from_env()
    if config is None:
        return weights
    whole = ("--weight-loader-disable-mmap" if kwargs.get("disable_mmap") else
             "--weight-loader-prefetch-checkpoints" if kwargs.get("prefetch") else None)
    return weight_filter.filtered(weights, "sglang", config.verify == "sample", whole)


def init_host_table(original, embed, num_embeddings: int, dim: int, layer_id: int):
    """AROUND hook of EngramEmbedding._init_host_table: the host table is the split arena of
    table `config.table(layer_id)`. Off (TIERSTORE_SGLANG_SOCKET unset): sglang's own."""
    config = SglangConfig.from_env()
    if config is None:
        return original(embed, num_embeddings, dim, layer_id)
    import torch
    from torch import nn

    table = config.table(layer_id)
    if _staged(config, table):
        return _attach_staged(embed, config, table, num_embeddings, dim, layer_id)
    t = _split_table(config, table)
    checks.check_shape("sglang", layer_id, table, t.rows, t.row_dim, num_embeddings, dim)
    weight, scale = t.tensors()
    embed.weight = nn.Parameter(weight, requires_grad=False)
    embed.scale = nn.Parameter(scale, requires_grad=False)
    # the loader __init__ gives both parameters is `self._load_rows`, looked up after this
    # hook returns: this instance's checks the checkpoint's rows instead of copying them
    embed._load_rows = checks.CheckpointCheck.mapped("sglang", layer_id, t, config.verify)
    if torch.cuda.is_available() and torch.get_default_device().type == "cuda":  # sglang builds under its device
        from sglang.srt.layers import engram as sg

        t.register_cuda()
        ptr = sg._registered_device_ptr(t.weight.ctypes.data)  # the host address on CUDA (UVA), HIP's own on ROCm
        embed.host_table = MappedHostTable(t, ptr)
        embed._host_table_ptrs = (ptr, ptr + t.weight.nbytes)
        embed._sort_host_reads = sg._sorted_host_reads(torch.cuda.current_device())
    else:
        embed.host_table = None  # sglang's CPU torch path reads weight / scale
    embed.register_forward_pre_hook(ArenaGuard(config, table, t))


def _attach_staged(embed, config: SglangConfig, table: str, num_embeddings: int, dim: int, layer_id: int) -> None:
    """The plugin's _init_host_table for a staged layer: placeholder parameters (no rows), a
    loader that checks the checkpoint's rows against tierstore's, a forward that refuses
    unstaged batches. `embed.tierstore_table` is what RowStager.from_model looks for."""
    import torch
    from torch import nn

    from tierstore.client.engines.sglang_stager import StagedHostTable, StagedTable, UnstagedForward, process_client

    try:
        t = StagedTable(process_client(config.socket, config.timeout), table, form=config.stage_form)
    except errors.Unavailable as e:
        raise EngineAttachError(f"sglang's Engram table {table} comes from the tierstore sidecar at "
                                f"{config.socket}, which does not answer ({e}); start it first: `tierstore serve "
                                f"--data DIR --socket {config.socket}`") from None
    except errors.TierstoreError as e:  # StagingError too (a table not in fp8-e4m3-ue8m0)
        raise EngineAttachError(f"sglang's Engram table {table} from the sidecar at {config.socket}: {e}") from None
    checks.check_shape("sglang", layer_id, table, t.rows, t.dim, num_embeddings, dim)
    scale_dtype = getattr(torch, "float8_e8m0fnu", torch.uint8)
    embed.weight = nn.Parameter(torch.empty((0, dim), dtype=torch.float8_e4m3fn), requires_grad=False)
    embed.scale = nn.Parameter(torch.empty((0, dim // checks.FP8_BLOCK), dtype=scale_dtype), requires_grad=False)
    embed._load_rows = checks.CheckpointCheck("sglang", layer_id, table, t.version, t.rows, dim, t.read,
                                              config.verify, checkpoint=t.checkpoint)
    embed.host_table = StagedHostTable(t)
    embed.staged_by_scheduler = True  # what sglang's enable_scheduler_staging sets
    embed.tierstore_table = t
    embed.forward = UnstagedForward(embed, table)


class MappedHostTable:
    """What sglang's forward reads of its `_HostTable` (layout, dirty, finish_load, device_ptr:
    the registered mapping's device address, `_registered_device_ptr`'s), over a split arena:
    "shared" (every row mapped in every rank), loaded already."""

    layout = "shared"

    def __init__(self, split, device_ptr: int):
        self.split = split
        self.dirty = False
        self.nbytes = split.weight.nbytes + split.scale.nbytes
        self.device_ptr = device_ptr

    def finish_load(self, label: str) -> None:
        log.info("engram host table %s: tierstore table %s v%d, mapped (%.2f GiB, no load)", label,
                 self.split.table, self.split.version, self.nbytes / 2**30)


class ArenaGuard:
    """Forward pre-hook: the arena is still the one the sidecar serves for this table, or a
    retired copy of the same version (same verified bytes); another version raises.

    While the mapped arena is current a forward reads one header byte. Once it is retired the
    guard asks the sidecar what it serves through one Client it keeps: the Client's handle of
    the table is described again only when the arena it names is retired too, so a sidecar
    restart costs one describe, not one per forward. A sidecar that does not answer is asked
    again at the next forward."""

    def __init__(self, config: SglangConfig, table: str, split):
        self.config, self.table, self.split = config, table, split
        self.client = None
        self.warned = False

    def __call__(self, module, args) -> None:
        if not self.split.retired:
            return
        from tierstore.client.client import Client

        try:
            if self.client is None:
                self.client = Client(self.config.socket, timeout=self.config.timeout)
            handle = self.client.handle(self.table)
            handle.mapped  # mapped (once per arena), so the handle turns stale when this arena retires too
            served = handle.version
        except errors.TierstoreError:
            served = None  # sidecar away: the mapped rows are the verified bytes of our version
        if served is not None and served != self.split.version:
            raise EngineAttachError(f"tierstore now serves table {self.table} at v{served}; this sglang process "
                                    f"maps v{self.split.version} and never mixes versions: restart sglang (it maps "
                                    f"the warm arena, no load)")
        if not self.warned:
            self.warned = True
            log.warning("tierstore table %s v%d: the sidecar retired this arena (restart%s); its mapped rows, "
                        "verified at load, keep serving", self.table, self.split.version,
                        "" if served is not None else ", and the sidecar does not answer now")


# ---- the launcher -------------------------------------------------------------------------------
def launch(socket: str, sglang_args: list[str], prefix: str = "", verify: str = "sample", stage: str = "auto") -> int:
    """`tierstore sglang --socket S -- ARGS`: sglang's server (python -m sglang.launch_server ARGS)
    with the integration on in it and every process it spawns. Fails before sglang starts when
    the sidecar does not answer, serves no table named {prefix}l*, or (stage off) none of them
    split-layout."""
    import subprocess

    from tierstore.client.client import Client

    SglangConfig(socket=socket, prefix=prefix, verify=verify, stage=stage)
    try:
        with Client(socket, timeout=10) as c:
            named = [t["table"] for t in c.tables() if t["table"].startswith(f"{prefix}l")]
            if not named:
                raise EngineAttachError(f"the sidecar at {socket} serves no table named {prefix}l*: ingest the "
                                        f"checkpoint (tierstore ingest-checkpoint) or pass its --prefix")
            if stage == "off" and not any(c.handle(t).split for t in named):
                raise EngineAttachError(f"the sidecar at {socket} serves no split-layout table named {prefix}l*: "
                                        f"restart it with --split-layout all, or stage the rows (--stage auto)")
    except errors.Unavailable as e:
        raise EngineAttachError(f"no tierstore sidecar answers at {socket} ({e}); start `tierstore serve --data DIR "
                                f"--socket {socket} --split-layout all` first") from None
    env = {**os.environ, "TIERSTORE_SGLANG_SOCKET": str(socket), "TIERSTORE_SGLANG_PREFIX": prefix,
           "TIERSTORE_SGLANG_VERIFY": verify, "TIERSTORE_SGLANG_STAGE": stage}
    return subprocess.call([sys.executable, "-m", "sglang.launch_server", *sglang_args], env=env)
