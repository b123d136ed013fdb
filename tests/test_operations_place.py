"""Node loss, re-placement and removal written once (``rollsafe.operations.place``): the steps
driven by hand with scripted outcomes, the verifier's model executing the same steps, and one
changed step changing what ``rollsafe verify`` reports. (The live fleet executes them in
``tests/test_elastic_groups.py`` and ``tests/test_ray_fleet.py``.)"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import pytest
from operations_helpers import rewritten

import rollsafe.operations.effects as fx
from rollsafe.operations import place as place_op
from rollsafe.operations.recover import AttemptEnd
from rollsafe.statemachines import GroupEvent
from rollsafe.verify import Action, FleetModel, ModelConfig, explore


def run(steps: Generator[fx.Effect, fx.Outcome, Any], answer: Callable[[fx.Effect], fx.Outcome]):
    """Drive ``steps``, answering each effect with ``answer``; return (effects, result)."""
    seen: list[fx.Effect] = []

    def perform(effect: fx.Effect) -> fx.Outcome:
        seen.append(effect)
        return answer(effect)

    return seen, fx.drive(steps, perform)


# ---------------------------------------------------------------------- scripted
def test_a_node_loss_sends_every_group_its_event_in_one_step() -> None:
    states = (("a", "active"), ("b", "pending_weights"), ("c", "draining"), ("d", "unplaced"))

    def answer(effect: fx.Effect) -> fx.Outcome:
        if isinstance(effect, fx.ReadStates):
            return fx.Ok(states)
        if isinstance(effect, fx.SendGroups):
            return fx.Ok(())
        return fx.Ok()

    seen, lost = run(place_op.node_lost(("a", "b", "c", "d")), answer)
    sends = [e for e in seen if isinstance(e, fx.SendGroups)]
    assert len(sends) == 1 and not any(isinstance(e, fx.SendGroup) for e in seen)
    assert sends[0].events == (
        ("a", (GroupEvent.NODE_LOST,)),
        ("b", (GroupEvent.NODE_LOST,)),
        ("c", (GroupEvent.RETIRE,)),  # being removed: retired, not placed again
    )
    assert lost == ("a", "b")


def test_a_refused_node_lost_is_not_reported_lost() -> None:
    def answer(effect: fx.Effect) -> fx.Outcome:
        if isinstance(effect, fx.ReadStates):
            return fx.Ok((("a", "active"), ("b", "active")))
        if isinstance(effect, fx.SendGroups):
            return fx.Ok((("b", "moved meanwhile"),))
        return fx.Ok()

    seen, lost = run(place_op.node_lost(("a", "b")), answer)
    assert lost == ("a",)
    note = seen[-1]
    assert isinstance(note, fx.NoteStep) and not note.ok and "moved meanwhile" in note.detail


def facts(state: str, busy: bool = False) -> fx.RecoveryFacts:
    return fx.RecoveryFacts(state, True, True, None, 0.0, busy=busy, budget=1, initial_budget=2)


def test_no_room_leaves_the_group_waiting_and_sends_nothing() -> None:
    def answer(effect: fx.Effect) -> fx.Outcome:
        if isinstance(effect, fx.ReadRecovery):
            return fx.Ok(facts("unplaced"))
        if isinstance(effect, fx.Place):
            return fx.Failed("PlacementUnavailable: 2 bundles, 60 s")
        return fx.Ok()

    seen, end = run(place_op.place("g0"), answer)
    assert isinstance(end, AttemptEnd) and end.status == "unplaced"
    assert "PlacementUnavailable" in end.reason
    assert not any(isinstance(e, fx.SendGroup) for e in seen)


def test_room_sends_placed_and_a_refused_placed_gives_the_placement_back() -> None:
    def answer(refuse: bool) -> Callable[[fx.Effect], fx.Outcome]:
        def reply(effect: fx.Effect) -> fx.Outcome:
            if isinstance(effect, fx.ReadRecovery):
                return fx.Ok(facts("unplaced"))
            if isinstance(effect, fx.Place):
                return fx.Ok("node-2")
            if isinstance(effect, fx.SendGroup):
                return fx.Failed("draining") if refuse else fx.Ok("recovering")
            return fx.Ok()

        return reply

    seen, end = run(place_op.place("g0"), answer(False))
    assert end is None
    assert [type(e) for e in seen] == [fx.ReadRecovery, fx.Place, fx.SendGroup, fx.NoteStep]
    sent = seen[2]
    assert isinstance(sent, fx.SendGroup) and sent.event is GroupEvent.PLACED
    seen, end = run(place_op.place("g0"), answer(True))
    assert end is not None and end.status == "failed"
    assert any(isinstance(e, fx.ReleasePlacement) for e in seen)


@pytest.mark.parametrize(("state", "busy"), [("inactive", False), ("unplaced", True)])
def test_placement_only_of_an_unplaced_group_with_nothing_running(state: str, busy: bool) -> None:
    seen, end = run(
        place_op.place("g0"),
        lambda e: fx.Ok(facts(state, busy)) if isinstance(e, fx.ReadRecovery) else fx.Ok(),
    )
    assert end is not None and end.status in ("not_needed", "failed")
    assert not any(isinstance(e, fx.Place) for e in seen)


def test_a_removal_drains_waits_stops_releases_then_retires() -> None:
    def answer(effect: fx.Effect) -> fx.Outcome:
        if isinstance(effect, fx.ReadStates):
            return fx.Ok((("g0", "active"),))
        if isinstance(effect, fx.AwaitDrained):
            return fx.Ok(2)
        return fx.Ok("ok")

    seen, end = run(place_op.remove("g0"), answer)
    kinds = [type(e).__name__ for e in seen if not isinstance(e, fx.NoteStep)]
    assert kinds == [
        "ReadStates",
        "SendGroup",
        "AwaitDrained",
        "StopEngine",
        "ReleasePlacement",
        "SendGroup",
    ]
    events = [e.event for e in seen if isinstance(e, fx.SendGroup)]
    assert events == [GroupEvent.DRAIN, GroupEvent.RETIRE]
    assert end.status == "retired" and end.cut == 2


# ---------------------------------------------------------------------- the model
SERVING = [Action("launch", (0, 0)), Action("launch", (1, 0))]


def test_a_node_with_both_groups_takes_both_out_at_once_and_each_comes_back() -> None:
    model = FleetModel(ModelConfig(groups=2, ranks=1, restart_budget=1))
    for action in SERVING:
        assert model.apply(action), action
    assert model.apply(Action("sync", (True, None, "fail")))  # the fleet at v1
    assert model.apply(Action("node_dies", ((0, 1),)))
    assert [g.state for g in model.groups] == ["active", "active"]  # not known yet
    assert model.apply(Action("node_lost"))
    assert [g.state for g in model.groups] == ["unplaced", "unplaced"]
    assert not any(g.is_routable for g in model.groups) and model.check() == []
    for g in (0, 1):
        assert model.apply(Action("place", (g,)))
        assert model.apply(Action("restart", (g, True)))
        model.apply(Action("push", (g, True)))
        assert model.groups[g].state == "active", model.groups[g].state
        assert model.groups[g].restart_budget == 1  # a node loss spends no budget
        assert {m.weights_version for m in model.groups[g].members.values()} == {1}
    assert model.check() == []


def test_a_removed_group_is_never_recovered() -> None:
    model = FleetModel(ModelConfig(groups=1, ranks=1))
    assert model.apply(Action("launch", (0, 0)))
    assert model.apply(Action("crash", (0, 0)))
    assert model.apply(Action("probe", (0,)))
    assert model.groups[0].state == "inactive"
    assert model.apply(Action("remove", (0,)))
    assert model.groups[0].state == "draining"
    assert not model.apply(Action("recover", (0,)))
    assert model.apply(Action("finish_removal", (0,)))
    assert model.groups[0].state == "retired" and model.check() == []


def fails_instead_of_node_lost(
    original: Callable[..., Generator[fx.Effect, fx.Outcome, Any]],
) -> Callable[..., Generator[fx.Effect, fx.Outcome, Any]]:
    """The node-loss step changed: its groups are failed like a crash (``fail``), so recovery
    claims them (spending budget) and may restart them on the dead node."""

    def rewrite(effect: fx.Effect) -> list[fx.Effect]:
        if isinstance(effect, fx.SendGroups):
            return [
                fx.SendGroups(
                    tuple((g, (GroupEvent.FAIL,)) for g, _ in effect.events), "judge_probe"
                )
            ]
        return [effect]

    return rewritten(original, rewrite)


def test_changing_the_node_loss_step_changes_what_verify_reports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = ModelConfig(groups=1, ranks=1, removals=0)
    assert explore(config, depth=5).ok
    monkeypatch.setattr(place_op, "node_lost", fails_instead_of_node_lost(place_op.node_lost))
    changed = explore(config, depth=5)
    assert not changed.ok
    cex = changed.counterexamples[0]
    assert "lost_node_groups_wait_unplaced" in {v.invariant for v in cex.violations}
    assert cex.trace[-1] == Action("node_lost")


def test_a_probe_that_sees_a_dead_node_first_still_spends_no_budget() -> None:
    """Probes usually notice a dead node before Ray's node health check: the recovery's gate
    asks the group's actor, finds it gone, and treats it as a node loss (no claim)."""
    model = FleetModel(ModelConfig(groups=1, ranks=1, restart_budget=1))
    assert model.apply(Action("launch", (0, 0)))
    assert model.apply(Action("sync", (True, None, "fail")))  # the fleet at v1
    assert model.apply(Action("node_dies", ((0,),)))
    assert model.apply(Action("probe", (0,)))
    assert model.groups[0].state == "inactive"
    assert model.apply(Action("recover", (0,)))
    assert model.groups[0].state == "unplaced" and model.groups[0].restart_budget == 1
    assert model.apply(Action("node_lost"))  # the watcher's later report changes no state
    assert model.groups[0].state == "unplaced" and model.check() == []
    assert model.apply(Action("place", (0,)))
    assert model.apply(Action("restart", (0, True)))  # on dummy weights: pending_weights
    assert model.apply(Action("push", (0, True)))
    assert model.groups[0].state == "active" and model.groups[0].restart_budget == 1
    assert model.check() == []
