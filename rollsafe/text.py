"""Bounded text: what rollsafe keeps of a message, a reason or a hostile value in an error.

Owns :func:`bound_text` (cut a long message to about ``limit`` characters, head and tail kept:
used for every engine answer, transport reason and fleet error field), :func:`short_repr` (a
readable ``repr`` of a possibly huge value) and :func:`few` (a short list of names). Imports only
the standard library.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["MAX_MESSAGE_CHARS", "bound_text", "few", "short_repr"]

#: The most characters of any server-provided text kept in an exception.
MAX_MESSAGE_CHARS = 2048
#: Characters of one value :func:`short_repr` shows.
SHOWN_CHARS = 80
#: Names :func:`few` lists before ``... +N more``.
NAMES_SHOWN = 12


def bound_text(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """Return ``text`` cut to at most about ``limit`` characters, keeping its head and tail."""
    if limit <= 0:
        return ""
    if len(text) <= limit:
        return text
    marker = f" ...[{len(text) - limit} chars elided]... "
    keep = max(limit - len(marker), 2)
    head = keep // 2
    return text[:head] + marker + text[len(text) - (keep - head) :]


def short_repr(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``repr`` of a (possibly hostile, huge) value, cut to a readable length."""
    try:
        text = repr(value) if not isinstance(value, (dict, list)) else _shape_of(value)
    except Exception:  # a repr that fails (never for JSON values, but be safe)
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _shape_of(value: dict[Any, Any] | list[Any]) -> str:
    if isinstance(value, dict):
        return f"<object of {len(value)} field(s)>"
    items = ", ".join(repr(v) if not isinstance(v, (dict, list)) else "..." for v in value[:8])
    return f"[{items}{', ...' if len(value) > 8 else ''}]"


def few(names: Iterable[str], shown: int = NAMES_SHOWN) -> str:
    """``[a, b, ... +N more]``: the first ``shown`` of the sorted names, each :func:`short_repr`."""
    items = sorted(names)
    listed = ", ".join(short_repr(k) for k in items[:shown])
    more = len(items) - shown
    return f"[{listed}{f', ... +{more} more' if more > 0 else ''}]"
