"""SyncCoordinator: one weight sync of the whole fleet, driving the machines in order.

Owns the sequence of one sync of version N (``docs/design.md``, "Fleet control"), always in this
order; every decision in it is :mod:`rollsafe.policy`'s (``judge_export``,
``proceed_after_register``, ``select_targets``, ``settle_update``), this module does the I/O:

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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import rollsafe.policy as policy
from rollsafe.fleet.registry import FleetError, FleetRegistry, WorkerGroup
from rollsafe.statemachines.base import TransitionRefused
from rollsafe.statemachines.events import GroupEvent
from rollsafe.statemachines.recovery_mode import ImmediateRecoveryMode
from rollsafe.text import bound_text

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from rollsafe.hf.retention import ExportRecord
    from rollsafe.statemachines.export import ExportLease
    from rollsafe.transports.base import EngineTarget, TargetResult, UpdateReport, WeightTransport

__all__ = [
    "ExportJudgement",
    "ExporterLike",
    "SyncCoordinator",
    "SyncError",
    "SyncReport",
    "SyncVersionError",
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
    from rollsafe.transports.base import EngineTarget

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
    weights_loaded: list[str] = field(default_factory=list)
    failed_groups: list[str] = field(default_factory=list)
    update_results: dict[str, TargetResult] = field(default_factory=dict)
    export_started: bool = False
    export_error: str | None = None
    fleet_version_before: int = 0
    fleet_version_after: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    started_at: float = 0.0

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
        }


class SyncCoordinator:
    """Runs weight syncs of a :class:`FleetRegistry`'s groups through one transport.

    ``transport``: any :class:`~rollsafe.transports.WeightTransport`. ``exporter``: an
    :class:`~rollsafe.hf.HFExporter` (optional: without it no export is judged or started).
    ``mode``: the fleet's :class:`ImmediateRecoveryMode` (optional). ``targets_for(group)``
    builds the transport target of a group (default :func:`default_target`).

    Colocated hooks (all optional, plain callables, run in this order around the update):
    ``offload_trainer()`` after register, ``onload_engines()`` before the update,
    ``onload_trainer()`` after it. ``health`` (a :class:`~rollsafe.fleet.HealthManager`) is
    paused from before the first hook until after the last one.

    ``on_update_failure``: ``"fail"`` (default) sends ``fail`` to a group whose update failed and
    calls ``on_group_failed(group_id, reason)`` (give it the recovery coordinator's ``submit``);
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
        self.abandon_wait_s = abandon_wait_s
        self.traits_for = traits_for or default_traits
        self.transport_lock = transport_lock or shared_transport_lock(transport)
        self._sync_lock = threading.Lock()
        self._last_export_version: int | None = None
        self._judged: set[int] = set()
        self._facts: dict[str, policy.GroupFacts] = {}  # the last sync's considered groups
        self._reports: deque[SyncReport] = deque(maxlen=_REPORTS_KEPT)

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
        return self._last_export_version

    def track_export(self, version: int) -> None:
        """Judge the export of ``version`` at the next sync, as if this coordinator had started
        it (for an export the embedding fleet started itself, e.g. of the initial weights)."""
        with self._sync_lock:
            self._last_export_version = version
            self._judged.discard(version)

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
                version, fleet_version_before=current, fleet_version_after=current,
                started_at=time.time(),
            )  # fmt: skip
            t_all = time.perf_counter()
            try:
                self._sync(weights, version, report, around_update)
            finally:
                report.timings["total_s"] = time.perf_counter() - t_all
                report.mode_state = self.mode.state if self.mode is not None else None
                self._reports.append(report)
            log.info(
                "sync v%d %s in %.3fs: updated %s, failed %s, stale %s, loaded %s; previous "
                "export %s; mode %s",
                version, "done" if report.ok else f"FAILED ({report.error})",
                report.timings["total_s"], report.updated, report.failed, report.marked_stale,
                report.weights_loaded, report.previous_export, report.mode_state,
            )  # fmt: skip
            return report

    def _sync(
        self,
        weights: Mapping[str, torch.Tensor] | list[tuple[str, torch.Tensor]],
        version: int,
        report: SyncReport,
        around_update: contextlib.AbstractContextManager[object] | None = None,
    ) -> None:
        timings = report.timings
        bracket = contextlib.ExitStack()  # around_update (#17), inside the health pause
        t = time.perf_counter()
        self._judge_previous_export(version, report)
        timings["judge_export_s"] = time.perf_counter() - t

        paused = trainer_back = False
        try:
            with self.transport_lock:
                t = time.perf_counter()
                log.info("sync v%d: registering with %s", version, _name(self.transport))
                try:
                    self.transport.register(weights, version)
                except Exception as exc:
                    report.error = bound_text(
                        f"register of v{version} failed: {type(exc).__name__}: {exc}", _MAX_ERROR
                    )
                    timings["register_s"] = time.perf_counter() - t
                    log.error(
                        "sync v%d: %s; fleet stays at v%d, nothing published",
                        version,
                        report.error,
                        report.fleet_version_before,
                    )
                    return
                timings["register_s"] = time.perf_counter() - t
                registration = getattr(self.transport, "registration", None)
                published = registration.published if registration is not None else ("", version)
                if not policy.proceed_after_register(published, version):
                    report.error = f"register of v{version} did not publish it ({published})"
                    log.error("sync v%d: %s; fleet stays at v%d", version, report.error,
                              report.fleet_version_before)  # fmt: skip
                    return

                if self.health is not None:
                    self.health.pause()
                    paused = True
                if around_update is not None:
                    bracket.enter_context(around_update)
                if not (
                    self._hook("offload_trainer", self.offload_trainer, report)
                    and self._hook("onload_engines", self.onload_engines, report)
                ):
                    return  # nothing was updated: the fleet stays at its version

                groups, targets = self._select_targets(report)
                generations = {gid: g.generation for gid, g in groups.items()}
                t = time.perf_counter()
                if targets:
                    log.info(
                        "sync v%d: updating %d group(s): %s",
                        version,
                        len(targets),
                        [tg.name for tg in targets],
                    )
                    update = self._update(targets, version)
                    report.update_results = dict(update.results)
                timings["update_s"] = time.perf_counter() - t

                t = time.perf_counter()
                self._record_versions(groups, generations, version, report)
                timings["versions_s"] = time.perf_counter() - t
                report.ok = True
            trainer_back = self._hook("onload_trainer", self.onload_trainer, report)
        finally:
            bracket.close()
            if paused and self.health is not None:
                self.health.resume()
        if not trainer_back:
            return  # the fleet moved on, but the trainer's tensors are not there to export

        t = time.perf_counter()
        self._start_export(weights, version, report)
        timings["export_start_s"] = time.perf_counter() - t

    # ------------------------------------------------------------------ steps
    def _judge_previous_export(self, version: int, report: SyncReport) -> None:
        exporter, prev = self.exporter, self._last_export_version
        if exporter is None or prev is None or prev in self._judged:
            return
        self._judged.add(prev)
        report.previous_export_version = prev
        try:
            handle = exporter.handle(prev)
        except Exception:  # the exporter no longer knows it: nothing to judge
            log.warning("sync v%d: export v%d is unknown to the exporter", version, prev)
            return
        mode = self.mode
        running = not handle.done()
        if running:
            observed = "writing"
        elif exporter.latest_ready(prev) is not None:
            observed = "ready"
        else:
            observed = str(handle.lifecycle.state)
        verdict = policy.judge_export(observed, mode.state if mode is not None else None)
        report.previous_export = verdict.judgement
        if mode is not None:
            for event in verdict.mode_events:
                mode.send(event)
        if verdict.abandon:
            abandoned = exporter.abandon(prev, reason=f"sync v{version} began first")
            log.warning(
                "sync v%d: export v%d was not ready in time: abandoned (%s), immediate "
                "recovery %s", version, prev, "stopping" if abandoned else "already finished",
                mode.state if mode is not None else "not configured",
            )  # fmt: skip
            if abandoned and self.abandon_wait_s > 0:
                try:
                    handle.wait(self.abandon_wait_s)
                except Exception as exc:  # ExportAbandoned is the expected outcome
                    log.debug("export v%d ended: %s", prev, exc)
            try:
                exporter.cleanup()
            except Exception:
                log.exception(
                    "sync v%d: cleaning up after abandoned export v%d failed", version, prev
                )
        elif verdict.judgement == "failed":
            log.warning(
                "sync v%d: export v%d failed (%s); it will not be offered for recovery",
                version,
                prev,
                observed,
            )

    def _hook(self, name: str, fn: Callable[[], object] | None, report: SyncReport) -> bool:
        """Run a colocated hook; a hook that raises is reported (``error``) and returns False."""
        if fn is None:
            return True
        t = time.perf_counter()
        log.info("sync v%d: running %s", report.version, name)
        try:
            fn()
        except Exception as exc:
            report.error = bound_text(f"{name} failed: {type(exc).__name__}: {exc}", _MAX_ERROR)
            log.error("sync v%d: %s", report.version, report.error)
            return False
        finally:
            report.timings[f"{name}_s"] = time.perf_counter() - t
        return True

    def _select_targets(
        self, report: SyncReport
    ) -> tuple[dict[str, WorkerGroup], list[EngineTarget]]:
        groups: dict[str, WorkerGroup] = {}
        facts: list[policy.GroupFacts] = []
        for group in self.registry.groups():
            members = group.machine.members
            facts.append(
                policy.GroupFacts(
                    group.group_id,
                    group.state,
                    tuple(group.ranks),
                    tuple(r for r, m in members.items() if not m.healthy),
                    self.traits_for(group).failed_update_keeps_weights,
                )
            )
            groups[group.group_id] = group
        selection = policy.select_targets(facts)
        report.not_targeted.update(selection.not_targeted)
        self._facts = {f.group_id: f for f in facts if f.group_id in selection.considered}
        targets: list[EngineTarget] = []
        for gid in selection.targets:
            try:
                target = self.targets_for(groups[gid])
            except Exception as exc:
                report.not_targeted[gid] = bound_text(
                    f"no target: {type(exc).__name__}: {exc}", 256
                )
                continue
            targets.append(target)
            report.targeted.append(target.name)
        names = [t.name for t in targets]
        missing = [g for g in names if g not in groups]
        if missing:
            raise SyncError(f"targets_for must name targets after their group ids; got {missing}")
        considered = {gid: groups[gid] for gid in selection.considered}
        return considered, targets

    def _update(self, targets: Sequence[EngineTarget], version: int) -> UpdateReport:
        from rollsafe.transports.base import TargetResult, UpdateReport

        try:
            return self.transport.update(targets)
        except Exception as exc:  # a collective set-up failure: every target failed
            reason = bound_text(f"{type(exc).__name__}: {exc}", _MAX_ERROR)
            log.error("sync v%d: update raised: %s", version, reason)
            return UpdateReport(
                name=_name(self.transport), version=version,
                results={t.name: TargetResult(t.name, False, reason) for t in targets},
            )  # fmt: skip

    def _record_versions(
        self,
        groups: Mapping[str, WorkerGroup],
        generations: Mapping[str, int],
        version: int,
        report: SyncReport,
    ) -> None:
        """Execute the policy's settlement of the update (versions, events, recoveries)."""
        reg = self.registry
        moved = [gid for gid in report.targeted if groups[gid].generation != generations[gid]]
        rank_ok = {
            gid: {rank: _ok_result(report.update_results.get(gid)) for rank in groups[gid].ranks}
            for gid in report.targeted
        }
        settlement = policy.settle_update(
            version,
            [self._facts[gid] for gid in groups],
            report.targeted,
            rank_ok,
            moved,
            self.on_update_failure,
        )
        report.updated = list(settlement.updated)
        report.failed = list(settlement.failed)
        for gid in settlement.moved:
            # It moved while we pushed (failed, claimed by a recovery): its members' facts
            # now describe a new incarnation; never credit it with this version.
            report.not_targeted[gid] = f"moved to {groups[gid].state} during the update"
        for gid in settlement.record_version:
            for rank, facts in groups[gid].machine.members.items():
                reg.report_member(gid, rank, healthy=facts.healthy, weights_version=version)
        reg.fleet_version = settlement.fleet_version
        report.fleet_version_after = settlement.fleet_version
        failed = set(settlement.failed)
        for gid, event in settlement.events:
            try:
                reg.send(gid, event)
            except TransitionRefused as exc:  # it moved meanwhile (failed, for instance)
                log.info("sync v%d: group %s: %s", version, gid, exc)
                continue
            if event is GroupEvent.FAIL:
                report.failed_groups.append(gid)
            elif event is GroupEvent.MARK_STALE:
                report.marked_stale.append(gid)
            elif event is GroupEvent.WEIGHTS_LOADED:
                report.weights_loaded.append(gid)
            if gid in failed:
                reason = report.update_results[gid].reason if gid in report.update_results else ""
                log.warning(
                    "sync v%d: update of group %s failed (%s): %s", version, gid, reason,
                    "taken out of routing" if event is GroupEvent.FAIL
                    else "left for the next sync",
                )  # fmt: skip
        for gid in settlement.recover:
            if self.on_group_failed is None or gid not in report.failed_groups:
                continue
            reason = report.update_results[gid].reason if gid in report.update_results else ""
            try:
                self.on_group_failed(gid, reason)
            except Exception:
                log.exception("on_group_failed raised for %s", gid)

    def _start_export(
        self,
        weights: Mapping[str, torch.Tensor] | list[tuple[str, torch.Tensor]],
        version: int,
        report: SyncReport,
    ) -> None:
        exporter = self.exporter
        if exporter is None or not report.ok:
            return
        if exporter.latest_ready(version) is not None:
            # the transport wrote it to sync through it (disk): the export is already there
            report.export_started = True
            self._last_export_version = version
            log.info("sync v%d: export already written by the transport", version)
            return
        try:
            exporter.start_hf_export(weights, version)
        except Exception as exc:
            report.export_error = bound_text(f"{type(exc).__name__}: {exc}", _MAX_ERROR)
            log.error("sync v%d: the export did not start: %s", version, report.export_error)
            return
        report.export_started = True
        self._last_export_version = version
        log.info("sync v%d: export started", version)


def _ok_result(result: TargetResult | None) -> bool:
    return result is not None and result.ok


def _name(transport: object) -> str:
    return str(getattr(transport, "name", type(transport).__name__))
