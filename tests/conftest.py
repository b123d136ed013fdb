"""Shared test configuration: hypothesis profiles, the GPU marker, the real engine's interpreter.

Profiles (``HYPOTHESIS_PROFILE``): ``ci`` (default) runs at least 300 examples per machine and 200
for the composed model; ``thorough`` runs ten times that. Tests scale their own example counts by
:func:`profiles.examples`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
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


#: A real vLLM a test starts itself (not through the launcher, which gives each its own
#: directory) binds its ZMQ ``ipc://`` sockets under ``VLLM_RPC_BASE_PATH``, by default the
#: temporary directory, and one killed leaves them there: this test process's go in one
#: directory, removed when it ends.
_VLLM_IPC_DIR: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _VLLM_IPC_DIR
    if "VLLM_RPC_BASE_PATH" not in os.environ:
        _VLLM_IPC_DIR = tempfile.mkdtemp(prefix="rollsafe-test-vllm-ipc-")
        os.environ["VLLM_RPC_BASE_PATH"] = _VLLM_IPC_DIR


def pytest_unconfigure(config: pytest.Config) -> None:
    if _VLLM_IPC_DIR is not None:
        shutil.rmtree(_VLLM_IPC_DIR, ignore_errors=True)


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
