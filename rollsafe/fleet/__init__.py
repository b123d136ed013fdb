"""Fleet control: what a trainer embeds (:class:`RolloutFleet`, built from a
:class:`FleetConfig`) and the I/O that executes the fleet's decisions.

``rollsafe.fleet`` lists what a trainer uses: the fleet, its config and settings, what its
calls return and the errors they raise. The components behind it have one import path each,
their module:

* :mod:`~rollsafe.fleet.config`: :class:`FleetConfig`, :class:`GroupSpec`, their plans;
* :mod:`~rollsafe.fleet.settings`: the components' and transports' settings;
* :mod:`~rollsafe.fleet.fleet`: :class:`RolloutFleet`, the trainer's verbs over the parts below;
* :mod:`~rollsafe.fleet.engines`: ``EngineGroups`` (plans, handles, spare ranks) and
  ``EngineEffects``; :mod:`~rollsafe.fleet.placement` / :mod:`~rollsafe.fleet.ray_placement`:
  where groups run (this machine, or placed by Ray);
* :mod:`~rollsafe.fleet.control_plane`: transport, exporter, health, recovery, sync, wired;
* :mod:`~rollsafe.fleet.router` / :mod:`~rollsafe.fleet.continuation`: requests to routable
  groups, a cut request continued; :mod:`~rollsafe.fleet.partial_rollouts`: a sync's pause
  bracket; :mod:`~rollsafe.fleet.provenance`: which weights made which tokens;
* :mod:`~rollsafe.fleet.health` / :mod:`~rollsafe.fleet.request_health`: probes and request
  failures that take groups out of routing;
* :mod:`~rollsafe.fleet.recovery`: ``RecoveryCoordinator``; :mod:`~rollsafe.fleet.sync`:
  ``SyncCoordinator``; :mod:`~rollsafe.fleet.elastic`: ``Membership`` (node loss, groups added
  and removed); :mod:`~rollsafe.fleet.steps`: step records and timed-step declarations;
* :mod:`~rollsafe.fleet.inspection`: the timeline and the invariants' picture of a fleet;
  :mod:`~rollsafe.fleet.weights_check`: an engine's checker against the trainer's tensors.

The registry of groups and their machines sits below the fleet: :mod:`rollsafe.registry`.
"""

from rollsafe.fleet.config import TRANSPORTS, FleetConfig, GroupSpec
from rollsafe.fleet.fleet import FleetNotStarted, RolloutFleet
from rollsafe.fleet.provenance import Segment, off_policy, versions_used
from rollsafe.fleet.recovery import RecoveryResult
from rollsafe.fleet.router import (
    ContinuationFailed,
    NoRoutableGroup,
    RequestFailed,
    RoutedResult,
    RouterError,
)
from rollsafe.fleet.settings import (
    CheckpointEngineSettings,
    DiskSettings,
    FleetConfigError,
    HealthSettings,
    IpcSettings,
    NcclSettings,
    RaySettings,
    RecoverySettings,
    TransportContext,
    TransportSettings,
)
from rollsafe.fleet.steps import RecoveryStep
from rollsafe.fleet.sync import SyncError, SyncReport, SyncVersionError

__all__ = [
    "TRANSPORTS",
    "CheckpointEngineSettings",
    "ContinuationFailed",
    "DiskSettings",
    "FleetConfig",
    "FleetConfigError",
    "FleetNotStarted",
    "GroupSpec",
    "HealthSettings",
    "IpcSettings",
    "NcclSettings",
    "NoRoutableGroup",
    "RaySettings",
    "RecoveryResult",
    "RecoverySettings",
    "RecoveryStep",
    "RequestFailed",
    "RolloutFleet",
    "RoutedResult",
    "RouterError",
    "Segment",
    "SyncError",
    "SyncReport",
    "SyncVersionError",
    "TransportContext",
    "TransportSettings",
    "off_policy",
    "versions_used",
]
