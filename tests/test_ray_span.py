"""Groups that span nodes on a real multi-node Ray cluster on this machine (issue #37 item 1).

A head node (no ``rollout`` room) and three worker nodes (``rollout: 2`` each), the driver
joined through ``RAY_ADDRESS``, one cluster for the module:

* ``GroupPlacer.place(slices=2)``: one ``STRICT_SPREAD`` placement group whose bundles are the
  slices, each on its own node; a group Ray cannot hold whole (more slices than nodes with room)
  is refused and nothing stays reserved (all slices or none).
* a moved export reaches every slice's node, and a restart from the head's copy loads each
  slice's own (digests equal);
* a fleet with a two-node group beside a one-node group: served, synced, a SIGKILLed rank of the
  second slice recovered in place, a node under one slice removed while rollouts run: the whole
  group out of routing (never served while incomplete), placed again whole, ``active`` at the
  version, digests equal (the last test: it removes a node of the module's cluster).

Needs Ray (skipped without it, failed under ``CI=true``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import sglang_digests, tiny_model_dir  # noqa: F401  (fixture)
from ray_cluster import local_cluster, require_ray, wait_for

from rollsafe.fleet import FleetConfig, GroupSpec, HealthSettings, RaySettings, RolloutFleet

ray = require_ray()
pytestmark = pytest.mark.ray_cluster

from rollsafe.adapters.ray import (  # noqa: E402
    GroupPlacer,
    PlacementUnavailable,
    RayEngineGroup,
    init_ray,
)

#: each worker node offers room for this many engine ranks: a slice of two, or a slice and a
#: one-node group of one
ROOM = 3


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    workers = [{"rollout": ROOM}] * 3
    with local_cluster(workers, head_resources={"head": 1}) as c:
        init_ray()  # the driver joins the cluster through RAY_ADDRESS
        yield c


def test_a_group_is_placed_one_slice_per_node_all_slices_or_none(cluster: Any) -> None:
    workers = {n.node_id for n in cluster.worker_nodes}
    placer = GroupPlacer({"rollout": 1.0}, timeout_s=5.0)
    made = []
    try:
        made.append(placer.place("wide", 4, slices=2))  # two slices of two ranks
        wide = made[-1]
        assert wide.slices == 2 and len(set(wide.node_ids)) == 2
        assert set(wide.node_ids) <= workers and wide.node_id == wide.node_ids[0]
        assert [dict(b) for b in wide.bundles] == [{"rollout": 2.0}] * 2
        assert placer.slice_nodes() == {"wide": wide.node_ids}
        assert placer.nodes() == {"wide": wide.node_id}
        with pytest.raises(PlacementUnavailable) as err:  # two slices, one node with room
            placer.place("second", 4, slices=2)
        assert err.value.slices == 2 and "2 distinct nodes" in str(err.value)
        assert "second" not in placer.nodes()
        # the slice that fitted was not kept: a one-node group takes the last node's room
        made.append(placer.place("narrow", 2))
        assert made[-1].node_ids == tuple(workers - set(wide.node_ids))
    finally:
        for p in made:
            placer.release(p)
    assert placer.nodes() == {} and placer.slice_nodes() == {}


# ------------------------------------------------------------------ a fleet with a two-node group
PROMPT = [3, 14, 15, 92, 65]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0}


def trained_weights(model_dir: Path, delta: float) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(delta)
    return {n: p.detach() for n, p in model.named_parameters()}


def test_a_moved_export_reaches_every_slice_and_each_loads_its_own_copy(
    cluster: Any,
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Without shared storage a recovery moves the export to the group's nodes: for a group
    over two nodes every slice's actor pulls it to its own node (checked against the manifest
    there), and a restart from the head's copy loads each slice's own copy: every rank's
    digests equal the trainer's."""
    from rollsafe.adapters.engines import EngineSpec
    from rollsafe.adapters.ray.exports import publish_export
    from rollsafe.hf import HFExporter

    weights = trained_weights(tiny_model_dir, 0.05)
    exporter = HFExporter(tmp_path / "exports", template_dir=tiny_model_dir)
    src = exporter.start(weights, 2).wait(120)
    parcel = publish_export(src)
    placer = GroupPlacer({"rollout": 1.0}, timeout_s=60)
    spec = EngineSpec(model_path=str(tiny_model_dir), ranks=4, ranks_per_node=2)
    group = RayEngineGroup("g0", spec, placer, bind_node_ip=False).start()
    try:
        assert len(set(group.node_ids)) == 2
        pulled = group.pull_export(parcel, str(tmp_path / "node-local"), fleet="t")
        (paths,) = group.slice_paths.values()
        assert paths[0] == pulled["path"] and len(set(paths)) == 2  # one copy per node
        for path, node in zip(paths, group.node_ids, strict=True):
            assert node[:16] in path and Path(path, "config.json").is_file()
        group.restart(model_path=pulled["path"], weight_version="2")
        assert group.client.weights_checksum().model == sglang_digests(weights, 4)["model"]
        out = group.client.generate(PROMPT, sampling_params=GREEDY)
        assert out.weight_version == "2" and len(out.output_ids) == 6
    finally:
        group.stop()
    assert placer.slice_nodes() == {} and group.slice_paths == {}


def test_a_two_node_group_is_served_synced_recovered_and_placed_again_whole_after_a_node_loss(
    cluster: Any,
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """``GroupSpec(ranks=4, ranks_per_node=2)`` beside a one-node group: its slices' actors on
    two distinct nodes (the head's engine on its node's IP, the other slice's ranks joined to
    it), served, synced over ``nccl`` (gloo) with every rank's digests equal, a SIGKILLed rank
    recovered in place; then a node under one of its slices is removed while rollouts run: the
    whole group leaves routing at once (the other group serves every request), is placed again
    whole (two distinct alive nodes), ``active`` at the current version, digests equal."""
    cfg = FleetConfig(
        model_path=tiny_model_dir,
        export_root=tmp_path / "exports",
        groups=[GroupSpec(ranks=4, ranks_per_node=2), GroupSpec(ranks=1)],
        transport="nccl",
        placement="ray",
        ray=RaySettings(resources_per_rank={"rollout": 1.0}, placement_timeout_s=60.0),
        health=HealthSettings(interval_s=0.2, timeout_s=2.0, failure_threshold=2),
        start_timeout_s=240.0,
    )
    with RolloutFleet(cfg) as fleet:
        wide = fleet.engine("g0")
        narrow = fleet.engine("g1")
        assert isinstance(wide, RayEngineGroup) and isinstance(narrow, RayEngineGroup)
        slices = wide.node_ids
        assert len(slices) == 2 and len(set(slices)) == 2, slices
        assert set(slices) <= {n.node_id for n in cluster.worker_nodes}
        for i, node in enumerate(slices):  # each slice's actor on its own node
            assert ray.get(wide.slice_actor(i).node_id.remote()) == node
        head_info = wide.ready_info
        assert head_info["nnodes"] == 2 and sorted(head_info["remote_rank_pids"]) == ["2", "3"]
        node_ip = ray.util.get_node_ip_address()
        assert wide.url.startswith(f"http://{node_ip}:")
        assert [g.state for g in fleet.registry.groups()] == ["active", "active"]
        assert len(wide.client.generate(PROMPT, sampling_params=GREEDY).output_ids) == 6

        weights = trained_weights(tiny_model_dir, 0.01)
        report = fleet.sync_weights(weights, 1)
        assert report.ok and report.updated == ["g0", "g1"], report
        want = {"g0": sglang_digests(weights, 4)["model"], "g1": sglang_digests(weights)["model"]}
        assert fleet.checksums() == want

        done = len(fleet.recoveries())
        wide.kill_rank(3)  # a rank of the second slice, on its node
        assert wait_for(
            lambda: len(fleet.recoveries()) > done and fleet.registry.get("g0").state == "active",
            240,
        ), fleet.snapshot()["recoveries"]
        assert fleet.recoveries()[-1].status == "active"
        assert wide.node_ids == slices and wide.replacements == 0  # restarted in place
        assert fleet.checksums() == want

        # a node under one slice (not the one-node group's) is lost while rollouts run
        doomed_id = next(n for n in slices if n != narrow.node_id)
        doomed = next(n for n in cluster.worker_nodes if n.node_id == doomed_id)
        # (when it was sent, when it was answered, the group that served it), wall clock as
        # the machines' transition records
        served: list[tuple[float, float, str]] = []
        stop = threading.Event()

        def rollouts() -> None:
            while not stop.is_set():
                with contextlib.suppress(Exception):
                    sent = time.time()
                    group = fleet.generate(PROMPT, sampling_params=GREEDY).group_id
                    served.append((sent, time.time(), group))

        roller = threading.Thread(target=rollouts, daemon=True)
        roller.start()
        try:
            cluster.remove_node(doomed, allow_graceful=False)
            assert wait_for(lambda: not fleet.registry.get("g0").is_routable, 60)
            out_at = time.time()
            assert wait_for(lambda: fleet.registry.get("g0").state == "active", 240), (
                fleet.snapshot()["recoveries"]
            )
            back_at = next(  # when g0 was active again, by its machine's own record
                t.timestamp
                for t in fleet.registry.get("g0").machine.history
                if t.target == "active" and t.timestamp > out_at
            )
            assert wait_for(lambda: served[-1][0] > back_at, 60)  # rollouts went on throughout
        finally:
            stop.set()
            roller.join(30)
        # every request sent after g0 left routing and answered before it was active again was
        # served by the other group (one sent before, or answered after, may be g0's by right)
        while_out = [
            group for sent, answered, group in served if out_at < sent < answered < back_at
        ]
        assert while_out and set(while_out) == {"g1"}, while_out  # never the incomplete group
        again = wide.node_ids
        alive = {str(n["NodeID"]) for n in ray.nodes() if n["Alive"]}
        assert len(again) == 2 and len(set(again)) == 2 and set(again) <= alive, again
        assert doomed_id not in again and wide.replacements >= 1
        assert fleet.checksums() == want
        out = wide.client.generate(PROMPT, sampling_params=GREEDY)
        assert out.weight_version == "1" and len(out.output_ids) == 6
        placer = fleet.placement.placer
        assert placer is not None
    assert placer.slice_nodes() == {}  # close gave every placement back
    assert wide.actor is None and wide.placement is None
