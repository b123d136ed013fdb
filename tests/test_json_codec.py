"""rollsafe.json_codec: orjson's speed with the standard library's results (values, errors)."""

from __future__ import annotations

import importlib
import json
import math
import sys
from typing import Any

import pytest

from rollsafe import json_codec

DOCUMENTS = [
    b'{"text":"hello","output_ids":[1,2,3],"meta_info":{"weight_version":"v3","e2e_latency":0.01}}',
    '{"a": "é\u2028 \\u001c", "b": [1.5, -0.0, 1e-05, 5e-324], "c": null, "d": true}',
    b'{"lp": NaN, "lo": -Infinity}',  # written by Python's json (the reference engine)
    b'{"lone": "\\ud800"}',  # a lone surrogate escape
    b'{"dup": 1, "dup": 2}',
    b"[]",
    b'"just a string"',
]


def test_an_integer_past_64_bits_is_a_float_with_orjson() -> None:
    doc = b'{"seed": 123456789012345678901234567890, "ok": 18446744073709551615}'
    got = json_codec.loads(doc)
    assert got["ok"] == 2**64 - 1 and isinstance(got["ok"], int)
    if json_codec.FAST:
        assert isinstance(got["seed"], float) and got["seed"] == float(json.loads(doc)["seed"])
    else:
        assert got == json.loads(doc)


MALFORMED = [b"", b"{", b'{"a":}', b"[1,]", b"nul", b'{"a": 1} x', "\ufeff{}"]


@pytest.mark.parametrize("doc", DOCUMENTS)
def test_loads_gives_what_json_gives(doc: str | bytes) -> None:
    want = json.loads(doc)
    got = json_codec.loads(doc)
    assert repr(got) == repr(want)  # NaN compares unequal to itself; its repr does not
    if isinstance(doc, bytes):
        assert repr(json_codec.loads(memoryview(doc))) == repr(want)


@pytest.mark.parametrize("doc", MALFORMED)
def test_malformed_input_raises_jsons_own_error(doc: str | bytes) -> None:
    with pytest.raises(json.JSONDecodeError) as std:
        json.loads(doc)
    with pytest.raises(json.JSONDecodeError) as ours:
        json_codec.loads(doc)
    assert str(ours.value) == str(std.value)


@pytest.mark.parametrize(
    "obj",
    [
        {"text": "é\u2028\x1c", "ids": (1, 2, 3), "nested": [{"x": None, "y": False}]},
        {"f": [1.5, -0.0, 1e-05, 1e16, 0.1 + 0.2, -1.2345e-7]},
        {"big": 2**70},  # orjson refuses: json writes it
        {1: "a key that is not a string"},  # the same
        "plain",
        [],
    ],
)
def test_dumps_writes_the_same_document_compact_in_utf8(obj: Any) -> None:
    out = json_codec.dumps(obj)
    assert isinstance(out, bytes)
    assert json.loads(out) == json.loads(json.dumps(obj))
    assert b", " not in out and b": " not in out
    if isinstance(obj, dict) and "text" in obj:
        assert "é".encode() in out and b"\\u001c" in out  # UTF-8, control characters escaped


def test_a_float_that_is_not_finite_is_written_null_when_orjson_runs() -> None:
    out = json_codec.loads(json_codec.dumps({"lp": -math.inf, "x": math.nan}))
    if json_codec.FAST:
        assert out == {"lp": None, "x": None}
    else:
        assert out["lp"] == -math.inf and math.isnan(out["x"])


@pytest.mark.parametrize(
    "obj",
    [
        {"input_ids": [1, 2, 3], "sampling_params": {"temperature": 0.7, "stop": None}},
        {"text": "null is a word here", "f": [1e-05, 0.1 + 0.2]},
        {1: "a key that is not a string", "x": 2**70},
    ],
)
def test_dumps_strict_writes_what_dumps_writes(obj: Any) -> None:
    out = json_codec.dumps_strict(obj)
    assert json.loads(out) == json.loads(json.dumps(obj))
    assert b", " not in out and b": " not in out


@pytest.mark.parametrize(
    "obj",
    [
        {"sampling_params": {"temperature": math.nan}},
        {"sampling_params": {"top_p": math.inf}, "stop": None},
        {1: [-math.inf]},  # orjson refuses the key: json's strict path refuses the float
    ],
)
def test_dumps_strict_refuses_a_float_that_is_not_finite_as_json_does(obj: Any) -> None:
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        json.dumps(obj, allow_nan=False)
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        json_codec.dumps_strict(obj)


def test_without_orjson_both_fall_back_to_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "orjson", None)  # import orjson -> ImportError
    try:
        plain = importlib.reload(json_codec)
        assert plain.FAST is False
        for doc in DOCUMENTS:
            assert repr(plain.loads(doc)) == repr(json.loads(doc))
        assert plain.dumps({"a": "é", "b": [1, 2]}) == '{"a":"é","b":[1,2]}'.encode()
        assert plain.dumps_strict({"a": [1.5]}) == b'{"a":[1.5]}'
        with pytest.raises(ValueError):
            plain.dumps_strict({"a": math.nan})
        with pytest.raises(json.JSONDecodeError):
            plain.loads(b"{")
    finally:
        monkeypatch.delitem(sys.modules, "orjson")
        importlib.reload(json_codec)
    assert json_codec.FAST is (importlib.util.find_spec("orjson") is not None)


def test_orjson_is_installed_where_make_installs_rollsafe() -> None:
    """The CPU lock installs it (constraints/cpu.txt): the measured path is the fast one."""
    assert json_codec.FAST
