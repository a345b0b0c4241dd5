"""Names that moved out of client/sidecar.py and client/layer.py (issue 15) still import from there."""
from __future__ import annotations

import importlib

import pytest

MOVED = [
    ("sidecar", "MappedArena", "arena_map"), ("sidecar", "register_for_cuda", "arena_map"),
    ("sidecar", "unregister_for_cuda", "arena_map"), ("sidecar", "TableHandle", "table_handle"),
    ("sidecar", "StepPlan", "step_plan"), ("sidecar", "REPLANS", "step_plan"),
    ("sidecar", "to_error", "channel"), ("sidecar", "RECONNECT_WAIT_S", "channel"),
    ("sidecar", "RELEASE_LINGER_S", "fast_link"),
    ("layer", "ShortConv", "short_conv"), ("layer", "CONV_EPS", "short_conv"),
]


@pytest.mark.parametrize("old,name,new", MOVED)
def test_a_moved_name_is_the_same_object_at_its_old_path(old, name, new):
    was = importlib.import_module(f"tierstore.client.{old}")
    now = importlib.import_module(f"tierstore.client.{new}")
    assert getattr(was, name) is getattr(now, name)
    assert name in was.__all__ and name in now.__all__
