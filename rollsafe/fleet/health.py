"""HealthManager: periodic, concurrent health probes that take failed groups out of routing.

Owns failure *detection* (never recovery):

* one probe loop (an asyncio event loop on its own thread) runs a round every ``interval_s``,
  or at once on :meth:`HealthManager.wake`; a round probes every group in ``probe_states``
  (``active``, ``standby`` -- a spare -- and ``pending_weights`` by default;
  ``inactive``/``recovering`` groups belong to the recovery coordinator) concurrently, each
  probe bounded by ``timeout_s``;
* async probes run on the loop itself (a thousand latency-bound probes cost one thread). The
  default probe asks each engine client's ``health()``: for rollsafe's own HTTP clients
  (:class:`~rollsafe.adapters.engines.sglang.SGLangClient`,
  :class:`~rollsafe.adapters.engines.vllm.VLLMClient`) that is the same one ``GET /health`` sent
  from the loop, over a keep-alive connection of the loop's own pool
  (:class:`~rollsafe.adapters.engines.aio.AsyncHttp`), no thread per probe (a thread and a
  blocking request per probe cost the fleet's process ~0.8 ms of CPU, four times a second on
  two groups); any other client's ``health()``, and any sync probe passed in, runs on a daemon
  thread of its own (:class:`~rollsafe.concurrency.DaemonCall`). A probe that hangs past its
  timeout counts as a failure; a sync probe still running is not started again (so hung
  engines hold at most one thread each) and it counts one more failure for every further
  ``timeout_s`` it stays stuck, not one per round (an async probe is cancelled at the round's
  deadline, and rounds are at least ``timeout_s`` apart while it hangs):
  ``failure_threshold`` failures always mean about ``failure_threshold x timeout_s`` without an
  answer, whatever ``interval_s`` is (a probe slowed by a busy host is not failed twice at
  once). A hung engine never delays the loop beyond ``timeout_s``;
* a time-out is the engine's only while the checker itself ran: a heartbeat on the probe loop
  (:class:`_StallWatch`) notes when the loop did not run (the fleet's process frozen: a long
  hold of the GIL, a collection, a starved host); a probe whose window held such a stall
  longer than half of ``timeout_s`` is not counted (``HealthRound.inconclusive``, logged) and
  its group is probed again. Seen on a loaded machine: the driver stood still for 3 to 4 s and
  every probe in flight "timed out", failing a serving group;
* consecutive failures are counted per rank; when a rank reaches ``failure_threshold`` it is
  reported unhealthy and the group is sent ``fail`` (the whole group leaves routing); a healthy
  answer resets the count and reports the members healthy. What each answer means is
  :func:`rollsafe.policy.judge_probe`'s decision, and the steps that apply it are
  :func:`rollsafe.operations.probe.probe`'s (the sequence ``rollsafe verify`` executes too):
  this module only executes them, one sequence per probed group and round, performing every
  group's probe step concurrently under the round's deadline. Defaults come from
  :class:`~rollsafe.fleet.settings.HealthSettings`;
* hand-off: each ``fail`` the manager sends is passed to ``on_group_failed(failure)`` on a
  separate notifier thread, never on the probe loop. The callback must return quickly (enqueue
  the group for the recovery coordinator); it is never where a recovery runs, so probes keep
  running while recoveries do;
* :meth:`pause` / :meth:`resume`: checks run only while engines serve (pause around offload or
  a weight update). After :meth:`pause` returns, no probe answer is applied and no failure is
  decided until :meth:`resume`; failure counts restart from zero on resume;
* locks: registry events (and so registry listeners) are sent outside the manager's own lock,
  so a listener may call :meth:`pause`, :meth:`wake` or take its own locks freely.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import inspect
import logging
import queue
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias

import rollsafe.operations.effects as fx
import rollsafe.policy as policy
from rollsafe.concurrency import DaemonCall
from rollsafe.errors import InvalidArgument
from rollsafe.fleet.settings import HealthSettings, with_overrides
from rollsafe.operations import probe as probe_op
from rollsafe.operations.executor import Executor, handles
from rollsafe.operations.probe import ProbeEnd
from rollsafe.registry import FleetRegistry, RegistryEffects, WorkerGroup
from rollsafe.text import bound_text

if TYPE_CHECKING:
    from rollsafe.adapters.engines.aio import AsyncHttp

__all__ = [
    "DEFAULT_PROBE_STATES",
    "GroupFailure",
    "HealthManager",
    "HealthRound",
    "Probe",
    "ProbeLedger",
    "ProbeOutcome",
    "ProbeResult",
    "client_health_probe",
]

log = logging.getLogger(__name__)

#: What a probe returns: ``True``/``None`` (every member healthy), ``False`` (none), or a
#: per-rank mapping (a rank missing from it counts as unhealthy). Raising counts as ``False``.
ProbeResult: TypeAlias = bool | Mapping[int, bool] | None
#: ``probe(group, timeout_s)``: a plain function (run on the pool) or a coroutine function (run
#: on the probe loop). It should honour ``timeout_s`` itself where it can; the manager bounds it
#: anyway.
Probe: TypeAlias = Callable[[WorkerGroup, float], ProbeResult | Awaitable[ProbeResult]]

#: States whose groups are probed by default.
DEFAULT_PROBE_STATES = frozenset({"active", "standby", "pending_weights"})

_MAX_REASON_CHARS = 512
#: a stuck probe that may not count another failure yet (see ``_still_running``)
_NOT_YET = object()


def client_health_probe(group: WorkerGroup, timeout_s: float) -> ProbeResult:
    """The default probe: every engine client of the group answers ``health()``.

    Any client failing fails the whole group (one endpoint cannot tell which rank broke). One
    request per client, never retried: the manager's consecutive-failure threshold is the retry.
    A :class:`HealthManager` left with this default sends the same request from its loop for
    rollsafe's HTTP clients (:class:`_LoopHealth`).
    """
    if not group.clients:
        raise InvalidArgument(
            "clients",
            f"worker group {group.group_id!r} has no engine clients; pass a probe function",
        )
    for client in group.clients:
        client.health(timeout=timeout_s, retry=False)
    return True


class ProbeOutcome(NamedTuple):
    """One probe of one group in one round (a tuple: a round builds a thousand of these)."""

    group_id: str
    #: The ranks this probe found unhealthy (every rank when the probe failed or timed out).
    unhealthy: tuple[int, ...]
    duration_s: float
    error: str | None = None
    timed_out: bool = False
    still_running: bool = False

    @property
    def ok(self) -> bool:
        return not self.unhealthy


@dataclass(frozen=True)
class GroupFailure:
    """What the manager hands to ``on_group_failed`` after it sent ``fail`` to a group."""

    group_id: str
    unhealthy_ranks: tuple[int, ...]
    consecutive_failures: int
    reason: str
    timestamp: float


@dataclass(frozen=True)
class HealthRound:
    """Summary of one probe round."""

    started_at: float
    duration_s: float
    probed: int
    healthy: int
    failed_probes: tuple[str, ...]
    timed_out: tuple[str, ...]
    failed_groups: tuple[str, ...]
    discarded: int
    outcomes: tuple[ProbeOutcome, ...] = field(repr=False, default=())
    #: groups whose time-out was not counted: the checker itself stood still in its window
    inconclusive: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "started_at": self.started_at,
            "duration_s": self.duration_s,
            "probed": self.probed,
            "healthy": self.healthy,
            "failed_probes": list(self.failed_probes),
            "timed_out": list(self.timed_out),
            "failed_groups": list(self.failed_groups),
            "discarded": self.discarded,
            "inconclusive": list(self.inconclusive),
        }


class ProbeLedger:
    """What the probes of one :class:`HealthManager` share: consecutive failures per group and
    rank, the lock a probe's answer is applied under, and whether an answer may be applied at
    all (checks not paused, not stopping, and in the same epoch as when its probe began: a
    ``pause()`` or ``resume()`` in between voids it).

    Held while an answer is applied (counts, member reports, the fail decision; not the fail
    itself); ``pause()`` takes it too, so after ``pause()`` returns nothing is applied."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._failures: dict[str, dict[int, int]] = {}
        self._paused = False
        self._stopping = False
        self._epoch = 0

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def stopping(self) -> bool:
        return self._stopping

    def applies(self, epoch: int) -> bool:
        """Whether an answer to a probe begun in ``epoch`` may be applied now."""
        return not self._paused and not self._stopping and epoch == self._epoch

    def pause(self) -> None:
        with self.lock:
            self._paused = True
            self._epoch += 1

    def resume(self) -> None:
        """Checks go on with fresh failure counts."""
        with self.lock:
            self._paused = False
            self._epoch += 1
            self._failures.clear()

    def stop(self) -> None:
        with self.lock:
            self._stopping = True
            self._epoch += 1

    def counts(self, group_id: str) -> dict[int, int]:
        """Group ``group_id``'s consecutive failures per rank (a copy)."""
        return dict(self._failures.get(group_id, {}))

    def set_counts(self, group_id: str, counts: Mapping[int, int]) -> None:
        """Group ``group_id``'s counts become ``counts`` (empty: forgotten)."""
        if counts:
            self._failures[group_id] = dict(counts)
        else:
            self._failures.pop(group_id, None)

    def keep_only(self, groups: Iterable[str]) -> None:
        """Forget the counts of groups not in ``groups`` (they left the registry)."""
        known = set(groups)
        if len(self._failures) > len(known) or any(g not in known for g in self._failures):
            with self.lock:
                for gid in [g for g in self._failures if g not in known]:
                    del self._failures[gid]

    def nonzero(self) -> dict[str, dict[int, int]]:
        """Every group's non-zero counts (copies)."""
        with self.lock:
            return {g: dict(c) for g, c in self._failures.items() if c}


class _Notifier:
    """Runs ``on_group_failed`` callbacks on one dedicated thread, in order."""

    def __init__(self, callback: Callable[[GroupFailure], None], name: str) -> None:
        self._callback = callback
        self._queue: queue.SimpleQueue[GroupFailure | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"{name}-notify", daemon=True)
        self._thread.start()

    def put(self, failure: GroupFailure) -> None:
        self._queue.put(failure)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._callback(item)
            except Exception:
                log.exception("on_group_failed callback raised for %s", item.group_id)

    def stop(self, timeout: float) -> bool:
        self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _is_async(fn: Callable[..., Any]) -> bool:
    """A coroutine function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


class _LoopHealth:
    """The default probe on the probe loop: each HTTP engine client's ``GET /health`` through
    its asyncio companion on the loop's one :class:`~rollsafe.adapters.engines.aio.AsyncHttp`
    (a keep-alive connection per engine, no thread per probe)."""

    def __init__(self) -> None:
        from rollsafe.adapters.engines.aio import AsyncHttp  # httptools: only when probing

        self.http: AsyncHttp = AsyncHttp()
        self._engines: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

    def engines(self, group: WorkerGroup) -> list[Any] | None:
        """The async companions of ``group``'s clients, on this loop; None when a client is not
        one of rollsafe's HTTP clients (or overrides their ``health``), when the group has no
        clients, or when called from another loop: the blocking probe on a thread decides."""
        clients = group.clients
        if not clients or asyncio.get_running_loop() is not self.http.loop:
            return None
        from rollsafe.adapters.engines.aio import async_engine
        from rollsafe.adapters.engines.sglang import SGLangClient
        from rollsafe.adapters.engines.vllm import VLLMClient

        out = []
        for client in clients:
            if type(client).health not in (SGLangClient.health, VLLMClient.health):
                return None
            engine = self._engines.get(client)
            if engine is None:
                engine = self._engines[client] = async_engine(client, self.http)
            out.append(engine)
        return out

    @staticmethod
    async def probe(engines: list[Any], timeout_s: float) -> bool:
        """What :func:`client_health_probe` does, awaited: each answers ``/health`` in turn."""
        for engine in engines:
            await engine.health(timeout_s)
        return True


class HealthManager:
    """Concurrent health probing of a :class:`FleetRegistry`'s groups.

    ``probe(group, timeout_s)`` defaults to :func:`client_health_probe` (sent from the loop
    itself for rollsafe's HTTP clients, :class:`_LoopHealth`). A sync probe runs on a
    daemon thread of its own (a :class:`~rollsafe.concurrency.DaemonCall`), so a probe stuck in a
    hung engine never blocks interpreter exit; a group whose probe still hangs is not probed
    again until it returns (it counts as a failure meanwhile), so at most one probe thread per
    group is alive (threads <= groups probed); for very large simulated fleets pass an async
    probe instead. ``on_group_failed`` is called on a notifier thread after each ``fail``
    the manager sends; it must only enqueue (see the module docstring).

    Use :meth:`start` / :meth:`stop` (or ``with``) for the periodic loop, or :meth:`check_now`
    to run one round synchronously (tests, benchmarks, a manual check).
    """

    def __init__(
        self,
        registry: FleetRegistry,
        probe: Probe | None = None,
        interval_s: float | None = None,
        timeout_s: float | None = None,
        failure_threshold: int | None = None,
        *,
        settings: HealthSettings | None = None,
        probe_states: Iterable[str] = DEFAULT_PROBE_STATES,
        on_group_failed: Callable[[GroupFailure], None] | None = None,
        name: str = "rollsafe-health",
    ) -> None:
        # The defaults are HealthSettings'; keyword arguments override its fields.
        self.settings = with_overrides(
            settings or HealthSettings(),
            {
                "interval_s": interval_s,
                "timeout_s": timeout_s,
                "failure_threshold": failure_threshold,
            },
        )
        interval_s = self.settings.interval_s
        timeout_s = self.settings.timeout_s
        failure_threshold = self.settings.failure_threshold
        self.registry = registry
        self.probe: Probe = probe if probe is not None else client_health_probe
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.failure_threshold = failure_threshold
        self.probe_states = frozenset(probe_states)
        self.name = name
        self._async_probe = _is_async(self.probe)
        #: the default probe, on the probe loop (made with the loop, closed with it)
        self._on_loop: _LoopHealth | None = None
        self._default_probe = probe is None
        self._notifier = _Notifier(on_group_failed, name) if on_group_failed is not None else None
        #: failure counts, the apply lock and the epoch the probe executors share
        self.ledger = ProbeLedger()
        #: the registry's effects, performed for every probe (one handler in the code base)
        self.registry_effects = RegistryEffects(registry)
        self._inflight: dict[str, DaemonCall[Any]] = {}
        #: group -> when its stuck sync probe last counted a failure (monotonic)
        self._counted_at: dict[str, float] = {}
        #: when the probe loop did not run (its heartbeat's gaps), in the loop's time
        self._stalls = _StallWatch(min(0.05, timeout_s / 4))
        self._inconclusive = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake_event: asyncio.Event | None = None
        self._round_lock: asyncio.Lock | None = None
        self._offline_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._rounds = 0
        self._groups_failed = 0
        self._last_round: HealthRound | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> HealthManager:
        """Start the periodic probe loop on its own thread (idempotent)."""
        if self._thread is not None and self._thread.is_alive():
            return self
        if self.ledger.stopping:
            raise RuntimeError(f"{self.name}: a stopped HealthManager cannot be restarted")
        self._ready.clear()
        self._thread = threading.Thread(target=self._run_loop, name=self.name, daemon=True)
        self._thread.start()
        if not self._ready.wait(30.0):
            raise RuntimeError(f"{self.name}: the probe loop thread did not start")
        return self

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the loop and join its thread, the notifier and the probe pool.

        Returns True when everything joined within ``timeout``; a probe still stuck in a hung
        engine is left on its daemon thread (logged) and makes this return False.
        """
        deadline = time.monotonic() + timeout
        self.ledger.stop()
        clean = True
        thread = self._thread
        if thread is not None:
            self._poke()
            thread.join(max(0.0, deadline - time.monotonic()))
            clean = not thread.is_alive()
        if self._notifier is not None:
            clean = self._notifier.stop(max(0.0, deadline - time.monotonic())) and clean
        # probes left stuck in hung engines stay on their daemon threads; wait briefly for them
        grace_end = time.monotonic() + max(0.0, min(0.5, deadline - time.monotonic()))
        stuck = [
            c.name
            for c in list(self._inflight.values())
            if not c.wait(grace_end - time.monotonic())
        ]
        if stuck:
            log.warning("%s: %d probe thread(s) still stuck in hung engines", self.name, len(stuck))
            clean = False
        return clean

    def __enter__(self) -> HealthManager:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self.ledger.stopping

    def pause(self) -> None:
        """Stop checking (engines offloaded or updating).

        Once this returns, no probe answer is applied and no new failure is decided until
        :meth:`resume`; a ``fail`` decided just before (from answers obtained before the pause)
        may still be delivered. Never blocks on listeners or callbacks.
        """
        self.ledger.pause()

    def resume(self) -> None:
        """Resume checking with fresh failure counts, and probe at once."""
        self.ledger.resume()
        self.wake()

    @property
    def paused(self) -> bool:
        return self.ledger.paused

    def wake(self) -> None:
        """Probe now (e.g. a request just failed on a group) instead of at the next interval."""
        self._poke()

    def _poke(self) -> None:
        loop, event = self._loop, self._wake_event
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # loop already closed
                loop.call_soon_threadsafe(event.set)

    # ------------------------------------------------------------------ inspection
    @property
    def rounds(self) -> int:
        """Rounds run so far."""
        return self._rounds

    @property
    def last_round(self) -> HealthRound | None:
        return self._last_round

    def failure_counts(self) -> dict[str, dict[int, int]]:
        """Consecutive failures per group and rank (only non-zero counts)."""
        return self.ledger.nonzero()

    def stats(self) -> dict[str, Any]:
        last = self._last_round
        return {
            "running": self.running,
            "paused": self.ledger.paused,
            "rounds": self._rounds,
            "groups_failed": self._groups_failed,
            "inconclusive": self._inconclusive,
            "probe_threads": sum(1 for c in list(self._inflight.values()) if not c.done()),
            "failure_counts": {
                g: {str(r): n for r, n in c.items()} for g, c in self.failure_counts().items()
            },
            "last_round": last.as_dict() if last is not None else None,
        }

    # ------------------------------------------------------------------ one round
    def check_now(self, timeout: float | None = None) -> HealthRound:
        """Run one round now and return its summary (also while the loop runs).

        Runs even while paused, but a paused manager applies nothing (``discarded`` counts
        them).
        """
        loop = self._loop
        if loop is not None and self.running:
            fut = asyncio.run_coroutine_threadsafe(self._serialized_round(), loop)
            return fut.result(timeout)
        with self._offline_lock:
            return asyncio.run(self._round())

    async def _serialized_round(self) -> HealthRound:
        assert self._round_lock is not None
        async with self._round_lock:
            return await self._round()

    def _run_loop(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._main(loop))
        finally:
            self._loop = None
            self._wake_event = None
            loop.close()

    async def _main(self, loop: asyncio.AbstractEventLoop) -> None:
        self._wake_event = asyncio.Event()
        self._round_lock = asyncio.Lock()
        self._loop = loop
        if self._default_probe:
            self._on_loop = _LoopHealth()
        heartbeat = loop.create_task(self._stalls.beat(loop, lambda: self.ledger.stopping))
        self._ready.set()
        try:
            await self._rounds_until_stopped()
        finally:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
            on_loop, self._on_loop = self._on_loop, None
            if on_loop is not None:
                await on_loop.http.close()

    async def _rounds_until_stopped(self) -> None:
        assert self._wake_event is not None
        while not self.ledger.stopping:
            began = time.monotonic()
            if not self.ledger.paused:
                try:
                    await self._serialized_round()
                except Exception:  # a bug in a probe wrapper must not end health checking
                    log.exception("%s: health round failed", self.name)
            wait = self.interval_s - (time.monotonic() - began)
            if wait > 0 and not self.ledger.stopping:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake_event.wait(), wait)
            self._wake_event.clear()

    async def _round(self) -> HealthRound:
        # Cheap by construction (1,000 probes per round must cost little more than one): one
        # task per probe that awaits the probe itself and applies its answer inline, no
        # per-probe timers or callbacks; one deadline, ``timeout_s`` from the start of the
        # round, cancels the probes that did not answer and counts them as timed out.
        epoch = self.ledger.epoch
        started_at = time.time()
        t0 = time.monotonic()
        loop = asyncio.get_running_loop()
        every = self.registry.groups()
        groups = [
            g for g in every if g.machine.state in self.probe_states and not g.loading_weights
        ]
        self._prune(every)
        results: list[tuple[ProbeOutcome, bool, bool]] = []
        running: dict[str, tuple[asyncio.Task[None], _ProbeRun]] = {}
        all_done: asyncio.Future[None] = loop.create_future()
        closed = False
        on_loop = self._on_loop

        def record(run: _ProbeRun, outcome: ProbeOutcome, answer: fx.Outcome[Any]) -> None:
            try:
                end = run.answer(answer)
            except Exception as exc:  # a broken sequence or executor: logged, the round goes on
                log.exception("%s: the probe of %s failed: %s", self.name, run.group.group_id, exc)
                end = ProbeEnd()
            results.append((outcome, end.failed, end.applied))

        async def probe_one(run: _ProbeRun) -> None:
            group = run.group
            try:
                if self._async_probe:
                    value = await self.probe(group, self.timeout_s)  # type: ignore[misc]
                elif on_loop is not None and (engines := on_loop.engines(group)) is not None:
                    value = await on_loop.probe(engines, self.timeout_s)
                else:
                    value = await self._sync_probe(group)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                outcome = self._outcome(group, t0, None, f"{type(exc).__name__}: {exc}")
                answer: fx.Outcome[Any] = fx.Failed(outcome.error or "probe failed")
            else:
                outcome = self._outcome(group, t0, value, None)
                answer = fx.Ok(fx.Probed(outcome.unhealthy, outcome.error))
            if closed:  # answered after the deadline; the round already counted it
                return
            del running[group.group_id]
            record(run, outcome, answer)
            if not running:
                _resolve(all_done)

        for group in groups:
            generation = group.generation
            hung = self._still_running(group, t0)
            if hung is _NOT_YET:
                continue  # stuck for less than another timeout_s: not probed, nothing counted
            run = _ProbeRun(self, group, epoch, generation)
            if not run.start():  # the sequence ended before it probed
                continue
            if isinstance(hung, ProbeOutcome):
                record(run, hung, fx.Failed(hung.error or "probe still running"))
                continue
            running[group.group_id] = (loop.create_task(probe_one(run)), run)
        inconclusive: list[str] = []
        if running:
            window_start = loop.time()
            deadline = loop.call_later(self.timeout_s, _resolve, all_done)
            await all_done
            deadline.cancel()
            closed = True
            stalled = self._stalls.longest(window_start, loop.time())
            for task, run in list(running.values()):
                task.cancel()  # a running sync probe keeps its thread until the engine answers
                self._counted_at[run.group.group_id] = time.monotonic()
                if stalled > self.timeout_s / 2:  # the checker stood still, not the engine
                    inconclusive.append(run.group.group_id)
                    continue  # the sequence ends unanswered: nothing read, nothing applied
                why = f"no answer within {self.timeout_s}s"
                outcome = self._outcome(run.group, t0, None, why, timed_out=True)
                record(run, outcome, fx.TimedOut(self.timeout_s, outcome.error))
            running.clear()
            if inconclusive:
                self._inconclusive += len(inconclusive)
                log.warning(
                    "%s: the probe loop stood still for %.1fs within a %.1fs probe window "
                    "(this process was frozen or starved): the time-outs of %s are not counted",
                    self.name,
                    stalled,
                    self.timeout_s,
                    ", ".join(inconclusive),
                )
        duration = time.monotonic() - t0
        outcomes = tuple(o for o, _, _ in results)
        summary = HealthRound(
            started_at=started_at,
            duration_s=duration,
            probed=len(outcomes),
            healthy=sum(1 for o in outcomes if o.ok),
            failed_probes=tuple(o.group_id for o in outcomes if not o.ok),
            timed_out=tuple(o.group_id for o in outcomes if o.timed_out),
            failed_groups=tuple(o.group_id for o, failed, _ in results if failed),
            discarded=sum(1 for _, _, applied in results if not applied),
            outcomes=outcomes,
            inconclusive=tuple(inconclusive),
        )
        self._rounds += 1
        self._last_round = summary
        return summary

    def _prune(self, groups: list[WorkerGroup]) -> None:
        """Forget finished probes and the counts of groups that left the registry."""
        if self._inflight:
            for gid in [g for g, f in self._inflight.items() if f.done()]:
                del self._inflight[gid]
                self._counted_at.pop(gid, None)
        self.ledger.keep_only(g.group_id for g in groups)

    def _still_running(self, group: WorkerGroup, t0: float) -> ProbeOutcome | object | None:
        """None if the group may be probed; else its previous sync probe is still stuck: a
        failure outcome once another ``timeout_s`` has passed since its last counted failure,
        :data:`_NOT_YET` before that."""
        if self._async_probe:
            return None
        previous = self._inflight.get(group.group_id)
        if previous is None or previous.done():
            return None
        now = time.monotonic()
        since = now - self._counted_at.get(group.group_id, now - self.timeout_s)
        if since < self.timeout_s:
            return _NOT_YET
        self._counted_at[group.group_id] = now
        loop = self._loop
        if loop is not None:
            later = loop.time()
            if self._stalls.longest(later - since, later) > self.timeout_s / 2:
                self._inconclusive += 1  # the checker stood still: another timeout_s to wait
                return _NOT_YET
        return self._outcome(
            group, t0, None, "previous probe still running (hung)", still_running=True
        )

    async def _sync_probe(self, group: WorkerGroup) -> Any:
        call = DaemonCall.start(
            functools.partial(self.probe, group, self.timeout_s),
            name=f"{self.name}-probe-{group.group_id}",
        )
        self._inflight[group.group_id] = call
        return await asyncio.wrap_future(call.future)

    def _outcome(
        self,
        group: WorkerGroup,
        t0: float,
        value: Any,
        error: str | None,
        *,
        timed_out: bool = False,
        still_running: bool = False,
    ) -> ProbeOutcome:
        duration = time.monotonic() - t0
        if error is None and (value is True or value is None):
            return ProbeOutcome(group.group_id, (), duration)
        if error is not None:
            bad = group.ranks
        elif value is False:
            bad = group.ranks
            error = "probe answered unhealthy"
        elif isinstance(value, Mapping):
            bad = tuple(r for r in group.ranks if not value.get(r, False))
            if bad:
                error = f"probe answered rank(s) {list(bad)} unhealthy"
        else:
            bad = group.ranks
            error = f"probe returned {type(value).__name__}, expected bool or rank mapping"
        return ProbeOutcome(
            group.group_id,
            bad,
            duration,
            None if error is None else bound_text(error, _MAX_REASON_CHARS),
            timed_out,
            still_running,
        )

    def hand_off(self, effect: fx.GroupFailed) -> None:
        """A probe sent ``fail`` (its :class:`~rollsafe.operations.effects.GroupFailed` step):
        count it, log it, queue the group for ``on_group_failed`` as the policy said (on the
        notifier thread, never here)."""
        self._groups_failed += 1
        failure = GroupFailure(
            effect.group, effect.unhealthy, effect.failures, effect.reason, time.time()
        )
        log.warning(
            "%s: group %s failed %d consecutive probe(s) on rank(s) %s: %s; taken out of routing",
            self.name,
            effect.group,
            effect.failures,
            list(effect.unhealthy),
            failure.reason,
        )
        if effect.handoff is policy.Handoff.ENQUEUE and self._notifier is not None:
            self._notifier.put(failure)


class _StallWatch:
    """When an event loop did not run: a heartbeat every ``tick_s`` notes each gap between two
    beats longer than twice the tick (the loop's thread was held: the GIL, a collection, a
    starved host), in the loop's clock; :meth:`longest` is the longest such stall overlapping a
    window. Keeps the last 256 stalls."""

    def __init__(self, tick_s: float) -> None:
        self.tick_s = max(0.005, tick_s)
        self._stalls: collections.deque[tuple[float, float]] = collections.deque(maxlen=256)
        self._lock = threading.Lock()

    async def beat(self, loop: asyncio.AbstractEventLoop, stopping: Callable[[], bool]) -> None:
        last = loop.time()
        while not stopping():
            await asyncio.sleep(self.tick_s)
            now = loop.time()
            if now - last > 2 * self.tick_s:
                with self._lock:
                    self._stalls.append((last + self.tick_s, now))
            last = now

    def note(self, start: float, end: float) -> None:
        """Record a stall by hand (tests)."""
        with self._lock:
            self._stalls.append((start, end))

    def longest(self, start: float, end: float) -> float:
        """The longest stall overlapping ``[start, end]`` (loop time), in seconds."""
        with self._lock:
            stalls = list(self._stalls)
        return max((min(b, end) - max(a, start) for a, b in stalls), default=0.0)


class _ProbeRun(Executor):
    """The executor of one group's :func:`rollsafe.operations.probe.probe` in one round.

    The round drives the sequence up to its probe (:meth:`~rollsafe.operations.effects.Run.until`
    ``ProbeMembers``), performs every group's probe concurrently under its deadline, and
    :meth:`answer` resumes the sequence with the outcome: the answer is applied under the
    ledger's lock (``LockHealth`` .. ``UnlockHealth``), the ``fail`` sent outside it, since
    registry listeners run on this thread during the send and must be free to call
    ``pause()``/``wake()`` or take their own locks without ever waiting on the probe loop.
    The registry's effects are the registry's own handlers (a part).
    """

    parts = {RegistryEffects: "registry_effects"}

    def __init__(
        self, manager: HealthManager, group: WorkerGroup, epoch: int, generation: int
    ) -> None:
        self.ledger = manager.ledger
        self.registry = manager.registry
        self.registry_effects = manager.registry_effects
        self.hand_off = manager.hand_off
        self.probe_states = manager.probe_states
        self.group = group
        self.epoch = epoch
        self.generation = generation
        self.held = False
        self.run = fx.Run(probe_op.probe(group.group_id, manager.failure_threshold), self.perform)

    def start(self) -> bool:
        """Perform the steps before the probe; False when the sequence ended first."""
        try:
            stopped = self.run.until(fx.ProbeMembers)
        finally:
            if self.run.done:
                self._release()
        return stopped is not None

    def answer(self, outcome: fx.Outcome[fx.Probed]) -> ProbeEnd:
        """The probe's ``outcome``: perform the rest of the steps; their :class:`ProbeEnd`."""
        try:
            return self.run.resume(outcome)
        finally:
            self._release()

    def _release(self) -> None:
        if self.held:
            self.held = False
            self.ledger.lock.release()

    @handles(fx.LockHealth)
    def lock(self, _effect: fx.LockHealth) -> fx.Outcome[None]:
        self.ledger.lock.acquire()
        self.held = True
        return fx.DONE

    @handles(fx.UnlockHealth)
    def unlock(self, _effect: fx.UnlockHealth) -> fx.Outcome[None]:
        self._release()
        return fx.DONE

    @handles(fx.ReadProbeFacts)
    def read_facts(self, _effect: fx.ReadProbeFacts) -> fx.Outcome[fx.ProbeFacts | None]:
        ledger, group = self.ledger, self.group
        if not ledger.applies(self.epoch):
            return fx.Ok(None)
        if (
            group.generation != self.generation
            or group.machine.state not in self.probe_states
            or group.loading_weights
            or group.group_id not in self.registry
        ):
            return fx.Ok(fx.ProbeFacts(group.ranks, {}, {}, moved=True))
        recorded = {rank: fact.healthy for rank, fact in group.machine.members.items()}
        return fx.Ok(fx.ProbeFacts(group.ranks, ledger.counts(group.group_id), recorded))

    @handles(fx.SetFailureCounts)
    def set_counts(self, effect: fx.SetFailureCounts) -> fx.Outcome[None]:
        self.ledger.set_counts(effect.group, effect.counts)
        return fx.DONE

    @handles(fx.GroupFailed)
    def group_failed(self, effect: fx.GroupFailed) -> fx.Outcome[None]:
        self.hand_off(effect)
        return fx.DONE
