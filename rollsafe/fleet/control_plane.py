"""The fleet's control plane, built once at start: exporter, transport, recovery, health,
request health and sync, wired to each other by name.

:func:`build_control_plane` makes each collaborator from the :class:`~rollsafe.fleet.FleetConfig`
and hands it the others' bound methods, never a closure: a failed probe goes to
``RecoveryCoordinator.on_group_failed``, a failed update or a run of failed requests to
``RecoveryCoordinator.on_update_failed``, request failures are not counted while the
``HealthManager`` is paused; with ``spare_groups`` a :class:`~rollsafe.fleet.spares.SparePool`
hears the registry and promotes a spare for a serving group that leaves routing. Every group
of a fleet runs the same engine, so one :class:`FleetTraits` answers every coordinator's
``traits_for`` and one :class:`FleetTargets` builds every transport target (with the engine
kind's delta capability).
:func:`build_transport` picks the configured transport or its named fallback.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import rollsafe.policy as policy
from rollsafe.fleet.config import FleetConfig, GroupPlan
from rollsafe.fleet.health import HealthManager
from rollsafe.fleet.recovery import RecoveryCoordinator
from rollsafe.fleet.request_health import RequestHealth
from rollsafe.fleet.settings import FleetConfigError, TransportContext, topology_fallback
from rollsafe.fleet.spares import SparePool
from rollsafe.fleet.sync import SyncCoordinator, default_target
from rollsafe.ports import PlaceableEngine
from rollsafe.registry import FleetListener, FleetRegistry, GroupTransition, WorkerGroup
from rollsafe.statemachines.recovery_mode import ImmediateRecoveryMode

if TYPE_CHECKING:
    from rollsafe.hf import HFExporter
    from rollsafe.ports import EngineTarget, RestartableEngine, WeightTransport

__all__ = [
    "ControlPlane",
    "DeltaBaseReset",
    "FleetTargets",
    "FleetTraits",
    "adopt_start_checkpoint",
    "build_control_plane",
    "build_transport",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FleetTraits:
    """``traits_for(group)`` of a fleet whose groups all run one engine kind."""

    traits: policy.EngineTraits

    def __call__(self, group: WorkerGroup) -> policy.EngineTraits:
        return self.traits


@dataclass(frozen=True)
class FleetTargets:
    """``targets_for(group)``: the group's transport target, carrying the engine kind's delta
    capability (whether a transport with deltas on may send it one; ``docs/transports.md``,
    "Deltas")."""

    traits: policy.EngineTraits

    def __call__(self, group: WorkerGroup) -> EngineTarget:
        return dataclasses.replace(
            default_target(group),
            applies_deltas=self.traits.applies_deltas,
            delta_base_by_content=self.traits.delta_base_by_content,
            rendezvous=self.traits.rendezvous,
        )


class DeltaBaseReset(FleetListener):
    """With deltas on: a group that leaves service (failed, lost with its node, draining,
    retired) or starts again (launching) has unknown weights until it confirms a push, so the
    transport forgets its base at once and its next push is full (``docs/transports.md``,
    "Deltas")."""

    STATES = frozenset({"inactive", "unplaced", "draining", "retired", "launching"})

    def __init__(self, transport: WeightTransport) -> None:
        self.transport = transport

    def on_transition(self, group: WorkerGroup, record: GroupTransition) -> None:
        if record.target not in self.STATES:
            return
        try:
            self.transport.forget(group.group_id)
        except Exception:  # a listener must not fail the sender's event
            log.exception("forgetting %s's delta base failed", group.group_id)


@dataclass(frozen=True)
class ControlPlane:
    """What a started fleet runs (see the module)."""

    exporter: HFExporter
    transport: WeightTransport
    #: why the configured transport could not serve the fleet (None: it is the one built)
    transport_fallback: str | None
    recovery: RecoveryCoordinator
    health: HealthManager
    request_health: RequestHealth
    sync: SyncCoordinator
    #: the spares' pool (``FleetConfig.spare_groups``; None: no spares)
    spares: SparePool | None = None


def build_transport(
    config: FleetConfig, plans: list[GroupPlan], world_size: int, exporter: HFExporter
) -> tuple[WeightTransport, str | None]:
    """The transport ``config`` asks for, or its fallback (with the reasons, logged once);
    :class:`~rollsafe.fleet.settings.FleetConfigError` when it cannot serve the fleet and has
    no fallback."""
    context = TransportContext(
        world_size=world_size,
        groups=tuple((p.group_id, p.ranks) for p in plans),
        engine=config.engine_spec,
        exporter=exporter,
    )
    settings = config.settings_for()
    reasons = settings.fallback_reasons(context)
    topology = topology_fallback(
        settings.transport,
        placement=config.placement,
        ray=config.ray,
        group_ids=[p.group_id for p in plans],
    )
    if topology is not None:  # checkpoint-engine's placement cannot follow Ray's
        reasons = [*reasons, topology]
    fallback: str | None = None
    if reasons:
        if settings.fallback is None:
            raise FleetConfigError(
                "transport",
                f"{settings.transport!r} cannot serve this fleet: " + "; ".join(reasons),
            )
        fallback = "; ".join(reasons)
        log.warning(
            "transport %r falls back to %r: %s", settings.transport, settings.fallback, fallback
        )
        settings = config.settings_for(settings.fallback)
    return settings.build(context), fallback


def adopt_start_checkpoint(exporter: HFExporter, config: FleetConfig) -> None:
    """The fleet's start checkpoint: ``model_path``, verified once here, becomes the ready
    export of ``initial_version`` (:meth:`~rollsafe.hf.HFExporter.adopt_start`), so a group
    that fails before the first sync is restarted from it at once (strategy ``immediate``,
    under a lease, moved to the group's node like any export) instead of waiting in
    ``pending_weights`` for that sync. Retention treats it as any export but only un-lists
    it: the user's directory is never removed. :class:`FleetConfigError` (``model_path``)
    naming the path and every problem when it is not a loadable HF checkpoint. Engines that
    load dummy weights (``EngineSpec(load_format="dummy")``) have none: the fleet then adopts no
    start checkpoint and a group failed before the first sync waits for that sync."""
    from rollsafe.hf import ExportVerificationError

    assert config.model_path is not None  # the config settled it
    path = Path(config.model_path)
    try:
        exporter.adopt_start(path, config.initial_version)
    except ExportVerificationError as exc:
        problems = "; ".join(exc.problems[:8])
        more = f" (and {len(exc.problems) - 8} more)" if len(exc.problems) > 8 else ""
        raise FleetConfigError(
            "model_path",
            f"{path} is not a loadable HF checkpoint (the fleet's start checkpoint, the export "
            f"of initial_version {config.initial_version}): {problems}{more}",
        ) from exc


def build_control_plane(
    config: FleetConfig,
    registry: FleetRegistry,
    mode: ImmediateRecoveryMode,
    *,
    plans: list[GroupPlan],
    world_size: int,
    handle_for: Callable[[str], RestartableEngine],
) -> ControlPlane:
    """Make and wire the fleet's control plane (see the module)."""
    from rollsafe.hf import HFExporter

    template = config.template_dir if config.template_dir is not None else config.model_path
    assert config.export_root is not None and template is not None  # the config checked both
    exporter = HFExporter(config.export_root, template_dir=template)
    if config.engine is None or config.engine.load_format != "dummy":
        adopt_start_checkpoint(exporter, config)
    else:  # random weights: not the trainer's initial_version, so no start export
        log.info("engines load dummy weights: no start checkpoint; first recovery waits for a sync")
    transport, fallback = build_transport(config, plans, world_size, exporter)
    traits = config.engine_traits
    targets_for = FleetTargets(traits)
    traits_for = FleetTraits(traits)
    rs = config.recovery
    recovery = RecoveryCoordinator(
        registry,
        launcher_for=handle_for,
        settings=rs,
        exporter=exporter,
        transport=transport if rs.targeted_push else None,
        mode=mode,
        targets_for=targets_for,
        traits_for=traits_for,
    )
    if transport.deltas is not None:
        registry.add_listener(DeltaBaseReset(transport))
    health = HealthManager(
        registry, settings=config.health, on_group_failed=recovery.on_group_failed
    )
    request_health = RequestHealth(
        registry,
        failure_threshold=config.health.failure_threshold,
        on_group_failed=recovery.on_update_failed,
        health=health,
    )
    sync = SyncCoordinator(
        registry,
        transport,
        exporter=exporter,
        mode=mode,
        on_update_failure=config.on_update_failure,
        on_group_failed=recovery.on_update_failed,
        on_group_stale=recovery.on_group_stale,
        targets_for=targets_for,
        traits_for=traits_for,
    )
    spares = None
    if config.spare_groups:
        spares = SparePool(
            registry,
            transport_lock=recovery.transport_lock,
            on_group_failed=recovery.on_update_failed,
            node_of=functools.partial(_node_of, handle_for),
            version_timeout_s=config.health.timeout_s,
        )
        registry.add_listener(spares)
    return ControlPlane(
        exporter, transport, fallback, recovery, health, request_health, sync, spares
    )


def _node_of(handle_for: Callable[[str], RestartableEngine], group_id: str) -> str | None:
    """The node ``group_id``'s engine runs on (None: this machine, or not placed yet)."""
    handle = handle_for(group_id)
    return handle.node_id if isinstance(handle, PlaceableEngine) else None
