"""Ray integration: engine groups in Ray actors, placed on the nodes of a Ray cluster.

==========================================  ==================================================
module                                      owns
==========================================  ==================================================
:mod:`~rollsafe.adapters.ray.actor`         ``EngineHost`` / ``EngineActor``: one engine
                                            group's launcher inside a Ray actor; ``init_ray``
:mod:`~rollsafe.adapters.ray.placement`     one placement group per engine group (its ranks
                                            packed on one node, groups spread over nodes)
:mod:`~rollsafe.adapters.ray.group`         ``RayEngineGroup``: the fleet's handle of a
                                            Ray-placed group (a ``RestartableEngine``)
:mod:`~rollsafe.adapters.ray.local`         ``local_cluster``: a real multi-node Ray cluster
                                            on one machine (demo, benchmark, tests)
:mod:`~rollsafe.adapters.ray.nodes`         ``NodeWatcher``: nodes that died or joined, one
                                            ``ray.nodes()`` call per round for a fleet
:mod:`~rollsafe.adapters.ray.exports`       the shared-exports check: a probe file under
                                            ``export_root`` read back on every node
:mod:`~rollsafe.adapters.ray.session`       a local Ray this process started: SIGTERM kept
                                            in Python, ``stop_local_ray`` (every process of
                                            the session ended, by pid, before its files go)
==========================================  ==================================================

Nothing here imports Ray until it is used (``init_ray()``, ``EngineActor``, a placement or a
group's start), so ``import rollsafe.adapters.ray`` works without Ray installed.
``docs/cluster.md`` has the design.
"""

from __future__ import annotations

from typing import Any

from rollsafe.adapters.ray.actor import EngineHost, driver_node_ip, engine_actor, init_ray
from rollsafe.adapters.ray.exports import (
    SharedExportsCheck,
    SharedExportUnreadable,
    check_shared_exports,
)
from rollsafe.adapters.ray.group import RayEngineGroup, ray_engine_factory
from rollsafe.adapters.ray.nodes import NodeEvent, NodeInfo, NodeWatcher
from rollsafe.adapters.ray.placement import GroupPlacer, Placement, PlacementUnavailable
from rollsafe.adapters.ray.session import RayStopReport, sigterm_back_to_python, stop_local_ray

# EngineActor is provided lazily by the module-level __getattr__ below.
__all__ = [
    "EngineActor",
    "EngineHost",
    "GroupPlacer",
    "NodeEvent",
    "NodeInfo",
    "NodeWatcher",
    "Placement",
    "PlacementUnavailable",
    "RayEngineGroup",
    "RayStopReport",
    "SharedExportUnreadable",
    "SharedExportsCheck",
    "check_shared_exports",
    "driver_node_ip",
    "engine_actor",
    "init_ray",
    "ray_engine_factory",
    "sigterm_back_to_python",
    "stop_local_ray",
]


def __getattr__(name: str) -> Any:
    # ``EngineActor`` is built on first access so that importing this package does not import Ray
    if name == "EngineActor":
        from rollsafe.adapters.ray import actor

        return actor.EngineActor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
