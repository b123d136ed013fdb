"""Standby readiness is a fact the fleet knows (issue #16).

A launcher's warm standby is ``warming`` (being spawned or still importing), ``ready`` or
``none``; a start while it warms waits for it at most what a fresh spawn costs, then races it
against a fresh spawn, so a crash during the warm-up never waits on a stalled standby alone.
Real processes: standbys and fresh spawns are slowed by
``tests/slow_engine.py`` (a sleep before the reference engine's imports). Assertions are on the
recorded source, never on timings.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("torch")

from engine_helpers import (  # noqa: F401  (fixture)
    all_gone,
    sglang_digests,
    tiny_model_dir,
    wait_for,
)

from rollsafe.adapters.engines import EngineLauncher, EngineSpec, EngineStartError
from rollsafe.processes import pid_alive

TESTS = Path(__file__).resolve().parent
STANDBY_WAIT_S = 120.0


def sb_state(launcher: EngineLauncher) -> str:
    """``launcher.standby_state`` (a function, so that mypy does not narrow it for good)."""
    return launcher.standby_state


def source(launcher: EngineLauncher) -> str | None:
    return launcher.last_start_source


def state_at_start(launcher: EngineLauncher) -> str | None:
    return launcher.last_start_standby_state


def slow_launcher(model: Path, control: Path) -> EngineLauncher:
    """A warm-standby launcher running ``tests/slow_engine.py`` controlled by ``control``."""
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path, "SLOW_ENGINE_DIR": str(control)}
    spec = EngineSpec(model_path=str(model), warm_standby=True, module="slow_engine", env=env)
    return EngineLauncher(spec)


def test_a_restart_while_the_standby_warms_is_won_by_a_fresh_spawn(
    tiny_model_dir: Path,  # noqa: F811
    launchers: list[EngineLauncher],
    tmp_path: Path,
) -> None:
    (tmp_path / "standby_s").write_text("600")  # every standby warms for ten minutes
    launcher = slow_launcher(tiny_model_dir, tmp_path)
    launchers.append(launcher)
    assert sb_state(launcher) == "none"  # not started: no standby
    launcher.start()
    assert source(launcher) == "fresh_spawn"
    assert state_at_start(launcher) == "none"
    assert wait_for(lambda: launcher.standby_pid is not None, 30.0)
    warming = launcher.standby_pid
    assert warming is not None and sb_state(launcher) == "warming"
    status = launcher.standby_status()
    assert status["state"] == "warming" and status["pid"] == warming and status["enabled"]
    assert status["import_s"] is None

    launcher.restart()  # would wait ten minutes on the standby alone
    assert source(launcher) == "fresh_spawn"
    assert state_at_start(launcher) == "warming"
    assert not launcher.last_start_from_standby and launcher.pid != warming
    assert launcher.client.is_healthy()
    stats = launcher.standby_stats
    assert stats["raced"] == 1 and stats["fallbacks"] == 1 and stats["used"] == 0
    assert "still importing" in str(stats["last_fallback"])
    assert launcher.standby_status()["fallbacks"] == 1
    # the standby that lost the race is kept (a fork never consumes it): it goes on warming
    assert launcher.standby_pid == warming and sb_state(launcher) == "warming"
    assert launcher.standby_stats["spawned"] == 1
    pids = [launcher.pid, launcher.standby_pid]
    launcher.stop()
    assert sb_state(launcher) == "none"
    assert all_gone([p for p in pids if p is not None])


def test_a_warming_standby_that_is_ready_first_takes_the_restart(
    tiny_model_dir: Path,  # noqa: F811
    launchers: list[EngineLauncher],
    tmp_path: Path,
) -> None:
    hold = tmp_path / "standby_hold"
    hold.touch()  # the standby warms until the restart has begun its race
    launcher = slow_launcher(tiny_model_dir, tmp_path)
    launchers.append(launcher)
    launcher.start()
    assert wait_for(lambda: launcher.standby_pid is not None, 30.0)
    warming = launcher.standby_pid
    (tmp_path / "fresh_s").write_text("600")  # from now on a fresh spawn never wins
    assert sb_state(launcher) == "warming"

    errors: list[BaseException] = []

    def restart() -> None:
        try:
            launcher.restart(weight_version="3")
        except BaseException as exc:
            errors.append(exc)

    restarting = threading.Thread(target=restart)
    restarting.start()
    # the start waits on the warming standby alone for what a fresh spawn cost, then races
    raced = wait_for(lambda: launcher.standby_stats["raced"] == 1, STANDBY_WAIT_S)
    hold.unlink()  # now the standby may get ready: it wins against the ten-minute fresh spawn
    restarting.join(STANDBY_WAIT_S)
    assert raced and not restarting.is_alive() and not errors, errors
    assert state_at_start(launcher) == "warming"
    assert source(launcher) == "warming_standby"
    assert launcher.last_start_from_standby
    assert launcher.ready_info["standby"]["zygote_pid"] == warming != launcher.pid
    assert launcher.ready_info["weight_version"] == "3" and launcher.client.is_healthy()
    stats = launcher.standby_stats
    assert stats["raced"] == 1 and stats["used"] == stats["used_warming"] == 1
    assert stats["fallbacks"] == 0
    # the same standby, now imported, is ready for the next start
    assert sb_state(launcher) == "ready" and launcher.standby_pid == warming
    assert launcher.standby_status()["import_s"] > 0

    launcher.restart()  # a ready standby: no race
    assert source(launcher) == "ready_standby"
    assert state_at_start(launcher) == "ready"
    stats = launcher.standby_stats
    assert stats["raced"] == 1 and stats["used_ready"] == 1 and stats["used"] == 2
    assert stats["spawned"] == 1
    pids = [launcher.pid, *([launcher.standby_pid] if launcher.standby_pid else [])]
    launcher.kill()
    assert all_gone(pids)


def test_the_fleet_knows_a_warming_standby_and_the_recovery_records_its_source(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Snapshot, metrics and the RecoveryResult of a real fleet whose standby never gets ready:
    the crash's restart is a fresh spawn that beat the warming standby, and it is counted."""
    from transformers import AutoModelForCausalLM

    from rollsafe.fleet import FleetConfig, GroupSpec, HealthSettings, RolloutFleet

    prom = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    control = tmp_path / "control"
    control.mkdir()
    (control / "standby_s").write_text("600")
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    weights = {n: p.detach() for n, p in model.named_parameters()}
    cfg = FleetConfig(
        model_path=tiny_model_dir,
        export_root=tmp_path / "exports",
        groups=[GroupSpec(1)],
        health=HealthSettings(interval_s=0.2, timeout_s=1.0, failure_threshold=2),
        enable_immediate_recovery=True,
        warm_standby=True,
        engine=EngineSpec(
            model_path=str(tiny_model_dir),
            **{
                "module": "slow_engine",
                "env": {"PYTHONPATH": path, "SLOW_ENGINE_DIR": str(control)},
            },
        ),
    )

    def scrape(fleet: RolloutFleet) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        assert fleet.metrics is not None
        text = prom.generate_latest(fleet.metrics.registry).decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }

    with RolloutFleet(cfg, metrics=True) as fleet:
        group = fleet.registry.get("g0")
        assert wait_for(lambda: group.standby().get("pid") is not None, 30.0)
        standby = fleet.snapshot()["registry"]["groups"]["g0"]["standby"]
        assert standby["state"] == "warming" and standby["enabled"] and standby["pid"]
        samples = scrape(fleet)
        assert samples[("rollsafe_group_standby_state", (("group", "g0"), ("state", "warming")))]
        assert not samples[("rollsafe_group_standby_state", (("group", "g0"), ("state", "ready")))]
        assert not samples[("rollsafe_group_standby_ready", (("group", "g0"),))]

        assert fleet.sync_weights(weights, 1).ok
        assert fleet.exporter is not None
        fleet.exporter.wait_hf_export(1, timeout=60)
        fleet.launcher("g0").kill_rank(0)
        assert wait_for(lambda: bool(fleet.recoveries()), 120.0)
        assert fleet.wait_recoveries(120.0)
        result = fleet.recoveries()[0]
        assert result.status == "active", result
        assert result.standby_at_restart == "warming"
        assert result.restart_source == "fresh_spawn"
        assert result.as_dict()["restart_source"] == "fresh_spawn"
        restart = next(s for s in result.steps if s.name == "restart")
        assert "source=fresh_spawn (standby was warming)" in restart.detail
        assert fleet.recovery is not None
        assert fleet.recovery.summary()["by_restart_source"] == {"fresh_spawn": 1}
        assert fleet.checksums() == {"g0": sglang_digests(weights)["model"]}
        standby = fleet.snapshot()["registry"]["groups"]["g0"]["standby"]
        assert standby["fallbacks"] == 1 and standby["raced"] == 1
        assert standby["last_start_source"] == "fresh_spawn"
        samples = scrape(fleet)
        key = ("rollsafe_standby_starts_total", (("group", "g0"), ("result", "fallback")))
        assert samples[key] == 1.0
        pids = [fleet.launcher("g0").pid, fleet.launcher("g0").standby_pid]
    assert all_gone([p for p in pids if p is not None])


def test_a_dummy_restart_after_the_export_it_ran_on_was_deleted(
    tiny_model_dir: Path,  # noqa: F811
    launchers: list[EngineLauncher],
    tmp_path: Path,
) -> None:
    """After a recovery from an export the launcher's model directory is that export, which a
    newer export may delete at any time: a targeted push's restart on dummy weights starts on
    the launcher's first model directory (same config) instead of failing an attempt."""
    import shutil

    export = tmp_path / "hf-v3"
    shutil.copytree(tiny_model_dir, export)
    launcher = EngineLauncher(EngineSpec(model_path=str(tiny_model_dir)))
    launchers.append(launcher)
    launcher.start()
    launcher.restart(model_path=str(export), weight_version="3")
    assert launcher.spec.model_path == str(export)
    # same model config: dummy weights start on the first directory (the export may go any time)
    launcher.restart(skip_load_weights=True)
    assert launcher.spec.model_path == str(tiny_model_dir)
    assert launcher.spec.load_format == "dummy" and launcher.client.is_healthy()
    launcher.restart(model_path=str(export), skip_load_weights=False, weight_version="3")
    shutil.rmtree(export)  # deleted: the same
    launcher.restart(skip_load_weights=True)
    assert launcher.spec.model_path == str(tiny_model_dir) and launcher.client.is_healthy()
    pids = [launcher.pid, *launcher.rank_pids]
    launcher.stop()
    assert all_gone(pids)


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_a_real_servers_dummy_restart_starts_on_the_first_directory(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    kind: str,
) -> None:
    """A real vLLM or SGLang server reads the config of its ``--model`` directory first and
    exits when it is gone (a soak's vLLM targeted push restarted on an export retention had
    deleted: the attempt failed): its restart on dummy weights starts on the launcher's first
    model directory too, whether the export is still there or gone; a directory with another
    model's config stays."""
    import dataclasses
    import json
    import shutil

    from rollsafe.adapters.engines.launch.spec import restart_spec

    export = tmp_path / "hf-v3"
    shutil.copytree(tiny_model_dir, export)
    spec = EngineSpec(model_path=str(export), kind=kind, load_format="auto")
    assert spec.real
    assert restart_spec(spec, str(tiny_model_dir), skip_load_weights=True).model_path == str(
        tiny_model_dir
    )
    shutil.rmtree(export)
    gone = restart_spec(spec, str(tiny_model_dir), skip_load_weights=True)
    assert gone.model_path == str(tiny_model_dir) and gone.load_format == "dummy"
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "hidden_size": 8}))
    kept = restart_spec(
        dataclasses.replace(spec, model_path=str(other)),
        str(tiny_model_dir),
        skip_load_weights=True,
    )
    assert kept.model_path == str(other)  # another model: never swapped
    # a real weights restart keeps the path it is given
    real = restart_spec(spec, str(tiny_model_dir), model_path=str(export), skip_load_weights=False)
    assert real.model_path == str(export) and real.load_format == "auto"


def test_a_pool_of_two_covers_the_death_of_a_standby(
    tiny_model_dir: Path,  # noqa: F811
    launchers: list[EngineLauncher],
) -> None:
    """Back-to-back restarts fork from the same standby (a fork does not consume it); with two,
    a standby that died is covered by the other while it is replaced."""
    import signal

    launcher = EngineLauncher(
        EngineSpec(model_path=str(tiny_model_dir), warm_standby=True, standbys=2)
    )
    launchers.append(launcher)
    launcher.start()
    assert wait_for(lambda: launcher.standby_status()["ready"] == 2, STANDBY_WAIT_S)
    first, second = launcher.standby_pids
    assert launcher.standby_pid == first  # the oldest ready one goes first
    launcher.restart()
    assert source(launcher) == "ready_standby"
    assert launcher.ready_info["standby"]["zygote_pid"] == first
    launcher.restart()  # right after: the same standby, still ready
    assert source(launcher) == "ready_standby" and state_at_start(launcher) == "ready"
    assert launcher.ready_info["standby"]["zygote_pid"] == first
    assert launcher.standby_pids == [first, second]

    os.kill(first, signal.SIGKILL)
    assert all_gone([first])
    launcher.restart()  # the other one takes it: no fallback
    assert source(launcher) == "ready_standby"
    assert launcher.ready_info["standby"]["zygote_pid"] == second
    stats = launcher.standby_stats
    assert stats["used_ready"] == 3 and stats["fallbacks"] == 0 and stats["raced"] == 0
    # the pool refills
    assert wait_for(lambda: launcher.standby_status()["ready"] == 2, STANDBY_WAIT_S)
    assert launcher.standby_stats["spawned"] == 3
    pids = [launcher.pid, *launcher.standby_pids]
    launcher.stop()
    assert launcher.standby_pids == [] and sb_state(launcher) == "none"
    assert all_gone(pids)


def test_a_standby_that_is_not_fork_safe_refuses_and_is_replaced(
    tiny_model_dir: Path,  # noqa: F811
    launchers: list[EngineLauncher],
    tmp_path: Path,
) -> None:
    """A standby with a second thread refuses the fork (it would inherit that thread's locks
    half-way): the start falls back to a fresh spawn, counted, and the standby is replaced."""
    (tmp_path / "standby_thread").write_text("")
    launcher = slow_launcher(tiny_model_dir, tmp_path)
    launchers.append(launcher)
    launcher.start()
    assert launcher.wait_standby(STANDBY_WAIT_S)
    refusing = launcher.standby_pid
    (tmp_path / "standby_thread").unlink()  # its replacement is fork-safe
    launcher.restart()
    assert source(launcher) == "fresh_spawn" and state_at_start(launcher) == "ready"
    assert launcher.client.is_healthy()
    stats = launcher.standby_stats
    assert stats["fallbacks"] == 1 and stats["used"] == 0
    assert "not single-threaded" in str(stats["last_fallback"])
    assert refusing is not None and all_gone([refusing])
    assert launcher.wait_standby(STANDBY_WAIT_S) and launcher.standby_pid != refusing
    launcher.restart()
    assert source(launcher) == "ready_standby"
    assert launcher.standby_stats["spawned"] == 2
    pids = [launcher.pid, *launcher.standby_pids]
    launcher.stop()
    assert all_gone(pids)


def test_standbys_must_be_a_positive_int(tiny_model_dir: Path) -> None:  # noqa: F811
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="standbys"):
            EngineSpec(model_path=str(tiny_model_dir), warm_standby=True, standbys=bad)  # type: ignore[arg-type]


def test_stop_during_a_slow_start_ends_the_start_instead_of_waiting_for_it(
    tiny_model_dir: Path,  # noqa: F811
    launchers: list[EngineLauncher],
    tmp_path: Path,
) -> None:
    """A start that holds the launcher for minutes (a real vLLM on a loaded machine) must not
    hold a fleet's close() for as long: stop() makes it give up and kills what it started."""
    (tmp_path / "fresh_s").write_text("600")  # the engine takes ten minutes to import
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path, "SLOW_ENGINE_DIR": str(tmp_path)}
    launcher = EngineLauncher(
        EngineSpec(model_path=str(tiny_model_dir), module="slow_engine", env=env)
    )
    launchers.append(launcher)
    errors: list[BaseException] = []

    def start() -> None:
        try:
            launcher.start()
        except BaseException as exc:
            errors.append(exc)

    starter = threading.Thread(target=start)
    starter.start()
    assert wait_for(lambda: launcher._running.proc is not None, 30.0)  # the engine process runs
    pid = launcher._running.proc.pid if launcher._running.proc is not None else -1
    launcher.stop(timeout=5.0)
    starter.join(30.0)
    assert not starter.is_alive(), "stop() waited for the ten-minute start"
    assert len(errors) == 1 and isinstance(errors[0], EngineStartError), errors
    assert "stop() was called while the engine was starting" in str(errors[0])
    assert not pid_alive(pid) and not launcher.started
