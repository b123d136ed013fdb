"""Chaos tests of the recovery export on a real :class:`RolloutFleet` of reference engines.

Scenarios: a late export (sync N+1 begins while export N is still writing: immediate recovery
is suspended, export N abandoned and never offered, a crash meanwhile recovers by targeted push,
then K on-time exports re-arm it); SIGKILL of the freshly restarted engine while a recovery
restart is loading the export (the recovery retries, the lease is released); an export writer
process SIGKILLed mid-write in the fleet's export root (nothing partial under a final name, its
temp dir removed by the next export, recovery loads only a ready export).

Seams: :class:`GatedExporter` is the real :class:`HFExporter` whose writer thread waits, with
its shards already in the temp dir, until the test releases it or the export is abandoned; the
fleet builds it because ``rollsafe.hf.HFExporter`` is patched while the fleet starts.
:class:`KillingLauncher` SIGKILLs the process of its next restart as soon as it is spawned.
Each scenario ends with :func:`chaos_support.assert_fleet_sound` and its recorded run replayed
through the verifier's model (:func:`chaos_support.assert_replays`, ``rollsafe verify
--trace``). Waits are bounded by deadlines; nothing asserts a duration.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from chaos_support import (
    WAIT_S,
    Journal,
    RecordingLauncher,
    RequestLoop,
    assert_fleet_sound,
    assert_replays,
    chaos_fleet,
    wait_for,
    wait_recovery,
)
from engine_helpers import (
    tiny_model_dir,  # noqa: F401  (fixture)
    tiny_model_dir_b,  # noqa: F401  (fixture)
)
from hf_support import hidden_entries
from transport_helpers import Trainer

import rollsafe.hf
from rollsafe.adapters.engines import EngineLauncher, EngineSpec
from rollsafe.fleet import (
    FleetConfig,
    GroupSpec,
    HealthSettings,
    RecoverySettings,
    RolloutFleet,
)
from rollsafe.hf import HFExporter, verify_hf_dir
from rollsafe.hf.layout import ShardPlan
from rollsafe.hf.snapshot import HostArena
from rollsafe.hf.writer import FileRecord


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
    assert report.ok and report.fleet_version_after == version, report
    return report


def ready_export(fleet: RolloutFleet, version: int) -> None:
    assert fleet.exporter is not None
    fleet.exporter.wait_hf_export(version, timeout=WAIT_S)


def temp_dirs(root: Path, version: int) -> list[Path]:
    return [p for p in root.iterdir() if p.name.startswith(f".hf-v{version}.tmp-")]


def final_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.name.startswith("hf-v"))


def assert_no_leases(fleet: RolloutFleet) -> None:
    assert fleet.exporter is not None
    held = {r.version: list(r.lifecycle.leases) for r in fleet.exporter.exports()}
    assert all(not leases for leases in held.values()), f"leaked export leases: {held}"


def assert_exports_sound(root: Path) -> None:
    """Every directory under a final name is a complete, verifiable export."""
    for path in final_dirs(root):
        assert verify_hf_dir(path).checksums_verified, path


# ====================================================================== seams
class Gate:
    """Holds one export's writer (see :class:`GatedExporter`)."""

    def __init__(self) -> None:
        self.reached = threading.Event()  # the writer is held, its shards in the temp dir
        self.release = threading.Event()


class GatedExporter(HFExporter):
    """The real exporter; the writer of a version passed to :meth:`hold` stops before reading
    its shards back (they are written, in the temp dir) until the gate is released or the export
    is abandoned, so the export is late for a real reason: it is still running."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gates: dict[int, Gate] = {}

    def hold(self, version: int) -> Gate:
        gate = self.gates[version] = Gate()
        return gate

    def _read_back(  # type: ignore[override]
        self, tmp: Path, plan: ShardPlan, arena: HostArena, handle: Any
    ) -> FileRecord:
        gate = self.gates.get(handle.version)
        if gate is not None:
            gate.reached.set()
            wait_for(
                lambda: gate.release.is_set() or handle.lifecycle.state == "abandoned",
                timeout=WAIT_S,
                interval=0.02,
            )
        return HFExporter._read_back(tmp, plan, arena, handle)


class KillingLauncher(RecordingLauncher):
    """A recording launcher that, when armed, SIGKILLs the engine process of its next restart
    right after it is spawned: the restart is then still loading its weights (the export)."""

    def __init__(self, group_id: str, spec: EngineSpec, journal: Journal) -> None:
        super().__init__(group_id, spec, journal)
        self.armed = threading.Event()
        self.killed: list[int] = []

    def restart(self, *args: Any, **kwargs: Any) -> EngineLauncher:
        if self.armed.is_set():
            self.armed.clear()
            before = self._running.proc
            threading.Thread(target=self._kill_next, args=(before,), daemon=True).start()
        return super().restart(*args, **kwargs)

    def _kill_next(self, before: Any) -> None:
        def spawned() -> bool:
            proc = self._running.proc
            return proc is not None and proc is not before

        if wait_for(spawned, timeout=WAIT_S, interval=0.005):
            proc = self._running.proc
            if proc is not None and proc.poll() is None and not self._running.info:
                os.kill(proc.pid, signal.SIGKILL)  # before its ready line: still loading
                self.killed.append(proc.pid)


def killing_fleet(
    model: Path, tmp_path: Path, groups: list[GroupSpec]
) -> tuple[RolloutFleet, Journal]:
    """Like :func:`chaos_support.chaos_fleet`, with :class:`KillingLauncher` launchers."""
    journal = Journal()

    def factory(group_id: str, spec: EngineSpec) -> EngineLauncher:
        return KillingLauncher(group_id, spec, journal)

    cfg = FleetConfig(
        model_path=model,
        export_root=tmp_path / "exports",
        groups=groups,
        health=HealthSettings(interval_s=0.2, timeout_s=1.5, failure_threshold=2),
        recovery=RecoverySettings(restart_budget=3, retry_delay_s=0.1, timeout_s=90.0),
        enable_immediate_recovery=True,
        launcher_factory=factory,
        engine=EngineSpec(model_path=str(model), **{"fault_injection": True}),
        request_timeout_s=5.0,
        router_max_attempts=4,
        wait_for_routable_s=2.0,
    )
    fleet = RolloutFleet(cfg)
    fleet.start()
    journal.exporter = fleet.exporter
    return fleet, journal


# ====================================================================== a late export
def test_a_late_export_is_abandoned_suspends_immediate_recovery_then_rearms(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    trainer: Trainer,
    fleets: list[RolloutFleet],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with monkeypatch.context() as patch:
        patch.setattr(rollsafe.hf, "HFExporter", GatedExporter)
        fleet, journal = chaos_fleet(tiny_model_dir, tmp_path, [GroupSpec(1), GroupSpec(1)])
    fleets.append(fleet)
    exporter = cast(GatedExporter, fleet.exporter)
    assert isinstance(exporter, GatedExporter)
    root = tmp_path / "exports"
    assert fleet.mode.state == "enabled" and fleet.config.rearm_after == 2

    assert step(fleet, trainer, 1, seed=11).ok
    ready_export(fleet, 1)
    gate = exporter.hold(2)
    report2 = step(fleet, trainer, 2, seed=12)
    assert report2.previous_export == "on_time" and report2.mode_state == "enabled", report2
    assert gate.reached.wait(WAIT_S), "export v2 never reached its gate"
    (tmp,) = temp_dirs(root, 2)
    assert any(tmp.glob("model-*.safetensors"))  # mid-write: shards on disk, not published
    assert exporter.handle(2).lifecycle.state in ("writing", "committing")
    assert not (root / "hf-v2").exists() and exporter.latest_ready(2) is None

    # Sync 3 begins while export 2 still runs: late -> suspended, export 2 abandoned.
    report3 = step(fleet, trainer, 3, seed=13)
    assert (report3.previous_export, report3.previous_export_version) == ("late", 2), report3
    assert report3.mode_state == "suspended" and fleet.mode.state == "suspended"
    assert wait_for(lambda: exporter.handle(2).done())
    v2 = exporter.handle(2).lifecycle
    assert v2.state == "abandoned" and not v2.leases
    assert fleet.export_states()[2] == "abandoned"
    assert not tmp.exists() and temp_dirs(root, 2) == []  # its temp dir removed
    assert not (root / "hf-v2").exists()
    assert 2 not in [r.version for r in exporter.exports()]
    ready_export(fleet, 3)  # an on-time export of v3 exists, but the mode is suspended

    # A crash while suspended: no immediate recovery (no export at all), targeted push instead.
    with RequestLoop(fleet) as loop:
        assert wait_for(lambda: loop.served_total() >= 2)
        fleet.launcher("g1").kill()
        suspended = wait_recovery(fleet, "g1")
        served = loop.served_total()
        assert wait_for(lambda: loop.served_total() > served)
    assert suspended.status == "active", suspended
    assert suspended.strategy == "targeted_push" and suspended.export_version is None, suspended
    assert any(s.name == "lease" and "suspended" in s.detail for s in suspended.steps), suspended
    assert [(r.group_id, r.model_path) for r in journal.restarts] == [("g1", None)]
    assert_fleet_sound(fleet, journal, trainer.weights())

    # K = 2 on-time exports re-arm it.
    report4 = step(fleet, trainer, 4, seed=14)
    assert report4.previous_export == "on_time" and report4.mode_state == "suspended", report4
    ready_export(fleet, 4)
    report5 = step(fleet, trainer, 5, seed=15)
    assert report5.previous_export == "on_time", report5
    assert report5.mode_state == "enabled" and fleet.mode.state == "enabled", report5
    ready_export(fleet, 5)

    # Re-armed: the next crash recovers immediately from the ready export of v5.
    fleet.launcher("g0").kill()
    rearmed = wait_recovery(fleet, "g0")
    assert rearmed.status == "active" and rearmed.strategy == "immediate", rearmed
    assert rearmed.export_version == 5
    assert journal.restarts[-1].model_path == str(root / "hf-v5")
    assert all("hf-v2" not in (r.model_path or "") for r in journal.restarts)
    assert_fleet_sound(fleet, journal, trainer.weights())
    assert_no_leases(fleet)
    assert_exports_sound(root)
    assert [p.name for p in final_dirs(root)] == ["hf-v4", "hf-v5"]  # retention keeps 2
    assert_replays(fleet, tmp_path)


# ====================================================================== kill while loading
def test_sigkill_while_a_restart_loads_the_export_retries_and_releases_the_lease(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    trainer: Trainer,
    fleets: list[RolloutFleet],
) -> None:
    fleet, journal = killing_fleet(tiny_model_dir, tmp_path, [GroupSpec(1), GroupSpec(1)])
    fleets.append(fleet)
    root = tmp_path / "exports"
    assert step(fleet, trainer, 1, seed=21).ok
    ready_export(fleet, 1)
    victim = cast(KillingLauncher, fleet.launcher("g1"))
    victim.armed.set()
    with RequestLoop(fleet) as loop:
        assert wait_for(lambda: loop.served_total() >= 2)
        victim.kill()  # the crash; its recovery's first restart is killed while loading
        result = wait_recovery(fleet, "g1")
        served = loop.served["g0"]
        assert wait_for(lambda: loop.served["g0"] > served)  # g0 served throughout
    assert len(victim.killed) == 1, victim.killed
    assert result.status == "active" and result.strategy == "immediate", result
    assert result.attempts == 2 and result.export_version == 1, result
    assert [(r.group_id, r.model_path) for r in journal.restarts] == [
        ("g1", str(root / "hf-v1")),
        ("g1", str(root / "hf-v1")),
    ]
    g1 = fleet.registry.get("g1")
    assert g1.state == "active" and g1.machine.restart_budget == 1  # two claims of 3
    assert_no_leases(fleet)
    assert_fleet_sound(fleet, journal, trainer.weights())
    # The next step reaches both groups; the (unleased) v1 export is retired normally.
    report = step(fleet, trainer, 2, seed=22)
    assert sorted(report.updated) == ["g0", "g1"], report
    ready_export(fleet, 2)
    assert_no_leases(fleet)
    assert_fleet_sound(fleet, journal, trainer.weights())
    assert_exports_sound(root)
    assert_replays(fleet, tmp_path)


# ====================================================================== writer killed
# A separate process exports version 2 into the fleet's export root (4 shards); after the first
# shard is durable it says so and hangs, so the test can SIGKILL it mid-write.
WRITER = textwrap.dedent(
    """
    import sys, time, torch
    import rollsafe.hf.exporter as E

    original = E.write_shard
    written = []

    def write_shard(*args, **kwargs):
        size = original(*args, **kwargs)
        written.append(size)
        if len(written) == 1:
            print("SHARD_WRITTEN", flush=True)
            time.sleep(120)
        return size

    E.write_shard = write_shard
    exporter = E.HFExporter(sys.argv[1], shard_size_bytes=1 << 16)
    tensors = {f"w{i}": torch.full((64, 256), float(i)) for i in range(4)}
    exporter.start(tensors, int(sys.argv[2])).wait()
    print("UNEXPECTED_DONE", flush=True)
    """
)


def kill_writer_mid_write(root: Path, version: int) -> Path:
    """Run :data:`WRITER` for ``version`` under ``root``, SIGKILL it mid-write; its temp dir."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(root), str(version)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "SHARD_WRITTEN", (line, proc.stderr.read() if proc.stderr else "")
        temps = [p for p in temp_dirs(root, version) if f".tmp-{proc.pid}-" in p.name]
        assert len(temps) == 1 and any(temps[0].glob("model-*.safetensors")), temps
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    return temps[0]


def test_an_export_writer_killed_mid_write_leaves_nothing_partial_and_is_never_used(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    trainer: Trainer,
    fleets: list[RolloutFleet],
) -> None:
    fleet, journal = chaos_fleet(tiny_model_dir, tmp_path, [GroupSpec(1), GroupSpec(1)])
    fleets.append(fleet)
    assert fleet.exporter is not None
    root = tmp_path / "exports"
    assert step(fleet, trainer, 1, seed=31).ok
    ready_export(fleet, 1)

    debris = kill_writer_mid_write(root, 2)
    assert [p.name for p in final_dirs(root)] == ["hf-v1"]  # nothing under hf-v2
    assert debris.exists()
    assert_exports_sound(root)
    assert fleet.exporter.latest_ready(2) is None

    # A crash now: recovery must use the ready v1 export (the fleet's version), never the debris.
    with RequestLoop(fleet) as loop:
        fleet.launcher("g1").kill()
        first = wait_recovery(fleet, "g1")
        served = loop.served["g0"]
        assert wait_for(lambda: loop.served["g0"] > served)
    assert first.status == "active" and first.strategy == "immediate", first
    assert first.export_version == 1, first
    assert_fleet_sound(fleet, journal, trainer.weights())

    # The fleet's next export (of that same version) removes the stale temp dir and publishes.
    report = step(fleet, trainer, 2, seed=32)
    assert report.export_started and sorted(report.updated) == ["g0", "g1"], report
    assert not debris.exists()
    ready_export(fleet, 2)
    assert hidden_entries(root) == []
    assert_exports_sound(root)
    assert verify_hf_dir(root / "hf-v2").version == 2

    fleet.launcher("g0").kill()
    second = wait_recovery(fleet, "g0")
    assert second.status == "active" and second.strategy == "immediate", second
    assert second.export_version == 2, second
    assert [r.model_path for r in journal.restarts] == [
        str(root / "hf-v1"),
        str(root / "hf-v2"),
    ]
    assert_no_leases(fleet)
    assert_fleet_sound(fleet, journal, trainer.weights())
    assert_replays(fleet, tmp_path)
