"""Benchmark recovery on CPU as a distribution: crashes at random points of a running rollout.

A real :class:`~rollsafe.fleet.fleet.RolloutFleet` of one 1-rank reference-engine group (the
tiny Llama of ``make_tiny_model``), the demo's in-process
:class:`~rollsafe.demo_trainer.Trainer` and one rollout client thread (the demo's
:class:`~rollsafe.demo.RolloutLoad`) run steps shaped like ``rollsafe demo``'s: a rollout phase
(``--rollout-s``), a train step, a weight sync (``ipc``) with an asynchronous HF export;
immediate recovery and the targeted push are on (the demo's configuration). Crashes (SIGKILL of
the engine's rank 0) come at random points of the rollout phases: after each recovery the next
crash is due either at once (probability ``--right-after``: the first rollout instant after the
group is back, while a warm standby is still importing) or after a quiet time drawn uniformly
from ``[0, --max-gap-s]``, whatever the step is doing then (an export being written, a sync just
done...). Crashes never overlap: the next one waits until the previous recovery finished.

Modes (one fleet each, ``--crashes`` crashes each): **warm_standby** (``FleetConfig.warm_standby
=True``: one standby per group, the demo's default; the standby is a resident fork server, so a
restart forks the engine from it and it stays ready for the next crash), **warm_standby_x2**
(the same with ``engine=EngineSpec(..., standbys=2)``: two fork servers, the second only covering
the death of the first) and **no_standby** (every restart spawns a fresh interpreter). A
standby still importing when a crash comes (only before its first import finished) is raced
against a fresh spawn by the launcher.

For every crash: crash -> ``active`` with the current weights (the first ``active`` transition
of the group after the SIGKILL; the engine's weights checksum is then compared with the
trainer's), split into

* ``detection``: SIGKILL -> the health manager failed the group;
* ``restart``: the ``shutdown`` and ``restart`` steps (process teardown, then the handoff to
  the standby or the fresh spawn up to the engine's ready line and first health check), less
  the weight load inside it; labelled by the restart's source (``ready_standby``,
  ``warming_standby``, ``fresh_spawn``, from the :class:`~rollsafe.fleet.recovery.
  RecoveryResult`) and by the standby's state at the crash;
* ``weight_load``: the engine loading the export's weights during its start (a restart from a
  ready export: ``startup_s`` of its ready line, ``rank0_loaded - preloaded``);
* ``push``: the targeted push of the current version (when the recovery could not restart
  from a ready export of it, e.g. a crash while that export was still being written, or the
  fleet moved to a new version during the restart);
* ``other``: the rest (hand-off to the recovery worker, claim, lease, health, transitions).

Reports p50 / p95 / max of each, overall and by restart source. Other work on the machine
shows in the 1-minute load average, recorded at the start, at the end and at every crash.
Exits 1 when its own checks fail: a recovery that did not end ``active``, or an engine whose
checksum differs from the trainer's once its group is ``active`` again. Writes
``benchmarks/results/recovery_cpu.json`` (``--out``).

    .venv/bin/python benchmarks/bench_recovery.py [--crashes 25] [--rollout-s 2.5] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rollsafe.adapters.engines import EngineSpec  # noqa: E402
from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model  # noqa: E402
from rollsafe.demo import RolloutLoad  # noqa: E402
from rollsafe.demo_trainer import Trainer  # noqa: E402
from rollsafe.fleet import (  # noqa: E402
    FleetConfig,
    GroupSpec,
    HealthSettings,
    RecoveryResult,
    RecoverySettings,
    RolloutFleet,
)

OUT = REPO / "benchmarks" / "results" / "recovery_cpu.json"
HEALTH = HealthSettings(interval_s=0.2, timeout_s=1.0, failure_threshold=2)  # the demo's
WAIT_S = 90.0
TARGET_P95_WARM_S = 1.0
#: mode -> warm standbys per group (0: none)
MODES = {"warm_standby": 1, "warm_standby_x2": 2, "no_standby": 0}
PARTS = ("detection_s", "restart_s", "weight_load_s", "push_s", "other_s")


def _config(model_dir: Path, work: Path, standbys: int, budget: int) -> FleetConfig:
    (work / "logs").mkdir(parents=True, exist_ok=True)
    options: dict[str, Any] = {"log_dir": str(work / "logs")}
    if standbys:
        options["standbys"] = standbys
    return FleetConfig(
        model_path=model_dir,
        export_root=work / "exports",
        groups=[GroupSpec(1)],
        transport="ipc",
        health=HEALTH,
        recovery=RecoverySettings(
            max_workers=2, timeout_s=120.0, restart_budget=budget, targeted_push=True
        ),
        enable_immediate_recovery=True,
        engine=EngineSpec(model_path=str(model_dir), **options),
        wait_for_routable_s=2.0,
        request_timeout_s=20.0,
        warm_standby=standbys > 0,
    )


def pct(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by linear interpolation between order statistics."""
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def dist(values: list[float]) -> dict[str, Any]:
    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 4)

    return {
        "n": len(values),
        "p50": r(pct(values, 0.5)),
        "p95": r(pct(values, 0.95)),
        "max": r(max(values) if values else None),
        "min": r(min(values) if values else None),
    }


def _active_after(fleet: RolloutFleet, gid: str, after: float) -> float | None:
    for rec in fleet.registry.get(gid).machine.history:
        if rec.target == "active" and rec.timestamp > after:
            return float(rec.timestamp)
    return None


def _result_after(fleet: RolloutFleet, gid: str, crash_at: float) -> RecoveryResult | None:
    done = [r for r in fleet.recoveries() if r.group_id == gid and r.failed_at >= crash_at]
    return done[0] if done else None


def breakdown(
    crash_at: float, active_at: float, rec: RecoveryResult, startup: dict[str, Any]
) -> dict[str, float]:
    """Split crash -> active into :data:`PARTS` (they add up to the total)."""
    total = active_at - crash_at
    detection = rec.failed_at - crash_at
    restart = rec.step_seconds("shutdown") + rec.step_seconds("restart")
    weight_load = 0.0
    if rec.export_version is not None and rec.restart_source is not None and startup:
        # restarted on the export's weights (a dummy restart loads none worth counting)
        loaded = startup.get("rank0_loaded")
        if loaded is not None:
            weight_load = max(0.0, float(loaded) - float(startup.get("preloaded", 0.0)))
    weight_load = min(weight_load, restart)
    push = rec.step_seconds("push")
    restart -= weight_load
    other = total - detection - restart - weight_load - push
    return {
        "total_s": total,
        "detection_s": detection,
        "restart_s": restart,
        "weight_load_s": weight_load,
        "push_s": push,
        "other_s": other,
    }


def run_mode(
    mode: str, model_dir: Path, work: Path, args: argparse.Namespace
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    standbys = MODES[mode]
    warm = standbys > 0
    rng = random.Random(f"{args.seed}-{mode}")
    trainer = Trainer(model_dir, seed=0)
    crashes: list[dict[str, Any]] = []
    syncs = {"ok": 0, "failed": 0}
    cfg = _config(model_dir, work / mode, standbys, budget=args.crashes + 5)
    with RolloutFleet(cfg) as fleet:
        gid = fleet.group_ids[0]
        launcher = fleet.launcher(gid)
        assert fleet.exporter is not None
        version = 1
        trainer.step()
        if not fleet.sync_weights(trainer.weights(), version).ok:
            raise RuntimeError("the first sync failed")
        fleet.exporter.wait_hf_export(version, timeout=WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while warm and launcher.standby_status()["ready"] < standbys:
            if time.monotonic() > deadline:
                raise RuntimeError(f"not {standbys} warm standby(s) ready before the first crash")
            time.sleep(0.05)
        load = RolloutLoad(fleet, workers=1, seed=args.seed)
        pending: dict[str, Any] | None = None  # the crash being recovered
        due = time.monotonic() + rng.uniform(0.0, args.max_gap_s)
        right_after = False
        last_back = time.monotonic()
        t_mode = time.monotonic()
        try:
            while len(crashes) < args.crashes:
                step_t0 = time.monotonic()
                load.active.set()
                while time.monotonic() - step_t0 < args.rollout_s:
                    now = time.monotonic()
                    if pending is None and now >= due and len(crashes) < args.crashes:
                        state = launcher.standby_state
                        at = time.time()
                        pid = launcher.kill_rank(0)
                        fleet.observer.mark_crash(gid, at=at, rank=0, pid=pid)
                        pending = {
                            "crash_at": at,
                            "into_rollout_s": round(now - step_t0, 3),
                            "right_after_recovery": right_after,
                            "since_previous_back_s": round(now - last_back, 3),
                            "standby_at_crash": state,
                            "fleet_version": fleet.registry.fleet_version,
                            "loadavg_1m": round(os.getloadavg()[0], 2),
                        }
                    if pending is not None:
                        done = _check(fleet, gid, trainer, pending)
                        if done is not None:
                            crashes.append(done)
                            _say(mode, len(crashes), done)
                            pending = None
                            last_back = time.monotonic()
                            right_after = rng.random() < args.right_after
                            gap = 0.0 if right_after else rng.uniform(0.0, args.max_gap_s)
                            due = last_back + gap
                        elif time.time() - pending["crash_at"] > WAIT_S:
                            raise TimeoutError(f"{gid} not active {WAIT_S}s after a crash")
                    time.sleep(0.005)
                load.active.clear()
                trainer.step()
                version += 1
                report = fleet.sync_weights(trainer.weights(), version)
                syncs["ok" if report.ok else "failed"] += 1
        finally:
            load.close()
        stats = launcher.standby_stats
        extra = {
            "wall_s": round(time.monotonic() - t_mode, 1),
            "steps": version,
            "syncs": syncs,
            "standby_stats": stats,
            "recovery_summary": fleet.recovery.summary() if fleet.recovery else None,
        }
        if args.record_dir:
            print(f"  recorded run: {fleet.record(Path(args.record_dir) / mode)}/timeline.svg")
    return crashes, extra


def _check(
    fleet: RolloutFleet, gid: str, trainer: Trainer, pending: dict[str, Any]
) -> dict[str, Any] | None:
    """The finished crash record once the group is active again and its recovery ended."""
    crash_at = pending["crash_at"]
    active_at = _active_after(fleet, gid, crash_at)
    if active_at is None:
        return None
    rec = _result_after(fleet, gid, crash_at)
    if rec is None or fleet.recovery is None or fleet.recovery.in_progress(gid):
        return None
    launcher = fleet.launcher(gid)
    startup = dict(launcher.ready_info.get("startup_s", {}))
    # the group's checker against the trainer's weights in its own layout (SGLang's fused ones)
    check = fleet.check_weights(trainer.weights()).get(gid)
    parts = breakdown(crash_at, active_at, rec, startup)
    return {
        **pending,
        "active_at": active_at,
        **{k: round(v, 4) for k, v in parts.items()},
        "status": rec.status,
        "strategy": rec.strategy,
        "restart_source": rec.restart_source,
        "standby_at_restart": rec.standby_at_restart,
        "attempts": rec.attempts,
        "state_when_checked": fleet.registry.get(gid).state,
        "weights_match_trainer": check is not None and check.equal,
        "startup_s": startup,
        "steps": [
            {"name": s.name, "seconds": round(s.seconds, 4), "ok": s.ok, "detail": s.detail[:160]}
            for s in rec.steps
        ],
    }


def _say(mode: str, n: int, c: dict[str, Any]) -> None:
    after = " (right after the previous recovery)" if c["right_after_recovery"] else ""
    print(
        f"  {mode} #{n}: {c['total_s']:.3f}s (detect {c['detection_s']:.3f}, restart"
        f" {c['restart_s']:.3f} from {c['restart_source']}, load {c['weight_load_s']:.3f},"
        f" push {c['push_s']:.3f}, other {c['other_s']:.3f}) standby at crash"
        f" {c['standby_at_crash']}{after};"
        f" {c['strategy']} -> {c['status']}; weights match {c['weights_match_trainer']}"
    )


def summarize(crashes: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "crash_to_active": dist([c["total_s"] for c in crashes]),
        "parts": {p: dist([c[p] for c in crashes]) for p in PARTS},
        "by_restart_source": {},
        "by_standby_at_crash": {},
        "by_strategy": {},
    }
    for key, field in (
        ("by_restart_source", "restart_source"),
        ("by_standby_at_crash", "standby_at_crash"),
        ("by_strategy", "strategy"),
    ):
        for value in sorted({str(c[field]) for c in crashes}):
            mine = [c for c in crashes if str(c[field]) == value]
            out[key][value] = {
                "crash_to_active": dist([c["total_s"] for c in mine]),
                "restart": dist([c["restart_s"] for c in mine]),
            }
    out["right_after_recovery"] = sum(bool(c["right_after_recovery"]) for c in crashes)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--crashes", type=int, default=25, help="crashes per mode (default 25)")
    p.add_argument("--rollout-s", type=float, default=2.5, help="rollout phase per step (s)")
    p.add_argument(
        "--right-after",
        type=float,
        default=0.25,
        help="probability that a crash comes right after the previous recovery (default 0.25)",
    )
    p.add_argument(
        "--max-gap-s", type=float, default=8.0, help="otherwise a quiet time U[0, this] (s)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--record-dir", default=None, help="also record each mode's run here")
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or args.crashes < 1:
        p.error(f"unknown modes {unknown}" if unknown else "--crashes must be >= 1")
    work = Path(tempfile.mkdtemp(prefix="rollsafe-bench-recovery-"))
    t_wall = time.monotonic()
    load_before = os.getloadavg()[0]
    results: dict[str, Any] = {}
    failures: list[str] = []
    try:
        model_dir = make_tiny_model(work / "model", seed=0)
        for mode in modes:
            print(f"{mode}: {args.crashes} crashes")
            crashes, extra = run_mode(mode, model_dir, work, args)
            for i, c in enumerate(crashes, 1):
                if c["status"] != "active":
                    failures.append(f"{mode} #{i}: recovery ended {c['status']}")
                if not c["weights_match_trainer"]:
                    failures.append(f"{mode} #{i}: engine checksum != trainer's once active")
            results[mode] = {"summary": summarize(crashes), **extra, "crashes": crashes}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    p95_warm = {
        mode: r["summary"]["crash_to_active"]["p95"]
        for mode, r in results.items()
        if MODES[mode] > 0
    }
    result: dict[str, Any] = {
        "benchmark": "recovery_cpu",
        "model": "tiny llama (make_tiny_model), 1 group x 1 rank, reference engine, ipc, "
        "immediate recovery + targeted push, 1 rollout client thread",
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "machine": platform.machine(),
            "loadavg_1m_at_start": round(load_before, 2),
            "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
            "loadavg_1m_at_crashes": dist(
                [c["loadavg_1m"] for r in results.values() for c in r["crashes"]]
            ),
        },
        "config": {
            "crashes_per_mode": args.crashes,
            "rollout_s": args.rollout_s,
            "right_after_probability": args.right_after,
            "max_gap_s": args.max_gap_s,
            "seed": args.seed,
            "modes": modes,
            "health": {
                "interval_s": HEALTH.interval_s,
                "timeout_s": HEALTH.timeout_s,
                "failure_threshold": HEALTH.failure_threshold,
            },
        },
        "targets": {"warm_standby_p95_max_s": TARGET_P95_WARM_S},
        "checks": {"ok": not failures, "failures": failures},
        "warm_standby_p95_within_target": {m: p <= TARGET_P95_WARM_S for m, p in p95_warm.items()},
        "modes": results,
        "wall_s": round(time.monotonic() - t_wall, 1),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")

    print(f"\n{'crash -> active with current weights (s)':<52} {'p50':>7} {'p95':>7} {'max':>7}")
    for mode, r in results.items():
        s = r["summary"]
        rows = [(f"{mode}: all {s['crash_to_active']['n']} crashes", s["crash_to_active"])]
        rows += [(f"  part {p.removesuffix('_s')}", s["parts"][p]) for p in PARTS]
        for src, d in s["by_restart_source"].items():
            rows.append(
                (
                    f"  restart from {src} (n={d['crash_to_active']['n']}): total",
                    d["crash_to_active"],
                )
            )
            rows.append((f"  restart from {src}: restart part", d["restart"]))
        for st, d in s["by_standby_at_crash"].items():
            rows.append(
                (
                    f"  standby {st} at the crash (n={d['crash_to_active']['n']})",
                    d["crash_to_active"],
                )
            )
        for name, d in rows:
            print(f"{name:<52} {d['p50']:>7.3f} {d['p95']:>7.3f} {d['max']:>7.3f}")
    for mode, p95 in p95_warm.items():
        verdict = "met" if p95 <= TARGET_P95_WARM_S else "NOT met"
        print(f"{mode} p95 {p95:.3f}s, target <= {TARGET_P95_WARM_S:g}s: {verdict}")
    load = result["host"]["loadavg_1m_at_crashes"]
    print(
        f"1-min load average ({result['host']['cpus']} cpus): {load_before:.2f} at the start, "
        f"{load['p50']} p50 / {load['max']} max at the crashes"
    )
    print(f"wrote {out} ({result['wall_s']}s)")
    if failures:
        print("CHECKS FAILED:")
        for f in failures:
            print(f"  - {f}")
        return 1
    print("checks: every recovery ended active with the trainer's weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
