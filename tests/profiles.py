"""Example counts per hypothesis profile (``HYPOTHESIS_PROFILE=ci|thorough``)."""

from __future__ import annotations

import os

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
MULTIPLIER = 10 if PROFILE == "thorough" else 1


def examples(ci_count: int) -> int:
    """Example count for the active profile (``thorough`` is ten times ``ci``)."""
    return ci_count * MULTIPLIER
