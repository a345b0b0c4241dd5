"""Fixtures of the sidecar tests: a free TCP port and a reader of the metrics endpoint."""
from __future__ import annotations

import socket as socketlib
import urllib.request

import pytest


@pytest.fixture
def free_port():
    """free_port() -> a TCP port on 127.0.0.1 nobody listens on now."""
    def pick() -> int:
        with socketlib.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    return pick


@pytest.fixture
def metric():
    """metric(port, name, tier) -> the value of counter `name` (its _total line) for `tier`."""
    def read(port, name, tier) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        line = next(ln for ln in text.splitlines() if ln.startswith(f"{name}_total{{") and f'tier="{tier}"' in ln)
        return float(line.rsplit(" ", 1)[1])
    return read
