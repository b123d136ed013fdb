"""Benchmark node loss on a real multi-node Ray cluster on this machine (issue #25 item 8).

A head node (no engine resource) and two worker nodes (``ray.cluster_utils.Cluster`` through
:func:`rollsafe.adapters.ray.local.local_cluster`: each its own raylet) run a
``FleetConfig(placement="ray")`` fleet of two 1-rank reference-engine groups (the tiny Llama of
``make_tiny_model``), ``nccl`` over gloo, one group per worker, while a rollout thread generates
without pause. Each round: a fresh worker joins (room for the lost group), the fleet syncs a new
version, then the node holding one group (alternating) is removed (``allow_graceful=False``: its
raylet and every process on it die). The fleet's ``NodeWatcher`` reports the dead node, the
group leaves routing (``unplaced``), recovery places it on the new worker, restarts it on dummy
weights and pushes the current version. Measured per removal:

* ``detection``: removal -> the group's ``unplaced`` transition (the GCS's health check at 1 s
  plus the watcher's round);
* ``placement``: the recovery's ``place`` step (the old placement given back, a new one
  reserved, the actor created);
* ``restart``: its ``launcher``, ``shutdown``, ``restart`` and ``health`` steps (the engine
  started in the new actor);
* ``weights``: its ``push`` step (the targeted push of the current version);
* ``total``: removal -> ``active`` again.

Beside it, in the same run, single-process crashes: SIGKILL of one engine rank (the actor and
node live), detected by the probes (``inactive``), restarted in place. Reports p50 / p95 / max
of each. Exits 1 when a check fails: a group not ``active`` at the fleet's version after a
removal or crash, a checksum different from the trainer's, a failed rollout request, or a
request dispatched to a group that was not ``active``. Writes
``benchmarks/results/node_loss_cpu.json`` (``--out``).

    .venv/bin/python benchmarks/bench_node_loss.py [--removals 10] [--kills 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from rollsafe.adapters.ray.local import local_cluster  # noqa: E402
from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model  # noqa: E402
from rollsafe.checksum import weights_checksum  # noqa: E402
from rollsafe.fleet import (  # noqa: E402
    FleetConfig,
    GroupSpec,
    HealthSettings,
    RaySettings,
    RolloutFleet,
)

OUT = REPO / "benchmarks" / "results" / "node_loss_cpu.json"
PROMPT = [3, 14, 15, 92, 65]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0}
WAIT_S = 240.0
RESTART_STEPS = ("launcher", "shutdown", "restart", "health")


def pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def dist(values: Sequence[float]) -> dict[str, Any]:
    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 3)

    return {
        "n": len(values),
        "p50": r(pct(values, 0.5)),
        "p95": r(pct(values, 0.95)),
        "max": r(max(values) if values else None),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--removals", type=int, default=10, help="node removals (default 10)")
    p.add_argument("--kills", type=int, default=5, help="single-rank SIGKILLs (default 5)")
    p.add_argument("--out", type=Path, default=OUT)
    return p.parse_args(argv)


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Rollouts:
    """Generates without pause on its own thread; counts requests and failures."""

    def __init__(self, fleet: RolloutFleet) -> None:
        self.fleet = fleet
        self.served = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-rollouts", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.fleet.generate(PROMPT, sampling_params=GREEDY)
                self.served += 1
            except Exception as exc:  # recorded: a check of the benchmark
                self.failures.append(f"{type(exc).__name__}: {exc}"[:300])
                self._stop.wait(0.2)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(60)


def weights_at(model_dir: Path, version: int) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.001 * version)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def wait_active(fleet: RolloutFleet, gid: str, since: float) -> Any:
    """The first recovery of ``gid`` submitted after ``since`` once its group is ``active``."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        done = [r for r in fleet.recoveries() if r.group_id == gid and r.submitted_at >= since]
        if any(r.status == "active" for r in done) and fleet.registry.get(gid).state == "active":
            return next(r for r in done if r.status == "active")
        time.sleep(0.1)
    raise TimeoutError(
        f"{gid} not active {WAIT_S}s after {since}: {fleet.snapshot()['recoveries']}"
    )


def transition_at(fleet: RolloutFleet, gid: str, target: str, since: float) -> float | None:
    for t in fleet.registry.get(gid).recent_transitions():
        if t.target == target and t.timestamp >= since:
            return float(t.timestamp)
    return None


def one_event(
    fleet: RolloutFleet, gid: str, at: float, detected_as: str, want: str
) -> dict[str, Any]:
    result = wait_active(fleet, gid, at - 1.0)
    detected = transition_at(fleet, gid, detected_as, at)
    active = transition_at(fleet, gid, "active", at)
    sums = fleet.checksums()
    row = {
        "group": gid,
        "detection": None if detected is None else detected - at,
        "placement": result.step_seconds("place"),
        "restart": sum(result.step_seconds(s) for s in RESTART_STEPS),
        "weights": result.step_seconds("push"),
        "total": None if active is None else active - at,
        "strategy": result.strategy,
        "checksums_equal": all(v == want for v in sums.values()),
        "state": fleet.registry.get(gid).state,
        "load1": os.getloadavg()[0],
    }
    return row


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="rs-nodeloss-"))
    removals: list[dict[str, Any]] = []
    kills: list[dict[str, Any]] = []
    failures: list[str] = []
    load_start = os.getloadavg()[0]
    t_run = time.monotonic()
    try:
        model_dir = make_tiny_model(scratch / "tiny", seed=0)
        with local_cluster([{"rollout": 1}, {"rollout": 1}], head_resources={"head": 1}) as c:
            cfg = FleetConfig(
                model_path=model_dir,
                export_root=scratch / "exports",
                groups=[GroupSpec(1), GroupSpec(1)],
                transport="nccl",
                placement="ray",
                ray=RaySettings(resources_per_rank={"rollout": 1.0}, placement_timeout_s=60.0),
                health=HealthSettings(interval_s=0.2, timeout_s=1.0, failure_threshold=2),
                start_timeout_s=240.0,
            )
            say("starting the fleet on the cluster ...")
            with RolloutFleet(cfg) as fleet:
                load = Rollouts(fleet)
                version = 0
                try:
                    for i in range(args.removals):
                        version += 1
                        weights = weights_at(model_dir, version)
                        assert fleet.sync_weights(weights, version).ok
                        want = weights_checksum(weights)["model"]
                        c.add_node(num_cpus=1, resources={"rollout": 1})
                        c.wait_for_nodes(timeout=120)
                        gid = fleet.group_ids[i % 2]
                        handle = fleet.engine(gid)
                        node = next(n for n in c.worker_nodes if n.node_id == handle.node_id)
                        at = time.time()
                        c.remove_node(node, allow_graceful=False)
                        row = one_event(fleet, gid, at, "unplaced", want)
                        removals.append(row)
                        say(
                            f"removal {i + 1}/{args.removals}: {gid} active again after "
                            f"{row['total']:.2f}s (detection {row['detection']:.2f}s, placement "
                            f"{row['placement']:.2f}s, restart {row['restart']:.2f}s, weights "
                            f"{row['weights']:.2f}s)"
                        )
                    for k in range(args.kills):
                        gid = fleet.group_ids[k % 2]
                        want = weights_checksum(weights_at(model_dir, version))["model"]
                        at = time.time()
                        fleet.engine(gid).kill_rank(0)
                        row = one_event(fleet, gid, at, "inactive", want)
                        kills.append(row)
                        say(f"SIGKILL {k + 1}/{args.kills}: {gid} active after {row['total']:.2f}s")
                finally:
                    load.close()
                for gid, counts in fleet.registry.dispatch_counts().items():
                    if set(counts) - {"active"}:
                        failures.append(f"{gid}: requests dispatched in {sorted(counts)}")
                failures += [f"rollout request failed: {f}" for f in load.failures[:5]]
                served = load.served
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for kind, rows in (("removal", removals), ("kill", kills)):
        for n, row in enumerate(rows, 1):
            if row["state"] != "active" or not row["checksums_equal"]:
                failures.append(f"{kind} {n}: {row['group']} {row['state']}, checksums {row}")
    phases = ("detection", "placement", "restart", "weights", "total")
    summary = {
        "node_removal": {p: dist([r[p] for r in removals if r[p] is not None]) for p in phases},
        "single_process_crash": {
            p: dist([r[p] for r in kills if r[p] is not None]) for p in phases
        },
    }
    out = {
        "benchmark": "node_loss_cpu",
        "command": "python benchmarks/bench_node_loss.py " + " ".join(argv or sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "load1": {"start": load_start, "end": os.getloadavg()[0]},
        "seconds": round(time.monotonic() - t_run, 1),
        "rollout_requests": served,
        "summary": summary,
        "removals": removals,
        "kills": kills,
        "checks": {"ok": not failures, "failures": failures},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    for kind, table in summary.items():
        cells = ", ".join(f"{p} p50 {d['p50']} / p95 {d['p95']} s" for p, d in table.items())
        say(f"{kind}: {cells}")
    if failures:
        say("CHECKS FAILED: " + "; ".join(failures))
        return 1
    say(f"checks: all held ({served} rollout requests, none failed); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
