"""Groups that span nodes (``GroupSpec(ranks_per_node=...)``, issue #37 item 1), without Ray: the
shape is checked before anything starts, naming the key, and carried into each group's plan and
engine spec; the placer's bundles are one per node slice; a group is on every node it holds a
slice on (a node lost under any slice finds it).

The cluster tests (a two-node group placed, served, synced, its node lost) are in
``tests/test_ray_span.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_helpers import sglang_digests, tiny_model_dir  # noqa: F401  (fixture)

from rollsafe.adapters.engines import EngineSpec
from rollsafe.adapters.ray import GroupPlacer
from rollsafe.adapters.ray.placement import Placement
from rollsafe.errors import InvalidArgument
from rollsafe.fleet import FleetConfig, FleetConfigError, GroupSpec, RaySettings
from rollsafe.fleet.engines import EngineGroups


def config(tmp_path: Path, **kw: Any) -> FleetConfig:
    return FleetConfig(model_path=tmp_path, export_root=tmp_path / "exports", **kw)


def test_a_group_spans_ranks_over_ranks_per_node_slices(tmp_path: Path) -> None:
    cfg = config(tmp_path, groups=[GroupSpec(ranks=4, ranks_per_node=2), GroupSpec(ranks=2)])
    plans = cfg._resolve_groups()
    assert [(p.group_id, p.ranks, p.ranks_per_node, p.slices) for p in plans] == [
        ("g0", 4, 2, 2),
        ("g1", 2, None, 1),
    ]
    assert plans[0].fleet_ranks == (0, 1, 2, 3) and plans[1].fleet_ranks == (4, 5)
    assert GroupSpec(ranks=8, ranks_per_node=2).slices == 4
    assert GroupSpec(ranks=8).slices == 1
    # the group's engine spec carries the shape; the template's stays unset
    groups = EngineGroups(cfg, plans)
    spec = groups.spec_for(plans[0])
    assert (spec.ranks, spec.ranks_per_node, spec.slices) == (4, 2, 2)
    assert groups.spec_for(plans[1]).slices == 1


@pytest.mark.parametrize(
    ("group", "why"),
    [
        (GroupSpec(ranks=4, ranks_per_node=3), "does not divide the group's 4 ranks"),
        (GroupSpec(ranks=4, ranks_per_node=0), "must be >= 1"),
        (GroupSpec(ranks=4, ranks_per_node=True), "must be an int"),  # type: ignore[arg-type]
        (GroupSpec(ranks=4, ranks_per_node="2"), "must be an int"),  # type: ignore[arg-type]
    ],
)
def test_a_shape_that_does_not_cut_the_ranks_into_slices_is_refused_naming_the_key(
    tmp_path: Path, group: GroupSpec, why: str
) -> None:
    with pytest.raises(FleetConfigError) as err:
        config(tmp_path, groups=[GroupSpec(ranks=2), group])
    assert err.value.key == "groups[1].ranks_per_node"
    assert isinstance(err.value, InvalidArgument) and why in str(err.value)


def test_the_shape_is_set_per_group_and_spares_share_it(tmp_path: Path) -> None:
    with pytest.raises(FleetConfigError) as err:
        config(tmp_path, engine=EngineSpec(model_path=str(tmp_path), ranks_per_node=1))
    assert err.value.key == "engine.ranks_per_node"
    with pytest.raises(FleetConfigError) as err:  # spares take over from any group
        config(
            tmp_path,
            groups=[GroupSpec(ranks=4, ranks_per_node=2), GroupSpec(ranks=4)],
            spare_groups=1,
        )
    assert err.value.key == "spare_groups" and "one shape" in str(err.value)
    plans = config(
        tmp_path, groups=[GroupSpec(ranks=4, ranks_per_node=2)], spare_groups=1
    )._resolve_groups()
    assert [(p.group_id, p.spare, p.slices) for p in plans] == [("g0", False, 2), ("s0", True, 2)]


def test_a_group_that_spans_nodes_cannot_be_pinned_to_the_trainers_node(tmp_path: Path) -> None:
    with pytest.raises(FleetConfigError) as err:
        config(
            tmp_path,
            placement="ray",
            transport="nccl",
            groups=[GroupSpec(ranks=2, ranks_per_node=1)],
            ray=RaySettings(trainer_node_groups=("g0",)),
        )
    assert err.value.key == "ray.trainer_node_groups" and "spans 2 nodes" in str(err.value)


def test_the_engine_spec_refuses_a_bad_shape_naming_the_field(tmp_path: Path) -> None:
    for bad in (3, 0, -2, True):
        with pytest.raises(InvalidArgument) as err:
            EngineSpec(model_path=str(tmp_path), ranks=4, ranks_per_node=bad)
        assert err.value.key == "EngineSpec.ranks_per_node"
    assert EngineSpec(model_path=str(tmp_path), ranks=6, ranks_per_node=3).slices == 2
    assert EngineSpec(model_path=str(tmp_path), ranks=6).slices == 1


def test_a_group_added_at_runtime_has_its_shape_checked(tmp_path: Path) -> None:
    cfg = config(tmp_path, spare_ranks=4)
    groups = EngineGroups(cfg, cfg._resolve_groups())
    with pytest.raises(InvalidArgument) as err:
        groups.plan(GroupSpec(ranks=4, ranks_per_node=3))
    assert err.value.key == "spec.ranks_per_node"
    assert groups.snapshot()["free_ranks"] == [1, 2, 3, 4]  # nothing taken
    plan = groups.plan(GroupSpec(ranks=4, ranks_per_node=2))
    assert (plan.slices, plan.fleet_ranks) == (2, (1, 2, 3, 4))


def test_the_placer_reserves_one_bundle_per_node_slice() -> None:
    placer = GroupPlacer({"GPU": 1.0, "CPU": 2.0})
    assert placer.bundles(4) == [{"GPU": 1.0, "CPU": 2.0}] * 4  # one node: one per rank
    assert placer.bundles(4, 2) == [{"GPU": 2.0, "CPU": 4.0}] * 2  # a slice's ranks each
    for slices, key in ((3, "slices"), (0, "slices")):
        with pytest.raises(InvalidArgument) as err:
            placer.place("g0", 4, slices=slices)
        assert err.value.key == key
    with pytest.raises(InvalidArgument) as err:
        placer.place("g0", 4, slices=2, node="n1")
    assert err.value.key == "node" and "spans 2 nodes" in str(err.value)


class Placed:
    """A handle placed on nodes (the ``PlaceableEngine`` members ``groups_on`` reads)."""

    def __init__(self, nodes: tuple[str, ...]) -> None:
        self.placement = Placement("x", None, nodes[0], (), nodes) if nodes else None

    @property
    def node_id(self) -> str | None:
        return None if self.placement is None else self.placement.node_id

    @property
    def node_ids(self) -> tuple[str, ...]:
        return () if self.placement is None else self.placement.node_ids

    def place_again(self) -> str:
        raise AssertionError("not asked")

    def release_placement(self) -> None:
        raise AssertionError("not asked")

    def placement_alive(self, *, timeout_s: float) -> bool:
        return True


def test_a_group_is_on_every_node_it_holds_a_slice_on(tmp_path: Path) -> None:
    """The node-loss path asks ``groups_on(node)``: a group that spans nodes answers for each of
    its slices' nodes, so losing the node under its second slice takes it out too."""
    cfg = config(tmp_path, groups=[GroupSpec(ranks=2, ranks_per_node=1), GroupSpec()])
    groups = EngineGroups(cfg, cfg._resolve_groups())
    groups._handles = {"g0": Placed(("a", "b")), "g1": Placed(("b",))}  # type: ignore[dict-item]
    assert groups.groups_on("a") == ["g0"]
    assert groups.groups_on("b") == ["g0", "g1"]
    assert groups.groups_on("c") == []
    one = Placement("g1", None, "b", ())
    assert (one.node_ids, one.slices) == (("b",), 1)


# ------------------------------------------------------------------ the slices, on this machine
PROMPT = [3, 14, 15, 92, 65]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0}


def test_a_two_slice_group_serves_syncs_every_rank_and_a_lost_slice_takes_it_out_whole(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """``placement="local"``: the slices are virtual nodes (one engine process each, joined to
    the head on loopback, :class:`SlicedLauncher`). The group answers as a one-node group of the
    same ranks does, takes an ``nccl`` (gloo) sync on all four ranks (per-rank digests equal
    the trainer's), and the SIGKILL of its second slice's process fails it at once: out of
    routing, restarted whole, ``active`` at the version, digests equal again."""
    import torch

    from rollsafe.adapters.engines import EngineLauncher
    from rollsafe.adapters.engines.sliced import SlicedLauncher
    from rollsafe.fleet import HealthSettings, RolloutFleet

    cfg = FleetConfig(
        model_path=tiny_model_dir,
        export_root=tmp_path / "exports",
        groups=[GroupSpec(ranks=4, ranks_per_node=2)],
        transport="nccl",
        health=HealthSettings(interval_s=0.2, timeout_s=2.0, failure_threshold=2),
        start_timeout_s=240.0,
    )
    one_node = EngineLauncher(EngineSpec(model_path=str(tiny_model_dir), ranks=4))
    with one_node:
        want_tokens = one_node.client.generate(PROMPT, sampling_params=GREEDY).output_ids
    with RolloutFleet(cfg) as fleet:
        group = fleet.engine("g0")
        assert isinstance(group, SlicedLauncher) and len(group.slices) == 2
        head, second = group.slices
        assert head.spec.node_rank == 0 and second.spec.node_rank == 1
        assert second.ready_info["ranks"] == [2, 3] and second.ready_info["url"] is None
        assert head.ready_info["remote_rank_pids"] == {
            "2": second.rank_pids[0],
            "3": second.rank_pids[1],
        }
        assert len(group.rank_pids) == 4
        out = fleet.generate(PROMPT, sampling_params=GREEDY)
        assert out.group_id == "g0" and out.result.output_ids == want_tokens

        gen = torch.Generator().manual_seed(7)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
        weights = {
            n: p.detach() + 0.01 * torch.randn(p.shape, generator=gen)
            for n, p in model.named_parameters()
        }
        report = fleet.sync_weights(weights, 1)
        assert report.ok and report.updated == ["g0"], report
        want = sglang_digests(weights, 4)["model"]  # its four ranks' shards
        assert fleet.checksums() == {"g0": want}

        done = len(fleet.recoveries())
        group.kill_slice(1)  # the second node's processes, as a lost node
        assert wait(lambda: not fleet.registry.get("g0").is_routable, 30)
        assert wait(
            lambda: len(fleet.recoveries()) > done and fleet.registry.get("g0").state == "active",
            240,
        ), fleet.snapshot()["recoveries"]
        assert fleet.recoveries()[-1].status == "active"
        assert group.is_alive() and len(group.rank_pids) == 4
        assert fleet.checksums() == {"g0": want}
        again = fleet.generate(PROMPT, sampling_params=GREEDY)
        assert again.result.weight_version == "1" and len(again.result.output_ids) == 6


def wait(predicate: Any, timeout: float) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return bool(predicate())
        time.sleep(0.1)
    return True


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--ranks", "4", "--nnodes", "3"], "--nnodes 3 must be >= 1 and divide --ranks 4"),
        (["--ranks", "4", "--nnodes", "2", "--node-rank", "2"], "--node-rank must be in 0..1"),
        (["--ranks", "4", "--nnodes", "2"], "needs --dist-init-addr"),
        (["--ranks", "2", "--nnodes", "2", "--dist-init-addr", "h"], "must be HOST:PORT"),
        (["--ranks", "2", "--nnodes", "2", "--dist-init-addr", "h:0"], "must be HOST:PORT"),
        (
            ["--ranks", "2", "--nnodes", "2", "--dist-init-addr", "10.1.2.3:4000"],
            "ROLLSAFE_DIST_INIT_KEY is not set",
        ),
    ],
)
def test_the_reference_engines_multi_node_flags_are_checked_before_anything_starts(
    argv: list[str],
    why: str,
    tiny_model_dir: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rollsafe.adapters.reference_engine.__main__ import check_args, parse_args

    monkeypatch.delenv("ROLLSAFE_DIST_INIT_KEY", raising=False)
    args = parse_args(["--model-path", str(tiny_model_dir), *argv])
    problem = check_args(args)
    assert problem is not None and why in problem
    monkeypatch.setenv("ROLLSAFE_DIST_INIT_KEY", "k")  # off loopback, a key makes it valid
    node = ["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.1.2.3:4000"]
    ok = parse_args(["--model-path", str(tiny_model_dir), "--ranks", "2", *node])
    assert check_args(ok) is None


def test_each_slice_starts_with_its_node_rank_the_heads_address_and_the_groups_key(
    tmp_path: Path,
) -> None:
    from rollsafe.adapters.engines.launch import spec as spec_module
    from rollsafe.adapters.engines.launch.spec import slice_spec
    from rollsafe.adapters.reference_engine import nodes

    assert spec_module.DIST_KEY_ENV == nodes.DIST_KEY_ENV  # one variable on both sides
    group = EngineSpec(model_path=str(tmp_path), ranks=4, ranks_per_node=2, warm_standby=True)
    with pytest.raises(InvalidArgument) as err:
        group.command()  # no head address yet: a slice is started from slice_spec
    assert err.value.key == "EngineSpec.dist_init_addr"
    head = slice_spec(group, 0, "127.0.0.1:4000", "k3y")
    second = slice_spec(group, 1, "127.0.0.1:4000", "k3y")
    tail = ["--nnodes", "2", "--node-rank", "0", "--dist-init-addr", "127.0.0.1:4000"]
    argv = head.command()
    at = argv.index("--nnodes")
    assert argv[at : at + len(tail)] == tail
    argv = second.command()
    assert argv[argv.index("--node-rank") + 1] == "1"
    assert head.warm_standby and not second.warm_standby  # a worker slice keeps none
    assert head.environment()["ROLLSAFE_DIST_INIT_KEY"] == "k3y"
    assert "k3y" in head.secrets() and "k3y" not in " ".join(head.command())
    with pytest.raises(InvalidArgument) as err:
        slice_spec(group, 2, "127.0.0.1:4000", "k3y")
    assert err.value.key == "EngineSpec.node_rank"


def test_a_slices_actor_made_beside_its_heads_takes_the_heads_address_before_it_starts(
    tmp_path: Path,
) -> None:
    """``RayEngineGroup`` creates every slice's actor at once (their starts overlap): a slice
    made without the head's address refuses to start until ``join_head`` gives it, then
    starts as one made with it; a head, or a slice already joined, refuses ``join_head``."""
    from rollsafe.adapters.engines.launch.spec import slice_spec
    from rollsafe.adapters.ray import EngineHost

    group = EngineSpec(model_path=str(tmp_path), ranks=4, ranks_per_node=2)
    second = EngineHost(group, node_slice=(1, "k3y", None))
    assert second.dist_init_addr() is None
    for start in (second.start, second.restart):
        with pytest.raises(RuntimeError, match="node slice 1 has no head address yet"):
            start()
    assert second.spec()["dist_init_addr"] is None  # nothing started
    second.join_head("127.0.0.1:4000")
    assert second.dist_init_addr() == "127.0.0.1:4000"
    want = slice_spec(group, 1, "127.0.0.1:4000", "k3y")
    got = second.spec()
    assert (got["node_rank"], got["env"], got["warm_standby"]) == (1, want.env, False)
    assert got["log_dir"] is not None  # the one log directory of both launchers
    with pytest.raises(RuntimeError, match="not a node slice waiting"):
        second.join_head("127.0.0.1:4001")
    # the directory made for the waiting slice is its launcher's: gone at its last stop
    assert Path(got["log_dir"]).is_dir()
    second.stop()
    assert not Path(got["log_dir"]).exists()
    head = EngineHost(group, node_slice=(0, "k3y", None))
    assert str(head.dist_init_addr()).startswith("127.0.0.1:")
    with pytest.raises(RuntimeError, match="not a node slice waiting"):
        head.join_head("127.0.0.1:4000")


# ------------------------------------------------------------------ rollsafe verify's model
def test_the_model_takes_a_group_out_whole_when_the_node_under_one_slice_dies() -> None:
    """``ModelConfig(slices=2)``: the node under a group's second slice dies (its ranks with
    it), the watcher's report takes the whole group out (``unplaced``) and leaves the other
    group serving; placing it again puts every slice on a live node."""
    from rollsafe.verify import Action, FleetModel, ModelConfig

    model = FleetModel(ModelConfig(groups=2, ranks=2, slices=2))
    for g in (0, 1):
        for r in (0, 1):
            assert model.apply(Action("launch", (g, r)))
    assert [g.state for g in model.groups] == ["active", "active"]
    assert model.apply(Action("slice_dies", (0, 1)))
    assert model.truth[0] == ((True, 0), (False, None))  # the head's slice still runs
    assert model.apply(Action("node_lost"))
    assert [g.state for g in model.groups] == ["unplaced", "active"]
    assert not model.groups[0].is_routable and model.picture().groups[0].lost_slices == (1,)
    assert model.check() == []
    assert model.apply(Action("place", (0,)))
    assert model.node_up[0] == (True, True) and model.picture().groups[0].lost_slices == ()
    assert model.groups[0].state == "recovering" and model.check() == []
    with pytest.raises(InvalidArgument) as err:
        ModelConfig(groups=1, ranks=3, slices=2)
    assert err.value.key == "slices"


def test_verify_explores_groups_over_two_nodes_without_a_violation() -> None:
    from rollsafe.verify import ModelConfig, explore

    result = explore(ModelConfig(groups=1, ranks=2, slices=2, removals=0), depth=6)
    assert result.ok, result.counterexamples[0].format()
    assert result.complete and result.states > 100


def test_a_node_loss_that_misses_a_groups_other_slices_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Planted: the membership takes out only the groups whose head slice is on the dead node
    (``groups_on`` reading one node per group): ``rollsafe verify`` finds a group routed with
    the node under its other slice reported dead."""
    import rollsafe.operations.place as place_op
    from rollsafe.verify import ModelConfig, explore

    def head_only(node: str, placements: Any) -> tuple[str, ...]:
        return tuple(gid for gid, nodes in placements.items() if nodes[0] == node)

    monkeypatch.setattr(place_op, "groups_on", head_only)
    result = explore(ModelConfig(groups=1, ranks=2, slices=2, removals=0), depth=5)
    assert not result.ok
    assert "no_routing_over_a_lost_slice" in result.counterexamples[0].format()


def test_a_placement_of_part_of_a_group_is_caught() -> None:
    """Planted: re-placement reserves only the lost slice's node back for the head, leaving
    the other on its dead node: ``placed_all_slices_or_none`` fails."""
    import rollsafe.operations.effects as fx
    from rollsafe.operations.effects import Ok
    from rollsafe.operations.executor import handles
    from rollsafe.verify import FleetModel, ModelConfig, explore

    class HeadOnly(FleetModel):
        @handles(fx.Place)
        def _place(self, effect: fx.Place) -> Any:
            g = self._index[effect.group]
            self.node_up[g] = (True, *self.node_up[g][1:])
            self.node_lost.discard(g)
            self.lost_slices[g] = ()
            self._audit_placement(g)
            return Ok(f"node-of-{effect.group}")

    result = explore(
        ModelConfig(groups=1, ranks=2, slices=2, removals=0), depth=5, model_factory=HeadOnly
    )
    assert not result.ok
    assert "placed_all_slices_or_none" in result.counterexamples[0].format()
