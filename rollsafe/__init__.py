"""rollsafe: keep an RL trainer's rollout fleet serving and correct.

Worker-group lifecycle, HF-export lifecycle, checkpoint registration and the immediate-recovery
mode are formal, guarded state machines (``rollsafe.statemachines``) that drive pluggable weight
transports (``rollsafe.transports``) and engine adapters (``rollsafe.adapters``).
Importing this package imports nothing: the machines below load on first use (PEP 562), so a
process that only decodes weights (:mod:`rollsafe.wire`) never loads python-statemachine.
The layers and which may import which: ``docs/architecture.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from rollsafe.errors import RollsafeError

if TYPE_CHECKING:
    from rollsafe.statemachines import (
        CheckpointRegistration,
        ExportLifecycle,
        ImmediateRecoveryMode,
        WorkerGroupLifecycle,
    )

__version__ = "0.1.0"

__all__ = [
    "CheckpointRegistration",
    "ExportLifecycle",
    "ImmediateRecoveryMode",
    "RollsafeError",
    "WorkerGroupLifecycle",
    "__version__",
]

_MACHINES = frozenset(
    {"CheckpointRegistration", "ExportLifecycle", "ImmediateRecoveryMode", "WorkerGroupLifecycle"}
)


def __getattr__(name: str) -> Any:
    if name not in _MACHINES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("rollsafe.statemachines"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
