"""Reading a fleet back: every machine's transitions in time order, and the fleet as the
invariants see it.

Owns :class:`ExportHistory` (the lifecycle machine of every export a fleet started, kept after
the exporter prunes its own table), :func:`timeline` (every transition of the groups, the
exports, the transport's registration and the immediate-recovery mode still in the machines'
in-memory histories, oldest first: a streamed run, ``FleetConfig.run_dir``, holds them all) and
:func:`picture` (a :class:`~rollsafe.invariants.FleetPicture` of what the fleet records:
``check_all(fleet.picture())`` is the demo's final invariant check). ``RolloutFleet.timeline()``
and ``.picture()`` call them with the fleet's parts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from rollsafe.invariants import (
    ExportPicture,
    FleetPicture,
    GroupPicture,
    MemberPicture,
    PromotionPicture,
)

if TYPE_CHECKING:
    from rollsafe.fleet.sync import ExporterLike
    from rollsafe.ports import WeightTransport
    from rollsafe.registry import FleetRegistry
    from rollsafe.statemachines.base import TransitionRecord
    from rollsafe.statemachines.recovery_mode import ImmediateRecoveryMode

__all__ = ["ExportHistory", "picture", "timeline"]

log = logging.getLogger(__name__)


class ExportHistory:
    """The lifecycle machine of every export the fleet started, by version."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._machines: dict[int, Any] = {}

    def harvest(self, exporter: ExporterLike | None) -> None:
        """Keep the machines of the exports ``exporter`` knows now (the one in flight too)."""
        if exporter is None:
            return
        found: list[tuple[int, Any]] = []
        try:
            found += [(r.version, r.lifecycle) for r in exporter.exports()]
        except Exception:
            log.debug("reading the exporter's exports failed", exc_info=True)
        try:
            handle = exporter.handle()
            found.append((handle.version, handle.lifecycle))
        except Exception:  # no export started yet
            pass
        with self._lock:
            for version, machine in found:
                self._machines.setdefault(version, machine)

    def machines(self) -> list[tuple[int, Any]]:
        with self._lock:
            return sorted(self._machines.items(), key=lambda item: item[0])

    def states(self) -> dict[int, str]:
        """Version -> the export's lifecycle state."""
        return {v: str(m.state) for v, m in self.machines()}


def timeline(
    registry: FleetRegistry,
    exports: ExportHistory,
    transport: WeightTransport | None,
    mode: ImmediateRecoveryMode,
) -> list[dict[str, Any]]:
    """Every machine transition (groups, exports, registration, mode), oldest first."""
    rows: list[dict[str, Any]] = []

    def add(kind: str, subject: str, records: Iterable[TransitionRecord]) -> None:
        for rec in records:
            row = rec.as_dict()
            row["kind"] = kind
            row["subject"] = subject
            rows.append(row)

    for group in registry.groups():
        add("group", group.group_id, group.machine.history)
    for version, machine in exports.machines():
        add("export", f"v{version}", machine.history)
    if transport is not None:
        add("registration", transport.name, transport.registration.history)
    add("mode", "immediate_recovery", mode.history)
    rows.sort(key=lambda r: (r["timestamp"], r["kind"], r["seq"]))
    return rows


def picture(
    registry: FleetRegistry,
    *,
    initial_version: int,
    transport: WeightTransport | None,
    exporter: ExporterLike | None,
    mode: ImmediateRecoveryMode,
    spare_groups: int | None = None,
    promotions: Iterable[PromotionPicture] = (),
) -> FleetPicture:
    """The fleet as :mod:`rollsafe.invariants` reads it (what the fleet records; the engines'
    ground truth is unknown here)."""
    groups = tuple(
        GroupPicture(
            g.group_id,
            g.state,
            g.is_routable,
            g.machine.restart_budget,
            tuple(
                MemberPicture(r, m.known, m.healthy, m.weights_version)
                for r, m in g.machine.members.items()
            ),
            spare=g.machine.spare,
        )
        for g in registry.groups()
    )
    registration = transport.registration if transport is not None else None
    exports: tuple[ExportPicture, ...] = ()
    if exporter is not None:
        exports = tuple(
            ExportPicture(r.version, r.state, len(r.lifecycle.leases), r.path.exists())
            for r in exporter.exports()
        )
    return FleetPicture(
        fleet_version=registry.fleet_version,
        groups=groups,
        initial_version=initial_version,
        registration_state=registration.state if registration is not None else None,
        published=registration.published if registration is not None else None,
        last_published_version=(
            registration.last_published_version if registration is not None else None
        ),
        exports=exports,
        mode_state=mode.state,
        rearm_after=mode.rearm_after,
        max_version_seen=registry.fleet_version,
        spare_groups=spare_groups,
        promotions=tuple(promotions),
    )
