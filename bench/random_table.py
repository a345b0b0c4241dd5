"""The random tables the storage benchmarks write once into their output directory
and reuse (`bench cold`, `bench warm`, `bench lookup --table-mib`): uniform random
bytes, fp32-typed, of a chosen size and row width. Same arguments, same bytes."""
from __future__ import annotations

import numpy as np

__all__ = ["random_table"]


def random_table(cache_dir, table_bytes: int, row_bytes: int = 256, seed: int = 0, progress=False,
                 name: str = "cold"):
    """Table `name` of about `table_bytes` in `cache_dir`, written once and reused while
    its current version has that shape and seed (else written again as a new version)."""
    from tierstore.ingest.writer import write_version
    from tierstore.store.catalog import Catalog

    rows = max(1024, table_bytes // row_bytes)
    try:
        with Catalog(cache_dir, readonly=True) as cat:
            v = cat.current(name)
            # a table in an older segment format is rewritten: its misses would not read like today's
            if v.rows == rows and v.row_bytes == row_bytes and v.source == f"bench-cold seed={seed}" \
                    and v.segment_format == 2:
                return v
    except (KeyError, FileNotFoundError):
        pass
    rng = np.random.default_rng(seed)
    step = (16 << 20) // row_bytes
    chunks = (rng.integers(0, 256, size=(min(step, rows - a), row_bytes), dtype=np.uint8)
              for a in range(0, rows, step))
    return write_version(cache_dir, name, chunks, rows=rows, row_format="fp32", row_dim=row_bytes // 4,
                         source=f"bench-cold seed={seed}", progress=progress)
