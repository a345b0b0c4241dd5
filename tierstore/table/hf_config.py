"""EngramSpec from a Hugging Face config.json (DeepSeek-V4.1 layout).

V4.1 nests the text model under `text_config`; the Engram fields live there,
`image_token_id` at the top level. Every hashing constant is taken from the
file (there is no seed field: the per-layer seed is 10007 * layer_id, which
EngramSpec.multipliers already does), and `engram_num_embeddings` is checked
against the prime layout the constants derive, so a config that would rehash
the table is refused before any row is read. The file is parsed within
bounded_json's limits and every field bounded (EngramSpec's LIMITS) before
the prime layout is derived from it.
"""
from __future__ import annotations

from pathlib import Path

from tierstore import bounded_json
from tierstore.errors import SpecMismatch
from tierstore.table.formats import RowFormat
from tierstore.table.spec import EngramSpec

__all__ = ["load_config", "spec_from_config", "ENGRAM_FIELDS", "MAX_CONFIG_BYTES"]

MAX_CONFIG_BYTES = 4 << 20  # a model's config.json is a few KB

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
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        cfg = bounded_json.loads(raw, max_bytes=MAX_CONFIG_BYTES)
    except FileNotFoundError:
        raise SpecMismatch(f"{path}: no such file; a Hugging Face checkpoint directory has a config.json") from None
    except (OSError, ValueError) as e:
        raise SpecMismatch(f"{path}: not a readable JSON config ({e}); re-fetch the checkpoint's config.json") from None
    if not isinstance(cfg, dict):
        raise SpecMismatch(f"{path}: not a JSON object; re-fetch the checkpoint's config.json")
    return cfg, str(path)


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
    layers, rows = t["engram_layer_ids"], t["engram_num_embeddings"]
    for field in ("engram_layer_ids", "engram_num_embeddings"):
        if not isinstance(t[field], list):
            raise SpecMismatch(f"{where}: {field} must be a list (one entry per Engram layer), got {t[field]!r:.80}")
    if len(rows) != len(layers):
        raise SpecMismatch(f"{where}: engram_num_embeddings has {len(rows)} entries for "
                           f"{len(layers)} engram_layer_ids")
    image = cfg.get("image_token_id", t.get("image_token_id"))
    evs = t["engram_vocab_size"]  # one value (V4.1) or one per n-gram order
    try:
        spec = EngramSpec(
            name=name or str(cfg.get("_name_or_path") or cfg.get("model_type") or "checkpoint"),
            layer_ids=tuple(layers), max_ngram=t["engram_max_ngram_size"], n_heads=t["engram_n_heads"],
            engram_vocab_size=tuple(evs) if isinstance(evs, list) else evs,
            compressed_vocab_size=t["engram_compressed_vocab_size"],
            row_dim=t["engram_head_dim"], row_format=RowFormat.FP8_E4M3_UE8M0.value,
            pad_id=t["engram_pad_token_id"], hidden_size=t["hidden_size"], hc_mult=t["hc_mult"],
            use_conv=False, rms_norm_eps=t["rms_norm_eps"], image_token_id=image)
    except (TypeError, ValueError) as e:
        raise SpecMismatch(f"{where}: bad Engram fields ({e}; the fields are engram_* and hidden_size, hc_mult, "
                           f"rms_norm_eps in text_config)") from None
    for L, n in zip(layers, rows):
        if spec.rows(L) != n:
            raise SpecMismatch(
                f"{where}: engram_num_embeddings says layer {L} has {n} rows, but the prime layout of "
                f"engram_vocab_size={t['engram_vocab_size']}, max_ngram={spec.max_ngram}, n_heads={spec.n_heads} "
                f"gives {spec.rows(L)}; the config does not describe this table")
    return spec
