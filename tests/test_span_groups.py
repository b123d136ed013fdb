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
