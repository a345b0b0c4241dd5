"""proto/frames.py's wire text is the step socket's specification: every
`[NAME] fields;` record it shows is the module's Struct NAME, field for field,
so the text cannot drift from what both sides pack."""
from __future__ import annotations

import re
import struct

import pytest

from tierstore.proto import frames

_INT = {"u8": "B", "u16": "H", "u32": "I", "u64": "Q", "i8": "b", "i16": "h", "i32": "i", "i64": "q"}


def _records() -> dict[str, list[str]]:
    """NAME -> its fields as the docstring lists them (one record may appear twice: COUNT)."""
    text = " ".join(frames.__doc__.split())
    out: dict[str, list[str]] = {}
    for name, fields in re.findall(r"\[([A-Z][A-Z_0-9]*)\]([^;]*);", text):
        out.setdefault(name, []).append(fields)
    return out


def _format(fields: str) -> str:
    """'u32 n_items, 4 pad, magic[4] "TSFP", conn_id[16]' -> 'I4x4s16s'."""
    codes = []
    for f in (f.strip() for f in fields.split(",")):
        if m := re.fullmatch(r"(\d+) pad", f):
            codes.append(f"{m[1]}x")
        elif m := re.fullmatch(r"([ui]\d+) \w+( \d+)?", f):
            codes.append(_INT[m[1]])
        elif m := re.fullmatch(r"\w+\[(\d+)\]( .*)?", f):
            codes.append(f"{m[1]}s")
        else:
            raise AssertionError(f"frames.py wire text: cannot read the field {f!r}")
    return "".join(codes)


def _canon(fmt: str) -> str:
    """A Struct format with its byte order dropped and runs spelled out ('xxx' == '3x')."""
    out = []
    for count, code in re.findall(r"(\d*)([a-zA-Z?])", fmt.lstrip("<>=!@")):
        n = int(count or 1)
        out.append(f"{n}{code}" if code in "sp" else code * n)
    return "".join(out)


RECORDS = _records()


def test_the_wire_text_shows_every_struct_the_frames_use():
    structs = {k for k, v in vars(frames).items() if isinstance(v, struct.Struct)}
    assert set(RECORDS) == structs, (set(RECORDS) ^ structs)


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_each_record_is_its_struct_field_for_field(name):
    st = getattr(frames, name)
    assert st.format.startswith("<"), f"{name} must be little-endian"
    for fields in RECORDS[name]:
        assert _canon(_format(fields)) == _canon(st.format), (name, fields, st.format)
