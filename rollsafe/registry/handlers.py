"""The registry's effects, handled once: events sent, states read, members reported, versions.

:class:`RegistryEffects` is the one handler in the code base of the operations' effects that act
on the fleet's table of groups: :class:`~rollsafe.operations.effects.SendGroup`,
:class:`~rollsafe.operations.effects.SendGroups`, :class:`~rollsafe.operations.effects.ReadStates`,
:class:`~rollsafe.operations.effects.ReportMembers`,
:class:`~rollsafe.operations.effects.ReportRank` and
:class:`~rollsafe.operations.effects.RecordVersions` (under
:meth:`~rollsafe.registry.FleetRegistry.recording`: a consistent reader sees the members'
versions and the fleet's move together). Every fleet executor holds one as a part
(``parts = {RegistryEffects: "registry_effects"}``) and ``rollsafe verify``'s model holds one on
its own real :class:`~rollsafe.registry.FleetRegistry`, so an event the policy decided is sent,
refused and recorded the same way in both.

A :class:`SendAudit` (optional) hears every decided send: what was decided by whom, each
transition taken, each refusal. The fleet's default only logs refusals; the verifier's model
checks the decisions against the policy's declarations and keeps the refusals for its
invariants. :attr:`RegistryEffects.changes` counts the effects that changed what the registry
records (a transition taken, a member's health or version changed).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from rollsafe.operations import effects as fx
from rollsafe.operations.executor import Executor, handles
from rollsafe.registry.table import FleetRegistry, FleetVersionRegression, UnknownGroup
from rollsafe.statemachines.base import TransitionRefused
from rollsafe.statemachines.events import GroupEvent

__all__ = ["RegistryEffects", "SendAudit"]

log = logging.getLogger(__name__)


class SendAudit(Protocol):
    """What hears the registry's decided sends (``rollsafe verify``'s model is one)."""

    def decided(self, by: str, events: Sequence[GroupEvent]) -> None:
        """``by`` (a policy function's name) decided ``events``."""

    def taken(self, group: str, event: GroupEvent) -> None:
        """Group ``group``'s machine took ``event``."""

    def refused(self, by: str, why: str) -> None:
        """A machine refused an event ``by`` decided (it moved meanwhile, or a bug)."""


class RegistryEffects(Executor):
    """The registry's effects performed on ``registry`` (see the module)."""

    def __init__(self, registry: FleetRegistry, *, audit: SendAudit | None = None) -> None:
        self.registry = registry
        self.audit = audit
        #: effects that changed what the registry records, so far
        self.changes = 0

    # ------------------------------------------------------------------ events
    @handles(fx.SendGroup)
    def send_group(self, effect: fx.SendGroup) -> fx.Outcome[str]:
        audit = self.audit
        if audit is not None:
            audit.decided(effect.decided_by, (effect.event,))
        try:
            inputs: dict[str, str] = {"decided_by": effect.decided_by}
            if effect.reason is not None:
                inputs["reason"] = effect.reason
            record = self.registry.send(effect.group, effect.event, **inputs)
        except (TransitionRefused, UnknownGroup) as exc:
            self._refused(effect.decided_by, effect.group, effect.event, str(exc))
            return fx.Failed(str(exc))
        self.changes += 1
        if audit is not None:
            audit.taken(effect.group, effect.event)
        return fx.Ok(record.target)

    @handles(fx.SendGroups)
    def send_groups(self, effect: fx.SendGroups) -> fx.Outcome[tuple[tuple[str, str], ...]]:
        audit = self.audit
        if audit is not None:
            audit.decided(effect.decided_by, tuple(e for _, evs in effect.events for e in evs))
        refused = self.registry.send_together(
            effect.events, decided_by=effect.decided_by, all_or_nothing=effect.all_or_nothing
        )
        refused_groups = {gid for gid, _ in refused}
        for gid, events in effect.events:
            if gid in refused_groups:
                continue
            self.changes += len(events)
            for event in events:
                if audit is not None:
                    audit.taken(gid, event)
        for gid, why in refused:
            self._refused(effect.decided_by, gid, None, why)
        return fx.Ok(tuple(refused))

    def _refused(self, by: str, group: str, event: GroupEvent | None, why: str) -> None:
        what = f"{event.value!r} " if event is not None else ""
        log.info("%s refused %sfor group %s: %s", by, what, group, why)
        if self.audit is not None:
            self.audit.refused(by, why)

    # ------------------------------------------------------------------ reads
    @handles(fx.ReadStates)
    def read_states(self, effect: fx.ReadStates) -> fx.Outcome[tuple[tuple[str, str], ...]]:
        registry = self.registry
        return fx.Ok(tuple((g, registry.get(g).state) for g in effect.groups if g in registry))

    # ------------------------------------------------------------------ members and versions
    @handles(fx.ReportMembers)
    def report_members(self, effect: fx.ReportMembers) -> fx.Outcome[None]:
        group = self.registry.get(effect.group)
        for rank, fact in group.machine.members.items():
            healthy = fact.healthy if effect.healthy is None else effect.healthy
            self._report(effect.group, rank, healthy, effect.weights_version)
        return fx.DONE

    @handles(fx.ReportRank)
    def report_rank(self, effect: fx.ReportRank) -> fx.Outcome[None]:
        self._report(effect.group, effect.rank, effect.healthy, None)
        return fx.DONE

    @handles(fx.RecordVersions)
    def record_versions(self, effect: fx.RecordVersions) -> fx.Outcome[None]:
        with self.registry.recording():
            before = self.registry.fleet_version
            if effect.fleet_version < before:  # versions only move forward: nothing changed
                exc = FleetVersionRegression(before, effect.fleet_version)
                log.error("%s", exc)
                return fx.Failed(str(exc))
            for gid in effect.groups:
                for rank, fact in self.registry.get(gid).machine.members.items():
                    self._report(gid, rank, fact.healthy, effect.version)
            self.registry.set_fleet_version(effect.fleet_version)
        if effect.fleet_version != before:
            self.changes += 1
        return fx.DONE

    def _report(self, group: str, rank: int, healthy: bool, version: int | None) -> None:
        machine = self.registry.get(group).machine
        before = machine.members[rank]
        self.registry.report_member(group, rank, healthy=healthy, weights_version=version)
        after = machine.members[rank]
        if (before.known, before.healthy, before.weights_version) != (
            after.known,
            after.healthy,
            after.weights_version,
        ):
            self.changes += 1
