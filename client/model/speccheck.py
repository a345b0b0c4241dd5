"""The table a layer reads must have been hashed with the model's constants.

A table ingested for another seed, pad id, compressed vocabulary, prime
layout or row format is in range for every id and silently wrong for all of
them: refuse it at attach, naming the field.
"""
from __future__ import annotations

from tierstore.errors import SpecMismatch

__all__ = ["HASHING_FIELDS", "check_table_spec"]

# what decides which row an n-gram reads, and how the row is decoded
HASHING_FIELDS = ("max_ngram", "n_heads", "engram_vocab_size", "compressed_vocab_size", "pad_id", "seed",
                  "scale", "row_dim", "row_format")


def check_table_spec(spec, stored: dict | None, layer_id: int, table: str, rows: int | None = None) -> None:
    """Raise SpecMismatch when the spec stored with `table` disagrees with the model's.

    spec: the model's EngramSpec; stored: the table's spec dict (None: ingested
    without one, only the row count can be checked); rows: the table's row count.
    """
    want_rows = spec.rows(layer_id)
    if rows is not None and int(rows) != want_rows:
        raise SpecMismatch(f"table {table!r} has {rows} rows but layer {layer_id} of spec {spec.name!r} "
                           f"hashes into {want_rows}: the prime layout differs (engram_vocab_size, n_heads, "
                           f"max_ngram or scale)")
    if not stored:
        return
    mine = spec.to_dict()
    for field in HASHING_FIELDS:
        if field not in stored:
            continue
        a, b = mine.get(field), stored[field]
        if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
            a = list(a) if isinstance(a, (list, tuple)) else [a] * len(b)
            b = list(b) if isinstance(b, (list, tuple)) else [b] * len(a)
        if a != b:
            raise SpecMismatch(f"table {table!r} was hashed with {field}={b!r} but the model uses {field}={a!r}; "
                               f"ingest the table with the model's spec (or load the model's matching spec)")
    if "layer_ids" in stored and layer_id not in stored["layer_ids"]:
        raise SpecMismatch(f"table {table!r} holds layers {stored['layer_ids']}, not layer {layer_id}")
