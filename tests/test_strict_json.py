"""The one strict JSON parser (:mod:`rollsafe.wire.strict_json`): every option both ways, what
is always refused, and that the export readers and the reference engine both parse with it."""

from __future__ import annotations

import json
import random
import sys
from typing import Any

import pytest

from rollsafe.errors import RollsafeError
from rollsafe.wire import strict_json
from rollsafe.wire.strict_json import (
    MAX_INT_DIGITS,
    MAX_JSON_DEPTH,
    BadJSON,
    json_depth_exceeds,
    loads_bounded,
)

#: the options the reference engine parses request bodies with
ENGINE: dict[str, Any] = {"max_depth": None, "duplicate_keys": True, "max_int_digits": None}


def _refused(raw: bytes, needle: str, **options: Any) -> str:
    with pytest.raises(BadJSON, match=needle) as caught:
        loads_bounded(raw, **options)
    return str(caught.value)


# ---------------------------------------------------------------- valid documents
DOCUMENTS = [
    {"a": [1, -2, 3.5, -0.0, 1e-300, True, False, None], "b": {"c": 'd\n\t"\\/'}},
    [],
    {},
    "",
    0,
    "\U0001f600 caf\u00e9 \u4e2d",
    {"nested": [[[[{"x": [1]}]]]]},
    {"big": 10**39, "neg": -(10**38)},
]


@pytest.mark.parametrize("value", DOCUMENTS)
@pytest.mark.parametrize("ascii_only", [True, False])
def test_a_valid_document_round_trips(value: Any, ascii_only: bool) -> None:
    data = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert loads_bounded(data) == value
    assert loads_bounded(data, **ENGINE) == value


def test_a_surrogate_pair_is_one_character_under_every_option() -> None:
    data = b'{"\\ud83d\\ude00": "\\uD83D\\uDE00\\ud800\\udc00"}'
    expect = {"\U0001f600": "\U0001f600\U00010000"}
    assert loads_bounded(data) == expect
    assert loads_bounded(data, lone_surrogates=True) == expect


# ---------------------------------------------------------------- refused under every option
ALWAYS_REFUSED = [
    (b"NaN", "non-finite number NaN"),
    (b"[Infinity]", "non-finite number Infinity"),
    (b'{"a": -Infinity}', "non-finite number -Infinity"),
    (b"1e400", "number 1e400 is not finite"),
    (b"[-1e400]", "overflows a float"),
    (b"\xc3\x28", r"not UTF-8 \(byte 0\)"),
    (b'"\xed\xa0\x80"', "not UTF-8"),  # a surrogate encoded in UTF-8 is not UTF-8
    (b"\xef\xbb\xbf{}", "invalid JSON"),
    (b'{"a": 1', "invalid JSON: .* at line 1 column"),
    (b"", "invalid JSON"),
]


@pytest.mark.parametrize(("raw", "needle"), ALWAYS_REFUSED)
@pytest.mark.parametrize("options", [{}, ENGINE, {**ENGINE, "lone_surrogates": True}])
def test_hostile_input_is_refused_under_every_option(
    raw: bytes, needle: str, options: dict[str, Any]
) -> None:
    _refused(raw, needle, **options)


def test_bad_json_is_a_rollsafe_error_and_a_value_error() -> None:
    assert issubclass(BadJSON, RollsafeError) and issubclass(BadJSON, ValueError)


# ---------------------------------------------------------------- duplicate_keys
@pytest.mark.parametrize("raw", [b'{"x": 1, "x": 2}', b'[{"a": {"x": 1, "y": 0, "x": 2}}]'])
def test_duplicate_keys_are_refused_by_default(raw: bytes) -> None:
    assert _refused(raw, "duplicate key") == "duplicate key 'x'"


def test_duplicate_keys_last_wins_when_allowed() -> None:
    assert loads_bounded(b'{"x": 1, "y": 0, "x": 2}', duplicate_keys=True) == {"x": 2, "y": 0}
    # same key text, different escapes: still the same key
    _refused(b'{"x": 1, "\\u0078": 2}', "duplicate key 'x'")
    assert loads_bounded(b'{"x": 1, "\\u0078": 2}', duplicate_keys=True) == {"x": 2}


def test_a_long_duplicate_key_is_shown_shortened() -> None:
    key = "k" * 1000
    message = _refused(json.dumps({key: 1}).encode()[:-1] + f', "{key}": 2}}'.encode(), "dup")
    assert len(message) < 80 and message.endswith("...")


# ---------------------------------------------------------------- max_depth
def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def test_max_depth_is_checked_before_parsing() -> None:
    assert loads_bounded(_nested(MAX_JSON_DEPTH)) is not None
    assert _refused(_nested(MAX_JSON_DEPTH + 1), "nested") == "nested deeper than 64 levels"
    assert loads_bounded(_nested(3), max_depth=3) == [[[]]]
    assert _refused(_nested(4), "nested", max_depth=3) == "nested deeper than 3 levels"
    # brackets inside strings do not count
    assert loads_bounded(b'[["[[[[\\"[[", "{{{{"]]', max_depth=2) == [['[[[["[[', "{{{{"]]


@pytest.mark.parametrize("raw", [_nested(100_000), b'{"a": ' + _nested(100_000) + b"}"])
def test_a_100k_deep_document_is_refused_not_a_crash(raw: bytes) -> None:
    assert _refused(raw, "nested") == "nested deeper than 64 levels"
    # only the interpreter's recursion limit: the RecursionError is caught and named
    assert _refused(raw, "nested", max_depth=None) == "nested too deeply"
    # a max_depth above what the interpreter can parse falls back to the same
    assert _refused(raw, "nested", max_depth=10**6) == "nested too deeply"


def test_without_max_depth_moderate_nesting_still_parses() -> None:
    assert loads_bounded(_nested(200), max_depth=None) is not None
    _refused(_nested(200), "nested deeper than 64 levels")


def test_json_depth_exceeds_is_exact_on_its_own() -> None:
    assert not json_depth_exceeds(b'{"a": [[1]]}', 3) and json_depth_exceeds(b'{"a": [[1]]}', 2)
    assert not json_depth_exceeds(b'["\\\\", "[[[["]', 1)


# ---------------------------------------------------------------- max_int_digits
def test_int_digits_default_limit_counts_the_sign() -> None:
    assert MAX_INT_DIGITS == 40
    assert loads_bounded(b"9" * 40) == int("9" * 40)
    assert loads_bounded(b"-" + b"9" * 39) == -int("9" * 39)
    message = _refused(b"9" * 41, "digits")
    assert message == "integer of 41 digits is too large (at most 40)"
    _refused(b"[-" + b"9" * 40 + b"]", "integer of 41 digits")
    assert loads_bounded(b"1" * 41 + b".5") == float("1" * 41 + ".5")  # floats are not ints


def test_int_digits_can_be_set() -> None:
    assert loads_bounded(b"[12345]", max_int_digits=5) == [12345]
    _refused(b"[123456]", "integer of 6 digits is too large", max_int_digits=5)


def test_int_digits_none_leaves_pythons_limit() -> None:
    assert loads_bounded(b"9" * 1000, max_int_digits=None) == int("9" * 1000)
    limit = getattr(sys, "get_int_max_str_digits", lambda: 0)()
    if not limit:
        pytest.skip("this interpreter has no int digit limit")
    assert loads_bounded(b"9" * limit, max_int_digits=None) == int("9" * limit)
    message = _refused(b"9" * (limit + 1), "digits", max_int_digits=None)
    assert message == f"integer of more than {limit} digits is too large"


# ---------------------------------------------------------------- lone_surrogates
LONE = [
    (b'"\\ud800"', "\\ud800"),
    (b'"ab\\udfffcd"', "\\udfff"),
    (b'["a", "\\uDBFF"]', "\\uDBFF"),
    (b'"\\ud800\\ud800\\udc00"', "\\ud800"),  # the first high has no low after it
    (b'"\\ud83d\\ude00\\ude00"', "\\ude00"),  # a pair, then a lone low
    (b'"\\\\\\ud800"', "\\ud800"),  # an escaped backslash, then the escape
]
LONE_IN_KEY = [(b'{"\\ud800": 1}', "\\ud800"), (b'[{"a": {"x\\udc00": 1}}]', "\\udc00")]


@pytest.mark.parametrize(("raw", "escape"), LONE + LONE_IN_KEY)
def test_a_lone_surrogate_is_refused_by_default(raw: bytes, escape: str) -> None:
    message = _refused(raw, "lone UTF-16 surrogate")
    assert message == f"a string holds a lone UTF-16 surrogate ({escape})"
    _refused(raw, "lone UTF-16 surrogate", **ENGINE)  # the engine refuses them too


@pytest.mark.parametrize(("raw", "escape"), LONE + LONE_IN_KEY)
def test_a_lone_surrogate_passes_when_allowed(raw: bytes, escape: str) -> None:
    assert loads_bounded(raw, lone_surrogates=True) == json.loads(raw)


@pytest.mark.parametrize("raw", [b'"\\\\ud800"', b'"\\\\\\\\ud800"', b'"\\\\\\"ud800"'])
def test_an_escaped_backslash_before_u_is_not_a_surrogate(raw: bytes) -> None:
    assert loads_bounded(raw) == json.loads(raw)


def test_the_surrogate_scan_agrees_with_the_decoder() -> None:
    """Random runs of escapes: refused exactly when the decoded string cannot be UTF-8."""
    rng = random.Random(7)
    pieces = [
        "\\\\",
        "\\ud800",
        "\\uDBFF",
        "\\udc00",
        "\\uDFFF",
        "\\ud83d",
        "\\ude00",
        "a",
        "\\n",
        '\\"',
        "\\u0041",
        "\\\\u",
        "ud800",
        "\\/",
    ]
    for _ in range(20_000):
        raw = ('"' + "".join(rng.choice(pieces) for _ in range(rng.randrange(9))) + '"').encode()
        text = json.loads(raw)
        try:
            text.encode("utf-8")
            lone = False
        except UnicodeEncodeError:
            lone = True
        if lone:
            _refused(raw, "lone UTF-16 surrogate")
        else:
            assert loads_bounded(raw) == text, raw


# ---------------------------------------------------------------- one parser, two users
def test_the_hf_verifier_parses_with_the_shared_parser() -> None:
    import rollsafe.hf.verify as verify

    assert verify.loads_bounded is strict_json.loads_bounded


def test_the_engine_parses_with_the_shared_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollsafe.adapters.reference_engine import server
    from rollsafe.adapters.reference_engine.errors import BadRequest

    seen: list[dict[str, Any]] = []

    def spy(data: bytes, *args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return strict_json.loads_bounded(data, *args, **kwargs)

    monkeypatch.setattr(server, "loads_bounded", spy)
    assert server.parse_json(b'{"a": 1}') == {"a": 1}
    assert seen == [{**ENGINE, "lone_surrogates": False}]
    with pytest.raises(BadRequest) as caught:
        server.parse_json(b"[NaN]")
    assert str(caught.value) == "malformed JSON body: non-finite number NaN is not allowed"


def test_the_engine_accepts_a_duplicate_key_the_hf_reader_refuses() -> None:
    from rollsafe.adapters.reference_engine.errors import BadRequest
    from rollsafe.adapters.reference_engine.server import parse_json

    raw = b'{"rid": "a", "rid": "b"}'
    assert parse_json(raw) == {"rid": "b"}  # as Python's json, behind SGLang / vLLM
    with pytest.raises(BadJSON, match="duplicate key 'rid'"):
        strict_json.loads_bounded(raw)
    # and both refuse a lone surrogate, the engine as a named 400
    with pytest.raises(BadRequest, match="malformed JSON body: a string holds a lone UTF-16"):
        parse_json(b'{"\\ud800": 1}')
    with pytest.raises(BadJSON, match="lone UTF-16 surrogate"):
        strict_json.loads_bounded(b'{"\\ud800": 1}')


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b"9" * 5000, "digits is too large"),
        (b'{"t": 1e400}', "overflows a float"),
        (b'"\\udfff"', "lone UTF-16 surrogate"),
        (b"\xff", "not UTF-8"),
    ],
)
def test_the_engine_names_what_is_wrong(raw: bytes, message: str) -> None:
    from rollsafe.adapters.reference_engine.errors import BadRequest
    from rollsafe.adapters.reference_engine.server import parse_json

    with pytest.raises(BadRequest, match=f"^malformed JSON body: .*{message}"):
        parse_json(raw)


@pytest.mark.parametrize(
    ("raw", "message"),
    [(b"[" * 100_000, "nested too deeply"), (b'{"action": NaN}', "NaN"), (b"\xff", "not UTF-8")],
)
def test_the_weight_checkers_parse_bodies_like_the_engine(
    raw: bytes, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio
    import re
    import types

    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from rollsafe.adapters.reference_engine import checker_api, server

    async def read_body(request: object) -> bytes:  # the engine's read (deadlines, budget) is
        return raw  # tested in test_engine_hardening; here: what the checker does with the bytes

    # the checkers read their bodies with the engine's request_body, which gets the bytes from
    # server.read_body (looked up at call time: replaced there, it is what the checkers get)
    monkeypatch.setattr(server, "read_body", read_body)
    app = web.Application()
    app[server.CTX_KEY] = types.SimpleNamespace(engine=None)  # type: ignore[assignment]
    for path, handler in (
        ("/weights_checker", checker_api.weights_checker),
        ("/weight_checker", checker_api.weight_checker),
    ):
        answer = asyncio.run(handler(make_mocked_request("POST", path, app=app)))
        assert answer.status == 400, path
        assert isinstance(answer, web.Response) and isinstance(answer.text, str)
        body = json.loads(answer.text)
        said = body["message"] if path == "/weights_checker" else body["error"]["message"]
        assert re.match(f"^malformed JSON body: .*{message}", said), (path, said)
