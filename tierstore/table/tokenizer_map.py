"""Tokenizer compression: raw token id -> canonical ("compressed") id.

Engram hashes canonical ids, so tokens that differ only in case, accents,
Unicode compatibility form or surrounding whitespace share rows. The map is
built once from a Hugging Face `tokenizer.json`:

1. decode each raw id on its own to its text (special tokens included);
2. normalise: NFKC, NFD, strip accents, lowercase, collapse runs of
   space/tab/CR/LF to one space, strip leading and trailing whitespace -- except
   that a token that is whitespace only becomes " " (never the empty string);
3. canonical id = order of first appearance of the normalised string, walking
   raw ids upwards, so the map is dense: C = number of distinct strings.

Two fall-backs keep distinct tokens distinct: a token whose lone decode is not
valid UTF-8 (a byte-level fragment, decoded with U+FFFD) keys on its raw
vocabulary string, and a token that normalises to "" keys on its decoded text.
A token whose decoded text is itself "" keys on "": every such token shares one
canonical id, as in the engines that serve these tables (vLLM's
`build_compressed_token_map`, sglang's hasher) -- keying them apart would
change C and so every multiplier (tests/client/engines/test_hash_agreement_vllm.py).

The size C of the map's range feeds every multiplier; a table is only valid
with the map it was built with, so save them together (`save_map`).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tierstore.table.spec import EngramSpec
from tierstore.errors import InvalidArgument

__all__ = ["normalize_token", "build_compression_map", "save_map", "load_map", "load_or_build", "describe"]

_REPLACEMENT = "\ufffd"
_base = None
_strip = None


def _normalizers():
    global _base, _strip
    if _base is None:
        from tokenizers import Regex, normalizers as N
        _base = N.Sequence([N.NFKC(), N.NFD(), N.StripAccents(), N.Lowercase(),
                            N.Replace(Regex(r"[ \t\r\n]+"), " ")])
        _strip = N.Strip()
    return _base, _strip


def normalize_token(text: str) -> str:
    """The canonical form of one token's text (step 2 above)."""
    base, strip = _normalizers()
    s = base.normalize_str(text)
    return s if s == " " else strip.normalize_str(s)


def build_compression_map(tokenizer_json: str | Path) -> np.ndarray:
    """int64 array [raw_vocab_size] mapping raw id -> canonical id (C = max + 1).

    tokenizer_json: path of a Hugging Face tokenizer.json (read offline).
    Raises FileNotFoundError, or InvalidArgument for a file `tokenizers` cannot load."""
    from tokenizers import Tokenizer

    path = Path(tokenizer_json)
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer file at {path}; pass the model's tokenizer.json")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for bad JSON
        raise InvalidArgument(f"{path} is not a tokenizer.json the `tokenizers` library can load: {e}") from None
    size = tok.get_vocab_size(with_added_tokens=True)
    texts = tok.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
    canon: dict[str, int] = {}
    out = np.empty(size, np.int64)
    for raw_id, text in enumerate(texts):  # offline, once per tokenizer
        if _REPLACEMENT in text:
            key = tok.id_to_token(raw_id) or text
        else:
            key = normalize_token(text) or text
        out[raw_id] = canon.setdefault(key, len(canon))
    return out


def _spec_path(path: Path) -> Path:
    return path.with_name(path.stem + ".spec.json")


def save_map(path: str | Path, cmap: np.ndarray, spec: EngramSpec | None = None) -> Path:
    """Write the map (and the spec it belongs to, if given).

    `*.npz`: one file holding `map` and `spec` (JSON text). Anything else is
    written as `.npy` with the spec beside it as `<stem>.spec.json`. The saved
    spec's compressed_vocab_size is set to the map's C."""
    path = Path(path)
    cmap = np.ascontiguousarray(cmap, dtype=np.int64)
    if spec is not None:
        spec = EngramSpec.from_dict({**spec.to_dict(), "compressed_vocab_size": int(cmap.max()) + 1})
    if path.suffix == ".npz":
        arrays = {"map": cmap}
        if spec is not None:
            arrays["spec"] = np.array(spec.to_json())
        np.savez(path, **arrays)
        return path
    if path.suffix != ".npy":
        path = path.with_name(path.name + ".npy")
    np.save(path, cmap)
    if spec is not None:
        _spec_path(path).write_text(spec.to_json() + "\n")
    return path


def load_map(path: str | Path) -> tuple[np.ndarray, EngramSpec | None]:
    """Read a map written by `save_map`: (int64 map, spec or None)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no compression map at {path}; build one with `tierstore tokenizer-map`")
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            cmap = z["map"]
            spec = EngramSpec.from_json(str(z["spec"])) if "spec" in z.files else None
    else:
        cmap = np.load(path, allow_pickle=False)
        sp = _spec_path(path)
        spec = EngramSpec.from_json(sp.read_text()) if sp.is_file() else None
    if cmap.ndim != 1 or cmap.dtype.kind not in "iu":
        raise InvalidArgument(f"{path} does not hold a 1-D integer compression map")
    return cmap.astype(np.int64, copy=False), spec


def load_or_build(path: str | Path) -> np.ndarray:
    """A saved map (.npy/.npz) or one built from a tokenizer.json (.json)."""
    path = Path(path)
    if path.suffix == ".json":
        return build_compression_map(path)
    return load_map(path)[0]


def describe(cmap: np.ndarray) -> dict:
    """Summary for the CLI: raw vocabulary, compressed size C, compression ratio."""
    raw, c = len(cmap), int(cmap.max()) + 1
    return {"raw_vocab_size": raw, "compressed_vocab_size": c, "merged_fraction": round(1 - c / raw, 6)}

