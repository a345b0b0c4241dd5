"""The engine code each plugin touches, per engine version, checked when the engine loads the plugin.

Neither engine has a hook for Engram storage, so the plugins patch, wrap, call and read
names in the engines' own modules (each plugin's docstring says which and why). A release
may rename, move or reshape any of them, and a plugin that hooked nothing would leave the
engine loading its own tables, or a staged layer reading rows nobody staged. So every
supported version (checks.SUPPORTED) has a manifest here, `MANIFESTS[engine][version]`:
every seam the plugin touches, with the parameters it passes where it calls or wraps one.
`check(engine, version)` runs where the engine loads the plugin (vLLM's
`load_general_plugins()` -> vllm_plugin.register; sglang's `load_plugins()` ->
sglang.plugin) and refuses the start with EngineRefused naming every seam that is missing
or changed, the engine version and the fix, before anything is patched.

The check reads the installed engine's source (Python's ast) and imports nothing: the
plugins load in every engine process before any model module is imported, and importing
vLLM's model code there would cost seconds in each of them. A seam is "module:Name" or
"module:Class.name" and is found where the engine's code defines it:
- a module-level name: a def, class, assignment or import (conditional ones included);
- in a class: a method, a class attribute, an annotated field (dataclasses, pydantic and
  msgspec configs), or an attribute one of its methods sets on `self` (`self.x = ...`,
  `self.x: T`, `self.register_buffer("x", ...)`);
- `params`: the leading positional parameter names of a def, in order (`self` / `cls`
  included), the way the plugin passes them.
An attribute a subclass inherits is named on the class that defines it.
"""
from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

from tierstore.client.engines import checks

__all__ = ["Seam", "MANIFESTS", "check", "missing", "source_of"]


@dataclass(frozen=True)
class Seam:
    """One name of an engine's code a plugin touches: `path` "module:Qualified.name", and for
    a def the leading parameter names the plugin passes (`params`), in order."""

    path: str
    params: tuple[str, ...] | None = None

    @property
    def module(self) -> str:
        return self.path.partition(":")[0]

    @property
    def names(self) -> list[str]:
        return self.path.partition(":")[2].split(".")

    def __str__(self) -> str:
        return self.path + (f"({', '.join(self.params)})" if self.params is not None else "")


def _seams(module: str, *entries) -> tuple[Seam, ...]:
    """Seams of one module: each entry "Name" / "Class.name", or ("Name", params...)."""
    out = []
    for e in entries:
        name, params = (e, None) if isinstance(e, str) else (e[0], tuple(e[1:]))
        out.append(Seam(f"{module}:{name}", params))
    return tuple(out)


# ---- vLLM ---------------------------------------------------------------------------------------
_ENGRAM = "vllm.models.deepseek_v41.common.engram"
_VLLM = (
    # the plugin's loader: vLLM runs the vllm.general_plugins entry points here
    *_seams("vllm.plugins", ("load_general_plugins",)),
    # vllm_plugin._patch: the Engram layer's storage, lookup and build
    *_seams(_ENGRAM, ("ParallelEngramEmbedding._allocate_weights", "self"),
            ("ParallelEngramEmbedding.lookup", "self", "indices", "out", "background"),
            ("ParallelEngramEmbedding._storage", "self"), "ParallelEngramEmbedding._weight_loader",
            "ParallelEngramEmbedding.cpu_offload", "ParallelEngramEmbedding.num_embeddings",
            "ParallelEngramEmbedding.dim", "ParallelEngramEmbedding.block_size",
            "ParallelEngramEmbedding.vocab_start_idx", "ParallelEngramEmbedding.vocab_end_idx",
            "ParallelEngramEmbedding.head_start", "ParallelEngramEmbedding.part_n_hash_cols",
            "ParallelEngramEmbedding.n_hash_cols", "ParallelEngramEmbedding.dp_size",
            ("Engram._create_embedding", "self", "layout", "layer_hash_index"), "current_platform",
            # vllm_stager: the hasher of vLLM's model and of the scheduler's process
            "NgramHashState.layout", "NgramHashState.token_map", "NgramHashState.multipliers",
            ("EngramLayout.from_config", "cls", "config"), "EngramLayout.layer_ids", "EngramLayout.max_ngram_size",
            "EngramLayout.n_heads", "EngramLayout.compressed_vocab_size", "EngramLayout.head_dim",
            "EngramLayout.pad_token_id", "EngramLayout.primes", ("build_compressed_token_map", "tokenizer")),
    *_seams("vllm.models.deepseek_v41.common.mm_preprocess", "IMAGE_SENTINEL_BASE_ID"),
    # vllm_plugin._patch_runner / vllm_stager.stage_runner_step: the V2 runner's step
    *_seams("vllm.models.deepseek_v41.nvidia.model_state",
            ("DeepseekV41ModelState.prepare_inputs", "self", "input_batch", "req_states"),
            ("DeepseekV41ModelState.prepare_dummy_inputs", "self", "num_reqs", "num_tokens"),
            "DeepseekV41ModelState.lookback_token_ids"),
    *_seams("vllm.v1.worker.gpu.model_states.interface", "ModelState.device", "ModelState.model",
            "ModelState.vllm_config"),
    *_seams("vllm.v1.worker.gpu.input_batch", "InputBatch.req_ids", "InputBatch.num_reqs", "InputBatch.num_tokens",
            "InputBatch.input_ids", "InputBatch.positions", "InputBatch.query_start_loc",
            ("InputBatch.make_dummy", "cls")),
    *_seams("vllm.v1.worker.gpu.states", "RequestState.req_id_to_index"),
    # vllm_plugin._patch_scheduler / vllm_stager.QueueHints: queued requests' hints
    *_seams("vllm.v1.core.sched.scheduler", "Scheduler.__init__", ("Scheduler.add_request", "self", "request"),
            "Scheduler.vllm_config", "Scheduler.requests", "Scheduler.waiting", "Scheduler.max_num_scheduled_tokens"),
    *_seams("vllm.v1.request", "Request.request_id", "Request.prompt_token_ids", "Request.num_prompt_tokens",
            "Request.num_computed_tokens"),
    # vllm_plugin._patch_loader: the checkpoint's tensors through the loader filter
    *_seams("vllm.model_executor.model_loader.default_loader", "safetensors_weights_iterator"),
    *_seams("vllm.model_executor.model_loader.weight_utils",
            ("safetensors_weights_iterator", "hf_weights_files", "use_tqdm_on_load", "safetensors_load_strategy")),
    # the settings the plugin reads (vllm_plugin, vllm_stager.check_engine / graph_tokens / QueueHints)
    *_seams("vllm.config.vllm", "get_current_vllm_config_or_none", "VllmConfig.load_config",
            "VllmConfig.parallel_config", "VllmConfig.compilation_config", "VllmConfig.model_config",
            "VllmConfig.scheduler_config"),
    *_seams("vllm.config.scheduler", "SchedulerConfig.max_num_batched_tokens"),
    *_seams("vllm.config", "CUDAGraphMode"),
    *_seams("vllm.config.load", "LoadConfig.load_format"),
    *_seams("vllm.config.parallel", "ParallelConfig.enable_dbo", "ParallelConfig.ubatch_size",
            "ParallelConfig.prefill_context_parallel_size"),
    *_seams("vllm.config.compilation", "CompilationConfig.cudagraph_mode", "CompilationConfig.cudagraph_capture_sizes",
            "CompilationConfig.max_cudagraph_capture_size"),
    *_seams("vllm.config.model", "ModelConfig.hf_text_config", "ModelConfig.tokenizer",
            "ModelConfig.trust_remote_code", "ModelConfig.revision"),
)

# ---- sglang -------------------------------------------------------------------------------------
_SG_ENGRAM = "sglang.srt.layers.engram"
_SGLANG = (
    *_seams("sglang.srt.plugins", ("load_plugins",)),
    *_seams("sglang.srt.plugins.hook_registry", ("HookRegistry.register", "cls", "target"),
            ("HookRegistry.apply_hooks", "cls"), "HookRegistry._hooks", "HookRegistry._patched",
            "HookType.AROUND", "HookType.BEFORE", "HookType.AFTER"),
    # sglang.py: the host table, its parameters and the loader of their rows
    *_seams(_SG_ENGRAM, ("EngramEmbedding._init_host_table", "self", "num_embeddings", "dim", "layer_id"),
            "EngramEmbedding.weight", "EngramEmbedding.scale", "EngramEmbedding._load_rows",
            "EngramEmbedding.host_table", "EngramEmbedding._host_table_ptrs", "EngramEmbedding._sort_host_reads",
            "EngramEmbedding.staged_by_scheduler", "EngramEmbedding.forward", ("EngramEmbedding.new_rows", "self",
                                                                               "indices"),
            "EngramEmbedding.dim", ("_registered_device_ptr", "host_ptr"), ("_sorted_host_reads", "device"),
            # sglang_stager.py: the staged layers' seams and what the stager reads
            ("EngramEmbedding.dequant_staged", "self", "rows", "scales", "copied", "hash_shape"),
            "Engram.layer_hash_index", "Engram.embed", ("EngramHasher.hash_windows", "self", "tokens", "blocked"),
            "EngramHasher.max_ngram_size", "EngramHasher.primes", "engram_gather",
            # sglang_stager.stage_forward: a deferred batch hashed from sglang's own history
            ("EngramHasher._torch_hash_ids", "self", "input_ids", "positions", "kmode", "history", "num_real",
             "block", "row", "starts"), "EngramHasher.history", "MODE_DECODE", "MODE_VERIFY"),
    *_seams("sglang.srt.layers.engram_staging", ("EngramRowStager.from_model", "cls", "model", "hasher", "device")),
    *_seams("sglang.srt.managers.scheduler", ("Scheduler._add_request_to_queue", "self", "req", "is_retracted"),
            "Scheduler.waiting_queue", "Scheduler.chunked_prefill_size"),
    *_seams("sglang.srt.managers.schedule_batch", "ScheduleBatch.forward_mode", "ScheduleBatch.reqs",
            "ScheduleBatch.prefix_lens", "ScheduleBatch.extend_lens", "ScheduleBatch.encoder_swa_reset",
            "ScheduleBatch.seq_lens_cpu", "ScheduleBatch.spec_algorithm", "Req.rid", "Req.origin_input_ids",
            "Req.output_ids"),
    *_seams("sglang.srt.model_executor.forward_batch_info", ("ForwardMode.is_idle", "self"),
            ("ForwardMode.is_decode", "self"), ("ForwardMode.is_extend_without_speculative", "self"),
            ("ForwardMode.is_target_verify", "self"),
            # sglang_stager.init_forward_batch: the rows of a deferred batch, at its ForwardBatch
            ("ForwardBatch.init_new", "cls", "batch", "model_runner"), "ForwardBatch.forward_mode",
            "ForwardBatch.input_ids", "ForwardBatch.positions", "ForwardBatch.req_pool_indices",
            "ForwardBatch.spec_info", "ForwardBatch.engram_staged_rows"),
    *_seams("sglang.srt.model_executor.model_runner", "ModelRunner.is_draft_worker"),
    *_seams("sglang.srt.speculative.dflash_info", "DFlashVerifyInput.draft_token_num"),
    *_seams("sglang.srt.speculative.spec_info", ("SpeculativeAlgorithm.is_none", "self")),
    *_seams("sglang.srt.model_executor.encoder_swa_replay", ("replay_len", "prefix_len")),
    *_seams("sglang.srt.model_executor.runner_utils.capture_mode", ("get_is_capture_mode",)),
    *_seams("sglang.srt.model_executor.cuda_graph_config", "CudaGraphConfig.decode", "PhaseConfig.backend",
            "PhaseConfig.bs", "PhaseConfig.max_bs"),
    *_seams("sglang.srt.runtime_context", ("get_parallel",), ("get_spec",), ("max_speculative_num_draft_tokens",),
            ("get_exec",), ("get_schedule",)),
    *_seams("sglang.srt.arg_groups.fields.schedule", "Schedule.chunked_prefill_size", "Schedule.max_prefill_tokens"),
    *_seams("sglang.srt.arg_groups.fields.exec_", "ExecGraph.cuda_graph_config"),
    *_seams("sglang.kernels.ops.embeddings.engram_gather",
            ("engram_gather", "weight_ptr", "scale_ptr", "ids", "out", "dim", "block_size", "row_lo", "row_hi")),
    # the settings sglang.py refuses or reads at start
    *_seams("sglang.srt.server_args", ("ServerArgs.check_server_args", "self")),
    *_seams("sglang.srt.arg_groups.fields.spec", "Spec.speculative_algorithm"),
    *_seams("sglang.srt.arg_groups.fields.model", "Model.load_format"),
    *_seams("sglang.srt.environ", "envs", "Envs.SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS",
            "Envs.SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT"),
    # weight_filter.py: the checkpoint's tensors through the loader filter
    *_seams("sglang.srt.model_loader.weight_utils", ("safetensors_weights_iterator", "hf_weights_files"),
            ("buffered_multi_thread_safetensors_weights_iterator", "hf_weights_files")),
)

# engine -> version -> its seams (checks.SUPPORTED lists the same versions)
MANIFESTS: dict[str, dict[str, tuple[Seam, ...]]] = {
    "vllm": {
        "0.33.0": _VLLM + _seams("vllm.config.vllm", "VllmConfig.use_v2_model_runner"),  # its V1 runner, refused
        "0.34.0": _VLLM,
    },
    "sglang": {"0.5.23": _SGLANG},
}


def source_of(module: str) -> str | None:
    """The source text of the installed `module`, found without importing it (its top-level
    package's location, then the module's file under it); None if there is none."""
    top, _, rest = module.partition(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    base = Path(list(spec.submodule_search_locations)[0]).joinpath(*rest.split(".")) if rest else None
    for f in ((base.with_suffix(".py"), base / "__init__.py") if base is not None else
              (Path(list(spec.submodule_search_locations)[0]) / "__init__.py",)):
        if f.is_file():
            return f.read_text()
    return None


@lru_cache(maxsize=64)
def _parse(text: str) -> ast.Module:
    return ast.parse(text)


def _statements(body: list) -> list:
    """The statements of `body`, those of its if / try / with blocks included."""
    out = []
    for node in body:
        out.append(node)
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in ("body", "orelse", "finalbody"):
                out += _statements(getattr(node, block, []) or [])
            for handler in getattr(node, "handlers", []):
                out += _statements(handler.body)
    return out


def _binds(node, name: str) -> bool:
    """Whether statement `node` binds `name` at its level."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    if isinstance(node, ast.Assign):
        return any(_target_names(t, name) for t in node.targets)
    if isinstance(node, ast.AnnAssign):
        return _target_names(node.target, name)
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return any((a.asname or a.name.split(".")[0]) == name for a in node.names)
    return False


def _target_names(target, name: str) -> bool:
    if isinstance(target, ast.Name):
        return target.id == name
    if isinstance(target, (ast.Tuple, ast.List)):
        return any(_target_names(t, name) for t in target.elts)
    return False


def _sets_on_self(cls: ast.ClassDef, name: str) -> bool:
    """Whether a method of `cls` sets attribute `name` on its instance (`self.name = ...`,
    `self.name: T`, `self.register_buffer("name", ...)`)."""
    def on_self(t, me: str) -> bool:
        if isinstance(t, ast.Attribute):
            return t.attr == name and isinstance(t.value, ast.Name) and t.value.id == me
        if isinstance(t, (ast.Tuple, ast.List)):
            return any(on_self(e, me) for e in t.elts)
        return False

    for fn in (n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        if not fn.args.args:
            continue
        me = fn.args.args[0].arg
        for node in ast.walk(fn):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            if any(on_self(t, me) for t in targets):
                return True
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("register_buffer", "register_parameter") and node.args
                    and isinstance(node.args[0], ast.Constant) and node.args[0].value == name):
                return True
    return False


def _find(module: ast.Module, names: list[str]):
    """The node defining names[0] in `module`, then each next name in the class before it;
    True for an attribute the class's methods set on self; None if absent. A name that holds
    more names is a class statement (a name rebound to a class made from it, as sglang's
    ServerArgs is, keeps that class's members)."""
    body, owner = module.body, None
    for i, name in enumerate(names):
        last = i == len(names) - 1
        found = [n for n in _statements(body) if _binds(n, name) and (last or isinstance(n, ast.ClassDef))]
        if not found:
            return True if last and owner is not None and _sets_on_self(owner, name) else None
        if last:
            return found[-1]
        owner = found[-1]
        body = owner.body
    return None


def missing(seams, source: Callable[[str], str | None] | None = None) -> list[str]:
    """The seams of `seams` not found in the source `source(module)` gives (None: the installed
    engine's, `source_of`), each as "seam: why"."""
    source = source or source_of
    out = []
    for seam in seams:
        text = source(seam.module)
        if text is None:
            out.append(f"{seam}: module {seam.module} has no source file here")
            continue
        node = _find(_parse(text), seam.names)
        if node is None:
            out.append(f"{seam}: not defined")
        elif seam.params is not None:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append(f"{seam}: not a function")
                continue
            have = [a.arg for a in (*node.args.posonlyargs, *node.args.args)]
            if tuple(have[:len(seam.params)]) != seam.params:
                out.append(f"{seam}: takes ({', '.join(have)})")
    return out


def check(engine: str, version: str, source: Callable[[str], str | None] | None = None) -> None:
    """EngineRefused unless every seam of `engine` `version`'s manifest is in the installed
    engine (`source`: where the engine's module sources are read), naming each that is not."""
    gone = missing(MANIFESTS[engine][version], source)
    if gone:
        var = checks.NO_SOCKET[engine]
        raise checks.EngineRefused(
            f"tierstore's {engine} plugin hooks and reads these parts of {engine} {version}, and this install of "
            f"{engine} {version} lacks or changed {len(gone)} of them: {'; '.join(gone)}. A release tierstore was "
            f"checked against would have them all (client/engines/seams.py): reinstall it (`pip install "
            f"--force-reinstall --no-deps {engine}=={version}`), or unset {var} to run {engine} without tierstore")
