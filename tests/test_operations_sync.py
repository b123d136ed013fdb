"""The sync written once (``rollsafe.operations.sync``): its steps driven by hand with scripted
outcomes, and one changed step changing what ``rollsafe verify`` reports and what the fleet does.

The first part answers each effect the sequence yields from a script (no I/O, no machines) and
asserts the effects it yields and the result it returns. The second part patches the sequence
(every targeted group records N before the update's outcome is settled) and shows that both
executors run the patched steps: the verifier finds ``recorded_versions_are_true`` broken and a
simulated fleet records a version its failed group does not hold; the unpatched sequence is
clean in both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest
from fleet_sim import make_fleet
from operations_helpers import rewritten
from test_fleet_sync import MemoryTransport, tensors, versions

import rollsafe.operations.effects as fx
import rollsafe.policy as policy
from rollsafe.fleet.sync import SyncCoordinator
from rollsafe.operations import sync as sync_op
from rollsafe.operations.sync import SyncResult
from rollsafe.statemachines import GroupEvent, ModeEvent
from rollsafe.verify import ModelConfig, explore

VERSION = 2
FACTS = (
    policy.GroupFacts("g0", "active", (0, 1)),
    policy.GroupFacts("g1", "active", (2, 3)),
    policy.GroupFacts("g2", "pending_weights", (4,)),
    policy.GroupFacts("g3", "recovering", (5,)),
)

Script = Mapping[type[fx.Effect], Callable[[Any], fx.Outcome]]


def all_loaded(effect: fx.Update) -> fx.Outcome:
    return fx.Ok(fx.UpdateDone({g.group_id: dict.fromkeys(g.ranks, True) for g in effect.groups}))


DEFAULT: Script = {
    fx.ObserveExport: lambda e: fx.Ok(None),
    fx.Register: lambda e: fx.Ok(("ckpt", e.version)),
    fx.ReadGroups: lambda e: fx.Ok(FACTS),
    fx.PrepareTargets: lambda e: fx.Ok({}),
    fx.Update: all_loaded,
    fx.StartExport: lambda e: fx.Ok(True),
}


def run(
    script: Script | None = None, *, facts: tuple[policy.GroupFacts, ...] = FACTS, **kw: Any
) -> tuple[list[fx.Effect], SyncResult]:
    """Drive one sync of VERSION by hand: each effect answered by ``script`` (else
    :data:`DEFAULT`, else ``Ok()``); return the effects it yielded and its result."""
    answers = {**DEFAULT, fx.ReadGroups: lambda e: fx.Ok(facts), **(script or {})}
    seen: list[fx.Effect] = []

    def perform(effect: fx.Effect) -> fx.Outcome:
        seen.append(effect)
        answer = answers.get(type(effect))
        return answer(effect) if answer is not None else fx.Ok()

    return seen, fx.drive(sync_op.sync(VERSION, **kw), perform)


def kinds(effects: list[fx.Effect]) -> list[str]:
    return [type(e).__name__ for e in effects]


def sends(effects: list[fx.Effect]) -> list[tuple[str, GroupEvent]]:
    return [(e.group, e.event) for e in effects if isinstance(e, fx.SendGroup)]


# ====================================================================== scripted outcomes
def test_a_clean_sync_yields_its_steps_in_order() -> None:
    effects, result = run()
    assert kinds(effects) == [
        "ObserveExport",
        "LockTransport",
        "Register",
        "Pause",
        "Hook",
        "Hook",
        "ReadGroups",
        "PrepareTargets",
        "Update",
        "RecordVersions",
        "SendGroup",
        "ReadGroups",  # the groups again: one back ``active`` below N meanwhile is stale
        "UnlockTransport",
        "Hook",
        "Resume",
        "StartExport",
    ]
    assert [e.name for e in effects if isinstance(e, fx.Hook)] == [
        "offload_trainer",
        "onload_engines",
        "onload_trainer",
    ]
    (update,) = [e for e in effects if isinstance(e, fx.Update)]
    assert [g.group_id for g in update.groups] == ["g0", "g1", "g2"]  # not the recovering g3
    assert fx.RecordVersions(("g0", "g1", "g2"), VERSION, VERSION) in effects
    assert sends(effects) == [("g2", GroupEvent.WEIGHTS_LOADED)]
    assert result.ok and result.error is None and result.fleet_version == VERSION
    assert result.updated == ("g0", "g1", "g2") and result.weights_loaded == ("g2",)
    assert result.not_targeted == {"g3": "state recovering"} and result.export_started


@pytest.mark.parametrize(
    "register",
    [fx.Failed("RegisterError: rank 3 staged nothing"), fx.TimedOut(30.0), fx.Ok(("ckpt", 1))],
)
def test_a_failed_register_publishes_nothing(register: fx.Outcome) -> None:
    effects, result = run({fx.Register: lambda e: register})
    assert kinds(effects) == ["ObserveExport", "LockTransport", "Register", "UnlockTransport"]
    assert not result.ok and result.fleet_version is None and not result.export_started
    assert result.error is not None and f"register of v{VERSION}" in result.error
    if isinstance(register, fx.Failed):
        assert "rank 3 staged nothing" in result.error
    elif isinstance(register, fx.TimedOut):
        assert "timed out after 30s" in result.error
    else:
        assert "did not publish it" in result.error


def test_a_failing_hook_updates_nothing_and_resumes() -> None:
    script: Script = {
        fx.Hook: lambda e: (
            fx.Failed("OSError: no memory") if e.name == "onload_engines" else fx.Ok()
        )
    }
    effects, result = run(script)
    assert kinds(effects)[-3:] == ["Hook", "UnlockTransport", "Resume"]
    assert not any(isinstance(e, fx.Update | fx.RecordVersions) for e in effects)
    assert not result.ok and result.error == "onload_engines failed: OSError: no memory"


def test_onload_trainer_failure_moves_the_fleet_but_starts_no_export() -> None:
    script: Script = {
        fx.Hook: lambda e: fx.Failed("boom") if e.name == "onload_trainer" else fx.Ok()
    }
    effects, result = run(script)
    assert result.ok and result.fleet_version == VERSION
    assert result.error == "onload_trainer failed: boom"
    assert kinds(effects)[-2:] == ["Hook", "Resume"] and not result.export_started


@pytest.mark.parametrize("on_failure", ["fail", "stale"])
def test_update_failure_on_an_engine_that_loses_weights_fails_and_recovers(
    on_failure: policy.UpdateFailurePolicy,
) -> None:
    def one_rank_fails(effect: fx.Update) -> fx.Outcome:
        ok = {g.group_id: dict.fromkeys(g.ranks, True) for g in effect.groups}
        ok["g1"] = {2: True, 3: False}
        return fx.Ok(fx.UpdateDone(ok))

    effects, result = run({fx.Update: one_rank_fails}, on_failure=on_failure)
    assert result.updated == ("g0", "g2") and result.failed == ("g1",)
    assert fx.RecordVersions(("g0", "g2"), VERSION, VERSION) in effects  # never the failed group
    assert ("g1", GroupEvent.FAIL) in sends(effects)
    assert fx.HandOff("g1") in effects and result.handed_off == ("g1",)
    assert result.failed_groups == ("g1",)


def test_update_failure_on_an_engine_that_keeps_weights_goes_stale_under_stale() -> None:
    keeps = tuple(policy.GroupFacts(f.group_id, f.state, f.ranks, (), True) for f in FACTS)

    def g1_fails(effect: fx.Update) -> fx.Outcome:
        ok = {g.group_id: dict.fromkeys(g.ranks, g.group_id != "g1") for g in effect.groups}
        return fx.Ok(fx.UpdateDone(ok))

    effects, result = run({fx.Update: g1_fails}, facts=keeps, on_failure="stale")
    assert ("g1", GroupEvent.MARK_STALE) in sends(effects)
    assert not any(isinstance(e, fx.HandOff) for e in effects) and result.marked_stale == ("g1",)


@pytest.mark.parametrize("outcome", [fx.Failed("TransportError: no group"), fx.TimedOut()])
def test_an_update_that_fails_as_a_whole_fails_every_target(outcome: fx.Outcome) -> None:
    effects, result = run({fx.Update: lambda e: outcome})
    assert result.ok and result.updated == () and result.failed == ("g0", "g1", "g2")
    assert fx.RecordVersions((), VERSION, VERSION) in effects
    assert [g for g, e in sends(effects) if e is GroupEvent.FAIL] == ["g0", "g1", "g2"]
    assert [e.group for e in effects if isinstance(e, fx.HandOff)] == ["g0", "g1", "g2"]


def test_a_refused_fail_is_not_handed_to_recovery() -> None:
    def g1_fails(effect: fx.Update) -> fx.Outcome:
        ok = {g.group_id: dict.fromkeys(g.ranks, g.group_id != "g1") for g in effect.groups}
        return fx.Ok(fx.UpdateDone(ok))

    script: Script = {
        fx.Update: g1_fails,
        fx.SendGroup: lambda e: fx.Failed("moved") if e.group == "g1" else fx.Ok(),
    }
    effects, result = run(script)
    assert ("g1", GroupEvent.FAIL) in sends(effects)
    assert not any(isinstance(e, fx.HandOff) for e in effects) and result.failed_groups == ()


def test_a_group_that_moved_during_the_update_is_never_credited() -> None:
    def g0_moved(effect: fx.Update) -> fx.Outcome:
        ok = {g.group_id: dict.fromkeys(g.ranks, True) for g in effect.groups}
        return fx.Ok(fx.UpdateDone(ok, moved={"g0": "recovering"}))

    script: Script = {fx.Update: g0_moved, fx.PrepareTargets: lambda e: fx.Ok({"g1": "no client"})}
    effects, result = run(script)
    (update,) = [e for e in effects if isinstance(e, fx.Update)]
    assert [g.group_id for g in update.groups] == ["g0", "g2"]  # g1 had no target
    assert fx.RecordVersions(("g2",), VERSION, VERSION) in effects
    assert result.not_targeted["g0"] == "moved to recovering during the update"
    assert result.not_targeted["g1"] == "no client"
    assert ("g0", GroupEvent.MARK_STALE) not in sends(effects)
    assert ("g1", GroupEvent.MARK_STALE) in sends(effects)  # active, not updated


@pytest.mark.parametrize(
    ("state", "judgement", "mode_events", "abandoned"),
    [
        ("writing", "late", [ModeEvent.EXPORT_LATE], True),
        ("ready", "on_time", [ModeEvent.EXPORT_ON_TIME], False),
        ("failed", "failed", [], False),
    ],
)
def test_the_previous_export_is_judged_first(
    state: str, judgement: str, mode_events: list[ModeEvent], abandoned: bool
) -> None:
    seen = fx.ExportSeen(1, state, "enabled")
    effects, result = run({fx.ObserveExport: lambda e: fx.Ok(seen)})
    lock = kinds(effects).index("LockTransport")
    before = effects[:lock]
    assert fx.ExportJudged(1, judgement, state) in before  # type: ignore[arg-type]
    assert [e.event for e in before if isinstance(e, fx.SendMode)] == mode_events
    assert any(isinstance(e, fx.AbandonExport) for e in before) is abandoned
    assert result.previous_export == judgement


# ====================================================================== one changed step
def records_every_target(
    original: Callable[..., sync_op.Steps],
) -> Callable[..., sync_op.Steps]:
    """The sequence with one step changed: every targeted group records N, whatever its
    update's outcome (the bug of recording versions before the update is settled)."""
    targeted: list[str] = []

    def rewrite(effect: fx.Effect) -> list[fx.Effect]:
        if isinstance(effect, fx.Update):
            targeted[:] = [g.group_id for g in effect.groups]
        elif isinstance(effect, fx.RecordVersions):
            return [fx.RecordVersions(tuple(targeted), effect.version, effect.fleet_version)]
        return [effect]

    return rewritten(original, rewrite)


def test_changing_one_step_changes_what_verify_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    config = ModelConfig(groups=1, ranks=1, engine="reference", node_loss=False, removals=0)
    clean = explore(config, depth=3)
    assert clean.ok and clean.complete
    monkeypatch.setattr(sync_op, "sync", records_every_target(sync_op.sync))
    changed = explore(config, depth=3)
    assert not changed.ok
    cex = changed.counterexamples[0]
    assert "recorded_versions_are_true" in {v.invariant for v in cex.violations}
    assert cex.trace[-1].name == "sync" and cex.trace[-1].args[1] == 0  # its update failed


def test_the_fleet_runs_the_same_changed_step(monkeypatch: pytest.MonkeyPatch) -> None:
    traits = policy.engine_traits("reference", "sglang")  # keeps its weights: "stale" applies

    def sync_once() -> tuple[Any, Any]:
        reg, _ = make_fleet((1, 2, 1), version=1, bind=False)
        transport = MemoryTransport(4)
        transport.fail = {"g1"}
        coordinator = SyncCoordinator(
            reg, transport, on_update_failure="stale", traits_for=lambda _group: traits
        )
        return reg, coordinator.sync(tensors(2), 2)

    reg, report = sync_once()
    assert report.failed == ["g1"] and versions(reg, "g1") == {1}
    assert reg.get("g1").state == "pending_weights"
    monkeypatch.setattr(sync_op, "sync", records_every_target(sync_op.sync))
    reg, report = sync_once()
    assert report.failed == ["g1"] and versions(reg, "g1") == {2}  # the changed step ran


# ====================================================================== a group back meanwhile
def test_a_group_back_active_below_n_during_the_update_is_marked_stale() -> None:
    """g3 was recovering when the sync read the groups (not targeted); its restart from the
    previous version's export ended while the update ran: the second read sees it ``active``
    at VERSION - 1, and it is marked stale (the soak's finding, issue #36)."""
    reads: list[int] = []

    def read(_effect: fx.ReadGroups) -> fx.Outcome:
        reads.append(1)
        if len(reads) == 1:
            return fx.Ok(FACTS)
        back = policy.GroupFacts("g3", "active", (5,), versions=(VERSION - 1,))
        updated = tuple(
            policy.GroupFacts(f.group_id, "active", f.ranks, versions=(VERSION,) * len(f.ranks))
            for f in FACTS[:3]
        )
        return fx.Ok((*updated, back))

    effects, result = run({fx.ReadGroups: read})
    assert len(reads) == 2
    assert sends(effects) == [("g2", GroupEvent.WEIGHTS_LOADED), ("g3", GroupEvent.MARK_STALE)]
    assert result.marked_stale == ("g3",) and result.updated == ("g0", "g1", "g2")
    assert result.latecomers == ("g3",)
    late = [e for e in effects if isinstance(e, fx.SendGroup) and e.group == "g3"]
    assert [e.decided_by for e in late] == ["settle_latecomers"]
    # handed over for the push of VERSION now, not left for the next sync (the stress run)
    assert [e for e in effects if isinstance(e, fx.HandOff)] == [fx.HandOff("g3", push_only=True)]
    # the second read comes after the new fleet version, before the transport is unlocked
    order = kinds(effects)
    assert order.index("RecordVersions") < len(order) - 1 - order[::-1].index("ReadGroups")
    assert order[::-1].index("ReadGroups") > order[::-1].index("UnlockTransport")


def test_settle_latecomers_leaves_updated_current_and_unknown_groups() -> None:
    facts = (
        policy.GroupFacts("g0", "active", (0,), versions=(3,)),  # updated by this sync
        policy.GroupFacts("g1", "active", (1, 2), versions=(3, 3)),  # at N already
        policy.GroupFacts("g2", "active", (3, 4), versions=(3, 2)),  # one member below N
        policy.GroupFacts("g3", "pending_weights", (5,), versions=(2,)),  # waits already
        policy.GroupFacts("g4", "active", (6,)),  # no versions read: nothing to judge
    )
    assert policy.settle_latecomers(3, facts, ("g0",)) == (("g2", GroupEvent.MARK_STALE),)


def without_the_second_read(
    original: Callable[..., sync_op.Steps],
) -> Callable[..., sync_op.Steps]:
    """The sequence with its second read of the groups answered with nothing (the sync as it
    was before the soak found the race)."""
    reads: list[int] = []

    def rewrite(effect: fx.Effect) -> list[fx.Effect] | fx.Outcome:
        if isinstance(effect, fx.ReadGroups):
            reads.append(1)
            if len(reads) % 2 == 0:
                return fx.Ok(())
        return [effect]

    return rewritten(original, rewrite)


def test_verify_finds_a_restart_that_ends_during_the_update(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = ModelConfig(groups=1, ranks=1, engine="vllm", node_loss=False, removals=0)
    clean = explore(config, depth=4)
    assert clean.ok and clean.complete
    monkeypatch.setattr(sync_op, "sync", without_the_second_read(sync_op.sync))
    changed = explore(config, depth=4)
    assert not changed.ok
    cex = changed.counterexamples[0]
    assert "active_groups_whole_and_current" in {v.invariant for v in cex.violations}
    last = cex.trace[-1]
    assert last.name == "sync" and last.args[-1] == 0  # g0's restart ended during the update


def test_the_fleet_marks_a_group_back_during_the_update_stale() -> None:
    """The real coordinator: g1 is recovering when the sync reads the groups; its restart (at
    v1, from the previous export) ends while the transport pushes v2 to the others."""
    reg, _ = make_fleet((1, 2, 1), version=1, bind=False)
    reg.send("g1", "fail")
    reg.send("g1", "claim")
    assert reg.get("g1").state == "recovering"

    class BackDuringUpdate(MemoryTransport):
        def update(self, targets: Any) -> Any:
            for r in reg.get("g1").ranks:
                reg.report_member("g1", r, healthy=True, weights_version=1)
            reg.send("g1", "restarted")  # the fleet is still at v1: active
            assert reg.get("g1").state == "active"
            return super().update(targets)

    transport = BackDuringUpdate(4)
    report = SyncCoordinator(reg, transport).sync(tensors(2), 2)
    assert report.ok and transport.pushed == [["g0", "g2"]]
    assert reg.fleet_version == 2 and versions(reg, "g1") == {1}
    assert reg.get("g1").state == "pending_weights"  # never routed at v1 under a v2 fleet
