"""rollsafe: keep an RL trainer's rollout fleet serving and correct.

Worker-group lifecycle, HF-export lifecycle, checkpoint registration and the immediate-recovery
mode are formal, guarded state machines (``rollsafe.statemachines``) that drive pluggable weight
transports (``rollsafe.transports``) and engine adapters (``rollsafe.adapters``).
Importing this package stays light: only python-statemachine is imported eagerly.
"""

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
    "WorkerGroupLifecycle",
    "__version__",
]
