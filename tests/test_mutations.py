"""Mutation check: each of the reviewers' bugs, planted on purpose, must be caught.

For every mutant in ``tests/mutants.py`` (machine mutants and policy mutants) two independent
nets are asserted to fail: the exhaustive verifier (a counterexample trace is found) and the
hypothesis property tests. Policy mutants are planted in :mod:`rollsafe.policy` itself,
the module the fleet runs, so both nets see exactly what the fleet would execute. A mutant that
slipped through either would mean the proof machinery cannot see that class of bug.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import Phase, settings
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test
from mutants import (
    MUTANTS,
    POLICY_MUTANTS,
    AdvanceBaseOnSend,
    AnyHealthyGroup,
    DeleteLeasedExport,
    PlacedSpendsBudget,
    PublishAfterRegisterThrew,
    PublishOnFailedRegister,
    SpareServesAtLaunch,
    SuspendedForever,
)
from test_delta_properties import DeltaLedgerProperties
from test_sm_properties import (
    ComposedFleetProperties,
    ExportProperties,
    ModeProperties,
    PolicyProperties,
    RegistrationProperties,
    WorkerGroupProperties,
)

from rollsafe import policy
from rollsafe.verify import FleetModel, ModelConfig, explore

# One group of two ranks is the smallest model in which any() and all() differ. The machine
# mutants that are not about nodes or removals keep the model without them (a smaller space).
MUTATION_CONFIG = ModelConfig(groups=1, ranks=2, node_loss=False, removals=0)
# A leased export is superseded within depth 8 only with one rank to launch.
CONFIGS = {
    "delete_leased_export": ModelConfig(groups=1, ranks=1, node_loss=False, removals=0),
    "placement_spends_budget": ModelConfig(groups=1, ranks=1),
    # a failed delta leaves a group serving (not restarted) only on an engine that keeps its
    # weights after a failed update; on vLLM the group is restarted, which resets its base
    "advance_base_on_send": ModelConfig(
        groups=1, ranks=1, engine="reference", node_loss=False, removals=0
    ),
    "spare_routed_before_promotion": ModelConfig(
        groups=1, ranks=1, spares=1, node_loss=False, removals=0
    ),
}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_verifier_catches_planted_bug(name: str) -> None:
    kwargs = MUTANTS[name]
    config = CONFIGS.get(name, MUTATION_CONFIG)
    result = explore(config, depth=8, model_factory=lambda cfg: FleetModel(cfg, **kwargs))
    assert not result.ok, f"the verifier missed the planted bug {name!r}"
    cex = result.counterexamples[0]
    assert cex.trace, "a counterexample must be a non-empty event trace"
    # Replaying the trace on a fresh mutant model reproduces the violation.
    model = FleetModel(config, **kwargs)
    for action in cex.trace:
        model.apply(action)
    assert model.check(), f"replaying {[str(a) for a in cex.trace]} did not reproduce it"


def test_clean_machines_pass_the_same_bound() -> None:
    result = explore(MUTATION_CONFIG, depth=8)
    assert result.ok, result.counterexamples[0].format()
    assert result.states > 1000


def test_clean_delta_bases_pass_the_mutants_bound() -> None:
    """The model in which ``advance_base_on_send`` is caught within three steps holds every
    invariant with the real DeltaBase, twice as deep."""
    result = explore(CONFIGS["advance_base_on_send"], depth=6)
    assert result.ok, result.counterexamples[0].format()
    assert result.states > 500


PROPERTY_NETS: dict[str, tuple[type[Any], dict[str, Any]]] = {
    "any_instead_of_all": (WorkerGroupProperties, {"machine_cls": AnyHealthyGroup}),
    "publish_on_failed_register": (
        RegistrationProperties,
        {"machine_cls": PublishOnFailedRegister},
    ),
    "publish_after_register_threw": (
        RegistrationProperties,
        {"machine_cls": PublishAfterRegisterThrew},
    ),
    "delete_leased_export": (ExportProperties, {"machine_cls": DeleteLeasedExport}),
    "suspended_forever": (ModeProperties, {"machine_cls": SuspendedForever}),
    "placement_spends_budget": (WorkerGroupProperties, {"machine_cls": PlacedSpendsBudget}),
    "advance_base_on_send": (DeltaLedgerProperties, {"machine_cls": AdvanceBaseOnSend}),
    "spare_routed_before_promotion": (WorkerGroupProperties, {"machine_cls": SpareServesAtLaunch}),
}


def test_every_mutant_has_a_property_net() -> None:
    assert set(PROPERTY_NETS) == set(MUTANTS)


def _net_catches(name: str) -> bool:
    """Whether the property tests of ``name``'s machine, run on its mutant, fail."""
    base, attrs = PROPERTY_NETS[name]
    mutant_test = type(f"Mutant{base.__name__}", (base,), attrs)
    # Derandomized (same examples every run) and without shrinking: we only need to know
    # that the net catches the bug, not the smallest example.
    quick = settings(
        max_examples=300,
        stateful_step_count=40,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
    )
    try:
        run_state_machine_as_test(mutant_test, settings=quick)
    except (AssertionError, Flaky):
        return True
    return False


@pytest.mark.parametrize("name", sorted(PROPERTY_NETS))
def test_property_tests_catch_planted_bug(name: str) -> None:
    """In an interpreter of its own: Hypothesis also draws from the constants of the modules
    loaded, so the same derandomized net drew other examples once other tests had imported all
    of rollsafe, and missed the planted ``any()`` (CI, 2026-12-06; reproduced by importing every
    module first). Here the examples depend on the code alone."""
    code = f"import sys, test_mutations as t; sys.exit(0 if t._net_catches({name!r}) else 3)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (
        f"the property tests missed the planted bug {name!r} (exit {done.returncode})\n"
        + done.stderr[-3000:]
    )


# ---------------------------------------------------------------------- policy mutants
@pytest.mark.parametrize("name", sorted(POLICY_MUTANTS))
def test_verifier_catches_planted_policy_bug(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    function, mutant, config = POLICY_MUTANTS[name]
    monkeypatch.setattr(policy, function, mutant)
    result = explore(config, depth=8)
    assert not result.ok, f"the verifier missed the planted policy bug {name!r}"
    cex = result.counterexamples[0]
    model = FleetModel(config)
    for action in cex.trace:
        model.apply(action)
    assert model.check(), f"replaying {[str(a) for a in cex.trace]} did not reproduce it"


def test_clean_policy_passes_the_mutants_bounds() -> None:
    for config in {c for _, _, c in POLICY_MUTANTS.values()} - {MUTATION_CONFIG}:
        result = explore(config, depth=6)
        assert result.ok, result.counterexamples[0].format()


@pytest.mark.parametrize("name", sorted(POLICY_MUTANTS))
def test_property_tests_catch_planted_policy_bug(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    function, mutant, _config = POLICY_MUTANTS[name]
    monkeypatch.setattr(policy, function, mutant)
    quick = settings(
        max_examples=300,
        stateful_step_count=30,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
    )
    with pytest.raises((AssertionError, Flaky)):
        run_state_machine_as_test(PolicyProperties, settings=quick)


def test_composed_property_test_uses_the_planted_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The composed hypothesis model runs the module's functions too: a planted bug that the
    first steps reach is caught there as well."""
    function, mutant, _ = POLICY_MUTANTS["publish_after_a_failed_register"]
    monkeypatch.setattr(policy, function, mutant)
    quick = settings(
        max_examples=100,
        stateful_step_count=20,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
    )
    with pytest.raises((AssertionError, Flaky)):
        run_state_machine_as_test(ComposedFleetProperties, settings=quick)
