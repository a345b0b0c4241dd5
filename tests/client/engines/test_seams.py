"""client/engines/seams.py: every supported engine version's manifest is found in that engine's
installed source, and any one seam renamed (each in turn) or re-signed refuses the start naming it.

The engines' sources are the installed ones (the version `make test-engines` puts first on
the path); a seam is renamed by rewriting its name in its module's source text, which the
check reads (seams.check's `source`), so nothing of the installed engine is modified."""
from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version

import pytest

from tierstore.client.engines import checks, seams


def _installed(engine: str) -> str:
    try:
        have = version(checks.SUPPORTED[engine][0])
    except PackageNotFoundError:
        pytest.skip(f"{engine} is not installed (make engine-deps-{engine} installs it)")
    if have not in checks.SUPPORTED[engine][1]:
        pytest.skip(f"{engine} {have} is not a supported version")
    return have


def _renamed(seam: seams.Seam, text_of=seams.source_of):
    """The sources with `seam`'s own name rewritten (every occurrence of the identifier in its module)."""
    name = seam.names[-1]

    def source(module: str) -> str | None:
        text = text_of(module)
        if module != seam.module or text is None:
            return text
        return re.sub(rf"\b{re.escape(name)}\b", f"{name}_renamed", text)

    return source


def test_every_supported_version_has_a_manifest_and_no_other():
    for engine, (_, versions) in checks.SUPPORTED.items():
        assert set(seams.MANIFESTS[engine]) == set(versions), engine
    assert set(seams.MANIFESTS) == set(checks.SUPPORTED)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_installed_engine_has_every_seam_of_its_manifest(engine):
    have = _installed(engine)
    assert seams.missing(seams.MANIFESTS[engine][have]) == []
    seams.check(engine, have)  # nothing raised


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_each_seam_renamed_in_turn_refuses_the_start_naming_it(engine):
    """Every seam of the installed version's manifest, one at a time: the check raises
    EngineRefused naming that seam (among any others the rename took with it), the version
    and the fix."""
    have = _installed(engine)
    manifest = seams.MANIFESTS[engine][have]
    for seam in manifest:
        with pytest.raises(checks.EngineRefused) as e:
            seams.check(engine, have, _renamed(seam))
        msg = str(e.value)
        assert f"{seam}: " in msg, (seam, msg)
        assert f"this install of {engine} {have} lacks or changed" in msg
        assert f"pip install --force-reinstall --no-deps {engine}=={have}" in msg
        assert f"unset {checks.NO_SOCKET[engine]}" in msg


def test_a_wrapped_method_whose_parameters_changed_is_refused():
    have = _installed("vllm")
    module = "vllm.models.deepseek_v41.nvidia.model_state"

    def source(name: str) -> str | None:
        text = seams.source_of(name)
        if name == module:
            text, n = re.subn(r"(def prepare_inputs\(\s*self,\s*)input_batch", r"\1batch", text)
            assert n == 1
        return text

    with pytest.raises(checks.EngineRefused, match=r"DeepseekV41ModelState.prepare_inputs\(self, input_batch, "
                                                   r"req_states\): takes \(self, batch, req_states\)"):
        seams.check("vllm", have, source)


def test_a_module_of_the_manifest_not_installed_is_named():
    """vLLM 0.34 removed the V1 runner's modules: a manifest naming one refuses, naming the module."""
    gone = seams.Seam("vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs")
    _installed("vllm")
    assert seams.missing([gone], lambda m: None) == [
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs: module vllm.v1.worker.gpu_model_runner "
        "has no source file here"]


def test_what_counts_as_defined():
    """Module names (def, class, assignment, import, conditional ones), class members, fields and
    attributes a method sets on self or registers as a buffer; a name rebound to a class made
    from it keeps the class's members."""
    text = '''
import os.path as osp
from a import b as c
try:
    X = 1
except ImportError:
    Y = 2
class K:
    field: int = 0
    def __init__(self, q, *, r=1):
        self.set_here = q
        self.a, self.b = 1, 2
        self.typed: int
        self.register_buffer("buf", None)
    def m(self, x, y=0):
        pass
K = make(K)
'''
    def found(*paths) -> list:
        return seams.missing([seams.Seam(f"m:{p}") for p in paths], lambda m: text)

    assert found("osp", "c", "X", "Y", "K", "K.field", "K.set_here", "K.a", "K.b", "K.typed", "K.buf", "K.m") == []
    assert found("os", "b", "K.q", "K.nothing", "Z") == [f"m:{p}: not defined" for p in ("os", "b", "K.q",
                                                                                         "K.nothing", "Z")]
    assert seams.missing([seams.Seam("m:K.m", ("self", "x")), seams.Seam("m:K.__init__", ("self", "q", "r"))],
                         lambda m: text) == ["m:K.__init__(self, q, r): takes (self, q)"]
    assert seams.missing([seams.Seam("m:K.field", ("self",))], lambda m: text) == ["m:K.field(self): not a function"]
