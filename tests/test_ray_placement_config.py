"""``FleetConfig(placement=..., ray=RaySettings(...))`` and ``GroupPlacer``: bad input is refused
before anything starts, naming the key (no Ray needed: nothing here imports it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_helpers import tiny_model_dir  # noqa: F401  (fixture)

from rollsafe.errors import InvalidArgument
from rollsafe.fleet import FleetConfig, FleetConfigError, RaySettings


def config(tmp_path: Path, **kw: Any) -> FleetConfig:
    return FleetConfig(model_path=tmp_path, export_root=tmp_path / "exports", **kw)


def test_placement_defaults_to_local_and_ray_needs_a_transport_that_crosses_nodes(
    tmp_path: Path,
) -> None:
    assert config(tmp_path).placement == "local"
    assert config(tmp_path, placement="ray", transport="nccl").ray == RaySettings()
    with pytest.raises(FleetConfigError) as err:
        config(tmp_path, placement="ray")  # the default transport is ipc
    assert err.value.key == "transport" and "'ipc'" in str(err.value)
    with pytest.raises(FleetConfigError) as err:
        config(tmp_path, placement="cloud", transport="nccl")
    assert err.value.key == "placement" and "'cloud'" in str(err.value)
    with pytest.raises(FleetConfigError) as err:
        config(tmp_path, ray={"spread": True})
    assert err.value.key == "ray"


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        ({"resources_per_rank": {}}, "ray.resources_per_rank"),
        ({"resources_per_rank": {"CPU": 0}}, "ray.resources_per_rank"),
        ({"resources_per_rank": {"CPU": -1}}, "ray.resources_per_rank['CPU']"),
        ({"resources_per_rank": {"GPU": "1"}}, "ray.resources_per_rank['GPU']"),
        ({"placement_timeout_s": 0}, "ray.placement_timeout_s"),
        ({"spread": "yes"}, "ray.spread"),
        ({"bind_node_ip": 1}, "ray.bind_node_ip"),
        ({"address": ""}, "ray.address"),
    ],
)
def test_bad_ray_settings_name_the_field(kw: dict[str, Any], key: str) -> None:
    with pytest.raises(FleetConfigError) as err:
        RaySettings(**kw)
    assert err.value.key == key


@pytest.mark.parametrize(
    ("args", "kw", "key"),
    [
        (({"CPU": -1.0},), {}, "resources_per_rank['CPU']"),
        (({"CPU": 0.0},), {}, "resources_per_rank"),
        ((), {"timeout_s": 0.0}, "timeout_s"),
    ],
)
def test_the_placer_refuses_bad_resources(
    args: tuple[Any, ...], kw: dict[str, Any], key: str
) -> None:
    from rollsafe.adapters.ray import GroupPlacer

    with pytest.raises(InvalidArgument) as err:
        GroupPlacer(*args, **kw)
    assert err.value.key == key


def test_a_group_of_n_ranks_reserves_n_bundles() -> None:
    from rollsafe.adapters.ray import GroupPlacer

    placer = GroupPlacer({"GPU": 1, "CPU": 2})
    assert placer.bundles(3) == [{"GPU": 1.0, "CPU": 2.0}] * 3
    assert placer.nodes() == {}


def test_disk_with_ray_needs_an_export_root_declared_shared(tmp_path: Path) -> None:
    with pytest.raises(FleetConfigError) as err:
        config(tmp_path, placement="ray", transport="disk")
    assert err.value.key == "transport" and "shared_exports" in str(err.value)
    cfg = config(tmp_path, placement="ray", transport="disk", ray=RaySettings(shared_exports=True))
    assert cfg.ray.shared_exports
    assert config(tmp_path, transport="disk").placement == "local"  # one machine: allowed
    with pytest.raises(FleetConfigError) as err:
        RaySettings(shared_exports="yes")  # type: ignore[arg-type]
    assert err.value.key == "ray.shared_exports"


def test_the_nccl_master_address_defaults_to_none_and_a_given_one_is_kept() -> None:
    from rollsafe.fleet import NcclSettings
    from rollsafe.fleet.settings import TransportContext

    assert NcclSettings().master_address is None
    assert NcclSettings().build(TransportContext(world_size=1)).master_address == "127.0.0.1"
    given = NcclSettings(master_address="10.1.2.3").build(TransportContext(world_size=1))
    assert given.master_address == "10.1.2.3"  # type: ignore[attr-defined]
    for bad in ("", "  ", 7):
        with pytest.raises(FleetConfigError) as err:
            NcclSettings(master_address=bad)  # type: ignore[arg-type]
        assert err.value.key == "nccl.master_address"


def test_ipc_and_disk_follow_each_groups_topology_naming_the_group(tmp_path: Path) -> None:
    from rollsafe.fleet import GroupSpec

    two = [GroupSpec(1), GroupSpec(1)]
    pinned = RaySettings(trainer_node_groups=("g0", "g1"))
    # every group on the trainer's node: its memory (ipc) and its path (disk) are reachable
    assert config(tmp_path, placement="ray", groups=two, ray=pinned).transport == "ipc"
    cfg = config(tmp_path, placement="ray", transport="disk", groups=two, ray=pinned)
    assert not cfg.ray.shared_exports
    half = RaySettings(trainer_node_groups=("g0",))
    for transport in ("ipc", "disk"):
        with pytest.raises(FleetConfigError) as err:
            config(tmp_path, placement="ray", transport=transport, groups=two, ray=half)
        text = str(err.value)
        assert err.value.key == "transport" and "group 'g1'" in text and "g0" not in text
        assert "any node" in text and "trainer_node_groups" in text
    # a shared export_root serves disk wherever the groups are; ipc still needs the node
    shared = RaySettings(trainer_node_groups=("g0",), shared_exports=True)
    assert config(tmp_path, placement="ray", transport="disk", groups=two, ray=shared)
    with pytest.raises(FleetConfigError, match="group 'g1'"):
        config(tmp_path, placement="ray", transport="ipc", groups=two, ray=shared)
    for bad in ("g0", ("",), (1,)):
        with pytest.raises(FleetConfigError) as err:
            RaySettings(trainer_node_groups=bad)  # type: ignore[arg-type]
        assert err.value.key == "ray.trainer_node_groups"
    with pytest.raises(FleetConfigError) as err:
        RaySettings(moved_exports_dir="relative/dir")
    assert err.value.key == "ray.moved_exports_dir"


def test_checkpoint_engine_follows_ray_placement_only_on_the_trainers_node() -> None:
    from rollsafe.fleet.settings import topology_fallback, topology_refusal

    kw: dict[str, Any] = {"placement": "ray", "group_ids": ["g0", "g1"]}
    why = topology_fallback("checkpoint_engine", ray=RaySettings(), **kw)
    assert why is not None and "['g0', 'g1']" in why and "colocated" in why
    one = topology_fallback("checkpoint_engine", ray=RaySettings(trainer_node_groups=("g0",)), **kw)
    assert one is not None and "['g1']" in one
    all_pinned = RaySettings(trainer_node_groups=("g0", "g1"))
    assert topology_fallback("checkpoint_engine", ray=all_pinned, **kw) is None
    assert (
        topology_fallback(
            "checkpoint_engine", ray=RaySettings(), placement="local", group_ids=["g0"]
        )
        is None
    )
    assert topology_refusal("checkpoint_engine", ray=RaySettings(), **kw) is None  # falls back
    assert topology_refusal("nccl", ray=RaySettings(), **kw) is None  # reaches every node


def test_a_ray_fleet_with_checkpoint_engine_falls_back_naming_the_topology(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The reason reaches the fleet's fallback (built without starting Ray or engines)."""
    from rollsafe.fleet import GroupSpec

    cfg = FleetConfig(
        model_path=tiny_model_dir,
        export_root=tmp_path / "exports",
        groups=[GroupSpec(1)],
        transport="checkpoint_engine",
        placement="ray",
    )
    from rollsafe.fleet.control_plane import build_transport
    from rollsafe.hf import HFExporter

    exporter = HFExporter(tmp_path / "exports", template_dir=tiny_model_dir)
    transport, fallback = build_transport(cfg, cfg.validate(), 1, exporter)
    try:
        assert transport.name == "nccl"
        assert fallback is not None and "placement='ray' groups ['g0']" in fallback
    finally:
        transport.close()
