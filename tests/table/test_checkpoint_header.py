"""tierstore.table.checkpoint.read_header accepts exactly the safetensors headers the format allows:
the safetensors library's own parser (safe_open) is the reference."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierstore.errors import SpecMismatch
from tierstore.table.checkpoint import read_header

_ITEM = {"U8": 1, "F16": 2, "BF16": 2, "F32": 4, "I64": 8}


def _write(path, entries, data: bytes) -> None:
    header = {"__metadata__": {"format": "pt"}}
    for name, dtype, shape, offsets in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _library_accepts(path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            list(f.keys())
        return True
    except Exception:  # noqa: BLE001 - every refusal counts the same here
        return False


def _ours_accepts(path) -> bool:
    try:
        read_header(path)
        return True
    except SpecMismatch:
        return False


tensors = st.lists(st.tuples(st.sampled_from(sorted(_ITEM)), st.lists(st.integers(0, 4), max_size=3)),
                   min_size=1, max_size=4)
# what is done to one tensor's offsets (or to the file's end) after a correct layout is written
damage = st.one_of(
    st.just(("none",)),
    st.tuples(st.just("shift"), st.integers(0, 3), st.integers(-9, 9)),
    st.tuples(st.just("end"), st.integers(0, 3), st.integers(-9, 9)),
    st.tuples(st.just("half"), st.integers(0, 3)),
    st.tuples(st.just("swap"), st.integers(0, 3)),
    st.tuples(st.just("copy"), st.integers(0, 3), st.integers(0, 3)),
    st.tuples(st.just("tail"), st.integers(-9, 9)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tensors=tensors, damage=damage)
def test_accepts_what_safe_open_accepts_and_refuses_what_it_refuses(tmp_path, tensors, damage):
    entries, pos = [], 0
    for i, (dtype, shape) in enumerate(tensors):
        n = int(np.prod(shape, dtype=np.int64)) * _ITEM[dtype]
        entries.append([f"t{i}", dtype, shape, [pos, pos + n]])
        pos += n
    size = pos
    kind, *arg = damage
    pick = lambda k: entries[k % len(entries)][3]  # noqa: E731
    if kind == "shift":
        o = pick(arg[0])
        o[:] = [max(0, o[0] + arg[1]), max(0, o[1] + arg[1])]
    elif kind == "end":
        o = pick(arg[0])
        o[1] = max(0, o[1] + arg[1])
    elif kind == "half":
        pick(arg[0])[0] += 0.5
    elif kind == "swap":
        pick(arg[0]).reverse()
    elif kind == "copy":
        pick(arg[1])[:] = list(pick(arg[0]))
    elif kind == "tail":
        size = max(0, size + arg[0])
    path = tmp_path / "x.safetensors"
    _write(path, entries, bytes(size))
    assert _ours_accepts(path) == _library_accepts(path), (entries, size)


def test_the_header_refusals_name_the_file_and_the_tensors(tmp_path):
    path = tmp_path / "x.safetensors"
    _write(path, [("w", "U8", [4, 8], [0, 32]), ("s", "U8", [4], [8, 12])], bytes(36))
    with pytest.raises(SpecMismatch, match=r"x\.safetensors: tensors w and s overlap"):
        read_header(path)
    _write(path, [("w", "U8", [4, 8], [0.5, 32])], bytes(32))
    with pytest.raises(SpecMismatch, match=r"x\.safetensors:w: data_offsets must be two integers"):
        read_header(path)
    _write(path, [("w", "U8", [4, 8], [0, 32])], bytes(32))
    assert read_header(path)["w"].nbytes == 32


@pytest.mark.parametrize("header, why", [
    (b'{"w": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", r"JSON nested 200001 levels deep, over the limit of 64"),
    (b'{"w": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]' + b"", r"not JSON"),
    (b'{"w": {"dtype": "U8", "shape": [4], "data_offsets": [0, NaN]}}', r"NaN is not a JSON number"),
    (b"\xff" * 16, r"not JSON"),
], ids=["nested", "cut", "nan", "not-utf8"])
def test_a_nested_or_malformed_header_is_refused_naming_the_file_and_the_limit(tmp_path, header, why):
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    with pytest.raises(SpecMismatch, match=r"x\.safetensors: not a safetensors file \((not JSON \()?" + why):
        read_header(path)


def test_a_header_length_over_the_limit_is_refused_before_reading(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", (100 << 20) + 1) + b"{}")
    with pytest.raises(SpecMismatch, match=r"x\.safetensors: not a safetensors file \(header length 104857601 is "
                                           r"over safetensors' 100 MiB limit\)"):
        read_header(path)
