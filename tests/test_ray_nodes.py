"""Node liveness and shared exports on a real multi-node Ray cluster on this machine.

A head node and two worker nodes (``ray.cluster_utils.Cluster``, each its own raylet), the
driver joined through ``RAY_ADDRESS``:

* :class:`NodeWatcher`: removing a worker (its raylet killed) is exactly one ``dead`` event for
  its node id, adding a node one ``joined`` event, a raising callback does not stop it, and every
  round made one ``ray.nodes()`` call;
* the shared-exports check reads the probe back on every alive node (each read ran on its own
  node) and removes it; a node that cannot run the read is named with the probe's path;
* a fleet with ``RaySettings(shared_exports=True)`` checks ``export_root`` at start, says
  ``"shared"`` in its snapshot and syncs through ``transport="disk"`` from that export; an
  explicitly set ``nccl.master_address`` is kept;
* an actor whose node was removed still answers calls for a moment, as an orphan: its
  ``node_alive`` says lost every time (the recovery then sends ``node_lost``, not a restart).

Needs Ray (skipped without it, failed under ``CI=true``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import sglang_digests, tiny_model_dir  # noqa: F401  (fixture)
from ray_cluster import local_cluster, require_ray, wait_for

from rollsafe.fleet import (
    FleetConfig,
    GroupSpec,
    HealthSettings,
    NcclSettings,
    RaySettings,
    RolloutFleet,
)

ray = require_ray()
pytestmark = pytest.mark.ray_cluster

from rollsafe.adapters.ray import (  # noqa: E402
    NodeEvent,
    NodeWatcher,
    SharedExportUnreadable,
    check_shared_exports,
    init_ray,
)
from rollsafe.adapters.ray.exports import PROBE_PREFIX  # noqa: E402

PROMPT = [3, 14, 15, 92, 65]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with local_cluster([{"rollout": 2}, {"rollout": 2}], head_resources={"head": 1}) as c:
        init_ray()  # the driver joins the cluster through RAY_ADDRESS
        yield c


def alive_ids() -> set[str]:
    return {str(n["NodeID"]) for n in ray.nodes() if n["Alive"]}


class Recorder:
    """The watcher's callback: keeps every call (with its time); raises on the first one."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, list[NodeEvent]]] = []
        self.lock = threading.Lock()

    def __call__(self, events: list[NodeEvent]) -> None:
        with self.lock:
            self.calls.append((time.monotonic(), list(events)))
            first = len(self.calls) == 1
        if first:
            raise RuntimeError("the fleet's node-loss handler failed")

    def events(self) -> list[NodeEvent]:
        with self.lock:
            return [e for _, batch in self.calls for e in batch]


def test_the_local_clusters_raylets_run_with_its_settings(cluster: Any) -> None:
    """Every raylet (and the GCS) ``local_cluster`` started reads its settings from its own
    environment: the private ``RAY_TMPDIR``, the 1 s node health check, the 300 s worker
    registration timeout (a loaded one-machine cluster must not kill a worker still starting),
    the workers' niceness 0 (Ray's 15 starved them beside busy processes)."""
    from rollsafe.adapters.ray.local import HEALTH_PERIOD, NICENESS, REGISTER_TIMEOUT

    nodes = [cluster.head_node, *cluster.worker_nodes]
    seen = 0
    for node in nodes:
        for kind in ("raylet", "gcs_server"):
            for info in node.all_processes.get(kind, []):
                raw = Path(f"/proc/{info.process.pid}/environ").read_bytes().split(b"\0")
                env = dict(item.decode().split("=", 1) for item in raw if b"=" in item)
                assert env.get(REGISTER_TIMEOUT) == "300", (kind, env.get(REGISTER_TIMEOUT))
                assert env.get(HEALTH_PERIOD) == "1000", (kind, env.get(HEALTH_PERIOD))
                assert env.get(NICENESS) == "0", (kind, env.get(NICENESS))
                assert env.get("RAY_TMPDIR", "").startswith("/tmp/rs-ray-"), kind
                seen += 1
    assert seen == len(nodes) + 1  # a raylet per node and the head's GCS

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, 0)

    task = ray.remote(num_cpus=0, resources={"rollout": 0.01})(niceness)
    assert ray.get(task.remote(), timeout=120) == 0  # a worker on a worker node


def test_the_watcher_reports_a_removed_node_once_and_a_joined_one(cluster: Any) -> None:
    got = Recorder()
    watcher = NodeWatcher(got, interval_s=0.2).start()
    try:
        assert set(watcher.alive_nodes()) == alive_ids()  # the baseline, no event
        assert len(watcher.alive_nodes()) == 3 and got.calls == []
        doomed = min(cluster.worker_nodes, key=lambda n: n.node_id)
        address = watcher.alive_nodes()[doomed.node_id].address
        t0 = time.monotonic()
        cluster.remove_node(doomed, allow_graceful=False)  # its raylet and workers die
        assert wait_for(lambda: len(got.calls) >= 1, 60), watcher.stats()
        detected = got.calls[0][0] - t0
        assert got.calls[0][1] == [NodeEvent("dead", doomed.node_id, address)]
        assert watcher.callback_errors == 1  # the callback raised; the watcher goes on
        assert doomed.node_id not in watcher.alive_nodes()

        t1 = time.monotonic()
        added = cluster.add_node(num_cpus=1, resources={"rollout": 2})
        assert wait_for(lambda: len(got.calls) >= 2, 60), watcher.stats()
        joined = got.calls[1][0] - t1
        assert got.calls[1][1] == [NodeEvent("joined", added.node_id, added.node_ip_address)]
        rounds = watcher.rounds
        assert wait_for(lambda: watcher.rounds >= rounds + 5, 30)  # a few more rounds...
        assert got.events() == [  # ...and every change was reported exactly once
            NodeEvent("dead", doomed.node_id, address),
            NodeEvent("joined", added.node_id, added.node_ip_address),
        ]
        assert set(watcher.alive_nodes()) == alive_ids() and len(alive_ids()) == 3
        stats = watcher.stats()
        assert stats["calls"] == stats["rounds"] and stats["failed_rounds"] == 0, stats
        print(
            f"node removed -> dead event {detected:.2f} s; node added -> joined {joined:.2f} s;"
            f" one ray.nodes() call {stats['last_call_s'] * 1000:.1f} ms"
        )
    finally:
        assert watcher.stop(timeout=10)


def test_the_shared_export_check_reads_the_probe_on_every_node(
    cluster: Any, tmp_path: Path
) -> None:
    root = tmp_path / "exports"
    check = check_shared_exports(root, timeout_s=60)
    nodes = alive_ids()
    assert set(check.nodes) == nodes and len(nodes) == 3
    assert all(ran == node for node, ran in check.nodes.items())  # each read ran on its node
    assert check.probe.size == 4096 and len(check.probe.sha256) == 64
    assert not any(p.name.startswith(PROBE_PREFIX) for p in root.iterdir())  # removed
    print(f"shared-exports check on {len(nodes)} nodes: {check.seconds:.2f} s")

    gone = secrets.token_hex(28)  # a node id no node has (one that died since it was listed)
    with pytest.raises(SharedExportUnreadable) as err:
        check_shared_exports(root, nodes=[*sorted(nodes), gone], timeout_s=30)
    assert err.value.node_id == gone and set(err.value.failures) == {gone}
    assert err.value.path.startswith(str(root.resolve()) + os.sep + PROBE_PREFIX)
    assert gone in str(err.value) and err.value.path in str(err.value)
    assert not any(p.name.startswith(PROBE_PREFIX) for p in root.iterdir())  # removed again


def trained_weights(model_dir: Path, delta: float) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(delta)
    return {n: p.detach() for n, p in model.named_parameters()}


def shared_config(model: Path, tmp_path: Path, transport: Any) -> FleetConfig:
    return FleetConfig(
        model_path=model,
        export_root=tmp_path / "exports",
        groups=[GroupSpec(1)],
        transport=transport,
        placement="ray",
        ray=RaySettings(
            resources_per_rank={"rollout": 1.0}, placement_timeout_s=60.0, shared_exports=True
        ),
        health=HealthSettings(interval_s=0.5, timeout_s=2.0, failure_threshold=2),
        start_timeout_s=240.0,
    )


@pytest.mark.parametrize("transport", ["disk", NcclSettings(master_address="127.0.0.1")])
def test_a_fleet_with_shared_exports_checks_them_at_start_and_syncs(
    cluster: Any,
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    transport: Any,
) -> None:
    cfg = shared_config(tiny_model_dir, tmp_path, transport)
    with RolloutFleet(cfg) as fleet:
        snap = fleet.snapshot()["placement"]
        assert snap["kind"] == "ray" and snap["exports"] == "shared"
        check = fleet.placement.shared_exports
        assert check is not None and set(check.nodes) == alive_ids()
        group = fleet.engine("g0")
        assert snap["nodes"]["g0"] != ray.get_runtime_context().get_node_id()  # on a worker
        if cfg.transport == "nccl":  # given explicitly: kept, not replaced by the node's IP
            assert fleet.transport.master_address == "127.0.0.1"  # type: ignore[union-attr]
        weights = trained_weights(tiny_model_dir, 0.03)
        report = fleet.sync_weights(weights, 1)
        assert report.ok and report.updated == ["g0"], report
        assert fleet.checksums() == {"g0": sglang_digests(weights)["model"]}
        out = group.client.generate(PROMPT, sampling_params=GREEDY)
        assert out.weight_version == "1" and len(out.output_ids) == 6


def test_a_moved_export_is_pulled_to_the_engines_node_checked_and_loaded(
    cluster: Any,
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    from rollsafe.adapters.engines import EngineSpec
    from rollsafe.adapters.ray import GroupPlacer, RayEngineGroup
    from rollsafe.adapters.ray.exports import ExportPullRefused, publish_export
    from rollsafe.hf import HFExporter, verify_hf_dir

    weights = trained_weights(tiny_model_dir, 0.05)
    exporter = HFExporter(tmp_path / "exports", template_dir=tiny_model_dir)
    src = exporter.start(weights, 2).wait(120)  # a verified export on the trainer's node
    parcel = publish_export(src, chunk_bytes=256 << 10)  # chunks in Ray's object store
    assert parcel.nbytes > 256 << 10 and sum(len(c) for c in parcel.chunks.values()) > 2

    placer = GroupPlacer({"rollout": 1.0}, timeout_s=60)
    spec = EngineSpec(model_path=str(tiny_model_dir), ranks=1, weight_version="0")
    group = RayEngineGroup("g0", spec, placer, bind_node_ip=False).start()
    try:
        node = group.node_id
        assert node != ray.get_runtime_context().get_node_id()  # a worker, not the driver's
        dest = tmp_path / "node-local"  # that node's own disk (here: the same machine)
        t0 = time.monotonic()
        pulled = ray.get(group.actor.pull_export.remote(parcel, str(dest)), timeout=120)
        print(f"moved export: {pulled['nbytes']} bytes pulled in {time.monotonic() - t0:.2f} s")
        assert pulled["node_id"] == node and pulled["nbytes"] == parcel.nbytes
        assert pulled["path"] == str(dest / src.name) and not pulled["reused"]
        assert verify_hf_dir(pulled["path"], require_manifest=True).checksums_verified
        group.restart(model_path=pulled["path"], weight_version="2")  # load the moved export
        assert group.client.weights_checksum().model == sglang_digests(weights)["model"]
        out = group.client.generate(PROMPT, sampling_params=GREEDY)
        assert out.weight_version == "2" and len(out.output_ids) == 6

        name, refs = next((n, c) for n, c in parcel.chunks.items() if len(c) > 1)
        damaged = dict(parcel.chunks)
        damaged[name] = (refs[0], ray.put(b"\0" * (256 << 10)), *refs[2:])  # altered on the way
        bad = dataclasses.replace(parcel, chunks=damaged)
        with pytest.raises(ray.exceptions.RayTaskError) as err:
            ray.get(group.actor.pull_export.remote(bad, str(tmp_path / "other")), timeout=120)
        assert isinstance(err.value.cause, ExportPullRefused), err.value
        assert err.value.cause.file == name and err.value.cause.export == src.name
        assert list((tmp_path / "other").iterdir()) == []  # nothing left to load
    finally:
        group.stop()
    assert placer.nodes() == {}


def test_a_node_that_joins_is_checked_and_one_that_cannot_read_the_shared_root_takes_no_group(
    cluster: Any,
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``shared_exports=True``: each node that joins after the start is checked. A node whose
    check fails is recorded and passed over: the group whose node dies waits ``unplaced``
    rather than go there, and is placed on the next node that joins and passes the check.
    Every node of this cluster is this machine, so the failing node's read is simulated (the
    check raises ``SharedExportUnreadable`` for it, as a node without the mount would); the
    other checks are the real ones."""
    home = cluster.add_node(num_cpus=1, resources={"sx": 1})
    cluster.wait_for_nodes(timeout=120)
    cfg = dataclasses.replace(
        shared_config(tiny_model_dir, tmp_path, "nccl"),
        ray=RaySettings(
            resources_per_rank={"sx": 1.0},
            placement_timeout_s=20.0,
            shared_exports=True,
            node_watch_interval_s=0.2,
        ),
    )
    unmounted = {"on": True}  # nodes joining meanwhile lack the shared mount
    checked: list[tuple[list[str], bool]] = []
    added: list[Any] = []
    try:
        with RolloutFleet(cfg) as fleet:
            assert fleet.engine("g0").node_id == home.node_id  # type: ignore[attr-defined]
            real = fleet.placement.shared_check
            assert real is check_shared_exports

            def check(root: Any, *, nodes: list[str], timeout_s: float) -> Any:
                bad = unmounted["on"]
                checked.append((list(nodes), bad))
                if bad:
                    path = f"{root}/{PROBE_PREFIX}simulated"
                    raise SharedExportUnreadable(
                        nodes[0], path, {nodes[0]: "FileNotFoundError: no such file"}
                    )
                return check_shared_exports(root, nodes=nodes, timeout_s=timeout_s)

            fleet.placement.shared_check = check
            weights = trained_weights(tiny_model_dir, 0.06)
            assert fleet.sync_weights(weights, 1).ok  # what a re-placed group is pushed
            bad = cluster.add_node(num_cpus=1, resources={"sx": 1})
            added.append(bad)
            assert wait_for(lambda: bad.node_id in fleet.placement.unreadable_nodes, 60), checked
            unmounted["on"] = False
            assert ([bad.node_id], True) in checked
            snap = fleet.snapshot()["placement"]
            assert set(snap["unreadable_nodes"]) == {bad.node_id}
            assert PROBE_PREFIX in snap["unreadable_nodes"][bad.node_id]
            warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
            assert any(bad.node_id in m and PROBE_PREFIX in m for m in warned), warned
            assert (
                fleet.placement.placer is not None
                and bad.node_id in fleet.placement.placer.excluded()
            )

            cluster.remove_node(home, allow_graceful=False)
            # only the unreadable node has room: the group waits rather than go there
            assert wait_for(lambda: any(r.status == "unplaced" for r in fleet.recoveries()), 120), (
                fleet.snapshot()["recoveries"]
            )
            assert fleet.registry.get("g0").state == "unplaced"
            assert "g0" not in fleet.placement.placer.nodes()

            good = cluster.add_node(num_cpus=1, resources={"sx": 1})
            added.append(good)
            assert wait_for(lambda: fleet.registry.get("g0").state == "active", 240), (
                fleet.snapshot()["recoveries"]
            )
            assert fleet.engine("g0").node_id == good.node_id  # type: ignore[attr-defined]
            assert ([good.node_id], False) in checked  # the real check, passed
            assert set(fleet.placement.unreadable_nodes) == {bad.node_id}
            assert fleet.checksums() == {"g0": sglang_digests(weights)["model"]}
            out = fleet.generate(PROMPT, sampling_params=GREEDY)
            assert out.group_id == "g0" and out.weight_version == "1"
    finally:
        for node in added:
            with contextlib.suppress(Exception):
                cluster.remove_node(node, allow_graceful=False)


def test_the_placer_pins_a_group_to_a_node_and_keeps_groups_off_an_excluded_one(
    cluster: Any,
) -> None:
    """``GroupPlacer.place(node=)`` (``RaySettings.trainer_node_groups``) and
    ``GroupPlacer.exclude`` (a node that cannot read the shared export_root): the bundles
    select the node's ``ray.io/node-id`` label (or any but the excluded ones), so Ray reserves
    nowhere else even right after other reservations were given back (its view of the free
    resources lags: the soft hint alone was passed over on a loaded machine); where the node
    cannot hold the group it is refused, naming it."""
    from rollsafe.adapters.ray import GroupPlacer, PlacementUnavailable

    workers = sorted(n.node_id for n in cluster.worker_nodes)
    head = ray.get_runtime_context().get_node_id()
    placer = GroupPlacer({"rollout": 1.0}, timeout_s=5.0)
    made = []
    try:
        for node in workers:  # each pinned placement lands on its node
            made.append(placer.place(f"p-{node[:6]}", 1, node=node))
            assert made[-1].node_id == node
        with pytest.raises(PlacementUnavailable) as err:  # the head offers no `rollout`
            placer.place("on-head", 1, node=head)
        assert head in str(err.value)
        for p in made:
            placer.release(p)
        made.clear()
        placer.exclude(workers[0], "cannot read the shared export_root")
        assert placer.excluded() == {workers[0]: "cannot read the shared export_root"}
        for i in range(2):  # room for two on the other worker: never the excluded one
            made.append(placer.place(f"x{i}", 1))
            assert made[-1].node_id == workers[1]
        with pytest.raises(PlacementUnavailable):
            placer.place("pinned-excluded", 1, node=workers[0])
    finally:
        for p in made:
            placer.release(p)
    assert placer.nodes() == {}


@pytest.mark.parametrize("selectors", [True, False], ids=["label-selectors", "hint-only"])
def test_a_full_allowed_node_never_sends_a_group_to_the_excluded_one(
    cluster: Any, monkeypatch: pytest.MonkeyPatch, selectors: bool
) -> None:
    """The allowed worker is full and the excluded one has room: with label selectors Ray
    never reserves there (the group waits and is refused, naming the exclusion); a Ray that
    takes only the soft hint reserves on the excluded node, each reservation is given back and
    asked again until the timeout, and the refusal names the node Ray offered. Either way
    nothing stays reserved."""
    from rollsafe.adapters.ray import GroupPlacer, PlacementUnavailable
    from rollsafe.adapters.ray import placement as placement_module

    monkeypatch.setattr(placement_module, "_SELECTORS", selectors)
    workers = sorted(n.node_id for n in cluster.worker_nodes)
    placer = GroupPlacer({"rollout": 1.0}, timeout_s=2.0)
    placer.exclude(workers[0], "cannot read the shared export_root")
    made = [placer.place(f"full{i}", 1, node=workers[1]) for i in range(2)]
    try:
        with pytest.raises(PlacementUnavailable) as err:
            placer.place("late", 1)
        if selectors:
            assert f"off the excluded {[workers[0]]}" in str(err.value)
            assert "offered" not in str(err.value)
        else:
            assert f"Ray offered [{workers[0]!r}" in str(err.value)
        assert set(placer.nodes()) == {"full0", "full1"}
    finally:
        for p in made:
            placer.release(p)
    assert placer.nodes() == {}
    assert wait_for(lambda: ray.available_resources().get("rollout", 0.0) == 4.0, 30)


def test_an_actor_whose_raylet_died_reports_its_node_lost_while_it_still_answers(
    cluster: Any,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    """An actor's worker outlives its raylet for a moment and answers calls meanwhile (they go
    worker to worker): the recovery's liveness question (``node_alive``, asked by
    ``RayEngineGroup.placement_alive``) must say lost from the raylet's death on, or a node
    loss is taken for an engine crash and restarted on the dead node."""
    from rollsafe.adapters.engines import EngineSpec
    from rollsafe.adapters.ray import engine_actor

    node = cluster.add_node(num_cpus=1, resources={"orphan": 1})
    removed = False
    try:
        spec = EngineSpec(model_path=str(tiny_model_dir), dialect="sglang")
        actor = engine_actor(resources={"orphan": 1}).remote(spec)
        assert ray.get(actor.node_id.remote(), timeout=60) == node.node_id
        assert ray.get(actor.node_alive.remote(), timeout=30) is True
        removed = True
        cluster.remove_node(node, allow_graceful=False)  # as the demo does: raylet killed
        answers = []  # every answer after the raylet's death
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                answers.append(ray.get(actor.node_alive.remote(), timeout=5))
            except ray.exceptions.RayError:
                break  # the worker noticed and exited (or Ray declared the actor dead)
        assert answers.count(True) == 0, answers
        print(f"the orphaned worker answered {len(answers)} call(s), each: node lost")
    finally:
        if not removed:
            with contextlib.suppress(Exception):
                cluster.remove_node(node, allow_graceful=False)
