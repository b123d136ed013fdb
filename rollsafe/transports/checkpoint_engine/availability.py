"""Whether checkpoint-engine can run here: the package, an accelerator, Mooncake for P2P.

Owns :func:`checkpoint_engine_unavailable_reasons`, :func:`mooncake_available` and the install
hint; nothing here imports checkpoint-engine unless asked.
"""

from __future__ import annotations

import contextlib
import importlib.util

INSTALL_HINT = "pip install 'rollsafe[ce]'"


def mooncake_available() -> bool:
    """True when Mooncake (checkpoint-engine's optional P2P transfer engine) is installed."""
    try:
        return importlib.util.find_spec("mooncake") is not None
    except (ImportError, ValueError):
        return False


def _accelerator_reason() -> str | None:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard requirement of this transport
        return "checkpoint-engine needs torch: torch is not installed"
    npu = getattr(torch, "npu", None)
    if npu is not None:
        with contextlib.suppress(Exception):
            if npu.is_available():
                return None
    if torch.cuda.is_available():
        return None
    return "checkpoint-engine needs CUDA or Ascend: torch.cuda.is_available() is False"


def checkpoint_engine_unavailable_reasons() -> list[str]:
    """Why checkpoint-engine cannot run in this process (empty when it can).

    Checks the package without importing it unless it is installed (the import itself then has
    to succeed) and the accelerator (CUDA or Ascend; the ``ParameterServer`` constructor raises
    ``TypeError`` on a CPU-only host).
    """
    reasons: list[str] = []
    if importlib.util.find_spec("checkpoint_engine") is None:
        reasons.append(f"checkpoint_engine is not installed: {INSTALL_HINT}")
    else:
        try:
            import checkpoint_engine.ps  # noqa: F401
        except Exception as exc:
            reasons.append(
                f"checkpoint_engine is installed but cannot be imported "
                f"({type(exc).__name__}: {exc}): {INSTALL_HINT}"
            )
    accel = _accelerator_reason()
    if accel is not None:
        reasons.append(accel)
    return reasons
