"""SyncCoordinator: register -> update active and pending groups -> versions -> export, and the
judging of the previous export (late: suspend and abandon; K on time: re-arm).

The first part uses simulated groups and an in-memory transport (every branch: failed register,
failed and raising updates, unhealthy and pending groups, hook order in colocated mode, failed
exports). The second part syncs real reference engines (one 1-rank, one 2-rank) over ``ipc``:
every engine's checksum equals the trainer's and the export is written and verifies; then an
export held back past the next sync suspends immediate recovery, is abandoned and never leased,
and two on-time exports re-arm the mode. Waits are bounded; no assertion is about timing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from engine_helpers import (
    tiny_model_dir,  # noqa: F401  (fixture)
    tiny_model_dir_b,  # noqa: F401  (fixture)
)
from fleet_sim import bring_up, make_fleet
from hf_support import gated_writer, hidden_entries
from transport_helpers import Trainer

import rollsafe.policy as rollsafe_policy
from rollsafe.adapters.engines import EngineLauncher, EngineSpec
from rollsafe.checksum import weights_checksum
from rollsafe.fleet import SyncError, SyncVersionError
from rollsafe.fleet.sync import SyncCoordinator, shared_transport_lock
from rollsafe.hf import HFExporter, UnknownExport, verify_hf_dir
from rollsafe.ports import EngineTarget, UpdateReport
from rollsafe.registry import FleetRegistry
from rollsafe.statemachines import ImmediateRecoveryMode
from rollsafe.transports import IPCTransport, RegisterError, StagedTransport, TransportError

WAIT_S = 60.0  # bound for waiting on a condition; never asserted as a duration


# ====================================================================== simulated fleet
class MemoryTransport(StagedTransport):
    """Stages nothing; a push records the target (or fails/raises as told)."""

    name = "memory"

    def __init__(self, world_size: int, log: list[str] | None = None) -> None:
        super().__init__(world_size)
        self.pushed: list[list[str]] = []
        self.fail: set[str] = set()
        self.register_error: Exception | None = None
        self.raise_on_update: Exception | None = None
        self.log = log if log is not None else []

    def _stage(
        self, items: list[tuple[str, torch.Tensor]], version: int
    ) -> tuple[Sequence[int], Sequence[str]]:
        self.log.append("register")
        if self.register_error is not None:
            raise self.register_error
        return list(range(self.registration.world_size)), [n for n, _ in items]

    def update(self, targets: Sequence[EngineTarget]) -> UpdateReport:
        self.log.append("update")
        self.pushed.append([t.name for t in targets])
        if self.raise_on_update is not None:
            raise self.raise_on_update
        return super().update(targets)

    def _push(self, target: EngineTarget) -> int:
        if target.name in self.fail:
            raise RuntimeError(f"engine {target.name} died mid-update")
        return 1


def tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(8, 8, generator=gen) for i in range(3)}


def versions(reg: FleetRegistry, gid: str) -> set[int | None]:
    return {m.weights_version for m in reg.get(gid).machine.members.values()}


@pytest.fixture
def fleet() -> tuple[FleetRegistry, MemoryTransport]:
    reg, _ = make_fleet((1, 2, 1), version=1, bind=False)
    return reg, MemoryTransport(4)


def test_sync_updates_every_serving_group_and_starts_the_export(
    fleet: tuple[FleetRegistry, MemoryTransport], tmp_path: Path
) -> None:
    reg, transport = fleet
    exporter = HFExporter(tmp_path / "exports")
    sync = SyncCoordinator(reg, transport, exporter=exporter)
    report = sync.sync(tensors(2), 2)
    assert report.ok and report.error is None
    assert report.updated == ["g0", "g1", "g2"] and report.failed == []
    assert transport.pushed == [["g0", "g1", "g2"]]
    assert reg.fleet_version == 2 and report.fleet_version_after == 2
    assert all(versions(reg, g) == {2} for g in ("g0", "g1", "g2"))
    assert [g.group_id for g in reg.routable()] == ["g0", "g1", "g2"]
    assert report.export_started and sync.last_export_version == 2
    assert report.previous_export == "none"
    path = exporter.wait_hf_export(2, timeout=WAIT_S)
    assert verify_hf_dir(path).version == 2
    assert {"judge_export_s", "register_s", "update_s", "versions_s", "total_s"} <= set(
        report.timings
    )
    assert sync.reports() == [report] and report.as_dict()["updated"] == ["g0", "g1", "g2"]
    with pytest.raises(SyncVersionError, match="version 2"):
        sync.sync(tensors(3), 2)  # not newer: refused, nothing changes
    assert len(sync.reports()) == 1


def test_failed_register_publishes_nothing_and_keeps_the_version(
    fleet: tuple[FleetRegistry, MemoryTransport], tmp_path: Path
) -> None:
    reg, transport = fleet
    exporter = HFExporter(tmp_path / "exports")
    transport.register_error = RegisterError("rank 3 ran out of pinned memory")
    sync = SyncCoordinator(reg, transport, exporter=exporter)
    report = sync.sync(tensors(2), 2)
    assert not report.ok and "pinned memory" in (report.error or "")
    assert reg.fleet_version == 1 and report.fleet_version_after == 1
    assert transport.registration.published is None
    assert transport.pushed == [] and report.updated == []
    assert not report.export_started and exporter.exports() == []
    assert all(g.state == "active" and versions(reg, g.group_id) == {1} for g in reg.groups())
    # The next sync works again.
    transport.register_error = None
    assert sync.sync(tensors(3), 3).ok and reg.fleet_version == 3


@pytest.mark.parametrize("engine", ["reference", "vllm", "sglang"])
@pytest.mark.parametrize("policy", ["fail", "stale"])
def test_a_failed_update_takes_the_group_out(
    fleet: tuple[FleetRegistry, MemoryTransport], policy: Any, engine: str
) -> None:
    reg, transport = fleet
    transport.fail = {"g1"}
    handed: list[tuple[str, str]] = []
    traits = rollsafe_policy.engine_traits(engine)
    sync = SyncCoordinator(
        reg,
        transport,
        on_update_failure=policy,
        on_group_failed=lambda gid, why: handed.append((gid, why)),
        traits_for=lambda _group: traits,
    )
    report = sync.sync(tensors(2), 2)
    assert report.ok and report.updated == ["g0", "g2"] and report.failed == ["g1"]
    assert "died mid-update" in report.update_results["g1"].reason
    # "stale" leaves a group waiting only where the engine kept its old weights (the reference
    # engine's SGLang dialect); a real engine's weights are unknown: failed and recovered
    if policy == "fail" or engine != "reference":
        assert reg.get("g1").state == "inactive" and report.failed_groups == ["g1"]
        assert [g for g, _ in handed] == ["g1"] and "died mid-update" in handed[0][1]
    else:
        assert reg.get("g1").state == "pending_weights" and report.marked_stale == ["g1"]
        assert handed == []
    assert [g.group_id for g in reg.routable()] == ["g0", "g2"]


def test_an_update_that_raises_fails_every_target(
    fleet: tuple[FleetRegistry, MemoryTransport],
) -> None:
    reg, transport = fleet
    transport.raise_on_update = TransportError("could not build the broadcast group")
    report = SyncCoordinator(reg, transport).sync(tensors(2), 2)
    assert report.ok and report.failed == ["g0", "g1", "g2"] and report.updated == []
    assert reg.fleet_version == 2
    assert all(g.state == "inactive" for g in reg.groups())


def test_unhealthy_active_goes_stale_and_pending_gets_loaded(
    fleet: tuple[FleetRegistry, MemoryTransport],
) -> None:
    reg, transport = fleet
    reg.report_member("g1", 2, healthy=False)  # one rank of the 2-rank group is sick
    reg.send("g2", "fail")
    reg.send("g2", "claim")
    for r in reg.get("g2").ranks:
        reg.report_member("g2", r, healthy=True)
    reg.send("g2", "restarted")  # dummy weights: pending_weights
    assert reg.get("g2").state == "pending_weights"
    report = SyncCoordinator(reg, transport).sync(tensors(2), 2)
    assert report.targeted == ["g0", "g2"]
    assert "unhealthy rank(s) [2]" in report.not_targeted["g1"]
    assert report.marked_stale == ["g1"] and reg.get("g1").state == "pending_weights"
    assert report.weights_loaded == ["g2"] and reg.get("g2").state == "active"
    assert versions(reg, "g1") == {1}  # never credited with a version it did not get


def test_groups_outside_active_and_pending_are_left_to_recovery(
    fleet: tuple[FleetRegistry, MemoryTransport],
) -> None:
    reg, transport = fleet
    reg.send("g0", "fail")
    reg.send("g0", "claim")
    report = SyncCoordinator(reg, transport).sync(tensors(2), 2)
    assert report.not_targeted["g0"] == "state recovering"
    assert reg.get("g0").state == "recovering" and versions(reg, "g0") == {None}


def test_colocated_hooks_run_in_order_with_health_paused(
    fleet: tuple[FleetRegistry, MemoryTransport],
) -> None:
    reg, _ = fleet
    events: list[str] = []
    transport = MemoryTransport(4, log=events)

    class Health:
        def pause(self) -> None:
            events.append("health.pause")

        def resume(self) -> None:
            events.append("health.resume")

    sync = SyncCoordinator(
        reg,
        transport,
        health=Health(),
        offload_trainer=lambda: events.append("offload_trainer"),
        onload_engines=lambda: events.append("onload_engines"),
        onload_trainer=lambda: events.append("onload_trainer"),
    )
    assert sync.sync(tensors(2), 2).ok
    assert events == [
        "register",
        "health.pause",
        "offload_trainer",
        "onload_engines",
        "update",
        "onload_trainer",
        "health.resume",
    ]


def test_a_failing_hook_is_reported_and_health_resumes(
    fleet: tuple[FleetRegistry, MemoryTransport], tmp_path: Path
) -> None:
    reg, transport = fleet
    paused: list[bool] = []

    class Health:
        def pause(self) -> None:
            paused.append(True)

        def resume(self) -> None:
            paused.append(False)

    def broken() -> None:
        raise RuntimeError("engines would not wake up")

    exporter = HFExporter(tmp_path / "exports")
    sync = SyncCoordinator(
        reg, transport, exporter=exporter, onload_engines=broken, health=Health()
    )
    report = sync.sync(tensors(2), 2)
    assert not report.ok and "onload_engines failed" in (report.error or "")
    assert paused == [True, False]
    assert reg.fleet_version == 1 and transport.pushed == [] and not report.export_started

    def trainer_lost() -> None:
        raise RuntimeError("trainer OOM on onload")

    sync = SyncCoordinator(reg, transport, exporter=exporter, onload_trainer=trainer_lost)
    report = sync.sync(tensors(3), 3)
    assert report.ok and reg.fleet_version == 3  # the engines did get v3
    assert "onload_trainer failed" in (report.error or "") and not report.export_started


def test_an_export_started_elsewhere_can_be_judged(
    fleet: tuple[FleetRegistry, MemoryTransport], tmp_path: Path
) -> None:
    reg, transport = fleet
    exporter = HFExporter(tmp_path / "exports")
    mode = ImmediateRecoveryMode(enabled=True)
    exporter.start_hf_export(tensors(1), 1)  # e.g. the initial weights, by the fleet itself
    exporter.wait_hf_export(1, timeout=WAIT_S)
    sync = SyncCoordinator(reg, transport, exporter=exporter, mode=mode)
    sync.track_export(1)
    report = sync.sync(tensors(2), 2)
    assert report.previous_export == "on_time" and report.previous_export_version == 1


def test_syncs_and_pushes_share_one_lock_per_transport(
    fleet: tuple[FleetRegistry, MemoryTransport],
) -> None:
    reg, transport = fleet
    lock = shared_transport_lock(transport)
    assert SyncCoordinator(reg, transport).transport_lock is lock
    assert shared_transport_lock(MemoryTransport(4)) is not lock
    holder_done = threading.Event()
    result: list[bool] = []

    def sync_while_locked() -> None:
        result.append(SyncCoordinator(reg, transport).sync(tensors(2), 2).ok)
        holder_done.set()

    with lock:
        worker = threading.Thread(target=sync_while_locked)
        worker.start()
        assert not holder_done.wait(0.2)  # the sync waits for the lock holder
        assert reg.fleet_version == 1
    worker.join(WAIT_S)
    assert result == [True] and reg.fleet_version == 2


def test_failed_export_is_judged_failed_and_leaves_the_mode_alone(
    fleet: tuple[FleetRegistry, MemoryTransport], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import rollsafe.hf.exporter as exporter_module

    reg, transport = fleet
    exporter = HFExporter(tmp_path / "exports")
    mode = ImmediateRecoveryMode(enabled=True)

    def broken(*args: Any, **kwargs: Any) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(exporter_module, "write_shard", broken)
    sync = SyncCoordinator(reg, transport, exporter=exporter, mode=mode)
    sync.sync(tensors(2), 2)
    with pytest.raises(Exception, match="No space"):
        exporter.wait_hf_export(2, timeout=WAIT_S)
    monkeypatch.undo()
    report = sync.sync(tensors(3), 3)
    assert report.previous_export == "failed" and report.previous_export_version == 2
    assert mode.state == "enabled"


def test_bad_configuration_fails_at_construction(
    fleet: tuple[FleetRegistry, MemoryTransport],
) -> None:
    reg, transport = fleet
    with pytest.raises(SyncError, match="on_update_failure"):
        SyncCoordinator(reg, transport, on_update_failure="ignore")  # type: ignore[arg-type]
    with pytest.raises(SyncError, match="abandon_wait_s"):
        SyncCoordinator(reg, transport, abandon_wait_s=-1)


# ====================================================================== real engines
@pytest.fixture(scope="module")
def trainer(tiny_model_dir_b: Path) -> Trainer:  # noqa: F811
    return Trainer(tiny_model_dir_b)


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> Iterator[dict[str, EngineLauncher]]:  # noqa: F811
    launchers = {
        "e0": EngineLauncher(EngineSpec(model_path=str(tiny_model_dir), ranks=1)),
        "e1": EngineLauncher(EngineSpec(model_path=str(tiny_model_dir), ranks=2)),
    }
    try:
        for launcher in launchers.values():
            launcher.start()
        yield launchers
    finally:
        for launcher in launchers.values():
            launcher.stop(timeout=5.0)


def real_fleet(engines: dict[str, EngineLauncher], version: int) -> FleetRegistry:
    reg = FleetRegistry(fleet_version=version)
    reg.add_group("e0", [0], clients=[engines["e0"].client])
    reg.add_group("e1", [1, 2], clients=[engines["e1"].client])
    for gid in ("e0", "e1"):
        bring_up(reg, gid)
    return reg


def engine_state(launcher: EngineLauncher) -> tuple[str | None, str | None]:
    """The engine's model digest (its weight checker) and weight version (``/get_server_info``:
    the checkers report none)."""
    checksum = launcher.client.weights_checksum()
    info = httpx.get(f"{launcher.client.url}/get_server_info", timeout=30).json()
    return checksum.model, info["weight_version"]


def exported_checksum(path: Path) -> str:
    from safetensors.torch import load_file

    loaded: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        loaded.update(load_file(str(shard)))
    return weights_checksum(loaded)["model"]


def test_real_sync_over_ipc_to_two_engines_and_export(
    engines: dict[str, EngineLauncher],
    trainer: Trainer,
    tiny_model_dir_b: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    reg = real_fleet(engines, 0)
    exporter = HFExporter(tmp_path / "exports", template_dir=tiny_model_dir_b)
    transport = IPCTransport(3)
    sync = SyncCoordinator(reg, transport, exporter=exporter)
    try:
        for version in (1, 2):
            trainer.perturb(version)
            report = sync.sync(trainer.weights(), version)
            assert report.ok and report.updated == ["e0", "e1"], report
            for launcher in engines.values():
                want = trainer.checksum(launcher.spec.ranks)
                assert engine_state(launcher) == (want, str(version))
            path = exporter.wait_hf_export(version, timeout=WAIT_S)
            verified = verify_hf_dir(path)
            assert verified.version == version and verified.checksums_verified
            assert exported_checksum(path) == weights_checksum(trainer.weights())["model"]
            assert (path / "config.json").is_file()
        assert [g.group_id for g in reg.routable()] == ["e0", "e1"]
        assert sync.last_report is not None and sync.last_report.previous_export == "on_time"
    finally:
        transport.close()


def test_real_late_export_suspends_is_abandoned_then_rearms(
    engines: dict[str, EngineLauncher],
    trainer: Trainer,
    tiny_model_dir_b: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reg = real_fleet(engines, 10)
    root = tmp_path / "exports"
    exporter = HFExporter(root, template_dir=tiny_model_dir_b)
    mode = ImmediateRecoveryMode(enabled=True, rearm_after=2)
    transport = IPCTransport(3)
    sync = SyncCoordinator(reg, transport, exporter=exporter, mode=mode, abandon_wait_s=WAIT_S)
    try:
        with gated_writer(monkeypatch) as gate:
            trainer.perturb(21)
            assert sync.sync(trainer.weights(), 11).export_started
            assert gate.started.wait(WAIT_S)  # the writer of v11 is held back
            # Sync v12 begins while v11 is still being written: late.
            threading.Timer(0.2, gate.release).start()
            trainer.perturb(22)
            report = sync.sync(trainer.weights(), 12)
        assert report.ok and report.previous_export == "late"
        assert report.previous_export_version == 11 and report.mode_state == "suspended"
        assert mode.state == "suspended"
        assert exporter.handle(11).lifecycle.state == "abandoned"
        assert exporter.latest_ready(11) is None
        with pytest.raises(UnknownExport):
            exporter.lease(11)  # never offered to a recovery
        assert not (root / "hf-v11").exists()
        assert report.export_started  # v12's export starts once v11's writer stopped
        exporter.wait_hf_export(12, timeout=WAIT_S)
        assert [e for e in hidden_entries(root) if "v11" in e] == []  # temp files cleaned

        for launcher in engines.values():
            assert engine_state(launcher) == (trainer.checksum(launcher.spec.ranks), "12")

        # K = 2 on-time exports re-arm immediate recovery.
        trainer.perturb(23)
        r13 = sync.sync(trainer.weights(), 13)
        assert r13.previous_export == "on_time" and mode.state == "suspended"
        exporter.wait_hf_export(13, timeout=WAIT_S)
        trainer.perturb(24)
        r14 = sync.sync(trainer.weights(), 14)
        assert r14.previous_export == "on_time" and mode.state == "enabled"
        assert mode.allows_immediate
    finally:
        transport.close()
