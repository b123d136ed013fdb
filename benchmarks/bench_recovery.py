"""Benchmark recovery latency on CPU: immediate (ready export) vs deferred (next sync).

A real :class:`~rollsafe.fleet.fleet.RolloutFleet` of one 1-rank reference-engine group (the
tiny Llama of ``make_tiny_model``) and the demo's in-process :class:`~rollsafe.demo.Trainer`
run steps shaped like ``rollsafe demo``'s: rollout phase (``--rollout-s``, the demo's default
8 s), train step, weight sync (``ipc``) with an async HF export. Every measured step SIGKILLs
the engine's rank 0 ``CRASH_DELAY_S`` (1 s, as the demo) into its rollout phase.

* **immediate** (``enable_immediate_recovery=True``): the health manager fails the group, the
  recovery restarts it from the ready export of the current version, ``restarted`` -> ``active``.
  Latency: SIGKILL -> the group's ``active`` transition.
* **immediate, warm standby** (the same, with ``FleetConfig.warm_standby=True``): the restart
  is handed to the group's idle, already-imported standby engine process instead of a fresh
  interpreter. Before each crash the bench waits until the standby finished its imports (a
  standby still importing would be used too, with less gain); the wait is recorded.
* **deferred** (``enable_immediate_recovery=False``, no targeted push): the group restarts on
  dummy weights into ``pending_weights`` and becomes ``active`` when the next sync (after the
  rollout phase and the train step) pushes the new version. Latency: SIGKILL -> ``active``.

For the immediate recoveries, rollsafe's own overhead is crash -> ``active`` minus the detection
latency (bounded by the health interval x threshold, reported separately), minus the engine's
own start (``startup_s["serving"]`` of the ready line: ``main()`` -> ready, weight load
included). It is broken down by the :class:`~rollsafe.fleet.recovery.RecoveryResult` steps; the
restart step's part outside the engine (teardown, process spawn and interpreter start before
``main()``, ready-line pump, first health check) is reported on its own, with a bare
``python -c 'import rollsafe.adapters.reference_engine.__main__'`` as the reference for the
spawn part. With a warm standby there is no spawn, so its rollsafe overhead is crash ->
``active`` minus detection minus the engine's start (counted from the handoff) and nothing else
(``overhead.standby``). Each mode's fleet is recorded (``RolloutFleet.record``) into
``benchmarks/results/recovery_runs/<mode>/``: ``timeline.jsonl`` and ``timeline.svg``, the
picture of its crashes and recoveries. Figures are medians of ``--repeats`` crashes per mode. The
step time at which immediate is 5x shorter is computed from the measured parts and, with
``--validate``, checked with one deferred run at that step time. Prints a table and writes
``benchmarks/results/recovery_cpu.json``.

    .venv/bin/python benchmarks/bench_recovery.py [--repeats 3] [--rollout-s 8] [--validate]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model  # noqa: E402
from rollsafe.demo import CRASH_DELAY_S, Trainer  # noqa: E402
from rollsafe.fleet.fleet import (  # noqa: E402
    FleetConfig,
    GroupSpec,
    HealthSettings,
    RecoverySettings,
    RolloutFleet,
)

OUT = REPO / "benchmarks" / "results" / "recovery_cpu.json"
#: One recorded run per mode (timeline.jsonl, fleet.json, timeline.svg; `rollsafe report` opens it)
RUNS = REPO / "benchmarks" / "results" / "recovery_runs"
TARGET_RATIO = 5.0
TARGET_OVERHEAD_S = 0.100
HEALTH = HealthSettings(interval_s=0.2, timeout_s=1.0, failure_threshold=2)  # the demo's
WAIT_S = 90.0


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def _config(
    model_dir: Path, work: Path, immediate: bool, budget: int, warm_standby: bool = False
) -> FleetConfig:
    (work / "logs").mkdir(parents=True, exist_ok=True)
    return FleetConfig(
        model_path=model_dir,
        export_root=work / "exports",
        groups=[GroupSpec(1)],
        transport="ipc",
        health=HEALTH,
        recovery=RecoverySettings(
            max_workers=2, timeout_s=120.0, restart_budget=budget, targeted_push=immediate
        ),
        enable_immediate_recovery=immediate,
        engine_options={"log_dir": str(work / "logs")},
        wait_for_routable_s=2.0,
        request_timeout_s=20.0,
        warm_standby=warm_standby,
    )


def _group_rows(fleet: RolloutFleet, gid: str, after: float) -> list[dict[str, Any]]:
    return [
        r
        for r in fleet.timeline()
        if r["kind"] == "group" and r["subject"] == gid and r["timestamp"] > after
    ]


def _first(rows: list[dict[str, Any]], **match: str) -> float | None:
    for r in rows:
        if all(r[k] == v for k, v in match.items()):
            return float(r["timestamp"])
    return None


def _wait_state(fleet: RolloutFleet, gid: str, state: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while fleet.registry.get(gid).state != state:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{gid} not {state} after {timeout}s: {fleet.registry.get(gid)}")
        time.sleep(0.01)


def _sync(fleet: RolloutFleet, trainer: Trainer, version: int) -> tuple[float, float]:
    """Train one step, sync ``version``; return (train s, sync s)."""
    t = time.monotonic()
    trainer.step()
    t_train = time.monotonic() - t
    t = time.monotonic()
    report = fleet.sync_weights(trainer.weights(), version)
    t_sync = time.monotonic() - t
    if not report.ok:
        raise RuntimeError(f"sync v{version} failed: {report.error}")
    return t_train, t_sync


def _crash(fleet: RolloutFleet, gid: str, step_t0: float) -> float:
    """Sleep to CRASH_DELAY_S into the rollout phase, SIGKILL rank 0; return the wall time."""
    time.sleep(max(0.0, step_t0 + CRASH_DELAY_S - time.monotonic()))
    at = time.time()
    pid = fleet.launcher(gid).kill_rank(0)
    fleet.observer.mark_crash(gid, at=at, rank=0, pid=pid)  # the onset in the recorded run
    return at


def run_immediate(
    model_dir: Path, work: Path, repeats: int, warm_standby: bool = False
) -> list[dict[str, Any]]:
    trainer = Trainer(model_dir, seed=0)
    out: list[dict[str, Any]] = []
    tag = "imm-standby" if warm_standby else "imm"
    with RolloutFleet(_config(model_dir, work / tag, True, repeats + 2, warm_standby)) as fleet:
        gid = fleet.group_ids[0]
        assert fleet.exporter is not None
        for i in range(repeats):
            version = i + 1
            _sync(fleet, trainer, version)  # the step before: v{version} and its export
            fleet.exporter.wait_hf_export(version, timeout=WAIT_S)
            standby_wait_s = None
            if warm_standby:
                t = time.monotonic()
                if not fleet.launcher(gid).wait_standby(WAIT_S):
                    raise TimeoutError(f"{gid}: no warm standby ready after {WAIT_S}s")
                standby_wait_s = time.monotonic() - t
            time.sleep(0.5)  # let the export's lifecycle settle
            step_t0 = time.monotonic()  # rollout phase of the measured step begins
            crash_at = _crash(fleet, gid, step_t0)
            deadline = time.monotonic() + WAIT_S
            while True:
                active_at = _first(_group_rows(fleet, gid, crash_at), target="active")
                if active_at is not None:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{gid} not active again after the crash")
                time.sleep(0.005)
            fleet.wait_recoveries(WAIT_S)
            rows = _group_rows(fleet, gid, crash_at)
            rec = next(r for r in fleet.recoveries() if r.failed_at >= crash_at)
            launcher = fleet.launcher(gid)
            info = launcher.ready_info
            want, got = trainer.checksum(), fleet.checksums().get(gid)
            out.append(
                {
                    "warm_standby": warm_standby,
                    "from_standby": launcher.last_start_from_standby,
                    "standby_wait_s": standby_wait_s,
                    "standby_stats": launcher.standby_stats,
                    "crash_at": crash_at,
                    "active_at": active_at,
                    "fail_at": _first(rows, event="fail"),
                    "recovery": rec.as_dict(),
                    "startup_s": dict(info.get("startup_s", {})),
                    "weights_match_trainer": want == got,
                    "transitions": [
                        {k: r[k] for k in ("event", "source", "target", "timestamp")} for r in rows
                    ],
                }
            )
            print(
                f"  immediate{' (warm standby)' if warm_standby else ''} #{i + 1}:"
                f" {active_at - crash_at:.3f}s ({rec.strategy}, {rec.status},"
                f" from standby {launcher.last_start_from_standby}, weights match {want == got})"
            )
        print(f"  recorded run and its picture: {fleet.record(RUNS / tag)}/timeline.svg")
    return out


def run_deferred(
    model_dir: Path, work: Path, repeats: int, rollout_s: float, tag: str
) -> list[dict[str, Any]]:
    trainer = Trainer(model_dir, seed=0)
    out: list[dict[str, Any]] = []
    with RolloutFleet(_config(model_dir, work / tag, False, repeats + 2)) as fleet:
        gid = fleet.group_ids[0]
        assert fleet.exporter is not None
        version = 1
        _sync(fleet, trainer, version)
        fleet.exporter.wait_hf_export(version, timeout=WAIT_S)
        for i in range(repeats):
            step_t0 = time.monotonic()
            crash_at = _crash(fleet, gid, step_t0)
            state_at_rollout_end = ""
            t_train = t_sync = 0.0
            syncs = 0
            # Steps go on (rollout, train, sync) until a sync finds the group pending_weights:
            # one restarted after a sync began waits for the one after.
            while fleet.registry.get(gid).state != "active" or syncs == 0:
                if syncs >= 5:
                    raise TimeoutError(f"{gid} not active after {syncs} syncs")
                time.sleep(max(0.0, step_t0 + rollout_s - time.monotonic()))  # rollout phase
                state_at_rollout_end = state_at_rollout_end or fleet.registry.get(gid).state
                version += 1
                t_train, t_sync = _sync(fleet, trainer, version)
                syncs += 1
                step_t0 = time.monotonic()
            _wait_state(fleet, gid, "active")
            rows = _group_rows(fleet, gid, crash_at)
            active_at = _first(rows, target="active")
            assert active_at is not None
            pending_at = _first(rows, target="pending_weights")
            rec = [r for r in fleet.recoveries() if r.failed_at >= crash_at]
            want, got = trainer.checksum(), fleet.checksums().get(gid)
            out.append(
                {
                    "rollout_s": rollout_s,
                    "crash_at": crash_at,
                    "active_at": active_at,
                    "fail_at": _first(rows, event="fail"),
                    "pending_weights_at": pending_at,
                    "state_at_rollout_end": state_at_rollout_end,
                    "syncs_until_active": syncs,
                    "train_s": t_train,
                    "sync_s": t_sync,
                    "recovery": rec[0].as_dict() if rec else None,
                    "weights_match_trainer": want == got,
                }
            )
            print(
                f"  deferred ({rollout_s:g}s rollout) #{i + 1}: {active_at - crash_at:.3f}s"
                f" ({syncs} sync(s); at rollout end {state_at_rollout_end}; train {t_train:.3f}s,"
                f" sync {t_sync:.3f}s; weights match {want == got})"
            )
            fleet.exporter.wait_hf_export(version, timeout=WAIT_S)
        print(f"  recorded run and its picture: {fleet.record(RUNS / tag)}/timeline.svg")
    return out


def spawn_reference(repeats: int = 5) -> float:
    """Median seconds of ``python -c 'import <engine __main__>'``: spawn + pre-``main()``."""
    times = []
    cmd = [sys.executable, "-c", "import rollsafe.adapters.reference_engine.__main__"]
    for _ in range(repeats):
        t = time.monotonic()
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": path})
        times.append(time.monotonic() - t)
    return _median(times)


def overhead(run: dict[str, Any]) -> dict[str, float]:
    """Split one immediate recovery's crash -> active into detection, engine, rollsafe."""
    rec = run["recovery"]
    steps: dict[str, float] = {}
    for s in rec["steps"]:
        steps[s["name"]] = steps.get(s["name"], 0.0) + s["seconds"]
    st = run["startup_s"]
    engine = float(st["serving"])
    weight_load = float(st.get("rank0_loaded", engine)) - float(st.get("preloaded", 0.0))
    total = run["active_at"] - run["crash_at"]
    detection = rec["failed_at"] - run["crash_at"]
    fail_transition = (run["fail_at"] or rec["failed_at"]) - run["crash_at"]
    handoff = rec["started_at"] - rec["failed_at"]  # notifier thread -> submit -> pool worker
    restart_outside_engine = steps.get("restart", 0.0) - engine
    in_steps = sum(steps.values())
    unaccounted = total - detection - handoff - in_steps - (run["active_at"] - rec["active_at"])
    rollsafe_s = total - detection - engine
    return {
        "total_s": total,
        "detection_s": detection,
        "fail_transition_after_crash_s": fail_transition,
        "engine_start_s": engine,
        "weight_load_s": weight_load,
        "handoff_to_worker_s": handoff,
        **{f"step_{k}_s": v for k, v in steps.items() if k != "restart"},
        "step_restart_s": steps.get("restart", 0.0),
        "restart_outside_engine_s": restart_outside_engine,
        "gaps_between_steps_s": unaccounted,
        "rollsafe_overhead_s": rollsafe_s,
        "rollsafe_overhead_excl_spawn_s": 0.0,  # filled in by main() with the spawn reference
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="crashes per mode (default 3)")
    p.add_argument("--rollout-s", type=float, default=8.0, help="demo's default rollout phase")
    p.add_argument("--validate", action="store_true", help="one deferred run at the 5x step time")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rollsafe-bench-recovery-"))
    t_wall = time.monotonic()
    try:
        model_dir = make_tiny_model(work / "model", seed=0)
        spawn_s = spawn_reference()
        print(f"spawn + engine module import (reference): {spawn_s:.3f}s")
        print("immediate recoveries:")
        imm = run_immediate(model_dir, work, args.repeats)
        print("immediate recoveries with a warm standby:")
        sby = run_immediate(model_dir, work, args.repeats, warm_standby=True)
        print("deferred recoveries:")
        dfr = run_deferred(model_dir, work, args.repeats, args.rollout_s, "dfr")
        imm_lat = [r["active_at"] - r["crash_at"] for r in imm]
        dfr_lat = [r["active_at"] - r["crash_at"] for r in dfr]
        sby_lat = [r["active_at"] - r["crash_at"] for r in sby]
        imm_med, dfr_med, sby_med = _median(imm_lat), _median(dfr_lat), _median(sby_lat)
        ratio = dfr_med / imm_med
        ratio_sby = dfr_med / sby_med
        # deferred(rollout_s) = (rollout_s - CRASH_DELAY_S) + train + sync (+ tail to active),
        # valid while the restart ends before the rollout phase does.
        tail = _median([d - (args.rollout_s - CRASH_DELAY_S) for d in dfr_lat])
        rollout_5x = TARGET_RATIO * imm_med + CRASH_DELAY_S - tail
        rollout_5x_rounded = float(math.ceil(rollout_5x))
        rollout_5x_sby = TARGET_RATIO * sby_med + CRASH_DELAY_S - tail
        validation: dict[str, Any] | None = None
        if args.validate:
            print(f"deferred at the computed 5x step time ({rollout_5x_rounded:g}s rollout):")
            v = run_deferred(model_dir, work, 1, rollout_5x_rounded, "val")
            v_lat = v[0]["active_at"] - v[0]["crash_at"]
            validation = {
                "rollout_s": rollout_5x_rounded,
                "deferred_latency_s": _r(v_lat),
                "ratio_to_immediate_median": _r(v_lat / imm_med, 2),
                "within_target": v_lat / imm_med >= TARGET_RATIO,
                "run": v[0],
            }
        ov = [overhead(r) for r in imm]
        for o in ov:
            o["rollsafe_overhead_excl_spawn_s"] = o["rollsafe_overhead_s"] - spawn_s
        keys = list(ov[0])
        ov_med = {k: _median([o[k] for o in ov]) for k in keys}
        ov_sby = [overhead(r) for r in sby]
        for o in ov_sby:  # no interpreter was spawned: nothing to take off
            o["rollsafe_overhead_excl_spawn_s"] = o["rollsafe_overhead_s"]
        ov_sby_med = {k: _median([o[k] for o in ov_sby]) for k in keys}
        detection_bound = HEALTH.interval_s * HEALTH.failure_threshold + HEALTH.interval_s
    finally:
        shutil.rmtree(work, ignore_errors=True)

    overhead_ok = ov_med["rollsafe_overhead_excl_spawn_s"] < TARGET_OVERHEAD_S
    overhead_sby_ok = ov_sby_med["rollsafe_overhead_s"] < TARGET_OVERHEAD_S
    result: dict[str, Any] = {
        "benchmark": "recovery_cpu",
        "model": "tiny llama (make_tiny_model), 1 group x 1 rank, reference engine, ipc",
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "machine": platform.machine(),
            "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
        },
        "config": {
            "repeats": args.repeats,
            "rollout_s": args.rollout_s,
            "crash_delay_s": CRASH_DELAY_S,
            "warm_standby_waited_ready": True,
            "health": {
                "interval_s": HEALTH.interval_s,
                "timeout_s": HEALTH.timeout_s,
                "failure_threshold": HEALTH.failure_threshold,
            },
        },
        "targets": {
            "deferred_over_immediate_min": TARGET_RATIO,
            "rollsafe_overhead_max_s": TARGET_OVERHEAD_S,
        },
        "latency": {
            "immediate_s": [_r(x) for x in imm_lat],
            "deferred_s": [_r(x) for x in dfr_lat],
            "immediate_median_s": _r(imm_med),
            "deferred_median_s": _r(dfr_med),
            "ratio": _r(ratio, 2),
            "within_target": ratio >= TARGET_RATIO,
            "deferred_tail_after_rollout_s": _r(tail),
            "rollout_s_for_5x": _r(rollout_5x, 2),
            "step_s_for_5x_note": (
                "deferred = (rollout_s - crash delay) + train + sync; 5x holds from this"
                " rollout phase length on (the computed value; see validation)"
            ),
            "validation": validation,
            "immediate_standby_s": [_r(x) for x in sby_lat],
            "immediate_standby_median_s": _r(sby_med),
            "ratio_standby": _r(ratio_sby, 2),
            "within_target_standby": ratio_sby >= TARGET_RATIO,
            "rollout_s_for_5x_standby": _r(rollout_5x_sby, 2),
            "standby_used": [bool(r["from_standby"]) for r in sby],
            "standby_wait_s": [_r(r["standby_wait_s"]) for r in sby],
        },
        "overhead": {
            "median_s": {k: _r(v) for k, v in ov_med.items()},
            "per_run_s": [{k: _r(v) for k, v in o.items()} for o in ov],
            "spawn_and_module_import_reference_s": _r(spawn_s),
            "detection_bound_s": _r(detection_bound),
            "detection_within_bound": ov_med["detection_s"] <= detection_bound,
            "within_target": overhead_ok,
            "standby": {
                "median_s": {k: _r(v) for k, v in ov_sby_med.items()},
                "per_run_s": [{k: _r(v) for k, v in o.items()} for o in ov_sby],
                "within_target": overhead_sby_ok,
            },
        },
        "runs": {"immediate": imm, "immediate_standby": sby, "deferred": dfr},
        "wall_s": round(time.monotonic() - t_wall, 1),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")

    print(f"\n{'figure':<58} {'median':>10}  target")
    rows = [
        ("immediate recovery, crash -> active (s)", imm_med, ""),
        ("immediate recovery with a warm standby, crash -> active (s)", sby_med, ""),
        (f"deferred recovery, crash -> active, {args.rollout_s:g}s rollout (s)", dfr_med, ""),
        ("ratio deferred / immediate", ratio, f">= {TARGET_RATIO:g}x "
         f"{'met' if ratio >= TARGET_RATIO else 'NOT met'}"),
        ("rollout phase at which 5x holds (s, computed)", rollout_5x, ""),
        ("ratio deferred / immediate with a warm standby", ratio_sby, f">= {TARGET_RATIO:g}x "
         f"{'met' if ratio_sby >= TARGET_RATIO else 'NOT met'}"),
        ("rollout phase at which 5x holds with a warm standby (s)", rollout_5x_sby, ""),
    ]  # fmt: skip
    if validation is not None:
        rows.append(
            (f"  validated: ratio at {rollout_5x_rounded:g}s rollout",
             validation["ratio_to_immediate_median"],
             "met" if validation["within_target"] else "NOT met"),
        )  # fmt: skip
    rows += [
        (f"detection (crash -> failure), bound {detection_bound:.2f}s", ov_med["detection_s"], ""),
        ("engine start, main() -> ready (startup_s.serving)", ov_med["engine_start_s"], ""),
        ("  of which weight load (rank0_loaded - preloaded)", ov_med["weight_load_s"], ""),
    ]
    for k in keys:
        if k.startswith("step_") or k in ("handoff_to_worker_s", "gaps_between_steps_s"):
            rows.append((f"  phase {k}", ov_med[k], ""))
    rows += [
        ("  restart step outside the engine (teardown, spawn, ready, health)",
         ov_med["restart_outside_engine_s"], ""),
        ("  reference: spawn + engine module import", spawn_s, ""),
        ("rollsafe overhead (total - detection - engine start)", ov_med["rollsafe_overhead_s"],
         ""),
        ("rollsafe overhead, also excluding spawn reference", ov_med[
            "rollsafe_overhead_excl_spawn_s"], f"< {TARGET_OVERHEAD_S * 1000:.0f} ms "
         f"{'met' if overhead_ok else 'NOT met'}"),
    ]  # fmt: skip
    rows += [
        ("warm standby: engine start handoff -> ready", ov_sby_med["engine_start_s"], ""),
        ("  restart step outside the engine (teardown, handoff, ready, health)",
         ov_sby_med["restart_outside_engine_s"], ""),
        ("warm standby: rollsafe overhead (total - detection - engine start)",
         ov_sby_med["rollsafe_overhead_s"], f"< {TARGET_OVERHEAD_S * 1000:.0f} ms "
         f"{'met' if overhead_sby_ok else 'NOT met'}"),
    ]  # fmt: skip
    for name, value, target in rows:
        print(f"{name:<58} {value:>10.3f}  {target}")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
