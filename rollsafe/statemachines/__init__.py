"""The formal machines: pure models, importing nothing heavier than statemachine.

* :class:`WorkerGroupLifecycle` — one per worker group (all processes of one engine).
* :class:`ExportLifecycle` — one per recovery export (weights version N on disk).
* :class:`CheckpointRegistration` — one per weight transport that stages weights.
* :class:`ImmediateRecoveryMode` — one per fleet.
* :class:`DeltaBase` — one per (transport, target) that receives deltas (issue #28).

State and event names are a public contract (``docs/design.md``, "The four machines"); the
events are typed constants in :mod:`rollsafe.statemachines.events`. Refused events raise
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
from rollsafe.statemachines.delta_base import DeltaBase
from rollsafe.statemachines.events import (
    DeltaEvent,
    ExportEvent,
    GroupEvent,
    ModeEvent,
    RegistrationEvent,
)
from rollsafe.statemachines.export import ExportLease, ExportLifecycle, LeaseError
from rollsafe.statemachines.recovery_mode import ImmediateRecoveryMode
from rollsafe.statemachines.worker_group import MemberFacts, WorkerGroupLifecycle

#: Every machine class, in the order diagrams and docs list them.
MACHINES: tuple[type[GuardedMachine], ...] = (
    WorkerGroupLifecycle,
    ExportLifecycle,
    CheckpointRegistration,
    ImmediateRecoveryMode,
    DeltaBase,
)

__all__ = [
    "MACHINES",
    "CheckpointRegistration",
    "DeltaBase",
    "DeltaEvent",
    "ExportEvent",
    "ExportLease",
    "ExportLifecycle",
    "GroupEvent",
    "GuardedMachine",
    "ImmediateRecoveryMode",
    "LeaseError",
    "MemberFacts",
    "MissingGuardInput",
    "ModeEvent",
    "RegistrationEvent",
    "TransitionNotAllowed",
    "TransitionRecord",
    "TransitionRefused",
    "WorkerGroupLifecycle",
]
