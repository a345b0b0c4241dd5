"""Engram table spec: the constants that decide which row every n-gram reads.

A wrong constant silently rehashes the whole table, so everything derived here
(multipliers, primes, offsets, row counts) is pinned against the published
DeepSeek-V4.1 values in tests/table/test_spec.py.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from functools import cached_property

import numpy as np

from tierstore import bounded_json
from tierstore.table.formats import RowFormat

__all__ = ["EngramSpec", "PRESETS", "preset", "is_prime", "next_unused_prime", "INT64_MAX", "LAYER_SEED_PRIME",
           "LIMITS", "MAX_BUCKETS", "MAX_SPEC_JSON_BYTES"]

INT64_MAX = np.iinfo(np.int64).max
LAYER_SEED_PRIME = 10007
# Inclusive bounds of every integer field, checked before anything is derived: the prime
# search runs once per (layer, order, head) from engram_vocab_size, so an unbounded
# n_heads or vocabulary would search for hours. Each bound is far above any Engram
# model (DeepSeek-V4.1: 2 layers, N=4, K=8, vocab 16M, C 99,092, D 256) and below
# what the derived maths holds: row ids and multiplier products stay int64, the
# Miller-Rabin bases stay deterministic, a table's bytes stay countable.
LIMITS: dict[str, tuple[int, int]] = {
    "max_ngram": (2, 16), "n_heads": (1, 256), "engram_vocab_size": (2, 1 << 40),
    "compressed_vocab_size": (2, 1 << 40), "row_dim": (1, 1 << 16), "pad_id": (0, 1 << 40),
    "seed": (0, 1 << 32), "scale": (1, 1 << 40), "hidden_size": (0, 1 << 20), "hc_mult": (1, 256),
    "kernel_size": (1, 256), "image_token_id": (0, 1 << 40), "layer_id": (0, 1 << 16),
}
MAX_LAYERS = 1024
MAX_BUCKETS = 1 << 12  # layers x (max_ngram - 1) x n_heads: the primes searched for
MAX_SPEC_JSON_BYTES = 1 << 20


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (bases are the first 13 primes)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_unused_prime(start: int, seen: set[int], after: dict[int, int] | None = None) -> int:
    """Smallest prime > start that is not in `seen`.

    after: a memo of n -> the smallest prime > n, shared across calls, so that the
    walk of a later layer past the primes earlier layers took costs a lookup each,
    not a primality test of every number between them."""
    after = {} if after is None else after
    n = start
    while True:
        p = after.get(n)
        if p is None:
            p = n + 1
            while not is_prime(p):
                p += 1
            after[n] = p
        if p not in seen:
            return p
        n = p


@dataclass(frozen=True)
class EngramSpec:
    """Hashing and layout constants of one Engram model.

    engram_vocab_size: per n-gram order (2..max_ngram), the size each head's
        prime search starts from (the public models use one value for all).
    compressed_vocab_size: C, the size of the tokenizer compression map's range.
    pad_id: *raw* pad token id; it is mapped through the compression map.
    row_dim: values per row (one head's embedding); row_format: on-disk format.
    scale: demo tables divide each bucket count by this (primes stay prime).
    rms_norm_eps: the gate's RMSNorm eps (V4.1: the model's rms_norm_eps);
        None keeps the paper demo's (fp32 machine epsilon).
    image_token_id: raw id of the image placeholder token (V4.1); its
        positions are dead: hashing stops at them and their gate is 0.
    """

    name: str
    layer_ids: tuple[int, ...]
    max_ngram: int
    n_heads: int
    engram_vocab_size: tuple[int, ...]
    compressed_vocab_size: int
    row_dim: int
    row_format: str
    pad_id: int = 2
    seed: int = 0
    scale: int = 1
    hidden_size: int = 0
    hc_mult: int = 1
    kernel_size: int = 4
    use_conv: bool = True
    rms_norm_eps: float | None = None
    image_token_id: int | None = None

    def __post_init__(self):
        """Every field checked against LIMITS (ValueError naming field, bound and value)
        before anything is derived from it; integer fields must be ints, not floats or bools."""
        for f in ("max_ngram", "n_heads", "compressed_vocab_size", "row_dim", "pad_id", "seed", "scale",
                  "hidden_size", "hc_mult", "kernel_size") + (("image_token_id",) if self.image_token_id is not None
                                                              else ()):
            _check_int(f, getattr(self, f))
        evs = self.engram_vocab_size
        if _is_int(evs):
            evs = (evs,) * (self.max_ngram - 1)
        if not isinstance(evs, (tuple, list)):
            raise ValueError(f"engram_vocab_size must be an integer or a list of integers, got {evs!r}")
        for v in evs:
            _check_int("engram_vocab_size", v)
        object.__setattr__(self, "engram_vocab_size", tuple(int(v) for v in evs))
        if not isinstance(self.layer_ids, (tuple, list)) or len(self.layer_ids) > MAX_LAYERS:
            raise ValueError(f"layer_ids must be a list of at most {MAX_LAYERS} layer ids, got "
                             f"{self.layer_ids!r:.80}")
        for v in self.layer_ids:
            _check_int("layer_id", v)
        object.__setattr__(self, "layer_ids", tuple(int(v) for v in self.layer_ids))
        if len(self.layer_ids) * (self.max_ngram - 1) * self.n_heads > MAX_BUCKETS:
            raise ValueError(f"{len(self.layer_ids)} layers x {self.max_ngram - 1} n-gram orders x {self.n_heads} "
                             f"heads is {len(self.layer_ids) * (self.max_ngram - 1) * self.n_heads} hash buckets, "
                             f"over the limit of {MAX_BUCKETS}; no Engram model has that many: check the spec")
        if self.rms_norm_eps is not None and not (isinstance(self.rms_norm_eps, (int, float))
                                                  and math.isfinite(self.rms_norm_eps) and self.rms_norm_eps >= 0):
            raise ValueError(f"rms_norm_eps must be a finite number >= 0, got {self.rms_norm_eps!r}")
        if not isinstance(self.row_format, str):
            raise ValueError(f"row_format must be a format name, got {self.row_format!r}")
        RowFormat.parse(self.row_format).row_bytes(self.row_dim)
        if len(self.engram_vocab_size) != self.max_ngram - 1:
            raise ValueError(
                f"engram_vocab_size needs one value per order 2..{self.max_ngram}, got {self.engram_vocab_size}")
        if not self.layer_ids or len(set(self.layer_ids)) != len(self.layer_ids):
            raise ValueError(f"layer_ids must be distinct and non-empty, got {self.layer_ids}")
        if self.scale < 1 or min(self.engram_vocab_size) // self.scale < 2:
            raise ValueError(f"scale {self.scale} leaves no rows per bucket")

    # ---- derived constants -------------------------------------------------
    @property
    def columns(self) -> int:
        """Rows one token position reads per layer: (N-1) * K."""
        return (self.max_ngram - 1) * self.n_heads

    @property
    def row_bytes(self) -> int:
        return RowFormat.parse(self.row_format).row_bytes(self.row_dim)

    def multipliers(self, layer_id: int) -> np.ndarray:
        """Odd int64 multipliers [max_ngram] of one layer; products with ids stay < 2**63."""
        self._check_layer(layer_id)
        half = max(1, (INT64_MAX // self.compressed_vocab_size) // 2)
        rng = np.random.default_rng(self.seed + LAYER_SEED_PRIME * layer_id)
        return rng.integers(0, half, size=self.max_ngram, dtype=np.int64) * 2 + 1

    @cached_property
    def _primes(self) -> dict[int, np.ndarray]:
        seen: set[int] = set()
        after: dict[int, int] = {}
        out = {}
        for layer in self.layer_ids:
            per_layer = []
            for order in range(2, self.max_ngram + 1):
                start = self.engram_vocab_size[order - 2] // self.scale - 1
                for _ in range(self.n_heads):
                    start = next_unused_prime(start, seen, after)
                    seen.add(start)
                    per_layer.append(start)
            out[layer] = np.asarray(per_layer, dtype=np.int64)
        return out

    def primes(self, layer_id: int) -> np.ndarray:
        """Bucket sizes M(n, k) of one layer, [columns], n-major head-minor."""
        self._check_layer(layer_id)
        return self._primes[layer_id]

    def offsets(self, layer_id: int) -> np.ndarray:
        """First global row of each (n, k) bucket range, [columns]."""
        p = self.primes(layer_id)
        return np.concatenate([[0], np.cumsum(p)[:-1]]).astype(np.int64)

    def rows(self, layer_id: int) -> int:
        """Rows in one layer's table."""
        return int(self.primes(layer_id).sum())

    def table_name(self, layer_id: int) -> str:
        self._check_layer(layer_id)
        return f"l{layer_id}"

    def _check_layer(self, layer_id: int) -> None:
        if layer_id not in self.layer_ids:
            raise KeyError(f"spec {self.name!r} has no Engram layer {layer_id}; layers are {list(self.layer_ids)}")

    # ---- serialisation -----------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d["layer_ids"] = list(self.layer_ids)
        d["engram_vocab_size"] = list(self.engram_vocab_size)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "EngramSpec":
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown spec fields: {sorted(unknown)}")
        d = dict(d)
        for f in ("layer_ids", "engram_vocab_size"):
            if isinstance(d.get(f), list):
                d[f] = tuple(d[f])
        return cls(**d)

    @classmethod
    def from_json(cls, text: str | bytes) -> "EngramSpec":
        """A spec from JSON (a tokenizer map's, a profile's): parsed within bounded_json's limits;
        ValueError (BadJSON among them) for a document that is not a valid spec."""
        d = bounded_json.loads(text, max_bytes=MAX_SPEC_JSON_BYTES)
        if not isinstance(d, dict):
            raise ValueError("a spec is a JSON object")
        return cls.from_dict(d)

    def scaled(self, scale: int) -> "EngramSpec":
        """The same layout with every bucket count divided by `scale` (demo tables)."""
        d = self.to_dict()
        d["scale"] = scale
        base = self.name.split("/")[0]  # scale replaces, never compounds
        d["name"] = f"{base}/{scale}" if scale > 1 else base
        return EngramSpec.from_dict(d)


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _check_int(field: str, v) -> None:
    lo, hi = LIMITS[field]
    if not _is_int(v):
        raise ValueError(f"{field} must be an integer, got {v!r:.80}")
    if not lo <= v <= hi:
        shown = f"{v}" if abs(v) < 10 ** 30 else f"a {len(str(abs(v)))}-digit number"
        raise ValueError(f"{field} = {shown} is outside {lo}..{hi}, the range tierstore serves; no Engram model "
                         f"needs more: check the config")


# DeepSeek-V4.1-Flash and the public paper demo (engram_demo_v1). The demo uses
# the DeepSeek-V3 tokenizer; V4.1 shares its 129,280-id vocabulary, and we
# assume the same compressed size C until a tokenizer map says otherwise
# (build one with `tierstore tokenizer-map` and it overrides C).
PRESETS: dict[str, EngramSpec] = {
    "deepseek-v4.1-flash": EngramSpec(
        name="deepseek-v4.1-flash", layer_ids=(1, 14), max_ngram=4, n_heads=8,
        engram_vocab_size=16_000_000, compressed_vocab_size=99_092,
        row_dim=256, row_format=RowFormat.FP8_E4M3_UE8M0.value,
        hidden_size=5120, hc_mult=4, use_conv=False, rms_norm_eps=1e-20, image_token_id=129_264,
    ),
    "engram-paper-demo": EngramSpec(
        name="engram-paper-demo", layer_ids=(1, 15), max_ngram=3, n_heads=8,
        engram_vocab_size=129_280 * 5, compressed_vocab_size=99_092,
        row_dim=64, row_format=RowFormat.FP32.value,
        hidden_size=1024, hc_mult=4, use_conv=True,
    ),
}


def preset(name: str, scale: int = 1) -> EngramSpec:
    """A named preset, optionally scaled down for a demo table."""
    try:
        spec = PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; presets are {sorted(PRESETS)}") from None
    return spec.scaled(scale) if scale != 1 else spec
