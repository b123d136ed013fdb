"""The exhaustive verifier: a bounded run in CI, the CLI's report, and counterexample traces."""

from __future__ import annotations

import pytest
from mutants import SuspendedForever

from rollsafe.cli import main
from rollsafe.verify import Action, FleetModel, ModelConfig, explore


def test_bounded_exploration_finds_no_violation() -> None:
    result = explore(ModelConfig(groups=2, ranks=2), depth=5)
    assert result.ok, result.counterexamples[0].format()
    assert result.complete
    assert result.states > 1000 and result.transitions > result.states
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
    # late export (two syncs), then rearm_after=2 on-time exports: six actions at least.
    assert len(cex.trace) == 6
    assert any(v.invariant == 8 for v in cex.violations)
    text = cex.format()
    assert "sync(True)" in text and "invariant 8" in text
    # Every proper prefix of a shortest trace is violation-free.
    model = FleetModel(ModelConfig(groups=1, ranks=1), mode_cls=SuspendedForever)
    for action in cex.trace[:-1]:
        model.apply(action)
        assert model.check() == []


def test_refused_action_changes_nothing() -> None:
    model = FleetModel(ModelConfig(groups=2, ranks=2))
    before = model.snapshot()
    assert model.apply(Action("group_event", (0, "claim"))) is False  # launching: not allowed
    assert model.apply(Action("group_event", (1, "launched"))) is False  # nobody healthy yet
    assert model.snapshot() == before


def test_max_states_marks_the_run_incomplete() -> None:
    result = explore(ModelConfig(groups=2, ranks=2), depth=8, max_states=200)
    assert not result.complete and result.states <= 201


def test_cli_verify_reports(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["verify", "--groups", "1", "--ranks", "2", "--depth", "4", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "states explored:" in out and "transitions taken:" in out and "violations: 0" in out


def test_cli_inspect_lists_guards(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "WorkerGroupLifecycle"]) == 0
    out = capsys.readouterr().out
    assert "claim: inactive -> recovering [group_complete and restart_budget_left]" in out
