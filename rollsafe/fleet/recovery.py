"""RecoveryCoordinator: bring failed worker groups back, off the health checks' threads.

Owns the recovery of ``inactive`` groups (``docs/design.md``, "Fleet control"). The order of
an attempt's steps is :func:`rollsafe.operations.recover.attempt`'s (the sequence ``rollsafe
verify`` executes too) and every decision in it (claim, skip, retire, strategy, what a restart
or a push means) is :mod:`rollsafe.policy`'s; this module executes its effects and does the I/O
(``_AttemptExecutor``: threads, deadlines, the launcher, the client, the transport, timings).
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
import dataclasses
import functools
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import rollsafe.operations.effects as fx
import rollsafe.policy as policy
from rollsafe.concurrency import DaemonCall, Outcome
from rollsafe.fleet.registry import FleetError, FleetRegistry, UnknownGroup, WorkerGroup
from rollsafe.fleet.settings import RecoverySettings, with_overrides
from rollsafe.fleet.sync import (
    ExporterLike,
    default_target,
    default_traits,
    shared_transport_lock,
)
from rollsafe.operations import place as place_op
from rollsafe.operations import recover as recover_op
from rollsafe.operations.effects import drive
from rollsafe.ports import PlaceableEngine, RestartableEngine, StandbyState, StartSource
from rollsafe.statemachines.base import TransitionRefused
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
    "RecoveryStatus",
    "RecoveryStep",
    "RecoveryStrategy",
    "RestartSource",
    "StepTimeout",
]

log = logging.getLogger(__name__)

#: How a recovery ended. ``active``: serving the current version; ``pending_weights``: up and
#: waiting for the next sync (deferred); ``skipped``: not attempted (rollout about to finish);
#: ``retired``: restart budget spent; ``failed``: every attempt failed, the group is
#: ``inactive``; ``not_needed``: the group was not ``inactive`` when the recovery started.
RecoveryStatus = Literal[
    "active", "pending_weights", "skipped", "retired", "failed", "not_needed", "unplaced"
]
#: Which strategy brought the group back (the last attempt's).
RecoveryStrategy = Literal["immediate", "targeted_push", "deferred"]
#: Where the restarted engine came from (``EngineLauncher.last_start_source``): a warm standby
#: that was ``ready``, one still importing (``warming``) that was ready before any fresh spawn,
#: or a fresh spawn.
RestartSource = StartSource
RESTART_SOURCES: tuple[RestartSource, ...] = ("ready_standby", "warming_standby", "fresh_spawn")

_OK = fx.Ok()
_RESULTS_KEPT = 512
_MAX_TEXT = 512

T = TypeVar("T")


class ExportMoverLike(Protocol):
    """What moves a verified export to a group's node (``moved`` mode;
    :class:`rollsafe.adapters.ray.ExportMover`): ``pull(group_id, version, path, timeout_s=)``
    returns the node's checked copy (``path``, ``nbytes``, ``reused``, ``node_id``) within
    ``timeout_s``, or raises."""

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
class RecoveryStep:
    """One timed step of a recovery (``attempt`` counts from 1)."""

    name: str
    attempt: int
    started_at: float
    seconds: float
    ok: bool
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "attempt": self.attempt,
            "started_at": self.started_at,
            "seconds": self.seconds,
            "ok": self.ok,
            "detail": self.detail,
        }


@dataclass(frozen=True)
class RecoveryResult:
    """The record of one recovery of one group.

    Timestamps are wall-clock (``time.time()``); ``failed_at`` is when the failure was detected
    (the health manager's ``GroupFailure.timestamp``, else the submit time). ``latency_s`` is
    failure -> ``active`` when the group got there.

    ``standby_at_restart``: the group's warm standby when the (last) attempt began (``none``,
    ``warming``, ``ready``); ``restart_source``: where the restarted engine came from
    (``ready_standby``, ``warming_standby``, ``fresh_spawn``). Both None when the handle does
    not tell (not an ``EngineLauncher``) or no restart succeeded.
    """

    group_id: str
    status: RecoveryStatus
    strategy: RecoveryStrategy | None
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
    restart_source: RestartSource | None = None

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
            "strategy": self.strategy,
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


@dataclass
class _Run:
    """Mutable state of one recovery while it runs (becomes a RecoveryResult)."""

    group_id: str
    failed_at: float
    submitted_at: float
    started_at: float = 0.0
    attempt: int = 0
    strategy: RecoveryStrategy | None = None
    export_version: int | None = None
    active_at: float | None = None
    steps: list[RecoveryStep] = field(default_factory=list)
    standby_at_restart: str | None = None
    restart_source: RestartSource | None = None
    #: a group added at runtime behind the fleet's version: only the targeted push
    catch_up: bool = False


class _Attempt(Exception):
    """Internal: one attempt failed; ``retry`` says whether another may follow."""

    def __init__(self, message: str, *, retry: bool = True, timed_out: bool = False) -> None:
        super().__init__(message)
        self.retry = retry
        self.timed_out = timed_out


class RecoveryCoordinator:
    """Runs recoveries of a :class:`FleetRegistry`'s failed groups on a bounded pool.

    ``launcher_for(group_id)`` returns the group's :class:`RestartableEngine` handle.
    ``exporter`` (an :class:`~rollsafe.hf.HFExporter`) and ``mode`` enable the immediate
    strategy; ``transport`` (the sync's transport: the same object, so they share its lock)
    enables the targeted push; ``targets_for(group)`` builds its target (default: the group's
    restarted client). ``remaining_work_s()`` estimates the rollout's remaining seconds (None:
    unknown, never skip). ``stop_timeout_s`` bounds the polite stop of the failed engine before
    it is killed (a crashed or hung engine rarely honours SIGTERM, so keep it short).
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
        exporter: ExporterLike | None = None,
        transport: WeightTransport | None = None,
        mode: ImmediateRecoveryMode | None = None,
        max_workers: int | None = None,
        recovery_timeout_s: float | None = None,
        remaining_work_s: Callable[[], float | None] | None = None,
        expected_recovery_s: float | None = None,
        targets_for: Callable[[WorkerGroup], EngineTarget] | None = None,
        health_timeout_s: float | None = None,
        retry: bool | None = None,
        retry_delay_s: float | None = None,
        transport_lock: threading.RLock | None = None,
        name: str = "rollsafe-recovery",
        stop_timeout_s: float | None = None,
        settings: RecoverySettings | None = None,
        traits_for: Callable[[WorkerGroup], policy.EngineTraits] | None = None,
        export_mover: ExportMoverLike | None = None,
    ) -> None:
        # The defaults are RecoverySettings'; keyword arguments override its fields.
        self.settings = rs = with_overrides(
            settings or RecoverySettings(),
            {
                "max_workers": max_workers,
                "timeout_s": recovery_timeout_s,
                "remaining_work_s": remaining_work_s,
                "expected_recovery_s": expected_recovery_s,
                "health_timeout_s": health_timeout_s,
                "retry": retry,
                "retry_delay_s": retry_delay_s,
                "stop_timeout_s": stop_timeout_s,
            },
        )
        max_workers = rs.max_workers
        self.registry = registry
        self.launcher_for = launcher_for
        self.exporter = exporter
        self.transport = transport
        self.mode = mode
        self.max_workers = rs.max_workers
        self.recovery_timeout_s = rs.timeout_s
        self.remaining_work_s = rs.remaining_work_s
        self.expected_recovery_s = rs.expected_recovery_s
        self.targets_for = targets_for or default_target
        self.traits_for = traits_for or default_traits
        self.health_timeout_s = rs.health_timeout_s
        self.retry = rs.retry
        self.retry_delay_s = rs.retry_delay_s
        self.stop_timeout_s = rs.stop_timeout_s
        #: how long a placed group's actor may take to answer before its node counts as lost
        self.placement_check_s = 5.0
        self.transport_lock = transport_lock or (
            shared_transport_lock(transport) if transport is not None else threading.RLock()
        )
        self.name = name
        #: moves an export to a Ray-placed group's node before a restart from it (the
        #: ``moved`` mode, docs/cluster.md section 5); None: engines read the exporter's path
        self.export_mover = export_mover
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._inflight: dict[str, concurrent.futures.Future[RecoveryResult]] = {}
        # Groups whose last attempt left a step running in the background (timed out): no new
        # recovery starts on them until that step ends (it may still be using the engine).
        self._busy: dict[str, threading.Event] = {}
        self._results: deque[RecoveryResult] = deque(maxlen=_RESULTS_KEPT)
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
        (:func:`rollsafe.operations.place.attempt`); ``catch_up``: the group was added at
        runtime and waits in ``pending_weights``: only the targeted push runs.

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
        """The :class:`~rollsafe.fleet.HealthManager` callback: enqueue, return at once."""
        self.submit(failure.group_id, failed_at=failure.timestamp, reason=failure.reason)

    def on_update_failed(self, group_id: str, reason: str) -> None:
        """The :class:`~rollsafe.fleet.sync.SyncCoordinator` ``on_group_failed`` callback."""
        self.submit(group_id, reason=f"weight update failed: {reason}")

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
                by_strategy[r.strategy] = by_strategy.get(r.strategy, 0) + 1
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
            attempts=run.attempt,
            export_version=run.export_version,
            fleet_version=self.registry.fleet_version,
            steps=tuple(run.steps),
            standby_at_restart=run.standby_at_restart,
            restart_source=run.restart_source,
        )
        with self._lock:
            self._results.append(result)
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
            run.strategy,
            run.attempt,
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
            log.warning("%s: attempt %d for %s failed: %s", self.name, run.attempt, gid, end.reason)
            if not self.retry or not end.retry or self._closed:
                return "failed", end.reason
            retried = True
            if self.retry_delay_s:
                time.sleep(self.retry_delay_s)

    def _remaining_s(self) -> float | None:
        """The rollout's remaining seconds as ``remaining_work_s()`` estimates them (None:
        unknown, or the estimate raised)."""
        if self.remaining_work_s is None:
            return None
        try:
            return self.remaining_work_s()
        except Exception as exc:
            log.warning("%s: remaining_work_s() raised (%s); recovering anyway", self.name, exc)
            return None

    def _release(self, lease: ExportLease) -> None:
        if self.exporter is None:
            return
        try:
            self.exporter.release(lease)
        except Exception:
            log.exception("%s: releasing lease %s failed", self.name, lease)

    # ------------------------------------------------------------------ helpers
    def _wait_healthy(self, client: EngineClient | None, deadline: float) -> None:
        if client is None:
            return
        last: Exception | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RecoveryError(
                    f"engine at {client.url} not healthy before the deadline: {last}"
                )
            try:
                client.health(timeout=max(0.1, min(self.health_timeout_s, remaining)))
                return
            except Exception as exc:
                last = exc
                time.sleep(min(0.1, max(0.0, remaining)))

    def _rebind(self, group: WorkerGroup, handle: RestartableEngine) -> EngineClient | None:
        """Point the group at the restarted engine's client (its URL may have changed)."""
        try:
            client = handle.client
        except Exception:
            return group.client
        current = group.client
        if current is client or (current is not None and current.url == client.url):
            return current
        self.registry.rebind_clients(
            group.group_id,
            (client, *group.clients[1:]),
            (client.url, *group.endpoints[1:]),
        )
        log.info("%s: group %s now served at %s", self.name, group.group_id, client.url)
        return client

    def _step(self, run: _Run, name: str, t0: float, ok: bool, detail: str = "") -> None:
        seconds = time.perf_counter() - t0
        run.steps.append(
            RecoveryStep(
                name, run.attempt, time.time() - seconds, seconds, ok, bound_text(detail, _MAX_TEXT)
            )
        )

    def _run_step(
        self,
        run: _Run,
        name: str,
        deadline: float,
        fn: Callable[[], T],
        *,
        detail: str = "",
        cancel: threading.Event | None = None,
        on_late_finish: Callable[[], None] | None = None,
    ) -> T:
        """Run ``fn`` on its own daemon thread until ``deadline``; time it; raise ``_Attempt``.

        On timeout the thread is left running: ``cancel`` is set, the group is marked busy (no
        new recovery starts on it) until the thread ends, and then ``on_late_finish`` runs on
        that thread, followed by a fresh recovery of the group when ``retry`` is on.
        A :class:`TransportError` raised by ``fn`` propagates as is.
        """
        gid = run.group_id
        t0 = time.perf_counter()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            self._step(run, name, t0, False, "deadline passed before the step")
            raise _Attempt(f"group {gid!r}: deadline passed before step {name!r}", retry=False)

        def mark_busy() -> None:  # under the hand-over lock, before any late()
            if cancel is not None:
                cancel.set()
            with self._lock:
                self._busy[gid] = call.finished

        def late(_outcome: Outcome[T]) -> None:
            self._late_finish(gid, name, call.finished, on_late_finish)

        call = DaemonCall.start(fn, name=f"{self.name}-{gid}-{name}", on_late=late)
        if not call.wait(remaining) and call.abandon(mark_busy):
            timeout = StepTimeout(gid, name, remaining)
            self._step(run, name, t0, False, str(timeout))
            raise _Attempt(str(timeout), retry=False, timed_out=True)
        error = call.outcome().error
        if error is not None:
            self._step(run, name, t0, False, f"{type(error).__name__}: {error}")
            if _is_transport_error(error):
                raise error
            raise _Attempt(f"step {name!r}: {type(error).__name__}: {error}") from error
        self._step(run, name, t0, True, detail)
        return call.outcome().value  # type: ignore[return-value]

    def _late_finish(
        self,
        group_id: str,
        step: str,
        finished: threading.Event,
        cleanup: Callable[[], None] | None,
    ) -> None:
        """A timed-out step finally ended (on its own thread): clean up, maybe recover again."""
        log.warning(
            "%s: the timed-out %s step of %s ended in the background", self.name, step, group_id
        )
        if cleanup is not None:
            try:
                cleanup()
            except Exception:
                log.exception(
                    "%s: clean-up after the late %s of %s failed", self.name, step, group_id
                )
        with self._lock:
            if self._busy.get(group_id) is finished:
                del self._busy[group_id]
            running = self._inflight.get(group_id)
        if not self.retry:
            return
        reason = f"retry after the timed-out {step} step"
        if running is not None and not running.done():
            # The recovery that gave up on this step has not returned yet: retry after it.
            running.add_done_callback(lambda _f: self._retry(group_id, reason))
        else:
            self._retry(group_id, reason)

    def _retry(self, group_id: str, reason: str) -> None:
        if self._closed or group_id not in self.registry:
            return
        if self.registry.get(group_id).state == "inactive":
            with contextlib.suppress(RecoveryError):
                self.submit(group_id, reason=reason)


class _AttemptExecutor:
    """Performs the effects of one :func:`rollsafe.operations.recover.attempt` on the fleet:
    the registry, the exporter's leases, the launcher, the client and the transport, each
    blocking step on its own daemon thread under the attempt's deadline, every step timed into
    the recovery's :class:`RecoveryStep` list."""

    def __init__(self, coordinator: RecoveryCoordinator, run: _Run, group: WorkerGroup) -> None:
        self.c = coordinator
        self.run = run
        self.group = group
        self.gid = group.group_id
        self.deadline = time.monotonic() + coordinator.recovery_timeout_s
        self.t_mark = time.perf_counter()
        self.handle: RestartableEngine | None = None
        self.record: Any = None  # the exporter's ready record the strategy was chosen from
        self.remaining_read = False
        self._push_detail = ""  # what the push did, for the ``push`` step's detail
        # a restart that timed out still runs in the background: what to do when it ends
        self._late_lock = threading.Lock()
        self._late_running = False
        self._late_cleanups: list[Callable[[], None]] = []
        self._table: dict[type[fx.Effect], Callable[[Any], fx.Outcome]] = {
            fx.ReadRecovery: self._read_recovery,
            fx.NoteStep: self._note,
            fx.SendGroup: self._send,
            fx.ReadStrategy: self._read_strategy,
            fx.TakeLease: self._take_lease,
            fx.ReleaseLease: self._release_lease,
            fx.PullExport: self._pull_export,
            fx.GetEngine: self._get_engine,
            fx.StopEngine: self._stop_engine,
            fx.Restart: self._restart,
            fx.AwaitHealthy: self._await_healthy,
            fx.ReportMembers: self._report_members,
            fx.PushUnderLock: self._push_under_lock,
            fx.ReadPushFacts: self._read_push_facts,
            fx.TargetedPush: self._targeted_push,
            fx.Place: self._place,
            fx.ReleasePlacement: self._release_placement,
        }

    def perform(self, effect: fx.Effect) -> fx.Outcome:
        return self._table[type(effect)](effect)

    # ------------------------------------------------------------------ decisions' facts
    def _read_recovery(self, _effect: fx.ReadRecovery) -> fx.Outcome:
        c = self.c
        group = c.registry.get(self.gid)
        machine = group.machine
        with c._lock:
            busy = c._busy.get(self.gid)
        remaining = None
        if group.state == "inactive" and not self.remaining_read:  # what the gate reads
            self.remaining_read = True
            remaining = c._remaining_s()
        return fx.Ok(
            fx.RecoveryFacts(
                group.state,
                budget_left=machine.restart_budget_left(),
                complete=machine.group_complete(),
                remaining_s=remaining,
                expected_s=c.expected_recovery_s,
                busy=busy is not None and not busy.is_set(),
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

    def _note(self, effect: fx.NoteStep) -> fx.Outcome:
        if effect.name in ("claim", "place") and effect.ok:  # the attempt and its deadline begin
            self.run.attempt += 1
            self.deadline = time.monotonic() + self.c.recovery_timeout_s
        self.c._step(self.run, effect.name, self.t_mark, effect.ok, effect.detail)
        self.t_mark = time.perf_counter()
        return _OK

    def _send(self, effect: fx.SendGroup) -> fx.Outcome:
        try:
            return fx.Ok(self.c.registry.send(effect.group, effect.event).target)
        except TransitionRefused as exc:
            log.info("%s: %s refused for %s: %s", self.c.name, effect.event, effect.group, exc)
            return fx.Failed(str(exc))

    # ------------------------------------------------------------------ strategy and lease
    def _read_strategy(self, _effect: fx.ReadStrategy) -> fx.Outcome:
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
            with contextlib.suppress(Exception):  # the exporter does not know this version
                handle = exporter.handle(version)
                facts = policy.ExportFacts(version, str(handle.lifecycle.state))
        moved = c.export_mover is not None
        return fx.Ok(fx.StrategyFacts(mode.state, version, facts, c.transport is not None, moved))

    def _take_lease(self, effect: fx.TakeLease) -> fx.Outcome:
        exporter = self.c.exporter
        assert exporter is not None  # ReadStrategy answered facts: an exporter is there
        try:
            lease = exporter.lease(effect.version, holder=effect.holder)
        except Exception as exc:  # superseded or deleted meanwhile (or never ready)
            return fx.Failed(f"{type(exc).__name__}: {exc}")
        record = self.record
        if record is None or record.version != effect.version:
            self.c._release(lease)
            return fx.Failed(f"export v{effect.version} is not ready")
        self.run.export_version = effect.version  # however the attempt ends
        return fx.Ok(fx.Leased(effect.version, str(record.path), lease))

    def _release_lease(self, effect: fx.ReleaseLease) -> fx.Outcome:
        lease: ExportLease = effect.lease.token
        if effect.once_restart_ends:
            with self._late_lock:
                if self._late_running:  # released by the restart's thread when it ends
                    self._late_cleanups.append(lambda: self.c._release(lease))
                    return _OK
        self.c._release(lease)
        return _OK

    def _pull_export(self, effect: fx.PullExport) -> fx.Outcome:
        """The ``pull`` step: the export moved to the group's node and checked there, within
        its share of the attempt's time (:func:`~rollsafe.policy.pull_budget_s`): a pull
        that does not finish leaves the fallback (dummy weights and a push) the rest."""
        mover = self.c.export_mover
        version, path = effect.lease.version, effect.lease.path
        if mover is None or path is None:
            return fx.Failed("no export mover")
        budget = policy.pull_budget_s(self.deadline - time.monotonic())
        # the pull's own bound ends a little before the step's, so its named error
        # (ExportPullTimeout: which phase waited) is what the step reports
        outcome = self._timed(
            "pull",
            lambda: mover.pull(effect.group, version, path, timeout_s=0.9 * budget),
            until=time.monotonic() + budget,
        )
        if not isinstance(outcome, fx.Ok):
            return outcome
        got = outcome.value
        pulled = fx.Pulled(str(got.path), int(got.nbytes), bool(got.reused), got.node_id)
        node = (pulled.node_id or "?")[:12]
        detail = f"pulled {pulled.nbytes} bytes of export v{version} to node {node}: {pulled.path}"
        if pulled.reused:
            detail += " (a checked copy was already there)"
        run = self.run
        if run.steps and run.steps[-1].name == "pull":
            run.steps[-1] = dataclasses.replace(run.steps[-1], detail=bound_text(detail, _MAX_TEXT))
        return fx.Ok(pulled)

    def _restart_ended_late(self) -> None:
        """On the timed-out restart's own thread, once it has ended."""
        with self._late_lock:
            self._late_running = False
            cleanups, self._late_cleanups = self._late_cleanups, []
        for cleanup in cleanups:
            cleanup()

    # ------------------------------------------------------------------ the restart
    def _timed(
        self,
        name: str,
        fn: Callable[[], Any],
        *,
        detail: str = "",
        until: float | None = None,
        **kw: Any,
    ) -> fx.Outcome:
        """Run ``fn`` as step ``name`` (its own daemon thread, the attempt's deadline, or the
        earlier ``until``)."""
        deadline = self.deadline if until is None else min(until, self.deadline)
        remaining = deadline - time.monotonic()
        try:
            value = self.c._run_step(self.run, name, deadline, fn, detail=detail, **kw)
        except _Attempt as exc:
            if exc.timed_out or not exc.retry:  # ran past, or no time left to start it
                return fx.TimedOut(max(0.0, remaining), str(exc))
            return fx.Failed(str(exc))
        except Exception as exc:  # a TransportError from a step that is not a push
            return fx.Failed(f"{type(exc).__name__}: {exc}")
        finally:
            self.t_mark = time.perf_counter()
        return fx.Ok(value)

    def _place(self, _effect: fx.Place) -> fx.Outcome:
        """A new placement for the group (its node died): the old one given back first."""
        handle = self.c.launcher_for(self.gid)
        if not isinstance(handle, PlaceableEngine):
            return fx.Ok("local")  # a group on this machine has no placement to renew
        self.deadline = time.monotonic() + self.c.recovery_timeout_s
        outcome = self._timed("place", handle.place_again)
        return outcome

    def _release_placement(self, _effect: fx.ReleasePlacement) -> fx.Outcome:
        handle = self.c.launcher_for(self.gid)
        if isinstance(handle, PlaceableEngine):
            with contextlib.suppress(Exception):
                handle.release_placement()
        return _OK

    def _get_engine(self, _effect: fx.GetEngine) -> fx.Outcome:
        outcome = self._timed("launcher", lambda: self.c.launcher_for(self.gid))
        if isinstance(outcome, fx.Ok):
            self.handle = outcome.value
            self.run.standby_at_restart = _standby_state(self.handle)
            self.run.restart_source = None
        return outcome

    def _stop_engine(self, _effect: fx.StopEngine) -> fx.Outcome:
        handle = self.handle
        assert handle is not None  # GetEngine came first
        timeout = self.c.stop_timeout_s
        # keep_standby: the restart below hands off to the warm standby
        return self._timed("shutdown", lambda: handle.stop(timeout=timeout, keep_standby=True))

    def _restart(self, effect: fx.Restart) -> fx.Outcome:
        handle = self.handle
        assert handle is not None  # GetEngine came first
        kwargs: dict[str, Any] = {"skip_load_weights": True, "stop_timeout": self.c.stop_timeout_s}
        if not effect.dummy:
            # the export's real weights, whatever format the launcher last used (a targeted
            # push restarts on dummy weights, and a spec may start on dummy ones)
            kwargs["skip_load_weights"] = False
            kwargs["model_path"] = effect.model_path
            if effect.weight_version is not None:
                kwargs["weight_version"] = str(effect.weight_version)
        with self._late_lock:
            self._late_running = True
        outcome = self._timed(
            "restart",
            lambda: handle.restart(**kwargs),
            detail=_describe(kwargs),
            on_late_finish=self._restart_ended_late,
        )
        run = self.run
        if not isinstance(outcome, fx.TimedOut) or "before step" in outcome.error:
            with self._late_lock:  # it ended (or never started): nothing runs late
                self._late_running = False
        if not isinstance(outcome, fx.Ok):
            return outcome
        run.restart_source = _start_source(handle)
        if run.restart_source is not None and run.steps and run.steps[-1].name == "restart":
            step = run.steps[-1]
            note = f"source={run.restart_source} (standby was {run.standby_at_restart})"
            run.steps[-1] = dataclasses.replace(
                step, detail=bound_text(f"{note}; {step.detail}", _MAX_TEXT)
            )
        return outcome

    def _await_healthy(self, _effect: fx.AwaitHealthy) -> fx.Outcome:
        assert self.handle is not None
        try:
            client = self.c._rebind(self.group, self.handle)
        except Exception as exc:
            return fx.Failed(f"{type(exc).__name__}: {exc}")
        return self._timed("health", lambda: self.c._wait_healthy(client, self.deadline))

    def _report_members(self, effect: fx.ReportMembers) -> fx.Outcome:
        group = self.c.registry.get(effect.group)
        for rank in group.ranks:
            healthy = effect.healthy
            if healthy is None:
                healthy = group.machine.members[rank].healthy
            self.c.registry.report_member(
                effect.group, rank, healthy=healthy, weights_version=effect.weights_version
            )
        return _OK

    # ------------------------------------------------------------------ the targeted push
    def _push_under_lock(self, effect: fx.PushUnderLock) -> fx.Outcome:
        """The ``push`` step: :func:`~rollsafe.operations.recover.push_locked` run on its own
        thread under the transport's lock (a push that times out keeps the lock until it
        ends; one that had not got the lock yet is cancelled)."""
        c, run = self.c, self.run
        cancelled = threading.Event()

        def section() -> recover_op.PushEnd:
            with c.transport_lock:
                if cancelled.is_set():
                    return recover_op.PushEnd("deferred", "cancelled")
                steps = recover_op.push_locked(effect.group, effect.keeps_weights)
                return drive(steps, self.perform)

        outcome = self._timed("push", section, cancel=cancelled)
        if not isinstance(outcome, fx.Ok) or not run.steps or run.steps[-1].name != "push":
            return outcome
        end: recover_op.PushEnd = outcome.value
        if end.result in ("refused", "cut_short"):  # cannot push to one group; it raised
            run.steps[-1] = dataclasses.replace(
                run.steps[-1], ok=False, detail=bound_text(end.why, _MAX_TEXT)
            )
        elif self._push_detail:
            run.steps[-1] = dataclasses.replace(
                run.steps[-1], detail=bound_text(self._push_detail, _MAX_TEXT)
            )
        return outcome

    def _read_push_facts(self, effect: fx.ReadPushFacts) -> fx.Outcome:
        c = self.c
        assert c.transport is not None  # the attempt checked can_push
        state = c.registry.get(effect.group).state
        return fx.Ok(
            fx.PushFacts(c.transport.registration.published, c.registry.fleet_version, state)
        )

    def _targeted_push(self, effect: fx.TargetedPush) -> fx.Outcome:
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
        self._push_detail = _push_detail(transport, target, report)
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


def _start_source(handle: RestartableEngine) -> RestartSource | None:
    """Where the handle's last start came from (None: it does not tell); for the record only."""
    try:
        source = handle.last_start_source
    except Exception:
        return None
    return source if source in RESTART_SOURCES else None


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


def _describe(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in kwargs.items())
