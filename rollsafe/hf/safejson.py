"""Bounded JSON parsing for files read from an export directory (which may be hostile).

:func:`loads_bounded` parses bytes as strict UTF-8 JSON and raises :class:`BadJSON` (a
``ValueError`` with a short, path-free message) for everything that is not plain, finite JSON of
reasonable shape: nesting deeper than ``max_depth`` (checked by a linear pre-scan, before
``json.loads`` could recurse), ``NaN``/``Infinity``/``-Infinity``, numbers that overflow to an
infinite float (``1e400``), integers longer than :data:`MAX_INT_DIGITS` digits, and duplicate
object keys (two readers could disagree on which one wins). The caller caps the byte size.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from rollsafe.errors import RollsafeError

__all__ = ["MAX_INT_DIGITS", "MAX_JSON_DEPTH", "BadJSON", "json_depth_exceeds", "loads_bounded"]

#: Default nesting limit of every JSON file read from an export (headers need 3, configs ~6).
MAX_JSON_DEPTH = 64
#: Longest integer literal accepted (sign included); far above any size, offset or dim.
MAX_INT_DIGITS = 40

_SHOWN = 40
_CHUNK = 8 << 20
_QUOTE = ord('"')
_STEPS = np.zeros(256, dtype=np.int8)
_STEPS[[ord("["), ord("{")]] = 1
_STEPS[[ord("]"), ord("}")]] = -1


class BadJSON(RollsafeError, ValueError):
    """The bytes are not bounded, finite, strict JSON; the message says what and where."""


def _short(text: str) -> str:
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def json_depth_exceeds(data: bytes, max_depth: int) -> bool:
    """Whether JSON ``data`` nests arrays/objects deeper than ``max_depth`` (linear time).

    Brackets inside strings do not count. Escapes are resolved the way JSON does: a run of
    backslashes pairs up from the left (``bytes.replace`` does exactly that), so after removing
    ``\\\\`` pairs and then ``\\"``, every remaining quote opens or closes a string. Exact for
    valid JSON; for invalid JSON it is exact up to the first syntax error, which is as far as
    ``json.loads`` gets.
    """
    if data.count(b"[") + data.count(b"{") <= max_depth:
        return False
    if b"\\" in data:
        data = data.replace(b"\\\\", b"__").replace(b'\\"', b"__")
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


def _reject_constant(name: str) -> Any:
    raise BadJSON(f"non-finite number {name} is not allowed")


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadJSON(f"number {_short(text)} is not finite")
    return value


def _parse_int(text: str) -> int:
    if len(text) > MAX_INT_DIGITS:
        raise BadJSON(f"integer of {len(text)} digits is too large")
    return int(text)


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise BadJSON(f"duplicate key {_short(repr(key))}")
            seen.add(key)
    return out


def loads_bounded(data: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse ``data`` (strict UTF-8 JSON) or raise :class:`BadJSON` saying why, never anything
    else: not UTF-8, syntax errors, nesting deeper than ``max_depth``, non-finite or oversized
    numbers, duplicate keys."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadJSON(f"not UTF-8 (byte {exc.start})") from None
    if json_depth_exceeds(data, max_depth):
        raise BadJSON(f"nested deeper than {max_depth} levels")
    try:
        return json.loads(
            text,
            parse_constant=_reject_constant,
            parse_float=_parse_float,
            parse_int=_parse_int,
            object_pairs_hook=_unique_pairs,
        )
    except BadJSON:
        raise
    except json.JSONDecodeError as exc:
        raise BadJSON(f"invalid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:  # the pre-scan makes this unreachable; a second line of defence
        raise BadJSON(f"nested deeper than {max_depth} levels") from None
    except (ValueError, OverflowError, MemoryError) as exc:
        raise BadJSON(f"invalid JSON: {type(exc).__name__}") from None
