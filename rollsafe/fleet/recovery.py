"""RecoveryCoordinator: bring failed worker groups back, off the health checks' threads.

Owns the recovery of ``inactive`` groups (``docs/design.md``, "Operations"). The order of
an attempt's steps is :func:`rollsafe.operations.recover.attempt`'s (the sequence ``rollsafe
verify`` executes too) and every decision in it (claim, skip, retire, strategy, what a restart
or a push means) is :mod:`rollsafe.policy`'s; this module executes its effects and does the I/O
(``_AttemptExecutor``: threads, deadlines, the launcher, the client, the transport, timings;
each blocking step is declared once, on its handler, as a :class:`~rollsafe.fleet.steps.TimedStep`:
it runs on its own daemon thread under the attempt's deadline, its record is written once, and
its outcome is typed, a time-out saying whether the step began).
:meth:`RecoveryCoordinator.submit` (what the health manager's ``on_group_failed`` callback
calls) only enqueues: recoveries run on a bounded worker pool, one at a time per group (a second
submit while one runs returns the same future). Each recovery is a sequence of machine events
and engine steps:

``skip?`` -> ``claim`` -> (lease) -> ``shutdown`` -> ``restart`` -> ``health`` -> ``restarted`` ->
(``push`` -> ``weights_loaded``)

with the strategy chosen in this order:

1. **immediate**: the :class:`~rollsafe.statemachines.ImmediateRecoveryMode` allows it and the
   exporter has a ``ready`` export of the fleet's current version: a lease is taken on it, the
   group restarts with ``model_path=<export dir>``, its members report that version, and
   ``restarted`` takes it straight to ``active``. The lease is released only once the restart
   step has ended (also when it timed out and is still loading in the background), so the
   directory is never deleted under a loading engine. With an ``export_mover`` (a Ray-placed
   group whose node cannot read the exporter's path: ``docs/cluster.md`` section 5) the export
   is first pulled to the group's node (a ``pull`` step: ``pulled N bytes``, checked against
   its manifest there) and the restart loads that copy; a pull refused or failed falls back
   to 2 (the ``strategy`` step says why), never loading unverified bytes;
2. **targeted push**: the group restarts on dummy weights (``skip_load_weights=True``),
   ``restarted`` -> ``pending_weights``, then the transport's registered checkpoint of the
   current version is pushed to that group only and ``weights_loaded`` -> ``active``. The push
   is ``transport.targeted_update([target])`` when the transport has one (checkpoint-engine in a
   fleet: P2P, ``ranks=[that group's ranks]``, never a broadcast; the ``push`` step's detail
   names the mode and ranks), else ``transport.update([target])``. A transport that cannot
   reach just one group (checkpoint-engine without usable P2P raises ``P2PUnavailable``, a
   ``TransportError``, before anything moves) falls through to 3. A push that fails (or is cut
   short) on an engine that keeps no known weights after a failed update (every real engine:
   :class:`~rollsafe.policy.EngineTraits`, ``traits_for``) sends ``fail``: the group is
   restarted again (budget permitting), never left waiting on weights nobody knows;
3. **deferred**: the group waits in ``pending_weights`` for the next sync.

Recovery is skipped, with the reason logged and recorded, when ``remaining_work_s()`` says the
rollout ends before ``expected_recovery_s``. A ``claim`` refused because the restart budget is
spent retires the group (the fleet keeps serving with the rest). A restart that raises or passes
``recovery_timeout_s`` sends ``restart_failed`` and, with ``retry=True``, is tried again while
budget lasts. Blocking steps run on their own daemon threads under the recovery's deadline, so a
hung engine never holds a pool worker past its timeout, never blocks another recovery and never
touches the health checks. Every step is timed in a :class:`RecoveryResult`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import rollsafe.operations.effects as fx
import rollsafe.policy as policy
from rollsafe.concurrency import DaemonCall
from rollsafe.fleet.engines import EngineEffects
from rollsafe.fleet.settings import RecoverySettings
from rollsafe.fleet.steps import RecoveryStep, StepLog, TimedStep
from rollsafe.fleet.sync import (
    ExporterLike,
    default_target,
    default_traits,
    shared_transport_lock,
)
from rollsafe.operations import place as place_op
from rollsafe.operations import recover as recover_op
from rollsafe.operations.effects import drive
from rollsafe.operations.executor import Executor, handles
from rollsafe.operations.recover import RecoveryStatus
from rollsafe.ports import PlaceableEngine, RestartableEngine, StandbyState, StartSource
from rollsafe.registry import FleetError, FleetRegistry, RegistryEffects, UnknownGroup, WorkerGroup
from rollsafe.statemachines.recovery_mode import ImmediateRecoveryMode
from rollsafe.text import bound_text

if TYPE_CHECKING:
    from rollsafe.fleet.health import GroupFailure
    from rollsafe.ports import EngineClient, EngineTarget, UpdateReport, WeightTransport
    from rollsafe.statemachines.export import ExportLease

__all__ = [
    "ExportMoverLike",
    "RecoveryClosed",
    "RecoveryCoordinator",
    "RecoveryError",
    "RecoveryResult",
    "StepTimeout",
]

log = logging.getLogger(__name__)

START_SOURCES: tuple[StartSource, ...] = ("ready_standby", "warming_standby", "fresh_spawn")
#: the decisions an attempt begins with (its number and its deadline start there)
_BEGINS_ATTEMPT = frozenset({"claim", "place"})

_RESULTS_KEPT = 512
_MAX_TEXT = 512


class ExportMoverLike(Protocol):
    """What moves a verified export to a group's node (``moved`` mode;
    :class:`rollsafe.adapters.ray.exports.ExportMover`):
    ``pull(group_id, version, path, timeout_s=)`` returns the node's checked copy (``path``,
    ``nbytes``, ``reused``, ``node_id``) within ``timeout_s``, or raises."""

    def pull(
        self, group_id: str, version: int, path: str, *, timeout_s: float | None = None
    ) -> Any: ...


class RecoveryError(FleetError):
    """A recovery step failed (the message names the group and the step)."""


class RecoveryClosed(RecoveryError):
    """The coordinator was closed; no new recovery is accepted."""


class StepTimeout(RecoveryError, TimeoutError):
    """A recovery step did not finish before the recovery's deadline."""

    def __init__(self, group_id: str, step: str, seconds: float) -> None:
        self.group_id = group_id
        self.step = step
        super().__init__(
            f"group {group_id!r}: step {step!r} did not finish within its deadline "
            f"({seconds:.1f}s left when it started); it continues on a background thread"
        )


@dataclass(frozen=True)
class RecoveryResult:
    """The record of one recovery of one group.

    Timestamps are wall-clock (``time.time()``); ``failed_at`` is when the failure was detected
    (the health manager's ``GroupFailure.timestamp``, else the submit time). ``latency_s`` is
    failure -> ``active`` when the group got there. ``status`` and ``strategy`` are the last
    attempt's (:data:`~rollsafe.operations.recover.RecoveryStatus`,
    :class:`~rollsafe.policy.Strategy`).

    ``standby_at_restart``: the group's warm standby when the (last) attempt began (``none``,
    ``warming``, ``ready``); ``restart_source``: where the restarted engine came from
    (``ready_standby``, ``warming_standby``, ``fresh_spawn``). Both None when the handle does
    not tell (not an ``EngineLauncher``) or no restart succeeded.
    """

    group_id: str
    status: RecoveryStatus
    strategy: policy.Strategy | None
    reason: str
    failed_at: float
    submitted_at: float
    started_at: float
    finished_at: float
    active_at: float | None
    attempts: int
    export_version: int | None
    fleet_version: int
    steps: tuple[RecoveryStep, ...] = ()
    standby_at_restart: str | None = None
    restart_source: StartSource | None = None

    @property
    def latency_s(self) -> float | None:
        """Failure detected -> group ``active`` again (None if it did not get there)."""
        return None if self.active_at is None else self.active_at - self.failed_at

    @property
    def queued_s(self) -> float:
        return self.started_at - self.submitted_at

    @property
    def duration_s(self) -> float:
        return self.finished_at - self.started_at

    def step_seconds(self, name: str) -> float:
        """Total seconds spent in steps called ``name`` (every attempt)."""
        return sum(s.seconds for s in self.steps if s.name == name)

    def as_dict(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "status": self.status,
            "strategy": self.strategy.value if self.strategy is not None else None,
            "reason": self.reason,
            "failed_at": self.failed_at,
            "submitted_at": self.submitted_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "active_at": self.active_at,
            "latency_s": self.latency_s,
            "attempts": self.attempts,
            "export_version": self.export_version,
            "fleet_version": self.fleet_version,
            "standby_at_restart": self.standby_at_restart,
            "restart_source": self.restart_source,
            "steps": [s.as_dict() for s in self.steps],
        }


class _Run:
    """One recovery while it runs (it becomes a :class:`RecoveryResult`): its step log and
    what its attempts found."""

    def __init__(self, group_id: str, failed_at: float, submitted_at: float) -> None:
        self.group_id = group_id
        self.failed_at = failed_at
        self.submitted_at = submitted_at
        self.started_at = 0.0
        self.strategy: policy.Strategy | None = None
        self.export_version: int | None = None
        self.active_at: float | None = None
        self.standby_at_restart: str | None = None
        self.restart_source: StartSource | None = None
        #: a group added at runtime behind the fleet's version: only the targeted push
        self.catch_up = False
        self.log = StepLog(label=f"recovery of {group_id}: ")


class BusyGroups:
    """Groups whose last attempt left a step running in the background (it timed out): no new
    recovery starts on one until that step's thread ends (it may still be using the engine)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._until: dict[str, threading.Event] = {}

    def mark(self, group_id: str, finished: threading.Event) -> None:
        with self._lock:
            self._until[group_id] = finished

    def clear(self, group_id: str, finished: threading.Event) -> None:
        with self._lock:
            if self._until.get(group_id) is finished:
                del self._until[group_id]

    def busy(self, group_id: str) -> bool:
        with self._lock:
            finished = self._until.get(group_id)
        return finished is not None and not finished.is_set()


class RecoveryCoordinator:
    """Runs recoveries of a :class:`FleetRegistry`'s failed groups on a bounded pool.

    ``launcher_for(group_id)`` returns the group's :class:`RestartableEngine` handle.
    ``settings`` (:class:`~rollsafe.fleet.settings.RecoverySettings`) holds every knob: workers,
    the attempt's deadline, retries, the stop grace, the skip estimate. ``exporter`` (an
    :class:`~rollsafe.hf.HFExporter`) and ``mode`` enable the immediate strategy; ``transport``
    (the sync's transport: the same object, so they share its lock) enables the targeted push;
    ``targets_for(group)`` builds its target (default: the group's restarted client).
    ``export_mover`` (:class:`ExportMoverLike`): the groups' nodes cannot read the exporter's
    path, so an immediate restart first pulls the export to the group's node (a ``pull`` step,
    ``pulled N bytes``) and loads that checked copy; a refused pull falls back to the targeted
    push. Thread-safe; use as a context manager or call :meth:`close`.
    """

    def __init__(
        self,
        registry: FleetRegistry,
        *,
        launcher_for: Callable[[str], RestartableEngine],
        settings: RecoverySettings | None = None,
        exporter: ExporterLike | None = None,
        transport: WeightTransport | None = None,
        mode: ImmediateRecoveryMode | None = None,
        targets_for: Callable[[WorkerGroup], EngineTarget] | None = None,
        traits_for: Callable[[WorkerGroup], policy.EngineTraits] | None = None,
        transport_lock: threading.RLock | None = None,
        export_mover: ExportMoverLike | None = None,
        name: str = "rollsafe-recovery",
    ) -> None:
        self.settings = rs = settings if settings is not None else RecoverySettings()
        if not isinstance(rs, RecoverySettings):
            raise TypeError(f"settings must be a RecoverySettings, got {rs!r}")
        self.registry = registry
        self.launcher_for = launcher_for
        self.exporter = exporter
        self.transport = transport
        self.mode = mode
        self.targets_for = targets_for or default_target
        self.traits_for = traits_for or default_traits
        #: how long a placed group's actor may take to answer before its node counts as lost
        self.placement_check_s = 5.0
        self.transport_lock = transport_lock or (
            shared_transport_lock(transport) if transport is not None else threading.RLock()
        )
        self.name = name
        #: moves an export to a Ray-placed group's node before a restart from it (the
        #: ``moved`` mode, docs/cluster.md section 5); None: engines read the exporter's path
        self.export_mover = export_mover
        #: the registry's effects and the engines' (one handler each in the code base)
        self.registry_effects = RegistryEffects(registry)
        self.engine_effects = EngineEffects(launcher_for, stop_timeout_s=rs.stop_timeout_s)
        #: groups a timed-out step still runs on
        self.busy = BusyGroups()
        self._pool = concurrent.futures.ThreadPoolExecutor(rs.max_workers, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._inflight: dict[str, concurrent.futures.Future[RecoveryResult]] = {}
        self._results: deque[RecoveryResult] = deque(maxlen=_RESULTS_KEPT)
        #: results that left :meth:`recoveries` (it keeps the last ones): a record written
        #: from memory misses them (a streamed run, ``FleetConfig.run_dir``, does not)
        self.results_dropped = 0
        #: called with each recovery's result as it ends (a streamed run writes it)
        self.on_result: Callable[[RecoveryResult], None] | None = None
        self._closed = False

    # ------------------------------------------------------------------ submitting
    def submit(
        self,
        group_id: str,
        *,
        failed_at: float | None = None,
        reason: str = "",
        catch_up: bool = False,
    ) -> concurrent.futures.Future[RecoveryResult]:
        """Queue a recovery of ``group_id`` and return its future; never blocks.

        An ``unplaced`` group (its node died) is placed again first
        (:func:`rollsafe.operations.place.attempt`); ``catch_up``: the group waits in
        ``pending_weights`` (added at runtime, or marked stale by a sync: :meth:`on_group_stale`):
        only the targeted push runs.

        Idempotent: while a recovery of this group is queued or running, the same future is
        returned. Raises :class:`RecoveryClosed` after :meth:`close`, :class:`UnknownGroup`
        for a group the registry does not know.
        """
        self.registry.get(group_id)  # UnknownGroup, early and loud
        now = time.time()
        with self._lock:
            if self._closed:
                raise RecoveryClosed(f"{self.name}: closed; recovery of {group_id!r} refused")
            existing = self._inflight.get(group_id)
            if existing is not None and not existing.done():
                return existing
            run = _Run(group_id, failed_at if failed_at is not None else now, now)
            run.catch_up = catch_up
            future = self._pool.submit(self._recover, run, reason)
            self._inflight[group_id] = future
        future.add_done_callback(functools.partial(self._forget, group_id))
        log.info(
            "%s: recovery of %s queued%s",
            self.name,
            group_id,
            f" ({bound_text(reason, 200)})" if reason else "",
        )
        return future

    def on_group_failed(self, failure: GroupFailure) -> None:
        """The :class:`~rollsafe.fleet.health.HealthManager` callback: enqueue, return at once."""
        self.submit(failure.group_id, failed_at=failure.timestamp, reason=failure.reason)

    def on_update_failed(self, group_id: str, reason: str) -> None:
        """The :class:`~rollsafe.fleet.sync.SyncCoordinator` and request-health callback:
        enqueue the group whose update (or requests) failed."""
        self.submit(group_id, reason=reason)

    def on_group_stale(self, group_id: str, reason: str) -> None:
        """The :class:`~rollsafe.fleet.sync.SyncCoordinator` callback for a group a sync marked
        stale (back ``active`` below the new version while its update ran): enqueue the
        targeted push of the registered checkpoint alone (``catch_up``); a push that cannot
        happen leaves it in ``pending_weights`` for the next sync.

        The recovery whose restart brought it back is usually still finishing (its result not
        yet recorded): :meth:`submit` would hand back that run's future and the push would
        never run, so the push is queued when that run ends."""
        with self._lock:
            running = self._inflight.get(group_id)
        if running is None or running.done():
            self._submit_push(group_id, reason)
            return
        running.add_done_callback(lambda _f: self._submit_push(group_id, reason))

    def _submit_push(self, group_id: str, reason: str) -> None:
        try:
            self.submit(group_id, reason=reason, catch_up=True)
        except (RecoveryClosed, UnknownGroup) as exc:  # closing, or the group was removed
            log.info("%s: no push for stale %s: %s", self.name, group_id, exc)

    def recover_inactive(self) -> list[str]:
        """Submit every ``inactive`` group not already being recovered (e.g. after a skip,
        when a new rollout begins); return their ids."""
        submitted = []
        for group in self.registry.groups():
            if group.state == "inactive" and not self.in_progress(group.group_id):
                self.submit(group.group_id, reason="inactive group picked up")
                submitted.append(group.group_id)
        return submitted

    def _forget(self, group_id: str, future: concurrent.futures.Future[RecoveryResult]) -> None:
        with self._lock:
            if self._inflight.get(group_id) is future:
                del self._inflight[group_id]

    # ------------------------------------------------------------------ inspection
    def in_progress(self, group_id: str) -> bool:
        """Whether a recovery of ``group_id`` is queued or running."""
        with self._lock:
            future = self._inflight.get(group_id)
        return future is not None and not future.done()

    def running(self) -> list[str]:
        """The ids of the groups whose recovery is queued or running."""
        with self._lock:
            return [g for g, f in self._inflight.items() if not f.done()]

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no recovery is queued or running (each one's own future, no polling);
        True when that happened within ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                futures = [f for f in self._inflight.values() if not f.done()]
            if not futures:
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            concurrent.futures.wait(futures, timeout=left)

    def recoveries(self) -> list[RecoveryResult]:
        """Finished recoveries, oldest first (the last 512)."""
        with self._lock:
            return list(self._results)

    def summary(self) -> dict[str, Any]:
        """Counts by status, strategy and restart source, and latency figures, for reports."""
        results = self.recoveries()
        latencies = sorted(r.latency_s for r in results if r.latency_s is not None)
        by_status: dict[str, int] = {}
        by_strategy: dict[str, int] = {}
        by_source: dict[str, int] = {}
        for r in results:
            by_status[r.status] = by_status.get(r.status, 0) + 1
            if r.strategy is not None:
                by_strategy[r.strategy.value] = by_strategy.get(r.strategy.value, 0) + 1
            if r.restart_source is not None:
                by_source[r.restart_source] = by_source.get(r.restart_source, 0) + 1
        return {
            "recoveries": len(results),
            "by_status": by_status,
            "by_strategy": by_strategy,
            "by_restart_source": by_source,
            "latency_s": {
                "min": latencies[0] if latencies else None,
                "median": latencies[len(latencies) // 2] if latencies else None,
                "max": latencies[-1] if latencies else None,
            },
        }

    # ------------------------------------------------------------------ shutdown
    def close(self, timeout: float = 10.0) -> bool:
        """Refuse new recoveries, wait up to ``timeout`` s for running ones; True if all ended.

        Running recoveries are not interrupted (a restart half-way is worse than a wait); queued
        ones that have not started are cancelled.
        """
        with self._lock:
            self._closed = True
            futures = list(self._inflight.values())
        for f in futures:
            f.cancel()
        _done, not_done = concurrent.futures.wait(futures, timeout=timeout)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if not_done:
            log.warning("%s: %d recovery(ies) still running at close", self.name, len(not_done))
        return not not_done

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> RecoveryCoordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ one recovery
    def _recover(self, run: _Run, reason: str) -> RecoveryResult:
        run.started_at = time.time()
        gid = run.group_id
        status: RecoveryStatus
        why: str
        try:
            status, why = self._recover_loop(run)
        except Exception as exc:  # a bug or an unexpected error: recorded, never lost
            log.exception("%s: recovery of %s crashed", self.name, gid)
            status, why = "failed", f"internal error: {type(exc).__name__}: {exc}"
        result = RecoveryResult(
            group_id=gid,
            status=status,
            strategy=run.strategy,
            reason=bound_text(why, _MAX_TEXT),
            failed_at=run.failed_at,
            submitted_at=run.submitted_at,
            started_at=run.started_at,
            finished_at=time.time(),
            active_at=run.active_at,
            attempts=run.log.attempt,
            export_version=run.export_version,
            fleet_version=self.registry.fleet_version,
            steps=run.log.steps,
            standby_at_restart=run.standby_at_restart,
            restart_source=run.restart_source,
        )
        with self._lock:
            if len(self._results) == self._results.maxlen:
                self.results_dropped += 1
            self._results.append(result)
        if self.on_result is not None:
            try:
                self.on_result(result)
            except Exception:
                log.exception("recovery of %s: the result hook failed (ignored)", result.group_id)
        level = (
            logging.INFO
            if status in ("active", "pending_weights", "not_needed")
            else (logging.WARNING)
        )
        log.log(
            level,
            "%s: recovery of %s -> %s (strategy %s, %d attempt(s), latency %s): %s",
            self.name,
            gid,
            status,
            run.strategy.value if run.strategy is not None else None,
            run.log.attempt,
            "n/a" if result.latency_s is None else f"{result.latency_s:.3f}s",
            result.reason,
        )
        return result

    def _recover_loop(self, run: _Run) -> tuple[RecoveryStatus, str]:
        """Run attempts of :func:`rollsafe.operations.recover.attempt` until one ends the
        recovery (retrying, budget permitting, when ``retry`` is on)."""
        gid = run.group_id
        retried = False
        while True:
            try:
                group = self.registry.get(gid)
            except UnknownGroup:
                return "not_needed", "the group was removed from the registry"
            traits = self.traits_for(group)
            if group.state == "unplaced":  # its node died: place it again, then recover
                steps = place_op.attempt(gid, traits)
            elif run.catch_up and group.state == "pending_weights" and not retried:
                steps = recover_op.push(gid, traits)
            else:
                steps = recover_op.attempt(gid, traits, retried=retried)
            end = drive(steps, _AttemptExecutor(self, run, group).perform)
            if end.strategy is not None:
                run.strategy = end.strategy
            if end.export_version is not None:
                run.export_version = end.export_version
            if end.status == "active":
                run.active_at = time.time()
            elif end.status == "skipped":
                log.warning("%s: recovery of %s skipped: %s", self.name, gid, end.reason)
            elif end.status == "retired":
                log.error(
                    "%s: group %s retired: restart budget (%d) spent; the fleet goes on without it",
                    self.name,
                    gid,
                    group.machine.initial_restart_budget,
                )
            if end.status == "unplaced" and end.retry and not self._closed:
                continue  # the gate found its node lost: place the group now (no budget)
            if end.status != "failed" or not (end.retry or end.timed_out):
                return end.status, end.reason
            log.warning(
                "%s: attempt %d for %s failed: %s", self.name, run.log.attempt, gid, end.reason
            )
            if not self.settings.retry or not end.retry or self._closed:
                return "failed", end.reason
            retried = True
            if self.settings.retry_delay_s:
                time.sleep(self.settings.retry_delay_s)

    def remaining_s(self) -> float | None:
        """The rollout's remaining seconds as ``settings.remaining_work_s()`` estimates them
        (None: unknown, or the estimate raised)."""
        estimate = self.settings.remaining_work_s
        if estimate is None:
            return None
        try:
            return estimate()
        except Exception as exc:
            log.warning("%s: remaining_work_s() raised (%s); recovering anyway", self.name, exc)
            return None

    def release(self, lease: ExportLease) -> None:
        """Give ``lease`` back to the exporter (logged, never raised: a recovery ends anyway)."""
        if self.exporter is None:
            return
        try:
            self.exporter.release(lease)
        except Exception:
            log.exception("%s: releasing lease %s failed", self.name, lease)

    def step_ended_late(self, group_id: str, step: str, finished: threading.Event) -> None:
        """A timed-out step of ``group_id`` finally ended (on its own thread): the group is no
        longer busy; with ``retry`` on, it is recovered again (after the recovery that gave up
        on the step returns, if it has not yet)."""
        log.warning(
            "%s: the timed-out %s step of %s ended in the background", self.name, step, group_id
        )
        self.busy.clear(group_id, finished)
        if not self.settings.retry:
            return
        with self._lock:
            running = self._inflight.get(group_id)
        reason = f"retry after the timed-out {step} step"
        if running is not None and not running.done():
            running.add_done_callback(lambda _f: self._retry(group_id, reason))
        else:
            self._retry(group_id, reason)

    def _retry(self, group_id: str, reason: str) -> None:
        if self._closed or group_id not in self.registry:
            return
        if self.registry.get(group_id).state == "inactive":
            with contextlib.suppress(RecoveryError):
                self.submit(group_id, reason=reason)


def wait_healthy(client: EngineClient | None, deadline: float, per_try_s: float) -> None:
    """Wait until ``client`` answers ``health()`` (each try bounded by ``per_try_s``) or raise
    :class:`RecoveryError` at ``deadline`` (``time.monotonic()``)."""
    if client is None:
        return
    last: Exception | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RecoveryError(f"engine at {client.url} not healthy before the deadline: {last}")
        try:
            client.health(timeout=max(0.1, min(per_try_s, remaining)))
            return
        except Exception as exc:
            last = exc
            time.sleep(min(0.1, max(0.0, remaining)))


class _AttemptExecutor(Executor):
    """Performs the effects of one :func:`rollsafe.operations.recover.attempt` on the fleet:
    the registry's effects are the registry's handlers, the engines' (stop, place, release) the
    :class:`~rollsafe.fleet.engines.EngineEffects`', a decision's record the recovery's
    :class:`~rollsafe.fleet.steps.StepLog`; the rest is here: leases, the moved export, the
    restart, the health wait, the targeted push.

    A handler declared with a :class:`~rollsafe.fleet.steps.TimedStep` runs on its own daemon
    thread under the attempt's deadline (:meth:`perform`); its step is recorded once, with the
    detail the handler left in :attr:`note`; a step that runs late answers
    :class:`~rollsafe.operations.effects.TimedOut` (``started`` says whether it began) and leaves
    the group busy until it ends, when the clean-ups it left (a lease that waits for a late
    restart) run and the group is recovered again."""

    parts = {
        RegistryEffects: "registry_effects",
        EngineEffects: "engine_effects",
        StepLog: "log",
    }

    def __init__(self, coordinator: RecoveryCoordinator, run: _Run, group: WorkerGroup) -> None:
        self.c = coordinator
        self.run = run
        self.log = run.log
        self.registry_effects = coordinator.registry_effects
        self.engine_effects = coordinator.engine_effects
        self.group = group
        self.gid = group.group_id
        self.deadline = time.monotonic() + coordinator.settings.timeout_s
        self.step_deadline = self.deadline  # the running timed step's own deadline
        self.handle: RestartableEngine | None = None
        self.record: Any = None  # the exporter's ready record the strategy was chosen from
        self.remaining_read = False
        #: what the running timed step says in its record (a handler sets it), and whether
        #: the step counts as done although it returned (a refused push does not)
        self.note = ""
        self.note_ok = True
        #: set when the running timed step ran past its deadline (the push section gives up
        #: if it has not got the transport's lock by then)
        self.cancel = threading.Event()
        # a timed-out step still runs in the background: what to do when it ends
        self._late_lock = threading.Lock()
        self._late: DaemonCall[Any] | None = None
        self._late_cleanups: list[Callable[[], None]] = []
        self.log.mark()

    # ------------------------------------------------------------------ timed steps
    def perform(self, effect: fx.Effect[Any]) -> fx.Outcome[Any]:
        step = self.declared_steps.get(type(effect))
        if isinstance(step, TimedStep):
            if step.starts_attempt:  # the attempt's clock starts with this step
                self.deadline = time.monotonic() + self.c.settings.timeout_s
            return self._timed(step, effect)
        if isinstance(effect, fx.NoteStep) and effect.ok and effect.name in _BEGINS_ATTEMPT:
            self.log.begin_attempt()  # the attempt and its deadline begin with this decision
            self.deadline = time.monotonic() + self.c.settings.timeout_s
        return super().perform(effect)

    def _timed(self, step: TimedStep, effect: fx.Effect[Any]) -> fx.Outcome[Any]:
        """Run ``effect``'s handler as step ``step`` on its own daemon thread until the
        attempt's deadline (or the step's share of it); record the step once; answer with its
        typed outcome."""
        gid, log_ = self.gid, self.log
        t0 = time.perf_counter()
        remaining = self.deadline - time.monotonic()
        if step.share is not None and remaining > 0:
            remaining = step.share(remaining)
        self.step_deadline = time.monotonic() + remaining
        if remaining <= 0:
            why = f"group {gid!r}: deadline passed before step {step.name!r}"
            log_.record(step.name, t0, False, "deadline passed before the step")
            return fx.TimedOut(0.0, why, started=False)
        self.note, self.note_ok = "", True
        self.cancel = cancel = threading.Event()
        handler = functools.partial(Executor.perform, self, effect)
        call: DaemonCall[fx.Outcome[Any]] = DaemonCall.start(
            handler, name=f"{self.c.name}-{gid}-{step.name}", on_late=lambda _o: self._ended(step)
        )

        def mark_busy() -> None:  # under the hand-over lock, before any on_late
            cancel.set()
            with self._late_lock:
                self._late = call
            self.c.busy.mark(gid, call.finished)

        if not call.wait(remaining) and call.abandon(mark_busy):
            timeout = StepTimeout(gid, step.name, remaining)
            log_.record(step.name, t0, False, str(timeout))
            return fx.TimedOut(remaining, str(timeout), started=True)
        ended = call.outcome()
        if ended.error is not None:  # a handler bug: recorded, the attempt fails
            error = f"{type(ended.error).__name__}: {ended.error}"
            log_.record(step.name, t0, False, error)
            return fx.Failed(f"step {step.name!r}: {error}")
        outcome = ended.value
        assert outcome is not None
        ok = isinstance(outcome, fx.Ok) and self.note_ok
        detail = self.note if isinstance(outcome, fx.Ok) else outcome.error
        log_.record(step.name, t0, ok, detail)
        return outcome

    def _ended(self, step: TimedStep) -> None:
        """The timed-out step's thread ended: run the clean-ups it left, then hand the group
        back to the coordinator (no longer busy; recovered again)."""
        with self._late_lock:
            call, self._late = self._late, None
            cleanups, self._late_cleanups = self._late_cleanups, []
        for cleanup in cleanups:
            try:
                cleanup()
            except Exception:
                log.exception(
                    "%s: clean-up after the late %s of %s failed", self.c.name, step.name, self.gid
                )
        if call is not None:
            self.c.step_ended_late(self.gid, step.name, call.finished)

    # ------------------------------------------------------------------ decisions' facts
    @handles(fx.ReadRecovery)
    def read_recovery(self, _effect: fx.ReadRecovery) -> fx.Outcome[fx.RecoveryFacts]:
        c = self.c
        group = c.registry.get(self.gid)
        machine = group.machine
        remaining = None
        if group.state == "inactive" and not self.remaining_read:  # what the gate reads
            self.remaining_read = True
            remaining = c.remaining_s()
        return fx.Ok(
            fx.RecoveryFacts(
                group.state,
                budget_left=machine.restart_budget_left(),
                complete=machine.group_complete(),
                remaining_s=remaining,
                expected_s=c.settings.expected_recovery_s,
                busy=c.busy.busy(self.gid),
                budget=machine.restart_budget,
                initial_budget=machine.initial_restart_budget,
                can_push=c.transport is not None,
                placement_alive=self._placement_alive(group.state),
            )
        )

    def _placement_alive(self, state: str) -> bool | None:
        """For an ``inactive`` group placed on a node, whether its actor still answers (one
        Ray call, on the failure path only); None otherwise."""
        if state != "inactive":
            return None
        try:
            handle = self.c.launcher_for(self.gid)
        except Exception:
            return None
        if not isinstance(handle, PlaceableEngine):
            return None
        try:
            return bool(handle.placement_alive(timeout_s=self.c.placement_check_s))
        except Exception:
            return None

    # ------------------------------------------------------------------ strategy and lease
    @handles(fx.ReadStrategy)
    def read_strategy(self, _effect: fx.ReadStrategy) -> fx.Outcome[fx.StrategyFacts | None]:
        c = self.c
        mode, exporter = c.mode, c.exporter
        if mode is None or exporter is None:
            return fx.Ok(None)
        version = c.registry.fleet_version
        self.record = record = exporter.latest_ready(version)
        facts: policy.ExportFacts | None = None
        if record is not None:
            facts = policy.ExportFacts(record.version, record.state)
        else:
            try:
                handle = exporter.handle(version)
                facts = policy.ExportFacts(version, str(handle.lifecycle.state))
            except Exception:  # the exporter does not know this version
                facts = None
        moved = c.export_mover is not None
        return fx.Ok(fx.StrategyFacts(mode.state, version, facts, c.transport is not None, moved))

    @handles(fx.TakeLease)
    def take_lease(self, effect: fx.TakeLease) -> fx.Outcome[fx.Leased]:
        exporter = self.c.exporter
        assert exporter is not None  # ReadStrategy answered facts: an exporter is there
        try:
            lease = exporter.lease(effect.version, holder=effect.holder)
        except Exception as exc:  # superseded or deleted meanwhile (or never ready)
            return fx.Failed(f"{type(exc).__name__}: {exc}")
        record = self.record
        if record is None or record.version != effect.version:
            self.c.release(lease)
            return fx.Failed(f"export v{effect.version} is not ready")
        self.run.export_version = effect.version  # however the attempt ends
        return fx.Ok(fx.Leased(effect.version, str(record.path), lease))

    @handles(fx.ReleaseLease)
    def release_lease(self, effect: fx.ReleaseLease) -> fx.Outcome[None]:
        lease: ExportLease = effect.lease.token
        if effect.once_restart_ends:
            with self._late_lock:
                late = self._late
                if late is not None and not late.done():  # released when the restart ends
                    self._late_cleanups.append(lambda: self.c.release(lease))
                    return fx.DONE
        self.c.release(lease)
        return fx.DONE

    @handles(fx.PullExport, step=TimedStep("pull", share=policy.pull_budget_s))
    def pull_export(self, effect: fx.PullExport) -> fx.Outcome[fx.Pulled]:
        """The export moved to the group's node and checked there, within its share of the
        attempt's time (:func:`~rollsafe.policy.pull_budget_s`): the mover's own bound ends a
        little before the attempt's, so its named error (``ExportPullTimeout``: which phase
        waited) is what the step reports, and a pull that does not finish leaves the fallback
        (dummy weights and a push) the rest of the attempt."""
        mover = self.c.export_mover
        version, path = effect.lease.version, effect.lease.path
        if mover is None or path is None:
            return fx.Failed("no export mover")
        budget = self.step_deadline - time.monotonic()
        try:
            got = mover.pull(effect.group, version, path, timeout_s=0.9 * budget)
        except Exception as exc:
            return fx.Failed(f"{type(exc).__name__}: {exc}")
        pulled = fx.Pulled(str(got.path), int(got.nbytes), bool(got.reused), got.node_id)
        node = (pulled.node_id or "?")[:12]
        self.note = (
            f"pulled {pulled.nbytes} bytes of export v{version} to node {node}: {pulled.path}"
        )
        if pulled.reused:
            self.note += " (a checked copy was already there)"
        return fx.Ok(pulled)

    # ------------------------------------------------------------------ the restart
    @handles(fx.GetEngine, step=TimedStep("launcher"))
    def get_engine(self, _effect: fx.GetEngine) -> fx.Outcome[None]:
        self.handle = handle = self.c.launcher_for(self.gid)
        self.run.standby_at_restart = _standby_state(handle)
        self.run.restart_source = None
        return fx.DONE

    @handles(fx.Restart, step=TimedStep("restart"))
    def restart(self, effect: fx.Restart) -> fx.Outcome[None]:
        handle = self.handle
        assert handle is not None  # GetEngine came first
        kwargs: dict[str, Any] = {
            "skip_load_weights": True,
            "stop_timeout": self.c.settings.stop_timeout_s,
        }
        if not effect.dummy:
            # the export's real weights, whatever format the launcher last used (a targeted
            # push restarts on dummy weights, and a spec may start on dummy ones)
            kwargs["skip_load_weights"] = False
            kwargs["model_path"] = effect.model_path
            if effect.weight_version is not None:
                kwargs["weight_version"] = str(effect.weight_version)
        described = ", ".join(f"{k}={v}" for k, v in kwargs.items())
        try:
            handle.restart(**kwargs)
        except Exception as exc:
            return fx.Failed(f"{type(exc).__name__}: {exc}")
        source = self.run.restart_source = _start_source(handle)
        self.note = described
        if source is not None:
            self.note = f"source={source} (standby was {self.run.standby_at_restart}); {described}"
        return fx.DONE

    @handles(fx.AwaitHealthy, step=TimedStep("health"))
    def await_healthy(self, _effect: fx.AwaitHealthy) -> fx.Outcome[None]:
        assert self.handle is not None
        try:
            client = self._rebind(self.handle)
            wait_healthy(client, self.deadline, self.c.settings.health_timeout_s)
        except Exception as exc:
            return fx.Failed(f"{type(exc).__name__}: {exc}")
        return fx.DONE

    def _rebind(self, handle: RestartableEngine) -> EngineClient | None:
        """Point the group at the restarted engine's client (its URL may have changed)."""
        group = self.c.registry.get(self.gid)
        try:
            client = handle.client
        except Exception:
            return group.client
        current = group.client
        if current is client or (current is not None and current.url == client.url):
            return current
        self.c.registry.rebind_clients(
            self.gid, (client, *group.clients[1:]), (client.url, *group.endpoints[1:])
        )
        log.info("%s: group %s now served at %s", self.c.name, self.gid, client.url)
        return client

    # ------------------------------------------------------------------ the targeted push
    @handles(fx.PushUnderLock, step=TimedStep("push"))
    def push_under_lock(self, effect: fx.PushUnderLock) -> fx.Outcome[fx.PushEnd]:
        """The ``push`` step: :func:`~rollsafe.operations.recover.push_locked` under the
        transport's lock (a push that times out keeps the lock until it ends; one that had not
        got the lock yet gives up)."""
        with self.c.transport_lock:
            if self.cancel.is_set():
                return fx.Ok(fx.PushEnd("deferred", "cancelled"))
            end = drive(recover_op.push_locked(effect.group, effect.keeps_weights), self.perform)
        if end.result in ("refused", "cut_short"):  # cannot push to one group; it raised
            self.note, self.note_ok = end.why, False
        return fx.Ok(end)

    @handles(fx.ReadPushFacts)
    def read_push_facts(self, effect: fx.ReadPushFacts) -> fx.Outcome[fx.PushFacts]:
        c = self.c
        assert c.transport is not None  # the attempt checked can_push
        state = c.registry.get(effect.group).state
        return fx.Ok(
            fx.PushFacts(c.transport.registration.published, c.registry.fleet_version, state)
        )

    @handles(fx.TargetedPush)
    def targeted_push(self, effect: fx.TargetedPush) -> fx.Outcome[fx.Pushed]:
        c = self.c
        transport = c.transport
        assert transport is not None
        group = c.registry.get(effect.group)
        try:
            target = c.targets_for(group)
            with group.loading():  # not probed meanwhile: a loading engine answers late
                report = transport.targeted_update([target])
        except Exception as exc:
            if _is_transport_error(exc):  # e.g. P2PUnavailable: this transport cannot do subsets
                return fx.Ok(fx.Pushed({}, f"{type(exc).__name__}: {exc}", refused=True))
            return fx.Failed(f"step 'push': {type(exc).__name__}: {exc}")
        self.note = _push_detail(transport, target, report)
        result = report.results.get(target.name)
        ok = result is not None and result.ok
        why = result.reason if result is not None else "no result"
        return fx.Ok(fx.Pushed(dict.fromkeys(group.ranks, ok), why or ""))


def _standby_state(handle: RestartableEngine) -> StandbyState | None:
    """The handle's warm standby state (``none`` / ``warming`` / ``ready``; None: it has none).

    Read for the record only: a handle whose property raises records None."""
    try:
        return handle.standby_state
    except Exception:
        return None


def _start_source(handle: RestartableEngine) -> StartSource | None:
    """Where the handle's last start came from (None: it does not tell); for the record only."""
    try:
        source = handle.last_start_source
    except Exception:
        return None
    return source if source in START_SOURCES else None


def _is_transport_error(error: BaseException) -> bool:
    transports = sys.modules.get("rollsafe.transports.base")
    return transports is not None and isinstance(error, transports.TransportError)


def _push_detail(transport: WeightTransport, target: EngineTarget, report: UpdateReport) -> str:
    """What the push did: the transport, its mode and ranks when it records them, the bytes."""
    text = f"{transport.name} -> {target.name}"
    record = transport.last_push()
    if record is not None and target.name in record.targets:
        ranks = record.ps_ranks
        text += f": {record.mode}" + (f" ranks={list(ranks)}" if ranks is not None else "")
    result = report.results.get(target.name)
    if result is not None and result.nbytes:
        text += f", {result.nbytes / 1e9:.3f} GB in {result.seconds:.3f}s"
    return text
