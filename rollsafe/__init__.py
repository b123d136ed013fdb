"""rollsafe: keep an RL trainer's rollout fleet serving and correct.

Worker-group lifecycle, HF-export lifecycle, checkpoint registration and the immediate-recovery
mode are formal, guarded state machines (``rollsafe.statemachines``) that drive pluggable weight
transports (``rollsafe.transports``) and engine adapters (``rollsafe.adapters``).
Importing this package imports nothing: the machines and the fleet's three trainer-facing
names (``from rollsafe import RolloutFleet, FleetConfig, GroupSpec``) load on first use
(PEP 562), so a process that only decodes weights (:mod:`rollsafe.wire`) never loads
python-statemachine.
The layers and which may import which: ``docs/architecture.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollsafe.errors import RollsafeError
from rollsafe.lazy import lazy_attributes
from rollsafe.version import VERSION

if TYPE_CHECKING:
    from rollsafe.fleet.config import FleetConfig, GroupSpec
    from rollsafe.fleet.fleet import RolloutFleet
    from rollsafe.statemachines import (
        CheckpointRegistration,
        ExportLifecycle,
        ImmediateRecoveryMode,
        WorkerGroupLifecycle,
    )

__version__ = VERSION

__all__ = [
    "CheckpointRegistration",
    "ExportLifecycle",
    "FleetConfig",
    "GroupSpec",
    "ImmediateRecoveryMode",
    "RolloutFleet",
    "RollsafeError",
    "WorkerGroupLifecycle",
    "__version__",
]

__getattr__, __dir__ = lazy_attributes(
    __name__,
    {
        **dict.fromkeys(
            (
                "CheckpointRegistration",
                "ExportLifecycle",
                "ImmediateRecoveryMode",
                "WorkerGroupLifecycle",
            ),
            "rollsafe.statemachines",
        ),
        "RolloutFleet": "rollsafe.fleet.fleet",
        "FleetConfig": "rollsafe.fleet.config",
        "GroupSpec": "rollsafe.fleet.config",
    },
    public=__all__,
)
