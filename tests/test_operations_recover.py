"""The recovery attempt written once (``rollsafe.operations.recover``): its steps driven by hand
with scripted outcomes, the verifier executing the same steps, and one changed step changing
what ``rollsafe verify`` reports.

The first part answers each effect the attempt yields from a script (no I/O, no machines) and
asserts the effects it yields and how it ends, branch by branch: the gate, the claim, the
strategy and lease, every restart step failing or timing out (the lease is always released;
by a restart that timed out only once it has ended), the targeted push (loaded, deferred,
poisoned, cut short, refused). The second part runs the model: a restart that times out while
holding its export's lease keeps the export from deletion until the restart ends, and a
sequence changed to forget that lease on a time-out is reported by the verifier
(``leases_held_by_recoveries``), as is one that reports the pushed version before the push
(``recorded_versions_are_true``); the fleet's ``RecoveryCoordinator`` runs the same changed
step (its export keeps a leaked lease).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Mapping
from pathlib import Path
from typing import Any

import pytest
from operations_helpers import rewritten
from test_fleet_recovery import WAIT_S, SimFleet, fail_group

import rollsafe.operations.effects as fx
import rollsafe.policy as policy
from rollsafe.operations import recover as recover_op
from rollsafe.operations.recover import AttemptEnd
from rollsafe.statemachines import GroupEvent
from rollsafe.verify import Action, FleetModel, ModelConfig, explore

GID = "g0"
VLLM = policy.engine_traits("vllm")  # keeps no known weights after a failed update
KEEPS = policy.engine_traits("reference", "sglang")  # keeps its old weights
LEASE = fx.Leased(3, "/exports/v3", token="lease-3")

Script = Mapping[type[fx.Effect], Callable[[Any], fx.Outcome]]


def facts(state: str = "inactive", **kw: Any) -> fx.RecoveryFacts:
    values: dict[str, Any] = {
        "budget_left": True,
        "complete": True,
        "remaining_s": None,
        "expected_s": 0.0,
        "budget": 1,
        "initial_budget": 2,
    }
    values.update(kw)
    return fx.RecoveryFacts(state, **values)


class Group:
    """The group's state as the script's answers move it (claim, restarted, ...)."""

    def __init__(self, state: str = "inactive", **facts_kw: Any) -> None:
        self.state = state
        self.facts_kw = facts_kw

    def read(self, _effect: fx.ReadRecovery) -> fx.Outcome:
        return fx.Ok(facts(self.state, **self.facts_kw))

    def send(self, effect: fx.SendGroup, restarted_to: str) -> fx.Outcome:
        moves = {
            GroupEvent.CLAIM: "recovering",
            GroupEvent.RETIRE: "retired",
            GroupEvent.RESTARTED: restarted_to,
            GroupEvent.RESTART_FAILED: "inactive",
            GroupEvent.WEIGHTS_LOADED: "active",
            GroupEvent.FAIL: "inactive",
        }
        self.state = moves[effect.event]
        return fx.Ok(self.state)


def ready_export(version: int = 3) -> fx.Outcome:
    return fx.Ok(fx.StrategyFacts("enabled", version, policy.ExportFacts(version, "ready"), True))


def run(
    script: Script | None = None,
    *,
    group: Group | None = None,
    traits: policy.EngineTraits = VLLM,
    retried: bool = False,
    restarted_to: str | None = None,
) -> tuple[list[fx.Effect], AttemptEnd]:
    """Drive one attempt on GID by hand: each effect answered by ``script`` (else a clean
    answer: the group moves as its events say, an export of v3 is ready, the push loads)."""
    grp = group or Group()
    default: dict[type[fx.Effect], Callable[[Any], fx.Outcome]] = {
        fx.ReadRecovery: grp.read,
        fx.ReadStrategy: lambda e: ready_export(),
        fx.TakeLease: lambda e: fx.Ok(fx.Leased(e.version, f"/exports/v{e.version}", "lease")),
        fx.ReadPushFacts: lambda e: fx.Ok(fx.PushFacts(("ckpt", 3), 3, grp.state)),
        fx.TargetedPush: lambda e: fx.Ok(fx.Pushed({0: True, 1: True})),
    }
    answers = {**default, **(script or {})}
    seen: list[fx.Effect] = []

    def perform(effect: fx.Effect) -> fx.Outcome:
        seen.append(effect)
        if isinstance(effect, fx.PushUnderLock) and fx.PushUnderLock not in answers:
            return fx.Ok(
                fx.drive(recover_op.push_locked(effect.group, effect.keeps_weights), perform)
            )
        if isinstance(effect, fx.SendGroup) and fx.SendGroup not in answers:
            to = restarted_to or (
                "active" if any(isinstance(e, fx.TakeLease) for e in seen) else "pending_weights"
            )
            return grp.send(effect, to)
        answer = answers.get(type(effect))
        return answer(effect) if answer is not None else fx.Ok()

    return seen, fx.drive(recover_op.attempt(GID, traits, retried=retried), perform)


def kinds(effects: list[fx.Effect]) -> list[str]:
    return [type(e).__name__ for e in effects]


def sends(effects: list[fx.Effect]) -> list[GroupEvent]:
    return [e.event for e in effects if isinstance(e, fx.SendGroup)]


def notes(effects: list[fx.Effect]) -> list[tuple[str, bool]]:
    return [(e.name, e.ok) for e in effects if isinstance(e, fx.NoteStep)]


def releases(effects: list[fx.Effect]) -> list[fx.ReleaseLease]:
    return [e for e in effects if isinstance(e, fx.ReleaseLease)]


# ====================================================================== the whole attempt
def test_an_immediate_recovery_restarts_from_the_leased_export() -> None:
    effects, end = run()
    assert kinds(effects) == [
        "ReadRecovery",
        "SendGroup",
        "ReadRecovery",
        "NoteStep",  # gate, claim
        "ReadStrategy",
        "TakeLease",
        "NoteStep",  # strategy, lease
        "GetEngine",
        "StopEngine",
        "Restart",
        "AwaitHealthy",
        "ReportMembers",
        "SendGroup",
        "NoteStep",
        "ReleaseLease",
    ]
    assert fx.Restart(GID, "/exports/v3", 3) in effects
    assert fx.ReportMembers(GID, 3, healthy=True) in effects  # the export's version
    assert sends(effects) == [GroupEvent.CLAIM, GroupEvent.RESTARTED]
    assert notes(effects) == [("claim", True), ("lease", True), ("restarted", True)]
    assert releases(effects) == [fx.ReleaseLease(fx.Leased(3, "/exports/v3"))]
    assert end == AttemptEnd("active", "restarted from the ready export of v3", "immediate", 3)


def test_without_a_ready_export_it_restarts_on_dummy_weights_and_pushes() -> None:
    effects, end = run({fx.ReadStrategy: lambda e: fx.Ok(None)})  # no mode / exporter
    assert fx.Restart(GID, None, None) in effects and fx.Restart(GID).dummy
    assert fx.ReportMembers(GID, None, healthy=True) in effects  # no known version
    assert not any(isinstance(e, fx.TakeLease | fx.ReleaseLease) for e in effects)
    push = kinds(effects).index("PushUnderLock")
    assert kinds(effects)[push:] == [
        "PushUnderLock",
        "ReadPushFacts",
        "TargetedPush",
        "ReportMembers",
        "SendGroup",
    ]
    assert fx.TargetedPush(GID, 3) in effects and fx.ReportMembers(GID, 3) in effects
    assert sends(effects) == [GroupEvent.CLAIM, GroupEvent.RESTARTED, GroupEvent.WEIGHTS_LOADED]
    assert end == AttemptEnd("active", "targeted push of v3 loaded", "targeted_push")


@pytest.mark.parametrize(
    ("export", "why"),
    [
        (policy.ExportFacts(3, "writing"), "export v3 is writing, fleet at v3"),
        (policy.ExportFacts(2, "ready"), "export v2 is ready, fleet at v3"),
        (None, "no export of v3"),
    ],
)
def test_no_lease_unless_the_current_export_is_ready(
    export: policy.ExportFacts | None, why: str
) -> None:
    strategy = fx.StrategyFacts("enabled", 3, export, True)
    effects, end = run({fx.ReadStrategy: lambda e: fx.Ok(strategy)})
    assert not any(isinstance(e, fx.TakeLease) for e in effects)
    assert fx.NoteStep("lease", False, why) in effects and fx.Restart(GID) in effects
    assert end.status == "active" and end.strategy == "targeted_push"


def test_a_lease_refused_falls_back_to_a_dummy_restart() -> None:
    effects, end = run({fx.TakeLease: lambda e: fx.Failed("LeaseError: superseded")})
    assert fx.NoteStep("lease", False, "LeaseError: superseded") in effects
    assert fx.Restart(GID) in effects and not releases(effects)
    assert end.strategy == "targeted_push"


# ====================================================================== the gate
@pytest.mark.parametrize(
    ("group", "retried", "status", "reason", "noted"),
    [
        (Group(busy=True), False, "failed", "still running in the background", []),
        (Group("active"), False, "not_needed", "group is active, not inactive", []),
        (Group("active"), True, "failed", "group left inactive meanwhile (active)", []),
        (
            Group(remaining_s=1.0, expected_s=5.0),
            False,
            "skipped",
            "rollout about to finish",
            [("skip", True)],
        ),
        (
            Group(complete=False),
            False,
            "failed",
            "claim refused: a rank of the group is unknown",
            [("claim", False)],
        ),
        (
            Group(budget_left=False),
            False,
            "retired",
            "restart budget of 2 spent; retired",
            [("claim", False), ("retire", True)],
        ),
    ],
)
def test_the_gate_ends_the_attempt_before_any_restart(
    group: Group, retried: bool, status: str, reason: str, noted: list[tuple[str, bool]]
) -> None:
    effects, end = run(group=group, retried=retried)
    assert end.status == status and reason in end.reason and not end.retry
    assert notes(effects) == noted
    assert not any(isinstance(e, fx.GetEngine | fx.TakeLease) for e in effects)
    assert sends(effects) == ([GroupEvent.RETIRE] if status == "retired" else [])


def test_a_refused_claim_ends_the_attempt() -> None:
    effects, end = run({fx.SendGroup: lambda e: fx.Failed("claim refused by the guard")})
    assert end.status == "failed" and end.reason == "claim refused: claim refused by the guard"
    assert notes(effects) == [("claim", False)] and kinds(effects)[-1] == "NoteStep"


# ====================================================================== the restart
@pytest.mark.parametrize("step", [fx.GetEngine, fx.StopEngine, fx.Restart, fx.AwaitHealthy])
@pytest.mark.parametrize("outcome", [fx.Failed("OSError: boom"), fx.TimedOut(5.0, "late")])
def test_a_failed_restart_step_sends_restart_failed_and_releases_the_lease(
    step: type[fx.Effect], outcome: fx.Outcome
) -> None:
    effects, end = run({step: lambda e: outcome})
    after = effects[[type(e) for e in effects].index(step) + 1 :]
    assert kinds(after) == ["ReadRecovery", "SendGroup", "ReleaseLease"]
    assert sends(after) == [GroupEvent.RESTART_FAILED]
    timed_out = isinstance(outcome, fx.TimedOut)
    # only a restart that timed out may still be loading from the export: released when it ends
    (release,) = releases(effects)
    assert release.once_restart_ends is (timed_out and step is fx.Restart)
    assert end.status == "failed" and end.reason == outcome.error  # type: ignore[union-attr]
    assert end.retry is not timed_out and end.timed_out is timed_out
    assert end.strategy == "immediate" and end.export_version == 3


def test_a_failed_dummy_restart_has_no_lease_to_release() -> None:
    script: Script = {
        fx.ReadStrategy: lambda e: fx.Ok(None),
        fx.Restart: lambda e: fx.TimedOut(5.0),
    }
    effects, end = run(script)
    assert not releases(effects) and sends(effects)[-1] is GroupEvent.RESTART_FAILED
    assert end.timed_out and end.strategy == "targeted_push" and end.reason == "timed out after 5s"


def test_restart_failed_is_not_sent_to_a_group_that_moved_meanwhile() -> None:
    group = Group()

    def restart_and_move(_effect: fx.Restart) -> fx.Outcome:
        group.state = "retired"  # a racing sender moved it while the restart ran
        return fx.Failed("boom")

    effects, end = run({fx.Restart: restart_and_move}, group=group)
    assert sends(effects) == [GroupEvent.CLAIM] and len(releases(effects)) == 1
    assert end.status == "failed" and end.retry


def test_a_refused_restarted_fails_the_attempt_and_releases_the_lease() -> None:
    group = Group()

    def refuse_restarted(effect: fx.SendGroup) -> fx.Outcome:
        if effect.event is GroupEvent.RESTARTED:
            return fx.Failed("a member is unhealthy")
        return group.send(effect, "active")

    effects, end = run({fx.SendGroup: refuse_restarted}, group=group)
    assert fx.NoteStep("restarted", False, "a member is unhealthy") in effects
    assert sends(effects)[-1] is GroupEvent.RESTART_FAILED and len(releases(effects)) == 1
    assert end.reason == "restarted refused: a member is unhealthy" and end.retry


# ====================================================================== the targeted push
NO_EXPORT: Script = {fx.ReadStrategy: lambda e: fx.Ok(None)}


def test_without_a_transport_the_group_is_deferred() -> None:
    effects, end = run(NO_EXPORT, group=Group(can_push=False))
    assert not any(isinstance(e, fx.PushUnderLock) for e in effects)
    assert fx.NoteStep("push", False, "no transport for a targeted push") in effects
    assert end == AttemptEnd(
        "pending_weights", "deferred to the next sync: no transport for a targeted push", "deferred"
    )


def test_no_registered_checkpoint_of_the_fleet_version_defers() -> None:
    script = {
        **NO_EXPORT,
        fx.ReadPushFacts: lambda e: fx.Ok(fx.PushFacts(None, 3, "pending_weights")),
    }
    effects, end = run(script)
    assert not any(isinstance(e, fx.TargetedPush) for e in effects)
    assert end.status == "pending_weights" and "no registered checkpoint of v3" in end.reason


def test_a_failed_push_on_an_engine_that_loses_weights_restarts_it() -> None:
    script = {
        **NO_EXPORT,
        fx.TargetedPush: lambda e: fx.Ok(fx.Pushed({0: True, 1: False}, "r1 oom")),
    }
    effects, end = run(script, traits=VLLM)
    assert sends(effects)[-1] is GroupEvent.FAIL
    assert not any(isinstance(e, fx.ReportMembers) and e.weights_version == 3 for e in effects)
    assert end.status == "failed" and end.retry and "keeps no known weights" in end.reason
    assert "r1 oom" in end.reason and "vllm" in end.reason


def test_a_failed_push_on_an_engine_that_keeps_weights_waits_for_the_next_sync() -> None:
    script = {
        **NO_EXPORT,
        fx.TargetedPush: lambda e: fx.Ok(fx.Pushed({0: True, 1: False}, "r1 oom")),
    }
    effects, end = run(script, traits=KEEPS)
    assert GroupEvent.FAIL not in sends(effects)
    assert fx.NoteStep("push", False, "push failed: r1 oom") in effects
    assert end.status == "pending_weights" and end.strategy == "deferred"


@pytest.mark.parametrize("outcome", [fx.Failed("step 'push': OSError: reset"), fx.TimedOut(9.0)])
@pytest.mark.parametrize("traits", [VLLM, KEEPS], ids=["loses", "keeps"])
def test_a_push_cut_short(outcome: fx.Outcome, traits: policy.EngineTraits) -> None:
    effects, end = run({**NO_EXPORT, fx.PushUnderLock: lambda e: outcome}, traits=traits)
    timed_out = isinstance(outcome, fx.TimedOut)
    if traits.failed_update_keeps_weights:  # up on dummy weights, not routable: next sync
        assert GroupEvent.FAIL not in sends(effects) and end.status == "pending_weights"
        assert not any(n == "push" for n, _ in notes(effects))  # the executor timed the step
    else:  # its weights are unknown: restart it
        assert sends(effects)[-1] is GroupEvent.FAIL and end.status == "failed"
        assert "its weights are unknown, restarting" in end.reason
        assert end.retry is not timed_out and end.timed_out is timed_out


def test_a_transport_that_cannot_push_to_one_group_defers() -> None:
    refused = fx.Ok(fx.Pushed({}, "P2PUnavailable: no RDMA", refused=True))
    effects, end = run({**NO_EXPORT, fx.TargetedPush: lambda e: refused}, traits=VLLM)
    assert GroupEvent.FAIL not in sends(effects) and not any(n == "push" for n, _ in notes(effects))
    assert end == AttemptEnd(
        "pending_weights", "deferred to the next sync: P2PUnavailable: no RDMA", "deferred"
    )


def test_a_sync_that_updated_the_group_meanwhile_makes_it_active() -> None:
    group = Group()

    def synced(effect: fx.ReadPushFacts) -> fx.Outcome:
        group.state = "active"  # a sync updated it while the push waited for the lock
        return fx.Ok(fx.PushFacts(("ckpt", 3), 3, group.state))

    effects, end = run({**NO_EXPORT, fx.ReadPushFacts: synced}, group=group)
    assert not any(isinstance(e, fx.TargetedPush) for e in effects)
    assert fx.NoteStep("push", False, "group moved to active") in effects
    assert end == AttemptEnd("active", "updated by a sync (group moved to active)", "deferred")


# ====================================================================== the verifier executes it
def held_leases(model: FleetModel, version: int) -> int:
    return len(model.exports[version].leases)


IMMEDIATE = [
    Action("launch", (0, 0)),
    Action("sync", (True, None, "fail")),
    Action("export_finish"),
    Action("crash", (0, 0)),
    Action("probe", (0,)),
    Action("recover", (0,)),
]


def test_a_restart_that_times_out_holds_its_lease_until_it_ends() -> None:
    model = FleetModel(ModelConfig(groups=1, ranks=1))
    for action in IMMEDIATE:
        assert model.apply(action), action
    assert model.groups[0].state == "recovering" and held_leases(model, 1) == 1
    assert model.apply(Action("restart_timeout", (0,)))
    assert model.groups[0].state == "inactive" and held_leases(model, 1) == 1
    assert model.check() == []
    # the export is not deleted under the loading engine, and no recovery claims the group
    assert not model.apply(Action("recover", (0,)))
    snap = model.snapshot()
    model.restore(model.snapshot())
    assert model.snapshot() == snap and held_leases(model, 1) == 1
    assert model.apply(Action("restart_ends", (0,)))
    assert held_leases(model, 1) == 0 and model.check() == []
    assert model.apply(Action("recover", (0,)))  # claimed again
    assert model.groups[0].state == "recovering"


def forgets_the_lease_on_a_time_out(
    original: Callable[..., Generator[fx.Effect, fx.Outcome, AttemptEnd | None]],
) -> Callable[..., Generator[fx.Effect, fx.Outcome, AttemptEnd | None]]:
    """The restart phase with one step changed: a restart that timed out never releases its
    lease (the case only the fleet had before the attempt was written once)."""

    def rewrite(effect: fx.Effect) -> list[fx.Effect] | fx.Outcome:
        if isinstance(effect, fx.ReleaseLease) and effect.once_restart_ends:
            return fx.Ok()  # skipped
        return [effect]

    return rewritten(original, rewrite)


def reports_before_the_push(
    original: Callable[..., Generator[fx.Effect, fx.Outcome, Any]],
) -> Callable[..., Generator[fx.Effect, fx.Outcome, Any]]:
    """The locked push with one step changed: the members report the pushed version before
    the push has loaded it (marking the weights loaded too early)."""

    def rewrite(effect: fx.Effect) -> list[fx.Effect]:
        if isinstance(effect, fx.TargetedPush):
            return [fx.ReportMembers(effect.group, effect.version), effect]
        return [effect]

    return rewritten(original, rewrite)


def test_changing_one_step_changes_what_verify_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    config = ModelConfig(groups=1, ranks=1, node_loss=False, removals=0)
    clean = explore(config, depth=7)
    assert clean.ok and clean.complete
    monkeypatch.setattr(recover_op, "restart", forgets_the_lease_on_a_time_out(recover_op.restart))
    changed = explore(config, depth=7)
    assert not changed.ok
    cex = changed.counterexamples[0]
    assert "leases_held_by_recoveries" in {v.invariant for v in cex.violations}
    assert cex.trace[-1] == Action("restart_timeout", (0,))


def test_reporting_before_the_push_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    config = ModelConfig(
        groups=1, ranks=1, engine="reference", node_loss=False, removals=0
    )  # a failed push keeps it pending
    assert explore(config, depth=7).ok
    monkeypatch.setattr(recover_op, "push_locked", reports_before_the_push(recover_op.push_locked))
    changed = explore(config, depth=7)
    assert not changed.ok
    cex = changed.counterexamples[0]
    assert "recorded_versions_are_true" in {v.invariant for v in cex.violations}
    assert cex.trace[-1] == Action("push", (0, False))


def test_the_fleet_runs_the_same_changed_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def hung_restart_then_recovered(root: Path) -> int:
        """g0's restart from the export hangs past its deadline, then ends; g0 is recovered
        again. Returns the leases left on the export."""
        sim = SimFleet(root)
        try:
            sim.export_ready(1)
            sim.register(1)
            record = sim.exporter.latest_ready(1)
            assert record is not None
            gate = threading.Event()
            sim.handles["g0"].gate = gate
            rc = sim.coordinator(recovery_timeout_s=0.5, retry=False)
            fail_group(sim.reg, "g0")
            result = rc.submit("g0").result(WAIT_S)
            assert result.status == "failed" and "did not finish" in result.reason
            assert len(record.lifecycle.leases) == 1  # the background restart still loads
            sim.handles["g0"].gate = None
            gate.set()
            deadline = time.monotonic() + WAIT_S
            while rc.submit("g0").result(WAIT_S).status != "active":  # busy until it ends
                assert time.monotonic() < deadline
                time.sleep(0.05)
            return len(record.lifecycle.leases)
        finally:
            sim.close()

    assert hung_restart_then_recovered(tmp_path / "clean") == 0
    monkeypatch.setattr(recover_op, "restart", forgets_the_lease_on_a_time_out(recover_op.restart))
    assert hung_restart_then_recovered(tmp_path / "changed") == 1  # the changed step ran
