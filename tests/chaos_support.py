"""Helpers for the chaos suite: a recording launcher, a background request loop, the checks.

``chaos_fleet`` builds a :class:`RolloutFleet` on real reference engines whose launchers are
:class:`RecordingLauncher`: every restart is recorded together with what the exporter said about
its ``model_path`` at that moment (a restart from an export must load a ``ready``, leased,
verifiable export of that exact path). :class:`RequestLoop` keeps generating in a background
thread. :func:`assert_fleet_sound` asserts the invariants every chaos scenario ends with;
:func:`assert_replays` records the run and replays it through the verifier's model
(``rollsafe verify --trace``, #36). Waits are bounded by deadlines; nothing asserts a duration.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from trace_support import assert_run_replays

from rollsafe.adapters.engines import EngineLauncher, EngineSpec
from rollsafe.fleet import FleetConfig, GroupSpec, HealthSettings, RecoverySettings, RolloutFleet
from rollsafe.hf import HFExporter
from rollsafe.hf.verify import verify_hf_dir

WAIT_S = 120.0  # bound for waiting on a condition; never asserted as a duration


@dataclass
class RestartRecord:
    group_id: str
    model_path: str | None
    skip_load_weights: bool | None
    #: Problems with the export at restart time (empty when it was a ready, leased, verified one).
    export_problems: list[str] = field(default_factory=list)


class RecordingLauncher(EngineLauncher):
    """An :class:`EngineLauncher` that records each restart and checks the export it loads."""

    def __init__(self, group_id: str, spec: EngineSpec, journal: Journal) -> None:
        super().__init__(spec)
        self.group_id = group_id
        self.journal = journal

    def restart(
        self,
        model_path: str | None = None,
        tokenizer_path: str | None = None,
        load_format: str | None = None,
        skip_load_weights: bool | None = None,
        *,
        weight_version: str | int | None = None,
        stop_timeout: float = 10.0,
    ) -> EngineLauncher:
        record = RestartRecord(self.group_id, model_path, skip_load_weights)
        if model_path is not None:
            record.export_problems = self.journal.check_export(model_path)
        self.journal.restarts.append(record)
        return super().restart(
            model_path,
            tokenizer_path,
            load_format,
            skip_load_weights,
            weight_version=weight_version,
            stop_timeout=stop_timeout,
        )


@dataclass
class Journal:
    """What happened to the fleet's launchers (shared by all of them)."""

    exporter: HFExporter | None = None
    restarts: list[RestartRecord] = field(default_factory=list)

    def check_export(self, model_path: str) -> list[str]:
        exporter = self.exporter
        if exporter is None:
            return ["restart from an export but the fleet has no exporter"]
        matches = [r for r in exporter.exports() if str(r.path) == model_path]
        if not matches:
            return [f"{model_path} is not a listed export"]
        record = matches[0]
        problems: list[str] = []
        if record.state != "ready":
            problems.append(f"export v{record.version} is {record.state}, not ready")
        if not record.lifecycle.leases:
            problems.append(f"export v{record.version} loaded without a lease")
        try:
            verify_hf_dir(model_path)
        except Exception as exc:  # a partial or corrupt export
            problems.append(f"verification failed: {exc}")
        return problems


def chaos_fleet(
    model: Path,
    tmp_path: Path,
    groups: list[GroupSpec],
    *,
    template: Path | None = None,
    budget: int = 3,
    immediate: bool = True,
    health: HealthSettings | None = None,
    initial_version: int = 0,
    run_dir: Path | None = None,
    transport: Any = None,
    **recovery: Any,
) -> tuple[RolloutFleet, Journal]:
    """A started fleet of reference engines (fault injection on) with recording launchers,
    streaming its run to ``run_dir`` (``FleetConfig.run_dir``; default ``tmp_path/stream``:
    :func:`assert_replays` replays it too), syncing through ``transport`` (a
    ``TransportSettings``; None: the fleet's default)."""
    journal = Journal()

    def factory(group_id: str, spec: EngineSpec) -> EngineLauncher:
        return RecordingLauncher(group_id, spec, journal)

    rs: dict[str, Any] = {"restart_budget": budget, "retry_delay_s": 0.1, "timeout_s": 90.0}
    rs.update(recovery)
    cfg = FleetConfig(
        model_path=model,
        export_root=tmp_path / "exports",
        template_dir=template,
        groups=groups,
        health=health or HealthSettings(interval_s=0.2, timeout_s=1.5, failure_threshold=2),
        recovery=RecoverySettings(**rs),
        enable_immediate_recovery=immediate,
        initial_version=initial_version,
        launcher_factory=factory,
        engine=EngineSpec(model_path=str(model), **{"fault_injection": True}),
        request_timeout_s=5.0,
        router_max_attempts=4,
        wait_for_routable_s=2.0,
        run_dir=run_dir if run_dir is not None else tmp_path / "stream",
        **({} if transport is None else {"transport": transport}),
    )
    fleet = RolloutFleet(cfg)
    fleet.start()
    journal.exporter = fleet.exporter
    return fleet, journal


class RequestLoop:
    """Generates through the fleet from a background thread until :meth:`stop`."""

    def __init__(self, fleet: RolloutFleet) -> None:
        self.fleet = fleet
        self.served: Counter[str] = Counter()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-request-loop", daemon=True)

    def __enter__(self) -> RequestLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            try:
                out = self.fleet.generate(
                    [1, 2, 3, i % 50 + 4], sampling_params={"max_new_tokens": 2}, timeout=5.0
                )
                self.served[out.group_id] += 1
            except Exception as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
                time.sleep(0.05)

    def served_total(self) -> int:
        return sum(self.served.values())

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        assert not self._thread.is_alive(), "request loop stuck"


def wait_for(predicate: Any, timeout: float = WAIT_S, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def results_for(fleet: RolloutFleet, gid: str) -> list[Any]:
    return [r for r in fleet.recoveries() if r.group_id == gid]


def wait_recovery(fleet: RolloutFleet, gid: str, n: int = 1) -> Any:
    """The ``n``-th finished recovery of ``gid`` (waits for it)."""
    assert wait_for(lambda: len(results_for(fleet, gid)) >= n), f"no recovery #{n} of {gid}"
    return results_for(fleet, gid)[n - 1]


def assert_fleet_sound(
    fleet: RolloutFleet, journal: Journal, weights: Mapping[str, torch.Tensor]
) -> None:
    """The chaos invariants: only active groups got requests; every active group holds the
    trainer's current ``weights`` at the fleet version (its checker, tensor by tensor in its
    own layout: ``RolloutFleet.check_weights``); restarts from exports used ready ones."""
    assert fleet.wait_recoveries(WAIT_S), "a recovery is still running"
    for gid, counts in fleet.registry.dispatch_counts().items():
        assert set(counts) <= {"active"}, f"{gid} got requests while {dict(counts)}"
    for rec in journal.restarts:
        assert rec.export_problems == [], rec
    active = [g.group_id for g in fleet.registry.groups() if g.state == "active"]
    assert active, "no active group left"
    checks = fleet.check_weights(weights)
    for gid in active:
        check = checks[gid]
        assert check is not None and check.equal, f"{gid} serves stale weights: {check}"
    version = fleet.registry.fleet_version
    for gid in active:
        members = fleet.registry.get(gid).machine.members.values()
        assert all(m.healthy and m.weights_version == version for m in members), gid


def assert_replays(fleet: RolloutFleet, tmp_path: Path) -> Path:
    """Record the fleet's run so far into ``tmp_path / "run"`` and replay it through the
    verifier's model with ``rollsafe verify --trace`` (#36): exit 0, no divergence, every
    recorded transition taken; the run the fleet streams (``FleetConfig.run_dir``) too, as it
    stands (a running fleet's stream has no ``end`` row yet: a partial replay). Returns the
    run's directory."""
    run = fleet.record(tmp_path / "run", svg=False)
    assert_run_replays(run)
    if fleet.config.run_dir is not None:
        assert_run_replays(Path(fleet.config.run_dir))
    return run
