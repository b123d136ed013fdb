"""The fleet's membership at runtime: a node's loss, a group added, a group removed.

Owns the executor of :mod:`rollsafe.operations.place` on a live fleet (the verifier is its
other executor) and the bookkeeping around it: which nodes were lost, which groups were added
and removed, and the hand-over to the :class:`~rollsafe.fleet.recovery.RecoveryCoordinator`,
which places an ``unplaced`` group again and brings an added group to the fleet's version
(``docs/cluster.md``, sections 4 and 7). It is handed what it works on explicitly: the
registry, the :class:`~rollsafe.fleet.engines.EngineGroups`, the recovery coordinator and the
config; it holds no fleet.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from typing import Any

import rollsafe.operations.effects as fx
import rollsafe.policy as policy
from rollsafe.errors import InvalidArgument
from rollsafe.fleet.config import FleetConfig, GroupSpec
from rollsafe.fleet.engines import EngineEffects, EngineGroups
from rollsafe.fleet.recovery import RecoveryCoordinator
from rollsafe.fleet.settings import topology_refusal
from rollsafe.fleet.steps import StepLog
from rollsafe.operations import place as place_op
from rollsafe.operations.effects import drive
from rollsafe.operations.executor import Executor, handles
from rollsafe.operations.place import RemovalEnd
from rollsafe.registry import FleetError, FleetRegistry, RegistryEffects

__all__ = ["Membership"]

log = logging.getLogger(__name__)

#: membership steps kept for the fleet's snapshot
_STEPS_KEPT = 64


class Membership(Executor):
    """Node loss, ``add_group`` and ``remove_group`` for one fleet.

    The registry's effects are the registry's handlers, the engines' (stop, release) the
    :class:`~rollsafe.fleet.engines.EngineEffects`', a step's record the membership's
    :class:`~rollsafe.fleet.steps.StepLog` (kept for the snapshot); waiting for a drained
    group's requests is its own. Thread-safe: one membership change at a time (a node loss
    waits for a removal in progress, and the other way round); requests, probes, syncs and
    recoveries go on."""

    parts = {RegistryEffects: "registry_effects", EngineEffects: "engine_effects", StepLog: "log"}

    def __init__(
        self,
        config: FleetConfig,
        registry: FleetRegistry,
        engines: EngineGroups,
        recovery: RecoveryCoordinator,
    ) -> None:
        self.config = config
        self.registry = registry
        self.engines = engines
        self.recovery = recovery
        self.registry_effects = RegistryEffects(registry)
        self.engine_effects = EngineEffects(
            engines.handle, stop_timeout_s=config.recovery.stop_timeout_s
        )
        self.log = StepLog(label="membership ", keep=_STEPS_KEPT, log_steps=True)
        self._lock = threading.RLock()
        self._drain_timeout_s = 30.0
        #: node id -> when the fleet was told it died (first report wins)
        self.lost_nodes: dict[str, float] = {}
        self.removed: list[str] = []
        self.added: list[str] = []

    # ------------------------------------------------------------------ node loss
    def node_lost(self, node_id: str, *, reason: str = "") -> list[str]:
        """Node ``node_id`` died: every group placed on it leaves routing in one registry
        step (``unplaced``), then each is handed to recovery to be placed again. Idempotent
        (a second report of the same node finds no group left on it). Returns the groups
        now ``unplaced``."""
        with self._lock:
            self.lost_nodes.setdefault(node_id, time.time())
            groups = tuple(self.engines.groups_on(node_id))
            if not groups:
                return []
            lost = drive(place_op.node_lost(groups), self.perform)
        why = f"node {node_id[:12]} lost" + (f": {reason}" if reason else "")
        log.warning("%s: groups %s out of routing, to be placed again", why, list(lost))
        recovery = self.recovery
        for gid in lost:
            with contextlib.suppress(FleetError):  # closed: nothing to place any more
                running = recovery.in_progress(gid)
                future = recovery.submit(gid, reason=why)
                if running:  # an attempt from before the loss: place the group once it ends
                    future.add_done_callback(functools.partial(self._place_if_waiting, gid, why))
        return list(lost)

    def _place_if_waiting(self, group_id: str, why: str, _done: object = None) -> None:
        with contextlib.suppress(FleetError):
            if self.registry.get(group_id).state == "unplaced":
                self.recovery.submit(group_id, reason=why)

    def place_waiting(self, reason: str = "room may have freed") -> list[str]:
        """Hand every ``unplaced`` group not already in recovery to the recovery (a node
        joined, or a removal gave a placement back). Returns their ids."""
        submitted = []
        for group in self.registry.groups():
            if group.state == "unplaced" and not self.recovery.in_progress(group.group_id):
                with contextlib.suppress(FleetError):
                    self.recovery.submit(group.group_id, reason=reason)
                    submitted.append(group.group_id)
        return submitted

    # ------------------------------------------------------------------ add
    def add_group(self, spec: GroupSpec) -> str:
        """Start a new group from ``spec`` and register it; it is routed only once it holds
        the fleet's version (``pending_weights`` until a targeted push, or the next sync,
        brings it there). Returns its id. Refusals change nothing: a duplicate id
        (``spec.group_id``), too few spare fleet ranks (``FleetConfig.spare_ranks``), a
        transport that cannot reach it, a start that fails (its placement given back)."""
        cfg = self.config
        with self._lock:
            plan = self.engines.plan(spec)
            refused = topology_refusal(
                cfg.settings_for().transport,
                placement=cfg.placement,
                ray=cfg.ray,
                group_ids=[plan.group_id],
            )
            if refused is not None:  # the transport cannot reach it where Ray may place it
                self.engines.give_back(plan)
                raise InvalidArgument("spec.group_id", refused[1])
        handle = self.engines.start_one(plan)
        gid = plan.group_id
        version = self.registry.fleet_version
        with self._lock:
            self.added.append(gid)
        self.registry.add_group(
            gid,
            plan.fleet_ranks,
            clients=[handle.client],
            restart_budget=cfg.recovery.restart_budget,
            metadata={"engine_ranks": plan.ranks, "added_at_runtime": True},
            standby_probe=handle.standby_status,
        )
        for rank in plan.fleet_ranks:
            self.registry.report_member(
                gid, rank, healthy=True, weights_version=cfg.initial_version
            )
        recorded = {r: m.healthy for r, m in self.registry.get(gid).machine.members.items()}
        for event in policy.launch_events(recorded):
            self.registry.send(gid, event, decided_by="launch_events")
        state = self.registry.get(gid).state
        log.info(
            "group %s added on fleet ranks %s: %s at v%d",
            gid,
            list(plan.fleet_ranks),
            state,
            version,
        )
        if state == "pending_weights":
            self.recovery.submit(gid, reason=f"added behind v{version}", catch_up=True)
        return gid

    # ------------------------------------------------------------------ remove
    def remove_group(self, group_id: str, *, drain_timeout_s: float = 30.0) -> RemovalEnd:
        """Drain ``group_id`` (out of routing: no new requests), wait up to
        ``drain_timeout_s`` for its in-flight requests and any recovery of it to end (what is
        still running is cut and continues on other groups), stop its engine, give its
        placement back and retire it. A removed group never comes back; its fleet ranks are
        not reused. Waiting ``unplaced`` groups are then offered the room."""
        if drain_timeout_s < 0:
            raise InvalidArgument("drain_timeout_s", f"must be >= 0, got {drain_timeout_s}")
        self.registry.get(group_id)  # UnknownGroup, early and loud
        with self._lock:
            self._drain_timeout_s = drain_timeout_s
            end = drive(place_op.remove(group_id), self.perform)
            if end.status == "retired":
                self.removed.append(group_id)
        log.info("remove_group(%s): %s (%s)", group_id, end.status, end.reason)
        if end.status == "retired":
            self.place_waiting(reason=f"{group_id} removed")
        return end

    @handles(fx.AwaitDrained)
    def await_drained(self, effect: fx.AwaitDrained) -> fx.Outcome[int]:
        """Wait (up to the removal's drain bound) for the group's requests and any recovery
        of it to end: the requests still running."""
        group = self.registry.get(effect.group)
        deadline = time.monotonic() + self._drain_timeout_s
        done = threading.Event()

        def busy() -> bool:
            return group.outstanding > 0 or self.recovery.in_progress(effect.group)

        while busy() and time.monotonic() < deadline:
            done.wait(0.05)
        return fx.Ok(group.outstanding)

    def snapshot(self) -> dict[str, Any]:
        """What changed the fleet's membership so far (for ``RolloutFleet.snapshot``)."""
        with self._lock:
            return {
                "lost_nodes": sorted(self.lost_nodes),
                "added": list(self.added),
                "removed": list(self.removed),
                **self.engines.snapshot(),
                "steps": [s.as_dict() for s in self.log.steps],
            }
