"""Opt-in timing lines of the reference engine (``ROLLSAFE_ENGINE_PROFILE=1``).

Owns :data:`PROFILE` and :func:`profile_line`: with the variable set, every rank operation, every
HTTP request and the parts of a weight update (payload decode, views, copy, sync) print
``rollsafe-profile op=<what> rank=<r> ms=<ms>`` on stderr, so a benchmark can tell where an
update's time goes inside the engine. Off, they cost one boolean test.
"""

from __future__ import annotations

import os
import sys

__all__ = ["PROFILE", "profile_line"]

PROFILE = os.environ.get("ROLLSAFE_ENGINE_PROFILE") == "1"


def profile_line(what: str, rank: int, seconds: float) -> None:
    """One ``rollsafe-profile`` line on stderr (only with ``ROLLSAFE_ENGINE_PROFILE=1``)."""
    if PROFILE:
        print(
            f"rollsafe-profile op={what} rank={rank} ms={seconds * 1e3:.3f}",
            file=sys.stderr,
            flush=True,
        )
