"""Fleet control: registry, router, health manager, recovery and sync coordinators.

What is here so far, in dependency order (each module imports only the ones above it):

* :mod:`~rollsafe.fleet.registry`: :class:`FleetRegistry`, the worker groups, their
  ``WorkerGroupLifecycle`` machines, the fleet version and the listeners;
* :mod:`~rollsafe.policy`: every decision of the components below, as pure functions
  (``rollsafe verify`` explores the same functions); :mod:`~rollsafe.invariants`: what
  consistent means, one named function per invariant;
* :mod:`~rollsafe.fleet.settings`: :class:`HealthSettings`, :class:`RecoverySettings`,
  :class:`RaySettings` (``FleetConfig(placement="ray")``, ``docs/cluster.md``) and one
  settings class per transport (:class:`NcclSettings`, :class:`CheckpointEngineSettings`,
  :class:`IpcSettings`, :class:`DiskSettings`), the one source of the components'
  defaults; a new fleet transport is one :class:`TransportSettings` subclass (it builds the
  transport from a :class:`TransportContext`);
* :mod:`~rollsafe.fleet.router`: :class:`Router`, requests to routable groups only;
* :mod:`~rollsafe.fleet.health`: :class:`HealthManager`, concurrent probes that take failed
  groups out of routing and hand them off (never recovering them itself);
* :mod:`~rollsafe.fleet.sync`: :class:`SyncCoordinator`, one weight sync (judge the previous
  export, register, update active and pending groups, versions, start the next export);
* :mod:`~rollsafe.fleet.fleet`: :class:`RolloutFleet`, the one object a trainer embeds, built
  from a :class:`FleetConfig` (above all the others);
* :mod:`~rollsafe.fleet.recovery`: :class:`RecoveryCoordinator`, recoveries on a bounded pool
  (immediate from the ready export, targeted push, or deferred to the next sync);
* :mod:`~rollsafe.fleet.weights_check`: an engine's checker against the trainer's tensors in the
  engine's own layout (``RolloutFleet.check_weights``); the behavioural check beside it is
  :mod:`rollsafe.probe`.
"""

from rollsafe.fleet.fleet import FleetConfig, FleetNotStarted, GroupSpec, RolloutFleet
from rollsafe.fleet.health import (
    DEFAULT_PROBE_STATES,
    GroupFailure,
    HealthManager,
    HealthRound,
    Probe,
    ProbeOutcome,
    ProbeResult,
    client_health_probe,
)
from rollsafe.fleet.provenance import Segment, off_policy, versions_used
from rollsafe.fleet.recovery import (
    RecoveryClosed,
    RecoveryCoordinator,
    RecoveryError,
    RecoveryResult,
    RecoveryStatus,
    RecoveryStep,
    RecoveryStrategy,
    StepTimeout,
)
from rollsafe.fleet.registry import (
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
from rollsafe.fleet.request_health import RequestHealth
from rollsafe.fleet.router import (
    DEFAULT_MAX_ERROR_CHARS,
    ContinuationFailed,
    NoRoutableGroup,
    RequestFailed,
    RoutedResult,
    Router,
    RouterError,
    is_retryable,
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
from rollsafe.fleet.sync import (
    SyncCoordinator,
    SyncError,
    SyncReport,
    SyncVersionError,
    default_target,
    shared_transport_lock,
)

__all__ = [
    "DEFAULT_MAX_ERROR_CHARS",
    "DEFAULT_PROBE_STATES",
    "LISTENER_HOOKS",
    "CheckpointEngineSettings",
    "ContinuationFailed",
    "DiskSettings",
    "DuplicateGroup",
    "FleetConfig",
    "FleetConfigError",
    "FleetError",
    "FleetListener",
    "FleetNotStarted",
    "FleetRegistry",
    "FleetVersionRegression",
    "GroupFailure",
    "GroupSpec",
    "GroupTransition",
    "HealthManager",
    "HealthRound",
    "HealthSettings",
    "IpcSettings",
    "NcclSettings",
    "NoRoutableGroup",
    "OverlappingRanks",
    "Probe",
    "ProbeOutcome",
    "ProbeResult",
    "RaySettings",
    "RecoveryClosed",
    "RecoveryCoordinator",
    "RecoveryError",
    "RecoveryResult",
    "RecoverySettings",
    "RecoveryStatus",
    "RecoveryStep",
    "RecoveryStrategy",
    "RequestFailed",
    "RequestHealth",
    "RolloutFleet",
    "RoutedResult",
    "Router",
    "RouterError",
    "Segment",
    "StepTimeout",
    "SyncCoordinator",
    "SyncError",
    "SyncReport",
    "SyncVersionError",
    "TransportContext",
    "TransportSettings",
    "UnknownGroup",
    "WorkerGroup",
    "client_health_probe",
    "default_target",
    "is_retryable",
    "off_policy",
    "shared_transport_lock",
    "versions_used",
]
