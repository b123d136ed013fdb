"""The four formal lifecycle machines: pure models, importing nothing heavier than statemachine.

* :class:`WorkerGroupLifecycle` — one per worker group (all processes of one engine).
* :class:`ExportLifecycle` — one per recovery export (weights version N on disk).
* :class:`CheckpointRegistration` — one per weight transport that stages weights.
* :class:`ImmediateRecoveryMode` — one per fleet.

State and event names are a public contract (see DESIGN.md section 3); refused events raise
:class:`TransitionRefused`, a ``statemachine.exceptions.TransitionNotAllowed``.
"""

from statemachine.exceptions import TransitionNotAllowed

from rollsafe.statemachines.base import (
    GuardedMachine,
    MissingGuardInput,
    TransitionRecord,
    TransitionRefused,
)
from rollsafe.statemachines.checkpoint_registration import CheckpointRegistration
from rollsafe.statemachines.export import ExportLease, ExportLifecycle, LeaseError
from rollsafe.statemachines.recovery_mode import ImmediateRecoveryMode
from rollsafe.statemachines.worker_group import MemberFacts, WorkerGroupLifecycle

#: Every machine class, in the order diagrams and docs list them.
MACHINES: tuple[type[GuardedMachine], ...] = (
    WorkerGroupLifecycle,
    ExportLifecycle,
    CheckpointRegistration,
    ImmediateRecoveryMode,
)

__all__ = [
    "MACHINES",
    "CheckpointRegistration",
    "ExportLease",
    "ExportLifecycle",
    "GuardedMachine",
    "ImmediateRecoveryMode",
    "LeaseError",
    "MemberFacts",
    "MissingGuardInput",
    "TransitionNotAllowed",
    "TransitionRecord",
    "TransitionRefused",
    "WorkerGroupLifecycle",
]
