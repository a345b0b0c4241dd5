"""A started --direct-io sidecar, or the test skipped where the filesystem refuses O_DIRECT."""
from __future__ import annotations

import pytest

from tierstore.sidecar.launcher import SidecarProcess


def direct_sidecar(data_dir, budget: str = "1MiB", extra=(), env=None) -> SidecarProcess:
    """Start `tierstore serve --direct-io` over `data_dir`; the caller cleans it up (not `with sc`,
    which would start another). Skips the test, leaving nothing behind, where O_DIRECT is refused."""
    sc = SidecarProcess(data_dir, dram_budget=budget, extra_args=["--direct-io", *extra], env=env)
    try:
        return sc.start()
    except Exception as e:  # noqa: BLE001
        sc.cleanup()
        pytest.skip(f"O_DIRECT refused where the test data lives: {e}")
