"""SyncCoordinator: one weight sync of the whole fleet, executing the sync's steps with real I/O.

The order of the steps of one sync of version N is :func:`rollsafe.operations.sync.sync`,
written once (``rollsafe verify`` executes the same sequence on its model); every decision in
it is :mod:`rollsafe.policy`'s (``judge_export``, ``proceed_after_register``,
``select_targets``, ``settle_update``). This module is its executor: it performs each effect
(register with the transport, pause health checks, run the hooks, update, send events, start
the export) with threads, locks, timings and logs, answers with the outcome, and fills the
:class:`SyncReport`. The steps, in order:

1. **judge the previous export** (version N-1): still running -> ``export_late`` on the
   :class:`~rollsafe.statemachines.ImmediateRecoveryMode`, the export is abandoned (never used,
   its temp dir removed); ready -> ``export_on_time`` (K of those re-arm a suspended mode);
   failed -> nothing (no export of N-1 will be offered, the mode is not about failures);
2. **register** N with the transport; a failed register ends the sync: the fleet version is
   unchanged, nothing was published, no group is touched, no export starts;
3. **update** every ``active`` and ``pending_weights`` group whose members are all healthy, in
   one ``transport.update(targets)`` (colocated mode: ``offload_trainer`` and
   ``onload_engines`` hooks run before it, ``onload_trainer`` after; the health manager, when
   given, is paused around them);
4. **versions**: updated groups' members report N; ``fleet_version`` becomes N; groups whose
   update failed are sent ``fail`` (their weights are in an unknown, possibly mixed state) and
   handed to ``on_group_failed`` (the recovery coordinator), or ``mark_stale`` under the
   ``"stale"`` policy when the engine kind keeps its weights after a failed update
   (:class:`~rollsafe.policy.EngineTraits`; no real engine does); ``active`` groups that
   were not updated get ``mark_stale``;
   ``pending_weights`` groups that were updated get ``weights_loaded``;
5. **export**: the async HF export of N starts (``exporter.start_hf_export``).

It also owns the transport's serialization: one transport must never register or update from
two threads at once (the registration machine would refuse it), so syncs and the recovery
coordinator's targeted pushes share :func:`shared_transport_lock`.

Importing this module does not import torch (the transports are imported when first used).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import rollsafe.operations.effects as fx
import rollsafe.policy as policy
from rollsafe.operations import sync as sync_op
from rollsafe.operations.effects import drive
from rollsafe.operations.executor import Executor, handles
from rollsafe.registry import FleetError, FleetRegistry, RegistryEffects, WorkerGroup
from rollsafe.statemachines.recovery_mode import ImmediateRecoveryMode
from rollsafe.text import bound_text

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from rollsafe.hf.retention import ExportRecord
    from rollsafe.ports import EngineTarget, TargetResult, WeightTransport
    from rollsafe.statemachines.export import ExportLease

__all__ = [
    "ExporterLike",
    "HandOffs",
    "SyncCoordinator",
    "SyncError",
    "SyncReport",
    "SyncVersionError",
    "TransportLocking",
    "default_target",
    "default_traits",
    "shared_transport_lock",
]

log = logging.getLogger(__name__)

#: How the previous export was judged when a sync began.
ExportJudgement = policy.ExportJudgement
#: What happens to a group whose update failed.
UpdateFailurePolicy = policy.UpdateFailurePolicy

_REPORTS_KEPT = 64
_MAX_ERROR = 1024

_locks: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
_locks_guard = threading.Lock()


def shared_transport_lock(transport: object) -> threading.RLock:
    """The one lock serializing ``register``/``update`` calls on ``transport``.

    Every coordinator built on the same transport object gets the same lock, so a targeted push
    never runs into a sync's register (the registration machine would refuse it).
    """
    with _locks_guard:
        lock = _locks.get(transport)
        if lock is None:
            lock = threading.RLock()
            _locks[transport] = lock
        return lock


def default_target(group: WorkerGroup) -> EngineTarget:
    """The transport target of ``group``: its first client, its ranks, one process per rank."""
    from rollsafe.ports import EngineTarget

    client = group.client
    if client is None:
        raise SyncError(
            f"worker group {group.group_id!r} has no engine client; pass targets_for= to build "
            "its transport target"
        )
    return EngineTarget(group.group_id, tuple(group.ranks), client, tp_size=len(group.ranks))


def default_traits(group: WorkerGroup) -> policy.EngineTraits:
    """A group's engine traits when the fleet does not say: the reference engine speaking its
    client's dialect (no client: an unknown engine, the careful traits)."""
    client = group.client
    if client is None:
        return policy.UNKNOWN_ENGINE
    return policy.engine_traits("reference", client.dialect)


class SyncError(FleetError):
    """A weight sync could not run at all (bad input or configuration)."""


class SyncVersionError(SyncError, ValueError):
    """The version to sync is not newer than the fleet's current version."""

    def __init__(self, current: int, requested: int) -> None:
        self.current = current
        self.requested = requested
        super().__init__(
            f"sync of version {requested} refused: the fleet is at version {current} and "
            "versions only move forward (sync a newer version)"
        )


class ExporterLike(Protocol):
    """What the coordinators need from an exporter (:class:`rollsafe.hf.HFExporter` has it)."""

    def start_hf_export(self, named_tensors: Any, version: int) -> Any: ...

    def abandon(self, version: int, reason: str = ...) -> bool: ...

    def handle(self, version: int | None = None) -> Any: ...

    def latest_ready(self, version: int | None = None) -> ExportRecord | None: ...

    def lease(self, version: int, holder: str = ...) -> ExportLease: ...

    def release(self, lease: ExportLease) -> None: ...

    def cleanup(self) -> list[Path]: ...

    def exports(self) -> list[ExportRecord]: ...


class _HealthPause(Protocol):
    def pause(self) -> None: ...

    def resume(self) -> None: ...


@dataclass
class SyncReport:
    """What one :meth:`SyncCoordinator.sync` did, group by group, with timings (seconds)."""

    version: int
    ok: bool = False
    error: str | None = None
    previous_export: ExportJudgement = "none"
    previous_export_version: int | None = None
    mode_state: str | None = None
    targeted: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    not_targeted: dict[str, str] = field(default_factory=dict)
    marked_stale: list[str] = field(default_factory=list)
    #: of ``marked_stale``: back ``active`` below N during the update, each handed to the
    #: recovery coordinator for the targeted push of N (``on_group_stale``)
    latecomers: list[str] = field(default_factory=list)
    weights_loaded: list[str] = field(default_factory=list)
    failed_groups: list[str] = field(default_factory=list)
    update_results: dict[str, TargetResult] = field(default_factory=dict)
    export_started: bool = False
    export_error: str | None = None
    fleet_version_before: int = 0
    fleet_version_after: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    started_at: float = 0.0
    #: the transport's deltas of this sync (``DeltaRecord.as_dict()``; None: deltas off)
    delta: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly view (demo report, logs)."""
        return {
            "version": self.version,
            "ok": self.ok,
            "error": self.error,
            "previous_export": self.previous_export,
            "previous_export_version": self.previous_export_version,
            "mode_state": self.mode_state,
            "targeted": list(self.targeted),
            "updated": list(self.updated),
            "failed": list(self.failed),
            "not_targeted": dict(self.not_targeted),
            "marked_stale": list(self.marked_stale),
            "latecomers": list(self.latecomers),
            "weights_loaded": list(self.weights_loaded),
            "failed_groups": list(self.failed_groups),
            "update_results": {
                k: {"ok": r.ok, "reason": r.reason, "seconds": r.seconds, "nbytes": r.nbytes}
                for k, r in self.update_results.items()
            },
            "export_started": self.export_started,
            "export_error": self.export_error,
            "fleet_version_before": self.fleet_version_before,
            "fleet_version_after": self.fleet_version_after,
            "timings": dict(self.timings),
            "started_at": self.started_at,
            "delta": self.delta,
        }


class SyncCoordinator:
    """Runs weight syncs of a :class:`FleetRegistry`'s groups through one transport.

    ``transport``: any :class:`~rollsafe.ports.WeightTransport`. ``exporter``: an
    :class:`~rollsafe.hf.HFExporter` (optional: without it no export is judged or started).
    ``mode``: the fleet's :class:`ImmediateRecoveryMode` (optional). ``targets_for(group)``
    builds the transport target of a group (default :func:`default_target`).

    Colocated hooks (all optional, plain callables, run in this order around the update):
    ``offload_trainer()`` after register, ``onload_engines()`` before the update,
    ``onload_trainer()`` after it. ``health`` (a :class:`~rollsafe.fleet.health.HealthManager`) is
    paused from before the first hook until after the last one.

    ``on_update_failure``: ``"fail"`` (default) sends ``fail`` to a group whose update failed and
    calls ``on_group_failed(group_id, reason)`` (give it the recovery coordinator's ``submit``);
    a group that came back ``active`` below N while the update ran is marked stale and given to
    ``on_group_stale(group_id, reason)`` (the coordinator's
    :meth:`~rollsafe.fleet.recovery.RecoveryCoordinator.on_group_stale`: the targeted push of
    N alone; None: it waits in ``pending_weights`` for the next sync);
    ``"stale"`` leaves such a group ``pending_weights`` for the next sync instead, but only when
    its engine kept the weights it had (``traits_for(group)``, a
    :class:`~rollsafe.policy.EngineTraits`; default: the reference engine in the group's client
    dialect). A group of an engine that does not (every real engine) is failed and recovered
    under either setting: its weights are unknown and its ``/health`` still answers.
    ``abandon_wait_s`` bounds how long a sync waits for an abandoned export's writer to stop.
    """

    def __init__(
        self,
        registry: FleetRegistry,
        transport: WeightTransport,
        *,
        exporter: ExporterLike | None = None,
        mode: ImmediateRecoveryMode | None = None,
        targets_for: Callable[[WorkerGroup], EngineTarget] | None = None,
        offload_trainer: Callable[[], object] | None = None,
        onload_engines: Callable[[], object] | None = None,
        onload_trainer: Callable[[], object] | None = None,
        health: _HealthPause | None = None,
        on_update_failure: UpdateFailurePolicy = "fail",
        on_group_failed: Callable[[str, str], object] | None = None,
        on_group_stale: Callable[[str, str], object] | None = None,
        abandon_wait_s: float = 10.0,
        transport_lock: threading.RLock | None = None,
        traits_for: Callable[[WorkerGroup], policy.EngineTraits] | None = None,
    ) -> None:
        if on_update_failure not in ("fail", "stale"):
            raise SyncError(
                f"on_update_failure must be 'fail' or 'stale', got {on_update_failure!r}"
            )
        if abandon_wait_s < 0:
            raise SyncError(f"abandon_wait_s must be >= 0, got {abandon_wait_s}")
        self.registry = registry
        self.transport = transport
        self.exporter = exporter
        self.mode = mode
        self.targets_for = targets_for or default_target
        self.offload_trainer = offload_trainer
        self.onload_engines = onload_engines
        self.onload_trainer = onload_trainer
        self.health = health
        self.on_update_failure: UpdateFailurePolicy = on_update_failure
        self.on_group_failed = on_group_failed
        self.on_group_stale = on_group_stale
        self.abandon_wait_s = abandon_wait_s
        self.traits_for = traits_for or default_traits
        self.transport_lock = transport_lock or shared_transport_lock(transport)
        #: the registry's effects (one handler in the code base)
        self.registry_effects = RegistryEffects(registry)
        #: the export the next sync judges
        self.exports = ExportTrack()
        self._sync_lock = threading.Lock()
        self._reports: deque[SyncReport] = deque(maxlen=_REPORTS_KEPT)
        #: reports that left :meth:`reports` (it keeps the last ones): a record written from
        #: memory misses them (a streamed run, ``FleetConfig.run_dir``, does not)
        self.reports_dropped = 0
        #: called with each sync's report as the sync ends (a streamed run writes it)
        self.on_report: Callable[[SyncReport], None] | None = None

    # ------------------------------------------------------------------ inspection
    def reports(self) -> list[SyncReport]:
        """The last syncs' reports, oldest first."""
        return list(self._reports)

    @property
    def last_report(self) -> SyncReport | None:
        return self._reports[-1] if self._reports else None

    @property
    def last_export_version(self) -> int | None:
        """The version whose export this coordinator started last."""
        return self.exports.last

    def track_export(self, version: int) -> None:
        """Judge the export of ``version`` at the next sync, as if this coordinator had started
        it (for an export the embedding fleet started itself, e.g. of the initial weights)."""
        with self._sync_lock:
            self.exports.started(version)

    # ------------------------------------------------------------------ the sync
    def sync(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        around_update: contextlib.AbstractContextManager[object] | None = None,
    ) -> SyncReport:
        """Sync ``version`` of ``named_tensors`` to the fleet; return what happened.

        ``around_update`` is entered once health checks are paused and left before they resume
        (:func:`rollsafe.fleet.partial_rollouts.paused_generation` pauses generation there).

        Raises :class:`SyncVersionError` (nothing changes) if ``version`` is not newer than the
        fleet's. Every other failure is reported in the returned :class:`SyncReport`: ``ok`` is
        False (and the fleet stays at its version) when registration or a pre-update hook
        failed; per-group update failures leave ``ok`` True and list the groups in ``failed``;
        an ``onload_trainer`` failure leaves ``ok`` True, sets ``error`` and starts no export.
        """
        if isinstance(version, bool) or not isinstance(version, int):
            raise SyncError(f"version must be an int, got {version!r}")
        weights: Mapping[str, torch.Tensor] | list[tuple[str, torch.Tensor]]
        weights = named_tensors if isinstance(named_tensors, Mapping) else list(named_tensors)
        with self._sync_lock:
            current = self.registry.fleet_version
            if version <= current:
                raise SyncVersionError(current, version)
            report = SyncReport(
                version,
                fleet_version_before=current,
                fleet_version_after=current,
                started_at=time.time(),
            )
            t_all = time.perf_counter()
            try:
                self._sync(weights, version, report, around_update)
            finally:
                report.timings["total_s"] = time.perf_counter() - t_all
                report.mode_state = self.mode.state if self.mode is not None else None
                if len(self._reports) == self._reports.maxlen:
                    self.reports_dropped += 1
                self._reports.append(report)
                if self.on_report is not None:
                    try:
                        self.on_report(report)
                    except Exception:
                        log.exception("sync v%d: the report hook failed (ignored)", version)
            log.info(
                "sync v%d %s in %.3fs: updated %s, failed %s, stale %s, loaded %s; previous "
                "export %s; mode %s",
                version,
                "done" if report.ok else f"FAILED ({report.error})",
                report.timings["total_s"],
                report.updated,
                report.failed,
                report.marked_stale,
                report.weights_loaded,
                report.previous_export,
                report.mode_state,
            )
            return report

    def _sync(
        self,
        weights: Mapping[str, torch.Tensor] | list[tuple[str, torch.Tensor]],
        version: int,
        report: SyncReport,
        around_update: contextlib.AbstractContextManager[object] | None = None,
    ) -> None:
        """Execute :func:`rollsafe.operations.sync.sync`: perform each effect with real I/O."""
        run = _SyncRun(self, weights, report, around_update)
        try:
            result = drive(sync_op.sync(version, on_failure=self.on_update_failure), run.perform)
        finally:
            run.close()  # an exception mid-sync: the transport lock and the pause are released
        for gid in result.failed:
            why = report.update_results[gid].reason if gid in report.update_results else ""
            settled = (
                "taken out of routing"
                if gid in result.failed_groups
                else "left for the next sync"
                if gid in result.marked_stale
                else "it moved meanwhile"
            )
            log.warning("sync v%d: update of group %s failed (%s): %s", version, gid, why, settled)
        report.ok = result.ok
        report.error = result.error
        report.previous_export = result.previous_export
        report.not_targeted = dict(result.not_targeted)
        report.updated = list(result.updated)
        report.failed = list(result.failed)
        report.failed_groups = list(result.failed_groups)
        report.marked_stale = list(result.marked_stale)
        report.latecomers = list(result.latecomers)
        report.weights_loaded = list(result.weights_loaded)
        report.export_started = result.export_started
        report.export_error = result.export_error
        if result.fleet_version is not None:
            report.fleet_version_after = result.fleet_version
        if result.error is not None and not result.ok:
            log.error(
                "sync v%d: %s; fleet stays at v%d, nothing published",
                version,
                result.error,
                report.fleet_version_before,
            )
        elif result.error is not None:
            log.error("sync v%d: %s; no export started", version, result.error)


class ExportTrack:
    """Which export the next sync judges: the one started last, judged once."""

    def __init__(self) -> None:
        self.last: int | None = None
        self._judged: set[int] = set()

    def started(self, version: int) -> None:
        """The export of ``version`` started (or was adopted): the next sync judges it."""
        self.last = version
        self._judged.discard(version)

    def take(self) -> int | None:
        """The export to judge now, once: None when there is none or it was judged."""
        if self.last is None or self.last in self._judged:
            return None
        self._judged.add(self.last)
        return self.last


class TransportLocking(Executor):
    """The one handler of :class:`~rollsafe.operations.effects.LockTransport` and
    :class:`~rollsafe.operations.effects.UnlockTransport`: holds ``lock`` (the transport's,
    :func:`shared_transport_lock`) between them; :meth:`release` lets it go if a sequence
    ended between the two (an exception). A sync's run and the spares' pool hold one each."""

    def __init__(self, lock: threading.RLock) -> None:
        self.lock = lock
        self.locked = False

    @handles(fx.LockTransport)
    def lock_transport(self, _effect: fx.LockTransport) -> fx.Outcome[None]:
        self.lock.acquire()
        self.locked = True
        return fx.DONE

    @handles(fx.UnlockTransport)
    def unlock_transport(self, _effect: fx.UnlockTransport) -> fx.Outcome[None]:
        self.release()
        return fx.DONE

    def release(self) -> None:
        if self.locked:
            self.locked = False
            self.lock.release()


class HandOffs(Executor):
    """The one handler of :class:`~rollsafe.operations.effects.HandOff`: a failed group goes
    to ``on_group_failed(group_id, reason_for(group_id))`` (the recovery's
    ``on_update_failed``: it only enqueues), a stale one (``push_only``) to
    ``on_group_stale(group_id, reason)`` (the recovery's ``on_group_stale``: the targeted push
    alone); a callback that raises is logged, never propagated."""

    def __init__(
        self,
        on_group_failed: Callable[[str, str], object] | None,
        reason_for: Callable[[str], str],
        on_group_stale: Callable[[str, str], object] | None = None,
    ) -> None:
        self.on_group_failed = on_group_failed
        self.reason_for = reason_for
        self.on_group_stale = on_group_stale

    @handles(fx.HandOff)
    def hand_off(self, effect: fx.HandOff) -> fx.Outcome[None]:
        if effect.push_only:
            callback, reason = self.on_group_stale, "back below the fleet's version"
        else:
            callback, reason = self.on_group_failed, self.reason_for(effect.group)
        if callback is None:
            return fx.DONE
        try:
            callback(effect.group, reason)
        except Exception:
            log.exception("the hand-off of %s raised", effect.group)
        return fx.DONE


class _SyncRun(Executor):
    """The fleet's executor of one sync's effects: the real I/O, the lock, the timings, the
    logs and the :class:`SyncReport`'s per-target details. Each handler declares the timing of
    :attr:`SyncReport.timings` its seconds count toward (``step=``; a hook times itself); the
    registry's effects (the settlement) are the registry's own handlers and count toward
    ``versions_s``."""

    parts = {
        RegistryEffects: "registry_effects",
        TransportLocking: "locking",
        HandOffs: "hand_offs",
    }

    def __init__(
        self,
        coordinator: SyncCoordinator,
        weights: Mapping[str, torch.Tensor] | list[tuple[str, torch.Tensor]],
        report: SyncReport,
        around_update: contextlib.AbstractContextManager[object] | None,
    ) -> None:
        self.c = coordinator
        self.registry_effects = coordinator.registry_effects
        self.weights = weights
        self.report = report
        self.around_update = around_update
        self.bracket = contextlib.ExitStack()  # around_update (#17), inside the health pause
        self.paused = False
        self.locking = TransportLocking(coordinator.transport_lock)
        self.hand_offs = HandOffs(
            coordinator.on_group_failed, self._failure_reason, coordinator.on_group_stale
        )
        self.handle: Any = None  # the previous export's handle, once observed
        self.groups: dict[str, WorkerGroup] = {}
        self.targets: list[EngineTarget] = []

    def perform(self, effect: fx.Effect[Any]) -> fx.Outcome[Any]:
        step = self.declared_steps.get(type(effect))
        if step is None and (type(effect) in RegistryEffects.table or type(effect) in _HANDED):
            step = "versions_s"
        t = time.perf_counter()
        try:
            return super().perform(effect)
        finally:
            if step is not None:
                timings = self.report.timings
                timings[step] = timings.get(step, 0.0) + time.perf_counter() - t

    def close(self) -> None:
        self.locking.release()
        self.resume(fx.Resume())

    def _failure_reason(self, group_id: str) -> str:
        result = self.report.update_results.get(group_id)
        return result.reason if result is not None else ""

    # -- the previous export
    @handles(fx.ObserveExport, step="judge_export_s")
    def observe_export(self, _effect: fx.ObserveExport) -> fx.Outcome[fx.ExportSeen | None]:
        c, report = self.c, self.report
        exporter = c.exporter
        prev = c.exports.take() if exporter is not None else None
        if exporter is None or prev is None:
            return fx.Ok(None)
        report.previous_export_version = prev
        mode_state = c.mode.state if c.mode is not None else None
        try:
            handle = exporter.handle(prev)
        except Exception:  # the exporter no longer knows it: nothing to judge
            log.warning("sync v%d: export v%d is unknown to the exporter", report.version, prev)
            return fx.Ok(fx.ExportSeen(prev, None, mode_state))
        self.handle = handle
        if not handle.done():
            observed = "writing"
        elif exporter.latest_ready(prev) is not None:
            observed = "ready"
        else:
            observed = str(handle.lifecycle.state)
        return fx.Ok(fx.ExportSeen(prev, observed, mode_state))

    @handles(fx.ExportJudged, step="judge_export_s")
    def export_judged(self, effect: fx.ExportJudged) -> fx.Outcome[None]:
        self.report.previous_export = effect.judgement
        if effect.judgement == "failed":
            log.warning(
                "sync v%d: export v%d failed (%s); it will not be offered for recovery",
                self.report.version,
                effect.version,
                effect.observed,
            )
        return fx.DONE

    @handles(fx.SendMode, step="judge_export_s")
    def send_mode(self, effect: fx.SendMode) -> fx.Outcome[None]:
        if self.c.mode is not None:
            self.c.mode.send(effect.event)
        return fx.DONE

    @handles(fx.AbandonExport, step="judge_export_s")
    def abandon_export(self, effect: fx.AbandonExport) -> fx.Outcome[None]:
        c, version, prev = self.c, self.report.version, effect.version
        exporter = c.exporter
        if exporter is None:
            return fx.DONE
        abandoned = exporter.abandon(prev, reason=effect.reason)
        log.warning(
            "sync v%d: export v%d was not ready in time: abandoned (%s), immediate recovery %s",
            version,
            prev,
            "stopping" if abandoned else "already finished",
            c.mode.state if c.mode is not None else "not configured",
        )
        if abandoned and c.abandon_wait_s > 0 and self.handle is not None:
            try:
                self.handle.wait(c.abandon_wait_s)
            except Exception as exc:  # ExportAbandoned is the expected outcome
                log.debug("export v%d ended: %s", prev, exc)
        try:
            exporter.cleanup()
        except Exception:
            log.exception("sync v%d: cleaning up after abandoned export v%d failed", version, prev)
        return fx.DONE

    # -- register, pause, hooks
    @handles(fx.Register, step="register_s")
    def register(self, effect: fx.Register) -> fx.Outcome[tuple[str, int] | None]:
        transport = self.c.transport
        log.info("sync v%d: registering with %s", effect.version, transport.name)
        try:
            transport.register(self.weights, effect.version)
        except Exception as exc:
            return fx.Failed(f"{type(exc).__name__}: {exc}")
        return fx.Ok(transport.registration.published)

    @handles(fx.Pause)
    def pause(self, _effect: fx.Pause) -> fx.Outcome[None]:
        if self.c.health is not None:
            self.c.health.pause()
            self.paused = True
        if self.around_update is not None:
            self.bracket.enter_context(self.around_update)
        return fx.DONE

    @handles(fx.Resume)
    def resume(self, _effect: fx.Resume) -> fx.Outcome[None]:
        self.bracket.close()
        if self.paused and self.c.health is not None:
            self.paused = False
            self.c.health.resume()
        return fx.DONE

    @handles(fx.Hook)
    def hook(self, effect: fx.Hook) -> fx.Outcome[None]:
        """Run a colocated hook; one that raises is :class:`~rollsafe.operations.Failed`."""
        hooks: dict[str, Callable[[], object] | None] = {
            "offload_trainer": self.c.offload_trainer,
            "onload_engines": self.c.onload_engines,
            "onload_trainer": self.c.onload_trainer,
        }
        fn = hooks[effect.name]  # a KeyError: the operation names a hook the fleet lacks
        if fn is None:
            return fx.DONE
        t = time.perf_counter()
        log.info("sync v%d: running %s", self.report.version, effect.name)
        try:
            fn()
        except Exception as exc:
            return fx.Failed(f"{type(exc).__name__}: {exc}")
        finally:
            self.report.timings[f"{effect.name}_s"] = time.perf_counter() - t
        return fx.DONE

    # -- the update
    @handles(fx.ReadGroups, step="update_s")
    def read_groups(self, _effect: fx.ReadGroups) -> fx.Outcome[tuple[policy.GroupFacts, ...]]:
        facts: list[policy.GroupFacts] = []
        for group in self.c.registry.groups():
            members = group.machine.members
            facts.append(
                policy.GroupFacts(
                    group.group_id,
                    group.state,
                    tuple(group.ranks),
                    tuple(r for r, m in members.items() if not m.healthy),
                    self.c.traits_for(group).failed_update_keeps_weights,
                    tuple(members[r].weights_version for r in sorted(members)),
                )
            )
            self.groups[group.group_id] = group
        return fx.Ok(tuple(facts))

    @handles(fx.PrepareTargets, step="update_s")
    def prepare_targets(self, effect: fx.PrepareTargets) -> fx.Outcome[Mapping[str, str]]:
        refused: dict[str, str] = {}
        for facts in effect.groups:
            gid = facts.group_id
            try:
                target = self.c.targets_for(self.groups[gid])
            except Exception as exc:
                refused[gid] = bound_text(f"no target: {type(exc).__name__}: {exc}", 256)
                continue
            self.targets.append(target)
            self.report.targeted.append(target.name)
        missing = [t.name for t in self.targets if t.name not in self.groups]
        if missing:
            raise SyncError(f"targets_for must name targets after their group ids; got {missing}")
        return fx.Ok(refused)

    @handles(fx.Update, step="update_s")
    def update(self, effect: fx.Update) -> fx.Outcome[fx.UpdateDone]:
        from rollsafe.ports import TargetResult

        report, targets, groups = self.report, self.targets, self.groups
        generations = {t.name: groups[t.name].generation for t in targets}
        log.info(
            "sync v%d: updating %d group(s): %s",
            effect.version,
            len(targets),
            [t.name for t in targets],
        )
        try:
            update = self.c.transport.update(targets)
        except Exception as exc:  # a collective set-up failure: every target failed
            reason = bound_text(f"{type(exc).__name__}: {exc}", _MAX_ERROR)
            log.error("sync v%d: update raised: %s", effect.version, reason)
            report.update_results = {t.name: TargetResult(t.name, False, reason) for t in targets}
            return fx.Failed(reason)
        report.update_results = dict(update.results)
        deltas = self.c.transport.deltas
        record = deltas.last() if deltas is not None else None
        if record is not None and record.version == effect.version:
            report.delta = record.as_dict()
            log.info("sync v%d: %s", effect.version, record.summary())
        rank_ok = {
            t.name: {rank: _ok_result(update.results.get(t.name)) for rank in groups[t.name].ranks}
            for t in targets
        }
        moved = {
            t.name: groups[t.name].state
            for t in targets
            if groups[t.name].generation != generations[t.name]
        }
        return fx.Ok(fx.UpdateDone(rank_ok, moved))

    # -- the settlement: the registry's effects are the registry's handlers, the hand-offs
    # -- the recovery's (HandOffs)

    # -- the export
    @handles(fx.StartExport, step="export_start_s")
    def start_export(self, effect: fx.StartExport) -> fx.Outcome[bool]:
        c, version = self.c, effect.version
        exporter = c.exporter
        if exporter is None:
            return fx.Ok(False)
        if exporter.latest_ready(version) is not None:
            # the transport wrote it to sync through it (disk): the export is already there
            c.exports.started(version)
            log.info("sync v%d: export already written by the transport", version)
            return fx.Ok(True)
        try:
            exporter.start_hf_export(self.weights, version)
        except Exception as exc:
            error = bound_text(f"{type(exc).__name__}: {exc}", _MAX_ERROR)
            log.error("sync v%d: the export did not start: %s", version, error)
            return fx.Failed(error)
        c.exports.started(version)
        log.info("sync v%d: export started", version)
        return fx.Ok(True)


#: the settlement's effects handed to parts (timed as ``versions_s`` with the registry's)
_HANDED = frozenset(HandOffs.table)


def _ok_result(result: TargetResult | None) -> bool:
    return result is not None and result.ok
