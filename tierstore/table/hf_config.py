"""EngramSpec from a Hugging Face config.json (DeepSeek-V4.1 layout).

V4.1 nests the text model under `text_config`; the Engram fields live there,
`image_token_id` at the top level. Every hashing constant is taken from the
file (there is no seed field: the per-layer seed is 10007 * layer_id, which
EngramSpec.multipliers already does), and `engram_num_embeddings` is checked
against the prime layout the constants derive, so a config that would rehash
the table is refused before any row is read.
"""
from __future__ import annotations

import json
from pathlib import Path

from tierstore.errors import SpecMismatch
from tierstore.table.formats import RowFormat
from tierstore.table.spec import EngramSpec

__all__ = ["load_config", "spec_from_config", "ENGRAM_FIELDS"]

# config field -> why it matters (named in the error when missing)
ENGRAM_FIELDS = ("engram_layer_ids", "engram_num_embeddings", "engram_max_ngram_size", "engram_n_heads",
                 "engram_head_dim", "engram_vocab_size", "engram_pad_token_id", "engram_compressed_vocab_size",
                 "hidden_size", "hc_mult", "rms_norm_eps")


def load_config(src) -> tuple[dict, str]:
    """(config dict, where it came from) for a checkpoint dir, a config.json path or a dict."""
    if isinstance(src, dict):
        return src, "config"
    path = Path(src)
    if path.is_dir():
        path = path / "config.json"
    try:
        return json.loads(path.read_text()), str(path)
    except FileNotFoundError:
        raise SpecMismatch(f"{path}: no such file; a Hugging Face checkpoint directory has a config.json") from None
    except (OSError, ValueError) as e:
        raise SpecMismatch(f"{path}: not a readable JSON config ({e})") from None


def _text(cfg: dict) -> dict:
    """The text model's fields: `text_config` merged over the top level (V4.1 nests them)."""
    text = cfg.get("text_config")
    return {**cfg, **text} if isinstance(text, dict) else cfg


def spec_from_config(src, name: str | None = None):
    """EngramSpec of the checkpoint config `src` (dir, config.json or dict).

    name: the spec's name (default the config's `_name_or_path` or `model_type`).
    Raises SpecMismatch naming the file and field for a missing or bad Engram
    field, or for `engram_num_embeddings` that disagree with the derived primes."""
    cfg, where = load_config(src)
    t = _text(cfg)
    missing = [f for f in ENGRAM_FIELDS if f not in t]
    if missing:
        raise SpecMismatch(f"{where}: no {', '.join(missing)} (looked at the top level and text_config); "
                           "is this an Engram model's config (e.g. DeepSeek-V4.1)?")
    layers = [int(v) for v in t["engram_layer_ids"]]
    rows = [int(v) for v in t["engram_num_embeddings"]]
    if len(rows) != len(layers):
        raise SpecMismatch(f"{where}: engram_num_embeddings has {len(rows)} entries for "
                           f"{len(layers)} engram_layer_ids")
    image = cfg.get("image_token_id", t.get("image_token_id"))
    evs = t["engram_vocab_size"]  # one value (V4.1) or one per n-gram order
    try:
        spec = EngramSpec(
            name=name or str(cfg.get("_name_or_path") or cfg.get("model_type") or "checkpoint"),
            layer_ids=tuple(layers), max_ngram=int(t["engram_max_ngram_size"]), n_heads=int(t["engram_n_heads"]),
            engram_vocab_size=tuple(int(v) for v in evs) if isinstance(evs, list) else int(evs),
            compressed_vocab_size=int(t["engram_compressed_vocab_size"]),
            row_dim=int(t["engram_head_dim"]), row_format=RowFormat.FP8_E4M3_UE8M0.value,
            pad_id=int(t["engram_pad_token_id"]), hidden_size=int(t["hidden_size"]), hc_mult=int(t["hc_mult"]),
            use_conv=False, rms_norm_eps=float(t["rms_norm_eps"]),
            image_token_id=None if image is None else int(image))
    except (TypeError, ValueError) as e:
        raise SpecMismatch(f"{where}: bad Engram fields ({e})") from None
    for L, n in zip(layers, rows):
        if spec.rows(L) != n:
            raise SpecMismatch(
                f"{where}: engram_num_embeddings says layer {L} has {n} rows, but the prime layout of "
                f"engram_vocab_size={t['engram_vocab_size']}, max_ngram={spec.max_ngram}, n_heads={spec.n_heads} "
                f"gives {spec.rows(L)}; the config does not describe this table")
    return spec
