"""``RayEngineGroup``: the fleet's handle of one engine group that runs in a Ray actor.

It implements :class:`~rollsafe.ports.LaunchableEngine` (so
:class:`~rollsafe.ports.RestartableEngine`, what recovery needs) for a group whose processes
live on whichever node Ray placed it on:

* :meth:`RayEngineGroup.start` reserves the group's placement
  (:class:`~rollsafe.adapters.ray.placement.GroupPlacer`: its ranks packed on one node), starts
  an :class:`~rollsafe.adapters.ray.actor.EngineHost` actor on that placement's bundle 0 and
  the engine inside it, and builds the fleet-side HTTP client on the URL the actor reports
  (the node's IP with ``bind_node_ip``). Requests, probes and weight updates then go straight
  to the engine over HTTP: no Ray call per request.
* :meth:`~RayEngineGroup.restart` runs the engine launcher's restart inside the actor, on the
  engine's node (so a warm standby there takes it); when the actor is gone (its node died, or
  it was killed) the group is **re-placed**: the old reservation is given back, a new one is
  made where Ray finds room, and the engine starts there with the same overrides.
* :meth:`~RayEngineGroup.stop` with ``keep_standby=True`` (recovery's shutdown step) stops the
  engine and keeps actor, placement and warm standby; without it (the fleet's close) it also
  ends the actor and gives the placement back.
* A group that spans nodes (``EngineSpec.ranks_per_node``) holds one actor per node slice, slice
  ``i`` on bundle ``i`` of its ``STRICT_SPREAD`` placement, all created at once (their starts
  overlap): the head's actor picks the head's address on its node, the other slices' actors
  are given it (``join_head``) and start their engines joined to it, and every
  start, restart and stop runs on all of them; any slice's actor lost is the whole group's
  placement lost (placed again whole); a moved export is pulled to every slice's node.

Every Ray call has a timeout; the warm standby's status is the actor's last report, refreshed in
the background (``standby_status()`` never waits for Ray: a metrics scrape of many groups
costs no round trips).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from rollsafe.adapters.engines.launch.readiness import engine_client
from rollsafe.adapters.ray.actor import engine_actor
from rollsafe.adapters.ray.placement import GroupPlacer, Placement

if TYPE_CHECKING:
    from rollsafe.adapters.engines import EngineSpec, SGLangClient, VLLMClient
    from rollsafe.ports import StandbyState, StartSource

__all__ = ["RayEngineGroup", "ray_engine_factory"]


class RayEngineGroup:
    """One engine group in a Ray actor pinned to its own placement group. Thread-safe.

    ``placer`` reserves the group's resources; ``start_timeout_s`` bounds one start or restart
    inside the actor; ``call_timeout_s`` any other call to it; ``bind_node_ip``: the engine
    listens on its node's IP (reachable from other nodes) instead of ``spec.host``;
    ``actor_options``: extra Ray actor options (``runtime_env``...)."""

    def __init__(
        self,
        group_id: str,
        spec: EngineSpec,
        placer: GroupPlacer,
        *,
        start_timeout_s: float = 180.0,
        call_timeout_s: float = 30.0,
        bind_node_ip: bool = True,
        actor_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.group_id = group_id
        self._spec = spec
        self._placer = placer
        self.start_timeout_s = start_timeout_s
        self.call_timeout_s = call_timeout_s
        self._bind_node_ip = bind_node_ip
        self._actor_options = dict(actor_options or {})
        self._lock = threading.RLock()
        self._placement: Placement | None = None
        self._actor: Any = None
        #: the actors of the node slices after the head's (slice order; none on one node)
        self._workers: list[Any] = []
        #: a moved export's path on the head's node -> its path on every slice's node
        self._slice_paths: dict[str, list[str]] = {}
        self._client: SGLangClient | VLLMClient | None = None
        self._info: dict[str, Any] = {}
        self._standby: dict[str, Any] = {"state": "none", "last_start_source": None, "status": {}}
        self._refresh_lock = threading.Lock()
        self._refreshing = False  # a standby view is on its way from the actor
        #: how many times the group was placed again after its actor (or node) was lost
        self.replacements = 0
        #: place the group on this node only (None: where Ray finds room); the fleet pins
        #: ``RaySettings.trainer_node_groups`` to the trainer's node
        self.pin_node: str | None = None

    # ------------------------------------------------------------------ what it tells
    @property
    def spec(self) -> EngineSpec:
        return self._spec

    @property
    def placement(self) -> Placement | None:
        """The group's current reservation (None while it holds none)."""
        return self._placement

    @property
    def node_id(self) -> str | None:
        """The Ray node (hex id) the group is placed on (its head slice's, for a group that
        spans nodes), None while it holds no placement."""
        placement = self._placement
        return None if placement is None else placement.node_id

    @property
    def node_ids(self) -> tuple[str, ...]:
        """Every node the group holds a slice on, head first (empty while it holds none)."""
        placement = self._placement
        return () if placement is None else placement.node_ids

    @property
    def url(self) -> str:
        if self._client is None:
            raise RuntimeError(f"group {self.group_id!r} is not running: call start() first")
        return self._client.url

    @property
    def ready_info(self) -> dict[str, Any]:
        """The engine's ready info as the actor reported it at the last start."""
        return dict(self._info)

    @property
    def client(self) -> SGLangClient | VLLMClient:
        client = self._client
        if client is None:
            raise RuntimeError(f"group {self.group_id!r} is not running: call start() first")
        return client

    @property
    def actor(self) -> Any:
        """The Ray actor handle (None while the group holds none): chaos tests kill it."""
        return self._actor

    @property
    def standby_state(self) -> StandbyState | None:
        state: StandbyState | None = self._read_standby().get("state")
        return state

    @property
    def last_start_source(self) -> StartSource | None:
        source: StartSource | None = self._standby.get("last_start_source")
        return source

    def standby_status(self) -> dict[str, Any]:
        """The warm standby as the actor last reported it (never waits: a fresh view is asked
        for in the background), plus ``node_id``."""
        view = self._read_standby()
        return {**dict(view.get("status") or {}), "node_id": self.node_id}

    @property
    def rank_pids(self) -> list[int]:
        """The engine's rank pids (on its node) as the actor reports them now."""
        return [int(p) for p in self._call("pids").get("rank_pids", [])]

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> RayEngineGroup:
        """Place the group (if it holds no placement), start its actor and engine; return once
        the engine is ready. Raises :class:`PlacementUnavailable` when no node has room."""
        with self._lock:
            self._run("start", {})
        return self

    def restart(
        self,
        *,
        model_path: str | None = None,
        load_format: str | None = None,
        skip_load_weights: bool | None = None,
        weight_version: str | None = None,
        stop_timeout: float = 10.0,
    ) -> RayEngineGroup:
        """Restart the engine inside its actor with these overrides
        (:meth:`EngineLauncher.restart`); re-place the group first when its actor is gone."""
        kwargs: dict[str, Any] = {
            "model_path": model_path,
            "load_format": load_format,
            "skip_load_weights": skip_load_weights,
            "weight_version": weight_version,
            "stop_timeout": stop_timeout,
        }
        with self._lock:
            self._run("restart", kwargs)
        return self

    def stop(self, *, timeout: float = 10.0, keep_standby: bool = False) -> None:
        """Stop the engine (SIGTERM, SIGKILL after ``timeout``). ``keep_standby``: keep the
        actor, its placement and the warm standby for the restart that follows; otherwise end
        the actor and give the placement back (a later :meth:`start` places it again)."""
        import ray

        actor = self._actor  # not under the lock: a stop interrupts a start in progress
        try:
            if actor is not None:
                refs = [
                    a.stop.remote(timeout=timeout, keep_standby=keep_standby)
                    for a in (actor, *self._workers)
                ]
                for ref in refs:
                    with contextlib.suppress(ray.exceptions.RayActorError):
                        ray.get(ref, timeout=timeout + self.call_timeout_s)
        except ray.exceptions.RayActorError:
            pass  # the actor (or its node) is gone, and its engine with it
        finally:  # a stop that did not answer still ends the actor (its watchdog: the engine)
            with self._lock:
                self._drop_client()
                if not keep_standby:
                    self._forget()

    def place_again(self) -> str:
        """Give the current placement back (ending the actor and its engine) and reserve a new
        one; return its node id. Raises :class:`PlacementUnavailable` when no node has room
        (the group then holds none). The engine starts on the next :meth:`restart`."""
        with self._lock:
            self._drop_client()
            self._forget()
            self._place()
            self.replacements += 1
            assert self._placement is not None
            return self._placement.node_id

    def placement_alive(self, *, timeout_s: float = 5.0) -> bool:
        """Whether the group's actor answers within ``timeout_s`` (one Ray call; the recovery
        asks it once per failure, never per request). False: no actor, the actor is dead, or
        it did not answer (its node is gone or cut off), or it answered as an orphan: its
        raylet is dead (:meth:`EngineHost.node_alive`; an orphaned worker still answers for a
        while after its node was lost, so an answer alone is no proof)."""
        import ray

        actor = self._actor
        if actor is None:
            return False
        try:
            refs = [a.node_alive.remote() for a in (actor, *self._workers)]
            return all(bool(ray.get(ref, timeout=timeout_s)) for ref in refs)
        except ray.exceptions.RayError:  # dead, unavailable, or no answer in time
            return False

    def release_placement(self) -> None:
        """End the actor (and its engine) and give the placement back."""
        with self._lock:
            self._drop_client()
            self._forget()

    def pull_export(
        self,
        parcel: Any,
        dest_root: str | None,
        *,
        fleet: str | None = None,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Have the group's actor pull a published export to its node
        (:meth:`EngineHost.pull_export`, checked there against the manifest); the actor's
        ``ExportPullRefused`` is raised as itself. Bounded by ``timeout_s`` (None:
        ``start_timeout_s``), in two phases a timeout names (``ExportPullTimeout.phase``):
        the actor answering (a new placement's actor may still be starting), then the
        transfer with the time left."""
        import ray

        from rollsafe.adapters.ray.exports import ExportPullTimeout

        actor = self._actor
        if actor is None:
            raise RuntimeError(f"group {self.group_id!r} holds no actor: nothing to pull to")
        if self._workers:  # every slice loads its shard from its own node's copy
            return self._pull_to_slices(parcel, dest_root, fleet=fleet, timeout_s=timeout_s)
        bound = self.start_timeout_s if timeout_s is None else float(timeout_s)
        deadline = time.monotonic() + bound
        try:
            ray.get(actor.node_alive.remote(), timeout=bound)
        except ray.exceptions.GetTimeoutError as exc:
            raise ExportPullTimeout(str(parcel.name), "actor", bound) from exc
        left = max(deadline - time.monotonic(), 0.001)
        try:
            got: dict[str, Any] = ray.get(
                actor.pull_export.remote(parcel, dest_root, fleet=fleet, timeout_s=left),
                timeout=left + self.call_timeout_s,  # the actor's own bound ends it first
            )
        except ray.exceptions.GetTimeoutError as exc:
            raise ExportPullTimeout(str(parcel.name), "transfer", bound) from exc
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, Exception):
                raise cause from exc
            raise
        return got

    def _pull_to_slices(
        self, parcel: Any, dest_root: str | None, *, fleet: str | None, timeout_s: float | None
    ) -> dict[str, Any]:
        """:meth:`pull_export` for a group that spans nodes: every slice's actor pulls the export
        to its node (at once); the head's answer is returned, and a restart from its path loads
        each slice's own copy."""
        import ray

        bound = self.start_timeout_s if timeout_s is None else float(timeout_s)
        actors = [self._actor, *self._workers]
        refs = [
            a.pull_export.remote(parcel, dest_root, fleet=fleet, timeout_s=bound) for a in actors
        ]
        try:
            got = [ray.get(ref, timeout=bound + self.call_timeout_s) for ref in refs]
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, Exception):
                raise cause from exc
            raise
        with self._lock:
            self._slice_paths[str(got[0]["path"])] = [str(g["path"]) for g in got]
        head: dict[str, Any] = got[0]
        return head

    def kill(self) -> None:
        """SIGKILL the engine group (every slice's, and the standby) inside the actors; the
        actors stay."""
        import ray

        for worker in self._workers:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(worker.kill.remote(), timeout=self.call_timeout_s)
        self._call("kill")
        with self._lock:
            self._drop_client()

    def kill_rank(self, rank: int) -> int:
        """SIGKILL one rank process on its node (chaos testing); return its pid."""
        if not self._workers:
            return int(self._call("kill_rank", rank))
        import ray

        per_node = self._spec.ranks // (len(self._workers) + 1)
        actor = [self._actor, *self._workers][rank // per_node]
        got = ray.get(actor.kill_rank.remote(rank % per_node), timeout=self.call_timeout_s)
        return int(got)

    @property
    def slice_paths(self) -> dict[str, list[str]]:
        """``{path on the head's node: [path on every slice's node]}`` of the exports moved
        to this placement's slices (a restart from the head's path loads each slice's own)."""
        with self._lock:
            return {k: list(v) for k, v in self._slice_paths.items()}

    def slice_actor(self, node_rank: int) -> Any:
        """The actor of node slice ``node_rank`` (0: the head's): chaos tests kill it."""
        return [self._actor, *self._workers][node_rank]

    # ------------------------------------------------------------------ internals
    def _run(self, method: str, kwargs: dict[str, Any]) -> None:
        """``method`` on the actor (placing the group first if needed); once more on a new
        placement when the actor is gone. Caller holds the lock."""
        import ray

        if self._actor is None:
            self._place()
        try:
            info = self._remote(method, kwargs)
        except ray.exceptions.RayActorError:
            # the actor died (its node was lost, or it was killed): place the group again
            self._forget()
            self._place()
            self.replacements += 1
            info = self._remote(method, kwargs)
        self._adopt(info)

    def _remote(self, method: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``method`` on every slice's actor at once (the other slices first: they wait for
        the head); the head's ready info once every slice answered."""
        import ray

        paths = self._slice_paths.get(str(kwargs.get("model_path")), [])
        refs = []
        for i, worker in enumerate(self._workers, start=1):
            own = {**kwargs, "model_path": paths[i]} if len(paths) > i else kwargs
            refs.append(getattr(worker, method).remote(**own))
        try:
            info: dict[str, Any] = ray.get(
                getattr(self._actor, method).remote(**kwargs), timeout=self.start_timeout_s
            )
            for ref in refs:  # each was ready before the head (the head waits for them)
                ray.get(ref, timeout=self.start_timeout_s)
        except BaseException:
            for worker in self._workers:  # a slice waiting for a head that failed: stop it
                with contextlib.suppress(Exception):
                    worker.kill.remote()
            raise
        return info

    def _place(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        slices = self._spec.slices
        placement = self._placer.place(
            self.group_id, self._spec.ranks, node=self.pin_node, slices=slices
        )

        def options(bundle: int) -> dict[str, Any]:
            return {
                "num_cpus": 0,
                "max_restarts": 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=placement.pg, placement_group_bundle_index=bundle
                ),
                **self._actor_options,
            }

        key = secrets.token_hex(16)
        try:
            head_slice = (0, key, None) if slices > 1 else None
            self._actor = engine_actor(**options(0)).remote(
                self._spec, bind_node_ip=self._bind_node_ip, node_slice=head_slice
            )
            if slices > 1:  # every slice's actor starts at once; the others then join the head
                self._workers = [
                    engine_actor(**options(i)).remote(
                        self._spec, bind_node_ip=self._bind_node_ip, node_slice=(i, key, None)
                    )
                    for i in range(1, slices)
                ]
                addr = ray.get(self._actor.dist_init_addr.remote(), timeout=self.start_timeout_s)
                joined = [w.join_head.remote(addr) for w in self._workers]
                ray.get(joined, timeout=self.start_timeout_s)
        except BaseException:
            self._kill_actors()
            self._placer.release(placement)
            raise
        self._placement = placement

    def _adopt(self, info: dict[str, Any]) -> None:
        """Take a (re)start's ready info: a new client on the reported URL, the standby view."""
        self._drop_client()
        self._info = dict(info)
        self._client = engine_client(self._spec, str(info["url"]))
        with contextlib.suppress(Exception):
            self._standby = self._call("standby")

    def _read_standby(self) -> dict[str, Any]:
        """The last standby view the actor sent; asks it for a fresh one in the background
        (one request in flight at most), so a read never waits for Ray."""
        actor = self._actor
        if actor is not None:
            with self._refresh_lock:
                ask = not self._refreshing
                self._refreshing = True
            if ask:
                try:
                    future = actor.standby.remote().future()
                except Exception:
                    with self._refresh_lock:
                        self._refreshing = False
                else:
                    future.add_done_callback(self._took_standby)
        return self._standby

    def _took_standby(self, future: concurrent.futures.Future[Any]) -> None:
        with self._refresh_lock:
            self._refreshing = False
        with contextlib.suppress(Exception):  # the actor died: keep the last view
            view = future.result()
            if isinstance(view, dict):
                self._standby = view

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        actor = self._actor
        if actor is None:
            raise RuntimeError(f"group {self.group_id!r} holds no actor: call start() first")
        return ray.get(getattr(actor, method).remote(*args), timeout=self.call_timeout_s)

    def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    def _forget(self) -> None:
        """End the actor (if any) and give the placement back."""

        self._kill_actors()
        self._slice_paths.clear()
        placement, self._placement = self._placement, None
        if placement is not None:
            self._placer.release(placement)

    def _kill_actors(self) -> None:
        import ray

        actors = [self._actor, *self._workers]
        self._actor, self._workers = None, []
        for actor in actors:
            if actor is not None:
                with contextlib.suppress(Exception):
                    ray.kill(actor)

    def __repr__(self) -> str:
        where = self.node_id[:12] if self.node_id else "unplaced"
        state = self._client.url if self._client is not None else "stopped"
        return f"RayEngineGroup({self.group_id!r}, node {where}, {state})"


def ray_engine_factory(
    placer: GroupPlacer, **options: Any
) -> Callable[[str, EngineSpec], RayEngineGroup]:
    """A fleet launcher factory (``FleetConfig.launcher_factory``) whose groups are
    :class:`RayEngineGroup` s placed by ``placer``; ``options`` go to each group."""

    def factory(group_id: str, spec: EngineSpec) -> RayEngineGroup:
        return RayEngineGroup(group_id, spec, placer, **options)

    return factory
