"""The fleet's membership at runtime: a node's loss, a group added, a group removed.

Owns the executor of :mod:`rollsafe.operations.place` on a live :class:`RolloutFleet` (the
verifier is its other executor) and the fleet-side bookkeeping around it: which groups a dead
node held, the fleet ranks kept for groups added at runtime (``FleetConfig.spare_ranks``),
and the hand-over to the :class:`~rollsafe.fleet.RecoveryCoordinator`, which places an
``unplaced`` group again and brings an added group to the fleet's version
(``docs/cluster.md``, sections 4 and 7).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import rollsafe.operations.effects as fx
import rollsafe.policy as policy
from rollsafe.errors import InvalidArgument
from rollsafe.fleet.registry import FleetError, UnknownGroup
from rollsafe.fleet.settings import topology_refusal
from rollsafe.operations import place as place_op
from rollsafe.operations.effects import drive
from rollsafe.operations.place import RemovalEnd
from rollsafe.ports import PlaceableEngine
from rollsafe.statemachines.base import TransitionRefused

if TYPE_CHECKING:
    from rollsafe.fleet.fleet import GroupSpec, RolloutFleet

__all__ = ["Membership"]

log = logging.getLogger(__name__)

_OK = fx.Ok()


class Membership:
    """Node loss, ``add_group`` and ``remove_group`` for one fleet (its ``membership``).

    Thread-safe: one membership change at a time (a node loss waits for a removal in
    progress, and the other way round); requests, probes, syncs and recoveries go on."""

    def __init__(self, fleet: RolloutFleet) -> None:
        self.fleet = fleet
        self._lock = threading.RLock()
        cfg = fleet.config
        used = {r for g in fleet._groups for r in g.fleet_ranks}
        #: fleet ranks no group holds, kept for groups added at runtime
        self._free_ranks = [r for r in range(fleet.world_size) if r not in used]
        #: node id -> when the fleet was told it died (first report wins)
        self.lost_nodes: dict[str, float] = {}
        self.removed: list[str] = []
        self.added: list[str] = []
        self._next_index = len(cfg.groups)

    # ------------------------------------------------------------------ node loss
    def groups_on(self, node_id: str) -> list[str]:
        """The groups whose current placement is on ``node_id``."""
        fleet = self.fleet
        return [
            gid
            for gid, handle in list(fleet._launchers.items())
            if isinstance(handle, PlaceableEngine) and handle.node_id == node_id
        ]

    def node_lost(self, node_id: str, *, reason: str = "") -> list[str]:
        """Node ``node_id`` died: every group placed on it leaves routing in one registry
        step (``unplaced``), then each is handed to recovery to be placed again. Idempotent
        (a second report of the same node finds no group left on it). Returns the groups
        now ``unplaced``."""
        with self._lock:
            self.lost_nodes.setdefault(node_id, time.time())
            groups = tuple(self.groups_on(node_id))
            if not groups:
                return []
            lost = drive(place_op.node_lost(groups), self._perform)
        why = f"node {node_id[:12]} lost" + (f": {reason}" if reason else "")
        log.warning("%s: groups %s out of routing, to be placed again", why, list(lost))
        recovery = self.fleet.recovery
        for gid in lost:
            if recovery is None:
                break
            with contextlib.suppress(FleetError):  # closed: nothing to place any more
                running = recovery.in_progress(gid)
                future = recovery.submit(gid, reason=why)
                if running:  # an attempt from before the loss: place the group once it ends
                    future.add_done_callback(functools.partial(self._place_if_waiting, gid, why))
        return list(lost)

    def _place_if_waiting(self, group_id: str, why: str, _done: object = None) -> None:
        recovery = self.fleet.recovery
        with contextlib.suppress(FleetError):
            group = self.fleet.registry.get(group_id)
            if recovery is not None and group.state == "unplaced":
                recovery.submit(group_id, reason=why)

    def place_waiting(self, reason: str = "room may have freed") -> list[str]:
        """Hand every ``unplaced`` group not already in recovery to the recovery (a node
        joined, or a removal gave a placement back). Returns their ids."""
        recovery = self.fleet.recovery
        if recovery is None:
            return []
        submitted = []
        for group in self.fleet.registry.groups():
            if group.state == "unplaced" and not recovery.in_progress(group.group_id):
                with contextlib.suppress(FleetError):
                    recovery.submit(group.group_id, reason=reason)
                    submitted.append(group.group_id)
        return submitted

    # ------------------------------------------------------------------ add
    def add_group(self, spec: GroupSpec) -> str:
        """Start a new group from ``spec`` and register it; it is routed only once it holds
        the fleet's version (``pending_weights`` until a targeted push, or the next sync,
        brings it there). Returns its id. Refusals change nothing: a duplicate id
        (``spec.group_id``), too few spare fleet ranks (``FleetConfig.spare_ranks``), a
        start that fails (its placement given back)."""
        from rollsafe.fleet.fleet import GroupSpec, _ResolvedGroup

        fleet = self.fleet
        fleet._require_started()
        if not isinstance(spec, GroupSpec):
            raise InvalidArgument("spec", f"add_group needs a GroupSpec, got {spec!r}")
        if not isinstance(spec.ranks, int) or isinstance(spec.ranks, bool) or spec.ranks < 1:
            raise InvalidArgument("spec.ranks", f"must be an int >= 1, got {spec.ranks!r}")
        with self._lock:
            gid = spec.group_id if spec.group_id is not None else self._new_id()
            if not isinstance(gid, str) or not gid:
                raise InvalidArgument("spec.group_id", f"must be a non-empty string: {gid!r}")
            if gid in fleet.registry or gid in fleet._launchers:
                raise InvalidArgument("spec.group_id", f"a group {gid!r} is already in the fleet")
            cfg = fleet.config
            refused = topology_refusal(
                cfg.settings_for().transport, placement=cfg.placement, ray=cfg.ray, group_ids=[gid]
            )
            if refused is not None:  # the transport cannot reach it where Ray may place it
                raise InvalidArgument("spec.group_id", refused[1])
            ranks = self._take_ranks(gid, spec)
            group = _ResolvedGroup(
                gid,
                spec.ranks,
                ranks,
                fleet.config.warm_standby if spec.warm_standby is None else spec.warm_standby,
            )
        try:
            handle = self._start(group)
        except BaseException:
            with self._lock:
                self._free_ranks.extend(ranks)
            raise
        version = fleet.registry.fleet_version
        with self._lock:
            fleet._launchers[gid] = handle
            fleet._groups.append(group)
            self.added.append(gid)
        fleet.registry.add_group(
            gid,
            ranks,
            clients=[handle.client],
            restart_budget=fleet.config.recovery.restart_budget,
            metadata={"engine_ranks": spec.ranks, "added_at_runtime": True},
            standby_probe=handle.standby_status,
        )
        initial = fleet.config.initial_version
        for rank in ranks:
            fleet.registry.report_member(gid, rank, healthy=True, weights_version=initial)
        recorded = {r: m.healthy for r, m in fleet.registry.get(gid).machine.members.items()}
        for event in policy.launch_events(recorded):
            fleet.registry.send(gid, event)
        state = fleet.registry.get(gid).state
        log.info("group %s added on fleet ranks %s: %s at v%d", gid, list(ranks), state, version)
        if state == "pending_weights" and fleet.recovery is not None:
            fleet.recovery.submit(gid, reason=f"added behind v{version}", catch_up=True)
        return gid

    def _new_id(self) -> str:
        fleet = self.fleet
        while True:
            gid = f"g{self._next_index}"
            self._next_index += 1
            if gid not in fleet.registry and gid not in fleet._launchers:
                return gid

    def _take_ranks(self, gid: str, spec: GroupSpec) -> tuple[int, ...]:
        spare = self.fleet.config.spare_ranks
        if spec.fleet_ranks is not None:
            wanted = tuple(int(r) for r in spec.fleet_ranks)
            missing = [r for r in wanted if r not in self._free_ranks]
            if len(wanted) != spec.ranks or missing:
                raise InvalidArgument(
                    "spec.fleet_ranks",
                    f"group {gid!r}: {list(wanted)} are not {spec.ranks} free fleet ranks "
                    f"(free: {self._free_ranks}; FleetConfig.spare_ranks={spare})",
                )
        else:
            if len(self._free_ranks) < spec.ranks:
                raise InvalidArgument(
                    "FleetConfig.spare_ranks",
                    f"adding group {gid!r} needs {spec.ranks} free fleet rank(s); "
                    f"{len(self._free_ranks)} left (spare_ranks={spare}): raise spare_ranks",
                )
            wanted = tuple(sorted(self._free_ranks)[: spec.ranks])
        for r in wanted:
            self._free_ranks.remove(r)
        return wanted

    def _start(self, group: Any) -> Any:
        fleet = self.fleet
        factory = fleet._factory
        assert factory is not None, "start() built the launcher factory"
        handle = factory(group.group_id, fleet._spec(group))
        try:
            handle.start()
            handle.client.health(timeout=fleet.config.health.timeout_s)
        except BaseException:
            with contextlib.suppress(Exception):
                handle.stop(timeout=5.0)
            raise
        return handle

    # ------------------------------------------------------------------ remove
    def remove_group(self, group_id: str, *, drain_timeout_s: float = 30.0) -> RemovalEnd:
        """Drain ``group_id`` (out of routing: no new requests), wait up to
        ``drain_timeout_s`` for its in-flight requests and any recovery of it to end (what is
        still running is cut and continues on other groups), stop its engine, give its
        placement back and retire it. A removed group never comes back; its fleet ranks are
        not reused. Waiting ``unplaced`` groups are then offered the room."""
        if drain_timeout_s < 0:
            raise InvalidArgument("drain_timeout_s", f"must be >= 0, got {drain_timeout_s}")
        fleet = self.fleet
        fleet._require_started()
        fleet.registry.get(group_id)  # UnknownGroup, early and loud
        with self._lock:
            self._drain_timeout_s = drain_timeout_s
            end = drive(place_op.remove(group_id), self._perform)
            if end.status == "retired":
                self.removed.append(group_id)
        log.info("remove_group(%s): %s (%s)", group_id, end.status, end.reason)
        if end.status == "retired":
            self.place_waiting(reason=f"{group_id} removed")
        return end

    # ------------------------------------------------------------------ effects
    def _perform(self, effect: fx.Effect) -> fx.Outcome:
        table: dict[type[fx.Effect], Callable[[Any], fx.Outcome]] = {
            fx.ReadStates: self._read_states,
            fx.SendGroups: self._send_groups,
            fx.SendGroup: self._send,
            fx.NoteStep: self._note,
            fx.AwaitDrained: self._await_drained,
            fx.StopEngine: self._stop_engine,
            fx.ReleasePlacement: self._release_placement,
        }
        return table[type(effect)](effect)

    def _read_states(self, effect: fx.ReadStates) -> fx.Outcome:
        registry = self.fleet.registry
        found = []
        for gid in effect.groups:
            with contextlib.suppress(UnknownGroup):
                found.append((gid, registry.get(gid).state))
        return fx.Ok(tuple(found))

    def _send_groups(self, effect: fx.SendGroups) -> fx.Outcome:
        return fx.Ok(tuple(self.fleet.registry.send_together(effect.events)))

    def _send(self, effect: fx.SendGroup) -> fx.Outcome:
        try:
            return fx.Ok(self.fleet.registry.send(effect.group, effect.event).target)
        except TransitionRefused as exc:
            return fx.Failed(str(exc))

    def _note(self, effect: fx.NoteStep) -> fx.Outcome:
        log.log(
            logging.INFO if effect.ok else logging.WARNING,
            "membership step %s %s: %s",
            effect.name,
            "ok" if effect.ok else "refused",
            effect.detail,
        )
        return _OK

    def _await_drained(self, effect: fx.AwaitDrained) -> fx.Outcome:
        fleet = self.fleet
        group = fleet.registry.get(effect.group)
        deadline = time.monotonic() + self._drain_timeout_s
        recovery = fleet.recovery

        def busy() -> bool:
            recovering = recovery is not None and recovery.in_progress(effect.group)
            return group.outstanding > 0 or recovering

        while busy() and time.monotonic() < deadline:
            time.sleep(0.05)
        return fx.Ok(group.outstanding)

    def _stop_engine(self, effect: fx.StopEngine) -> fx.Outcome:
        handle = self.fleet._launchers.get(effect.group)
        if handle is None:
            return _OK
        try:
            handle.stop(timeout=self.fleet.config.recovery.stop_timeout_s)
        except Exception as exc:  # the placement is given back next (ReleasePlacement)
            return fx.Failed(f"{type(exc).__name__}: {exc}")
        return _OK

    def _release_placement(self, effect: fx.ReleasePlacement) -> fx.Outcome:
        handle = self.fleet._launchers.get(effect.group)
        if isinstance(handle, PlaceableEngine):
            with contextlib.suppress(Exception):
                handle.release_placement()
        return _OK

    def snapshot(self) -> dict[str, Any]:
        """What changed the fleet's membership so far (for ``RolloutFleet.snapshot``)."""
        with self._lock:
            return {
                "lost_nodes": sorted(self.lost_nodes),
                "added": list(self.added),
                "removed": list(self.removed),
                "free_ranks": sorted(self._free_ranks),
            }
