"""The composed fleet model: the four real machines wired together as the fleet wires them.

``FleetModel`` holds N worker groups of R ranks (``WorkerGroupLifecycle``), one
``CheckpointRegistration`` over all engine ranks, the chain of ``ExportLifecycle`` machines (one
per weights version) and one ``ImmediateRecoveryMode``, plus the fleet's current version. Its
actions are the things that happen to a fleet (a member comes up or crashes, a group event is
sent, a weight sync runs or fails to register, an export finishes or fails, a recovery takes a
lease, a targeted push lands, retention runs). Each action feeds events to the REAL machine
classes, so a bug planted in a machine (a guard written with ``any()``, a publish on a failed
register...) shows up as a violated invariant here.

The model is deliberately free: it also fires events the fleet would not send, because a guard
must refuse them and a refused event must change nothing. ``snapshot()``/``restore()`` turn the
whole model into a hashable value and back, which is what the exhaustive explorer deduplicates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from statemachine.exceptions import TransitionNotAllowed

from rollsafe.statemachines import (
    CheckpointRegistration,
    ExportLease,
    ExportLifecycle,
    ImmediateRecoveryMode,
    MemberFacts,
    WorkerGroupLifecycle,
)

__all__ = ["GROUP_EVENTS", "Action", "FleetModel", "ModelConfig", "Violation"]

#: Group events the model may fire at any group (the guards must refuse the wrong ones).
GROUP_EVENTS: tuple[str, ...] = (
    "launched",
    "claim",
    "restarted",
    "restart_failed",
    "weights_loaded",
    "mark_stale",
    "retire",
)

_KEYS: tuple[str, ...] = ("model.embed_tokens.weight", "lm_head.weight", "mtp.layer.weight")
_EXPECTED = _KEYS
_REGISTERED = _KEYS[:2]  # the MTP key is legitimately missing (allow-listed)


@dataclass(frozen=True)
class ModelConfig:
    """Size of the composed model."""

    groups: int = 2
    ranks: int = 2
    restart_budget: int = 2
    rearm_after: int = 2
    keep_last: int = 1
    max_version: int | None = None
    #: Also toggle immediate recovery off/on (the property tests do; the exhaustive run keeps the
    #: mode's transitions to export outcomes, since enable/disable are covered machine-by-machine).
    mode_toggles: bool = False

    def __post_init__(self) -> None:
        if self.groups < 1 or self.ranks < 1:
            raise ValueError(f"need at least one group of one rank, got {self}")


@dataclass(frozen=True)
class Violation:
    """An invariant that failed, with the number of the invariant (DESIGN.md section 3)."""

    invariant: int
    message: str

    def __str__(self) -> str:
        return f"invariant {self.invariant}: {self.message}"


@dataclass(frozen=True)
class Action:
    """One thing that can happen to the fleet: a name and its arguments."""

    name: str
    args: tuple[Any, ...] = ()

    def __str__(self) -> str:
        inner = ", ".join(repr(a) for a in self.args)
        return f"{self.name}({inner})"


@dataclass
class _Audit:
    """Facts the model keeps beside the machines, only to check invariants."""

    max_version_seen: int = 0
    published_from: tuple[str, int] | None = None
    publish_was_complete: bool = True
    late_versions: frozenset[int] = frozenset()
    on_time_since_late: int | None = None
    lease_versions_at_take: dict[int, tuple[int, int]] = field(default_factory=dict)
    judged_version: int = 0


class FleetModel:
    """The composed fleet model. Machine classes are parameters so tests can plant bugs."""

    def __init__(
        self,
        config: ModelConfig | None = None,
        *,
        group_cls: type[WorkerGroupLifecycle] = WorkerGroupLifecycle,
        export_cls: type[ExportLifecycle] = ExportLifecycle,
        registration_cls: type[CheckpointRegistration] = CheckpointRegistration,
        mode_cls: type[ImmediateRecoveryMode] = ImmediateRecoveryMode,
    ) -> None:
        self.config = cfg = config or ModelConfig()
        self._export_cls = export_cls
        self.groups: list[WorkerGroupLifecycle] = [
            group_cls(
                range(g * cfg.ranks, (g + 1) * cfg.ranks),
                restart_budget=cfg.restart_budget,
                group_id=f"g{g}",
            )
            for g in range(cfg.groups)
        ]
        self.registration = registration_cls(world_size=cfg.groups * cfg.ranks)
        self.mode = mode_cls(enabled=True, rearm_after=cfg.rearm_after)
        self.version = 0
        self.exports: dict[int, ExportLifecycle] = {}
        self._export_pool: dict[int, ExportLifecycle] = {}
        self.leases: dict[int, ExportLease] = {}  # group index -> lease
        self.audit = _Audit()
        self._allowed = {
            cls: _allowed_events_table(cls)
            for cls in (group_cls, export_cls, registration_cls, mode_cls)
        }

    # ------------------------------------------------------------------ actions
    def actions(self) -> Iterator[Action]:
        """Every action the model may take now (refused machine events included)."""
        cfg = self.config
        for g in range(cfg.groups):
            for r in range(cfg.ranks):
                yield Action("member_up", (g, r, True))
                yield Action("member_up", (g, r, False))
                yield Action("member_crash", (g, r))
                yield Action("member_lost", (g, r))
            for event in GROUP_EVENTS:
                yield Action("group_event", (g, event))
            yield Action("targeted_push", (g,))
        yield Action("sync", (True,))
        yield Action("sync", (False,))
        yield Action("export_finish")
        yield Action("export_fail")
        yield Action("retention")
        if cfg.mode_toggles:
            yield Action("mode_toggle")

    def enabled_actions(self) -> Iterator[Action]:
        """Actions that can change something now (cheap pre-filter on the state tables)."""
        for action in self.actions():
            if self._may_change(action):
                yield action

    def apply(self, action: Action) -> bool:
        """Take ``action``. Returns False when the machines refused it (nothing changed)."""
        handler: Callable[..., bool] = getattr(self, f"_do_{action.name}")
        try:
            return handler(*action.args)
        except TransitionNotAllowed:
            return False

    # -- members
    def _do_member_up(self, g: int, r: int, loaded: bool) -> bool:
        group = self.groups[g]
        rank = group.ranks[r]
        if group.state not in ("launching", "recovering"):
            return False
        if group.members[rank].healthy:
            return False
        if group.state == "launching":
            version: int | None = 0 if loaded else None
        else:
            lease = self.leases.get(g)
            if loaded and lease is None:
                return False
            version = lease.version if (loaded and lease is not None) else None
        group.report_member(rank, healthy=True, weights_version=version)
        return True

    def _do_member_crash(self, g: int, r: int) -> bool:
        group = self.groups[g]
        rank = group.ranks[r]
        if group.state == "retired" or not group.members[rank].healthy:
            return False
        group.report_member(rank, healthy=False)
        # The health manager takes the whole group out of routing at once.
        if group.state in ("launching", "active", "pending_weights"):
            group.fail()
        return True

    def _do_member_lost(self, g: int, r: int) -> bool:
        group = self.groups[g]
        rank = group.ranks[r]
        if group.state == "retired" or not group.members[rank].known:
            return False
        group.forget_member(rank)
        if group.state in ("launching", "active", "pending_weights"):
            group.fail()
        return True

    # -- group events, with the fleet's side effects around them
    def _do_group_event(self, g: int, event: str) -> bool:
        group = self.groups[g]
        if event == "mark_stale" or event in ("launched", "restarted", "weights_loaded"):
            group.send(event, current_version=self.version)
        else:
            group.send(event)
        if event == "claim":
            self._take_lease_for(g)
        elif event in ("restarted", "restart_failed", "retire"):
            self._release_lease_of(g)
        return True

    def _take_lease_for(self, g: int) -> None:
        """Immediate strategy: lease the ready export of the current version, if allowed."""
        export = self.exports.get(self.version)
        if self.mode.allows_immediate and export is not None and export.offerable:
            lease = export.acquire_lease(holder=f"g{g}")
            self.leases[g] = lease
            self.audit.lease_versions_at_take[g] = (lease.version, self.version)

    def _release_lease_of(self, g: int) -> None:
        lease = self.leases.pop(g, None)
        self.audit.lease_versions_at_take.pop(g, None)
        if lease is not None:
            self.exports[lease.version].release_lease(lease)

    def _do_targeted_push(self, g: int) -> bool:
        """Strategy 2: push the registered checkpoint to one pending group only."""
        group = self.groups[g]
        published = self.registration.published
        if group.state != "pending_weights" or published is None:
            return False
        if published[1] != self.version or not group.all_members_healthy():
            return False
        self._update_targets([g], published[1])
        group.weights_loaded(current_version=self.version)
        return True

    def _update_targets(self, targets: list[int], version: int) -> None:
        rank_lists = [list(self.groups[g].ranks) for g in targets]
        self.registration.begin_update(targets=rank_lists)
        results: dict[int, bool] = {}
        for g in targets:
            for rank in self.groups[g].ranks:
                self.groups[g].report_member(rank, healthy=True, weights_version=version)
                results[rank] = True
        self.registration.update_done(results=results)

    # -- weight sync
    def _do_sync(self, complete_register: bool) -> bool:
        cfg = self.config
        new = self.version + 1
        if cfg.max_version is not None and new > cfg.max_version:
            return False
        reg = self.registration
        if reg.state not in ("empty", "registered", "failed"):
            return False
        self._judge_export_deadline()
        reg.begin_register(name=f"ckpt-v{new}", version=new)
        ranks_ok = list(range(reg.world_size))
        if not complete_register:
            ranks_ok = ranks_ok[:-1]
        try:
            reg.register_ok(ranks_ok=ranks_ok, expected_keys=_EXPECTED, registered_keys=_REGISTERED)
        except TransitionNotAllowed:
            reg.register_failed(reason="a rank failed to register")
            return True
        self.audit.published_from = reg.published
        self.audit.publish_was_complete = set(ranks_ok) == set(range(reg.world_size))
        # Update every serving or waiting group whose members are all healthy.
        targets = [
            g
            for g, grp in enumerate(self.groups)
            if grp.state in ("active", "pending_weights") and grp.all_members_healthy()
        ]
        if targets:
            self._update_targets(targets, new)
        self.version = new
        self.audit.max_version_seen = max(self.audit.max_version_seen, new)
        for grp in self.groups:
            if grp.state == "active" and grp.behind_current_version(current_version=new):
                grp.mark_stale(current_version=new)
            elif grp.state == "pending_weights" and grp.can("weights_loaded", current_version=new):
                grp.weights_loaded(current_version=new)
        self._start_export(new)
        return True

    def _judge_export_deadline(self) -> None:
        """Before sync N+1: the export of N is either ready (on time) or late (abandoned)."""
        export = self.exports.get(self.version)
        if export is None or self.audit.judged_version >= export.version:
            return  # each export is judged once, by the first sync attempt after it
        self.audit.judged_version = export.version
        if export.state in ("snapshotting", "writing", "committing"):
            export.abandon(reason=f"sync v{self.version + 1} began first")
            self.audit.late_versions = self.audit.late_versions | {export.version}
            self.audit.on_time_since_late = 0
            if self.mode.state != "disabled":
                self.mode.export_late()
        elif export.state == "ready":
            if self.audit.on_time_since_late is not None:
                self.audit.on_time_since_late += 1
            if self.mode.state != "disabled":
                self.mode.export_on_time()

    def _start_export(self, version: int) -> None:
        export = self._export_pool.get(version)
        if export is None:
            export = self._export_cls(version)
            self._export_pool[version] = export
        export.restore_state("requested")
        export._leases.clear()
        export.snapshot()
        self.exports[version] = export

    # -- exports
    def _do_export_finish(self) -> bool:
        export = self.exports.get(self.version)
        if export is None or export.state != "snapshotting":
            return False
        export.snapshot_done()
        export.shards_written(ranks_ok=list(range(export.world_size)))
        export.publish(index_missing_keys=[], checksums_verified=True, renamed=True)
        ready = sorted(v for v, e in self.exports.items() if e.state == "ready")
        for old in ready[: max(0, len(ready) - self.config.keep_last)]:
            self.exports[old].supersede(newer_version=ready[-1])
        return True

    def _do_export_fail(self) -> bool:
        export = self.exports.get(self.version)
        if export is None or export.state not in ("snapshotting", "writing", "committing"):
            return False
        export.fail(reason="writer died")
        return True

    def _do_retention(self) -> bool:
        changed = False
        for export in list(self.exports.values()):
            if export.state == "superseded" and export.can("delete"):
                export.delete()
                changed = True
            elif export.state in ("deleted", "failed", "abandoned") and not export.leases:
                del self.exports[export.version]
                changed = True
        return changed

    def _do_mode_toggle(self) -> bool:
        if self.mode.state == "disabled":
            self.mode.enable()
            self.audit.on_time_since_late = None
        else:
            self.mode.disable()
        return True

    # ------------------------------------------------------------------ pre-filter
    def _may_change(self, action: Action) -> bool:
        """False for actions that certainly change nothing here (cheap checks, no machine call).

        Events the state table allows are always kept, so a guard still gets to refuse them.
        """
        name, args = action.name, action.args
        if name == "group_event":
            group = self.groups[args[0]]
            return args[1] in self._allowed[type(group)].get(group.state, ())
        if name in ("member_up", "member_crash", "member_lost"):
            g: int = args[0]
            r: int = args[1]
            group = self.groups[g]
            facts = group._members[group.ranks[r]]
            healthy = facts.healthy
            if name == "member_lost":
                return group.state != "retired" and facts.known
            if name == "member_crash":
                return group.state != "retired" and healthy
            if healthy or group.state not in ("launching", "recovering"):
                return False
            return not (args[2] and group.state == "recovering" and g not in self.leases)
        if name == "targeted_push":
            target: int = args[0]
            return self.groups[target].state == "pending_weights"
        if name in ("export_finish", "export_fail"):
            export = self.exports.get(self.version)
            return export is not None and export.state == "snapshotting"
        if name == "retention":
            return any(e.state != "ready" for e in self.exports.values())
        return True

    def canonical(self, snap: tuple[Any, ...] | None = None) -> tuple[Any, ...]:
        """A snapshot with the symmetry of identical groups and ranks factored out.

        Groups are interchangeable (same size and budget) and so are the ranks inside a group, so
        states that differ only by a permutation of them are one state for the explorer.
        """
        snap = snap if snap is not None else self.snapshot()
        version, groups, reg_s, exports, leases, mode_s, audit_s = snap
        lease_of = dict(leases)
        taken = dict(audit_s[5])
        per_group = sorted(
            (
                (state, budget, tuple(sorted(members, key=repr)), lease_of.get(g), taken.get(g))
                for g, (state, budget, members) in enumerate(groups)
            ),
            key=repr,
        )
        exports_c = tuple((v, st, len(holders)) for v, st, holders in exports)
        return (version, tuple(per_group), reg_s, exports_c, mode_s, audit_s[:5], audit_s[6])

    # ------------------------------------------------------------------ invariants
    def check(self) -> list[Violation]:
        """Check invariants 1-6 and 8 of DESIGN.md section 3 on the current state."""
        out: list[Violation] = []
        for group in self.groups:
            state = group.state
            members = group.members.values()
            if group.is_routable != (state == "active"):
                out.append(
                    Violation(1, f"{group.group_id} routable={group.is_routable} in {state}")
                )
            if state == "active":
                bad = [m for m in members if not m.healthy or m.weights_version != self.version]
                if bad:
                    out.append(
                        Violation(
                            1,
                            f"{group.group_id} is active but members {_fmt(bad)} are not healthy"
                            f" at current version {self.version}",
                        )
                    )
            if state in ("active", "pending_weights"):
                sick = [m.rank for m in members if not m.healthy]
                if sick:
                    out.append(
                        Violation(2, f"{group.group_id} is {state} with unhealthy ranks {sick}")
                    )
            if group.restart_budget < 0:
                out.append(Violation(2, f"{group.group_id} restart budget below zero"))
        reg = self.registration
        published = reg.published
        if published is not None:
            if reg.state not in ("registered", "updating"):
                out.append(Violation(3, f"{published} is published in state {reg.state}"))
            if published != self.audit.published_from or not self.audit.publish_was_complete:
                out.append(
                    Violation(3, f"published {published} without a complete, successful register")
                )
        for g, lease in self.leases.items():
            export = self.exports.get(lease.version)
            if export is None or export.state not in ("ready", "superseded"):
                where = export.state if export else "gone"
                out.append(Violation(4, f"g{g} holds a lease on v{lease.version} in {where}"))
            taken = self.audit.lease_versions_at_take.get(g)
            if taken is not None and taken[0] != taken[1]:
                out.append(
                    Violation(4, f"g{g} leased v{taken[0]} while the fleet was at {taken[1]}")
                )
        for export in self.exports.values():
            if export.state == "deleted" and export.leases:
                out.append(
                    Violation(
                        5, f"export v{export.version} deleted with {len(export.leases)} leases"
                    )
                )
            if export.state in ("failed", "abandoned") and export.leases:
                out.append(Violation(4, f"{export.state} export v{export.version} is leased"))
        if self.version < self.audit.max_version_seen:
            out.append(Violation(6, f"fleet version went back to {self.version}"))
        last = reg.last_published_version
        if last is not None and last > self.version + 1:
            out.append(Violation(6, f"registered v{last} is ahead of fleet v{self.version}"))
        for lease in self.leases.values():
            if lease.version in self.audit.late_versions:
                out.append(Violation(8, f"late export v{lease.version} was used for recovery"))
        streak = self.audit.on_time_since_late
        if self.mode.state != "disabled" and streak is not None:
            if streak == 0 and self.mode.state != "suspended":
                out.append(Violation(8, f"a late export left the mode {self.mode.state}"))
            if streak >= self.mode.rearm_after and self.mode.state != "enabled":
                out.append(
                    Violation(
                        8,
                        f"{streak} on-time exports since the last late one, mode still"
                        f" {self.mode.state} (rearm_after={self.mode.rearm_after})",
                    )
                )
        return out

    # ------------------------------------------------------------------ snapshot / restore
    def snapshot(self) -> tuple[Any, ...]:
        """The whole model as a hashable value (machines' states and the facts guards read)."""
        groups = tuple(
            (
                grp.state,
                grp.restart_budget,
                tuple((m.known, m.healthy, m.weights_version) for m in grp._members.values()),
            )
            for grp in self.groups
        )
        reg = self.registration
        exports = tuple(
            (v, e.state, tuple(sorted(lease.holder for lease in e._leases.values())))
            for v, e in sorted(self.exports.items())
        )
        leases = tuple(sorted((g, lease.version) for g, lease in self.leases.items()))
        audit = self.audit
        return (
            self.version,
            groups,
            (reg.state, reg._published, reg.pending, reg.last_published_version),
            exports,
            leases,
            (self.mode.state, self.mode.on_time_streak),
            (
                audit.max_version_seen,
                audit.published_from,
                audit.publish_was_complete,
                audit.late_versions,
                audit.on_time_since_late,
                tuple(sorted(audit.lease_versions_at_take.items())),
                audit.judged_version,
            ),
        )

    def restore(self, snap: tuple[Any, ...]) -> None:
        """Put the model back into a state produced by :meth:`snapshot`."""
        version, groups, reg_s, exports, leases, mode_s, audit_s = snap
        self.version = version
        for grp, (state, budget, members) in zip(self.groups, groups, strict=True):
            if grp.current_state_value != state:
                grp.restore_state(state)
            grp.restart_budget = budget
            grp._members = {
                rank: MemberFacts(rank, known, healthy, ver)
                for rank, (known, healthy, ver) in zip(grp.ranks, members, strict=True)
            }
        reg = self.registration
        if reg.current_state_value != reg_s[0]:
            reg.restore_state(reg_s[0])
        reg._published, reg.pending, reg.last_published_version = reg_s[1], reg_s[2], reg_s[3]
        self.exports = {}
        lease_by_holder: dict[str, ExportLease] = {}
        for v, state, holders in exports:
            export = self._export_pool.get(v)
            if export is None:
                export = self._export_cls(v)
                self._export_pool[v] = export
            if export.current_state_value != state or not export._engine.running:
                export.restore_state(state)
            export._leases.clear()
            for i, holder in enumerate(holders):
                lease = ExportLease(lease_id=-(v * 1000 + i + 1), version=v, holder=holder)
                export._leases[lease.lease_id] = lease
                lease_by_holder[holder] = lease
            self.exports[v] = export
        self.leases = {}
        for g, v in leases:
            held = lease_by_holder.get(f"g{g}")
            self.leases[g] = held if held is not None else ExportLease(-1, v, f"g{g}")
        if self.mode.current_state_value != mode_s[0]:
            self.mode.restore_state(mode_s[0])
        self.mode.on_time_streak = mode_s[1]
        self.audit = _Audit(
            max_version_seen=audit_s[0],
            published_from=audit_s[1],
            publish_was_complete=audit_s[2],
            late_versions=audit_s[3],
            on_time_since_late=audit_s[4],
            lease_versions_at_take=dict(audit_s[5]),
            judged_version=audit_s[6],
        )


def _allowed_events_table(cls: type[Any]) -> dict[str, frozenset[str]]:
    """state id -> events that have at least one transition out of it."""
    return {
        state.id: frozenset(str(e) for e in state.transitions.unique_events) for state in cls.states
    }


def _fmt(members: list[MemberFacts]) -> str:
    return ", ".join(f"r{m.rank}(healthy={m.healthy}, v={m.weights_version})" for m in members)
