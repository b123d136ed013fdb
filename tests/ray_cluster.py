"""A real multi-node Ray cluster on this machine for tests, and the gate of tests that need Ray.

:func:`require_ray` imports Ray: without it a developer's run skips with the reason, and under
``CI=true`` the test fails instead (CI never passes without having run the Ray tests).

:func:`local_cluster` is :func:`rollsafe.adapters.ray.local.local_cluster` (a head node and
worker nodes, each its own raylet, in a private ``RAY_TMPDIR``; ``RAY_ADDRESS`` set for the
fleet under test to join).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest

from rollsafe.adapters.ray.local import local_cluster

__all__ = ["local_cluster", "require_ray", "wait_for"]


def require_ray() -> Any:
    """``import ray``; skip without it, except under ``CI=true`` where that fails."""
    try:
        import ray
    except ImportError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"Ray is required under CI=true: {exc}")
        pytest.skip(f"Ray is not installed: {exc}")
    return ray


def wait_for(predicate: Callable[[], bool], timeout: float = 120.0, step: float = 0.1) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` s passed; return its last value."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return predicate()
        time.sleep(step)
    return True
