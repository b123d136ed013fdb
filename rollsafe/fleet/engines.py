"""The fleet's engine groups: their plans, the handle running each, the fleet ranks kept for
groups added later, and what the operations do to a handle (stop, release, place).

:class:`EngineGroups` owns the groups' plans (:class:`~rollsafe.fleet.config.GroupPlan`), the
handle that runs each (an ``EngineLauncher``, a ``RayEngineGroup``: a
:class:`~rollsafe.ports.LaunchableEngine`), the spare fleet ranks and how a group's
:class:`~rollsafe.adapters.engines.EngineSpec` is made from the config's template; it is handed
to the membership changes and the recovery explicitly (they hold no fleet).
:class:`EngineEffects` is the one handler of :class:`~rollsafe.operations.effects.StopEngine`,
:class:`~rollsafe.operations.effects.ReleasePlacement` and
:class:`~rollsafe.operations.effects.Place`; the recovery and the membership changes hold one as
a part, over the same handles (``handle_for(group_id)``: an ``EngineLauncher``, a
``RayEngineGroup``). The steps it declares (``shutdown``, ``place``) are timed under the
attempt's deadline by the recovery and run plainly by a removal.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import rollsafe.operations.effects as fx
import rollsafe.operations.place as place_op
from rollsafe.errors import InvalidArgument
from rollsafe.fleet.config import (
    FleetConfig,
    GroupPlan,
    GroupSpec,
    LauncherFactory,
    check_shape,
)
from rollsafe.fleet.steps import TimedStep
from rollsafe.operations.executor import Executor, handles
from rollsafe.ports import LaunchableEngine, PlaceableEngine, RestartableEngine

if TYPE_CHECKING:
    from rollsafe.adapters.engines import EngineSpec

__all__ = ["EngineEffects", "EngineGroups"]

log = logging.getLogger(__name__)


class EngineEffects(Executor):
    """Stop, release and place engine groups through ``handle_for(group_id)`` (a ``KeyError``
    for a group without a handle: nothing to stop or release). ``stop_timeout_s`` is the grace
    before a stop kills what still runs."""

    def __init__(
        self, handle_for: Callable[[str], RestartableEngine], *, stop_timeout_s: float
    ) -> None:
        self.handle_for = handle_for
        self.stop_timeout_s = stop_timeout_s

    @handles(fx.StopEngine, step=TimedStep("shutdown"))
    def stop(self, effect: fx.StopEngine) -> fx.Outcome[None]:
        """Stop the group's engine (``keep_standby``: its warm standby takes the restart)."""
        try:
            handle = self.handle_for(effect.group)
        except KeyError:
            return fx.DONE  # nothing was started for it
        try:
            handle.stop(timeout=self.stop_timeout_s, keep_standby=effect.keep_standby)
        except Exception as exc:
            return fx.Failed(f"{type(exc).__name__}: {exc}")
        return fx.DONE

    @handles(fx.ReleasePlacement)
    def release(self, effect: fx.ReleasePlacement) -> fx.Outcome[None]:
        """Give the group's placement back (its engine is stopped); a group on this machine
        has none."""
        try:
            handle = self.handle_for(effect.group)
        except KeyError:
            return fx.DONE
        if isinstance(handle, PlaceableEngine):
            with contextlib.suppress(Exception):  # the actor may be gone with its node
                handle.release_placement()
        return fx.DONE

    @handles(fx.Place, step=TimedStep("place", starts_attempt=True))
    def place(self, effect: fx.Place) -> fx.Outcome[str]:
        """Give the group's old placement back and reserve a new one: the new node's id
        (``local`` for a group on this machine); :class:`Failed` when no node has room."""
        handle = self.handle_for(effect.group)
        if not isinstance(handle, PlaceableEngine):
            return fx.Ok("local")  # a group on this machine has no placement to renew
        try:
            return fx.Ok(handle.place_again())
        except Exception as exc:
            return fx.Failed(f"{type(exc).__name__}: {exc}")


class EngineGroups:
    """The engine groups of one fleet (see the module). Thread-safe."""

    def __init__(self, config: FleetConfig, plans: list[GroupPlan]) -> None:
        self.config = config
        self._lock = threading.RLock()
        self._plans: dict[str, GroupPlan] = {p.group_id: p for p in plans}
        self._handles: dict[str, LaunchableEngine] = {}
        #: every fleet rank: the groups' ranks and ``FleetConfig.spare_ranks``
        self.world_size = sum(p.ranks for p in plans) + config.spare_ranks
        used = {r for p in plans for r in p.fleet_ranks}
        self._free = [r for r in range(self.world_size) if r not in used]
        self._next_index = len(plans)
        self._factory: LauncherFactory | None = None
        self._adjust: Callable[[EngineSpec], EngineSpec] = lambda spec: spec

    # ------------------------------------------------------------------ reads
    def plans(self) -> list[GroupPlan]:
        """Every group's plan, in the order they joined."""
        with self._lock:
            return list(self._plans.values())

    @property
    def ids(self) -> list[str]:
        return [p.group_id for p in self.plans()]

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._plans or group_id in self._handles

    def handle(self, group_id: str) -> LaunchableEngine:
        """The handle running ``group_id``'s engine (``KeyError`` for one without)."""
        return self._handles[group_id]

    def handles(self) -> list[LaunchableEngine]:
        with self._lock:
            return list(self._handles.values())

    def groups_on(self, node_id: str) -> list[str]:
        """The groups with a slice of their current placement on ``node_id`` (a group that
        spans nodes is on each of its slices' nodes)."""
        with self._lock:
            handles = list(self._handles.items())
        placements = {
            gid: handle.node_ids for gid, handle in handles if isinstance(handle, PlaceableEngine)
        }
        return list(place_op.groups_on(node_id, placements))

    # ------------------------------------------------------------------ specs
    def spec_for(self, plan: GroupPlan) -> EngineSpec:
        """The engine spec of ``plan``'s group: the config's template with the group's ranks,
        warm standby and (when the template has none) the fleet's initial version, adjusted by
        the placement (an API key for engines bound to a node's IP)."""
        template = self.config.engine_spec
        version = template.weight_version
        if version is None:
            version = str(self.config.initial_version)
        spec = dataclasses.replace(
            template,
            ranks=plan.ranks,
            ranks_per_node=plan.ranks_per_node,
            warm_standby=plan.warm_standby,
            weight_version=version,
        )
        return self._adjust(spec)

    # ------------------------------------------------------------------ starting
    def start_all(
        self,
        factory: LauncherFactory,
        *,
        adjust: Callable[[EngineSpec], EngineSpec] | None = None,
        timeout_s: float,
    ) -> None:
        """Make every planned group's handle with ``factory`` and start them together; return
        once every one is ready (or raise: the caller stops what started)."""
        self._factory = factory
        if adjust is not None:
            self._adjust = adjust
        plans = self.plans()
        for plan in plans:
            self._handles[plan.group_id] = factory(plan.group_id, self.spec_for(plan))
        with concurrent.futures.ThreadPoolExecutor(max(1, len(plans))) as pool:
            futures = [pool.submit(self._handles[p.group_id].start) for p in plans]
            deadline = time.monotonic() + timeout_s
            for fut in futures:
                fut.result(timeout=max(0.1, deadline - time.monotonic()))

    def plan(self, spec: GroupSpec) -> GroupPlan:
        """A plan for a group added at runtime: its id (``spec.group_id`` or the next free
        ``g<i>``) and fleet ranks taken from the spare ones. Refused, changing nothing: a
        duplicate id, too few spare ranks, ranks that are not free."""
        if not isinstance(spec, GroupSpec):
            raise InvalidArgument("spec", f"add_group needs a GroupSpec, got {spec!r}")
        if not isinstance(spec.ranks, int) or isinstance(spec.ranks, bool) or spec.ranks < 1:
            raise InvalidArgument("spec.ranks", f"must be an int >= 1, got {spec.ranks!r}")
        check_shape("spec.ranks_per_node", spec.ranks, spec.ranks_per_node)
        with self._lock:
            gid = spec.group_id if spec.group_id is not None else self._new_id()
            if not isinstance(gid, str) or not gid:
                raise InvalidArgument("spec.group_id", f"must be a non-empty string: {gid!r}")
            if gid in self:
                raise InvalidArgument("spec.group_id", f"a group {gid!r} is already in the fleet")
            ranks = self._take_ranks(gid, spec)
            standby = self.config.warm_standby if spec.warm_standby is None else spec.warm_standby
            return GroupPlan(gid, spec.ranks, ranks, standby, ranks_per_node=spec.ranks_per_node)

    def give_back(self, plan: GroupPlan) -> None:
        """A plan that will not start: its fleet ranks are free again."""
        with self._lock:
            self._free.extend(plan.fleet_ranks)

    def start_one(self, plan: GroupPlan) -> LaunchableEngine:
        """Start ``plan``'s group (one made by :meth:`plan`) and keep its handle; a start that
        fails gives its fleet ranks back and stops what started."""
        factory = self._factory
        if factory is None:
            raise RuntimeError("the fleet's groups have not been started (start_all first)")
        handle = factory(plan.group_id, self.spec_for(plan))
        try:
            handle.start()
            handle.client.health(timeout=self.config.health.timeout_s)
        except BaseException:
            with contextlib.suppress(Exception):
                handle.stop(timeout=5.0)
            self.give_back(plan)
            raise
        with self._lock:
            self._handles[plan.group_id] = handle
            self._plans[plan.group_id] = plan
        return handle

    def _new_id(self) -> str:
        while True:
            gid = f"g{self._next_index}"
            self._next_index += 1
            if gid not in self:
                return gid

    def _take_ranks(self, gid: str, spec: GroupSpec) -> tuple[int, ...]:
        spare = self.config.spare_ranks
        if spec.fleet_ranks is not None:
            wanted = tuple(int(r) for r in spec.fleet_ranks)
            missing = [r for r in wanted if r not in self._free]
            if len(wanted) != spec.ranks or missing:
                raise InvalidArgument(
                    "spec.fleet_ranks",
                    f"group {gid!r}: {list(wanted)} are not {spec.ranks} free fleet ranks "
                    f"(free: {self._free}; FleetConfig.spare_ranks={spare})",
                )
        else:
            if len(self._free) < spec.ranks:
                raise InvalidArgument(
                    "FleetConfig.spare_ranks",
                    f"adding group {gid!r} needs {spec.ranks} free fleet rank(s); "
                    f"{len(self._free)} left (spare_ranks={spare}): raise spare_ranks",
                )
            wanted = tuple(sorted(self._free)[: spec.ranks])
        for r in wanted:
            self._free.remove(r)
        return wanted

    # ------------------------------------------------------------------ stopping
    def stop_all(self, timeout_s: float = 5.0) -> None:
        """Stop every group's engine (each failure logged; the others still stopped)."""
        for handle in self.handles():
            try:
                handle.stop(timeout=timeout_s)
            except Exception:  # keep stopping the others
                log.exception("stopping an engine failed")

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"free_ranks": sorted(self._free)}
