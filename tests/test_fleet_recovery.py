"""RecoveryCoordinator: strategy choice, leases, budget, skips, timeouts, and real engines killed.

The first part drives simulated groups (``fleet_sim``) with a real :class:`HFExporter` (tiny
tensors) and an in-memory transport, covering every path quickly: immediate under a lease,
targeted push, deferral (no transport, subset push impossible), budget exhaustion, skipped
recoveries, restarts that raise or hang past their deadline, idempotent submits, and a race with
a sync. The second part runs two real reference engines: SIGKILL, detection by the
HealthManager, then immediate recovery from the ready export (lease held while loading), a
targeted ``nccl`` push to the restarted group only, a recovery skipped near the end of the
rollout (picked up later) and retirement once the budget is spent while the other group serves.
Waits are bounded; no assertion is about timing.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import (
    tiny_model_dir,  # noqa: F401  (fixture)
    tiny_model_dir_b,  # noqa: F401  (fixture)
    wait_for,
)
from fleet_sim import SimEngineClient, bring_up, generate, make_fleet
from transport_helpers import Trainer

import rollsafe.policy as policy
from rollsafe.adapters.engines import EngineLauncher, EngineSpec, EngineUnavailable
from rollsafe.fleet import RecoveryResult, RecoverySettings
from rollsafe.fleet.health import HealthManager
from rollsafe.fleet.recovery import RecoveryClosed, RecoveryCoordinator
from rollsafe.fleet.router import Router
from rollsafe.fleet.sync import SyncCoordinator
from rollsafe.hf import HFExporter
from rollsafe.ports import EngineTarget, StandbyState, StartSource
from rollsafe.registry import FleetRegistry, UnknownGroup, WorkerGroup
from rollsafe.statemachines import ImmediateRecoveryMode
from rollsafe.transports import IPCTransport, NCCLTransport, StagedTransport, TransportError

WAIT_S = 30.0  # bound for waiting on a condition; never asserted as a duration


# ====================================================================== simulated fleet
class SimHandle:
    """A restartable engine handle without a process: records stops and restarts, can raise or
    hang. It declares every :class:`RestartableEngine` member (no warm standby: its
    ``standby_state`` and ``last_start_source`` are None).

    It serves through the group's simulated client; a successful restart clears the client's
    health error (the new process is healthy). ``calls`` holds each restart's weight
    arguments, ``options`` its ``weight_version`` and ``stop_timeout``."""

    standby_state: StandbyState | None = None
    last_start_source: StartSource | None = None

    def __init__(self, client: SimEngineClient) -> None:
        self.calls: list[dict[str, Any]] = []
        self.options: list[dict[str, Any]] = []
        self.stops: list[dict[str, Any]] = []
        self.error: Exception | None = None
        self.gate: threading.Event | None = None
        self.on_restart: Callable[[dict[str, Any]], None] | None = None
        self._client = client

    def stop(self, *, timeout: float = 10.0, keep_standby: bool = False) -> None:
        self.stops.append({"timeout": timeout, "keep_standby": keep_standby})

    def restart(
        self,
        *,
        model_path: str | None = None,
        load_format: str | None = None,
        skip_load_weights: bool | None = None,
        weight_version: str | None = None,
        stop_timeout: float = 10.0,
    ) -> SimHandle:
        kw = {
            "model_path": model_path,
            "load_format": load_format,
            "skip_load_weights": skip_load_weights,
        }
        self.calls.append(kw)
        self.options.append({"weight_version": weight_version, "stop_timeout": stop_timeout})
        if self.on_restart is not None:
            self.on_restart(kw)
        if self.gate is not None:
            self.gate.wait()
        if self.error is not None:
            raise self.error
        self._client.health_error = None  # a fresh process answers its health checks
        return self

    @property
    def client(self) -> SimEngineClient:
        return self._client

    def standby_status(self) -> dict[str, Any]:
        return {"state": "none"}


class MemoryTransport(StagedTransport):
    """Stages nothing; a push records the target (or fails/raises as told)."""

    name = "memory"

    def __init__(self, world_size: int) -> None:
        super().__init__(world_size)
        self.pushed: list[str] = []
        self.fail: set[str] = set()
        self.raise_on_update: Exception | None = None

    def _stage(
        self, items: list[tuple[str, torch.Tensor]], version: int
    ) -> tuple[Sequence[int], Sequence[str]]:
        return list(range(self.registration.world_size)), [n for n, _ in items]

    def update(self, targets: Sequence[EngineTarget]) -> Any:
        if self.raise_on_update is not None:
            raise self.raise_on_update
        return super().update(targets)

    def _push(self, target: EngineTarget) -> int:
        self.pushed.append(target.name)
        if target.name in self.fail:
            raise RuntimeError(f"push to {target.name} failed")
        return 1


def sim_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(8, 8, generator=gen) for i in range(3)}


def fail_group(reg: FleetRegistry, gid: str) -> None:
    group = reg.get(gid)
    for r in group.ranks:
        reg.report_member(gid, r, healthy=False)
    reg.send(gid, "fail")


class SimFleet:
    """Registry + handles + exporter + transport + mode, and a coordinator factory."""

    def __init__(self, tmp_path: Path, *, sizes: Sequence[int] = (1, 2), budget: int = 3) -> None:
        self.reg, self.clients = make_fleet(sizes, version=1, restart_budget=budget, bind=False)
        self.handles = {gid: SimHandle(c) for gid, c in self.clients.items()}
        self.exporter = HFExporter(tmp_path / "exports")
        self.transport = MemoryTransport(sum(sizes))
        self.mode = ImmediateRecoveryMode(enabled=True)
        self.coordinators: list[RecoveryCoordinator] = []

    def export_ready(self, version: int = 1) -> Path:
        self.exporter.start_hf_export(sim_tensors(version), version)
        return self.exporter.wait_hf_export(version, timeout=WAIT_S)

    def register(self, version: int = 1) -> None:
        self.transport.register(sim_tensors(version), version)

    def coordinator(self, **kw: Any) -> RecoveryCoordinator:
        """A coordinator over this fleet; keywords naming a ``RecoverySettings`` field (or
        ``recovery_timeout_s`` for ``timeout_s``) go into its settings."""
        fields = {f.name for f in dataclasses.fields(RecoverySettings)}
        knobs: dict[str, Any] = {"retry_delay_s": 0.0}
        args: dict[str, Any] = {
            "launcher_for": self.handles.__getitem__,
            "exporter": self.exporter,
            "transport": self.transport,
            "mode": self.mode,
        }
        for key, value in kw.items():
            name = "timeout_s" if key == "recovery_timeout_s" else key
            (knobs if name in fields else args)[name] = value
        rc = RecoveryCoordinator(self.reg, settings=RecoverySettings(**knobs), **args)
        self.coordinators.append(rc)
        return rc

    def close(self) -> None:
        for rc in self.coordinators:
            rc.close(timeout=5.0)


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[SimFleet]:
    fleet = SimFleet(tmp_path)
    yield fleet
    for h in fleet.handles.values():
        if h.gate is not None:
            h.gate.set()
    fleet.close()


def names(result: RecoveryResult) -> list[str]:
    return [s.name for s in result.steps]


def test_immediate_restarts_from_the_ready_export_under_a_lease(sim: SimFleet) -> None:
    path = sim.export_ready(1)
    sim.register(1)
    record = sim.exporter.latest_ready(1)
    assert record is not None
    leases_during_restart: list[int] = []
    sim.handles["g1"].on_restart = lambda kw: leases_during_restart.append(
        len(record.lifecycle.leases)
    )
    rc = sim.coordinator()
    fail_group(sim.reg, "g1")
    result = rc.submit("g1", failed_at=time.time()).result(WAIT_S)

    assert result.status == "active" and result.strategy == "immediate"
    assert sim.handles["g1"].calls == [
        {"model_path": str(path), "load_format": None, "skip_load_weights": False}
    ]
    # the restart reports the export's version; the shutdown before it keeps the standby
    stop_s = rc.settings.stop_timeout_s
    assert sim.handles["g1"].options == [{"weight_version": "1", "stop_timeout": stop_s}]
    assert sim.handles["g1"].stops == [{"timeout": stop_s, "keep_standby": True}]
    assert leases_during_restart == [1]  # held while the engine loads ...
    assert record.lifecycle.leases == ()  # ... and released afterwards
    assert sim.transport.pushed == []  # no push needed
    group = sim.reg.get("g1")
    assert group.state == "active"
    assert all(m.weights_version == 1 and m.healthy for m in group.machine.members.values())
    assert group.machine.restart_budget == 2
    assert result.export_version == 1 and result.latency_s is not None
    assert names(result) == [
        "claim",
        "lease",
        "launcher",
        "shutdown",
        "restart",
        "health",
        "restarted",
    ]
    assert rc.recoveries() == [result]
    assert rc.summary()["by_strategy"] == {"immediate": 1}
    assert sim.reg.get("g0").state == "active"


class StandbyHandle(SimHandle):
    """A SimHandle that tells its standby state and where its last start came from, as an
    ``EngineLauncher`` does."""

    def __init__(self, client: SimEngineClient) -> None:
        super().__init__(client)
        self.standby_state = "warming"

    def restart(self, **kw: Any) -> SimHandle:
        super().restart(**kw)
        self.last_start_source, self.standby_state = "warming_standby", "none"
        return self


def test_the_result_records_the_standby_and_the_restart_source(sim: SimFleet) -> None:
    """A handle that tells gets its standby state at the attempt and the restart's source
    recorded; one that does not leaves both None."""
    sim.export_ready(1)
    sim.register(1)
    plain = sim.handles["g1"]
    sim.handles["g1"] = StandbyHandle(sim.clients["g1"])
    rc = sim.coordinator()
    fail_group(sim.reg, "g1")
    result = rc.submit("g1", failed_at=time.time()).result(WAIT_S)
    assert result.status == "active"
    assert result.standby_at_restart == "warming"
    assert result.restart_source == "warming_standby"
    assert result.as_dict()["restart_source"] == "warming_standby"
    restart = next(s for s in result.steps if s.name == "restart")
    assert restart.detail.startswith("source=warming_standby (standby was warming)")
    assert rc.summary()["by_restart_source"] == {"warming_standby": 1}

    sim.handles["g1"] = plain  # a plain handle: nothing known
    fail_group(sim.reg, "g1")
    second = rc.submit("g1", failed_at=time.time()).result(WAIT_S)
    assert second.status == "active"
    assert second.standby_at_restart is None and second.restart_source is None
    assert sim.reg.snapshot()["groups"]["g1"]["standby"] == {"state": "none"}


def test_the_registry_snapshot_shows_the_standby_probe() -> None:
    from rollsafe.registry import FleetRegistry

    reg = FleetRegistry()
    status = {"state": "warming", "pid": 12, "fallbacks": 0}
    reg.add_group("a", [0], standby_probe=lambda: status)
    reg.add_group("b", [1], standby_probe=lambda: 1 / 0)  # type: ignore[arg-type, return-value]
    reg.add_group("c", [2])
    groups = reg.snapshot()["groups"]
    assert groups["a"]["standby"] == status and reg.get("a").standby_state == "warming"
    status["state"] = "ready"
    assert reg.get("a").standby_state == "ready"
    assert groups["b"]["standby"]["state"] == "none"
    assert "ZeroDivisionError" in groups["b"]["standby"]["error"]
    assert groups["c"]["standby"] == {"state": "none"}


def test_targeted_push_when_immediate_is_disabled(sim: SimFleet) -> None:
    sim.export_ready(1)
    sim.register(1)
    sim.mode.disable()
    rc = sim.coordinator()
    fail_group(sim.reg, "g1")
    result = rc.submit("g1").result(WAIT_S)
    assert result.status == "active" and result.strategy == "targeted_push"
    assert sim.handles["g1"].calls[0]["skip_load_weights"] is True
    assert sim.transport.pushed == ["g1"]  # that group only
    lease_step = next(s for s in result.steps if s.name == "lease")
    assert not lease_step.ok and "disabled" in lease_step.detail
    transitions = [t.event for t in sim.reg.get("g1").recent_transitions()]
    assert transitions[-3:] == ["claim", "restarted", "weights_loaded"]
    assert sim.transport.registration.state == "registered"


def test_no_ready_export_of_the_current_version_means_push(sim: SimFleet) -> None:
    sim.export_ready(1)
    sim.reg.fleet_version = 2  # the export of v1 is too old now
    sim.register(2)
    rc = sim.coordinator()
    fail_group(sim.reg, "g1")
    result = rc.submit("g1").result(WAIT_S)
    assert result.strategy == "targeted_push" and result.status == "active"
    assert all(m.weights_version == 2 for m in sim.reg.get("g1").machine.members.values())


@pytest.mark.parametrize("its_recovery", ["still_finishing", "ended"])
def test_a_group_back_below_the_version_during_a_sync_is_pushed_the_version_at_once(
    sim: SimFleet, its_recovery: str
) -> None:
    """g1's restart from the export of v1 ends while the sync of v2 updates g0: the sync marks
    it stale (``settle_latecomers``) and hands it over; the coordinator pushes v2 to g1 alone,
    with no second sync (the stress run's finding: the demo's last sync left it at v1).
    ``still_finishing``: the hand-over comes while the recovery that restarted it has not
    ended yet (its result hook holds it), the usual case: the push follows that run."""
    sim.export_ready(1)
    sim.register(1)
    rc = sim.coordinator()
    handed = threading.Event()
    if its_recovery == "still_finishing":
        rc.on_result = lambda _result: handed.wait(WAIT_S)
    gate = sim.handles["g1"].gate = threading.Event()
    fail_group(sim.reg, "g1")
    first = rc.submit("g1", failed_at=time.time())
    assert wait_for(lambda: sim.handles["g1"].calls != [], WAIT_S)  # restarting from v1's export

    class BackDuringUpdate(MemoryTransport):
        def update(self, targets: Any) -> Any:
            if not gate.is_set():  # the sync's update (the push comes after)
                gate.set()
                assert wait_for(lambda: sim.reg.get("g1").state == "active", WAIT_S)  # at v1
                if its_recovery == "ended":
                    first.result(WAIT_S)
            return super().update(targets)

    transport = BackDuringUpdate(3)
    rc.transport = transport
    transport.register(sim_tensors(1), 1)

    def stale(group_id: str, reason: str) -> None:
        rc.on_group_stale(group_id, reason)
        handed.set()

    sync = SyncCoordinator(
        sim.reg, transport, on_group_failed=rc.on_update_failed, on_group_stale=stale
    )
    report = sync.sync(sim_tensors(2), 2)
    assert report.ok and report.updated == ["g0"], report
    assert report.marked_stale == report.latecomers == ["g1"]
    assert first.result(WAIT_S).status == "active" and first.result().export_version == 1
    assert wait_for(lambda: len(rc.recoveries()) == 2, WAIT_S) and rc.wait_idle(WAIT_S)
    push = rc.recoveries()[-1]
    assert (push.group_id, push.status, push.strategy) == ("g1", "active", "targeted_push")
    assert names(push) == ["push"] and "v2" in push.reason
    assert transport.pushed == ["g0", "g1"]  # the sync's update, then g1 alone
    group = sim.reg.get("g1")
    assert group.state == "active"
    assert all(m.weights_version == 2 for m in group.machine.members.values())
    assert [t.event for t in group.recent_transitions()][-3:] == [
        "restarted",
        "mark_stale",
        "weights_loaded",
    ]


def test_deferred_without_transport_or_when_subset_push_is_impossible(sim: SimFleet) -> None:
    sim.register(1)
    rc = sim.coordinator(transport=None, mode=None)
    fail_group(sim.reg, "g0")
    result = rc.submit("g0").result(WAIT_S)
    assert result.status == "pending_weights" and result.strategy == "deferred"
    assert "no transport" in result.reason
    assert sim.reg.get("g0").state == "pending_weights"

    sim.transport.raise_on_update = TransportError("P2P unavailable for ranks [1, 2]")
    rc2 = sim.coordinator()
    sim.mode.disable()
    fail_group(sim.reg, "g1")
    result = rc2.submit("g1").result(WAIT_S)
    assert result.status == "pending_weights" and result.strategy == "deferred"
    assert "P2P unavailable" in result.reason
    assert not sim.reg.get("g1").is_routable


def test_failed_push_defers_and_a_sync_may_finish_the_job(sim: SimFleet) -> None:
    sim.register(1)
    sim.transport.fail = {"g1"}
    rc = sim.coordinator(mode=None)
    fail_group(sim.reg, "g1")
    result = rc.submit("g1").result(WAIT_S)
    assert result.status == "pending_weights" and "push failed" in result.reason
    # The next sync updates the pending group and brings it back.
    sim.transport.fail = set()
    sync = SyncCoordinator(sim.reg, sim.transport)
    report = sync.sync(sim_tensors(2), 2)
    assert report.weights_loaded == ["g1"] and sim.reg.get("g1").state == "active"


def test_failed_push_into_an_engine_that_keeps_no_weights_restarts_it(sim: SimFleet) -> None:
    """vLLM (and SGLang) keep no known weights after a failed update and still answer
    /health: the group is failed and restarted again, never left waiting for a push."""
    sim.register(1)
    sim.transport.fail = {"g1"}
    # the second restart's push succeeds
    sim.handles["g1"].on_restart = lambda kw: (
        sim.transport.fail.clear() if len(sim.handles["g1"].calls) == 2 else None
    )
    vllm = policy.engine_traits("vllm")
    rc = sim.coordinator(mode=None, traits_for=lambda _group: vllm)
    fail_group(sim.reg, "g1")
    result = rc.submit("g1").result(WAIT_S)
    assert result.status == "active" and result.attempts == 2, result
    assert len(sim.handles["g1"].calls) == 2 and sim.transport.pushed == ["g1", "g1"]
    # after the failed push the group went out of routing and back to a restart
    states = [r.target for r in sim.reg.get("g1").machine.history]
    at = states.index("recovering")
    assert states[at : at + 5] == [
        "recovering",
        "pending_weights",
        "inactive",
        "recovering",
        "pending_weights",
    ], states
    assert sim.reg.get("g1").state == "active"


def test_budget_exhaustion_retires_and_the_fleet_goes_on(tmp_path: Path) -> None:
    fleet = SimFleet(tmp_path, budget=2)
    try:
        fleet.handles["g0"].error = RuntimeError("engine would not start")
        rc = fleet.coordinator(mode=None)
        fail_group(fleet.reg, "g0")
        result = rc.submit("g0").result(WAIT_S)
        assert result.status == "retired"
        assert result.attempts == 2 and len(fleet.handles["g0"].calls) == 2
        assert fleet.reg.get("g0").state == "retired"
        events = [t.event for t in fleet.reg.get("g0").recent_transitions()]
        assert events[-5:] == ["claim", "restart_failed", "claim", "restart_failed", "retire"]
        assert fleet.reg.get("g1").state == "active"
        assert [g.group_id for g in fleet.reg.routable()] == ["g1"]
    finally:
        fleet.close()


def test_no_retry_leaves_the_group_inactive_after_one_failure(sim: SimFleet) -> None:
    sim.handles["g0"].error = RuntimeError("boom")
    rc = sim.coordinator(retry=False, mode=None)
    fail_group(sim.reg, "g0")
    result = rc.submit("g0").result(WAIT_S)
    assert result.status == "failed" and "boom" in result.reason
    assert sim.reg.get("g0").state == "inactive"
    assert sim.reg.get("g0").machine.restart_budget == 2


def test_recovery_is_skipped_when_the_rollout_is_about_to_finish(sim: SimFleet) -> None:
    remaining: list[float | None] = [1.0]
    rc = sim.coordinator(remaining_work_s=lambda: remaining[0], expected_recovery_s=30.0)
    fail_group(sim.reg, "g0")
    result = rc.submit("g0").result(WAIT_S)
    assert result.status == "skipped" and "about to finish" in result.reason
    assert sim.handles["g0"].calls == []
    group = sim.reg.get("g0")
    assert group.state == "inactive" and group.machine.restart_budget == 3  # nothing consumed
    remaining[0] = None  # unknown: recover
    assert rc.recover_inactive() == ["g0"]
    assert wait_for(lambda: group.state == "pending_weights", WAIT_S)


def test_submit_is_idempotent_and_not_needed_on_healthy_groups(sim: SimFleet) -> None:
    gate = threading.Event()
    sim.handles["g0"].gate = gate
    rc = sim.coordinator(mode=None)
    fail_group(sim.reg, "g0")
    first = rc.submit("g0")
    assert rc.submit("g0") is first
    assert wait_for(lambda: len(sim.handles["g0"].calls) == 1, WAIT_S)
    assert rc.in_progress("g0") and rc.running() == ["g0"]
    gate.set()
    assert first.result(WAIT_S).status == "pending_weights"
    assert len(sim.handles["g0"].calls) == 1
    other = rc.submit("g1").result(WAIT_S)
    assert other.status == "not_needed"
    with pytest.raises(UnknownGroup):
        rc.submit("nope")
    rc.close()
    with pytest.raises(RecoveryClosed):
        rc.submit("g0")


def test_a_hung_restart_times_out_without_blocking_others_or_leaking_the_lease(
    sim: SimFleet,
) -> None:
    sim.export_ready(1)
    sim.register(1)
    record = sim.exporter.latest_ready(1)
    assert record is not None
    gate = threading.Event()
    sim.handles["g0"].gate = gate
    rc = sim.coordinator(recovery_timeout_s=0.5, max_workers=1)
    fail_group(sim.reg, "g0")
    fail_group(sim.reg, "g1")
    stuck = rc.submit("g0")
    result = stuck.result(WAIT_S)
    assert result.status == "failed" and "did not finish" in result.reason
    assert sim.reg.get("g0").state == "inactive"
    assert len(record.lifecycle.leases) == 1  # the background restart still loads from it
    # The single pool worker is free again: g1 recovers while g0's restart hangs.
    other = rc.submit("g1").result(WAIT_S)
    assert other.status == "active" and other.strategy == "immediate"
    # While the hung step runs, g0 is not restarted a second time.
    assert rc.submit("g0").result(WAIT_S).status == "failed"
    assert len(sim.handles["g0"].calls) == 1
    # The hung restart ends: its lease is released and g0 is recovered again (retry).
    sim.handles["g0"].gate = None
    gate.set()
    assert wait_for(lambda: sim.reg.get("g0").state == "active", WAIT_S)
    assert wait_for(lambda: record.lifecycle.leases == (), WAIT_S)
    assert len(sim.handles["g0"].calls) == 2


def test_health_manager_hands_off_and_keeps_probing_while_a_recovery_hangs(
    sim: SimFleet,
) -> None:
    gate = threading.Event()
    sim.handles["g0"].gate = gate
    rc = sim.coordinator(mode=None)
    hm = HealthManager(
        sim.reg, interval_s=60, timeout_s=2, failure_threshold=1, on_group_failed=rc.on_group_failed
    )
    try:
        sim.clients["g0"].health_error = EngineUnavailable("http://sim-g0", "/health", "refused")
        hm.check_now()
        assert wait_for(lambda: len(sim.handles["g0"].calls) == 1, WAIT_S)
        assert sim.reg.get("g0").state == "recovering"
        # Probes go on while g0's restart hangs: g1 fails and is recovered meanwhile.
        sim.clients["g1"].health_error = EngineUnavailable("http://sim-g1", "/health", "refused")
        rnd = hm.check_now()
        assert rnd.failed_groups == ("g1",)
        assert wait_for(lambda: sim.reg.get("g1").state == "pending_weights", WAIT_S)
        gate.set()
        assert wait_for(lambda: sim.reg.get("g0").state == "pending_weights", WAIT_S)
    finally:
        gate.set()
        hm.stop()


def test_fleet_moving_on_during_an_immediate_restart_ends_with_a_push(sim: SimFleet) -> None:
    sim.export_ready(1)
    sim.register(1)
    sync = SyncCoordinator(sim.reg, sim.transport, exporter=None)

    def sync_meanwhile(kw: dict[str, Any]) -> None:
        report = sync.sync(sim_tensors(2), 2)  # the restarting group is not targeted
        assert "g1" in report.not_targeted

    sim.handles["g1"].on_restart = sync_meanwhile
    rc = sim.coordinator()
    fail_group(sim.reg, "g1")
    result = rc.submit("g1").result(WAIT_S)
    assert result.status == "active" and result.strategy == "targeted_push"
    assert result.export_version == 1
    assert all(m.weights_version == 2 for m in sim.reg.get("g1").machine.members.values())


def test_bad_arguments_fail_at_construction(sim: SimFleet) -> None:
    with pytest.raises(ValueError, match="max_workers"):
        RecoverySettings(max_workers=0)
    with pytest.raises(ValueError, match=r"recovery\.timeout_s"):
        RecoverySettings(timeout_s=0)
    with pytest.raises(TypeError, match="RecoverySettings"):
        RecoveryCoordinator(
            sim.reg,
            launcher_for=sim.handles.__getitem__,
            settings={"timeout_s": 1.0},  # type: ignore[arg-type]
        )


# ====================================================================== real engines
@pytest.fixture(scope="module")
def trainer(tiny_model_dir_b: Path) -> Trainer:  # noqa: F811
    return Trainer(tiny_model_dir_b)


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> Iterator[dict[str, EngineLauncher]]:  # noqa: F811
    launchers = {
        gid: EngineLauncher(EngineSpec(model_path=str(tiny_model_dir), ranks=1))
        for gid in ("e0", "e1")
    }
    try:
        for launcher in launchers.values():
            launcher.start()
        yield launchers
    finally:
        for launcher in launchers.values():
            launcher.stop(timeout=5.0)


class LeaseWatch:
    """Forwards to a launcher; records, at each restart, the leases held on ``exporter``."""

    def __init__(self, launcher: EngineLauncher, exporter: HFExporter | None) -> None:
        self.launcher = launcher
        self.exporter = exporter
        self.leases_at_restart: list[int] = []
        self.restarts: list[dict[str, Any]] = []

    def restart(
        self,
        *,
        model_path: str | None = None,
        load_format: str | None = None,
        skip_load_weights: bool | None = None,
        weight_version: str | None = None,
        stop_timeout: float = 10.0,
    ) -> EngineLauncher:
        self.restarts.append({"model_path": model_path, "skip_load_weights": skip_load_weights})
        if self.exporter is not None:
            self.leases_at_restart.append(
                sum(len(r.lifecycle.leases) for r in self.exporter.exports())
            )
        return self.launcher.restart(
            model_path=model_path,
            load_format=load_format,
            skip_load_weights=skip_load_weights,
            weight_version=weight_version,
            stop_timeout=stop_timeout,
        )

    def stop(self, *, timeout: float = 10.0, keep_standby: bool = False) -> None:
        self.launcher.stop(timeout=timeout, keep_standby=keep_standby)

    @property
    def client(self) -> Any:
        return self.launcher.client

    @property
    def standby_state(self) -> StandbyState | None:
        return self.launcher.standby_state

    @property
    def last_start_source(self) -> StartSource | None:
        return self.launcher.last_start_source

    def standby_status(self) -> dict[str, Any]:
        return self.launcher.standby_status()


def real_fleet(
    engines: dict[str, EngineLauncher], *, version: int = 0, budgets: Sequence[int] = (3, 3)
) -> FleetRegistry:
    reg = FleetRegistry(fleet_version=version)
    for rank, ((gid, launcher), budget) in enumerate(zip(engines.items(), budgets, strict=True)):
        reg.add_group(gid, [rank], clients=[launcher.client], restart_budget=budget)
        bring_up(reg, gid)
    return reg


def sigkill(launcher: EngineLauncher) -> None:
    os.kill(launcher.pid, signal.SIGKILL)


def engine_checksum(group: WorkerGroup) -> str | None:
    assert group.client is not None
    return group.client.weights_checksum().model


def health(reg: FleetRegistry, rc: RecoveryCoordinator) -> HealthManager:
    return HealthManager(
        reg,
        interval_s=0.2,
        timeout_s=2.0,
        failure_threshold=2,
        on_group_failed=rc.on_group_failed,
    ).start()


def wait_result(rc: RecoveryCoordinator, gid: str, n: int = 1) -> RecoveryResult:
    assert wait_for(lambda: len([r for r in rc.recoveries() if r.group_id == gid]) >= n, 120.0)
    return [r for r in rc.recoveries() if r.group_id == gid][n - 1]


def test_real_kill_then_immediate_recovery_from_the_export(
    engines: dict[str, EngineLauncher],
    trainer: Trainer,
    tiny_model_dir_b: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    # e0's launcher last started on dummy weights (as after a targeted push, or a spec that
    # starts on dummy ones): the immediate restart must still load the export's real weights
    engines["e0"].restart(skip_load_weights=True)
    reg = real_fleet(engines)
    exporter = HFExporter(tmp_path / "exports", template_dir=tiny_model_dir_b)
    transport = IPCTransport(2)
    mode = ImmediateRecoveryMode(enabled=True)
    sync = SyncCoordinator(reg, transport, exporter=exporter, mode=mode)
    trainer.perturb(11)
    report = sync.sync(trainer.weights(), 1)
    assert report.ok and report.updated == ["e0", "e1"]
    exporter.wait_hf_export(1, timeout=60)
    want = trainer.checksum()

    watch = LeaseWatch(engines["e0"], exporter)
    rc = RecoveryCoordinator(
        reg,
        launcher_for={"e0": watch}.__getitem__,
        exporter=exporter,
        transport=transport,
        mode=mode,
        settings=RecoverySettings(timeout_s=120.0),
    )
    hm = health(reg, rc)
    try:
        sigkill(engines["e0"])
        result = wait_result(rc, "e0")
    finally:
        hm.stop()
        rc.close()
        transport.close()
    assert result.status == "active" and result.strategy == "immediate", result
    assert watch.restarts[0] == {
        "model_path": str(exporter.root / "hf-v1"),
        "skip_load_weights": False,
    }
    assert watch.leases_at_restart == [1]  # lease held while the engine loaded the export
    assert all(not r.lifecycle.leases for r in exporter.exports())  # released afterwards
    group = reg.get("e0")
    assert group.state == "active" and group.client is engines["e0"].client
    assert engine_checksum(group) == want
    assert engine_checksum(reg.get("e1")) == want
    assert result.latency_s is not None and result.step_seconds("restart") > 0


def test_real_targeted_push_over_an_nccl_subset(
    engines: dict[str, EngineLauncher], trainer: Trainer
) -> None:
    reg = real_fleet(engines, version=1)
    transport = NCCLTransport(2, backend="gloo", group_timeout=60.0)
    sync = SyncCoordinator(reg, transport)
    trainer.perturb(12)
    report = sync.sync(trainer.weights(), 2)
    assert report.ok and report.updated == ["e0", "e1"], report
    want = trainer.checksum()
    assert engine_checksum(reg.get("e0")) == want == engine_checksum(reg.get("e1"))

    watch = LeaseWatch(engines["e1"], None)
    rc = RecoveryCoordinator(
        reg,
        launcher_for={"e1": watch}.__getitem__,
        transport=transport,
        mode=ImmediateRecoveryMode(enabled=False),
        settings=RecoverySettings(timeout_s=120.0),
    )
    hm = health(reg, rc)
    try:
        sigkill(engines["e1"])
        result = wait_result(rc, "e1")
    finally:
        hm.stop()
        rc.close()
        transport.close()
    assert result.status == "active" and result.strategy == "targeted_push", result
    assert watch.restarts == [{"model_path": None, "skip_load_weights": True}]
    events = [t.event for t in reg.get("e1").recent_transitions()]
    assert events[-4:] == ["fail", "claim", "restarted", "weights_loaded"]
    assert engine_checksum(reg.get("e1")) == want
    assert reg.get("e0").state == "active"


def test_real_crash_near_the_end_is_skipped_then_picked_up(
    engines: dict[str, EngineLauncher], trainer: Trainer
) -> None:
    reg = real_fleet(engines, version=2)
    remaining: list[float | None] = [0.5]
    rc = RecoveryCoordinator(
        reg,
        launcher_for=engines.__getitem__,
        settings=RecoverySettings(
            remaining_work_s=lambda: remaining[0], expected_recovery_s=20.0, timeout_s=120.0
        ),
    )
    hm = health(reg, rc)
    try:
        sigkill(engines["e1"])
        result = wait_result(rc, "e1")
        assert result.status == "skipped" and "about to finish" in result.reason
        assert reg.get("e1").state == "inactive"
        assert not engines["e1"].is_alive()  # nothing was restarted
        assert [g.group_id for g in reg.routable()] == ["e0"]
        # The next rollout has plenty of work left: the inactive group is picked up.
        remaining[0] = 600.0
        assert rc.recover_inactive() == ["e1"]
        again = wait_result(rc, "e1", 2)
    finally:
        hm.stop()
        rc.close()
    assert again.status == "pending_weights" and again.strategy == "deferred"  # no transport
    assert engines["e1"].is_alive()


def test_real_budget_exhaustion_retires_while_the_other_group_serves(
    engines: dict[str, EngineLauncher],
) -> None:
    reg = real_fleet(engines, version=3, budgets=(0, 3))
    rc = RecoveryCoordinator(reg, launcher_for=engines.__getitem__)
    hm = health(reg, rc)
    router = Router(reg)
    try:
        sigkill(engines["e0"])
        result = wait_result(rc, "e0")
        assert result.status == "retired"
        assert reg.get("e0").state == "retired"
        for _ in range(3):
            routed = generate(router, [1, 2, 3], sampling_params={"max_new_tokens": 2})
            assert routed.group_id == "e1"
        assert reg.dispatch_counts()["e0"].keys() <= {"active"}
    finally:
        hm.stop()
        rc.close()
