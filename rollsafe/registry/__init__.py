"""The fleet's tables: worker groups with their lifecycle machines, the fleet version and
listeners; the transports' delta bases; and the effects that act on them, handled once.

It sits below the fleet (``docs/architecture.md``): the fleet's executors and ``rollsafe
verify``'s model both perform the registry's effects with :class:`RegistryEffects` on a real
:class:`FleetRegistry`.

* :mod:`~rollsafe.registry.table`: :class:`FleetRegistry`, :class:`WorkerGroup`, transitions,
  listeners, the registry's errors;
* :mod:`~rollsafe.registry.handlers`: :class:`RegistryEffects` (send, read states, report
  members, record versions, set the fleet version);
* :mod:`~rollsafe.registry.delta_ledger`: :class:`DeltaLedger`, one ``DeltaBase`` machine per
  transport target (the one handler of ``SendBase``; a transport's ``DeltaSender`` and the
  verifier's model hold one).
"""

from rollsafe.registry.delta_ledger import DeltaLedger
from rollsafe.registry.handlers import RegistryEffects, SendAudit
from rollsafe.registry.table import (
    LISTENER_HOOKS,
    DuplicateGroup,
    FleetError,
    FleetListener,
    FleetRegistry,
    FleetVersionRegression,
    GroupTransition,
    OverlappingRanks,
    UnknownGroup,
    WorkerGroup,
)

__all__ = [
    "LISTENER_HOOKS",
    "DeltaLedger",
    "DuplicateGroup",
    "FleetError",
    "FleetListener",
    "FleetRegistry",
    "FleetVersionRegression",
    "GroupTransition",
    "OverlappingRanks",
    "RegistryEffects",
    "SendAudit",
    "UnknownGroup",
    "WorkerGroup",
]
