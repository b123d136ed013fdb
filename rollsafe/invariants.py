"""The fleet's invariants, one named function each, over a plain picture of the fleet.

Owns what "consistent" means (``docs/design.md``, "Invariants"). Each invariant is a function
``(FleetPicture) -> list[str]`` returning what it found broken (empty when it holds). The
exhaustive verifier (``rollsafe verify``), the hypothesis property tests and the demo's final
check all call :func:`check_all` on a :class:`FleetPicture`: the verifier builds one from its
model (machines plus the engines' ground truth), the demo from a running fleet
(:meth:`rollsafe.fleet.RolloutFleet.picture`). Facts a source cannot know are ``None`` and the
invariants that need them skip them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = [
    "INVARIANTS",
    "POISONED",
    "DeltaPicture",
    "ExportPicture",
    "FleetPicture",
    "GroupPicture",
    "InvariantViolation",
    "LeasePicture",
    "MemberPicture",
    "PromotionPicture",
    "RecoveryPicture",
    "active_groups_whole_and_current",
    "base_never_ahead",
    "budget_spent_only_by_claims",
    "check_all",
    "delta_only_onto_its_base",
    "fleet_version_never_decreases",
    "immediate_recovery_rearms",
    "late_export_never_used",
    "leases_held_by_recoveries",
    "lost_node_groups_wait_unplaced",
    "no_delete_under_lease",
    "no_publish_on_failed_register",
    "policy_agrees_with_machines",
    "promoted_only_at_current_version",
    "recorded_versions_are_true",
    "recovery_never_on_health_thread",
    "removed_group_never_returns",
    "routable_iff_active",
    "spare_pool_kept",
    "spares_never_routed",
    "spares_ready_at_current_version",
    "unknown_weights_taken_out",
    "whole_group_transitions",
]


#: ``MemberPicture.true_version`` of a live engine whose update failed on an engine kind that
#: keeps no weights then (vLLM, SGLang): it holds nothing known, answers ``/health``, and dies
#: on its next forward pass.
POISONED = -1


@dataclass(frozen=True)
class MemberPicture:
    """One rank: what the fleet recorded and, where known, what the engine really is."""

    rank: int
    known: bool
    healthy: bool
    version: int | None
    alive: bool | None = None  # ground truth (the verifier knows it; a live fleet does not)
    true_version: int | None = None  # the weights the engine really holds (None: unknown)


@dataclass(frozen=True)
class GroupPicture:
    group_id: str
    state: str
    routable: bool
    restart_budget: int
    members: tuple[MemberPicture, ...]
    #: the fleet was told its node died, and it was not placed again since (None: unknown)
    node_lost: bool | None = None
    #: its removal began (``remove_group``) (None: unknown)
    removed: bool | None = None
    #: the restart budget it started with, and the claims made on it (None: unknown)
    initial_budget: int | None = None
    claims: int | None = None
    #: its role: a spare (``standby`` when ready, never routed) or serving (None: unknown)
    spare: bool | None = None
    #: the node slices (of a group that spans nodes) whose node the fleet was told is dead,
    #: not placed again since (None: unknown)
    lost_slices: tuple[int, ...] | None = None


@dataclass(frozen=True)
class PromotionPicture:
    """One spare promoted in place of ``covered``: the fleet's version then, its members'
    recorded versions, what its engines really held (None: unknown) and what they answered to
    the last version check (None: unknown; empty: they did not answer)."""

    group_id: str
    covered: str
    fleet_version: int
    recorded: tuple[int | None, ...]
    true_versions: tuple[int | None, ...] | None = None
    reported: tuple[str | None, ...] | None = None


@dataclass(frozen=True)
class ExportPicture:
    version: int
    state: str
    leases: int
    dir_present: bool | None = None


@dataclass(frozen=True)
class RecoveryPicture:
    """One recovery that loaded from an export: which, in what state, at which fleet version."""

    group_id: str
    export_version: int
    export_state: str
    fleet_version: int


@dataclass(frozen=True)
class LeasePicture:
    """One export lease held by a recovery of ``group_id`` (in ``group_state``);
    ``restart_running``: its restart timed out and still runs in the background."""

    group_id: str
    export_version: int
    group_state: str
    restart_running: bool = False


@dataclass(frozen=True)
class DeltaPicture:
    """The sender's base for one target (its :class:`~rollsafe.statemachines.DeltaBase`):
    ``target`` is the group id; ``base`` the version it confirmed holding (None: unknown);
    ``in_flight`` the version being pushed to it (None: no push under way)."""

    target: str
    state: str
    base: int | None
    in_flight: int | None = None


@dataclass(frozen=True)
class FleetPicture:
    """Everything the invariants read. Built by the verifier's model or by a live fleet."""

    fleet_version: int
    groups: tuple[GroupPicture, ...]
    #: the version the fleet started at (it was never registered by a sync)
    initial_version: int = 0
    registration_state: str | None = None
    published: tuple[str, int] | None = None
    last_published_version: int | None = None
    #: whether every rank succeeded in the last register (None: unknown)
    last_register_complete: bool | None = None
    exports: tuple[ExportPicture, ...] = ()
    mode_state: str | None = None
    rearm_after: int = 1
    #: on-time exports judged since the last late one (None: none was late, or unknown)
    on_time_since_late: int | None = None
    late_versions: frozenset[int] = frozenset()
    max_version_seen: int = 0
    immediate_recoveries: tuple[RecoveryPicture, ...] = ()
    #: (group id, the thread a recovery ran on) for recoveries started by the health manager
    recovery_threads: tuple[tuple[str, str], ...] = ()
    #: decisions the machines refused (event, machine, why): the policy and guards disagree
    refused_decisions: tuple[str, ...] = field(default=())
    #: every export lease and who holds it (None: unknown)
    lease_holders: tuple[LeasePicture, ...] | None = None
    #: the sender's base per target (delta sync; None: unknown or deltas off)
    delta_bases: tuple[DeltaPicture, ...] | None = None
    #: deltas sent to an engine that did not hold their base (what was seen; empty when none)
    wrong_base_deltas: tuple[str, ...] = ()
    #: how many groups are spares by configuration (``FleetConfig.spare_groups``; None:
    #: unknown)
    spare_groups: int | None = None
    #: every promotion of a spare so far (what was seen)
    promotions: tuple[PromotionPicture, ...] = ()
    #: placements that reserved fewer node slices than their group has (what was seen: group
    #: id and slices placed of slices; empty when none)
    partial_placements: tuple[str, ...] = ()


@dataclass(frozen=True)
class InvariantViolation:
    """An invariant that failed: its function's name and what was found."""

    invariant: str
    message: str

    def __str__(self) -> str:
        return f"{self.invariant}: {self.message}"


def routable_iff_active(p: FleetPicture) -> list[str]:
    """A group takes traffic exactly when it is ``active``."""
    return [
        f"{g.group_id} routable={g.routable} in {g.state}"
        for g in p.groups
        if g.routable != (g.state == "active")
    ]


def active_groups_whole_and_current(p: FleetPicture) -> list[str]:
    """No routing to a group that is not whole and current: every member of an ``active``
    group is healthy and holds the fleet's version (by the record, and by the engines
    themselves where that is known)."""
    out = []
    for g in p.groups:
        if g.state != "active":
            continue
        for m in g.members:
            if not m.healthy or m.version != p.fleet_version:
                out.append(
                    f"{g.group_id} is active but r{m.rank} is recorded healthy={m.healthy} "
                    f"v={m.version} (fleet at v{p.fleet_version})"
                )
            elif (
                m.alive is not None
                and m.true_version is not None
                and (not m.alive or m.true_version != p.fleet_version)
            ):
                out.append(
                    f"{g.group_id} is active but engine r{m.rank} holds v{m.true_version} "
                    f"(alive={m.alive}, fleet at v{p.fleet_version})"
                )
    return out


def whole_group_transitions(p: FleetPicture) -> list[str]:
    """Transitions move whole groups: an ``active``, ``standby`` or ``pending_weights`` group
    has no member recorded unhealthy, and a restart budget never goes below zero."""
    out = []
    for g in p.groups:
        if g.state in ("active", "standby", "pending_weights"):
            sick = [m.rank for m in g.members if not m.healthy]
            if sick:
                out.append(f"{g.group_id} is {g.state} with unhealthy ranks {sick}")
        if g.restart_budget < 0:
            out.append(f"{g.group_id} restart budget below zero")
    return out


def recorded_versions_are_true(p: FleetPicture) -> list[str]:
    """The fleet never credits a live member with the current version its engine does not hold
    (a version pushed to a subset is never recorded for the others; a failed push is never
    recorded). Under-claiming is safe: such a group waits for weights, out of routing."""
    out = []
    for g in p.groups:
        if g.state in ("inactive", "retired"):
            continue
        for m in g.members:
            if (
                m.alive
                and m.healthy
                and m.version == p.fleet_version
                and m.true_version != p.fleet_version
            ):
                out.append(
                    f"{g.group_id} r{m.rank} recorded at v{m.version}, engine holds "
                    f"v{m.true_version}"
                )
    return out


def no_publish_on_failed_register(p: FleetPicture) -> list[str]:
    """A checkpoint is published only by a successful register, and the fleet moves to a
    version only once the transport published it."""
    out = []
    if p.published is not None and p.registration_state not in ("registered", "updating"):
        out.append(f"{p.published} is published in state {p.registration_state}")
    if p.published is not None and p.last_register_complete is False:
        out.append(f"{p.published} is published although a rank failed to register")
    if p.registration_state is not None and p.fleet_version > p.initial_version:
        last = p.last_published_version
        if last is None or last < p.fleet_version:
            out.append(f"fleet at v{p.fleet_version} but the last published version is {last}")
    return out


def no_delete_under_lease(p: FleetPicture) -> list[str]:
    """An export with leases is never deleted (machine state or directory)."""
    return [
        f"export v{e.version} {e.state} (dir present: {e.dir_present}) with {e.leases} lease(s)"
        for e in p.exports
        if e.leases and (e.state == "deleted" or e.dir_present is False)
    ]


def late_export_never_used(p: FleetPicture) -> list[str]:
    """Only a ``ready`` export of the fleet's current version is used for recovery: never a
    late (abandoned) one, one still being written, or an older one."""
    out = []
    for r in p.immediate_recoveries:
        if r.export_state != "ready" or r.export_version != r.fleet_version:
            out.append(
                f"{r.group_id} recovered from export v{r.export_version} in {r.export_state} "
                f"(fleet at v{r.fleet_version})"
            )
        elif r.export_version in p.late_versions:
            out.append(f"{r.group_id} recovered from late export v{r.export_version}")
    for e in p.exports:
        if e.state in ("failed", "abandoned") and e.leases:
            out.append(f"{e.state} export v{e.version} is leased")
    return out


def leases_held_by_recoveries(p: FleetPicture) -> list[str]:
    """Every export lease is held by a recovery still using it: its group is ``recovering``,
    or its restart timed out and still loads in the background; an export's leases are
    exactly those (none leaked, so retention can delete it once they end)."""
    if p.lease_holders is None:
        return []
    out = [
        f"{h.group_id} ({h.group_state}) still holds its lease on export v{h.export_version}"
        for h in p.lease_holders
        if h.group_state != "recovering" and not h.restart_running
    ]
    for e in p.exports:
        held = sum(1 for h in p.lease_holders if h.export_version == e.version)
        if e.leases != held:
            out.append(f"export v{e.version} has {e.leases} lease(s), {held} held by recoveries")
    return out


def immediate_recovery_rearms(p: FleetPicture) -> list[str]:
    """A late export suspends immediate recovery; ``rearm_after`` on-time exports after the
    last late one re-arm it (never suspended forever)."""
    streak = p.on_time_since_late
    if p.mode_state in (None, "disabled") or streak is None:
        return []
    if streak == 0 and p.mode_state != "suspended":
        return [f"a late export left the mode {p.mode_state}"]
    if streak >= p.rearm_after and p.mode_state != "enabled":
        return [
            f"{streak} on-time exports since the last late one, mode still {p.mode_state} "
            f"(rearm_after={p.rearm_after})"
        ]
    return []


def fleet_version_never_decreases(p: FleetPicture) -> list[str]:
    """The fleet version never goes back."""
    if p.fleet_version < p.max_version_seen:
        return [f"fleet version went back to {p.fleet_version} from {p.max_version_seen}"]
    return []


def recovery_never_on_health_thread(p: FleetPicture) -> list[str]:
    """Recovery never runs on the health-check thread (probes keep running meanwhile)."""
    return [
        f"recovery of {gid} ran on the health thread {thread!r}"
        for gid, thread in p.recovery_threads
        if thread == "health"
    ]


def unknown_weights_taken_out(p: FleetPicture) -> list[str]:
    """A group with a live member that holds unknown weights (an update failed on an engine
    that keeps none, :data:`POISONED`) is out of routing and in recovery (``inactive``,
    ``recovering``) or retired: never ``active`` on the word of ``/health``, never left
    ``pending_weights`` for a push into an engine that cannot take one."""
    out = []
    for g in p.groups:
        if g.state in ("inactive", "recovering", "retired", "unplaced", "draining"):
            continue
        bad = [m.rank for m in g.members if m.alive and m.true_version == POISONED]
        if bad:
            out.append(f"{g.group_id} is {g.state} although r{bad} hold unknown weights")
    return out


def lost_node_groups_wait_unplaced(p: FleetPicture) -> list[str]:
    """A group whose node the fleet knows is dead is ``unplaced`` until it is placed again
    (or removed: ``draining``, ``retired``): never routable, never claimed, never restarted on
    the dead node."""
    return [
        f"{g.group_id} is {g.state} although its node was reported dead and it was not placed"
        for g in p.groups
        if g.node_lost and g.state not in ("unplaced", "draining", "retired")
    ]


def no_routing_over_a_lost_slice(p: FleetPicture) -> list[str]:
    """A group that spans nodes leaves routing whole when the node under any of its slices is
    reported dead, and stays out (``unplaced``) until it is placed again: never routed while
    incomplete."""
    return [
        f"{g.group_id} is {g.state} (routable={g.routable}) although the node under its "
        f"slice(s) {list(g.lost_slices)} was reported dead"
        for g in p.groups
        if g.lost_slices and (g.routable or g.state not in ("unplaced", "draining", "retired"))
    ]


def placed_all_slices_or_none(p: FleetPicture) -> list[str]:
    """A group is placed again whole: every node slice on a live node, or not placed at all
    (a placement holding some slices would start an engine that can never be whole)."""
    return [f"a placement held part of a group: {what}" for what in p.partial_placements]


def budget_spent_only_by_claims(p: FleetPicture) -> list[str]:
    """The restart budget goes down by one per claim and by nothing else: a node loss and
    the placement after it spend none (the engine did nothing wrong)."""
    return [
        f"{g.group_id} has budget {g.restart_budget} after {g.claims} claim(s) of "
        f"{g.initial_budget}"
        for g in p.groups
        if g.initial_budget is not None
        and g.claims is not None
        and g.restart_budget != g.initial_budget - g.claims
    ]


def removed_group_never_returns(p: FleetPicture) -> list[str]:
    """A group whose removal began is ``draining`` or ``retired`` from then on: never
    routable again, never recovered."""
    return [
        f"{g.group_id} is {g.state} after its removal began"
        for g in p.groups
        if g.removed and g.state not in ("draining", "retired")
    ]


def delta_only_onto_its_base(p: FleetPicture) -> list[str]:
    """No delta is ever applied onto another version than the base it names, and none is even
    sent to an engine that does not hold that base: the engine refuses such a delta (nothing
    changed), but the sender's bookkeeping must make that check redundant, so that an engine
    kind that cannot check (one applying raw sparse updates) is safe too."""
    return list(p.wrong_base_deltas)


def base_never_ahead(p: FleetPicture) -> list[str]:
    """The sender's base for a target is what the target's engine really holds: whenever a
    target is ``based`` on version B with no push in flight, every live rank of its group
    holds B (a failed or lost push never moves the base; a restart resets it). A rank holding
    unknown weights (:data:`POISONED`) is left to ``unknown_weights_taken_out``: its group is
    restarted, which resets the base."""
    if p.delta_bases is None:
        return []
    groups = {g.group_id: g for g in p.groups}
    out = []
    for d in p.delta_bases:
        group = groups.get(d.target)
        if d.state != "based" or d.in_flight is not None or group is None:
            continue
        for m in group.members:
            if m.alive and m.true_version != POISONED and m.true_version != d.base:
                out.append(
                    f"the sender's base for {d.target} is v{d.base} but its r{m.rank} holds "
                    f"v{m.true_version}"
                )
    return out


def spares_never_routed(p: FleetPicture) -> list[str]:
    """A spare is never routable before its promotion: a group whose role is spare is never
    ``active`` (``promote`` makes it a serving group as it enters ``active``)."""
    return [
        f"{g.group_id} is a spare and {g.state} (routable={g.routable})"
        for g in p.groups
        if g.spare and (g.routable or g.state == "active")
    ]


def spares_ready_at_current_version(p: FleetPicture) -> list[str]:
    """A spare in ``standby`` is ready to serve the fleet's version: every member is recorded
    healthy at it and, where known, its engine holds it (every sync keeps the spares at the
    fleet's version; one that misses it leaves ``standby``)."""
    out = []
    for g in p.groups:
        if g.state != "standby":
            continue
        for m in g.members:
            if not m.healthy or m.version != p.fleet_version:
                out.append(
                    f"{g.group_id} is standby but r{m.rank} is recorded healthy={m.healthy} "
                    f"v={m.version} (fleet at v{p.fleet_version})"
                )
            elif m.alive and m.true_version is not None and m.true_version != p.fleet_version:
                out.append(
                    f"{g.group_id} is standby but engine r{m.rank} holds v{m.true_version} "
                    f"(fleet at v{p.fleet_version})"
                )
    return out


def promoted_only_at_current_version(p: FleetPicture) -> list[str]:
    """A spare is promoted only at the fleet's current version: every member recorded at it,
    every engine holding it (where known) and naming it when asked last."""
    out = []
    for pr in p.promotions:
        want = pr.fleet_version
        bad: list[object] = [v for v in pr.recorded if v != want]
        if pr.true_versions is not None:
            bad += [v for v in pr.true_versions if v != want]
        if pr.reported is not None:
            bad += [v for v in pr.reported if v != str(want)] or ([] if pr.reported else ["?"])
        if bad:
            out.append(
                f"{pr.group_id} was promoted for {pr.covered} at v{want} holding {bad} "
                f"(recorded {list(pr.recorded)}, engines {pr.true_versions}, "
                f"answered {pr.reported})"
            )
    return out


def spare_pool_kept(p: FleetPicture) -> list[str]:
    """The pool refills: a spare is promoted only together with the enlisting of the group it
    covers (whose recovery ends in ``standby``), so the number of groups in the spare role is
    the configured one, always (a retired or removed spare still counts: the pool shrinks
    only by what the fleet gave up)."""
    if p.spare_groups is None or any(g.spare is None for g in p.groups):
        return []
    spares = sorted(g.group_id for g in p.groups if g.spare)
    if len(spares) != p.spare_groups:
        return [f"{len(spares)} group(s) are spares {spares}, {p.spare_groups} configured"]
    return []


def policy_agrees_with_machines(p: FleetPicture) -> list[str]:
    """Every event the policy decided was taken by its machine: a decision a guard refuses
    means the policy and the machines disagree."""
    return list(p.refused_decisions)


#: Every invariant, in the order reports list them.
INVARIANTS: tuple[Callable[[FleetPicture], list[str]], ...] = (
    routable_iff_active,
    active_groups_whole_and_current,
    whole_group_transitions,
    recorded_versions_are_true,
    no_publish_on_failed_register,
    no_delete_under_lease,
    late_export_never_used,
    leases_held_by_recoveries,
    immediate_recovery_rearms,
    fleet_version_never_decreases,
    recovery_never_on_health_thread,
    unknown_weights_taken_out,
    lost_node_groups_wait_unplaced,
    no_routing_over_a_lost_slice,
    placed_all_slices_or_none,
    budget_spent_only_by_claims,
    removed_group_never_returns,
    delta_only_onto_its_base,
    base_never_ahead,
    spares_never_routed,
    spares_ready_at_current_version,
    promoted_only_at_current_version,
    spare_pool_kept,
    policy_agrees_with_machines,
)


def check_all(picture: FleetPicture) -> list[InvariantViolation]:
    """Run every invariant on ``picture``; return the violations (empty when all hold)."""
    return [
        InvariantViolation(fn.__name__, message) for fn in INVARIANTS for message in fn(picture)
    ]
