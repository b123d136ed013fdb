"""``FleetConfig(placement="ray")`` on a real multi-node Ray cluster on this machine.

A head node and two worker nodes (``ray.cluster_utils.Cluster``: each its own raylet, 1 CPU and
a custom ``rollout`` resource); the fleet joins through ``RAY_ADDRESS``. Its groups are placed
one placement group each (ranks packed on one node, groups spread over the workers), serve
rollouts and take an ``nccl`` (gloo) sync with checksums equal; a SIGKILLed engine recovers
through the group's Ray handle on its node; a removed node's group leaves routing and is placed
again on a node with room. Needs Ray (skipped without it, failed under ``CI=true``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import pid_alive, sglang_digests, tiny_model_dir  # noqa: F401  (fixture)
from ray_cluster import local_cluster, require_ray, wait_for

from rollsafe.fleet import FleetConfig, GroupSpec, HealthSettings, RaySettings, RolloutFleet
from rollsafe.registry import FleetError

ray = require_ray()
pytestmark = pytest.mark.ray_cluster

from rollsafe.adapters.ray import RayEngineGroup  # noqa: E402

PROMPT = [3, 14, 15, 92, 65]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0}
#: each worker node offers room for this many engine ranks
ROOM = 4


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with local_cluster([{"rollout": ROOM}, {"rollout": ROOM}], head_resources={"head": 1}) as c:
        yield c


def ray_config(model: Path, tmp_path: Path, groups: list[GroupSpec]) -> FleetConfig:
    return FleetConfig(
        model_path=model,
        export_root=tmp_path / "exports",
        groups=groups,
        transport="nccl",
        placement="ray",
        ray=RaySettings(resources_per_rank={"rollout": 1.0}, placement_timeout_s=60.0),
        health=HealthSettings(interval_s=0.2, timeout_s=2.0, failure_threshold=2),
        start_timeout_s=240.0,
    )


def trained_weights(model_dir: Path, delta: float) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(delta)
    return {n: p.detach() for n, p in model.named_parameters()}


def handles(fleet: RolloutFleet) -> dict[str, RayEngineGroup]:
    out = {}
    for gid in fleet.group_ids:
        engine = fleet.engine(gid)
        assert isinstance(engine, RayEngineGroup), engine
        out[gid] = engine
    return out


def kill_and_recover(fleet: RolloutFleet, group: RayEngineGroup) -> Any:
    """SIGKILL the group's rank 0; wait for a new recovery and g0 ``active``; its result."""
    done = len(fleet.recoveries())
    group.kill_rank(0)
    assert wait_for(
        lambda: len(fleet.recoveries()) > done and fleet.registry.get("g0").state == "active",
        240,
    ), fleet.snapshot()["recoveries"]
    return fleet.recoveries()[-1]


def worker_ids(cluster: Any) -> set[str]:
    return {n.node_id for n in cluster.worker_nodes}


def test_groups_on_two_nodes_serve_sync_over_nccl_and_recover_a_sigkill(
    cluster: Any,
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    cfg = ray_config(tiny_model_dir, tmp_path, [GroupSpec(2), GroupSpec(1)])
    with RolloutFleet(cfg) as fleet:
        groups = handles(fleet)
        nodes = {gid: g.node_id for gid, g in groups.items()}
        # one node per group, both workers (the head offers no `rollout`), spread apart
        assert set(nodes.values()) == worker_ids(cluster), nodes
        placement = fleet.snapshot()["placement"]
        assert placement["kind"] == "ray" and placement["nodes"] == nodes
        node_ip = ray.util.get_node_ip_address()  # every node of this cluster is this machine
        assert placement["exports"] == "moved"  # not declared shared: moved to a node on recovery
        # the weight-update store is on the driver's node IP, as Ray reports it (nccl's
        # master_address was left unset): engines on other nodes reach it there
        driver = ray.get_runtime_context().get_node_id()
        driver_ip = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == driver)
        assert fleet.transport is not None
        assert fleet.transport.master_address == driver_ip == node_ip  # type: ignore[attr-defined]
        for gid, group in groups.items():
            assert ray.get(group.actor.node_id.remote()) == nodes[gid]  # the actor is there
            assert group.url.startswith(f"http://{node_ip}:")  # the engine is on its node's IP
            assert group.spec.api_key  # and, reachable from the network, has a key
            assert group.placement is not None
            assert len(group.placement.bundles) == cfg.groups[int(gid[1])].ranks
            assert len(group.rank_pids) == cfg.groups[int(gid[1])].ranks
        assert [g.state for g in fleet.registry.groups()] == ["active", "active"]
        with pytest.raises(FleetError, match="RayEngineGroup"):
            fleet.launcher("g0")  # not an EngineLauncher: fleet.engine() is the handle
        for group in groups.values():  # each engine answers on the URL its actor reported
            assert len(group.client.generate(PROMPT, sampling_params=GREEDY).output_ids) == 6
        served = {fleet.generate(PROMPT, sampling_params=GREEDY).group_id for _ in range(6)}
        assert served <= {"g0", "g1"} and served

        weights = trained_weights(tiny_model_dir, 0.01)
        report = fleet.sync_weights(weights, 1)
        assert report.ok and report.updated == ["g0", "g1"], report
        # each group's SGLang checker: its own parameters, g0's two ranks their shards
        want = {"g0": sglang_digests(weights, 2)["model"], "g1": sglang_digests(weights)["model"]}
        assert fleet.checksums() == want

        victim = groups["g1"]
        pid = victim.kill_rank(0)  # SIGKILL of the engine's rank on its node
        assert wait_for(lambda: not pid_alive(pid), 30)
        assert wait_for(
            lambda: (
                any(r.group_id == "g1" for r in fleet.recoveries())
                and fleet.registry.get("g1").state == "active"
            ),
            180,
        ), fleet.snapshot()["recoveries"]
        result = [r for r in fleet.recoveries() if r.group_id == "g1"][-1]
        assert result.status == "active", result
        assert victim.node_id == nodes["g1"] and victim.replacements == 0  # same node
        assert fleet.registry.get("g0").state == "active"
        assert fleet.checksums() == want
        out = victim.client.generate(PROMPT, sampling_params=GREEDY)
        assert out.weight_version == "1" and len(out.output_ids) == 6
        placer = fleet.placement.placer
        assert placer is not None
    assert placer.nodes() == {}  # close gave every placement back
    assert all(g.actor is None and g.placement is None for g in groups.values())


def test_a_removed_node_takes_its_group_out_and_it_is_placed_again(
    cluster: Any,
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    cfg = ray_config(tiny_model_dir, tmp_path, [GroupSpec(1), GroupSpec(1)])
    with RolloutFleet(cfg) as fleet:
        groups = handles(fleet)
        nodes = {gid: g.node_id for gid, g in groups.items()}
        assert set(nodes.values()) == worker_ids(cluster), nodes
        weights = trained_weights(tiny_model_dir, 0.02)
        assert fleet.sync_weights(weights, 1).ok
        want = sglang_digests(weights)["model"]

        driver = ray.get_runtime_context().get_node_id()  # never remove the driver's node
        lost = next(gid for gid in ("g1", "g0") if nodes[gid] != driver)
        kept = "g0" if lost == "g1" else "g1"
        doomed = next(n for n in cluster.worker_nodes if n.node_id == nodes[lost])
        cluster.remove_node(doomed, allow_graceful=False)  # its raylet and every process die
        assert wait_for(lambda: not fleet.registry.get(lost).is_routable, 60)
        # the other group never stops serving, and no request reaches the lost one
        for _ in range(4):
            assert fleet.generate(PROMPT, sampling_params=GREEDY).group_id == kept
        assert wait_for(lambda: fleet.registry.get(lost).state == "active", 240), fleet.snapshot()[
            "recoveries"
        ]
        assert groups[lost].node_id == nodes[kept]  # placed again on the surviving worker
        assert worker_ids(cluster) == {nodes[kept]}
        assert groups[lost].replacements == 1 and groups[kept].replacements == 0
        assert fleet.checksums() == {"g0": want, "g1": want}
        out = groups[lost].client.generate(PROMPT, sampling_params=GREEDY)
        assert out.weight_version == "1"


def test_a_lost_node_takes_all_its_groups_out_at_once_they_wait_for_room_and_a_new_node_takes_them(
    cluster: Any,
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Two of three groups share a node (capacities force it); the node dies; both leave
    routing in one step without spending budget; with no room they wait ``unplaced``; a node
    that joins takes both, at the fleet's version; the third group serves throughout."""
    big = cluster.add_node(num_cpus=1, resources={"slot": 2})
    small = cluster.add_node(num_cpus=1, resources={"slot": 1})
    cluster.wait_for_nodes(timeout=120)
    cfg = dataclasses.replace(
        ray_config(tiny_model_dir, tmp_path, [GroupSpec(1), GroupSpec(1), GroupSpec(1)]),
        ray=RaySettings(resources_per_rank={"slot": 1.0}, placement_timeout_s=5.0),
        # probes stay out of it: the node's loss is the failure class under test
        health=HealthSettings(interval_s=0.5, timeout_s=2.0, failure_threshold=1000),
    )
    with RolloutFleet(cfg) as fleet:
        groups = handles(fleet)
        on_big = sorted(g for g, h in groups.items() if h.node_id == big.node_id)
        (alone,) = [g for g, h in groups.items() if h.node_id == small.node_id]
        assert len(on_big) == 2, {g: h.node_id for g, h in groups.items()}
        weights = trained_weights(tiny_model_dir, 0.03)
        assert fleet.sync_weights(weights, 1).ok
        want = sglang_digests(weights)["model"]
        budget = {g: fleet.registry.get(g).machine.restart_budget for g in groups}

        cluster.remove_node(big, allow_graceful=False)
        # the fleet's NodeWatcher sees Ray report the node dead: both groups leave routing in
        # one step (unplaced), before any placement
        assert wait_for(lambda: big.node_id in fleet.membership.lost_nodes, 60)
        assert all(fleet.registry.get(g).state in ("unplaced", "recovering") for g in on_big)
        lost_at = {
            g: next(
                t.seq for t in fleet.registry.get(g).recent_transitions() if t.target == "unplaced"
            )
            for g in on_big
        }
        assert abs(lost_at[on_big[0]] - lost_at[on_big[1]]) == 1  # consecutive: one step
        for _ in range(4):
            assert fleet.generate(PROMPT, sampling_params=GREEDY).group_id == alone
        # no node has room: each waits unplaced, its budget untouched
        assert wait_for(
            lambda: all(
                any(r.group_id == g and r.status == "unplaced" for r in fleet.recoveries())
                for g in on_big
            ),
            120,
        ), fleet.snapshot()["recoveries"]
        assert all(fleet.registry.get(g).state == "unplaced" for g in on_big)
        assert fleet.node_lost(big.node_id) == []  # a second report changes nothing

        joined = cluster.add_node(num_cpus=1, resources={"slot": 2})
        cluster.wait_for_nodes(timeout=120)
        # the watcher sees the node join and offers it the waiting groups
        assert wait_for(
            lambda: all(fleet.registry.get(g).state == "active" for g in on_big), 240
        ), fleet.snapshot()["recoveries"]
        for g in on_big:
            assert groups[g].node_id == joined.node_id
            assert fleet.registry.get(g).machine.restart_budget == budget[g]
            path = [t.target for t in fleet.registry.get(g).recent_transitions()]
            i = path.index("unplaced")
            assert path[i + 1] == "recovering" and path[-1] == "active", path
        assert fleet.registry.get(alone).state == "active"
        assert set(fleet.registry.dispatch_counts().get(on_big[0], {})) <= {"active"}
        assert fleet.checksums() == {g: want for g in groups}
        assert fleet.snapshot()["placement"]["lost_nodes"] == [big.node_id]
        assert fleet.placement.node_watcher is not None and fleet.placement.node_watcher.rounds > 0
    cluster.remove_node(small, allow_graceful=False)
    cluster.remove_node(joined, allow_graceful=False)


def test_a_re_placed_group_restarts_from_the_export_moved_to_its_node_and_a_damaged_one_is_refused(
    cluster: Any,
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Exports not shared: the export of v1 is on the trainer's disk only. The group's node is
    removed; its restart on the other node pulls the export there (Ray's object store, checked
    against the manifest) and starts from that copy at v1. Then a chunk of v2's export is
    damaged on the way: the pull is refused and the group comes back by the targeted push.
    Last, a chunk never arrives: the pull gives up within its share of the attempt
    (``policy.pull_budget_s``), named, and the push in the same attempt brings it back."""
    from rollsafe.adapters.ray.exports import publish_export

    first = cluster.add_node(num_cpus=1, resources={"mv": 1})
    second = cluster.add_node(num_cpus=1, resources={"mv": 1})
    cluster.wait_for_nodes(timeout=120)
    cfg = dataclasses.replace(
        ray_config(tiny_model_dir, tmp_path, [GroupSpec(1)]),
        ray=RaySettings(resources_per_rank={"mv": 1.0}, placement_timeout_s=30.0),
        enable_immediate_recovery=True,
    )
    stuck_refs: list[Any] = []
    try:
        with RolloutFleet(cfg) as fleet:
            (group,) = handles(fleet).values()
            assert fleet.snapshot()["placement"]["exports"] == "moved"
            assert fleet.exporter is not None and fleet.placement.export_mover is not None
            weights = trained_weights(tiny_model_dir, 0.04)
            assert fleet.sync_weights(weights, 1).ok
            want = sglang_digests(weights)["model"]
            assert wait_for(lambda: fleet.exporter.latest_ready(1) is not None, 120)
            source = str(fleet.exporter.latest_ready(1).path)  # type: ignore[union-attr]

            lost = next(n for n in (first, second) if n.node_id == group.node_id)
            kept = second if lost is first else first
            cluster.remove_node(lost, allow_graceful=False)
            assert wait_for(lambda: any(r.status == "active" for r in fleet.recoveries()), 240), (
                fleet.snapshot()["recoveries"]
            )
            result = fleet.recoveries()[-1]
            assert group.node_id == kept.node_id and group.replacements == 1
            assert result.strategy == "immediate" and result.export_version == 1, result
            (pull,) = [s for s in result.steps if s.name == "pull"]
            nbytes = int(pull.detail.split("pulled ")[1].split(" bytes")[0])
            assert pull.ok and nbytes > 0, pull
            copy = pull.detail.split(": ", 1)[1]
            assert copy != source and "rollsafe-moved" in copy and kept.node_id[:16] in copy
            (restart,) = [s for s in result.steps if s.name == "restart"]
            assert f"model_path={copy}" in restart.detail, restart  # loaded the node's copy
            assert not any(s.name == "push" for s in result.steps)  # at v1 from the export
            assert fleet.checksums() == {"g0": want}
            assert group.client.generate(PROMPT, sampling_params=GREEDY).weight_version == "1"

            weights2 = trained_weights(tiny_model_dir, 0.05)
            assert fleet.sync_weights(weights2, 2).ok
            want2 = sglang_digests(weights2)["model"]
            assert wait_for(lambda: fleet.exporter.latest_ready(2) is not None, 120)
            fleet.snapshot()  # harvests the exports: v1's parcel is kept only while v1 is ready
            v1_ready = fleet.exporter.latest_ready(1) is not None
            assert (1 in fleet.placement.export_mover.published()) == v1_ready

            def tampering(path: str) -> Any:
                parcel = publish_export(path, chunk_bytes=64 << 10)
                name = max(parcel.chunks, key=lambda n: len(parcel.chunks[n]))
                refs = parcel.chunks[name]
                damaged = {**parcel.chunks, name: (refs[0], ray.put(b"\0" * (64 << 10)), *refs[2:])}
                return dataclasses.replace(parcel, chunks=damaged)

            fleet.placement.export_mover.publish = tampering
            result = kill_and_recover(fleet, group)
            (pull,) = [s for s in result.steps if s.name == "pull"]
            assert not pull.ok and "ExportPullRefused" in pull.detail, pull
            (why,) = [s for s in result.steps if s.name == "strategy"]
            assert "could not be moved" in why.detail
            (restart,) = [s for s in result.steps if s.name == "restart"]
            assert "skip_load_weights=True" in restart.detail  # dummy weights, never the bytes
            assert result.strategy == "targeted_push" and result.status == "active", result
            assert fleet.checksums() == {"g0": want2}
            assert group.client.generate(PROMPT, sampling_params=GREEDY).weight_version == "2"
            stats = fleet.snapshot()["placement"]["moved"]
            assert stats["failed_pulls"] == 1 and stats["bytes_pulled"] == nbytes

            # a chunk that never arrives (its object is the result of a task that does not
            # end): the pull gives up within its share of the attempt, named, and the group
            # still comes back at v2 by the push in the time left
            # (a lambda: pickled by value, the workers cannot import this test module)
            never = ray.remote(num_cpus=0, max_retries=0)(lambda: time.sleep(3600)).remote()
            stuck_refs.append(never)

            def stuck(path: str) -> Any:
                parcel = publish_export(path, chunk_bytes=64 << 10)
                name = max(parcel.chunks, key=lambda n: len(parcel.chunks[n]))
                refs = parcel.chunks[name]
                return dataclasses.replace(parcel, chunks={**parcel.chunks, name: (never, *refs)})

            mover = fleet.placement.export_mover
            assert mover is not None and fleet.recovery is not None
            mover.publish = stuck  # type: ignore[attr-defined]
            # the pull may take half of the attempt: 30 s
            fleet.recovery.settings = dataclasses.replace(fleet.recovery.settings, timeout_s=60.0)
            result = kill_and_recover(fleet, group)
            (pull,) = [s for s in result.steps if s.name == "pull"]
            assert not pull.ok and "ExportPullTimeout" in pull.detail, pull
            assert ".safetensors' did not arrive" in pull.detail, pull  # names the file
            assert pull.seconds < 0.5 * 60.0 + 5.0, pull  # its share, not the whole attempt
            (restart,) = [s for s in result.steps if s.name == "restart"]
            assert "skip_load_weights=True" in restart.detail
            assert result.strategy == "targeted_push" and result.status == "active", result
            assert result.attempts == 1, result  # the fallback fit in the same attempt
            assert fleet.checksums() == {"g0": want2}
            assert fleet.snapshot()["placement"]["moved"]["failed_pulls"] == 2
    finally:
        for ref in stuck_refs:
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=True)
        for node in (first, second):
            with contextlib.suppress(Exception):
                cluster.remove_node(node, allow_graceful=False)


def test_groups_added_and_removed_during_rollouts_on_the_cluster(
    cluster: Any,
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """While three threads generate: ``add_group`` places a new group on the worker with room
    and brings it to the fleet's version through ``pending_weights`` before any request
    reaches it; ``remove_group`` drains the first group: no request fails, none reaches it
    after the call, its engine stops and its placement is given back."""
    nodes = [cluster.add_node(num_cpus=1, resources={"el": 1}) for _ in range(2)]
    cluster.wait_for_nodes(timeout=120)
    cfg = dataclasses.replace(
        ray_config(tiny_model_dir, tmp_path, [GroupSpec(1)]),
        ray=RaySettings(resources_per_rank={"el": 1.0}, placement_timeout_s=60.0),
        spare_ranks=1,
    )
    errors: list[BaseException] = []
    served: list[str] = []
    stop = threading.Event()

    def rollouts(fleet: RolloutFleet) -> None:
        while not stop.is_set():
            try:
                served.append(fleet.generate(PROMPT, sampling_params=GREEDY).group_id)
            except BaseException as exc:  # recorded: the test asserts none happened
                errors.append(exc)

    try:
        with RolloutFleet(cfg) as fleet:
            first = fleet.engine("g0")
            assert isinstance(first, RayEngineGroup)
            weights = trained_weights(tiny_model_dir, 0.07)
            assert fleet.sync_weights(weights, 1).ok
            want = sglang_digests(weights)["model"]
            threads = [threading.Thread(target=rollouts, args=(fleet,)) for _ in range(3)]
            for t in threads:
                t.start()
            try:
                gid = fleet.add_group(GroupSpec(1))  # started at v0, behind the fleet's v1
                assert fleet.wait_recoveries(timeout=180)
                added = fleet.engine(gid)
                assert isinstance(added, RayEngineGroup)
                assert {added.node_id, first.node_id} == {n.node_id for n in nodes}
                path = [(t.source, t.target) for t in fleet.registry.get(gid).recent_transitions()]
                assert path == [("launching", "pending_weights"), ("pending_weights", "active")]
                assert set(fleet.registry.dispatch_counts().get(gid, {})) <= {"active"}
                assert fleet.checksums() == {"g0": want, gid: want}
                n = len(served)
                assert wait_for(lambda: gid in served[n:], 60)  # routed once active

                pids = first.rank_pids
                end = fleet.remove_group("g0", drain_timeout_s=30.0)
                dispatched = dict(fleet.registry.dispatch_counts().get("g0", {}))
                after = len(served)
                assert wait_for(lambda: len(served) >= after + 10 or bool(errors), 60)
            finally:
                stop.set()
                for t in threads:
                    t.join(60)
            assert not errors, errors[:3]
            assert end.status == "retired", end
            assert fleet.registry.get("g0").state == "retired"
            assert dict(fleet.registry.dispatch_counts().get("g0", {})) == dispatched
            assert set(served[after:]) == {gid}  # the removed group served nothing after
            assert not any(pid_alive(p) for p in pids), "the removed group's engine still runs"
            assert first.actor is None and first.placement is None  # placement given back
            assert fleet.placement.placer is not None and set(fleet.placement.placer.nodes()) == {
                gid
            }
            snap = fleet.snapshot()["placement"]
            assert snap["added"] == [gid] and snap["removed"] == ["g0"]
            weights2 = trained_weights(tiny_model_dir, 0.08)
            report = fleet.sync_weights(weights2, 2)
            assert report.ok and report.updated == [gid], report
    finally:
        for node in nodes:
            with contextlib.suppress(Exception):
                cluster.remove_node(node, allow_graceful=False)


def test_a_spare_kept_off_the_serving_node_takes_over_its_node_loss_and_a_lost_spare_returns(
    cluster: Any,
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """``spare_groups=1`` over three nodes of its own (#37): the placer keeps the spare off the
    serving group's node; the spare's node dies: it is placed again on the node without the
    serving group and comes back ``standby``, nothing promoted; the serving group's node dies:
    the spare is promoted at once (the requests go on, none fails), and the lost group is
    placed again and comes back as the spare."""
    from chaos_support import RequestLoop

    from rollsafe import invariants

    added = [cluster.add_node(num_cpus=1, resources={"spare_slot": 2}) for _ in range(3)]
    cluster.wait_for_nodes(timeout=120)
    mine = {n.node_id for n in added}
    cfg = dataclasses.replace(
        ray_config(tiny_model_dir, tmp_path, [GroupSpec(1)]),
        spare_groups=1,
        ray=RaySettings(resources_per_rank={"spare_slot": 1.0}, placement_timeout_s=30.0),
        wait_for_routable_s=120.0,
        request_timeout_s=10.0,
    )
    try:
        with RolloutFleet(cfg) as fleet:
            registry = fleet.registry
            groups = handles(fleet)
            where = {gid: g.node_id for gid, g in groups.items()}
            assert set(where.values()) <= mine and where["g0"] != where["s0"], where
            assert registry.get("s0").state == "standby"
            weights = trained_weights(tiny_model_dir, 0.02)
            assert fleet.sync_weights(weights, 1).ok
            want = sglang_digests(weights)["model"]
            assert fleet.exporter is not None
            fleet.exporter.wait_hf_export(1, timeout=120)

            # the spare's node dies: it is placed again, away from the serving group
            doomed = next(n for n in added if n.node_id == where["s0"])
            cluster.remove_node(doomed, allow_graceful=False)
            assert wait_for(
                lambda: (
                    ("unplaced" in [t.target for t in registry.get("s0").recent_transitions()])
                    and registry.get("s0").state == "standby"
                ),
                240,
            ), fleet.snapshot()["recoveries"]
            third = (mine - {where["g0"], where["s0"]}).pop()
            assert groups["s0"].node_id == third  # not the serving group's node
            assert registry.get("g0").state == "active"
            assert fleet.spares is not None and fleet.spares.promotions() == []

            # the serving group's node dies: the spare takes over, the lost group refills
            with RequestLoop(fleet) as loop:
                assert wait_for(lambda: loop.served_total() >= 5, 60)
                doomed = next(n for n in added if n.node_id == where["g0"])
                cluster.remove_node(doomed, allow_graceful=False)
                assert wait_for(lambda: registry.get("s0").state == "active", 120)
                served = loop.served_total()
                assert wait_for(lambda: loop.served_total() > served + 3, 120)
                assert wait_for(lambda: registry.get("g0").state == "standby", 240), (
                    fleet.snapshot()["recoveries"]
                )
            assert loop.errors == [], loop.errors[:3]
            assert set(loop.served) == {"g0", "s0"}
            assert [(p.spare, p.covered) for p in fleet.spares.promotions()] == [("s0", "g0")]
            assert registry.get("g0").machine.spare and not registry.get("s0").machine.spare
            assert groups["g0"].node_id == third and groups["g0"].replacements == 1
            assert fleet.checksums() == {"g0": want, "s0": want}
            assert fleet.wait_recoveries(120) and fleet.spares.wait_idle(60)
            assert not invariants.check_all(fleet.picture())
            for counts in registry.dispatch_counts().values():
                assert set(counts) <= {"active"}
    finally:
        for node in added:
            with contextlib.suppress(Exception):
                cluster.remove_node(node, allow_graceful=False)
