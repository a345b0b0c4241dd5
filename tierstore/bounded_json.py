"""JSON read from a file or the wire, parsed only within limits.

Python's json recurses once per nesting level, so a header of 200,000 `[`
ends in a RecursionError, and a length field read from the file decides how
much it reads. `loads` is the one parser of every JSON document tierstore did
not just write itself (safetensors headers, a checkpoint's index and
config.json, the portable export's header, catalog records, spec files): the
size is checked before anything is read into the parser and the nesting depth
before json recurses, each with BadJSON naming the limit.
"""
from __future__ import annotations

import json
import math
import re

import numpy as np

from tierstore.errors import BadJSON

__all__ = ["loads", "MAX_DEPTH"]

# Deepest nesting accepted: the documents read here nest 2-6 levels (a config's
# text_config.rope_scaling, a manifest's spec), far below json's recursion limit.
MAX_DEPTH = 64
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)  # a JSON string, escapes included
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = np.zeros(256, np.int8)
_STEP[list(b"[{")], _STEP[list(b"]}")] = 1, -1
_CHUNK = 1 << 20


def loads(raw: bytes | str, *, max_bytes: int, max_depth: int = MAX_DEPTH):
    """The value of JSON document `raw`, refused (BadJSON) when it is over
    `max_bytes`, nested deeper than `max_depth`, holds a number that is not finite
    (NaN, Infinity, 1e400), or is not JSON.

    The message says which limit was crossed; callers prefix the file it came from."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    if len(raw) > max_bytes:
        raise BadJSON(f"{len(raw)} bytes of JSON, over the {_size(max_bytes)} limit")
    depth = _max_depth(raw)
    if depth > max_depth:
        raise BadJSON(f"JSON nested {depth} levels deep, over the limit of {max_depth}")
    try:
        return json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite)
    except RecursionError:  # cannot happen within MAX_DEPTH; kept typed should a caller raise the limit
        raise BadJSON(f"JSON nested too deep to parse (limit {max_depth})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise BadJSON(f"not JSON ({e})") from None


def _max_depth(raw: bytes) -> int:
    """Deepest bracket nesting of `raw` outside its strings (not recursive: brackets
    are counted with a running sum, a chunk at a time)."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKET)
    depth = deepest = 0
    for a in range(0, len(brackets), _CHUNK):
        run = np.cumsum(_STEP[np.frombuffer(brackets, np.uint8, min(_CHUNK, len(brackets) - a), a)], dtype=np.int64)
        deepest = max(deepest, depth + int(run.max()))
        depth += int(run[-1])
    return deepest


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"{text[:40]} is beyond a float's range")
    return v


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n} bytes"
