"""The health probe written once (``rollsafe.operations.probe``): its steps driven by hand with
scripted outcomes, the ``HealthManager`` executing them, and one changed step changing what
``rollsafe verify`` reports and what the fleet does.

The first part answers each effect the sequence yields from a script (no I/O, no machines) and
asserts the effects it yields and the result it returns. The second part runs the manager on a
registry with a scripted probe function (no engines) and the model's ``probe_timeout`` action.
The third patches the sequence (after failing the group, the probe begins its recovery itself,
on the probe thread): the verifier finds ``recovery_never_on_health_thread`` broken, and the
fleet's probe executor, which has no handler for a recovery's effects, refuses it; the
unpatched sequence is clean in both.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import pytest
from fleet_sim import make_fleet

import rollsafe.operations.effects as fx
import rollsafe.policy as policy
from rollsafe.fleet.health import GroupFailure, HealthManager
from rollsafe.operations import probe as probe_op
from rollsafe.operations import recover as recover_op
from rollsafe.operations.probe import ProbeEnd
from rollsafe.registry import WorkerGroup
from rollsafe.statemachines import GroupEvent
from rollsafe.verify import Action, FleetModel, ModelConfig, explore

WAIT_S = 15.0  # bound for waiting on a condition; never asserted as a duration
RANKS = (4, 5)
FACTS = fx.ProbeFacts(RANKS, {}, {4: True, 5: True})

Script = Mapping[type[fx.Effect], Callable[[Any], fx.Outcome]]


def run(
    answer: fx.Outcome, facts: fx.ProbeFacts | None = FACTS, *, threshold: int = 2, **script: Any
) -> tuple[list[fx.Effect], ProbeEnd]:
    """Drive one probe of ``g2`` by hand: the probe answers ``answer``, the facts read are
    ``facts``; every other effect ``Ok()`` (or ``script[EffectName]``)."""
    answers: dict[type[fx.Effect], Callable[[Any], fx.Outcome]] = {
        fx.ProbeMembers: lambda e: answer,
        fx.ReadProbeFacts: lambda e: fx.Ok(facts),
    }
    answers.update({getattr(fx, name): fn for name, fn in script.items()})
    seen: list[fx.Effect] = []

    def perform(effect: fx.Effect) -> fx.Outcome:
        seen.append(effect)
        found = answers.get(type(effect))
        return found(effect) if found is not None else fx.Ok()

    return seen, fx.drive(probe_op.probe("g2", threshold), perform)


def kinds(effects: list[fx.Effect]) -> list[str]:
    return [type(e).__name__ for e in effects]


def reports(effects: list[fx.Effect]) -> list[tuple[int, bool]]:
    return [(e.rank, e.healthy) for e in effects if isinstance(e, fx.ReportRank)]


def counts(effects: list[fx.Effect]) -> list[Mapping[int, int]]:
    return [e.counts for e in effects if isinstance(e, fx.SetFailureCounts)]


# ====================================================================== scripted outcomes
def test_a_healthy_answer_applies_under_the_lock_and_sends_nothing() -> None:
    effects, end = run(fx.Ok(fx.Probed()), replace(FACTS, counts={4: 1}))
    assert kinds(effects) == [
        "ProbeMembers",
        "LockHealth",
        "ReadProbeFacts",
        "SetFailureCounts",
        "UnlockHealth",
    ]
    assert counts(effects) == [{}]  # the healthy answer reset rank 4's count
    assert end == ProbeEnd(applied=True, failed=False)


def test_a_healthy_answer_reports_recorded_unhealthy_ranks_healthy() -> None:
    effects, _ = run(fx.Ok(fx.Probed()), replace(FACTS, recorded_healthy={4: True, 5: False}))
    assert reports(effects) == [(5, True)]


def test_below_the_threshold_a_failure_is_only_counted() -> None:
    effects, end = run(fx.Ok(fx.Probed((5,), "rank 5 unhealthy")))
    assert counts(effects) == [{5: 1}] and reports(effects) == []
    assert not any(isinstance(e, fx.SendGroup) for e in effects)
    assert end == ProbeEnd(applied=True, failed=False)


def test_at_the_threshold_the_group_is_failed_then_handed_over_in_this_order() -> None:
    effects, end = run(fx.Ok(fx.Probed((5,), "rank 5 unhealthy")), replace(FACTS, counts={5: 1}))
    assert kinds(effects)[3:] == [
        "ReportRank",
        "SetFailureCounts",
        "UnlockHealth",  # the fail is sent outside the lock
        "SendGroup",
        "GroupFailed",
    ]
    assert reports(effects) == [(5, False)] and counts(effects) == [{}]
    send = effects[-2]
    assert isinstance(send, fx.SendGroup)
    assert (send.group, send.event, send.decided_by) == ("g2", GroupEvent.FAIL, "judge_probe")
    assert send.reason == "rank 5 unhealthy"  # kept with the fail's transition
    failed = effects[-1]
    assert failed == fx.GroupFailed("g2", (5,), 2, "rank 5 unhealthy", policy.Handoff.ENQUEUE)
    assert end == ProbeEnd(applied=True, failed=True)


@pytest.mark.parametrize(
    "answer",
    [fx.TimedOut(3.0, "no answer within 3.0s"), fx.Failed("EngineUnavailable: refused")],
    ids=["timed_out", "failed"],
)
def test_a_time_out_or_a_failure_counts_against_every_rank(answer: fx.Outcome) -> None:
    effects, _ = run(answer)
    assert counts(effects) == [{4: 1, 5: 1}]
    effects, end = run(answer, replace(FACTS, counts={4: 1, 5: 1}))
    assert reports(effects) == [(4, False), (5, False)]
    failed = effects[-1]
    assert isinstance(failed, fx.GroupFailed)
    assert failed.unhealthy == RANKS and failed.reason == answer.error
    assert end.failed


def test_nothing_is_applied_while_paused() -> None:
    effects, end = run(fx.Failed("boom"), None, threshold=1)
    assert kinds(effects) == ["ProbeMembers", "LockHealth", "ReadProbeFacts", "UnlockHealth"]
    assert end == ProbeEnd(applied=False, failed=False)


def test_an_answer_about_a_group_that_moved_only_forgets_its_counts() -> None:
    effects, end = run(fx.Failed("boom"), replace(FACTS, counts={4: 1}, moved=True), threshold=1)
    assert kinds(effects)[3:] == ["SetFailureCounts", "UnlockHealth"]
    assert counts(effects) == [{}]
    assert end == ProbeEnd(applied=False, failed=False)


def test_a_refused_fail_is_not_handed_over() -> None:
    refused = {"SendGroup": lambda e: fx.Failed("TransitionRefused: g2 is inactive")}
    effects, end = run(fx.Failed("boom"), threshold=1, **refused)
    assert kinds(effects)[-1] == "SendGroup"
    assert end == ProbeEnd(applied=True, failed=False)


# ====================================================================== the two executors
def test_the_health_manager_runs_the_sequence_once_per_probed_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[tuple[str, str]] = []
    original = probe_op.probe

    def traced(group: str, threshold: int) -> probe_op.Steps:
        steps = original(group, threshold)
        effect = next(steps)
        while True:
            seen.append((group, type(effect).__name__))
            outcome = yield effect
            try:
                effect = steps.send(outcome)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]

    monkeypatch.setattr(probe_op, "probe", traced)
    reg, _ = make_fleet((1, 1))
    answers: dict[str, bool] = {"g0": True, "g1": False}
    hm = HealthManager(reg, lambda group, _t: answers[group.group_id], failure_threshold=1)
    try:
        r = hm.check_now()
    finally:
        assert hm.stop()
    assert r.failed_groups == ("g1",) and reg.get("g1").state == "inactive"
    # the fail's transition keeps what the probe saw (a recorded run's fail row says why)
    fail = [t for t in reg.get("g1").machine.history if t.event == "fail"]
    assert len(fail) == 1
    inputs = dict(fail[0].inputs)
    assert (inputs["decided_by"], inputs["reason"]) == ("judge_probe", "probe answered unhealthy")
    assert [k for g, k in seen if g == "g0"] == [
        "ProbeMembers",
        "LockHealth",
        "ReadProbeFacts",
        "SetFailureCounts",
        "UnlockHealth",
    ]
    g1 = [k for g, k in seen if g == "g1"]
    assert g1[-3:] == ["UnlockHealth", "SendGroup", "GroupFailed"]


def test_the_health_manager_answers_a_hung_probe_with_a_time_out() -> None:
    reg, _ = make_fleet((1,))
    gate = threading.Event()
    failures: queue.Queue[GroupFailure] = queue.Queue()

    def hangs(_group: WorkerGroup, _timeout: float) -> bool:
        gate.wait(WAIT_S)
        return True

    hm = HealthManager(reg, hangs, timeout_s=0.2, failure_threshold=1, on_group_failed=failures.put)
    try:
        r = hm.check_now()
        assert r.timed_out == ("g0",) and r.failed_groups == ("g0",)
        failure = failures.get(timeout=WAIT_S)
        assert failure.reason == "no answer within 0.2s" and failure.unhealthy_ranks == (0,)
    finally:
        gate.set()
        assert hm.stop()


def test_the_model_chooses_a_probe_time_out() -> None:
    """A probe that times out fails a group whose engines are all alive (threshold 1)."""
    model = FleetModel(ModelConfig(groups=1, ranks=2))
    for r in (0, 1):
        assert model.apply(Action("launch", (0, r)))
    assert model.groups[0].state == "active"
    assert not model.apply(Action("probe", (0,)))  # alive and healthy: changes nothing
    assert model.apply(Action("probe_timeout", (0,)))
    assert model.groups[0].state == "inactive"
    assert all(alive for alive, _ in model.truth[0])
    assert [m.healthy for m in model.groups[0].members.values()] == [False, False]
    assert model.check() == []


# ====================================================================== one changed step
def recovers_inline(original: Callable[..., fx.Steps[ProbeEnd]]) -> Callable[..., Any]:
    """The sequence with one step changed: after failing the group, the probe begins its
    recovery itself (a claim, on the probe thread) instead of only queueing it."""

    def changed(group: str, threshold: int) -> fx.Steps[ProbeEnd]:
        end = yield from original(group, threshold)
        if end.failed:
            yield from recover_op.claim(group)
        return end

    return changed


def test_changing_one_step_changes_what_verify_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    config = ModelConfig(groups=1, ranks=1, engine="reference", node_loss=False, removals=0)
    clean = explore(config, depth=3)
    assert clean.ok and clean.complete
    monkeypatch.setattr(probe_op, "probe", recovers_inline(probe_op.probe))
    changed = explore(config, depth=3)
    assert not changed.ok
    cex = changed.counterexamples[0]
    assert "recovery_never_on_health_thread" in {v.invariant for v in cex.violations}
    assert cex.trace[-1].name in ("probe", "probe_timeout")


def test_the_fleet_cannot_run_the_changed_step(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The fleet's probe executor has no handler for a recovery's effects: the changed
    sequence fails the group (queued for recovery as before), its inline claim is refused by
    the executor (``OperationError``, logged) and no recovery step runs on the probe loop; the
    manager keeps probing."""

    def run_once() -> tuple[str, list[str], int]:
        reg, _ = make_fleet((1,))
        threads: queue.Queue[str] = queue.Queue()
        hm = HealthManager(
            reg,
            lambda _group, _t: False,
            failure_threshold=1,
            on_group_failed=lambda _f: threads.put(threading.current_thread().name),
            name="hm",
        ).start()
        try:
            thread = threads.get(timeout=WAIT_S)
            rounds = hm.rounds
            deadline = time.monotonic() + WAIT_S
            while hm.rounds < rounds + 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            events = [t.event for t in reg.get("g0").machine.history]
            return thread, events, hm.rounds - rounds
        finally:
            assert hm.stop()

    thread, events, more = run_once()
    assert thread == "hm-notify" and "fail" in events and "claim" not in events and more >= 2
    monkeypatch.setattr(probe_op, "probe", recovers_inline(probe_op.probe))
    with caplog.at_level("ERROR"):
        thread, events, more = run_once()
    assert thread == "hm-notify"  # queued for the recovery coordinator, as before
    assert "fail" in events and "claim" not in events  # no recovery began on the probe loop
    assert more >= 2  # the manager keeps probing
    assert any("cannot perform ReadRecovery" in r.getMessage() for r in caplog.records)
