"""Where a fleet's engine groups run, behind one port: :class:`Placement`.

The fleet asks its placement for four things and nothing else: a launcher factory (made once
the transport and the exporter exist: a Ray placement joins the cluster and checks its nodes
first), each group's spec as the placement needs it (an API key for engines bound to a node's
IP), whether a recovery must move an export to the group's node (an export mover), and a
watch on the nodes (a lost node's groups leave routing at once, a joining node takes the
waiting ones). :class:`LocalPlacement` runs every group on this machine (``EngineLauncher``, or
``FleetConfig.launcher_factory``); :class:`~rollsafe.fleet.ray_placement.RayPlacement` places
each group with Ray (``FleetConfig(placement="ray")``, ``docs/cluster.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rollsafe.fleet.config import LauncherFactory

if TYPE_CHECKING:
    from rollsafe.adapters.engines import EngineLauncher, EngineSpec
    from rollsafe.adapters.engines.sliced import SlicedLauncher
    from rollsafe.fleet.recovery import ExportMoverLike
    from rollsafe.ports import LaunchableEngine, WeightTransport

__all__ = ["LocalPlacement", "NodeEvents", "Placement", "PlacementContext"]


@dataclass(frozen=True)
class PlacementContext:
    """What a placement is prepared with: the fleet's ``transport`` (a Ray placement points
    its weight-update store at the driver node's IP), the ``exporter`` (what a moved export
    is pulled from, while the export is ``ready``), ``handle_for(group_id)`` (the group's
    handle, for the export mover) and ``apart(group_id)`` (the groups it should not share a
    node with where it can: a spare and the serving groups it covers)."""

    transport: WeightTransport | None
    exporter: Any
    handle_for: Callable[[str], LaunchableEngine]
    apart: Callable[[str], Collection[str]] | None = None


class NodeEvents(Protocol):
    """What a placement tells the fleet about its nodes (the fleet's membership has it)."""

    def node_lost(self, node_id: str, *, reason: str = "") -> list[str]: ...

    def place_waiting(self, reason: str = ...) -> list[str]: ...


class Placement(Protocol):
    """Where the fleet's groups run (see the module)."""

    @property
    def kind(self) -> str:
        """``local`` or ``ray`` (``snapshot()["placement"]["kind"]``)."""

    def prepare(self, context: PlacementContext) -> LauncherFactory:
        """Get ready to place groups; return the factory that makes each group's handle."""

    def spec(self, spec: EngineSpec) -> EngineSpec:
        """``spec`` as this placement starts it."""

    @property
    def export_mover(self) -> ExportMoverLike | None:
        """What moves an export to a recovering group's node (None: nodes read the path)."""

    def watch(self, events: NodeEvents) -> None:
        """Start telling ``events`` of nodes lost and joined (no-op without nodes)."""

    def after_sync(self) -> None:
        """A sync ended: drop what no longer needs keeping (a moved export that is no longer
        ``ready``)."""

    def snapshot(self) -> dict[str, Any]:
        """``RolloutFleet.snapshot()["placement"]`` (JSON-friendly)."""

    def close(self, timeout: float) -> None:
        """Stop watching; placements of groups are given back by their handles."""


def _default_launcher(group_id: str, spec: EngineSpec) -> EngineLauncher | SlicedLauncher:
    from rollsafe.adapters.engines.sliced import launcher_for

    return launcher_for(spec)


class LocalPlacement:
    """Every group on this machine: an ``EngineLauncher`` each (children of this process; a
    group that spans nodes: a ``SlicedLauncher``, its slices as virtual nodes on loopback), or
    the handles ``factory`` makes (``FleetConfig.launcher_factory``)."""

    def __init__(self, factory: LauncherFactory | None = None) -> None:
        self._factory: LauncherFactory = factory or _default_launcher

    @property
    def kind(self) -> str:
        return "local"

    def prepare(self, context: PlacementContext) -> LauncherFactory:
        return self._factory

    def spec(self, spec: EngineSpec) -> EngineSpec:
        return spec

    @property
    def export_mover(self) -> ExportMoverLike | None:
        return None

    def watch(self, events: NodeEvents) -> None:
        return None

    def after_sync(self) -> None:
        return None

    def snapshot(self) -> dict[str, Any]:
        return {
            "kind": "local",
            "exports": "local",
            "moved": None,
            "unreadable_nodes": {},
            "nodes": {},
            "watcher": None,
        }

    def close(self, timeout: float) -> None:
        return None
