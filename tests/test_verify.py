"""The exhaustive verifier: a bounded run in CI, the CLI's report, and counterexample traces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mutants import AdvanceBaseOnSend, SuspendedForever

from rollsafe.cli import main
from rollsafe.verify import Action, FleetModel, ModelConfig, explore


def test_bounded_exploration_finds_no_violation() -> None:
    result = explore(ModelConfig(groups=2, ranks=2), depth=5)
    assert result.ok, result.counterexamples[0].format()
    assert result.complete
    assert result.states > 300 and result.transitions > result.states
    assert result.frontier_sizes[0] == 1


def test_exploration_is_deterministic() -> None:
    a = explore(ModelConfig(groups=1, ranks=2), depth=5)
    b = explore(ModelConfig(groups=1, ranks=2), depth=5)
    assert (a.states, a.transitions, a.refused) == (b.states, b.transitions, b.refused)


def test_counterexample_is_a_shortest_replayable_trace() -> None:
    result = explore(
        ModelConfig(groups=1, ranks=1),
        depth=8,
        model_factory=lambda cfg: FleetModel(cfg, mode_cls=SuspendedForever),
    )
    assert not result.ok
    cex = result.counterexamples[0]
    # A late export (two syncs), then rearm_after=2 on-time exports: six actions at least.
    assert len(cex.trace) == 6
    assert any(v.invariant == "immediate_recovery_rearms" for v in cex.violations)
    text = cex.format()
    assert "sync(True, None, 'fail')" in text and "immediate_recovery_rearms" in text
    # Every proper prefix of a shortest trace is violation-free.
    model = FleetModel(ModelConfig(groups=1, ranks=1), mode_cls=SuspendedForever)
    for action in cex.trace[:-1]:
        model.apply(action)
        assert model.check() == []


def test_refused_action_changes_nothing() -> None:
    model = FleetModel(ModelConfig(groups=2, ranks=2))
    before = model.snapshot()
    assert model.apply(Action("stray", (0, "claim"))) is False  # launching: not allowed
    assert model.apply(Action("stray", (1, "launched"))) is False  # nobody healthy yet
    assert model.apply(Action("restart", (0, True))) is False  # not recovering
    assert model.snapshot() == before


def test_verify_runs_the_policy_module_the_fleet_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """One module of decisions: the fleet's coordinators, the verifier and the property tests
    all hold rollsafe.policy itself, and changing one of its functions changes what the
    verifier reports."""
    import test_sm_properties

    from rollsafe import invariants, policy
    from rollsafe.fleet import health, recovery, sync
    from rollsafe.hf import retention
    from rollsafe.verify import model

    for module in (health, recovery, sync, model, test_sm_properties):
        assert module.policy is policy
    assert model.invariants is invariants and test_sm_properties.invariants is invariants
    config = ModelConfig(groups=1, ranks=1)
    clean = explore(config, depth=4)
    assert clean.ok
    monkeypatch.setattr(policy, "proceed_after_register", lambda published, version: True)
    changed = explore(config, depth=4)
    assert not changed.ok
    assert changed.counterexamples[0].violations[0].invariant == "no_publish_on_failed_register"
    assert "plan_retention" in retention.apply_retention.__code__.co_names


def test_every_event_a_decision_returns_is_declared(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollsafe import policy
    from rollsafe.statemachines import GroupEvent

    monkeypatch.setattr(policy, "launch_events", lambda recorded: (GroupEvent.CLAIM,))
    result = explore(ModelConfig(groups=1, ranks=1), depth=2)
    assert not result.ok
    assert any("undeclared" in v.message for v in result.counterexamples[0].violations)


def test_typed_event_constants_match_the_machines() -> None:
    from rollsafe.statemachines import (
        CheckpointRegistration,
        DeltaBase,
        DeltaEvent,
        ExportEvent,
        ExportLifecycle,
        GroupEvent,
        ImmediateRecoveryMode,
        ModeEvent,
        RegistrationEvent,
        WorkerGroupLifecycle,
    )
    from rollsafe.statemachines.base import event_names

    for enum, cls in (
        (GroupEvent, WorkerGroupLifecycle),
        (ExportEvent, ExportLifecycle),
        (RegistrationEvent, CheckpointRegistration),
        (ModeEvent, ImmediateRecoveryMode),
        (DeltaEvent, DeltaBase),
    ):
        assert {e.value for e in enum} == set(event_names(cls))


def test_machines_use_no_private_statemachine_attribute() -> None:
    """No python-statemachine internal is reached: in a module that builds machines (it imports
    ``statemachine``) no use of the names at all; elsewhere no ``x._engine``-style access on
    anything but the module's own objects (``self._events`` of an HTTP client is its own).
    One exception, for the model checker only: ``GuardedMachine.revive`` sets the engine's
    running flag again (python-statemachine has no public way to reuse a terminated machine;
    :func:`test_a_terminated_machine_revived_takes_transitions_again` checks it still works)."""
    import re
    from pathlib import Path

    import rollsafe

    private = r"_engine|_put_nonblocking|_processing_loop|_events|_callbacks"
    access = re.compile(rf"(\w+)\.({private})\b")
    machine_module = re.compile(r"^\s*(from|import) statemachine\b", re.M)
    root = Path(rollsafe.__file__).parent
    revive = "statemachines/base.py: self._engine"
    offenders = []
    for path in root.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        builds_machines = machine_module.search(text) is not None
        for m in access.finditer(text):
            if builds_machines or m.group(1) not in ("self", "cls"):
                offenders.append(f"{path.relative_to(root)}: {m.group(0)}")
    assert offenders.count(revive) == 1  # GuardedMachine.revive
    assert [o for o in offenders if o != revive] == []


def test_a_terminated_machine_revived_takes_transitions_again() -> None:
    """``revive`` (the model checker's pool) on the installed python-statemachine: a group
    machine retired by a transition has terminated; revived into ``draining`` it retires
    again, as a machine built fresh would; ``restore_state`` still refuses it."""
    from rollsafe.statemachines import WorkerGroupLifecycle
    from rollsafe.statemachines.base import MachineTerminated

    def retired() -> WorkerGroupLifecycle:
        machine = WorkerGroupLifecycle(range(1), group_id="g0")
        machine.restore_state("draining")
        machine.retire()
        return machine

    machine = retired()
    assert machine.state == "retired" and machine.is_terminated
    with pytest.raises(MachineTerminated):
        machine.restore_state("draining")
    machine.revive("draining")
    assert machine.state == "draining" and not machine.is_terminated
    machine.retire()
    assert machine.state == "retired" and machine.is_terminated
    assert [t.event for t in machine.history][-2:] == ["retire", "retire"]


def test_max_states_marks_the_run_incomplete() -> None:
    result = explore(ModelConfig(groups=2, ranks=2), depth=8, max_states=200)
    assert not result.complete and result.states <= 201


def test_cli_verify_reports(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["verify", "--groups", "1", "--ranks", "2", "--depth", "4", "--quiet"]
    rc = main([*argv, "--workers", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "states explored:" in out and "transitions taken:" in out and "violations: 0" in out
    assert "1 worker)" in out
    assert main([*argv, "--workers", "0"]) == 2
    assert "--workers must be at least 1, got 0" in capsys.readouterr().out


# Run in a fresh interpreter: the workers are spawned processes, kept out of pytest's.
_WORKERS_SCRIPT = """
import functools, json
import rollsafe.verify.explorer as explorer
from mutants import SuspendedForever
from rollsafe.verify import FleetModel, ModelConfig, explore

explorer._INLINE_BELOW = 1  # hand every level to the workers, however small
out = {}
for workers in (1, 2):
    clean = explore(ModelConfig(groups=2, ranks=2), depth=5, workers=workers)
    planted = explore(
        ModelConfig(groups=1, ranks=1), depth=8, workers=workers,
        model_factory=functools.partial(FleetModel, mode_cls=SuspendedForever),
    )
    out[workers] = {
        "clean": [clean.states, clean.transitions, clean.refused, clean.frontier_sizes, clean.ok],
        "trace": [str(a) for a in planted.counterexamples[0].trace],
        "broken": sorted(v.invariant for v in planted.counterexamples[0].violations),
        "workers": [clean.workers, planted.workers],
    }
print(json.dumps(out))
"""


def test_workers_explore_the_same_states_and_find_the_same_trace() -> None:
    """Two worker processes reach the same states, transitions and shortest counterexample as
    one: the merge takes the expansions in frontier order."""
    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parent)])}
    done = subprocess.run(
        [sys.executable, "-c", _WORKERS_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    one, two = out["1"], out["2"]
    assert one["workers"] == [1, 1] and two["workers"] == [2, 2]
    assert two["clean"] == one["clean"] and one["clean"][-1] is True
    assert one["clean"][0] > 300
    assert two["trace"] == one["trace"] and len(one["trace"]) == 6
    assert two["broken"] == one["broken"] and "immediate_recovery_rearms" in one["broken"]


def test_cli_inspect_lists_guards(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "WorkerGroupLifecycle"]) == 0
    out = capsys.readouterr().out
    assert "claim: inactive -> recovering [group_complete and restart_budget_left]" in out


# ---------------------------------------------------------------------- delta sync (issue #28)
def _run(model: FleetModel, *actions: Action) -> None:
    for action in actions:
        assert model.apply(action), f"{action} was refused"
        assert model.check() == [], [str(v) for v in model.check()]


def test_deltas_follow_the_confirmed_base_in_the_model() -> None:
    """First push full, then deltas; a failed delta keeps the base (the engine kept its
    weights: reference engine), a lagging group gets a full push, a restart resets."""
    cfg = ModelConfig(groups=2, ranks=1, engine="reference", node_loss=False, removals=0)
    model = FleetModel(cfg)
    _run(model, Action("launch", (0, 0)), Action("launch", (1, 0)))
    assert [d.state for d in model.delta] == ["no_base", "no_base"]
    _run(model, Action("sync", (True, None, "fail")))
    assert [(d.state, d.base) for d in model.delta] == [("based", 1), ("based", 1)]
    assert [r.event for r in model.delta[0].history] == ["send_full", "confirm"]
    _run(model, Action("sync", (True, 1, "stale")))  # g1's delta fails: g1 stale, kept v1
    assert [(d.state, d.base) for d in model.delta] == [("based", 2), ("based", 1)]
    assert [r.event for r in model.delta[1].history][-2:] == ["send_delta", "unconfirmed"]
    _run(model, Action("sync", (True, None, "fail")))  # g1 lags: its base v1 is not held
    assert [r.event for r in model.delta[0].history][-2:] == ["send_delta", "confirm"]
    assert [r.event for r in model.delta[1].history][-2:] == ["send_full", "confirm"]
    assert [d.base for d in model.delta] == [3, 3]
    _run(model, Action("crash", (0, 0)), Action("probe", (0,)), Action("recover", (0,)))
    _run(model, Action("restart", (0, True)))
    assert model.delta[0].state == "no_base"


def test_no_deltas_keeps_the_model_without_bases() -> None:
    model = FleetModel(ModelConfig(groups=1, ranks=1, deltas=False))
    _run(model, Action("launch", (0, 0)), Action("sync", (True, None, "fail")))
    assert model.delta == [] and model.picture().delta_bases is None


def test_advance_base_on_send_is_a_shortest_trace() -> None:
    cfg = ModelConfig(groups=1, ranks=1, engine="reference", node_loss=False, removals=0)
    result = explore(
        cfg, depth=6, model_factory=lambda c: FleetModel(c, delta_cls=AdvanceBaseOnSend)
    )
    assert not result.ok
    cex = result.counterexamples[0]
    assert [str(a) for a in cex.trace] == [
        "launch(0, 0)",
        "sync(True, None, 'fail')",
        "sync(True, 0, 'fail')",
    ]
    assert [v.invariant for v in cex.violations] == ["base_never_ahead"]


def test_cli_verify_no_deltas(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["verify", "--groups", "1", "--ranks", "1", "--depth", "3", "--quiet"]
    assert main([*argv, "--no-deltas"]) == 0
    off = capsys.readouterr().out
    assert main(argv) == 0
    on = capsys.readouterr().out
    assert "deltas off" in off and "deltas on" in on and "violations: 0" in on
