"""Shared test configuration: hypothesis profiles, the GPU marker, the real engine's interpreter.

Profiles (``HYPOTHESIS_PROFILE``): ``ci`` (default) runs at least 300 examples per machine and 200
for the composed model; ``thorough`` runs ten times that. Tests scale their own example counts by
:func:`profiles.examples`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu``-marked tests cleanly when no CUDA device is present."""
    try:
        import torch

        has_cuda = bool(torch.cuda.is_available())
    except Exception:  # torch missing or broken: no GPU tests either way
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (gpu marker); none here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The real vLLM's interpreter (``tests/real_vllm.py``): skip without it, fail under CI."""
    from real_vllm import require_vllm_python

    return require_vllm_python()


@pytest.fixture
def launchers() -> Iterator[list[Any]]:
    """Collects the ``EngineLauncher``s a test creates and kills whatever is still running."""
    made: list[Any] = []
    yield made
    for launcher in made:
        launcher.kill()


@pytest.fixture(autouse=True)
def close_planes() -> Iterator[None]:
    """Close the data planes ``fleet_sim.generate`` opened for a test (their loop threads)."""
    yield
    import sys

    sim = sys.modules.get("fleet_sim")
    if sim is not None:
        sim.close_planes()
