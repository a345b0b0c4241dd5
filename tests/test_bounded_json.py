"""tierstore.bounded_json: the same values as json.loads for every document within its
limits, and BadJSON (naming the limit) for one over them, never a RecursionError."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore import bounded_json
from tierstore.errors import BadJSON, InvalidArgument

# JSON values with strings full of brackets, quotes and backslashes (what a depth count must skip)
TEXT = st.text(alphabet=st.sampled_from('[]{}"\\\\ab/é\n\u2028'), max_size=12)
VALUES = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False,
                                                                                  allow_infinity=False), TEXT),
                      lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(TEXT, kids, max_size=4)),
                      max_leaves=30)


def _depth(v) -> int:
    if isinstance(v, list):
        return 1 + max(map(_depth, v), default=0)
    if isinstance(v, dict):
        return 1 + max(map(_depth, v.values()), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(VALUES, st.booleans())
def test_within_the_limits_it_is_json_loads(v, ascii_only):
    raw = json.dumps(v, ensure_ascii=ascii_only)
    assert bounded_json.loads(raw, max_bytes=1 << 20) == json.loads(raw)
    depth = _depth(v)
    if depth:
        with pytest.raises(BadJSON, match=f"nested {depth} levels deep, over the limit of {depth - 1}"):
            bounded_json.loads(raw, max_bytes=1 << 20, max_depth=depth - 1)


@pytest.mark.parametrize("doc", ["[" * 200_000 + "]" * 200_000, '{"a": ' * 100_000 + "1" + "}" * 100_000,
                                 "[" * 200_000])
def test_deep_nesting_is_refused_not_a_recursion_error(doc):
    with pytest.raises(BadJSON, match=r"nested \d+ levels deep, over the limit of 64"):
        bounded_json.loads(doc, max_bytes=1 << 30)


def test_size_is_refused_before_parsing_and_errors_are_invalid_arguments():
    with pytest.raises(BadJSON, match=r"1048577 bytes of JSON, over the 1 MiB limit"):
        bounded_json.loads(b" " * ((1 << 20) + 1), max_bytes=1 << 20)
    for doc, why in [('{"x": NaN}', "NaN is not a JSON number"), ("[1e400]", "1e400 is beyond a float's range"),
                     ("[-Infinity]", "-Infinity"),
                     ("[1,", "not JSON"), (b"\xff\xfe", "not JSON"), ('"[[[["', None)]:
        if why is None:
            assert bounded_json.loads(doc, max_bytes=100) == "[[[["
            continue
        with pytest.raises(InvalidArgument, match=why):
            bounded_json.loads(doc, max_bytes=100)
