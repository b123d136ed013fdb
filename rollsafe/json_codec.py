"""JSON on the request path: orjson where it is installed, the standard library otherwise.

Owns the two calls every request makes many times (an engine's stream is one JSON document an
event, the gateway writes one an event): :func:`loads` and :func:`dumps`, and
:func:`dumps_strict` for the bodies rollsafe's engine clients send. orjson (a dependency
of the ``engine`` and ``gateway`` extras, as of vLLM and SGLang themselves) decodes an SGLang
event about 5x faster and encodes a chunk about 15x faster than :mod:`json`
(docs/gateway.md, "The gateway's CPU work"); without it both fall back to :mod:`json`.

The results are :mod:`json`'s, whichever runs:

* :func:`loads` gives what ``json.loads`` gives, and raises what it raises: input orjson refuses
  and ``json`` takes (``NaN`` and ``Infinity``, a lone surrogate escape) and every malformed
  document are handed to ``json.loads``, so values and error messages stay the standard
  library's. One difference: an integer past 64 bits comes back a float (orjson reads it so)
  where ``json`` gives an ``int``; no token id, count or length an engine takes is that large;
* :func:`dumps` writes the document ``json.dumps(obj, separators=(",", ":"),
  ensure_ascii=False)`` writes, as UTF-8: the same values, a float perhaps in another equal
  form (``0.00001`` for ``1e-05``), and a float that is not finite as ``null`` (orjson, as
  SGLang's own server writes it) where ``json`` writes ``NaN``, which no strict JSON parser
  reads; an object orjson cannot write (a key that is not a string, an integer past 64 bits)
  is written by ``json``;
* :func:`dumps_strict` writes what :func:`dumps` writes, and refuses what
  ``json.dumps(..., allow_nan=False)`` refuses (a float that is not finite: ``ValueError``),
  as httpx does for a ``json=`` body.
"""

from __future__ import annotations

import json
from typing import Any

try:  # pragma: no branch - which one runs depends on the install
    import orjson as _orjson
except ImportError:  # pragma: no cover - the extras install it
    _orjson = None  # type: ignore[assignment]

__all__ = ["FAST", "dumps", "dumps_strict", "loads"]

#: whether orjson is in use
FAST = _orjson is not None


def _std_loads(data: str | bytes | bytearray | memoryview) -> Any:
    return json.loads(bytes(data) if isinstance(data, memoryview) else data)


def _std_dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def _std_dumps_strict(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


if _orjson is not None:
    _fast_loads = _orjson.loads
    _fast_dumps = _orjson.dumps
    _DecodeError = _orjson.JSONDecodeError
    _EncodeError = _orjson.JSONEncodeError

    def loads(data: str | bytes | bytearray | memoryview) -> Any:
        """``json.loads(data)`` (see the module)."""
        try:
            return _fast_loads(data)
        except _DecodeError:
            return _std_loads(data)

    def dumps(obj: Any) -> bytes:
        """Compact UTF-8 JSON of ``obj`` (see the module)."""
        try:
            return _fast_dumps(obj)
        except (_EncodeError, TypeError):
            return _std_dumps(obj)

    def dumps_strict(obj: Any) -> bytes:
        """:func:`dumps`, but a float that is not finite is a ``ValueError``, as
        ``json.dumps(..., allow_nan=False)`` makes it (see the module)."""
        try:
            data = _fast_dumps(obj)
        except (_EncodeError, TypeError):
            return _std_dumps_strict(obj)
        # orjson writes NaN and infinities as null: a document with a null is written again
        # by json, which refuses them (a None, or "null" in a string, only costs the rewrite)
        return _std_dumps_strict(obj) if b"null" in data else data

else:  # pragma: no cover - the extras install orjson

    def loads(data: str | bytes | bytearray | memoryview) -> Any:
        """``json.loads(data)``."""
        return _std_loads(data)

    def dumps(obj: Any) -> bytes:
        """Compact UTF-8 JSON of ``obj``."""
        return _std_dumps(obj)

    def dumps_strict(obj: Any) -> bytes:
        """Compact UTF-8 JSON of ``obj``; a float that is not finite is a ``ValueError``."""
        return _std_dumps_strict(obj)
