"""How each engine kind fails (``rollsafe.policy.EngineTraits``) and what the fleet does with it:
the table, the configuration keys that follow from it, and the sync's default pause."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import rollsafe.policy as policy
from rollsafe.adapters.engines import EngineSpec
from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model
from rollsafe.fleet import FleetConfig, FleetConfigError, RolloutFleet


def test_only_the_reference_sglang_dialect_keeps_weights_after_a_failed_update() -> None:
    keeps = {
        (kind, dialect): policy.engine_traits(kind, dialect).failed_update_keeps_weights
        for kind, dialect in [
            ("reference", "sglang"),
            ("reference", "vllm"),
            ("sglang", "sglang"),
            ("vllm", "vllm"),
            ("reference", None),
        ]
    }
    assert keeps == {
        ("reference", "sglang"): True,
        ("reference", "vllm"): False,
        ("sglang", "sglang"): False,
        ("vllm", "vllm"): False,
        ("reference", None): True,
    }


def test_vllm_updates_run_paused_and_sglang_ones_need_not() -> None:
    assert policy.engine_traits("vllm").update_needs_pause
    assert policy.engine_traits("reference", "vllm").update_needs_pause
    assert not policy.engine_traits("sglang").update_needs_pause
    assert not policy.engine_traits("reference", "sglang").update_needs_pause


def test_an_unknown_engine_gets_the_careful_answers() -> None:
    traits = policy.engine_traits("lmdeploy")
    assert traits is policy.UNKNOWN_ENGINE
    assert not traits.failed_update_keeps_weights and traits.update_needs_pause


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("traits") / "model"
    make_tiny_model(path)
    return path


def _config(model: Path, tmp: Path, engine: dict[str, Any] | None = None, **kw: Any) -> FleetConfig:
    """A fleet config on ``model``; ``engine``: the engine spec's fields."""
    spec = EngineSpec(model_path=str(model), **(engine or {}))
    return FleetConfig(export_root=tmp / "exports", transport="nccl", engine=spec, **kw)


@pytest.mark.parametrize(
    ("key", "value"), [("on_update_failure", "ignore"), ("pause_mode", "in_place")]
)
def test_bad_failure_and_pause_settings_name_the_key(
    model: Path, tmp_path: Path, key: str, value: str
) -> None:
    with pytest.raises(FleetConfigError) as err:
        _config(model, tmp_path, **{key: value})
    assert err.value.key == key and value in str(err.value)


@pytest.mark.parametrize(
    ("options", "configured", "requested", "expected"),
    [
        ({}, None, None, None),  # the reference SGLang dialect serves through an update
        ({"dialect": "vllm"}, None, None, "abort"),  # vLLM dies on a request mid-update
        ({"dialect": "vllm"}, "retract", None, "retract"),  # the fleet's choice
        ({"dialect": "vllm"}, "retract", "abort", "abort"),  # the call's choice
        ({}, "retract", None, "retract"),
    ],
)
def test_the_sync_pause_mode_is_the_fleets_choice_and_vllm_is_never_left_unpaused(
    model: Path,
    tmp_path: Path,
    options: dict[str, Any],
    configured: Any,
    requested: Any,
    expected: Any,
) -> None:
    fleet = RolloutFleet(_config(model, tmp_path, engine=options, pause_mode=configured))
    assert fleet.sync_pause_mode(requested) == expected


@pytest.mark.parametrize(
    ("options", "kind", "deltas"),
    [
        ({"kind": "vllm"}, "vllm-cpu", True),  # the launcher's CPU default: rollsafe_gloo
        ({"kind": "vllm", "device": "cpu"}, "vllm-cpu", True),
        ({"kind": "vllm", "device": "cuda"}, "vllm", False),  # vLLM's own nccl backend
        ({"kind": "vllm", "weight_transfer_backend": "rollsafe_gloo"}, "vllm-cpu", True),
        ({"kind": "vllm", "device": "cpu", "weight_transfer_backend": "x"}, "vllm", False),
        ({"kind": "sglang", "device": "cpu"}, "sglang", False),
        ({}, "reference-sglang", True),
    ],
)
def test_vllm_applies_deltas_only_through_rollsafes_gloo_plugin(
    model: Path, tmp_path: Path, options: dict[str, Any], kind: str, deltas: bool
) -> None:
    traits = RolloutFleet(_config(model, tmp_path, engine=options)).engine_traits
    assert (traits.kind, traits.applies_deltas) == (kind, deltas)
    assert traits.delta_base_by_content == (kind == "vllm-cpu")
