"""``protocol.parse_json``, the one parser every route's body goes through: a body Python's
``json`` cannot turn into objects (a number with too many digits, nesting past the
recursion limit) is a ``BadRequest`` (HTTP 400), never another exception (HTTP 500)."""

from __future__ import annotations

import sys

import pytest

from sglang_echo.runtime.protocol import MAX_JSON_DEPTH, BadRequest, parse_json


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b'{"a": ' + b"7" * 5000 + b"}", f"{sys.get_int_max_str_digits()} digits"),
        (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
        (b'{"a": ' + b"{" * 50_000 + b"}" * 50_000 + b"}", "not valid JSON"),
        (b'{"a": ' + b'{"b": ' * 50_000 + b"1" + b"}" * 50_000 + b"}", "nested too deeply"),
        (b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), "nested too deeply"),
        (b'{"a": ' * (MAX_JSON_DEPTH + 1) + b"1" + b"}" * (MAX_JSON_DEPTH + 1), "too deeply"),
        (b'{"a": 1', "not valid JSON"),
        (b"[1, 2]", "JSON object"),
    ],
    ids=[
        "5000-digits",
        "100K-arrays",
        "50K-bare-braces",
        "50K-objects",
        "depth+1",
        "obj-depth+1",
        "truncated",
        "not-an-object",
    ],
)
def test_bad_bodies_are_bad_requests(body: bytes, needle: str) -> None:
    with pytest.raises(BadRequest, match=needle):
        parse_json(body)


def test_deepest_allowed_and_large_flat_bodies_parse() -> None:
    deepest = b'{"a": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}"
    assert "a" in parse_json(deepest)
    assert "a" in parse_json(b'{"a": ' * MAX_JSON_DEPTH + b"1" + b"}" * MAX_JSON_DEPTH)
    ids = list(range(100_000))
    body = b'{"input_ids": [%s], "text": "%s"}' % (
        ", ".join(map(str, ids)).encode(),
        b"[{" * 1000,  # brackets inside a string are not nesting
    )
    assert parse_json(body)["input_ids"] == ids
