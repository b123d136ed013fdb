"""Elastic groups on real engines (issue #25 item 5): ``add_group`` brings a group started at
runtime to the fleet's version through ``pending_weights`` before it is routed;
``remove_group`` drains a group while requests run, stops it and retires it for good; bad
calls are named refusals that change nothing. (Node loss on a real multi-node Ray cluster:
``tests/test_ray_fleet.py``; the operations themselves: ``tests/test_operations_place.py``.)"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from engine_helpers import pid_alive, sglang_digests, tiny_model_dir  # noqa: F401  (fixture)

from rollsafe.errors import InvalidArgument
from rollsafe.fleet import FleetConfig, GroupSpec, RolloutFleet
from rollsafe.registry import UnknownGroup


def _bumped(model_dir: Path, delta: float) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(delta)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_an_added_group_catches_up_before_it_is_routed_and_a_removed_one_never_returns(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    cfg = FleetConfig(
        model_path=tiny_model_dir,
        export_root=tmp_path / "exports",
        groups=[GroupSpec(1), GroupSpec(1)],
        transport="nccl",
        spare_ranks=1,
    )
    with RolloutFleet(cfg) as fleet:
        weights = _bumped(tiny_model_dir, 0.01)
        assert fleet.sync_weights(weights, 1).ok
        want = sglang_digests(weights)["model"]

        # -- add: started on the initial weights (v0), behind the fleet's v1
        gid = fleet.add_group(GroupSpec(1))
        assert gid == "g2" and fleet.registry.get(gid).ranks == (2,)
        assert fleet.wait_recoveries(timeout=120)
        group = fleet.registry.get(gid)
        path = [(t.source, t.target) for t in group.recent_transitions()]
        assert path == [("launching", "pending_weights"), ("pending_weights", "active")], path
        assert fleet.checksums()[gid] == want
        assert set(fleet.registry.dispatch_counts().get(gid, {})) <= {"active"}
        catch_up = [r for r in fleet.recoveries() if r.group_id == gid]
        assert catch_up and catch_up[-1].status == "active", catch_up
        assert catch_up[-1].strategy == "targeted_push"
        # no spare rank is left: a second add is refused, naming the setting, nothing changed
        before = sorted(fleet.registry.snapshot()["groups"])
        with pytest.raises(InvalidArgument) as info:
            fleet.add_group(GroupSpec(1))
        assert info.value.key == "FleetConfig.spare_ranks"
        with pytest.raises(InvalidArgument) as dup:
            fleet.add_group(GroupSpec(1, group_id="g0"))
        assert dup.value.key == "spec.group_id"
        assert sorted(fleet.registry.snapshot()["groups"]) == before

        # -- remove g0 while requests run on the fleet
        pids = list(fleet.launcher("g0").rank_pids)
        errors: list[BaseException] = []
        stop = threading.Event()
        served: list[str] = []

        def rollouts() -> None:
            while not stop.is_set():
                try:
                    out = fleet.generate([1, 2, 3], sampling_params={"max_new_tokens": 8})
                    served.append(out.group_id)
                except BaseException as exc:  # recorded: the test asserts none happened
                    errors.append(exc)

        workers = [threading.Thread(target=rollouts) for _ in range(3)]
        for w in workers:
            w.start()
        try:
            end = fleet.remove_group("g0", drain_timeout_s=30.0)
            after_removal = len(served)
            while len(served) < after_removal + 10 and not errors:
                stop.wait(0.05)
        finally:
            stop.set()
            for w in workers:
                w.join(60)
        assert not errors, errors[:3]
        assert end.status == "retired", end
        g0 = fleet.registry.get("g0")
        assert g0.state == "retired" and not g0.is_routable
        assert [t.target for t in g0.recent_transitions()][-2:] == ["draining", "retired"]
        assert "g0" not in served[after_removal:]
        assert not any(pid_alive(p) for p in pids), "the removed group's engine still runs"
        assert set(served[after_removal:]) <= {"g1", "g2"}
        # a second removal is a no-op; an unknown group is named
        assert fleet.remove_group("g0").status == "already"
        with pytest.raises(UnknownGroup):
            fleet.remove_group("nope")
        # a sync after the removal updates the others only and all hold it
        weights2 = _bumped(tiny_model_dir, 0.02)
        report = fleet.sync_weights(weights2, 2)
        assert report.ok and sorted(report.updated) == ["g1", "g2"], report
        want2 = sglang_digests(weights2)["model"]
        sums = fleet.checksums()
        assert sums["g1"] == sums["g2"] == want2
        snap = fleet.snapshot()["placement"]
        assert snap["added"] == ["g2"] and snap["removed"] == ["g0"]
