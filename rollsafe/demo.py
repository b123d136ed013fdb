"""``rollsafe demo``: a trainer actor, a rollout fleet, weight syncs, async exports and a SIGKILL.

On one CPU machine with a local Ray (``RAY_ADDRESS`` joins a cluster instead): a Ray trainer
actor (:class:`~rollsafe.demo_trainer.RayTrainer`) trains a tiny Llama (the reference engine's
``make_tiny_model`` config, seed-fixed) with SGD on synthetic token data; a
:class:`~rollsafe.fleet.fleet.RolloutFleet` of ``--groups`` reference-engine groups (the second
has 2 ranks) serves rollouts through the router from background threads during each step's
rollout phase; after each train step the driver fetches the actor's weights through the object
store and syncs them over ``--transport`` (``ipc`` or ``nccl``, gloo on CPU), and every version
is exported asynchronously. During step ``--crash-at``'s rollout rank 1 of the 2-rank group is
SIGKILLed. ``--trainer inprocess`` runs the same trainer in the driver (no Ray).

It prints live progress, then a timeline of every machine transition, the recovery latency
(crash -> ``active`` with current weights), the throughput lost, the per-step weights checksum
check (every serving engine against the trainer actor's own digest) and where the time went,
the trainer actor's round trips included; it writes ``<out>/timeline.jsonl`` (with the syncs,
recoveries, the crash and the request rates: :mod:`rollsafe.observe.runfile`),
``<out>/timeline.svg`` (its picture), ``<out>/fleet.json``, ``<out>/paths.md`` (the paths the
machines actually took, as mermaid ``stateDiagram-v2``) and ``<out>/summary.json``;
``rollsafe report <out>`` reads them back. Exit status 1 if an invariant broke: a request
admitted to a non-``active`` group, an engine serving weights other than the trainer's, a failed
step, or the crashed group never returning. Engines, the trainer actor and the local Ray are shut
down on the way out, also on an error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from rollsafe.demo_trainer import Trainer, TrainerLike

__all__ = ["CRASH_DELAY_S", "DemoOptions", "Trainer", "add_arguments", "main", "run_demo"]

CRASH_GROUP_INDEX = 1  # the 2-rank group
CRASH_DELAY_S = 1.0  # into the crash step's rollout
THINK_S = 0.02  # pause between one client's requests


class DemoOptions(argparse.Namespace):
    steps: int
    groups: int
    transport: str
    crash_at: int
    no_immediate_recovery: bool
    out: str
    rollout_s: float
    workers: int
    trainer: str
    quiet: bool
    warm_standby: bool
    max_new_tokens: int
    no_continuation: bool


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=4, help="training steps (default 4)")
    p.add_argument("--groups", type=int, default=3, help="engine groups, >= 2 (default 3)")
    p.add_argument("--transport", choices=("ipc", "nccl"), default="ipc")
    p.add_argument(
        "--crash-at", type=int, default=2, help="step whose rollout loses a rank (0: no crash)"
    )
    p.add_argument(
        "--no-immediate-recovery", action="store_true", help="deferred baseline for comparison"
    )
    p.add_argument("--out", default="demo-report", help="report directory (default demo-report)")
    p.add_argument("--rollout-s", type=float, default=8.0, help="rollout phase per step (s)")
    p.add_argument("--workers", type=int, default=2, help="rollout client threads")
    p.add_argument(
        "--trainer",
        choices=("actor", "inprocess"),
        default="actor",
        help="actor: a Ray trainer actor on a local Ray (default); inprocess: no Ray",
    )
    p.add_argument("--quiet", action="store_true", help="no live progress lines")
    p.add_argument(
        "--max-new-tokens", type=int, default=8, help="tokens per rollout request (default 8)"
    )
    p.add_argument(
        "--no-continuation",
        action="store_true",
        help="baseline: a request whose group dies starts over (its tokens regenerated) instead "
        "of continuing from its last streamed token",
    )
    p.add_argument(
        "--warm-standby",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep a pre-imported standby engine process per group for fast restarts "
        "(default on)",
    )


# ---------------------------------------------------------------------------- rollout load
class RolloutLoad:
    """Background threads issuing generate requests while ``active`` is set."""

    def __init__(self, fleet: Any, workers: int, seed: int = 0, max_new_tokens: int = 8) -> None:
        self.fleet = fleet
        self.max_new_tokens = max_new_tokens
        self.active = threading.Event()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.served: Counter[str] = Counter()
        self.failed = 0
        self.errors: list[str] = []
        self.threads = [
            threading.Thread(target=self._run, args=(seed + i,), daemon=True, name=f"rollout-{i}")
            for i in range(workers)
        ]
        for t in self.threads:
            t.start()

    def _run(self, seed: int) -> None:
        from rollsafe.fleet import NoRoutableGroup, RouterError

        rng = random.Random(seed)
        while not self.stop.is_set():
            if not self.active.wait(0.1):
                continue
            prompt = [rng.randrange(1, 500) for _ in range(8)]
            try:
                res = self.fleet.generate(
                    prompt, sampling_params={"max_new_tokens": self.max_new_tokens}
                )
            except (NoRoutableGroup, RouterError) as exc:
                with self.lock:
                    self.failed += 1
                    if len(self.errors) < 20:
                        self.errors.append(str(exc)[:300])
                time.sleep(0.05)
                continue
            with self.lock:
                self.served[res.group_id] += 1
            time.sleep(THINK_S)  # leave CPU to the engines (and a restarting one) on 2 cores

    def take(self) -> tuple[dict[str, int], int]:
        with self.lock:
            served, failed = dict(self.served), self.failed
            self.served.clear()
            self.failed = 0
        return served, failed

    def close(self) -> None:
        self.stop.set()
        self.active.clear()
        for t in self.threads:
            t.join(timeout=60)


# ---------------------------------------------------------------------------- report helpers
def _states(fleet: Any) -> str:
    """``g0=active g1=inactive ...``; with warm standbys each group's standby state too
    (``g0=active/sb:ready``: ``ready``, ``warming`` while it imports, ``none``)."""
    standby = bool(getattr(fleet.config, "warm_standby", False))
    return " ".join(
        f"{g.group_id}={g.state}" + (f"/sb:{g.standby_state}" if standby else "")
        for g in fleet.registry.groups()
    )


def _continued(fleet: Any) -> str:
    """``continued 3 (kept 412 tok, regenerated 0)``: requests continued after their group
    failed or a sync aborted them, the tokens they kept, the tokens started over (baseline)."""
    c = fleet.router.stats()["continuation"]
    return (
        f"continued {c['after_failure'] + c['after_abort']} (kept {c['tokens_kept']} tok,"
        f" regenerated {c['tokens_regenerated']})"
    )


def _exports(fleet: Any) -> str:
    states = fleet.export_states()
    return ", ".join(f"v{v} {s}" for v, s in list(states.items())[-2:]) or "none"


def mermaid_paths(timeline: Sequence[dict[str, Any]]) -> str:
    """One ``stateDiagram-v2`` per machine of the states it actually visited (markdown)."""
    subjects: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in timeline:
        key = (row["kind"], "exports" if row["kind"] == "export" else row["subject"])
        subjects.setdefault(key, []).append(row)
    parts = ["# Paths the machines took in this run\n"]
    for (kind, subject), rows in subjects.items():
        edges: dict[tuple[str, str], list[str]] = {}
        for r in rows:
            events = edges.setdefault((r["source"], r["target"]), [])
            if r["event"] not in events:
                events.append(r["event"])
        lines = ["stateDiagram-v2", f"    [*] --> {rows[0]['source']}"]
        for (src, dst), events in edges.items():
            lines.append(f"    {src} --> {dst} : {', '.join(events)}")
        parts.append(f"## {kind} {subject}\n\n```mermaid\n" + "\n".join(lines) + "\n```\n")
    return "\n".join(parts)


def _table(timeline: Sequence[dict[str, Any]], t0: float) -> str:
    out = [f"{'t (s)':>8}  {'machine':<28} {'event':<16} transition"]
    for r in timeline:
        name = f"{r['kind']} {r['subject']}"
        move = f"{r['source']} -> {r['target']}"
        out.append(f"{r['timestamp'] - t0:8.3f}  {name:<28} {r['event']:<16} {move}")
    return "\n".join(out)


def _exit_on_sigterm() -> Callable[[], None]:
    """Turn the first SIGTERM into ``SystemExit(143)`` so the demo's cleanup runs; return undo.

    Only in the main thread (signal handlers cannot be set elsewhere). A second SIGTERM during
    the cleanup gets the previous handler. ``ray.init`` replaces it with its own equivalent
    (``sys.exit(15)``), so with the trainer actor the exit status is 15.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, previous)
        raise SystemExit(128 + signum)

    def undo() -> None:
        signal.signal(signal.SIGTERM, previous)

    signal.signal(signal.SIGTERM, handler)
    return undo


# ---------------------------------------------------------------------------- the run
def run_demo(opts: DemoOptions) -> int:
    from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model
    from rollsafe.fleet.fleet import (
        FleetConfig,
        GroupSpec,
        HealthSettings,
        RecoverySettings,
        RolloutFleet,
    )
    from rollsafe.invariants import check_all

    if opts.groups < 2:
        print("--groups must be >= 2 (one of them is the 2-rank group)")
        return 2
    if opts.steps < 1:
        print("--steps must be >= 1")
        return 2
    say = (lambda *a: None) if opts.quiet else print
    immediate = not opts.no_immediate_recovery
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rollsafe-demo-"))
    (work / "logs").mkdir()
    timings: dict[str, float] = defaultdict(float)
    t_begin = time.time()
    wall0 = time.monotonic()

    sizes = [2 if i == CRASH_GROUP_INDEX else 1 for i in range(opts.groups)]
    actor = opts.trainer == "actor"
    who = "trainer actor" if actor else "trainer"
    print(
        f"rollsafe demo: {opts.steps} steps, groups {sizes} (ranks), transport {opts.transport},"
        f" crash at step {opts.crash_at or 'never'},"
        f" {'immediate' if immediate else 'deferred (baseline)'} recovery,"
        f" {'Ray trainer actor' if actor else 'in-process trainer'}"
    )
    steps: list[dict[str, Any]] = []
    crash: dict[str, Any] | None = None
    load: RolloutLoad | None = None
    failures: list[str] = []
    trainer: TrainerLike | None = None
    fleet: RolloutFleet | None = None
    ray_dir: Path | None = None
    interrupted = ""
    restore_sigterm = _exit_on_sigterm()
    try:
        t = time.monotonic()
        model_dir = make_tiny_model(work / "model", seed=0)
        timings["setup (tiny model)"] += time.monotonic() - t
        t = time.monotonic()
        if actor:
            from rollsafe.demo_trainer import RayTrainer

            ray_dir = Path(tempfile.mkdtemp(prefix="rollsafe-ray-"))
            trainer = RayTrainer(model_dir, seed=0, temp_dir=ray_dir)
            timings["trainer actor start (ray.init, actor, model)"] += time.monotonic() - t
        else:
            trainer = Trainer(model_dir, seed=0)
            timings["trainer start (model)"] += time.monotonic() - t
        info = trainer.describe()
        say(
            f"{who} up in {time.monotonic() - t:.1f}s: pid {info['pid']}"
            f" (driver pid {info['driver_pid']})"
            + (f", Ray {info['ray_address']}, node {str(info['node_id'])[:12]}" if actor else "")
            + f"; scratch {work}"
            + (f", Ray files {ray_dir}" if ray_dir else "")
        )
        config = FleetConfig(
            model_path=model_dir,
            export_root=work / "exports",
            groups=[GroupSpec(n) for n in sizes],
            transport=opts.transport,
            health=HealthSettings(interval_s=0.2, timeout_s=1.0, failure_threshold=2),
            recovery=RecoverySettings(
                max_workers=2, timeout_s=120.0, restart_budget=3, targeted_push=immediate
            ),
            enable_immediate_recovery=immediate,
            engine_options={"log_dir": str(work / "logs")},
            # every group keeps one pre-imported engine process: a restart skips the
            # interpreter start and the torch/transformers imports (seconds on CPU)
            warm_standby=opts.warm_standby,
            wait_for_routable_s=2.0,
            request_timeout_s=20.0,
        )
        fleet = RolloutFleet(config)
        t = time.monotonic()
        fleet.start()
        timings["fleet start (engines up)"] += time.monotonic() - t
        say(f"fleet up in {fleet.start_seconds:.1f}s: {_states(fleet)}")
        want = trainer.checksum()
        initial = fleet.checksums()
        if any(v != want for v in initial.values()):
            failures.append(f"step 0: engines do not start on the trainer's weights: {initial}")
        fleet.router.keep_tokens = not getattr(opts, "no_continuation", False)
        load = RolloutLoad(fleet, opts.workers, max_new_tokens=getattr(opts, "max_new_tokens", 8))
        crash_gid = fleet.group_ids[CRASH_GROUP_INDEX]
        cont_seen: dict[str, int] = {}
        for step in range(1, opts.steps + 1):
            record: dict[str, Any] = {"step": step, "version_served": fleet.registry.fleet_version}
            # -------- rollout
            t = time.monotonic()
            load.active.set()
            end = t + opts.rollout_s
            crashed_now = False
            next_print = t
            while time.monotonic() < end:
                now = time.monotonic()
                if step == opts.crash_at and not crashed_now and now - t >= CRASH_DELAY_S:
                    pid = fleet.launcher(crash_gid).kill_rank(1)
                    crash = {"group": crash_gid, "step": step, "rank": 1, "pid": pid,
                             "at": time.time()}  # fmt: skip
                    crashed_now = True
                    # the onset of the failure for the metrics, timeline.jsonl and its picture
                    fleet.observer.mark_crash(crash_gid, at=crash["at"], rank=1, pid=pid)
                    say(f"  !! step {step}: SIGKILL rank 1 (pid {pid}) of {crash_gid}")
                if now >= next_print:
                    with load.lock:
                        n_ok, n_bad = sum(load.served.values()), load.failed
                    say(
                        f"  step {step} rollout {now - t:4.1f}s | {_states(fleet)} |"
                        f" served {n_ok} failed {n_bad} | {_continued(fleet)} |"
                        f" export {_exports(fleet)}"
                    )
                    next_print = now + 1.0
                time.sleep(0.05)
            load.active.clear()
            served, failed = load.take()
            cont_now = fleet.router.stats()["continuation"]
            record["continuation"] = {k: v - cont_seen.get(k, 0) for k, v in cont_now.items()}
            cont_seen = cont_now
            rollout_s = time.monotonic() - t
            timings["rollout"] += rollout_s
            record.update(served_by_group=served, served=sum(served.values()), failed=failed,
                          rollout_s=rollout_s)  # fmt: skip
            # -------- train
            t = time.monotonic()
            record["loss"] = trainer.step()
            timings[f"train ({who} round trip)" if actor else "train"] += time.monotonic() - t
            # -------- fetch the new version, sync it
            try:
                t = time.monotonic()
                weights = trainer.weights()
                timings["fetch weights (object store)" if actor else "weights snapshot"] += (
                    time.monotonic() - t
                )
                t = time.monotonic()
                report = fleet.sync_weights(weights, step)
                timings["sync"] += time.monotonic() - t
                record["sync"] = report.as_dict()
                if not report.ok:
                    failures.append(f"step {step}: sync failed: {report.error}")
            except Exception as exc:  # a failed step is an invariant break, keep reporting
                failures.append(f"step {step}: sync raised {type(exc).__name__}: {exc}")
                record["sync"] = {"ok": False, "error": str(exc)}
            # -------- verify
            t = time.monotonic()
            want = trainer.checksum()
            checks: dict[str, str] = {}
            for gid, got in fleet.checksums().items():
                state = fleet.registry.get(gid).state
                if state != "active":
                    checks[gid] = f"not serving ({state})"
                elif got == want:
                    checks[gid] = "match"
                else:
                    checks[gid] = "MISMATCH"
                    failures.append(f"step {step}: {gid} serves {got}, trainer has {want}")
            record["checksums"] = checks
            timings[f"verify checksums (engines, {who})"] += time.monotonic() - t
            steps.append(record)
            print(
                f"step {step}/{opts.steps}: loss {record['loss']:.3f} | served {record['served']}"
                f" failed {failed} | sync v{step}"
                f" {'ok' if record['sync'].get('ok') else 'FAILED'}"
                f" {sum(record['sync'].get('timings', {}).values()):.2f}s |"
                f" {_states(fleet)} | export {_exports(fleet)} |"
                f" checksums {sorted(set(checks.values()))}"
            )
        load.close()
        # -------- settle: every group back and on the trainer's weights
        t = time.monotonic()
        fleet.wait_recoveries(timeout=120.0)
        final = fleet.checksums()
        want = trainer.checksum()
        final_checks = {}
        for gid, got in final.items():
            state = fleet.registry.get(gid).state
            final_checks[gid] = "match" if state == "active" and got == want else f"{state}/{got}"
            if final_checks[gid] != "match":
                failures.append(f"final: {gid} is {state} with checksum {got}, want {want}")
        with_export = fleet.exporter
        if with_export is not None:
            try:
                with_export.wait_hf_export(opts.steps, timeout=60)
            except Exception as exc:
                failures.append(f"final export v{opts.steps} did not become ready: {exc}")
        timings["settle (recoveries, last export)"] += time.monotonic() - t
        dispatch = fleet.registry.dispatch_counts()
        bad_dispatch = {g: c for g, c in dispatch.items() if set(c) - {"active"}}
        if bad_dispatch:
            failures.append(f"requests admitted to non-active groups: {bad_dispatch}")
        # The named invariants the verifier and the property tests check, on the live fleet.
        failures.extend(f"invariant {v}" for v in check_all(fleet.picture()))
        timeline = fleet.timeline()
        snapshot = fleet.snapshot()
        recoveries = [r.as_dict() for r in fleet.recoveries()]
    except (KeyboardInterrupt, SystemExit) as exc:
        interrupted = type(exc).__name__
        raise
    finally:
        if load is not None:
            load.close()
        try:
            if fleet is not None:
                t = time.monotonic()
                fleet.close()
                timings["close (fleet, engines)"] += time.monotonic() - t
        finally:
            if trainer is not None:
                t = time.monotonic()
                trainer.close()
                timings["close (trainer actor, Ray)" if actor else "close (trainer)"] += (
                    time.monotonic() - t
                )
            restore_sigterm()
            shutil.rmtree(work, ignore_errors=True)
            if ray_dir is not None:
                shutil.rmtree(ray_dir, ignore_errors=True)
            if interrupted:
                print(
                    f"demo interrupted ({interrupted}): engines"
                    + (", trainer actor and Ray" if actor else " and trainer")
                    + " shut down"
                )

    assert trainer is not None
    trainer_info = trainer.describe()
    # -------- recovery latency and throughput lost
    recovery: dict[str, Any] = {"crashed": crash is not None}
    if crash is not None:
        back = [
            r for r in timeline
            if r["kind"] == "group" and r["subject"] == crash["group"]
            and r["target"] == "active" and r["timestamp"] > crash["at"]
        ]  # fmt: skip
        out_of_routing = [
            r for r in timeline
            if r["kind"] == "group" and r["subject"] == crash["group"]
            and r["event"] == "fail" and r["timestamp"] > crash["at"]
        ]  # fmt: skip
        recovery.update(crash)
        recovery["active_again_at"] = back[0]["timestamp"] if back else None
        recovery["latency_s"] = back[0]["timestamp"] - crash["at"] if back else None
        recovery["detected_after_s"] = (
            out_of_routing[0]["timestamp"] - crash["at"] if out_of_routing else None
        )
        mine = [r for r in recoveries if r["group_id"] == crash["group"]]
        recovery["strategy"] = mine[0]["strategy"] if mine else None
        recovery["status"] = mine[0]["status"] if mine else None
        recovery["restart_source"] = mine[0].get("restart_source") if mine else None
        recovery["standby_at_restart"] = mine[0].get("standby_at_restart") if mine else None
        recovery["coordinator"] = mine
        if not back:
            failures.append(f"{crash['group']} never became active again after the crash")
    base = [s for s in steps if s["step"] != (crash or {}).get("step")]
    per_group_rate = {
        g: (sum(s["served_by_group"].get(g, 0) for s in base) / len(base)) if base else None
        for g in ([crash["group"]] if crash else [])
    }
    throughput = {
        "per_step": [
            {
                "step": s["step"],
                "served": s["served"],
                "failed": s["failed"],
                "by_group": s["served_by_group"],
            }
            for s in steps
        ],
        "served_total": sum(s["served"] for s in steps),
        "failed_total": sum(s["failed"] for s in steps),
    }
    if crash is not None:
        crash_step = next(s for s in steps if s["step"] == crash["step"])
        g = crash["group"]
        typical = per_group_rate.get(g)
        throughput["crashed_group_served_in_crash_step"] = crash_step["served_by_group"].get(g, 0)
        throughput["crashed_group_served_per_other_step"] = typical
        if typical:
            lost = max(0.0, typical - crash_step["served_by_group"].get(g, 0))
            throughput["requests_lost_in_crash_step"] = round(lost, 1)
            throughput["fraction_of_crash_step_lost"] = round(
                lost / max(1.0, sum(s["served"] for s in base) / len(base)), 3
            )
        throughput["group_unavailable_s"] = recovery.get("latency_s")

    # -------- continued requests (#17): tokens kept vs regenerated, the crash step's share
    continuation: dict[str, Any] = {
        "mode": "start_over" if getattr(opts, "no_continuation", False) else "continue",
        "max_new_tokens": getattr(opts, "max_new_tokens", 8),
        "total": snapshot["router"]["continuation"],
        "per_step": {s["step"]: s.get("continuation", {}) for s in steps},
    }
    if crash is not None:
        cstep = next(s for s in steps if s["step"] == crash["step"]).get("continuation", {})
        continuation["crash_step"] = cstep
        continuation["tokens_regenerated_after_crash"] = cstep.get("tokens_regenerated", 0)
        continuation["tokens_kept_after_crash"] = cstep.get("tokens_kept", 0)
        continuation["crash_step_lost_fraction"] = throughput.get("fraction_of_crash_step_lost")

    standbys: dict[str, Any] = {
        gid: g.get("standby") for gid, g in snapshot["registry"]["groups"].items()
    }
    ok = not failures
    checksums_ok = not any("MISMATCH" in f or "checksum" in f for f in failures)
    summary = {
        "ok": ok,
        "failures": failures,
        "options": {k: v for k, v in vars(opts).items() if not k.startswith("_") and k != "func"},
        "immediate_recovery": immediate,
        "trainer": trainer_info,
        "scratch_dir": str(work),
        "groups": dict(zip([f"g{i}" for i in range(len(sizes))], sizes, strict=True)),
        "recovery": recovery,
        "throughput": throughput,
        "continuation": continuation,
        "standby": standbys,
        "checksums": {
            "per_step": {s["step"]: s["checksums"] for s in steps},
            "final": final_checks,
            "all_matched": checksums_ok,
        },
        "dispatch_counts": dispatch,
        "steps": steps,
        "final_snapshot": snapshot,
        "timings_s": {k: round(v, 3) for k, v in timings.items()},
        "wall_s": round(time.monotonic() - wall0, 3),
    }
    # timeline.jsonl (transitions, syncs, recoveries, the crash, request rates), fleet.json and
    # timeline.svg; `rollsafe report <out>` reads them back and redraws the picture
    assert fleet is not None
    fleet.record(out, t0=t_begin)
    (out / "paths.md").write_text(mermaid_paths(timeline))
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")

    print("\ntimeline (every machine transition, seconds since start):")
    print(_table(timeline, t_begin))
    print("\nrecovery:")
    if crash is None:
        print("  no crash scheduled")
    else:
        lat = recovery["latency_s"]
        print(
            f"  {crash['group']} rank 1 SIGKILLed at step {crash['step']};"
            f" out of routing after {recovery['detected_after_s'] or float('nan'):.2f}s;"
            f" active with current weights after {lat if lat is not None else float('nan'):.2f}s"
            f" (strategy {recovery['strategy']}, status {recovery['status']})"
        )
        if recovery.get("restart_source"):
            print(
                f"  restarted from a {recovery['restart_source'].replace('_', ' ')}"
                f" (its standby was {recovery['standby_at_restart']} when the restart began)"
            )
    if opts.warm_standby:
        print("warm standbys (at the end; starts by source, fallbacks to a fresh spawn):")
        for gid, status in standbys.items():
            sb = status or {}
            print(
                f"  {gid}: {sb.get('state')} | ready {sb.get('used_ready', 0)}"
                f" warming {sb.get('used_warming', 0)} fallbacks {sb.get('fallbacks', 0)}"
                f" (raced {sb.get('raced', 0)}; last fallback: {sb.get('last_fallback')})"
            )
    print("throughput:")
    for s in throughput["per_step"]:
        by = s["by_group"]
        print(f"  step {s['step']}: served {s['served']} failed {s['failed']} by group {by}")
    if "requests_lost_in_crash_step" in throughput:
        print(
            f"  lost in the crash step: ~{throughput['requests_lost_in_crash_step']} requests"
            f" of {crash and crash['group']}"
            f" ({throughput['fraction_of_crash_step_lost']:.1%} of a normal step's total)"
        )
    total = continuation["total"]
    print(
        f"continued requests ({continuation['mode']}): after a failure {total['after_failure']},"
        f" after a sync abort {total['after_abort']}; tokens kept {total['tokens_kept']},"
        f" regenerated {total['tokens_regenerated']}"
    )
    if "crash_step" in continuation:
        print(
            f"  crash step: {continuation['tokens_kept_after_crash']} token(s) kept,"
            f" {continuation['tokens_regenerated_after_crash']} regenerated, lost throughput"
            f" {continuation['crash_step_lost_fraction'] or 0:.1%}"
        )
    matched = checksums_ok
    print(f"checksums: every active engine == trainer after every step: {matched}")
    print(f"dispatch to non-active groups: {bad_dispatch or 'none'}")
    print("where time went:")
    for k, v in timings.items():
        print(f"  {k:<46} {v:7.2f}s")
    print(f"  {'total':<46} {summary['wall_s']:7.2f}s")
    if actor:
        print(
            f"  trainer actor pid {trainer_info['pid']} (driver pid {trainer_info['driver_pid']});"
            " round trips (driver-measured = in actor + Ray overhead):"
        )
        for method, rt in trainer_info["round_trips"].items():
            print(
                f"    {method:<9} {rt['calls']:3d} calls {rt['seconds']:7.3f}s"
                f" = {rt['in_actor_s']:.3f}s in actor + {rt['overhead_s']:.3f}s Ray"
            )
        print(
            f"    weights fetched zero-copy from the object store:"
            f" {trainer_info['weights_fetched_zero_copy']}; rebuilt and verified in"
            f" {trainer_info['fetch_rebuild_verify_s']:.3f}s"
        )
    print(f"report: {out}/timeline.jsonl, {out}/paths.md, {out}/summary.json, {out}/fleet.json")
    print(f"picture: {out}/timeline.svg (`rollsafe report {out}` checks the run and redraws it)")
    if ok:
        print("demo OK: all invariants held")
        return 0
    print("demo FAILED:")
    for f_ in failures:
        print(f"  - {f_}")
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollsafe demo", description=__doc__)
    add_arguments(parser)
    return run_demo(parser.parse_args(argv, namespace=DemoOptions()))


if __name__ == "__main__":
    raise SystemExit(main())
