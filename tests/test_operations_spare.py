"""A spare's takeover written once (``rollsafe.operations.spare``): the steps driven by hand
with scripted outcomes, the decisions (``policy.plan_cover``, ``policy.judge_spare``), the
registry's all-or-nothing step, the verifier's model executing the same steps, and one changed
step changing what ``rollsafe verify`` reports. (The live fleet executes them in
``tests/test_spares.py``, ``tests/test_ray_fleet.py`` and ``tests/test_real_vllm_fleet.py``.)"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import pytest
from operations_helpers import rewritten

import rollsafe.operations.effects as fx
from rollsafe import policy
from rollsafe.errors import InvalidArgument
from rollsafe.operations import spare as spare_op
from rollsafe.registry import FleetRegistry
from rollsafe.statemachines import GroupEvent
from rollsafe.verify import Action, FleetModel, ModelConfig, explore


def run(steps: Generator[fx.Effect, fx.Outcome, Any], answer: Callable[[fx.Effect], fx.Outcome]):
    seen: list[fx.Effect] = []

    def perform(effect: fx.Effect) -> fx.Outcome:
        seen.append(effect)
        return answer(effect)

    return seen, fx.drive(steps, perform)


def facts(gid: str, state: str, *, spare: bool, version: int = 3, **kw: Any) -> policy.SpareFacts:
    fields: dict[str, Any] = {"ranks": 1, "healthy": True, "versions": (version,), "node": None}
    fields.update(kw)
    return policy.SpareFacts(gid, state, spare, **fields)


GROUP = facts("g0", "inactive", spare=False, node="n1")


# ---------------------------------------------------------------------- the decisions
def test_plan_cover_takes_ready_spares_of_the_groups_size_off_its_node_first() -> None:
    spares = [
        facts("s0", "standby", spare=True, node="n1"),  # on the failed group's node
        facts("s1", "standby", spare=True, node="n2"),
        facts("s2", "pending_weights", spare=True, version=2),  # behind
        facts("s3", "standby", spare=True, healthy=False),
        facts("s4", "standby", spare=True, ranks=2),  # another size
        facts("s5", "standby", spare=True, version=2),  # recorded behind
    ]
    plan = policy.plan_cover(GROUP, spares, 3)
    assert plan.candidates == ("s1", "s0")
    assert plan.swap("s1") == (("s1", (GroupEvent.PROMOTE,)), ("g0", (GroupEvent.ENLIST,)))
    for group, why in (
        (facts("g0", "active", spare=False), "nothing to cover"),
        (facts("g0", "draining", spare=False), "nothing to cover"),
        (facts("g0", "inactive", spare=True), "it is a spare"),
    ):
        assert policy.plan_cover(group, spares, 3).candidates == ()
        assert why in policy.plan_cover(group, spares, 3).reason
    none = policy.plan_cover(GROUP, spares[2:], 3)
    assert none.candidates == () and "no spare ready at v3" in none.reason


@pytest.mark.parametrize(
    ("reported", "promote", "events"),
    [
        (("3",), True, ()),
        (("3", "3"), True, ()),
        (None, False, ()),  # no answer: the probes judge its health
        ((), False, ()),
        (("3", None), False, ()),  # an engine names no version
        (("2",), False, (GroupEvent.FAIL,)),  # other weights than recorded: recovered
        (("3", "4"), False, (GroupEvent.FAIL,)),
    ],
)
def test_judge_spare_promotes_only_on_its_engines_word(
    reported: tuple[str | None, ...] | None, promote: bool, events: tuple[GroupEvent, ...]
) -> None:
    verdict = policy.judge_spare(reported, 3)
    assert (verdict.promote, verdict.events) == (promote, events), verdict.reason


# ---------------------------------------------------------------------- scripted
def answer_with(
    spares: tuple[policy.SpareFacts, ...], reports: dict[str, fx.Outcome], switch: fx.Outcome
) -> Callable[[fx.Effect], fx.Outcome]:
    def answer(effect: fx.Effect) -> fx.Outcome:
        if isinstance(effect, fx.ReadSpares):
            return fx.Ok(fx.SparesSeen(GROUP, spares, 3))
        if isinstance(effect, fx.CheckVersion):
            return reports[effect.group]
        if isinstance(effect, fx.SendGroups):
            return switch
        return fx.Ok("inactive")

    return answer


def test_the_switch_is_one_all_or_nothing_step_under_the_transport_lock() -> None:
    spares = (facts("s0", "standby", spare=True), facts("s1", "standby", spare=True))
    reports = {"s0": fx.Ok(("2",)), "s1": fx.Ok(("3",))}
    seen, end = run(spare_op.cover("g0"), answer_with(spares, reports, fx.Ok(())))
    kinds = [type(e).__name__ for e in seen]
    assert kinds == [
        "LockTransport",
        "ReadSpares",
        "CheckVersion",  # s0 names v2: failed and handed to recovery
        "SendGroup",
        "HandOff",
        "CheckVersion",  # s1 names v3: promoted
        "SendGroups",
        "UnlockTransport",
        "NoteStep",
    ]
    failed = seen[3]
    assert isinstance(failed, fx.SendGroup) and failed.group == "s0"
    assert failed.event is GroupEvent.FAIL and failed.decided_by == "judge_spare"
    switch = seen[6]
    assert isinstance(switch, fx.SendGroups) and switch.all_or_nothing
    assert switch.events == (("s1", (GroupEvent.PROMOTE,)), ("g0", (GroupEvent.ENLIST,)))
    assert switch.decided_by == "plan_cover"
    assert end.status == "promoted" and end.spare == "s1"


def test_no_answer_passes_a_spare_over_and_a_refused_switch_covers_nothing() -> None:
    spares = (facts("s0", "standby", spare=True),)
    seen, end = run(
        spare_op.cover("g0"),
        answer_with(spares, {"s0": fx.TimedOut(2.0)}, fx.Ok(())),
    )
    assert end.status == "uncovered" and "did not answer" in end.reason
    assert not any(isinstance(e, (fx.SendGroup, fx.SendGroups)) for e in seen)
    refused = fx.Ok((("s0", "g0 is active"), ("g0", "g0 is active")))
    seen, end = run(spare_op.cover("g0"), answer_with(spares, {"s0": fx.Ok(("3",))}, refused))
    assert end.status == "uncovered" and "refused (g0 is active)" in end.reason
    assert isinstance(seen[-2], fx.UnlockTransport)  # the lock goes back either way


# ---------------------------------------------------------------------- the registry's step
def test_the_registry_sends_a_promotion_and_an_enlisting_both_or_neither() -> None:
    registry = FleetRegistry(fleet_version=0)
    registry.add_group("g0", [0])
    registry.add_group("s0", [1], spare=True)
    for gid, rank in (("g0", 0), ("s0", 1)):
        registry.report_member(gid, rank, healthy=True, weights_version=0)
        registry.send(gid, GroupEvent.LAUNCHED)
    assert (registry.get("g0").state, registry.get("s0").state) == ("active", "standby")
    swap = (("s0", (GroupEvent.PROMOTE,)), ("g0", (GroupEvent.ENLIST,)))
    refused = registry.send_together(swap, all_or_nothing=True)  # g0 still serves
    assert [g for g, _ in refused] == ["s0", "g0"] and "enlist" in refused[0][1]
    assert registry.get("s0").state == "standby" and not registry.get("g0").machine.spare
    registry.send("g0", GroupEvent.FAIL)
    assert registry.send_together(swap, all_or_nothing=True) == []
    assert (registry.get("s0").state, registry.get("g0").state) == ("active", "inactive")
    assert registry.get("g0").machine.spare and not registry.get("s0").machine.spare
    with pytest.raises(InvalidArgument, match="one event per group"):
        registry.send_together(
            (("g0", (GroupEvent.CLAIM, GroupEvent.RETIRE)),), all_or_nothing=True
        )


# ---------------------------------------------------------------------- the model
def test_the_model_covers_a_failed_group_and_the_recovery_refills_the_pool() -> None:
    model = FleetModel(ModelConfig(groups=1, ranks=1, spares=1, node_loss=False, removals=0))
    for action in (Action("launch", (0, 0)), Action("launch", (1, 0))):
        assert model.apply(action), action
    assert [(g.state, g.spare) for g in model.groups] == [("active", False), ("standby", True)]
    assert model.apply(Action("sync", (True, None, "fail")))
    assert model.groups[1].state == "standby"  # kept at the version
    assert model.apply(Action("export_finish"))  # the recovery restarts from v1's export
    assert model.apply(Action("crash", (0, 0)))
    assert model.apply(Action("probe", (0,)))
    assert model.apply(Action("cover", (0,)))
    assert [(g.state, g.spare) for g in model.groups] == [("inactive", True), ("active", False)]
    assert model.apply(Action("recover", (0,)))
    assert model.apply(Action("restart", (0, True)))
    assert model.groups[0].state == "standby"  # back in the pool, never routed
    assert model.check() == []
    (promotion,) = model.audit.promotions
    assert (promotion.group_id, promotion.covered, promotion.reported) == ("g1", "g0", ("1",))


def test_a_spare_whose_rank_died_unnoticed_is_passed_over() -> None:
    model = FleetModel(ModelConfig(groups=1, ranks=1, spares=1, node_loss=False, removals=0))
    for action in (Action("launch", (0, 0)), Action("launch", (1, 0)), Action("crash", (1, 0))):
        assert model.apply(action), action
    assert model.apply(Action("probe_timeout", (0,)))  # g0 failed; the spare looks ready
    assert not model.apply(Action("cover", (0,)))  # its engine does not answer: not promoted
    assert [g.state for g in model.groups] == ["inactive", "standby"]
    assert model.check() == []


def promote_without_the_lock(
    original: Callable[..., Generator[fx.Effect, fx.Outcome, Any]],
) -> Callable[..., Generator[fx.Effect, fx.Outcome, Any]]:
    """The switch changed: the spare is promoted alone, its covered group not enlisted."""

    def rewrite(effect: fx.Effect) -> list[fx.Effect]:
        if isinstance(effect, fx.SendGroups):
            return [fx.SendGroups(effect.events[:1], effect.decided_by, all_or_nothing=True)]
        return [effect]

    return rewritten(original, rewrite)


def test_changing_the_switch_step_changes_what_verify_reports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = ModelConfig(groups=1, ranks=1, spares=1, node_loss=False, removals=0)
    monkeypatch.setattr(spare_op, "cover", promote_without_the_lock(spare_op.cover))
    result = explore(config, depth=6)
    assert not result.ok
    assert "spare_pool_kept" in result.counterexamples[0].format()
