"""Spare groups (issue #37) on a real fleet of reference-engine processes.

``FleetConfig(spare_groups=1)`` starts a spare beside the serving group: never routed
(``standby``), kept at the fleet's version by every sync, promoted at once when the serving
group is SIGKILLed (the request the kill cut continues on it, token for token), and the killed
group's recovery refills the pool (it comes back in ``standby``). A spare behind the version is
never promoted, a spare that fails is recovered as a spare. Requests are counted at the engine
(the reference engine's ``/get_server_info`` ``tokens_generated``; its vLLM dialect's
``/health`` generates nothing), so "no request reached the spare before its promotion" is the
engine's own word. Waits are bounded by deadlines; nothing asserts a duration.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from chaos_support import WAIT_S, RequestLoop, wait_for
from engine_helpers import (  # noqa: F401  (fixtures)
    stall_groups,
    tiny_model_dir,
    tiny_model_dir_b,
)
from trace_support import assert_run_replays
from transport_helpers import Trainer

from rollsafe import invariants
from rollsafe.adapters.engines import EngineSpec
from rollsafe.fleet import (
    FleetConfig,
    FleetConfigError,
    GroupSpec,
    HealthSettings,
    RecoverySettings,
    RolloutFleet,
)

GREEDY = {"max_new_tokens": 120, "temperature": 0.0, "ignore_eos": True}
PROMPT = [1, 2, 3, 4]
KILL_AT = 25


@pytest.fixture
def trainer(tiny_model_dir_b: Path) -> Trainer:  # noqa: F811
    return Trainer(tiny_model_dir_b)


@pytest.fixture
def fleets() -> Iterator[list[RolloutFleet]]:
    started: list[RolloutFleet] = []
    yield started
    for fleet in started:
        fleet.close()


def spare_fleet(model: Path, tmp: Path, *, dialect: str = "vllm", **kw: Any) -> RolloutFleet:
    """One serving group (``g0``) and one spare (``s0``), immediate recovery on."""
    engine = {"fault_injection": True, **kw.pop("engine", {})}
    fleet = RolloutFleet(
        FleetConfig(
            model_path=model,
            export_root=tmp / "exports",
            groups=[GroupSpec(1)],
            spare_groups=1,
            engine=EngineSpec(model_path=str(model), dialect=dialect, **engine),
            transport="nccl" if dialect == "vllm" else "ipc",
            health=HealthSettings(interval_s=0.2, timeout_s=1.5, failure_threshold=2),
            recovery=RecoverySettings(restart_budget=4, retry_delay_s=0.1, timeout_s=90.0),
            enable_immediate_recovery=True,
            wait_for_routable_s=60.0,
            request_timeout_s=10.0,
            **kw,
        )
    )
    fleet.start()
    return fleet


def server_info(fleet: RolloutFleet, gid: str) -> dict[str, Any]:
    client = fleet.registry.get(gid).client
    assert client is not None
    answer = httpx.get(f"{client.url}/get_server_info", timeout=10.0)
    answer.raise_for_status()
    info: dict[str, Any] = answer.json()
    return info


def kill(fleet: RolloutFleet, gid: str) -> None:
    for pid in fleet.launcher(gid).rank_pids:
        os.kill(pid, signal.SIGKILL)


def transitions(fleet: RolloutFleet, gid: str) -> list[tuple[str, str]]:
    return [
        (r["event"], r["target"])
        for r in fleet.timeline()
        if r["kind"] == "group" and r["subject"] == gid
    ]


def sync(fleet: RolloutFleet, trainer: Trainer, version: int) -> Any:
    trainer.perturb(version)
    report = fleet.sync_weights(trainer.weights(), version)
    assert report.fleet_version_after == version, report
    return report


def assert_sound(fleet: RolloutFleet, run_dir: Path | None = None) -> None:
    """Every invariant the live fleet can judge holds (the spare ones among them), only
    ``active`` groups ever took a request, and (``run_dir``) the recorded run replays through
    the verifier's model (``rollsafe verify --trace``: promotions, enlistments and all)."""
    assert fleet.wait_recoveries(WAIT_S)
    assert fleet.spares is not None and fleet.spares.wait_idle(WAIT_S)
    broken = invariants.check_all(fleet.picture())
    assert not broken, broken
    for gid, counts in fleet.registry.dispatch_counts().items():
        assert set(counts) <= {"active"}, (gid, counts)
    if run_dir is not None:
        assert_run_replays(fleet.record(run_dir, svg=False))


def test_spare_groups_are_checked_at_construction(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    base: dict[str, Any] = {"model_path": tiny_model_dir, "export_root": tmp_path / "exports"}
    with pytest.raises(FleetConfigError) as bad:
        FleetConfig(**base, spare_groups=-1)
    assert bad.value.key == "spare_groups"
    with pytest.raises(FleetConfigError) as mixed:
        FleetConfig(**base, groups=[GroupSpec(1), GroupSpec(2)], spare_groups=1)
    assert mixed.value.key == "spare_groups" and "one size" in str(mixed.value)
    plans = FleetConfig(
        **base, groups=[GroupSpec(2), GroupSpec(2, group_id="s0")], spare_groups=2
    ).validate()
    spares = [p for p in plans if p.spare]
    assert [p.group_id for p in spares] == ["s1", "s2"]  # ids the groups took are skipped
    assert [p.fleet_ranks for p in spares] == [(4, 5), (6, 7)]
    assert not (tmp_path / "exports").exists()


def test_a_spare_takes_over_a_killed_group_mid_request_and_the_pool_refills(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    trainer: Trainer,
    fleets: list[RolloutFleet],
) -> None:
    fleet = spare_fleet(tiny_model_dir, tmp_path)
    fleets.append(fleet)
    registry = fleet.registry
    assert {g.group_id: (g.state, g.machine.spare) for g in registry.groups()} == {
        "g0": ("active", False),
        "s0": ("standby", True),
    }
    report = sync(fleet, trainer, 1)
    assert sorted(report.updated) == ["g0", "s0"], report  # the spare is kept at the version
    assert registry.get("s0").state == "standby"
    assert {m.weights_version for m in registry.get("s0").machine.members.values()} == {1}
    s0_client = registry.get("s0").client
    assert s0_client is not None and s0_client.weight_version() == "1"
    sums = fleet.checksums()
    assert sums["s0"] is not None and sums["s0"] == sums["g0"]
    assert fleet.exporter is not None
    fleet.exporter.wait_hf_export(1, timeout=WAIT_S)

    ref = fleet.generate(PROMPT, sampling_params=GREEDY)  # uninterrupted, on g0 at v1
    assert ref.group_id == "g0"
    with RequestLoop(fleet) as loop:
        assert wait_for(lambda: loop.served_total() >= 10)
    assert set(loop.served) == {"g0"}
    info = server_info(fleet, "s0")
    # the engine's own count: no request ever reached the spare before its promotion
    assert info["tokens_generated"] == 0 and info["running_requests"] == 0, info
    assert registry.get("s0").dispatch_counts() == {}

    killed: list[str] = []

    def progress(gid: str, n: int) -> None:
        if n >= KILL_AT and not killed:
            killed.append(gid)
            kill(fleet, gid)

    stall_groups(fleet, KILL_AT + 1, ["g0"])  # still generating when the reader sees KILL_AT
    fleet.router.on_progress = progress
    out = fleet.generate(PROMPT, sampling_params=GREEDY)
    fleet.router.on_progress = None
    assert killed == ["g0"]
    assert out.output_ids == ref.output_ids  # the cut request continued on the spare
    assert [s.group_id for s in out.segments] == ["g0", "s0"], out.segments
    assert out.segments[0].ended == "failed" and out.segments[0].end >= KILL_AT
    assert registry.get("s0").state == "active" and not registry.get("s0").machine.spare
    assert server_info(fleet, "s0")["tokens_generated"] > 0  # it serves now

    assert fleet.spares is not None
    (promotion,) = fleet.spares.promotions()
    assert (promotion.spare, promotion.covered, promotion.fleet_version) == ("s0", "g0", 1)
    assert promotion.reported == ("1",) and promotion.recorded == (1,)
    # the killed group's recovery refills the pool: it comes back as the spare
    assert wait_for(lambda: registry.get("g0").state == "standby")
    assert registry.get("g0").machine.spare
    assert ("enlist", "inactive") in transitions(fleet, "g0") or (
        "enlist",
        "recovering",
    ) in transitions(fleet, "g0")
    assert ("active", "standby") not in transitions(fleet, "g0")
    # the state moves inside the recovery; its record is kept once the recovery returns
    assert fleet.wait_recoveries(timeout=WAIT_S)
    (recovery,) = [r for r in fleet.recoveries() if r.group_id == "g0"]
    assert recovery.status == "standby", recovery
    assert_sound(fleet)

    # the next sync reaches both, the new spare included; the pool works the other way round
    report = sync(fleet, trainer, 2)
    assert sorted(report.updated) == ["g0", "s0"], report
    sums = fleet.checksums()
    assert sums["g0"] == sums["s0"] is not None
    before = server_info(fleet, "g0")["tokens_generated"]
    with RequestLoop(fleet) as loop:
        assert wait_for(lambda: loop.served_total() >= 5)
        assert server_info(fleet, "g0")["tokens_generated"] == before  # a spare again
        kill(fleet, "s0")
        assert wait_for(lambda: registry.get("g0").state == "active")
        assert wait_for(lambda: registry.get("s0").state == "standby")
        served = loop.served_total()
        assert wait_for(lambda: loop.served_total() > served)
    assert [(p.spare, p.covered) for p in fleet.spares.promotions()] == [
        ("s0", "g0"),
        ("g0", "s0"),
    ]
    assert_sound(fleet, tmp_path / "run")


def test_a_spare_behind_the_version_is_never_promoted_and_a_failed_spare_stays_one(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    trainer: Trainer,
    fleets: list[RolloutFleet],
) -> None:
    """The reference engine's SGLang dialect keeps its weights after a failed update, so under
    ``on_update_failure="stale"`` a spare whose update failed stays up, behind the version."""
    fleet = spare_fleet(tiny_model_dir, tmp_path, dialect="sglang", on_update_failure="stale")
    fleets.append(fleet)
    registry = fleet.registry
    assert fleet.exporter is not None
    sync(fleet, trainer, 1)
    fleet.exporter.wait_hf_export(1, timeout=WAIT_S)

    # a spare that fails is recovered like any group, and comes back a spare
    kill(fleet, "s0")
    assert wait_for(lambda: ("restarted", "standby") in transitions(fleet, "s0"))
    assert ("fail", "inactive") in transitions(fleet, "s0")
    assert registry.get("s0").state == "standby" and registry.get("s0").machine.spare
    assert registry.get("g0").state == "active"

    # a spare whose update failed is behind the version: out of standby until a sync
    s0_client = registry.get("s0").client
    assert s0_client is not None
    httpx.post(
        f"{s0_client.url}/fault/fail_next",
        json={"endpoint": "/update_weights_from_tensor"},
        timeout=10.0,
    ).raise_for_status()
    report = sync(fleet, trainer, 2)
    assert report.failed == ["s0"] and report.marked_stale == ["s0"], report
    assert registry.get("s0").state == "pending_weights"
    fleet.exporter.wait_hf_export(2, timeout=WAIT_S)

    # the serving group is killed: the spare behind the version is not promoted
    kill(fleet, "g0")
    assert wait_for(lambda: registry.get("g0").state != "active")
    assert fleet.spares is not None and fleet.spares.wait_idle(WAIT_S)
    assert wait_for(lambda: registry.get("g0").state == "active")  # its own recovery
    assert fleet.spares.promotions() == []
    assert registry.get("s0").state == "pending_weights"
    covers = [s for s in fleet.spares.log.steps if s.name == "cover"]
    assert covers and not covers[-1].ok and "no spare ready at v2" in covers[-1].detail

    # the next sync brings it back to standby, at the new version
    sync(fleet, trainer, 3)
    assert registry.get("s0").state == "standby"
    assert ("promote", "active") not in transitions(fleet, "s0")
    assert "active" not in {target for _, target in transitions(fleet, "s0")}
    assert registry.get("s0").dispatch_counts() == {}
    assert_sound(fleet, tmp_path / "run")
