"""``rollsafe demo``: a trainer, a rollout fleet, weight syncs, async exports and a SIGKILL.

On one CPU machine: an in-process trainer trains a tiny Llama (the reference engine's
``make_tiny_model`` config, seed-fixed) with SGD on synthetic token data; a
:class:`~rollsafe.fleet.fleet.RolloutFleet` of ``--groups`` reference-engine groups (the second
has 2 ranks) serves rollouts through the router from background threads during each step's
rollout phase; weights sync each step over ``--transport`` and every version is exported
asynchronously. During step ``--crash-at``'s rollout rank 1 of the 2-rank group is SIGKILLed.

It prints live progress, then a timeline of every machine transition, the recovery latency
(crash -> ``active`` with current weights), the throughput lost, the per-step weights checksum
check and where the time went; it writes ``<out>/timeline.jsonl``, ``<out>/paths.md`` (the
paths the machines actually took, as mermaid ``stateDiagram-v2``) and ``<out>/summary.json``.
Exit status 1 if an invariant broke: a request admitted to a non-``active`` group, an engine
serving weights other than the trainer's, a failed step, or the crashed group never returning.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["DemoOptions", "add_arguments", "main", "run_demo"]

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
    quiet: bool


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
    p.add_argument("--quiet", action="store_true", help="no live progress lines")


# ---------------------------------------------------------------------------- trainer
class Trainer:
    """A plain PyTorch trainer: a tiny Llama and SGD on seeded synthetic token batches."""

    def __init__(self, model_dir: Path, seed: int = 0, lr: float = 0.05) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir))
        self.model.train()
        self.vocab = int(self.model.config.vocab_size)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.gen = torch.Generator().manual_seed(seed)

    def step(self) -> float:
        import torch

        batch = torch.randint(0, self.vocab, (4, 16), generator=self.gen)
        out = self.model(input_ids=batch, labels=batch)
        self.opt.zero_grad()
        out.loss.backward()
        self.opt.step()
        return float(out.loss.detach())

    def weights(self) -> dict[str, Any]:
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def checksum(self) -> str:
        from rollsafe.checksum import weights_checksum

        return str(weights_checksum(self.weights())["model"])


# ---------------------------------------------------------------------------- rollout load
class RolloutLoad:
    """Background threads issuing generate requests while ``active`` is set."""

    def __init__(self, fleet: Any, workers: int, seed: int = 0) -> None:
        self.fleet = fleet
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
                res = self.fleet.generate(prompt, sampling_params={"max_new_tokens": 8})
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
    return " ".join(f"{g.group_id}={g.state}" for g in fleet.registry.groups())


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

    t = time.monotonic()
    model_dir = make_tiny_model(work / "model", seed=0)
    trainer = Trainer(model_dir, seed=0)
    timings["setup (tiny model, trainer)"] += time.monotonic() - t

    sizes = [2 if i == CRASH_GROUP_INDEX else 1 for i in range(opts.groups)]
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
        wait_for_routable_s=2.0,
        request_timeout_s=20.0,
    )
    print(
        f"rollsafe demo: {opts.steps} steps, groups {sizes} (ranks), transport {opts.transport},"
        f" crash at step {opts.crash_at or 'never'},"
        f" {'immediate' if immediate else 'deferred (baseline)'} recovery"
    )
    fleet = RolloutFleet(config)
    steps: list[dict[str, Any]] = []
    crash: dict[str, Any] | None = None
    load: RolloutLoad | None = None
    failures: list[str] = []
    try:
        t = time.monotonic()
        fleet.start()
        timings["fleet start (engines up)"] += time.monotonic() - t
        say(f"fleet up in {fleet.start_seconds:.1f}s: {_states(fleet)}")
        want = trainer.checksum()
        initial = fleet.checksums()
        if any(v != want for v in initial.values()):
            failures.append(f"step 0: engines do not start on the trainer's weights: {initial}")
        load = RolloutLoad(fleet, opts.workers)
        crash_gid = fleet.group_ids[CRASH_GROUP_INDEX]
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
                    say(f"  !! step {step}: SIGKILL rank 1 (pid {pid}) of {crash_gid}")
                if now >= next_print:
                    with load.lock:
                        n_ok, n_bad = sum(load.served.values()), load.failed
                    say(
                        f"  step {step} rollout {now - t:4.1f}s | {_states(fleet)} |"
                        f" served {n_ok} failed {n_bad} | export {_exports(fleet)}"
                    )
                    next_print = now + 1.0
                time.sleep(0.05)
            load.active.clear()
            served, failed = load.take()
            rollout_s = time.monotonic() - t
            timings["rollout"] += rollout_s
            record.update(served_by_group=served, served=sum(served.values()), failed=failed,
                          rollout_s=rollout_s)  # fmt: skip
            # -------- train
            t = time.monotonic()
            record["loss"] = trainer.step()
            timings["train"] += time.monotonic() - t
            # -------- sync
            t = time.monotonic()
            try:
                report = fleet.sync_weights(trainer.weights(), step)
                record["sync"] = report.as_dict()
                if not report.ok:
                    failures.append(f"step {step}: sync failed: {report.error}")
            except Exception as exc:  # a failed step is an invariant break, keep reporting
                failures.append(f"step {step}: sync raised {type(exc).__name__}: {exc}")
                record["sync"] = {"ok": False, "error": str(exc)}
            timings["sync"] += time.monotonic() - t
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
            timings["verify checksums"] += time.monotonic() - t
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
        timeline = fleet.timeline()
        snapshot = fleet.snapshot()
        recoveries = [r.as_dict() for r in fleet.recoveries()]
    finally:
        if load is not None:
            load.close()
        t = time.monotonic()
        fleet.close()
        timings["close"] += time.monotonic() - t
        shutil.rmtree(work, ignore_errors=True)

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

    ok = not failures
    checksums_ok = not any("MISMATCH" in f or "checksum" in f for f in failures)
    summary = {
        "ok": ok,
        "failures": failures,
        "options": {k: v for k, v in vars(opts).items() if not k.startswith("_") and k != "func"},
        "immediate_recovery": immediate,
        "groups": dict(zip([f"g{i}" for i in range(len(sizes))], sizes, strict=True)),
        "recovery": recovery,
        "throughput": throughput,
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
    with (out / "timeline.jsonl").open("w") as f:
        for row in timeline:
            f.write(json.dumps({**row, "t": row["timestamp"] - t_begin}, default=str) + "\n")
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
    matched = checksums_ok
    print(f"checksums: every active engine == trainer after every step: {matched}")
    print(f"dispatch to non-active groups: {bad_dispatch or 'none'}")
    print("where time went:")
    for k, v in timings.items():
        print(f"  {k:<36} {v:7.2f}s")
    print(f"  {'total':<36} {summary['wall_s']:7.2f}s")
    print(f"report: {out}/timeline.jsonl, {out}/paths.md, {out}/summary.json")
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
