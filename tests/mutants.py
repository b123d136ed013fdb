"""Deliberately planted versions of the reviewers' bugs (``docs/design.md``, "The problem").

Two kinds. Machine mutants subclass a real machine and break one guard or action; they are
passed to :class:`~rollsafe.verify.FleetModel` as machine classes. Policy mutants replace one
function of :mod:`rollsafe.policy` (the module the fleet, the verifier and the property
tests all call); they are planted with ``monkeypatch.setattr(policy, name, mutant)``. The
mutation tests assert that the exhaustive verifier and the property tests catch every one.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

from rollsafe import policy
from rollsafe.statemachines import (
    CheckpointRegistration,
    DeltaBase,
    ExportLifecycle,
    ImmediateRecoveryMode,
    WorkerGroupLifecycle,
)
from rollsafe.verify import ModelConfig

# ---------------------------------------------------------------------- machine mutants


class AnyHealthyGroup(WorkerGroupLifecycle):
    """Bug: the group guard asks any() member instead of all()."""

    def all_members_healthy(self) -> bool:
        return any(m.healthy for m in self._members.values())


class PublishOnFailedRegister(CheckpointRegistration):
    """Bug: a register in which a rank failed still publishes its name."""

    def every_rank_registered(self, ranks_ok: Collection[int] | None = None) -> bool:
        return True


class PublishAfterRegisterThrew(CheckpointRegistration):
    """Bug: the name is published before registration is known to succeed, and stays published
    although registration threw (publication no longer derived from the state)."""

    def on_register_failed(self, reason: str = "unspecified") -> None:
        self._published = self.pending
        self.failure_reason = reason

    @property
    def published(self) -> tuple[str, int] | None:
        return self._published


class DeleteLeasedExport(ExportLifecycle):
    """Bug: retention deletes an export while a restart still loads from it."""

    def no_leases_held(self) -> bool:
        return True


class SuspendedForever(ImmediateRecoveryMode):
    """Bug: one late export disables immediate recovery for good (never re-armed)."""

    def rearm_streak_reached(self) -> bool:
        return False


class PlacedSpendsBudget(WorkerGroupLifecycle):
    """Bug: a re-placement after a node loss spends a unit of the restart budget (a fleet
    that loses nodes often retires healthy groups)."""

    def on_placed(self) -> None:
        super().on_placed()
        self.restart_budget -= 1


class SpareServesAtLaunch(WorkerGroupLifecycle):
    """Bug: the group's role is not read: a spare that comes up at the current version goes
    to ``active`` like a serving group and takes requests before any promotion."""

    def is_spare(self) -> bool:
        return False

    def is_serving(self) -> bool:
        return True


class AdvanceBaseOnSend(DeltaBase):
    """Bug (slime#2104's drift): the sender's base for a target moves to the new version when
    the push is sent, not when the target confirmed it; a lost or failed delta leaves the
    sender diffing against weights the engine never got."""

    def on_send_full(self, version: int) -> None:
        super().on_send_full(version)
        self._base = version

    def on_send_delta(self, version: int) -> None:
        super().on_send_delta(version)
        self._base = version


MUTANTS = {
    "any_instead_of_all": {"group_cls": AnyHealthyGroup},
    "publish_on_failed_register": {"registration_cls": PublishOnFailedRegister},
    "publish_after_register_threw": {"registration_cls": PublishAfterRegisterThrew},
    "delete_leased_export": {"export_cls": DeleteLeasedExport},
    "suspended_forever": {"mode_cls": SuspendedForever},
    "placement_spends_budget": {"group_cls": PlacedSpendsBudget},
    "advance_base_on_send": {"delta_cls": AdvanceBaseOnSend},
    "spare_routed_before_promotion": {"group_cls": SpareServesAtLaunch},
}

# ---------------------------------------------------------------------- policy mutants
_settle = policy.settle_update


def activate_with_failed_rank(
    version: int,
    groups: Sequence[policy.GroupFacts],
    targeted: Sequence[str],
    rank_ok: Mapping[str, Mapping[int, bool]],
    moved: Sequence[str] = (),
    on_failure: policy.UpdateFailurePolicy = "fail",
) -> policy.Settlement:
    """Bug: a group whose push failed for one rank counts as updated (any() rank loaded)."""
    lenient = {g: dict.fromkeys(r, any(r.values())) for g, r in rank_ok.items()}
    return _settle(version, groups, targeted, lenient, moved, on_failure)


def proceed_after_failed_register(published: tuple[str, int] | None, version: int) -> bool:
    """Bug: the sync goes on (versions, update, export) although the register failed."""
    return True


def lease_free_delete(
    exports: Sequence[policy.ExportFacts], keep_last: int
) -> policy.RetentionPlan:
    """Bug: retention deletes superseded exports without looking at their leases."""
    plan = policy_original("plan_retention")([replace(e, leases=0) for e in exports], keep_last)
    return plan


def late_export_for_recovery(
    *, mode_state: str, fleet_version: int, export: policy.ExportFacts | None, can_push: bool
) -> policy.StrategyChoice:
    """Bug: recovery restarts from any export that has not failed: also one still being written
    when the next sync judges it late, or an abandoned one."""
    if mode_state == "enabled" and export is not None and export.state != "failed":
        return policy.StrategyChoice(policy.Strategy.IMMEDIATE, export.version, "any export")
    return policy_original("choose_strategy")(
        mode_state=mode_state, fleet_version=fleet_version, export=export, can_push=can_push
    )


def subset_recorded_fleet_wide(
    version: int,
    groups: Sequence[policy.GroupFacts],
    targeted: Sequence[str],
    rank_ok: Mapping[str, Mapping[int, bool]],
    moved: Sequence[str] = (),
    on_failure: policy.UpdateFailurePolicy = "fail",
) -> policy.Settlement:
    """Bug: the version pushed to a subset of the fleet is recorded for every group, and no
    group that missed it is marked stale."""
    right = _settle(version, groups, targeted, rank_ok, moved, on_failure)
    everyone = tuple(g.group_id for g in groups)
    events = tuple((g, e) for g, e in right.events if e is not policy.GroupEvent.MARK_STALE)
    return replace(right, record_version=everyone, events=events)


def stale_trusts_a_failed_engine(
    version: int,
    groups: Sequence[policy.GroupFacts],
    targeted: Sequence[str],
    rank_ok: Mapping[str, Mapping[int, bool]],
    moved: Sequence[str] = (),
    on_failure: policy.UpdateFailurePolicy = "fail",
) -> policy.Settlement:
    """Bug: every engine is assumed to keep its old weights after a failed update, so under
    ``"stale"`` a vLLM group whose update failed waits in ``pending_weights`` (its ``/health``
    still answers) instead of being restarted."""
    trusting = [replace(g, keeps_weights=True) for g in groups]
    return _settle(version, trusting, targeted, rank_ok, moved, on_failure)


_after_push = policy.after_push


def failed_push_left_pending(
    rank_ok: Mapping[int, bool], version: int, *, keeps_weights: bool = True
) -> tuple[policy.GroupEvent, ...]:
    """Bug: a failed targeted push leaves the group waiting for the next sync, whatever the
    engine kind (a vLLM engine's weights are unknown after it)."""
    return _after_push(rank_ok, version, keeps_weights=True)


_on_node_lost = policy.on_node_lost


def node_loss_spares_groups_not_serving(
    groups: Sequence[tuple[str, str]],
) -> policy.NodeLossPlan:
    """Bug: only the ``active`` groups of a dead node leave for ``unplaced``; a group that was
    ``pending_weights`` or recovering stays, and is pushed to and routed on a dead node."""
    return _on_node_lost([(g, s) for g, s in groups if s == "active"])


def removal_drains_only_active(state: str) -> policy.RemovalPlan:
    """Bug: ``remove_group`` drains only a serving group; an ``inactive`` one is left to the
    recovery, which brings it back after its removal."""
    if state == "active":
        return policy.RemovalPlan((policy.GroupEvent.DRAIN,), "draining")
    return policy.RemovalPlan((), f"nothing to drain in {state}")


_plan_cover = policy.plan_cover


def promote_unchecked_spare(
    reported: Sequence[str | None] | None, fleet_version: int
) -> policy.SpareVerdict:
    """Bug: the last version check trusts the record: a spare is promoted whatever its engine
    answered (or when it did not answer: its rank died since the last probe), so it may serve
    weights behind the fleet's version, or none."""
    return policy.SpareVerdict(True, "trusted without asking")


class _NoRefill(policy.CoverPlan):
    def swap(self, spare: str) -> tuple[tuple[str, tuple[policy.GroupEvent, ...]], ...]:
        return ((spare, (policy.GroupEvent.PROMOTE,)),)


def promotion_without_refill(
    group: policy.SpareFacts, spares: Sequence[policy.SpareFacts], fleet_version: int
) -> policy.CoverPlan:
    """Bug: a spare is promoted but the group it covers is not enlisted: its recovery brings
    it back serving, and the pool shrinks by one spare per failure."""
    plan = _plan_cover(group, spares, fleet_version)
    return _NoRefill(plan.group, plan.candidates, plan.reason)


_ORIGINALS: dict[str, Callable[..., Any]] = {
    name: getattr(policy, name)
    for name in (
        "settle_update",
        "judge_probe",
        "proceed_after_register",
        "plan_retention",
        "choose_strategy",
    )
}


def policy_original(name: str) -> Callable[..., Any]:
    """The unmutated policy function (a mutant may delegate to it while one is planted)."""
    return _ORIGINALS[name]


#: the model without node loss and removals, for the mutants that are not about them (smaller)
NO_NODES: dict[str, Any] = {"node_loss": False, "removals": 0}

#: name -> (policy function replaced, mutant, the smallest model that reaches the bug)
POLICY_MUTANTS: dict[str, tuple[str, Callable[..., Any], ModelConfig]] = {
    "activate_group_whose_push_failed_for_one_rank": (
        "settle_update",
        activate_with_failed_rank,
        ModelConfig(groups=1, ranks=2, **NO_NODES),
    ),
    "publish_after_a_failed_register": (
        "proceed_after_register",
        proceed_after_failed_register,
        ModelConfig(groups=1, ranks=1, **NO_NODES),
    ),
    "lease_free_delete": (
        "plan_retention",
        lease_free_delete,
        ModelConfig(groups=1, ranks=1, **NO_NODES),
    ),
    "late_export_used_for_recovery": (
        "choose_strategy",
        late_export_for_recovery,
        ModelConfig(groups=1, ranks=1, **NO_NODES),
    ),
    "version_pushed_to_a_subset_recorded_fleet_wide": (
        # reached through a "stale" group, which only an engine that keeps its weights has
        "settle_update",
        subset_recorded_fleet_wide,
        ModelConfig(groups=1, ranks=2, engine="reference", **NO_NODES),
    ),
    "stale_policy_trusts_a_failed_vllm_engine": (
        "settle_update",
        stale_trusts_a_failed_engine,
        ModelConfig(groups=1, ranks=1, **NO_NODES),
    ),
    "node_loss_spares_groups_not_serving": (
        "on_node_lost",
        node_loss_spares_groups_not_serving,
        ModelConfig(groups=1, ranks=1),
    ),
    "removal_drains_only_active": (
        "plan_removal",
        removal_drains_only_active,
        ModelConfig(groups=1, ranks=1),
    ),
    "failed_push_left_pending_on_vllm": (
        "after_push",
        failed_push_left_pending,
        ModelConfig(groups=1, ranks=1, **NO_NODES),
    ),
    "spare_promoted_without_its_version_check": (
        "judge_spare",
        promote_unchecked_spare,
        ModelConfig(groups=1, ranks=1, spares=1, **NO_NODES),
    ),
    "spare_promoted_without_refilling_the_pool": (
        "plan_cover",
        promotion_without_refill,
        ModelConfig(groups=1, ranks=1, spares=1, **NO_NODES),
    ),
}
