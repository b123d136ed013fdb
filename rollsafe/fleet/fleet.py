"""RolloutFleet: the one object a trainer embeds.

It is built from one :class:`~rollsafe.fleet.config.FleetConfig` (a malformed one fails at
construction with :class:`~rollsafe.fleet.settings.FleetConfigError` naming the key; nothing is
launched before :meth:`start`) and owns, in parts:

* the engine groups (:class:`~rollsafe.fleet.engines.EngineGroups`: plans, handles, spare
  ranks) and where they run (:class:`~rollsafe.fleet.placement.Placement`: on this machine or
  placed by Ray);
* the :class:`~rollsafe.registry.FleetRegistry` of their machines, the :class:`Router` and
  the request path (:class:`~rollsafe.fleet.dataplane.DataPlane`: :meth:`generate` blocks,
  :meth:`agenerate` / :meth:`astream` run on the caller's event loop);
* the control plane (:mod:`rollsafe.fleet.control_plane`): transport, exporter, health,
  recovery, request health, sync, and the fleet's :class:`ImmediateRecoveryMode`;
* the runtime membership (:class:`~rollsafe.fleet.elastic.Membership`: node loss, groups
  added and removed) and what it records (:class:`FleetObserver`, optional Prometheus metrics).

Trainer-side use::

    with RolloutFleet(FleetConfig(model_path=..., export_root=..., groups=[GroupSpec(2)])) as fleet:
        out = fleet.generate([1, 2, 3], sampling_params={"max_new_tokens": 8})
        # or, on an event loop: out = await fleet.agenerate([1, 2, 3], ...)
        fleet.sync_weights(dict(model.named_parameters()), version=1)

:meth:`timeline` returns every machine transition in time order; :meth:`snapshot` the current
picture; :meth:`record` writes the run so far for ``rollsafe report``. ``metrics=`` /
``metrics_port=`` export Prometheus metrics (``docs/metrics.md``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import rollsafe.policy as policy
from rollsafe.errors import InvalidArgument
from rollsafe.fleet.config import FleetConfig, GroupSpec
from rollsafe.fleet.control_plane import ControlPlane, build_control_plane
from rollsafe.fleet.dataplane import DataPlane
from rollsafe.fleet.elastic import Membership
from rollsafe.fleet.engines import EngineGroups
from rollsafe.fleet.inspection import ExportHistory, picture, timeline
from rollsafe.fleet.partial_rollouts import SYNC_PAUSE_MODES, SyncPauseMode, paused_generation
from rollsafe.fleet.placement import LocalPlacement, Placement, PlacementContext
from rollsafe.fleet.provenance import TokenChunk
from rollsafe.fleet.router import RoutedResult, Router
from rollsafe.observe.observer import FleetObserver
from rollsafe.registry import FleetError, FleetRegistry
from rollsafe.statemachines.recovery_mode import ImmediateRecoveryMode

if TYPE_CHECKING:
    import torch
    from prometheus_client import CollectorRegistry

    from rollsafe.adapters.engines import EngineLauncher
    from rollsafe.digest_check import DigestCheck
    from rollsafe.fleet.health import HealthManager
    from rollsafe.fleet.recovery import RecoveryCoordinator, RecoveryResult
    from rollsafe.fleet.request_health import RequestHealth
    from rollsafe.fleet.spares import SparePool
    from rollsafe.fleet.sync import SyncCoordinator, SyncReport
    from rollsafe.gateway.app import Gateway
    from rollsafe.gateway.router_sync import RouterSync
    from rollsafe.gateway.settings import ExternalRouter, GatewaySettings
    from rollsafe.hf import HFExporter
    from rollsafe.invariants import FleetPicture
    from rollsafe.observe.metrics import FleetMetrics
    from rollsafe.observe.stream import RunStream
    from rollsafe.operations.place import RemovalEnd
    from rollsafe.ports import LaunchableEngine, WeightTransport

__all__ = ["FleetNotStarted", "RolloutFleet"]

log = logging.getLogger(__name__)


def make_placement(config: FleetConfig) -> Placement:
    """The placement ``config`` asks for: its ``launcher_factory`` (which wins), else
    ``placement`` (``"local"`` or ``"ray"``)."""
    if config.launcher_factory is not None or config.placement != "ray":
        return LocalPlacement(config.launcher_factory)
    from rollsafe.fleet.ray_placement import RayPlacement

    return RayPlacement(config)


class FleetNotStarted(FleetError, RuntimeError):
    """The fleet was used before :meth:`RolloutFleet.start` (or after :meth:`close`)."""


class RolloutFleet:
    """The rollout-engine fleet of one trainer: launch, route, sync, recover, close.

    Thread-safe for :meth:`generate` (many threads) alongside one :meth:`sync_weights` at a
    time. Use as a context manager: ``__enter__`` starts the fleet, ``__exit__`` closes it.
    The parts (``registry``, ``router``, ``engines``, ``placement``, and from :meth:`start`
    ``transport``, ``exporter``, ``health``, ``recovery``, ``sync``, ``membership``) are
    attributes for inspection and tests; the trainer's verbs come first below.
    """

    def __init__(
        self,
        config: FleetConfig,
        *,
        metrics: CollectorRegistry | bool | None = None,
        metrics_port: int | None = None,
    ) -> None:
        """``metrics``: a ``prometheus_client.CollectorRegistry`` to register the fleet's
        metrics into (``True``: a fresh one, :attr:`metrics` ``.registry``); ``metrics_port``:
        serve them on ``127.0.0.1:PORT/metrics`` from :meth:`start` to :meth:`close` (0 picks a
        free port; :attr:`metrics` ``.url``). Both need the ``[metrics]`` extra
        (prometheus-client): without it they raise ``ImportError``. See ``docs/metrics.md``."""
        plans = config.validate()
        self.config = config
        self.engines = EngineGroups(config, plans)
        self.placement = make_placement(config)
        self.registry = FleetRegistry(fleet_version=config.initial_version)
        self.mode = ImmediateRecoveryMode(
            enabled=config.enable_immediate_recovery, rearm_after=config.rearm_after
        )
        self.router = Router(
            self.registry,
            max_attempts=config.router_max_attempts,
            wait_for_routable_s=config.wait_for_routable_s,
            request_timeout_s=config.request_timeout_s,
        )
        # request samples, crash marks and failure episodes (rollsafe.observe): for metrics,
        # record() and the timeline picture; a registry listener and the router's error hook
        self.observer = FleetObserver(self.registry)
        self.registry.add_listener(self.observer)
        self.router.on_group_error = self._request_failed
        #: the request path, asyncio end to end (agenerate / astream; generate blocks on it)
        self.data_plane = DataPlane(self.router, log_to=self.observer)
        #: the rollout gateway (``FleetConfig.gateway``), serving from :meth:`start`
        self.gateway: Gateway | None = None
        #: the external routers kept in step (``FleetConfig.external_routers``)
        self.router_syncs: list[RouterSync] = []
        self._control: ControlPlane | None = None
        self.membership: Membership | None = None
        self._exports = ExportHistory()
        self._stream: RunStream | None = None
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        self.started_at: float | None = None
        self.start_seconds: float | None = None
        self.metrics: FleetMetrics | None = None
        if (metrics is not None and metrics is not False) or metrics_port is not None:
            from rollsafe.observe.metrics import FleetMetrics

            self.metrics = FleetMetrics(
                self, registry=None if metrics is True else metrics, port=metrics_port
            )

    # ------------------------------------------------------------------ the trainer's verbs
    def start(self) -> RolloutFleet:
        """Launch every group's engine (concurrently), wait until healthy, send ``launched``.

        On any failure everything started so far is stopped and the error propagates.
        """
        with self._lock:
            if self._closed:
                raise FleetNotStarted("a closed RolloutFleet cannot be started again")
            if self._started:
                return self
            self._started = True
        t0 = time.monotonic()
        self.started_at = time.time()
        try:
            cfg, engines = self.config, self.engines
            control = self._control = build_control_plane(
                cfg,
                self.registry,
                self.mode,
                plans=engines.plans(),
                world_size=engines.world_size,
                handle_for=engines.handle,
            )
            factory = self.placement.prepare(
                PlacementContext(
                    control.transport, control.exporter, engines.handle, apart=self._apart
                )
            )
            self._open_stream(control)
            self.router.on_group_ok = control.request_health.ok
            control.recovery.export_mover = self.placement.export_mover
            self.membership = Membership(cfg, self.registry, engines, control.recovery)
            engines.start_all(factory, adjust=self.placement.spec, timeout_s=cfg.start_timeout_s)
            self._register_groups()
            control.health.start()
            self.placement.watch(self.membership)
            self.observer.start()
            if self.metrics is not None and self.metrics.requested_port is not None:
                self.metrics.serve()
            if cfg.gateway is not None:
                self._start_gateway(cfg.gateway)
            self._start_router_syncs(cfg.external_routers)
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.monotonic() - t0
        return self

    def _start_gateway(self, settings: GatewaySettings) -> None:
        """Serve the gateway on the data plane's event loop (``docs/gateway.md``)."""
        from rollsafe.gateway.app import Gateway

        if self.metrics is None:  # the gateway's /metrics serves the fleet's metrics too
            from rollsafe.observe.metrics import FleetMetrics

            self.metrics = FleetMetrics(self)
        assert self.config.model_path is not None
        gateway = Gateway(self, settings, model_path=Path(self.config.model_path))
        self.data_plane.loop_thread.run(gateway.start())
        self.gateway = gateway
        log.info("rollout gateway serving at %s", gateway.url)

    def _start_router_syncs(self, routers: Sequence[ExternalRouter]) -> None:
        """Keep each external router's worker list equal to the routable set."""
        if not routers:
            return
        from rollsafe.gateway.router_sync import RouterSync

        for router in routers:
            sync = RouterSync(self.registry, router)
            sync.start()
            self.router_syncs.append(sync)

    @property
    def gateway_url(self) -> str | None:
        """Where the rollout gateway serves (``http://host:port``), None without one."""
        return self.gateway.url if self.gateway is not None else None

    def _register_groups(self) -> None:
        """Every started group joins the registry at the fleet's version: ``launched``."""
        version = self.registry.fleet_version
        for plan in self.engines.plans():
            handle = self.engines.handle(plan.group_id)
            handle.client.health(timeout=self.config.health.timeout_s)
            self.registry.add_group(
                plan.group_id,
                plan.fleet_ranks,
                clients=[handle.client],
                restart_budget=self.config.recovery.restart_budget,
                metadata={"engine_ranks": plan.ranks},
                standby_probe=handle.standby_status,
                spare=plan.spare,
            )
            for rank in plan.fleet_ranks:
                self.registry.report_member(
                    plan.group_id, rank, healthy=True, weights_version=version
                )
            members = self.registry.get(plan.group_id).machine.members
            for event in policy.launch_events({r: m.healthy for r, m in members.items()}):
                self.registry.send(plan.group_id, event, decided_by="launch_events")

    def generate(
        self,
        input_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        session_id: str | None = None,
        timeout: float | None = None,
    ) -> RoutedResult:
        """One rollout request (only ``active`` groups serve), blocking: :meth:`agenerate` run
        on the data plane's event loop thread."""
        self._require_started()
        return self.data_plane.generate(
            input_ids,
            text=text,
            sampling_params=sampling_params,
            session_id=session_id,
            timeout=timeout,
        )

    async def agenerate(
        self,
        input_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        session_id: str | None = None,
        timeout: float | None = None,
    ) -> RoutedResult:
        """One rollout request on the caller's event loop (no thread per request): a token-id
        prompt is streamed and continued on another group after a crash or a sync's abort
        (:mod:`rollsafe.fleet.dataplane`). Close the loop's engine connections with
        :meth:`aclose_loop` before closing a loop of yours."""
        self._require_started()
        return await self.data_plane.agenerate(
            input_ids,
            text=text,
            sampling_params=sampling_params,
            session_id=session_id,
            timeout=timeout,
        )

    def astream(
        self,
        input_ids: Sequence[int],
        *,
        sampling_params: Mapping[str, Any] | None = None,
        session_id: str | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[TokenChunk]:
        """One rollout request's tokens as they come: each :class:`TokenChunk` names the group
        and weights version that produced it; a stream cut by a crash or a sync continues on
        another group from its last token; the last chunk is ``finished`` (with the whole
        provenance). ``async for chunk in fleet.astream(ids): ...``"""
        self._require_started()
        return self.data_plane.astream(
            input_ids, sampling_params=sampling_params, session_id=session_id, timeout=timeout
        )

    async def aclose_loop(self) -> None:
        """Close the engine connections the running event loop opened (:meth:`agenerate` /
        :meth:`astream` on a loop of yours): call it before that loop closes."""
        await self.data_plane.aclose_loop()

    def sync_weights(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        pause_mode: SyncPauseMode | None = None,
    ) -> SyncReport:
        """Push ``version`` to every active and pending group, then export it asynchronously.

        ``pause_mode`` (``"retract"`` or ``"abort"``): pause generation around the push and
        continue the paused requests from their tokens so far on the new weights, their
        segments tagged with each version (:mod:`rollsafe.fleet.partial_rollouts`); None
        (default): :attr:`FleetConfig.pause_mode`, and when that is None too, requests keep
        running while the weights change, except on an engine whose update must run paused
        (:attr:`engine_traits`, vLLM), which is paused with ``"abort"``."""
        control = self._control_plane()
        pause_mode = self.sync_pause_mode(pause_mode)
        if pause_mode is None:
            report = control.sync.sync(named_tensors, version)
        else:
            if pause_mode not in SYNC_PAUSE_MODES:
                raise InvalidArgument(
                    "pause_mode", f"pause_mode must be in {SYNC_PAUSE_MODES}, not {pause_mode!r}"
                )
            bracket = paused_generation(self.registry, self.router, pause_mode)
            report = control.sync.sync(named_tensors, version, around_update=bracket)
        self.placement.after_sync()
        self._exports.harvest(control.exporter)
        return report

    def sync_pause_mode(self, requested: SyncPauseMode | None = None) -> SyncPauseMode | None:
        """The pause mode a sync runs with: ``requested``, else :attr:`FleetConfig.pause_mode`,
        else ``"abort"`` for an engine whose update must run paused, else None (no pause)."""
        if requested is not None:
            return requested
        if self.config.pause_mode is not None:
            return self.config.pause_mode
        return "abort" if self.engine_traits.update_needs_pause else None

    def pause(self) -> None:
        """Pause health checks, then generation on every routable group (before offload)."""
        control = self._control_plane()
        control.health.pause()
        for group in self.registry.routable():
            if group.client is not None:
                group.client.pause_generation()

    def resume(self) -> None:
        """Continue generation on every routable group, then resume health checks."""
        control = self._control_plane()
        for group in self.registry.routable():
            if group.client is not None:
                group.client.continue_generation()
        control.health.resume()

    def close(self, timeout: float = 10.0) -> None:
        """Stop health checks, recoveries, the router, the transport and every engine process.

        Idempotent; waits up to ``timeout`` s for an in-flight export to finish first.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.placement.close(timeout)
        control = self._control
        if control is not None:
            with contextlib.suppress(Exception):
                control.health.stop(timeout=timeout)
            if control.spares is not None:
                with contextlib.suppress(Exception):
                    control.spares.close()
        with contextlib.suppress(Exception):
            self.observer.stop()
        if self.metrics is not None:  # stop serving; a closed fleet leaves the registry
            with contextlib.suppress(Exception):
                self.metrics.unregister()
        if control is not None:
            with contextlib.suppress(Exception):
                control.recovery.close(timeout=timeout)
        for sync in self.router_syncs:
            with contextlib.suppress(Exception):
                sync.close()
        if self.gateway is not None:
            with contextlib.suppress(Exception):
                self.data_plane.loop_thread.run(self.gateway.close(grace_s=min(timeout, 5.0)))
        self.router.close()
        with contextlib.suppress(Exception):
            self.data_plane.close()
        if control is not None:
            handle = control.exporter.in_flight
            if handle is not None:
                with contextlib.suppress(Exception):
                    handle.wait(timeout)
            with contextlib.suppress(Exception):
                control.transport.close()
        self.engines.stop_all()
        self._close_stream()

    # ------------------------------------------------------------------ the streamed run
    def _open_stream(self, control: ControlPlane) -> None:
        """``FleetConfig.run_dir``: stream every transition of every machine the fleet owns,
        each sync's and recovery's row, from here to :meth:`close`
        (:class:`~rollsafe.observe.stream.RunStream`)."""
        if self.config.run_dir is None:
            return
        from rollsafe.observe.runfile import recovery_row, run_header, sync_row
        from rollsafe.observe.stream import RunStream

        groups = [{"id": p.group_id, "ranks": list(p.fleet_ranks)} for p in self.engines.plans()]
        assert self.started_at is not None
        stream = RunStream(self.config.run_dir, run_header(self, self.started_at, groups=groups))
        self._stream = stream
        stream.watch("mode", "immediate_recovery", self.mode)
        stream.watch("registration", control.transport.name, control.transport.registration)
        control.exporter.watch(
            lambda version, machine: stream.watch("export", f"v{version}", machine)
        )
        for group in self.registry.groups():
            stream.watch_group(group)
        self.registry.add_listener(stream)
        transport = control.transport.name
        control.sync.on_report = lambda report: stream.write(sync_row(report, transport))
        control.recovery.on_result = lambda result: stream.write(
            recovery_row(result, self.observer.episodes())
        )

    def _close_stream(self) -> None:
        """The streamed run's ``end`` row; the file fsync'd and closed."""
        stream = self._stream
        if stream is None or stream.closed:
            return
        from rollsafe.observe.runfile import end_row

        try:
            end = end_row(self, time.time())
        except Exception:  # the record stays readable without it: a partial one
            log.exception("the streamed run's end row could not be built")
            end = None
        stream.close(end)

    @property
    def stream(self) -> RunStream | None:
        """The run streamed to ``FleetConfig.run_dir`` from :meth:`start` (None: not
        streamed); closed by :meth:`close`."""
        return self._stream

    @property
    def recoveries_dropped(self) -> int:
        """Recoveries that left :meth:`recoveries` (it keeps the last ones)."""
        return self._control.recovery.results_dropped if self._control is not None else 0

    def __enter__(self) -> RolloutFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ membership
    def add_group(self, spec: GroupSpec) -> str:
        """Start a group at runtime and return its id; it is routed only once it holds the
        fleet's version (``pending_weights`` until a targeted push or the next sync brings it
        there). Its fleet ranks come from ``FleetConfig.spare_ranks``
        (:meth:`rollsafe.fleet.elastic.Membership.add_group`)."""
        return self._membership().add_group(spec)

    def remove_group(self, group_id: str, *, drain_timeout_s: float = 30.0) -> RemovalEnd:
        """Drain ``group_id``, wait up to ``drain_timeout_s`` for its requests (the rest
        continue elsewhere), stop it, give its placement back and retire it for good."""
        return self._membership().remove_group(group_id, drain_timeout_s=drain_timeout_s)

    def node_lost(self, node_id: str, *, reason: str = "") -> list[str]:
        """Node ``node_id`` died: every group on it leaves routing at once and is placed
        again; returns those groups (``placement="ray"``; the ``NodeWatcher`` calls it)."""
        return self._membership().node_lost(node_id, reason=reason)

    # ------------------------------------------------------------------ recoveries and checks
    def recoveries(self) -> list[RecoveryResult]:
        return self._control.recovery.recoveries() if self._control is not None else []

    def wait_recoveries(self, timeout: float = 60.0) -> bool:
        """Wait until no recovery is queued or running; return whether that happened in time."""
        return self._control is None or self._control.recovery.wait_idle(timeout)

    def checksums(self, timeout: float = 10.0) -> dict[str, str | None]:
        """Each group's engine model digest from its own weight checker (None if it did not
        answer): :func:`rollsafe.fleet.weights_check.engine_checksums`. Against a trainer use
        :meth:`check_weights`."""
        from rollsafe.fleet.weights_check import engine_checksums

        return engine_checksums(self.registry, timeout=timeout)

    def check_weights(
        self, weights: Mapping[str, torch.Tensor], timeout: float = 10.0
    ) -> dict[str, DigestCheck | None]:
        """Each group's engine checked against the trainer's HF-named ``weights``, tensor by
        tensor in the engine's own layout (:func:`rollsafe.fleet.weights_check.check_engines`);
        ``"equal"`` only when every tensor carried data and matched (vLLM on CPU reports no
        data for its linear weights: ``"unverified"``; check those with :mod:`rollsafe.probe`)."""
        from rollsafe.fleet.weights_check import check_engines

        cfg = self.config
        template = cfg.template_dir if cfg.template_dir is not None else cfg.model_path
        assert template is not None  # the config settled model_path
        return check_engines(self.registry, weights, template, timeout=timeout)

    # ------------------------------------------------------------------ inspection
    def timeline(self, *, from_memory: bool = False) -> list[dict[str, Any]]:
        """Every machine transition (groups, exports, registration, mode), oldest first: read
        back from the streamed run when there is one (``FleetConfig.run_dir``: the whole run),
        else (or with ``from_memory``) from the machines' in-memory histories, each its last
        ``history_limit`` transitions."""
        stream = self._stream
        if stream is not None and not from_memory:
            from rollsafe.observe.runfile import TRANSITION_KINDS

            return [
                {k: v for k, v in r.items() if k != "t"}
                for r in stream.rows()
                if r["kind"] in TRANSITION_KINDS
            ]
        self._exports.harvest(self.exporter)
        return timeline(self.registry, self._exports, self.transport, self.mode)

    def export_states(self) -> dict[int, str]:
        """Every export this fleet started, by version, and its lifecycle state."""
        self._exports.harvest(self.exporter)
        return self._exports.states()

    def picture(self) -> FleetPicture:
        """The fleet as :mod:`rollsafe.invariants` reads it (what the fleet records; the
        engines' ground truth is unknown here). ``check_all(fleet.picture())`` is the demo's
        final invariant check."""
        spares = self.spares
        return picture(
            self.registry,
            initial_version=self.config.initial_version,
            transport=self.transport,
            exporter=self.exporter,
            mode=self.mode,
            spare_groups=self.config.spare_groups,
            promotions=[p.picture() for p in spares.promotions()] if spares is not None else (),
        )

    def record(
        self,
        path: str | os.PathLike[str],
        *,
        t0: float | None = None,
        marks: Iterable[Mapping[str, Any]] = (),
        svg: bool = True,
    ) -> Path:
        """Write this fleet's run so far into the directory ``path``: ``timeline.jsonl`` (every
        machine transition, sync, recovery, crash mark and request-count sample,
        :mod:`rollsafe.observe.runfile`), ``fleet.json`` (:meth:`snapshot`) and, with ``svg``,
        ``timeline.svg`` (:mod:`rollsafe.observe.timeline_svg`). ``rollsafe report PATH`` reads
        it back. Works during the run and after :meth:`close`; returns ``path``. ``t0``: the
        run's start (wall clock; default :attr:`started_at`); ``marks``: extra points such as
        ``{"kind": "crash", "group": "g1", "timestamp": ...}`` (or use
        ``fleet.observer.mark_crash(group_id)`` when it happens)."""
        from rollsafe.observe.runfile import build_rows, write_run

        out = Path(path)
        rows = build_rows(self, t0=t0, marks=marks)
        write_run(out, rows, fleet_json=self.snapshot())
        if svg:
            from rollsafe.observe.timeline_svg import write_svg

            write_svg(out / "timeline.svg", rows)
        return out

    def snapshot(self) -> dict[str, Any]:
        """A JSON-friendly picture of the fleet right now."""
        control = self._control
        transport = self.transport
        deltas = transport.deltas if transport is not None else None
        membership = self.membership.snapshot() if self.membership is not None else {}
        return {
            "started": self.started,
            "transport": self.config.transport,
            "placement": {**self.placement.snapshot(), **membership},
            "registry": self.registry.snapshot(),
            "dispatch_counts": self.registry.dispatch_counts(),
            "mode": self.mode.state,
            "registration": transport.registration.state if transport is not None else None,
            "delta": dict(deltas.stats()) if deltas is not None else None,
            "exports": {str(v): s for v, s in self.export_states().items()},
            "recoveries": [r.as_dict() for r in self.recoveries()],
            "router": self.router.stats(),
            "health": control.health.stats() if control is not None else None,
            "request_health": control.request_health.stats() if control is not None else None,
            "spares": self.spares.snapshot() if self.spares is not None else None,
            "gateway": (
                {"url": self.gateway.url, **self.gateway.counters.as_dict()}
                if self.gateway is not None
                else None
            ),
            "external_routers": [sync.stats() for sync in self.router_syncs],
        }

    # ------------------------------------------------------------------ parts
    @property
    def group_ids(self) -> list[str]:
        return self.engines.ids

    @property
    def started(self) -> bool:
        return self._started and not self._closed

    @property
    def engine_traits(self) -> policy.EngineTraits:
        """How this fleet's engines fail (:class:`~rollsafe.policy.EngineTraits`)."""
        return self.config.engine_traits

    def engine(self, group_id: str) -> LaunchableEngine:
        """The handle of ``group_id``'s engine: an ``EngineLauncher``, a ``RayEngineGroup``
        (``placement="ray"``) or what the ``launcher_factory`` made."""
        self._require_started()
        return self.engines.handle(group_id)

    def launcher(self, group_id: str) -> EngineLauncher:
        """The launcher owning ``group_id``'s engine processes (chaos tests kill ranks here);
        :class:`FleetError` when the group is not run by an ``EngineLauncher`` (use
        :meth:`engine`)."""
        from rollsafe.adapters.engines import EngineLauncher

        engine = self.engine(group_id)
        if not isinstance(engine, EngineLauncher):
            raise FleetError(
                f"group {group_id!r} runs in a {type(engine).__name__}, not an EngineLauncher "
                f"(placement={self.config.placement!r}): use fleet.engine({group_id!r})"
            )
        return engine

    @property
    def transport(self) -> WeightTransport | None:
        """The transport syncs push through (None until :meth:`start`)."""
        return self._control.transport if self._control is not None else None

    @property
    def transport_fallback(self) -> str | None:
        """Why the configured transport could not serve the fleet (None: it is the one)."""
        return self._control.transport_fallback if self._control is not None else None

    @property
    def exporter(self) -> HFExporter | None:
        return self._control.exporter if self._control is not None else None

    @property
    def health(self) -> HealthManager | None:
        return self._control.health if self._control is not None else None

    @property
    def recovery(self) -> RecoveryCoordinator | None:
        return self._control.recovery if self._control is not None else None

    @property
    def sync(self) -> SyncCoordinator | None:
        return self._control.sync if self._control is not None else None

    @property
    def spares(self) -> SparePool | None:
        """The spares' pool (``FleetConfig.spare_groups``; None without spares or before
        :meth:`start`): its promotions, :meth:`~rollsafe.fleet.spares.SparePool.wait_idle`."""
        return self._control.spares if self._control is not None else None

    @property
    def request_health(self) -> RequestHealth | None:
        return self._control.request_health if self._control is not None else None

    def _require_started(self) -> None:
        if not self._started or self._closed:
            raise FleetNotStarted("call RolloutFleet.start() first (or use it as a context)")

    def _control_plane(self) -> ControlPlane:
        self._require_started()
        assert self._control is not None
        return self._control

    def _membership(self) -> Membership:
        self._require_started()
        assert self.membership is not None
        return self.membership

    def _apart(self, group_id: str) -> list[str]:
        """The groups ``group_id`` should not share a node with where it can: for a spare,
        the serving groups it covers; for a serving group, the spares (a node's loss should
        not take a group and the spare that would take over). Empty without spares."""
        if not self.config.spare_groups:
            return []
        roles = {p.group_id: p.spare for p in self.engines.plans()}
        for group in self.registry.groups():  # roles change with promotions
            roles[group.group_id] = group.machine.spare
        mine = roles.get(group_id, False)
        return [gid for gid, spare in roles.items() if spare != mine]

    def _request_failed(self, group_id: str, exc: BaseException | None = None) -> None:
        """The router's error hook: the observer's episodes, then request health."""
        self.observer.request_failed(group_id, exc)
        if self._control is not None:
            self._control.request_health.failed(group_id, exc)
