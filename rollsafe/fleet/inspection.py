"""Reading a fleet back: every machine's transitions in time order, and the fleet as the
invariants see it.

Owns :class:`ExportHistory` (the lifecycle machine of every export the exporter holds, and the
transitions of the last ``_RETIRED_KEPT`` exports it let go of), :func:`timeline` (every
transition of the groups, the exports, the transport's registration and the immediate-recovery
mode still in the machines' in-memory histories, oldest first: a streamed run,
``FleetConfig.run_dir``, holds them all) and
:func:`picture` (a :class:`~rollsafe.invariants.FleetPicture` of what the fleet records:
``check_all(fleet.picture())`` is the demo's final invariant check). ``RolloutFleet.timeline()``
and ``.picture()`` call them with the fleet's parts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
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

#: Exports the exporter let go of (deleted, failed, abandoned, pruned) whose transitions the
#: timeline keeps, newest versions first (the sync reports keep as many syncs).
_RETIRED_KEPT = 64


@dataclass(frozen=True)
class _Retired:
    """An export the exporter no longer holds, as the timeline keeps it: its state and its
    transitions when it was let go of. The machine itself (its callbacks, event queues and
    locks: about 70 KiB) goes with the exporter's last reference."""

    version: int
    state: str
    history: tuple[TransitionRecord, ...]

    @property
    def last_transition(self) -> TransitionRecord | None:
        return self.history[-1] if self.history else None


class ExportHistory:
    """The export lifecycle machines the fleet reads back, by version.

    Bounded: a machine is kept only while the exporter holds it (its records and the latest
    handle, themselves bounded by retention and ``_HANDLES_KEPT``); once the exporter lets go
    of it, only its state and transitions are kept (:class:`_Retired`), for the last
    ``_RETIRED_KEPT`` versions. Holding every machine ever started grew the driver by one
    machine a sync (issue #36).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._machines: dict[int, Any] = {}
        self._retired: dict[int, _Retired] = {}

    def harvest(self, exporter: ExporterLike | None) -> None:
        """Keep the machines of the exports ``exporter`` holds now (the one in flight too);
        retire those it no longer holds."""
        if exporter is None:
            return
        found: list[tuple[int, Any]] = []
        complete = True
        try:
            found += [(r.version, r.lifecycle) for r in exporter.exports()]
        except Exception:
            complete = False  # nothing is retired on a partial reading
            log.debug("reading the exporter's exports failed", exc_info=True)
        try:
            handle = exporter.handle()
            found.append((handle.version, handle.lifecycle))
        except Exception:  # no export started yet
            pass
        with self._lock:
            held = {version for version, _ in found}
            for version, machine in found:
                if version not in self._machines:
                    self._retired.pop(version, None)  # held again: the machine has it all
                    self._machines[version] = machine
            if not complete:
                return
            for version in [v for v in self._machines if v not in held]:
                machine = self._machines.pop(version)
                self._retired[version] = _Retired(version, str(machine.state), machine.history)
            while len(self._retired) > _RETIRED_KEPT:
                del self._retired[min(self._retired)]

    def machines(self) -> list[tuple[int, Any]]:
        """Version -> the machine (or, once retired, its state and history), oldest first."""
        with self._lock:
            items: list[tuple[int, Any]] = [*self._machines.items(), *self._retired.items()]
        return sorted(items, key=lambda item: item[0])

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
    ground truth is unknown here), read consistently (:meth:`FleetRegistry.consistent`): a
    sync's recorded versions and the fleet's version move together in it."""
    return registry.consistent(
        lambda: _picture(
            registry,
            initial_version=initial_version,
            transport=transport,
            exporter=exporter,
            mode=mode,
            spare_groups=spare_groups,
            promotions=tuple(promotions),
        )
    )


def _picture(
    registry: FleetRegistry,
    *,
    initial_version: int,
    transport: WeightTransport | None,
    exporter: ExporterLike | None,
    mode: ImmediateRecoveryMode,
    spare_groups: int | None,
    promotions: tuple[PromotionPicture, ...],
) -> FleetPicture:
    fleet_version = registry.fleet_version
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
        fleet_version=fleet_version,
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
        max_version_seen=fleet_version,
        spare_groups=spare_groups,
        promotions=promotions,
    )
