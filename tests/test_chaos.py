"""Chaos and bad-input tests on a real :class:`RolloutFleet` of reference-engine processes.

Scenarios: SIGKILL of one rank of a 2-rank group during generation (immediate recovery from the
ready export); SIGKILL during a weight update (that target fails, the group leaves routing and
is recovered, the others updated); a hung engine (health times out, the group is taken out, no
request thread stays stuck); repeated crashes until retirement while the rest serves; two
groups failing at once while a third serves; a crash as the rollout ends (recovery skipped, then
picked up); malformed configs failing at construction with a named error.

Each fleet scenario ends with :func:`chaos_support.assert_fleet_sound`: no request reached a
non-routable group, every active group holds the trainer's current weights, every restart from
an export loaded a ready, leased, verified one; and the trainer's sync steps completed. Its
recorded run then replays through the verifier's model (:func:`chaos_support.assert_replays`,
``rollsafe verify --trace``) with no divergence.
Waits are bounded by deadlines; nothing asserts a duration.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from chaos_support import (
    WAIT_S,
    RequestLoop,
    assert_fleet_sound,
    assert_replays,
    chaos_fleet,
    results_for,
    wait_for,
    wait_recovery,
)
from engine_helpers import (
    tiny_model_dir,  # noqa: F401  (fixture)
    tiny_model_dir_b,  # noqa: F401  (fixture)
)
from transport_helpers import Trainer

from rollsafe.fleet import FleetConfig, FleetConfigError, GroupSpec, HealthSettings, RolloutFleet


@pytest.fixture
def trainer(tiny_model_dir_b: Path) -> Trainer:  # noqa: F811
    return Trainer(tiny_model_dir_b)


@pytest.fixture
def fleets() -> Iterator[list[RolloutFleet]]:
    """Fleets appended here are closed after the test whatever happened."""
    started: list[RolloutFleet] = []
    yield started
    for fleet in started:
        fleet.close()


def step(fleet: RolloutFleet, trainer: Trainer, version: int, seed: int) -> Any:
    """One trainer step: change the weights, sync them (must complete), return the report."""
    trainer.perturb(seed)
    report = fleet.sync_weights(trainer.weights(), version)
    assert report.fleet_version_after == version, report
    return report


def ready_export(fleet: RolloutFleet, version: int) -> None:
    assert fleet.exporter is not None
    fleet.exporter.wait_hf_export(version, timeout=WAIT_S)


def events(fleet: RolloutFleet, gid: str) -> list[tuple[str, str]]:
    return [
        (r["event"], r["target"])
        for r in fleet.timeline()
        if r["kind"] == "group" and r["subject"] == gid
    ]


# ====================================================================== bad input
@pytest.mark.parametrize("case", ["transport", "overlap", "export_root", "template"])
def test_malformed_config_fails_at_construction_with_a_named_error(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    case: str,
) -> None:
    (tmp_path / "not-hf").mkdir()
    (tmp_path / "not-hf" / "README.md").write_text("no config.json here\n")
    kw: dict[str, Any] = {"model_path": tiny_model_dir, "export_root": tmp_path / "exports"}
    key = {
        "transport": "transport",
        "overlap": "groups[1].fleet_ranks",
        "export_root": "export_root",
        "template": "template_dir",
    }[case]
    if case == "transport":
        kw["transport"] = "smoke-signals"
    elif case == "overlap":
        kw["groups"] = [GroupSpec(2, fleet_ranks=(0, 1)), GroupSpec(2, fleet_ranks=(1, 2))]
    elif case == "export_root":
        kw["export_root"] = tmp_path / "missing-parent" / "exports"
    else:
        kw["template_dir"] = tmp_path / "not-hf"
    with pytest.raises(FleetConfigError) as info:
        RolloutFleet(FleetConfig(**kw))
    assert info.value.key == key and key in str(info.value)
    assert not (tmp_path / "exports").exists()  # nothing was created or launched


# ====================================================================== real engines
def test_sigkill_of_a_rank_during_generate_recovers_immediately(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    trainer: Trainer,
    fleets: list[RolloutFleet],
) -> None:
    fleet, journal = chaos_fleet(tiny_model_dir, tmp_path, [GroupSpec(2), GroupSpec(1)])
    fleets.append(fleet)
    assert step(fleet, trainer, 1, seed=1).ok
    ready_export(fleet, 1)
    with RequestLoop(fleet) as loop:
        assert wait_for(lambda: loop.served_total() >= 3)
        fleet.launcher("g0").kill_rank(1)  # one rank of the 2-rank group, mid-generation
        result = wait_recovery(fleet, "g0")
        served_before = loop.served_total()
        assert wait_for(lambda: loop.served_total() > served_before)  # still serving
    assert result.status == "active" and result.strategy == "immediate", result
    assert result.export_version == 1
    assert [(r.group_id, r.model_path) for r in journal.restarts] == [
        ("g0", str(tmp_path / "exports" / "hf-v1"))
    ]
    assert ("fail", "inactive") in events(fleet, "g0")
    assert fleet.registry.get("g1").state == "active"
    assert_fleet_sound(fleet, journal, trainer.weights())
    # The trainer's next step reaches both groups.
    report = step(fleet, trainer, 2, seed=2)
    assert report.ok and sorted(report.updated) == ["g0", "g1"], report
    assert_fleet_sound(fleet, journal, trainer.weights())
    assert_replays(fleet, tmp_path)


def test_sigkill_during_a_weight_update_fails_that_target_only(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    trainer: Trainer,
    fleets: list[RolloutFleet],
) -> None:
    fleet, journal = chaos_fleet(
        tiny_model_dir, tmp_path, [GroupSpec(1), GroupSpec(1)], immediate=False
    )
    fleets.append(fleet)
    victim = fleet.launcher("g1")
    client = victim.client
    original = client.update_weights_from_tensor
    killed = threading.Event()

    def killing_update(*args: Any, **kwargs: Any) -> Any:
        if not killed.is_set():
            killed.set()
            victim.kill_rank(0)
        return original(*args, **kwargs)

    client.update_weights_from_tensor = killing_update  # type: ignore[method-assign]
    with RequestLoop(fleet) as loop:
        report = step(fleet, trainer, 1, seed=3)  # the trainer's step completes
        assert killed.is_set()
        assert report.updated == ["g0"], report
        assert report.ok  # per-group failures are listed; the step itself completed
        # g1's push failed, and the sync took it out; or, on a loaded machine, the health
        # probes saw the dead engine first and it left routing while the push ran (the sync
        # then never credits it): either way only g1 is out
        if report.failed:
            assert report.failed == ["g1"] and "g1" in report.failed_groups, report
        else:
            assert "moved to" in report.not_targeted.get("g1", ""), report
        result = wait_recovery(fleet, "g1")
        assert wait_for(lambda: loop.served_total() > 0)
    g1 = events(fleet, "g1")
    assert ("fail", "inactive") in g1, g1  # out of routing ...
    assert result.status == "active", result  # ... and recovered later at v1
    assert result.strategy == "targeted_push", result
    assert journal.restarts and journal.restarts[0].model_path is None
    assert_fleet_sound(fleet, journal, trainer.weights())
    assert_replays(fleet, tmp_path)


def test_a_hung_engine_is_taken_out_and_no_thread_stays_stuck(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    trainer: Trainer,
    fleets: list[RolloutFleet],
) -> None:
    before = {t.ident for t in threading.enumerate()}
    fleet, journal = chaos_fleet(
        tiny_model_dir,
        tmp_path,
        [GroupSpec(1), GroupSpec(1)],
        health=HealthSettings(interval_s=0.2, timeout_s=1.0, failure_threshold=2),
    )
    fleets.append(fleet)
    assert step(fleet, trainer, 1, seed=4).ok
    ready_export(fleet, 1)
    with RequestLoop(fleet) as loop:
        assert wait_for(lambda: loop.served_total() >= 2)
        with pytest.raises(httpx.TimeoutException):  # the hang request itself never answers
            httpx.post(fleet.launcher("g1").url + "/fault/hang", timeout=0.5)
        result = wait_recovery(fleet, "g1")
        served = loop.served_total()
        assert wait_for(lambda: loop.served_total() > served)
    assert ("fail", "inactive") in events(fleet, "g1")
    assert result.status == "active" and result.strategy == "immediate", result
    assert_fleet_sound(fleet, journal, trainer.weights())
    assert_replays(fleet, tmp_path)
    fleet.close()

    # Every thread the fleet, its probes and the request loop started ends once it is closed.
    def leftover() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]

    assert wait_for(lambda: not leftover(), 30.0), [t.name for t in leftover()]


def test_repeated_crashes_retire_the_group_while_the_rest_serves(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    trainer: Trainer,
    fleets: list[RolloutFleet],
) -> None:
    fleet, journal = chaos_fleet(tiny_model_dir, tmp_path, [GroupSpec(1), GroupSpec(1)], budget=1)
    fleets.append(fleet)
    assert step(fleet, trainer, 1, seed=5).ok
    ready_export(fleet, 1)
    with RequestLoop(fleet) as loop:
        fleet.launcher("g1").kill()
        first = wait_recovery(fleet, "g1")
        assert first.status == "active", first  # budget 1 -> 0
        fleet.launcher("g1").kill()
        second = wait_recovery(fleet, "g1", 2)
        served = loop.served["g0"]
        assert wait_for(lambda: loop.served["g0"] > served)  # g0 keeps serving
    assert second.status == "retired", second
    assert fleet.registry.get("g1").state == "retired"
    assert [g.group_id for g in fleet.registry.routable()] == ["g0"]
    report = step(fleet, trainer, 2, seed=6)
    assert report.updated == ["g0"], report
    for _ in range(3):
        assert fleet.generate([1, 2], sampling_params={"max_new_tokens": 1}).group_id == "g0"
    assert_fleet_sound(fleet, journal, trainer.weights())
    assert_replays(fleet, tmp_path)


def test_two_groups_fail_at_once_while_a_third_serves(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    trainer: Trainer,
    fleets: list[RolloutFleet],
) -> None:
    fleet, journal = chaos_fleet(
        tiny_model_dir, tmp_path, [GroupSpec(1), GroupSpec(1), GroupSpec(1)]
    )
    fleets.append(fleet)
    assert step(fleet, trainer, 1, seed=7).ok
    ready_export(fleet, 1)
    with RequestLoop(fleet) as loop:
        assert wait_for(lambda: loop.served_total() >= 3)
        fleet.launcher("g1").kill()
        fleet.launcher("g2").kill()
        assert wait_for(lambda: len(fleet.registry.routable()) < 3 or len(fleet.recoveries()) > 0)
        served = loop.served["g0"]
        assert wait_for(lambda: loop.served["g0"] > served)  # the third serves meanwhile
        r1, r2 = wait_recovery(fleet, "g1"), wait_recovery(fleet, "g2")
    assert (r1.status, r2.status) == ("active", "active"), (r1, r2)
    assert {r.group_id for r in journal.restarts} == {"g1", "g2"}
    report = step(fleet, trainer, 2, seed=8)
    assert report.ok and sorted(report.updated) == ["g0", "g1", "g2"], report
    assert_fleet_sound(fleet, journal, trainer.weights())
    assert_replays(fleet, tmp_path)


def test_a_crash_as_the_rollout_ends_is_skipped_then_picked_up(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    trainer: Trainer,
    fleets: list[RolloutFleet],
) -> None:
    remaining: list[float | None] = [0.5]
    fleet, journal = chaos_fleet(
        tiny_model_dir,
        tmp_path,
        [GroupSpec(1), GroupSpec(1)],
        remaining_work_s=lambda: remaining[0],
        expected_recovery_s=20.0,
    )
    fleets.append(fleet)
    assert step(fleet, trainer, 1, seed=9).ok
    ready_export(fleet, 1)
    fleet.launcher("g1").kill()
    skipped = wait_recovery(fleet, "g1")
    assert skipped.status == "skipped", skipped
    assert fleet.registry.get("g1").state == "inactive" and journal.restarts == []
    assert fleet.generate([1, 2], sampling_params={"max_new_tokens": 1}).group_id == "g0"
    # The next rollout has work left: the inactive group is picked up.
    remaining[0] = 600.0
    assert fleet.recovery is not None
    assert fleet.recovery.recover_inactive() == ["g1"]
    again = wait_recovery(fleet, "g1", 2)
    assert again.status == "active", again
    assert len(results_for(fleet, "g1")) == 2
    assert_fleet_sound(fleet, journal, trainer.weights())
    assert_replays(fleet, tmp_path)
