"""Fixtures of the engine tests: the engines' real modules, skipped (with the reason) where not installed."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def sglang_engram():
    """(sglang.srt.layers.engram, engram_staging), imported the narrow way tierstore imports them
    (tierstore.client.engines.sglang.import_engram), on a tp-1 parallel context."""
    from tierstore.client.engines.sglang import import_engram

    try:
        modules = import_engram()
    except ImportError as e:
        pytest.skip(f"sglang's Engram modules do not import here ({e}); `make engine-deps-sglang` installs them")
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(tp_size=1, tp_rank=0)
    return modules
