"""Moved: the strict JSON parser is :mod:`rollsafe.wire.strict_json` now, shared by export
readers and the reference engine. This module re-exports its names so old imports keep
working; :func:`loads_bounded` here *is* ``rollsafe.wire.strict_json.loads_bounded``.
"""

from __future__ import annotations

from rollsafe.wire.strict_json import (
    MAX_INT_DIGITS,
    MAX_JSON_DEPTH,
    BadJSON,
    json_depth_exceeds,
    loads_bounded,
)

__all__ = ["MAX_INT_DIGITS", "MAX_JSON_DEPTH", "BadJSON", "json_depth_exceeds", "loads_bounded"]
