"""Checks of the directories the engine reads (model, tokenizer) that never leak OS errors.

Owns one rule: a path given by a user or a request (``--model-path``, ``--tokenizer-path``,
``/update_weights_from_disk`` ``model_path``) is checked up front, and every way it can be bad --
missing, not a directory, too long (``ENAMETOOLONG``), unreadable (``EACCES``), containing a NUL
byte, not a string -- becomes one named error that quotes the path, never an ``OSError`` that
would surface as HTTP 500 or kill a rank. Light: imports neither torch nor transformers.
"""

from __future__ import annotations

import os
from pathlib import Path

from rollsafe.adapters.reference_engine.errors import ServerError, WeightUpdateError

__all__ = ["check_dir", "show_path"]

_SHOWN_CHARS = 120


def show_path(path: object) -> str:
    """``repr`` of ``path`` for an error message, shortened when it is very long."""
    text = str(path)
    if len(text) <= _SHOWN_CHARS:
        return repr(text)
    return f"{text[:_SHOWN_CHARS]!r}... ({len(text)} characters)"


def check_dir(
    path: object,
    *,
    what: str,
    must_contain: tuple[str, ...] = (),
    error: type[ServerError] = WeightUpdateError,
) -> Path:
    """Return ``path`` as a :class:`Path` if it is a readable directory holding ``must_contain``.

    Otherwise raise ``error`` (default :class:`WeightUpdateError`, HTTP 400) naming ``what`` and
    the path, and why (``not a directory``, ``File name too long``, ``Permission denied``...).
    """
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise error(f"{what} must be a non-empty path string, got {path!r}")
    p = Path(path)
    shown = show_path(p)
    try:
        if not p.is_dir():
            raise error(f"{what} {shown} is not a directory")
        if not os.access(p, os.R_OK | os.X_OK):
            raise error(f"{what} {shown} is not readable: Permission denied")
        for name in must_contain:
            if not (p / name).is_file():
                raise error(f"{what} {shown} has no {name}")
    except ValueError as exc:  # e.g. "embedded null byte"
        raise error(f"{what} {shown} is not a valid path: {exc}") from exc
    except OSError as exc:  # ENAMETOOLONG, EACCES on a parent, ELOOP...
        raise error(f"{what} {shown} cannot be used: {exc.strerror or exc}") from exc
    return p
