"""Groups that span nodes on a real multi-node Ray cluster on this machine (issue #37 item 1).

A head node (no ``rollout`` room) and three worker nodes (``rollout: 2`` each), the driver
joined through ``RAY_ADDRESS``, one cluster for the module:

* ``GroupPlacer.place(slices=2)``: one ``STRICT_SPREAD`` placement group whose bundles are the
  slices, each on its own node; a group Ray cannot hold whole (more slices than nodes with room)
  is refused and nothing stays reserved (all slices or none).

Needs Ray (skipped without it, failed under ``CI=true``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from ray_cluster import local_cluster, require_ray

ray = require_ray()
pytestmark = pytest.mark.ray_cluster

from rollsafe.adapters.ray import GroupPlacer, PlacementUnavailable, init_ray  # noqa: E402

#: each worker node offers room for this many engine ranks
ROOM = 2


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
