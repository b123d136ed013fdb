"""The demo on a local multi-node Ray cluster (``rollsafe demo --nodes N``): the node loss.

Owns what ``--nodes`` adds to the demo's phases (``docs/cluster.md``, "Running on a real Ray
cluster"):

* :func:`start_cluster` -- a real multi-node Ray cluster on this machine
  (:func:`~rollsafe.adapters.ray.local.local_cluster`): a head node (1 CPU: the trainer actor,
  which the driver's node takes, and no engine resource) and ``N - 1`` worker nodes, each its own
  raylet offering the custom resource :data:`ENGINE_RESOURCE` for every rank of the fleet (so
  one surviving worker can take every group); the fleet joins it through ``RAY_ADDRESS`` with
  :func:`ray_settings` (one ``ENGINE_RESOURCE`` per rank: engines never land on the head);
* :func:`remove_node` -- at ``--crash-at``'s rollout, the worker node holding the second group
  is removed (``allow_graceful=False``: its raylet and every process on it die); when it holds
  every group (``--nodes 2``) the load pauses first until the requests in flight are done, and
  resumes once every group is out of routing (a request sent to a dead engine would be cut,
  with no other group to continue on): then new requests wait for a group to come back
  (``FleetConfig.wait_for_routable_s``) instead of failing;
* :func:`tend` -- while the rollout goes on: when the lost groups wait ``unplaced`` because no
  node has room (``--nodes 2``: no worker is left), a worker node is added back, and the
  fleet's ``NodeWatcher`` offers it the waiting groups; says when every lost group is back;
* :func:`figures` -- per lost group where it went and the phases of its return (detection,
  placement, restart, weights; as ``benchmarks/bench_node_loss.py`` splits them), the requests,
  and the checks (each ``ok`` or ``FAILED``; a failed one is an invariant break: exit 1);
* :func:`print_report` -- that section of the printed report; :func:`write_node_loss_svg` --
  ``<out>/node_loss.svg``: the fleet's timeline picture from :data:`PICTURE_BEFORE_S` before the
  removal (``timeline.svg`` starts when the fleet started: most of it is the engines' start).

The engines are rollsafe's reference engines (not real vLLM), synced over ``nccl`` (gloo on
CPU). Leaving :attr:`~rollsafe.demo.state.DemoRun.stack` (settle) shuts the cluster down.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollsafe.demo.options import CRASH_GROUP_INDEX
from rollsafe.demo.state import DemoRun

if TYPE_CHECKING:
    from rollsafe.fleet import RaySettings

__all__ = [
    "BACK_TIMEOUT_S",
    "ENGINE_RESOURCE",
    "figures",
    "name_of",
    "placement",
    "print_report",
    "ray_settings",
    "remove_node",
    "start_cluster",
    "tend",
    "write_node_loss_svg",
]

#: the custom resource the worker nodes offer and each engine rank reserves (the head has none)
ENGINE_RESOURCE = "rollout"
#: how long the node loss's step keeps its rollout going for the lost groups to come back
BACK_TIMEOUT_S = 150.0
#: how long a group waits for room before it is ``unplaced`` (then a joining node takes it)
PLACEMENT_TIMEOUT_S = 10.0
#: how much of the run before the removal ``node_loss.svg`` shows (s)
PICTURE_BEFORE_S = 6.0
#: the recovery steps that make up the "restart" phase (the engine started on the new node)
RESTART_STEPS = ("launcher", "shutdown", "restart", "health")


def ray_settings() -> RaySettings:
    """The fleet's placement on the demo's cluster: one :data:`ENGINE_RESOURCE` per rank."""
    from rollsafe.fleet import RaySettings

    return RaySettings(
        resources_per_rank={ENGINE_RESOURCE: 1.0}, placement_timeout_s=PLACEMENT_TIMEOUT_S
    )


def start_cluster(run: DemoRun) -> None:
    """The head and ``N - 1`` worker nodes, up; ``RAY_ADDRESS`` set for the trainer and the
    fleet to join; the cluster's context is left on ``run.stack`` (settle closes it)."""
    from rollsafe.adapters.ray.local import local_cluster

    nodes = run.nodes
    assert nodes is not None and nodes >= 2
    room = sum(run.sizes)  # one worker can hold every group: the survivor takes the lost ones
    with run.timed("cluster start (head + workers)"):
        run.cluster = run.stack.enter_context(
            local_cluster([{ENGINE_RESOURCE: room}] * (nodes - 1), head_resources={"head": 1})
        )
    run.node_names[run.cluster.head_node.node_id] = "head"
    for node in sorted(run.cluster.worker_nodes, key=lambda n: n.node_id):
        _name_worker(run, node.node_id)
    run.ray_tmpdir = os.environ.get("RAY_TMPDIR")  # local_cluster's private directory
    run.say(
        f"Ray cluster up: {nodes} nodes on this machine, each its own raylet"
        f" ({run.cluster.address}, files {run.ray_tmpdir}): head (trainer, no"
        f" `{ENGINE_RESOURCE}`), "
        + ", ".join(f"{n} ({ENGINE_RESOURCE}: {room})" for n in _workers(run))
    )


def _name_worker(run: DemoRun, node_id: str) -> str:
    name = f"worker{sum(1 for n in run.node_names.values() if n != 'head') + 1}"
    run.node_names[node_id] = name
    return name


def _workers(run: DemoRun) -> list[str]:
    return [n for n in run.node_names.values() if n != "head"]


def name_of(run: DemoRun, node_id: str | None) -> str:
    """``head``, ``worker1``...; ``-`` when not placed."""
    if node_id is None:
        return "-"
    return run.node_names.get(node_id, node_id[:8])


def _node_id(fleet: Any, gid: str) -> str | None:
    return getattr(fleet.engine(gid), "node_id", None)


def placement(run: DemoRun) -> dict[str, str]:
    """Each group's node by name (no Ray call: the handle's last placement)."""
    return {gid: name_of(run, _node_id(run.fleet, gid)) for gid in run.fleet.group_ids}


def _raylet_pid(node: Any) -> int | None:
    procs = getattr(node, "all_processes", {}).get("raylet") or []
    return int(procs[0].process.pid) if procs else None


def remove_node(run: DemoRun, step: int) -> None:
    """Remove the worker node that holds the second group (its raylet and every process on
    it die), mark the onset for the timeline, and keep what the checks need."""
    fleet, cluster = run.fleet, run.cluster
    gid = fleet.group_ids[CRASH_GROUP_INDEX]
    node_id = _node_id(fleet, gid)
    node = next((n for n in cluster.worker_nodes if n.node_id == node_id), None)
    if node is None:  # the group is not on a worker of this cluster: nothing to remove
        run.failures.append(f"node loss: {gid} is not placed on a worker node ({node_id})")
        return
    name = name_of(run, node_id)
    lost = [g for g in fleet.group_ids if _node_id(fleet, g) == node_id]
    pids = [p for g in lost for p in getattr(fleet.engine(g), "rank_pids", [])]
    raylet = _raylet_pid(node)
    budget = {g: fleet.registry.get(g).machine.restart_budget for g in lost}
    survivors = [g for g in fleet.group_ids if g not in lost]
    if not survivors:  # a request cut now would have no other group to continue on
        _quiesce(run)
    at = time.time()
    cluster.remove_node(node, allow_graceful=False)
    for g in lost:
        fleet.observer.mark_crash(g, at=at, node=name, what="node removed")
    what = f"worker node {name} (its raylet and every process on it)"
    run.crash = {"group": gid, "step": step, "rank": None, "what": what, "pid": raylet, "at": at}
    run.node_loss = {
        "node": name,
        "node_id": node_id,
        "at": at,
        "step": step,
        "groups": lost,
        "survivors": survivors,
        "engine_pids": pids,
        "raylet_pid": raylet,
        "budget": budget,
        "version": fleet.registry.fleet_version,
        "added_node": None,
        "served_during": {},
        "paused": not survivors,  # the load resumes once every group left routing (tend)
    }
    run.say(
        f"  !! step {step}: removed {what}; raylet pid {raylet}, engine pids {pids};"
        f" groups on it: {', '.join(lost)}"
    )


def _quiesce(run: DemoRun, timeout_s: float = 30.0) -> None:
    """Pause the load and let the requests in flight finish (``--nodes 2``: every group is on
    the node about to go, so a cut request could not continue elsewhere)."""
    run.load.active.clear()
    deadline = time.monotonic() + timeout_s
    while any(g.outstanding for g in run.fleet.registry.groups()):
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    run.say("  .. every group is on the node to be removed: in-flight requests finished first")


def _unplaced_waits(run: DemoRun, lost: list[str], since: float) -> bool:
    """Every lost group gave up waiting for room (a recovery that ended ``unplaced``)."""
    done = [r for r in run.fleet.recoveries() if r.submitted_at >= since - 1.0]
    return all(
        any(r.group_id == g and r.status == "unplaced" for r in done)
        and run.fleet.registry.get(g).state == "unplaced"
        for g in lost
    )


def tend(run: DemoRun) -> bool:
    """One tick after the removal: add a worker node when the lost groups wait ``unplaced``
    (no node had room); True when every lost group left ``active`` and is ``active`` again."""
    loss = run.node_loss
    if loss is None:
        return True
    fleet = run.fleet
    lost: list[str] = loss["groups"]
    if loss["paused"] and not any(fleet.registry.get(g).is_routable for g in lost):
        loss["paused"] = False  # no group can be picked: new requests wait for one to return
        run.load.active.set()
        run.say("  .. every group is out of routing: the load resumes, requests wait for a group")
    if loss["added_node"] is None and _unplaced_waits(run, lost, loss["at"]):
        run.say(f"  .. {', '.join(lost)} wait unplaced (no node has room): adding a worker node")
        t = time.monotonic()
        node = run.cluster.add_node(num_cpus=1, resources={ENGINE_RESOURCE: sum(run.sizes)})
        name = _name_worker(run, node.node_id)
        loss["added_node"] = {"node": name, "node_id": node.node_id, "at": time.time()}
        run.say(f"  ++ {name} joined in {time.monotonic() - t:.1f}s")
    return all(
        _first_transition(run, g, loss["at"], {"active"}) is not None
        and fleet.registry.get(g).state == "active"
        for g in lost
    )


def _first_transition(run: DemoRun, gid: str, since: float, targets: set[str] | None) -> Any:
    for t in run.fleet.registry.get(gid).recent_transitions():
        if t.timestamp >= since and (targets is None or t.target in targets):
            return t
    return None


def _returned(run: DemoRun, gid: str, since: float) -> Any:
    """The recovery that brought ``gid`` back after ``since`` (the first ``active`` one)."""
    done = [
        r
        for r in run.fleet.recoveries()
        if r.group_id == gid and r.submitted_at >= since - 1.0 and r.status == "active"
    ]
    return done[0] if done else None


def figures(run: DemoRun) -> None:
    """Per lost group: its path and the phases of its return; the requests; the checks (a
    failed check is also appended to ``run.failures``). Runs while the fleet is up, after
    ``check_final`` (the final checksums and dispatch counts are read from ``run``)."""
    from rollsafe.processes import pid_alive

    loss = run.node_loss
    fleet = run.fleet
    served = sum(s["served"] for s in run.steps)
    failed = sum(s["failed"] for s in run.steps)
    cont = fleet.router.stats()["continuation"]
    out: dict[str, Any] = {
        "nodes": run.nodes,
        "ray_tmpdir": run.ray_tmpdir,
        "cluster": {name: node_id for node_id, name in run.node_names.items()},
        "placement": placement(run),
        "requests": {
            "served": served,
            "failed": failed,
            "continued": cont["after_failure"] + cont["after_abort"],
            "tokens_kept": cont["tokens_kept"],
        },
        "groups": {},
        "checks": [],
    }
    run.node_figures = out
    checks: list[tuple[str, bool, str]] = []
    if loss is None:
        checks.append(("a worker node was removed", False, "no node was removed"))
    else:
        at = loss["at"]
        version = fleet.registry.fleet_version
        for gid in loss["groups"]:
            left = _first_transition(run, gid, at, None)
            back = _first_transition(run, gid, at, {"active"})
            unplaced = _first_transition(run, gid, at, {"unplaced"})
            result = _returned(run, gid, at)
            group = fleet.registry.get(gid)
            out["groups"][gid] = {
                "ranks": run.sizes[fleet.group_ids.index(gid)],
                "from": loss["node"],
                "to": name_of(run, _node_id(fleet, gid)),
                "left_routing_by": None if left is None else left.event,
                "detection": None if left is None else left.timestamp - at,
                "unplaced_at": None if unplaced is None else unplaced.timestamp - at,
                "placement": None if result is None else result.step_seconds("place"),
                "restart": (
                    None if result is None else sum(result.step_seconds(s) for s in RESTART_STEPS)
                ),
                "weights": None if result is None else result.step_seconds("push"),
                "total": None if back is None else back.timestamp - at,
                "strategy": None if result is None else result.strategy,
                "state": group.state,
                "versions": sorted(
                    {m.weights_version or 0 for m in group.machine.members.values()}
                ),
                "budget": [loss["budget"][gid], group.machine.restart_budget],
            }
        rows = out["groups"]
        gone = [p for p in [*loss["engine_pids"], loss["raylet_pid"]] if p and pid_alive(p)]
        checks.append(
            (
                f"{loss['node']} removed: its raylet and its engine processes are gone",
                not gone and loss["raylet_pid"] is not None,
                f"alive: {gone}" if gone else f"raylet {loss['raylet_pid']}",
            )
        )
        dead = _ray_reports_dead(loss["node_id"])
        checks.append((f"Ray reports {loss['node']} dead", dead, "" if dead else "still alive"))
        left = {g: r["left_routing_by"] for g, r in rows.items()}
        checks.append(
            (
                "every group on it left routing",
                all(left.values()),
                ", ".join(f"{g} by {e}" for g, e in left.items()),
            )
        )
        bad = {g: c for g, c in run.bad_dispatch.items() if g in rows}
        checks.append(
            (
                "no request dispatched to a group while it was not active",
                not bad,
                str(bad) if bad else "",
            )
        )
        moved = {g: r["to"] for g, r in rows.items()}
        checks.append(
            (
                "every lost group re-placed on a live node",
                all(n not in ("-", loss["node"]) for n in moved.values()),
                ", ".join(f"{g} on {n}" for g, n in moved.items()),
            )
        )
        at_version = {g: (r["state"], r["versions"]) for g, r in rows.items()}
        checks.append(
            (
                f"every lost group active at the current version (v{version})",
                all(s == "active" and v == [version] for s, v in at_version.values()),
                str(at_version),
            )
        )
        spent = {g: r["budget"] for g, r in rows.items() if r["budget"][0] != r["budget"][1]}
        checks.append(
            ("the node loss spent no restart budget", not spent, str(spent) if spent else "")
        )
        stopped = _survivors_stopped(run, loss)
        checks.append(
            (
                "the other groups kept serving (active throughout)",
                not stopped,
                stopped or ", ".join(loss["survivors"]) or "no other group",
            )
        )
    checks.append(
        (
            "checksums equal (every group == the trainer at the end)",
            bool(run.final_checks) and all(v == "match" for v in run.final_checks.values()),
            "" if all(v == "match" for v in run.final_checks.values()) else str(run.final_checks),
        )
    )
    stuck = sum(t.is_alive() for t in run.load.threads)  # a request still waiting at the end
    checks.append(
        (
            "0 failed requests (none left waiting)",
            failed == 0 and not stuck,
            f"{failed} failed of {served + failed}" + (f", {stuck} still waiting" if stuck else ""),
        )
    )
    out["checks"] = [{"check": c, "ok": ok, "detail": d} for c, ok, d in checks]
    for c, ok, d in checks:
        if not ok:
            run.failures.append(f"node loss check failed: {c}" + (f" ({d})" if d else ""))


def _ray_reports_dead(node_id: str, timeout_s: float = 30.0) -> bool:
    """Ray's node table says ``node_id`` is not alive (the GCS notices within seconds)."""
    import ray

    nodes: Any = ray.nodes
    deadline = time.monotonic() + timeout_s
    while True:
        alive = {n["NodeID"] for n in nodes() if n.get("Alive")}
        if node_id not in alive:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def _survivors_stopped(run: DemoRun, loss: dict[str, Any]) -> str:
    """The surviving groups that left ``active`` after the removal (``""``: none did)."""
    out = []
    for gid in loss["survivors"]:
        t = _first_transition(run, gid, loss["at"], None)
        if t is not None:
            out.append(f"{gid} {t.source} -> {t.target} ({t.event})")
    return "; ".join(out)


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}s"


def print_report(run: DemoRun) -> None:
    """The node loss's section of the printed report: the cluster, each lost group's return
    with its phases, the requests and the checks."""
    fig, loss = run.node_figures, run.node_loss
    if not fig:
        return
    n = run.nodes or 0
    print(
        f"\nnode loss (a {n}-node local Ray cluster: head + {n - 1} worker(s); rollsafe's"
        " reference engines, not real vLLM; nccl over gloo):"
    )
    print("  placement at the end: " + " ".join(f"{g}@{n}" for g, n in fig["placement"].items()))
    if loss is not None:
        print(
            f"  step {loss['step']}: {loss['node']} removed at"
            f" t={loss['at'] - run.t_begin:.2f}s (raylet pid {loss['raylet_pid']} and every"
            f" process on it); groups on it: {', '.join(loss['groups'])}"
        )
        if loss["added_node"]:
            print(
                f"  no node had room: {loss['added_node']['node']} added at"
                f" t={loss['added_node']['at'] - run.t_begin:.2f}s"
            )
        for gid, r in fig["groups"].items():
            print(
                f"  {gid} ({r['ranks']} rank{'s' if r['ranks'] > 1 else ''}): {r['from']} ->"
                f" {r['to']}; out of routing ({r['left_routing_by']}) after {_s(r['detection'])},"
                f" active again after {_s(r['total'])} (strategy {r['strategy']}); at the end"
                f" {r['state']} at v{max(r['versions'], default='?')}"
            )
            print(
                f"    phases: detection {_s(r['detection'])} | placement {_s(r['placement'])} |"
                f" restart {_s(r['restart'])} | weights {_s(r['weights'])}"
            )
    req = fig["requests"]
    print(
        f"  requests: served {req['served']}, failed {req['failed']}, continued"
        f" {req['continued']} (tokens kept {req['tokens_kept']})"
    )
    print("checks:")
    for c in fig["checks"]:
        detail = f" ({c['detail']})" if c["detail"] else ""
        print(f"  {'ok' if c['ok'] else 'FAILED':<6} {c['check']}{detail}")


def write_node_loss_svg(run: DemoRun, path: Path) -> Path:
    """The fleet's timeline (:mod:`rollsafe.observe.timeline_svg`: a lane per group coloured by
    its state, the crash marks of the removal, the recovery spans, syncs, exports, request
    rates) from :data:`PICTURE_BEFORE_S` before the node loss to the end of the run."""
    from rollsafe.observe.runfile import build_rows
    from rollsafe.observe.timeline_svg import write_svg

    loss = run.node_loss
    assert loss is not None
    rows = [dict(r) for r in build_rows(run.fleet, t0=run.t_begin)]
    for r in rows:
        if r["kind"] == "run":  # the picture starts at the header's started_at
            r["started_at"] = max(float(r.get("started_at") or 0.0), loss["at"] - PICTURE_BEFORE_S)
    title = (
        f"rollsafe demo --nodes {run.nodes}: {loss['node']} removed at step {loss['step']}"
        f" (groups on it: {', '.join(loss['groups'])})"
    )
    return write_svg(path, rows, title=title)
