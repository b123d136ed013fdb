"""``FleetConfig(placement=..., ray=RaySettings(...))`` and ``GroupPlacer``: bad input is refused
before anything starts, naming the key (no Ray needed: nothing here imports it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

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
