"""The one strict JSON parser: export files (which may be hostile) and the reference engine's
request bodies are both parsed here.

:func:`loads_bounded` parses bytes as strict UTF-8 JSON and raises :class:`BadJSON` (a
``ValueError`` with a short, path-free message) for everything that is not plain, finite JSON of
reasonable shape. Always refused: bytes that are not UTF-8, syntax errors,
``NaN``/``Infinity``/``-Infinity`` and numbers that overflow to an infinite float (``1e400``),
nesting beyond the interpreter's recursion limit (a ``RecursionError`` never escapes). Options,
each strict by default:

* ``max_depth``: nesting deeper than this is refused by a linear pre-scan
  (:func:`json_depth_exceeds`), before ``json.loads`` could recurse; ``None`` leaves only the
  interpreter's recursion limit;
* ``duplicate_keys``: an object with a key twice is refused (two readers could disagree on which
  one wins); ``True`` lets the last one win, as :func:`json.loads` does;
* ``max_int_digits``: an integer literal longer than this (sign included) is refused; ``None``
  leaves Python's own limit (``sys.get_int_max_str_digits()``, 4300 by default);
* ``lone_surrogates``: a ``\\uD800``-style escape of half a UTF-16 surrogate pair, in any string
  or key, is refused (such a string cannot be encoded as UTF-8; Rust's serde_json, which
  safetensors reads headers with, refuses it too); ``True`` lets it through as Python does.

The caller caps the byte size. :mod:`rollsafe.hf.verify` reads export files with the defaults;
the reference engine's ``parse_json`` accepts what SGLang's and vLLM's servers (Python's json,
FastAPI) accept: ``duplicate_keys=True, max_depth=None, max_int_digits=None``, lone surrogates
still refused.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from rollsafe.errors import RollsafeError

__all__ = ["MAX_INT_DIGITS", "MAX_JSON_DEPTH", "BadJSON", "json_depth_exceeds", "loads_bounded"]

#: Default nesting limit of every JSON file read from an export (headers need 3, configs ~6).
MAX_JSON_DEPTH = 64
#: Longest integer literal accepted by default (sign included); far above any size, offset or
#: dim.
MAX_INT_DIGITS = 40

_SHOWN = 40
_CHUNK = 8 << 20
_QUOTE = ord('"')
_STEPS = np.zeros(256, dtype=np.int8)
_STEPS[[ord("["), ord("{")]] = 1
_STEPS[[ord("]"), ord("}")]] = -1

#: the escape of either half of a UTF-16 surrogate pair
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
#: once every escaped backslash is blanked out, a lone surrogate escape: a high half not
#: followed by a low one, or a low half not preceded by a high one (``json`` pairs them greedily
#: from the left, exactly so); both branches start with ``\u`` so that the search is fast
_LONE_SURROGATE = re.compile(
    rb"\\u[dD](?:"
    rb"[89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
    rb"|[c-fC-F][0-9a-fA-F]{2}(?<!\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    rb")"
)


class BadJSON(RollsafeError, ValueError):
    """The bytes are not bounded, finite, strict JSON; the message says what and where."""


def _short(text: str) -> str:
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def _blank_escaped_backslashes(data: bytes) -> bytes:
    """``data`` with every ``\\\\`` escape replaced by two other bytes (same offsets), so that
    each backslash left starts an escape. A run of backslashes pairs up from the left, which is
    what ``bytes.replace`` does."""
    return data.replace(b"\\\\", b"__") if b"\\\\" in data else data


def json_depth_exceeds(data: bytes, max_depth: int) -> bool:
    """Whether JSON ``data`` nests arrays/objects deeper than ``max_depth`` (linear time).

    Brackets inside strings do not count. Escapes are resolved the way JSON does: after
    removing ``\\\\`` pairs (:func:`_blank_escaped_backslashes`) and then ``\\"``, every
    remaining quote opens or closes a string. Exact for valid JSON; for invalid JSON it is exact
    up to the first syntax error, which is as far as ``json.loads`` gets.
    """
    if data.count(b"[") + data.count(b"{") <= max_depth:
        return False
    if b"\\" in data:
        data = _blank_escaped_backslashes(data).replace(b'\\"', b"__")
    arr = np.frombuffer(data, dtype=np.uint8)
    depth = 0
    in_string = 0
    for off in range(0, len(arr), _CHUNK):
        chunk = arr[off : off + _CHUNK]
        quotes = np.cumsum(chunk == _QUOTE, dtype=np.int64)
        inside = ((quotes + in_string) & 1).astype(bool)
        steps = _STEPS[chunk].astype(np.int64)
        steps[inside] = 0
        levels = np.cumsum(steps) + depth
        if int(levels.max()) > max_depth:
            return True
        depth = int(levels[-1])
        in_string = (in_string + int(quotes[-1])) & 1
    return False


def _lone_surrogate(data: bytes) -> str | None:
    """The first escape of a lone UTF-16 surrogate in valid JSON ``data`` (``'\\\\ud800'``), or
    None when every surrogate escape is half of a pair. Linear time, on the bytes. Raw UTF-8
    cannot hold a surrogate (a strict decode refuses it), so only escapes can."""
    if _SURROGATE.search(data) is None:
        return None
    found = _LONE_SURROGATE.search(_blank_escaped_backslashes(data))
    return None if found is None else found.group().decode("ascii")


def _reject_constant(name: str) -> Any:
    raise BadJSON(f"non-finite number {name} is not allowed")


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadJSON(f"number {_short(text)} is not finite (it overflows a float)")
    return value


def _int_parser(max_digits: int) -> Callable[[str], int]:
    def parse_int(text: str) -> int:
        if len(text) > max_digits:
            raise BadJSON(f"integer of {len(text)} digits is too large (at most {max_digits})")
        return int(text)

    return parse_int


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise BadJSON(f"duplicate key {_short(repr(key))}")
            seen.add(key)
    return out


def loads_bounded(
    data: bytes,
    max_depth: int | None = MAX_JSON_DEPTH,
    *,
    duplicate_keys: bool = False,
    max_int_digits: int | None = MAX_INT_DIGITS,
    lone_surrogates: bool = False,
) -> Any:
    """Parse ``data`` (strict UTF-8 JSON) or raise :class:`BadJSON` saying why, never anything
    else: not UTF-8, syntax errors, ``NaN``/``Infinity``, numbers that overflow a float, and,
    per the options (see the module docstring), nesting deeper than ``max_depth``, duplicate
    keys, integers longer than ``max_int_digits`` and lone UTF-16 surrogates."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadJSON(f"not UTF-8 (byte {exc.start})") from None
    if max_depth is not None and json_depth_exceeds(data, max_depth):
        raise BadJSON(f"nested deeper than {max_depth} levels")
    try:
        value = json.loads(
            text,
            parse_constant=_reject_constant,
            parse_float=_parse_float,
            parse_int=None if max_int_digits is None else _int_parser(max_int_digits),
            object_pairs_hook=None if duplicate_keys else _unique_pairs,
        )
    except BadJSON:
        raise
    except json.JSONDecodeError as exc:
        raise BadJSON(f"invalid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:  # max_depth=None, or a max_depth above what the interpreter can do
        raise BadJSON("nested too deeply") from None
    except ValueError as exc:  # int() past sys.get_int_max_str_digits()
        if "digits" in str(exc):
            limit = getattr(sys, "get_int_max_str_digits", lambda: 4300)()
            raise BadJSON(f"integer of more than {limit} digits is too large") from None
        raise BadJSON(f"invalid JSON: {type(exc).__name__}") from None
    except (OverflowError, MemoryError) as exc:
        raise BadJSON(f"invalid JSON: {type(exc).__name__}") from None
    if not lone_surrogates and (escape := _lone_surrogate(data)) is not None:
        raise BadJSON(f"a string holds a lone UTF-16 surrogate ({escape})")
    return value
