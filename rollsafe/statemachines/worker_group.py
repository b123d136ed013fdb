"""WorkerGroupLifecycle: the lifecycle of one worker group (all server processes of one engine).

A worker group is the unit of routing and recovery: a TP/EP group or a multi-node engine. Its
lifecycle state is per group; per-member facts (health, weights version) only feed guards, and
every guard asks ``all()`` members, never ``any()``. That is the whole-group consistency rule:
a half-recovered group never gets traffic.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from statemachine import State

from rollsafe.errors import InvalidArgument
from rollsafe.statemachines.base import GuardedMachine, GuardInputMissing

__all__ = ["MemberFacts", "WorkerGroupLifecycle"]


@dataclass(frozen=True)
class MemberFacts:
    """What the fleet last reported about one rank of a group."""

    rank: int
    known: bool = False
    healthy: bool = False
    weights_version: int | None = None


class WorkerGroupLifecycle(GuardedMachine):
    """Lifecycle of one worker group: launching, serving, failing, recovering, retiring.

    States: ``launching`` (initial), ``active`` (the only routable state), ``standby`` (a
    spare: healthy, at the fleet's current version, never routed until promoted),
    ``inactive`` (out of routing after a failure), ``recovering`` (a recovery claimed it and is
    restarting it), ``pending_weights`` (healthy but not at the fleet's current weights
    version), ``unplaced`` (its node died: waiting for a node with room), ``draining`` (being
    removed: no new requests), ``retired`` (final: restart budget spent or removed on purpose).

    Spares (``FleetConfig(spare_groups=N)``, ``docs/recovery.md``): a group's role is a fact,
    :attr:`spare`, read by the guards. A spare that reaches the current version (``launched``,
    ``restarted``, ``weights_loaded``) goes to ``standby``, a serving group to ``active``;
    ``mark_stale`` takes a spare behind the version to ``pending_weights`` like a serving one.
    ``promote`` (``standby`` -> ``active``, every member healthy and at the current version)
    makes a spare serve; ``enlist`` (a serving group out of routing: ``inactive``,
    ``recovering``, ``unplaced``, ``pending_weights``; its state unchanged) makes it a spare,
    so its recovery ends in ``standby``. The fleet sends both in one registry step, all or
    nothing: the pool keeps its size.

    Node loss (``docs/cluster.md``): ``node_lost`` takes a group whose node died out of every
    non-final state but ``draining`` to ``unplaced`` and forgets its members; ``placed``
    (``unplaced`` -> ``recovering``) follows a new placement. Neither touches the restart
    budget: the engine did nothing wrong. ``drain`` starts a removal; ``retire`` ends it.

    Guards read the per-member facts recorded with :meth:`report_member` and, for the events
    that need it (``launched``, ``restarted``, ``weights_loaded``, optionally ``mark_stale``), the
    fleet's ``current_version=``. ``claim`` consumes one unit of the restart budget; ``claim``
    also forgets the members' health and versions, since the restarted processes start blank.

    Invariants: routable iff ``active`` (never ``standby``, ``unplaced`` or ``draining``); a
    spare is never ``active`` (``promote`` makes it serving as it enters); on entering
    ``active`` every member is healthy and at the current version; no transition happens on the
    word of ``any()`` member; the budget never goes below zero.
    """

    launching = State("Launching", initial=True)
    active = State("Active")
    standby = State("Standby")
    inactive = State("Inactive")
    recovering = State("Recovering")
    pending_weights = State("Pending weights")
    unplaced = State("Unplaced")
    draining = State("Draining")
    retired = State("Retired", final=True)

    launched = (
        launching.to(
            standby,
            cond=["is_spare", "all_members_healthy", "all_at_current_version"],
            validators="current_version_given",
        )
        | launching.to(
            active,
            cond=["is_serving", "all_members_healthy", "all_at_current_version"],
            validators="current_version_given",
        )
        | launching.to(pending_weights, cond="all_members_healthy")
    )
    fail = (
        launching.to(inactive)
        | active.to(inactive)
        | standby.to(inactive)
        | pending_weights.to(inactive)
    )
    claim = inactive.to(recovering, cond=["group_complete", "restart_budget_left"])
    restarted = (
        recovering.to(
            standby,
            cond=["is_spare", "all_members_healthy", "all_at_current_version"],
            validators="current_version_given",
        )
        | recovering.to(
            active,
            cond=["is_serving", "all_members_healthy", "all_at_current_version"],
            validators="current_version_given",
        )
        | recovering.to(pending_weights, cond="all_members_healthy")
    )
    restart_failed = recovering.to(inactive)
    mark_stale = active.to(pending_weights, cond="behind_current_version") | standby.to(
        pending_weights, cond="behind_current_version"
    )
    weights_loaded = pending_weights.to(
        standby,
        cond=["is_spare", "all_members_healthy", "all_at_current_version"],
        validators="current_version_given",
    ) | pending_weights.to(
        active,
        cond=["is_serving", "all_members_healthy", "all_at_current_version"],
        validators="current_version_given",
    )
    promote = standby.to(
        active,
        cond=["is_spare", "all_members_healthy", "all_at_current_version"],
        validators="current_version_given",
    )
    enlist = (
        inactive.to.itself(internal=True, cond="is_serving")  # type: ignore[no-untyped-call]
        | recovering.to.itself(internal=True, cond="is_serving")  # type: ignore[no-untyped-call]
        | unplaced.to.itself(internal=True, cond="is_serving")  # type: ignore[no-untyped-call]
        | pending_weights.to.itself(  # type: ignore[no-untyped-call]
            internal=True, cond="is_serving"
        )
    )
    retire = (
        launching.to(retired)
        | active.to(retired)
        | standby.to(retired)
        | inactive.to(retired)
        | recovering.to(retired)
        | pending_weights.to(retired)
        | unplaced.to(retired)
        | draining.to(retired)
    )
    node_lost = (
        launching.to(unplaced)
        | active.to(unplaced)
        | standby.to(unplaced)
        | inactive.to(unplaced)
        | recovering.to(unplaced)
        | pending_weights.to(unplaced)
    )
    placed = unplaced.to(recovering)
    drain = (
        launching.to(draining)
        | active.to(draining)
        | standby.to(draining)
        | inactive.to(draining)
        | recovering.to(draining)
        | pending_weights.to(draining)
        | unplaced.to(draining)
    )

    def __init__(
        self,
        ranks: Iterable[int],
        restart_budget: int = 3,
        group_id: str | None = None,
        *,
        spare: bool = False,
    ) -> None:
        rank_list = list(ranks)
        if not rank_list:
            raise InvalidArgument(
                "ranks", "WorkerGroupLifecycle ranks: needs at least one rank, got none"
            )
        if len(set(rank_list)) != len(rank_list):
            dup = sorted({r for r in rank_list if rank_list.count(r) > 1})
            raise InvalidArgument(
                "ranks", f"WorkerGroupLifecycle ranks must be unique; repeated: {dup}"
            )
        if restart_budget < 0:
            raise InvalidArgument(
                "restart_budget", f"restart_budget must be >= 0, got {restart_budget}"
            )
        self.ranks: tuple[int, ...] = tuple(rank_list)
        self.group_id = group_id if group_id is not None else f"group-{rank_list[0]}"
        self.restart_budget = restart_budget
        self.initial_restart_budget = restart_budget
        #: the group's role: a spare (``standby`` when ready, never routed until promoted) or
        #: a serving group; changed only by ``promote`` (-> serving) and ``enlist`` (-> spare)
        self.spare = bool(spare)
        # Ranks given at construction are known; a rank whose process or node vanishes without
        # a report is forgotten (forget_member) until it reports again.
        self._members: dict[int, MemberFacts] = {r: MemberFacts(r, known=True) for r in self.ranks}
        super().__init__()

    # ------------------------------------------------------------------ facts
    @property
    def label(self) -> str:
        return f"WorkerGroupLifecycle({self.group_id})"

    @property
    def members(self) -> dict[int, MemberFacts]:
        """A copy of the per-member facts, keyed by rank."""
        with self._lock:
            return dict(self._members)

    @property
    def is_routable(self) -> bool:
        """True only in ``active``: the router sends requests to this group."""
        return bool(self.current_state_value == "active")

    def report_member(
        self, rank: int, *, healthy: bool, weights_version: int | None = None
    ) -> None:
        """Record what a probe or an engine said about one rank.

        ``weights_version=None`` leaves the recorded version unchanged (a plain health probe does
        not know it). An unknown rank raises ``ValueError`` naming it and changes nothing.
        """
        with self._lock:
            old = self._members.get(rank)
            if old is None:
                raise InvalidArgument(
                    "rank",
                    f"{self.label}: rank {rank!r} is not a member (members: {list(self.ranks)})",
                )
            version = old.weights_version if weights_version is None else weights_version
            # Copy on write: history entries keep a reference to the dict they saw.
            self._members = {**self._members, rank: MemberFacts(rank, True, bool(healthy), version)}

    def forget_member(self, rank: int) -> None:
        """Mark a rank unknown (its process or node vanished without a report)."""
        with self._lock:
            if rank not in self._members:
                raise InvalidArgument(
                    "rank",
                    f"{self.label}: rank {rank!r} is not a member (members: {list(self.ranks)})",
                )
            self._members = {**self._members, rank: MemberFacts(rank)}

    def restore_members(self, members: Iterable[MemberFacts]) -> None:
        """Set every member's facts at once, bypassing reports (model checking only)."""
        with self._lock:
            facts = {m.rank: m for m in members}
            if set(facts) != set(self.ranks):
                raise InvalidArgument(
                    "facts", f"{self.label}: facts for ranks {sorted(facts)} != {self.ranks}"
                )
            self._members = {r: facts[r] for r in self.ranks}

    def restore_role(self, spare: bool) -> None:
        """Set the group's role directly, bypassing ``promote`` / ``enlist`` (model checking
        only)."""
        with self._lock:
            self.spare = bool(spare)

    def facts_token(self) -> Any:
        return (self._members, self.restart_budget, self.spare)

    def facts_from_token(self, token: Any) -> dict[str, Any]:
        members_map, budget, spare = token
        members = members_map.values()
        return {
            "unhealthy": tuple(m.rank for m in members if not m.healthy),
            "versions": tuple(m.weights_version for m in members),
            "restart_budget": budget,
            "spare": spare,
        }

    # ------------------------------------------------------------------ validators
    def current_version_given(self, current_version: int | None = None) -> None:
        """``launched``, ``restarted`` and ``weights_loaded`` need the fleet's version."""
        if current_version is None:
            raise GuardInputMissing(f"{self.label}: this event needs current_version=")

    # ------------------------------------------------------------------ guards (all(), never any())
    def all_members_healthy(self) -> bool:
        """Every member reported healthy."""
        return all(m.healthy for m in self._members.values())

    def all_at_current_version(self, current_version: int | None = None) -> bool:
        """Every member reports the same weights version, equal to the fleet's current one."""
        if current_version is None:
            return False
        return all(m.weights_version == current_version for m in self._members.values())

    def group_complete(self) -> bool:
        """Every rank of the group is known (none forgotten without reporting again)."""
        return all(m.known for m in self._members.values())

    def is_spare(self) -> bool:
        """The group is a spare (ready: ``standby``; serves only once promoted)."""
        return self.spare

    def is_serving(self) -> bool:
        """The group serves (ready: ``active``); not a spare."""
        return not self.spare

    def restart_budget_left(self) -> bool:
        """At least one restart of the budget remains."""
        return self.restart_budget > 0

    def behind_current_version(self, current_version: int | None = None) -> bool:
        """Some member is not at the fleet's current version (always true when not given)."""
        if current_version is None:
            return True
        return not all(m.weights_version == current_version for m in self._members.values())

    # ------------------------------------------------------------------ actions
    def on_claim(self) -> None:
        self.restart_budget -= 1
        self._members = {r: MemberFacts(r, known=m.known) for r, m in self._members.items()}

    def on_promote(self) -> None:
        """A spare promoted serves from now on (its recovery, if it fails, ends in ``active``)."""
        self.spare = False

    def on_enlist(self) -> None:
        """A serving group covered by a promoted spare refills the pool: its recovery ends in
        ``standby``."""
        self.spare = True

    def on_node_lost(self) -> None:
        """Every member went with its node: none is known until the group is placed again."""
        self._members = {r: MemberFacts(r) for r in self._members}

    def on_placed(self) -> None:
        """Placed on a new node: the members are the ones about to start there (blank, known);
        the budget is untouched."""
        self._members = {r: MemberFacts(r, known=True) for r in self._members}
