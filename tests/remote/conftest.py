"""A real Mooncake cluster on loopback: one mooncake_master and two store
processes (each lending a DRAM segment), stopped at teardown. Never a mock."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mooncake_cluster import local_cluster  # noqa: E402


@pytest.fixture
def cluster(tmp_path):
    with local_cluster(tmp_path / "mooncake-logs", stores=2) as c:
        yield c
