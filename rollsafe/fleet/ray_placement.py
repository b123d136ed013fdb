"""The fleet's groups placed by Ray (``FleetConfig(placement="ray")``, ``docs/cluster.md``).

:class:`RayPlacement` is the Ray side of the :class:`~rollsafe.fleet.placement.Placement` port:
it joins Ray (``RAY_ADDRESS`` or ``ray.address``; a new local Ray otherwise), points the
weight-update store at the driver node's IP, checks a ``ray.shared_exports`` export root on
every node, places each group in its own placement group (``GroupPlacer``: one
``STRICT_PACK`` group per engine group, groups spread), pins the groups named in
``ray.trainer_node_groups`` to the trainer's node, gives engines bound to a node's IP the
fleet's API key, moves exports to a recovering group's node when the nodes share no storage
(``ExportMover``), and watches the nodes (``NodeWatcher``): a dead node's groups leave routing
at once, a joining node is checked (shared exports) and offered the waiting groups.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
from typing import TYPE_CHECKING, Any

import rollsafe.policy as policy
from rollsafe.fleet.config import FleetConfig, LauncherFactory

if TYPE_CHECKING:
    from collections.abc import Callable

    from rollsafe.adapters.engines import EngineSpec
    from rollsafe.adapters.ray import GroupPlacer, NodeWatcher, SharedExportsCheck
    from rollsafe.adapters.ray.exports import ExportMover
    from rollsafe.fleet.placement import NodeEvents, PlacementContext
    from rollsafe.fleet.recovery import ExportMoverLike
    from rollsafe.ports import LaunchableEngine

__all__ = ["RayPlacement"]

log = logging.getLogger(__name__)


class RayPlacement:
    """Groups placed by Ray (see the module). Public state for inspection and tests:
    ``placer``, ``node_watcher``, ``shared_exports`` (the passed start check),
    ``unreadable_nodes`` (nodes that joined and could not read the shared export root) and
    ``shared_check`` (the check run on a joining node)."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        #: the API key of engines bound to their node's IP when the engine spec names none
        #: (one per fleet)
        self.api_key = secrets.token_urlsafe(32)
        self.placer: GroupPlacer | None = None
        self.node_watcher: NodeWatcher | None = None
        self.shared_exports: SharedExportsCheck | None = None
        self.unreadable_nodes: dict[str, str] = {}
        #: the shared check run on a node that joins (``check_shared_exports``; tests wrap it)
        self.shared_check: Callable[..., Any] | None = None
        self._mover: ExportMover | None = None
        self._node_events: NodeEvents | None = None
        self._lock = threading.Lock()

    @property
    def kind(self) -> str:
        return "ray"

    # ------------------------------------------------------------------ before the groups
    def prepare(self, context: PlacementContext) -> LauncherFactory:
        from rollsafe.adapters.ray import GroupPlacer, init_ray, ray_engine_factory
        from rollsafe.adapters.ray.placement import ray_node_id

        settings = self.config.ray
        init_ray(**({"address": settings.address} if settings.address else {}))
        self._prepare_cluster(context)
        self.placer = GroupPlacer(
            settings.resources_per_rank,
            timeout_s=settings.placement_timeout_s,
            spread=settings.spread,
            name_prefix=f"rollsafe-{os.getpid()}-{id(self):x}",
        )
        self.placer.apart = context.apart  # spares off the nodes of the groups they cover
        self._move_exports(context)
        factory = ray_engine_factory(
            self.placer,
            start_timeout_s=self.config.start_timeout_s,
            bind_node_ip=settings.bind_node_ip,
        )
        if not settings.trainer_node_groups:
            return factory
        pinned = set(settings.trainer_node_groups)
        trainer_node = str(ray_node_id())

        def pinning(group_id: str, spec: EngineSpec) -> LaunchableEngine:
            group = factory(group_id, spec)
            if group_id in pinned:  # placed on the trainer's node only (docs/cluster.md, 6)
                group.pin_node = trainer_node
            return group

        return pinning

    def _prepare_cluster(self, context: PlacementContext) -> None:
        """Once Ray is joined and before any group is placed: the weight-update store on the
        driver's node IP (unless ``nccl.master_address`` was set), and the check of a
        ``ray.shared_exports`` export_root on every alive node
        (:class:`~rollsafe.adapters.ray.SharedExportUnreadable` fails the start)."""
        from rollsafe.adapters.ray import check_shared_exports, driver_node_ip
        from rollsafe.transports import NCCLTransport

        cfg = self.config
        transport = context.transport
        if cfg.nccl.master_address is None and isinstance(transport, NCCLTransport):
            transport.master_address = driver_node_ip()
        if cfg.ray.shared_exports:
            if self.shared_check is None:
                self.shared_check = check_shared_exports
            assert cfg.export_root is not None  # the config checked it
            self.shared_exports = check_shared_exports(
                cfg.export_root, timeout_s=cfg.ray.placement_timeout_s
            )
            log.info(
                "export_root %s read back on %d Ray node(s) in %.2f s",
                cfg.export_root,
                len(self.shared_exports.nodes),
                self.shared_exports.seconds,
            )

    def _move_exports(self, context: PlacementContext) -> None:
        """Without shared exports: a recovery that restarts a group from the current export
        moves it to the group's node first (``ExportMover``: published once per version,
        dropped when the export is no longer ready; docs/cluster.md section 5)."""
        cfg = self.config
        access = policy.export_access(placement=cfg.placement, shared=cfg.ray.shared_exports)
        if access is not policy.ExportAccess.MOVED or context.exporter is None:
            return
        from rollsafe.adapters.ray.exports import ExportMover

        exporter = context.exporter
        self._mover = ExportMover(
            context.handle_for,
            keep=lambda v: exporter.latest_ready(v) is not None,
            dest_root=cfg.ray.moved_exports_dir,
            fleet=f"{os.getpid()}-{id(self):x}",
        )

    def spec(self, spec: EngineSpec) -> EngineSpec:
        """Engines on a node's IP are reachable from the network: never without a key."""
        if self.config.ray.bind_node_ip and spec.api_key is None:
            return dataclasses.replace(spec, api_key=self.api_key)
        return spec

    @property
    def export_mover(self) -> ExportMoverLike | None:
        return self._mover

    # ------------------------------------------------------------------ nodes
    def watch(self, events: NodeEvents) -> None:
        """One ``NodeWatcher`` for the fleet: a dead node's groups go through
        ``events.node_lost``; a joining node is checked, then offered the waiting groups."""
        if self.placer is None:
            return
        from rollsafe.adapters.ray import NodeWatcher

        self._node_events = events

        def on_events(found: list[Any]) -> None:
            for event in found:
                if event.kind == "dead":
                    events.node_lost(event.node_id, reason="Ray reports the node dead")
            joined = [event.node_id for event in found if event.kind == "joined"]
            if joined and self.config.ray.shared_exports:
                # the check reads a file on the node (up to placement_timeout_s): off the
                # watcher's thread, and before the waiting groups are offered the node
                threading.Thread(
                    target=self.nodes_joined,
                    args=(joined,),
                    name="rollsafe-shared-check",
                    daemon=True,
                ).start()
            elif joined:
                events.place_waiting(reason="a node joined")

        self.node_watcher = NodeWatcher(on_events, interval_s=self.config.ray.node_watch_interval_s)
        self.node_watcher.start()

    def nodes_joined(self, node_ids: list[str]) -> dict[str, str]:
        """Nodes joined the cluster: with ``ray.shared_exports`` each is checked
        (``check_shared_exports(export_root, nodes=[id])``); one that cannot read the probe is
        recorded (``snapshot()["placement"]["unreadable_nodes"]``, a warning naming the node
        and the path) and no group is placed on it (``GroupPlacer.exclude``). Then the waiting
        groups are offered the room. Returns the nodes found unreadable now."""
        from rollsafe.adapters.ray import SharedExportUnreadable

        cfg = self.config
        check = self.shared_check
        found: dict[str, str] = {}
        if cfg.ray.shared_exports and check is not None:
            for node_id in node_ids:
                try:
                    check(cfg.export_root, nodes=[node_id], timeout_s=cfg.ray.placement_timeout_s)
                except SharedExportUnreadable as exc:
                    why = exc.failures.get(node_id, str(exc))
                    found[node_id] = f"{exc.path}: {why}"
                except Exception as exc:  # the check itself failed: not known to read it
                    found[node_id] = f"{cfg.export_root}: {type(exc).__name__}: {exc}"
            for node_id, why in found.items():
                log.warning(
                    "Ray node %s joined but cannot read the shared export_root (%s); "
                    "no group is placed on it",
                    node_id,
                    why,
                )
                with self._lock:
                    self.unreadable_nodes[node_id] = why
                if self.placer is not None:
                    self.placer.exclude(node_id, f"cannot read the shared export_root: {why}")
        if self._node_events is not None:
            self._node_events.place_waiting(reason="a node joined")
        return found

    # ------------------------------------------------------------------ the rest
    def after_sync(self) -> None:
        if self._mover is not None:  # a retired export's published parcel is dropped
            try:
                self._mover.prune()
            except Exception:
                log.exception("pruning moved exports failed")

    def export_access(self) -> str:
        """``shared`` (checked at start), ``moved`` (recoveries move the export to the group's
        node) or ``local``."""
        if self.shared_exports is not None:
            return "shared"
        return "moved" if self._mover is not None else "local"

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            unreadable = dict(self.unreadable_nodes)
        return {
            "kind": "ray",
            "exports": self.export_access(),
            "moved": self._mover.stats() if self._mover is not None else None,
            "unreadable_nodes": unreadable,
            "nodes": self.placer.nodes() if self.placer is not None else {},
            "watcher": self.node_watcher.stats() if self.node_watcher is not None else None,
        }

    def close(self, timeout: float) -> None:
        if self.node_watcher is not None:
            try:
                self.node_watcher.stop(timeout=timeout)
            except Exception:
                log.exception("stopping the node watcher failed")
