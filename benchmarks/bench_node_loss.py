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

With ``--span`` (issue #37 item 4): the same measurement for a group that spans nodes beside a
one-node group of the same ranks, in one fleet and one run: ``GroupSpec(ranks=2,
ranks_per_node=1)`` (two slices of one rank, each on its own node) and ``GroupSpec(ranks=2)``
(both ranks on one node), three worker nodes with room for two ranks each (so no node ever
holds slices of both groups). ``--removals`` is then per group, alternating between them; the
two-node group loses its head's node and its other slice's node in turn. Each row also keeps
every recovery step's seconds (``steps``) and the nodes the group was placed on again. Extra
checks: every re-placement of the two-node group is whole (two distinct alive nodes, the
removed one not among them), and its ``total`` p50 and p95 are at most ``--max-ratio`` (1.5)
times the one-node group's. Writes ``benchmarks/results/node_loss_span_cpu.json``.

    .venv/bin/python benchmarks/bench_node_loss.py [--removals 10] [--kills 5]
    .venv/bin/python benchmarks/bench_node_loss.py --span [--removals 10] [--kills 4]
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
from rollsafe.fleet import (  # noqa: E402
    FleetConfig,
    GroupSpec,
    HealthSettings,
    RaySettings,
    RolloutFleet,
)

OUT = REPO / "benchmarks" / "results" / "node_loss_cpu.json"
OUT_SPAN = REPO / "benchmarks" / "results" / "node_loss_span_cpu.json"
PROMPT = [3, 14, 15, 92, 65]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0}
WAIT_S = 240.0
RESTART_STEPS = ("launcher", "shutdown", "restart", "health")
PHASES = ("out", "detection", "placement", "restart", "weights", "total")
#: issue #37's target: a two-node group's node loss at most this many times a one-node group's
MAX_RATIO = 1.5
#: ``--span``: the shape of each group (in ``group_ids`` order) and its summary's key
SPAN_SHAPES = (("two_node", "two_node_group"), ("one_node", "one_node_group"))
#: what the figures were measured with (the JSON's ``warm``)
WARM = (
    "the tiny model's files in the page cache and the fleet's export written before the first "
    "event; nothing warm on the group's nodes: each removal's group is placed again in fresh "
    "actors (a two-node group's surviving slice's actor too: the placement is given back "
    "whole) on dummy weights with no warm standby, then the current version is pushed"
)


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
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--span",
        action="store_true",
        help="a two-node group beside a one-node group of the same ranks (issue #37 item 4)",
    )
    p.add_argument(
        "--removals", type=int, default=10, help="node removals (default 10; --span: per group)"
    )
    p.add_argument("--kills", type=int, default=5, help="single-rank SIGKILLs (default 5)")
    p.add_argument(
        "--max-ratio",
        type=float,
        default=MAX_RATIO,
        help="--span: the two-node group's total p50 and p95 at most this times the one-node "
        "group's (default 1.5)",
    )
    p.add_argument("--out", type=Path, default=None, help="the result JSON")
    args = p.parse_args(argv)
    if args.removals < 1:
        p.error("--removals must be >= 1")
    if args.kills < 0:
        p.error("--kills must be >= 0")
    if not args.max_ratio > 0:
        p.error("--max-ratio must be > 0")
    if args.out is None:
        args.out = OUT_SPAN if args.span else OUT
    return args


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


def left_routing_at(fleet: RolloutFleet, gid: str, since: float) -> float | None:
    """The group's first transition away from ``active`` at or after ``since``."""
    for t in fleet.registry.get(gid).recent_transitions():
        if t.target != "active" and t.timestamp >= since:
            return float(t.timestamp)
    return None


def one_event(
    fleet: RolloutFleet, gid: str, at: float, detected_as: str, weights: dict[str, torch.Tensor]
) -> dict[str, Any]:
    result = wait_active(fleet, gid, at - 1.0)
    detected = transition_at(fleet, gid, detected_as, at)
    out = left_routing_at(fleet, gid, at)
    active = transition_at(fleet, gid, "active", at)
    # every group's checker against the weights in its own layout (SGLang: fused, per rank)
    checks = fleet.check_weights(weights)
    steps: dict[str, float] = {}
    for step in result.steps:
        steps[step.name] = round(steps.get(step.name, 0.0) + step.seconds, 4)
    row = {
        "group": gid,
        "out": None if out is None else out - at,
        "detection": None if detected is None else detected - at,
        "placement": result.step_seconds("place"),
        "restart": sum(result.step_seconds(s) for s in RESTART_STEPS),
        "weights": result.step_seconds("push"),
        "total": None if active is None else active - at,
        "steps": steps,
        # the head engine's own start-up phases (s from its process start), as its ready line
        "engine_startup_s": dict(
            getattr(fleet.engine(gid), "ready_info", {}).get("startup_s") or {}
        ),
        "strategy": result.strategy,
        "checksums_equal": all(c is not None and c.equal for c in checks.values()),
        "state": fleet.registry.get(gid).state,
        "load1": os.getloadavg()[0],
    }
    return row


# ------------------------------------------------------------------ the figures and the checks
def phase_table(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """p50 / p95 / max of each phase, and of each recovery step (``steps``)."""
    table: dict[str, Any] = {p: dist([r[p] for r in rows if r.get(p) is not None]) for p in PHASES}
    names = sorted({name for r in rows for name in r.get("steps", {})})
    table["steps"] = {
        n: dist([r["steps"][n] for r in rows if n in r.get("steps", {})]) for n in names
    }
    return table


def summarize(
    removals: Sequence[dict[str, Any]], kills: Sequence[dict[str, Any]], *, span: bool
) -> dict[str, Any]:
    """``node_removal`` (every removal) and ``single_process_crash``; with ``span`` also one
    table per group shape (``two_node_group``, ``one_node_group``)."""
    summary = {"node_removal": phase_table(removals), "single_process_crash": phase_table(kills)}
    if span:
        for shape, key in SPAN_SHAPES:
            summary[key] = phase_table([r for r in removals if r.get("shape") == shape])
    return summary


def span_ratio(summary: dict[str, Any]) -> dict[str, float | None]:
    """The two-node group's ``total`` over the one-node group's, at p50 and p95."""
    two = summary["two_node_group"]["total"]
    one = summary["one_node_group"]["total"]
    out: dict[str, float | None] = {}
    for q in ("p50", "p95"):
        out[q] = round(two[q] / one[q], 3) if two[q] is not None and one[q] else None
    return out


def checks(
    removals: Sequence[dict[str, Any]],
    kills: Sequence[dict[str, Any]],
    *,
    span: bool,
    want_removals: int,
    want_kills: int,
    max_ratio: float = MAX_RATIO,
    dispatch: dict[str, dict[str, int]] | None = None,
    rollout_failures: Sequence[str] = (),
) -> list[str]:
    """Every check that failed, named (empty: all held). ``want_removals`` per group shape
    with ``span``, in all without."""
    failures: list[str] = []
    for gid, counts in (dispatch or {}).items():
        if set(counts) - {"active"}:
            failures.append(f"{gid}: requests dispatched in {sorted(counts)}")
    failures += [f"rollout request failed: {f}" for f in list(rollout_failures)[:5]]
    for kind, rows in (("removal", removals), ("kill", kills)):
        for n, row in enumerate(rows, 1):
            if row["state"] != "active" or not row["checksums_equal"]:
                failures.append(f"{kind} {n}: {row['group']} {row['state']}, checksums {row}")
            if row.get("placed_whole") is False:
                failures.append(
                    f"{kind} {n}: {row['group']} placed again on {row.get('nodes_after')}, not "
                    f"on {row.get('slices')} distinct alive nodes without the removed one"
                )
    if len(kills) < want_kills:
        failures.append(f"{len(kills)} SIGKILL(s) measured, {want_kills} wanted")
    if not span:
        if len(removals) < want_removals:
            failures.append(f"{len(removals)} removal(s) measured, {want_removals} wanted")
        return failures
    for shape, _key in SPAN_SHAPES:
        got = sum(1 for r in removals if r.get("shape") == shape)
        if got < want_removals:
            failures.append(f"{shape}: {got} removal(s) measured, {want_removals} wanted")
    ratio = span_ratio(summarize(removals, kills, span=True))
    for q, value in ratio.items():
        if value is None:
            failures.append(f"node loss ratio at {q}: not measured")
        elif value > max_ratio:
            failures.append(
                f"node loss of the two-node group {value}x the one-node group's at {q} "
                f"(> {max_ratio}x)"
            )
    return failures


# ------------------------------------------------------------------ the run
#: how long a request waits for a routable group (the demo's ``--nodes`` bound: a node loss
#: may take every group out until they are placed again)
WAIT_FOR_ROUTABLE_S = 150.0


def fleet_config(span: bool, model_dir: Path, scratch: Path) -> FleetConfig:
    groups = (
        [GroupSpec(ranks=2, ranks_per_node=1), GroupSpec(ranks=2)]
        if span
        else [
            GroupSpec(1),
            GroupSpec(1),
        ]
    )
    return FleetConfig(
        model_path=model_dir,
        export_root=scratch / "exports",
        groups=groups,
        transport="nccl",
        placement="ray",
        ray=RaySettings(resources_per_rank={"rollout": 1.0}, placement_timeout_s=60.0),
        health=HealthSettings(interval_s=0.2, timeout_s=1.0, failure_threshold=2),
        start_timeout_s=240.0,
        # a node loss takes one of the two groups out; a request (or a cut one's continuation)
        # that finds the other out too (its probes timed out on a loaded machine) waits for a
        # routable group, as the demo's --nodes runs do, instead of failing at once
        wait_for_routable_s=WAIT_FOR_ROUTABLE_S,
    )


def run(
    args: argparse.Namespace, model_dir: Path, scratch: Path
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any], list[str]]:
    """The removals, the kills, what the fleet counted (``served``, ``dispatch``,
    ``rollout_failures``), and an error that ended the run early (empty: none)."""
    removals: list[dict[str, Any]] = []
    kills: list[dict[str, Any]] = []
    errors: list[str] = []
    room = 2 if args.span else 1  # --span: a node holds one slice of g0, or all of g1
    shapes = [s for s, _ in SPAN_SHAPES] if args.span else ["one_node", "one_node"]
    events = 2 * args.removals if args.span else args.removals
    workers = [{"rollout": room}] * (3 if args.span else 2)
    counted: dict[str, Any] = {}
    with local_cluster(workers, head_resources={"head": 1}) as c:
        say(f"starting the fleet on the cluster ({len(workers)} worker nodes) ...")
        with RolloutFleet(fleet_config(args.span, model_dir, scratch)) as fleet:
            say(f"fleet up: {[(g, len(fleet.engine(g).node_ids)) for g in fleet.group_ids]}")
            load = Rollouts(fleet)
            version = 0
            lost = [0, 0]  # removals per group so far
            try:
                for i in range(events):
                    version += 1
                    weights = weights_at(model_dir, version)
                    assert fleet.sync_weights(weights, version).ok
                    c.add_node(num_cpus=1, resources={"rollout": room})
                    c.wait_for_nodes(timeout=120)
                    g = i % 2
                    gid = fleet.group_ids[g]
                    handle = fleet.engine(gid)
                    slices = len(handle.node_ids)
                    which = lost[g] % slices  # a two-node group: its head's node, then the other
                    lost[g] += 1
                    doomed = handle.node_ids[which]
                    node = next(n for n in c.worker_nodes if n.node_id == doomed)
                    at = time.time()
                    c.remove_node(node, allow_graceful=False)
                    row = one_event(fleet, gid, at, "unplaced", weights)
                    alive = {n.node_id for n in c.worker_nodes}
                    after = list(fleet.engine(gid).node_ids)
                    row.update(
                        shape=shapes[g],
                        slices=slices,
                        slice=which,
                        removed=doomed[:12],
                        nodes_after=[n[:12] for n in after],
                        placed_whole=len(set(after)) == slices
                        and set(after) <= alive
                        and doomed not in after,
                    )
                    removals.append(row)
                    say(
                        f"removal {i + 1}/{events}: {gid} ({shapes[g]}, slice {which}) active "
                        f"again after {row['total']:.2f}s (out {row['out']:.2f}s, detection "
                        f"{row['detection']:.2f}s, placement {row['placement']:.2f}s, restart "
                        f"{row['restart']:.2f}s, weights {row['weights']:.2f}s; load "
                        f"{row['load1']:.1f})"
                    )
                for k in range(args.kills):
                    g = k % 2
                    gid = fleet.group_ids[g]
                    ranks = fleet.engine(gid).spec.ranks
                    rank = (k // 2) % ranks  # a two-node group: its head's rank, then the other's
                    weights = weights_at(model_dir, version)
                    at = time.time()
                    fleet.engine(gid).kill_rank(rank)
                    row = one_event(fleet, gid, at, "inactive", weights)
                    row.update(shape=shapes[g], rank=rank)
                    kills.append(row)
                    say(
                        f"SIGKILL {k + 1}/{args.kills}: {gid} rank {rank} active after "
                        f"{row['total']:.2f}s"
                    )
            except Exception as exc:  # recorded (a failed check) with what was measured so far
                errors.append(f"the run stopped early: {type(exc).__name__}: {exc}"[:2000])
                say(errors[-1])
            finally:
                load.close()
            counted = {
                "served": load.served,
                "dispatch": fleet.registry.dispatch_counts(),
                "rollout_failures": list(load.failures),
            }
    return removals, kills, counted, errors


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="rs-nodeloss-"))
    load_start = os.getloadavg()[0]
    t_run = time.monotonic()
    try:
        model_dir = make_tiny_model(scratch / "tiny", seed=0)
        removals, kills, counted, errors = run(args, model_dir, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    failures = errors + checks(
        removals,
        kills,
        span=args.span,
        want_removals=args.removals,
        want_kills=args.kills,
        max_ratio=args.max_ratio,
        dispatch=counted.get("dispatch"),
        rollout_failures=counted.get("rollout_failures", ()),
    )
    summary = summarize(removals, kills, span=args.span)
    out: dict[str, Any] = {
        "benchmark": "node_loss_span_cpu" if args.span else "node_loss_cpu",
        "command": "python benchmarks/bench_node_loss.py " + " ".join(argv or sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "load1": {"start": load_start, "end": os.getloadavg()[0]},
        "seconds": round(time.monotonic() - t_run, 1),
        "rollout_requests": counted.get("served", 0),
        "summary": summary,
    }
    if args.span:
        out["groups"] = {
            "g0": "GroupSpec(ranks=2, ranks_per_node=1): two slices of one rank, two nodes",
            "g1": "GroupSpec(ranks=2): both ranks on one node",
        }
        out["ratio"] = {**span_ratio(summary), "max": args.max_ratio}
        out["warm"] = WARM
    out.update(removals=removals, kills=kills, checks={"ok": not failures, "failures": failures})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    for kind, table in summary.items():
        cells = ", ".join(
            f"{p} p50 {d['p50']} / p95 {d['p95']} s" for p, d in table.items() if p != "steps"
        )
        say(f"{kind}: {cells}")
    if args.span:
        say(f"two-node / one-node total: {out['ratio']}")
    if failures:
        say("CHECKS FAILED: " + "; ".join(failures))
        return 1
    say(f"checks: all held ({counted['served']} rollout requests, none failed); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
