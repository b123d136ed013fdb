"""Router: which routable worker group takes a rollout request, and the request path's books.

Owns the decisions and the bookkeeping of the fleet's request path (the I/O is the data
plane's, :mod:`rollsafe.fleet.dataplane`, asyncio end to end):

* choice (:meth:`Router.acquire`, a coroutine): among the groups in ``active``, the one with
  the fewest outstanding requests (ties rotate); a request is admitted only by
  :meth:`WorkerGroup.begin_request`, which re-checks the state under the lock every transition
  of that group takes, so no request is ever dispatched to a group that is not ``active`` at
  dispatch time; with none routable a request waits up to ``wait_for_routable_s`` (woken when a
  group becomes active, no thread held);
* sticky sessions: a session id keeps going to the group that served it while that group stays
  routable; when the group leaves routing (a registry listener) or fails a request, its
  sessions are unpinned and move to another group on their next request;
* failures: :func:`is_retryable` says which engine errors go on to ANOTHER routable group (at
  most ``max_attempts`` tries in all); :meth:`Router.failure` builds the bounded error a caller
  gets (``max_error_chars``, a few KB, however many attempts failed and however large the
  engines' error bodies were); the request-health hooks (``on_group_error`` / ``on_group_ok``)
  and the counters (:meth:`Router.stats`);
* partial rollouts: :meth:`Router.hold` / :meth:`Router.release` hold new requests and the
  continuations of aborted ones while a sync pushes (:mod:`rollsafe.fleet.partial_rollouts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollsafe.adapters.engines.errors import (
    EngineError,
    EngineRequestError,
    EngineUnavailable,
)
from rollsafe.errors import InvalidArgument
from rollsafe.fleet.provenance import Segment, off_policy, versions_used
from rollsafe.ports import GenerateResult
from rollsafe.registry import (
    FleetError,
    FleetListener,
    FleetRegistry,
    GroupTransition,
    WorkerGroup,
)
from rollsafe.text import bound_text

__all__ = [
    "DEFAULT_MAX_ERROR_CHARS",
    "ContinuationFailed",
    "NoRoutableGroup",
    "RequestFailed",
    "RoutedResult",
    "Router",
    "RouterError",
    "is_retryable",
]

log = logging.getLogger(__name__)

#: Default cap on the error text of a failed request (all attempts together).
DEFAULT_MAX_ERROR_CHARS = 4096


class RouterError(FleetError):
    """Base class of the router's errors."""


class NoRoutableGroup(RouterError):
    """No worker group can take the request (none is ``active``, or all were tried)."""

    def __init__(self, states: Mapping[str, str], tried: Sequence[str] = ()) -> None:
        self.states = dict(states)
        self.tried = tuple(tried)
        items = sorted(self.states.items())
        shown = ", ".join(f"{g}={s}" for g, s in items[:16])
        if len(items) > 16:
            shown += f", ... ({len(items)} groups)"
        extra = f"; already tried: {list(self.tried)}" if self.tried else ""
        super().__init__(f"no routable worker group (states: {shown or 'no groups'}){extra}")


class RequestFailed(RouterError):
    """A request failed on every group it was tried on, or with a final (non-retryable) error.

    ``attempts`` lists ``(group_id, error type name)`` per try; ``retryable`` says whether the
    last error was retryable (the router ran out of attempts or of groups) or final. The message
    is at most ``max_error_chars`` long; the last engine error is ``__cause__``.
    """

    def __init__(
        self, message: str, attempts: Sequence[tuple[str, str]], *, retryable: bool
    ) -> None:
        self.attempts = tuple(attempts)
        self.retryable = retryable
        super().__init__(message)

    @property
    def groups(self) -> tuple[str, ...]:
        return tuple(g for g, _ in self.attempts)


class ContinuationFailed(RequestFailed):
    """A streamed request gave up (bounded tries spent, no group left, or a final error):
    ``segments`` lists what each try generated, ``output_ids`` the tokens received before it
    gave up (:mod:`rollsafe.fleet.continuation`)."""

    def __init__(
        self,
        message: str,
        attempts: Sequence[tuple[str, str]],
        *,
        retryable: bool,
        segments: Sequence[Segment] = (),
        output_ids: Sequence[int] = (),
    ) -> None:
        super().__init__(message, attempts, retryable=retryable)
        self.segments = tuple(segments)
        self.output_ids = tuple(output_ids)


@dataclass(frozen=True)
class RoutedResult:
    """A completion and where it came from: ``group_id`` served its last token; ``segments``
    (:class:`~rollsafe.fleet.provenance.Segment`) say which group and weights version produced
    each token range (one segment unless the request was continued after a failure or across
    a weight sync; empty for a text prompt served without streaming); ``failed_on``: the groups
    that failed this request before it was served, in order."""

    result: GenerateResult
    group_id: str
    attempts: int
    segments: tuple[Segment, ...] = ()
    failed_on: tuple[str, ...] = ()

    @property
    def weights_versions(self) -> tuple[str | None, ...]:
        """The weights versions that produced this result's tokens, oldest first."""
        if not self.segments:
            return (self.result.weight_version,)
        return versions_used(self.segments)

    @property
    def off_policy(self) -> int | None:
        """Newest minus oldest weights version used (0: one version; None: not numbers)."""
        return off_policy(self.segments)

    @property
    def continued(self) -> bool:
        """Whether more than one try produced this result's tokens."""
        return len({s.attempt for s in self.segments}) > 1

    @property
    def text(self) -> str:
        return self.result.text

    @property
    def output_ids(self) -> list[int]:
        return self.result.output_ids

    @property
    def weight_version(self) -> str | None:
        return self.result.weight_version

    @property
    def output_logprobs(self) -> tuple[float | None, ...] | None:
        """The sampled tokens' logprobs (asked with ``return_logprob``), else None."""
        return self.result.output_logprobs


def is_retryable(exc: BaseException) -> bool:
    """Whether a failed generate may be retried on another group.

    Connection refused/reset and timeouts (:class:`EngineUnavailable`, :class:`EngineTimeout`)
    and server-side errors (5xx) are; client errors (4xx) and everything else are not.
    """
    if isinstance(exc, EngineUnavailable):
        return True
    if isinstance(exc, EngineRequestError):
        return exc.status_code >= 500
    return False


class Router(FleetListener):
    """Least-outstanding, session-sticky choice of a routable group, and the request path's books.

    ``max_attempts`` bounds the tries per request (each on a different group);
    ``max_error_chars`` bounds a failed request's error text; ``max_sessions`` bounds the sticky
    table (least recently used sessions are forgotten first); ``wait_for_routable_s`` lets a
    request wait that long for a group to become active before :class:`NoRoutableGroup`;
    ``request_timeout_s`` is a request's default wait for each engine event;
    ``on_group_error(group_id, exc)`` is called (quickly: it runs on the data plane's event loop)
    when a request fails retryably on a group. ``continue_on_failure``, ``max_aborts``,
    ``keep_tokens``, ``whole_up_to`` and ``on_progress`` steer continuation
    (:mod:`rollsafe.fleet.continuation`).

    The router registers itself as a registry listener; :meth:`close` unregisters it.
    """

    def __init__(
        self,
        registry: FleetRegistry,
        *,
        max_attempts: int = 3,
        max_error_chars: int = DEFAULT_MAX_ERROR_CHARS,
        max_sessions: int = 100_000,
        wait_for_routable_s: float = 0.0,
        request_timeout_s: float | None = None,
        on_group_error: Callable[[str, EngineError], None] | None = None,
        continue_on_failure: bool = True,
        max_aborts: int = 8,
        whole_up_to: int = 64,
    ) -> None:
        if max_attempts < 1:
            raise InvalidArgument("max_attempts", f"max_attempts must be >= 1, got {max_attempts}")
        if max_error_chars < 64:
            raise InvalidArgument(
                "max_error_chars", f"max_error_chars must be >= 64, got {max_error_chars}"
            )
        if max_sessions < 1:
            raise InvalidArgument("max_sessions", f"max_sessions must be >= 1, got {max_sessions}")
        if wait_for_routable_s < 0:
            raise InvalidArgument(
                "wait_for_routable_s",
                f"wait_for_routable_s must be >= 0, got {wait_for_routable_s}",
            )
        if isinstance(whole_up_to, bool) or not isinstance(whole_up_to, int) or whole_up_to < 0:
            raise InvalidArgument(
                "whole_up_to", f"whole_up_to must be an int >= 0, got {whole_up_to!r}"
            )
        self.registry = registry
        self.max_attempts = max_attempts
        self.max_error_chars = max_error_chars
        self.max_sessions = max_sessions
        self.wait_for_routable_s = wait_for_routable_s
        self.request_timeout_s = request_timeout_s
        self.on_group_error = on_group_error
        #: called with a group id after a request succeeded on it (request-failure health)
        self.on_group_ok: Callable[[str], None] | None = None
        #: stream token-id prompts and continue them on another group when theirs fails
        #: (:mod:`rollsafe.fleet.continuation`); False: retry from scratch, as before
        self.continue_on_failure = continue_on_failure
        #: called on the data plane's event loop after each streamed event with (group id,
        #: tokens of the request so far); keep it quick (tests and benchmarks hook crashes in)
        self.on_progress: Callable[[str, int], None] | None = None
        self.max_aborts = max_aborts
        #: False: a streamed request whose group failed starts over on another group, its
        #: tokens counted as regenerated (the behaviour before #17; benchmarks compare both)
        self.keep_tokens = True
        #: a request read whole by its caller (``RolloutFleet.generate``, a gateway request
        #: without ``stream``) that asks at most this many new tokens is read from its engine
        #: as one answer, not token by token: no per-token events to parse, and a crash costs
        #: at most these tokens, generated again elsewhere (0: every request streams)
        self.whole_up_to = whole_up_to
        #: how long a request waits for a sync that holds requests (:meth:`hold`) to release
        self.hold_wait_s = 120.0
        #: set unless a sync holds requests (:meth:`hold`): new and aborted ones wait on it
        self._released = threading.Event()
        self._released.set()
        from rollsafe.fleet.continuation import ContinuationStats

        self.continuation = ContinuationStats()
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._by_group: dict[str, set[str]] = {}
        self._rotor = itertools.count()
        self._served: Counter[str] = Counter()
        self._retries = 0
        self._failures = 0
        self._sessions_moved = 0
        self._closed = False
        #: requests waiting for a change (a group became active, continuations released, the
        #: router closed), each on its own event loop
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        registry.add_listener(self)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop listening to the registry (in-flight requests finish normally)."""
        self.registry.remove_listener(self)
        with self._lock:
            self._closed = True
        self._wake()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ listener hooks
    def on_transition(self, group: WorkerGroup, record: GroupTransition) -> None:
        if record.left_routing:
            self._unpin_group(group.group_id)

    def on_group_active(self, group: WorkerGroup) -> None:
        self._wake()

    # ------------------------------------------------------------------ waiting, no thread held
    def _wake(self) -> None:
        """Wake every waiting request (on its own loop; a loop already closed is skipped)."""
        with self._lock:
            waiters = list(self._waiters)
        for loop, event in waiters:
            with contextlib.suppress(RuntimeError):  # that loop is closed
                loop.call_soon_threadsafe(event.set)

    @contextlib.contextmanager
    def _change(self) -> Iterator[asyncio.Event]:
        """An event set by the next :meth:`_wake`; registered before the caller checks, so a
        change between its check and its wait is never missed."""
        entry = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            self._waiters.add(entry)
        try:
            yield entry[1]
        finally:
            with self._lock:
                self._waiters.discard(entry)

    @staticmethod
    async def _wait(event: asyncio.Event, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)

    # ------------------------------------------------------------------ sessions
    def session_group(self, session_id: str) -> str | None:
        """The group ``session_id`` is pinned to, if any."""
        with self._lock:
            return self._sessions.get(session_id)

    def end_session(self, session_id: str) -> None:
        """Forget a session's pin."""
        with self._lock:
            self._drop_session(session_id)

    def pin(self, session_id: str, group_id: str) -> None:
        with self._lock:
            old = self._sessions.get(session_id)
            if old == group_id:
                self._sessions.move_to_end(session_id)
                return
            if old is not None:
                self._drop_session(session_id)
                self._sessions_moved += 1
            self._sessions[session_id] = group_id
            self._by_group.setdefault(group_id, set()).add(session_id)
            while len(self._sessions) > self.max_sessions:
                oldest = next(iter(self._sessions))
                self._drop_session(oldest)

    def _drop_session(self, session_id: str) -> None:  # caller holds self._lock
        gid = self._sessions.pop(session_id, None)
        if gid is not None:
            members = self._by_group.get(gid)
            if members is not None:
                members.discard(session_id)
                if not members:
                    del self._by_group[gid]

    def _unpin_group(self, group_id: str) -> None:
        with self._lock:
            sessions = self._by_group.pop(group_id, set())
            for sid in sessions:
                self._sessions.pop(sid, None)
            self._sessions_moved += len(sessions)

    # ------------------------------------------------------------------ choice
    async def acquire(
        self,
        session_id: str | None = None,
        exclude: Iterable[str] = (),
        *,
        wait_s: float | None = None,
    ) -> WorkerGroup:
        """Admit one request on a routable group and return it; the caller must call
        ``group.end_request(...)`` when done. While a sync holds requests (:meth:`hold`: it
        pauses generation in ``abort`` mode and pushes) wait for its release, at most
        ``hold_wait_s``; with none routable, wait (at most ``wait_s``, default
        ``wait_for_routable_s``) for one to become active; then :class:`NoRoutableGroup`."""
        excluded = frozenset(exclude)
        if not self.held and not self._closed:
            # the common case admits at once: no waiter to register (that is only needed
            # before a check whose failure leads to a wait, below)
            group = self._try_acquire(session_id, excluded)
            if group is not None:
                return group
        wait = self.wait_for_routable_s if wait_s is None else wait_s
        deadline = time.monotonic() + wait
        held_deadline = time.monotonic() + max(wait, self.hold_wait_s)
        while True:
            with self._change() as changed:
                if self.held and not self._closed:  # a sync in abort mode: its new weights first
                    remaining = held_deadline - time.monotonic()
                    if remaining > 0:
                        await self._wait(changed, min(remaining, 0.25))
                        continue
                group = self._try_acquire(session_id, excluded)
                if group is not None:
                    return group
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    states = {g.group_id: g.state for g in self.registry.groups()}
                    raise NoRoutableGroup(states, sorted(excluded))
                # a group that turns active wakes us; the cap re-checks groups that became
                # routable without a transition into ``active`` (none today: a safety net)
                await self._wait(changed, min(remaining, 0.25))

    def _try_acquire(self, session_id: str | None, excluded: frozenset[str]) -> WorkerGroup | None:
        if session_id is not None:
            pinned = self.session_group(session_id)
            if pinned is not None and pinned not in excluded and pinned in self.registry:
                group = self.registry.get(pinned)
                if group.begin_request() is not None:
                    return group
        candidates = [
            g for g in self.registry.groups() if g.group_id not in excluded and g.is_routable
        ]
        while candidates:
            low = min(g.outstanding for g in candidates)
            tied = [g for g in candidates if g.outstanding == low]
            group = tied[next(self._rotor) % len(tied)]
            if group.begin_request() is not None:
                if session_id is not None:
                    self.pin(session_id, group.group_id)
                return group
            candidates.remove(group)  # left routing since the snapshot
        return None

    # ------------------------------------------------------------------ partial rollouts
    def hold(self) -> None:
        """Hold new requests and continuations of aborted ones until :meth:`release` (a sync
        that pauses generation in ``abort`` mode holds them while it pushes the new weights:
        they are dispatched to the new weights, never to a paused engine)."""
        self._released.clear()

    def release(self) -> None:
        """Let held continuations go (to the groups' new weights)."""
        self._released.set()
        self._wake()

    @property
    def held(self) -> bool:
        """Whether continuations are held now."""
        return not self._released.is_set()

    async def wait_released(self, timeout: float | None = None) -> bool:
        """Wait while continuations are held; return False if still held after ``timeout``."""
        if self._released.is_set():  # the common case: nothing held, no waiter registered
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._change() as changed:
                if self._released.is_set():
                    return True
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                await self._wait(changed, 0.25 if remaining is None else min(remaining, 0.25))

    # ------------------------------------------------------------------ bookkeeping
    def request_failed(self, group_id: str, exc: EngineError, *, notify: bool = True) -> None:
        """A request failed on ``group_id``: count it; tell the hook when ``notify`` (a
        retryable failure: the group's fault, not the request's)."""
        with self._lock:
            self._failures += 1
        if notify and self.on_group_error is not None:
            try:
                self.on_group_error(group_id, exc)
            except Exception:
                log.exception("router on_group_error hook raised; continuing")

    def request_ok(self, group_id: str) -> None:
        if self.on_group_ok is not None:
            try:
                self.on_group_ok(group_id)
            except Exception:
                log.exception("router on_group_ok hook raised; continuing")

    def count_retry(self) -> None:
        with self._lock:
            self._retries += 1

    def count_served(self, group_id: str) -> None:
        with self._lock:
            self._served[group_id] += 1

    def failure(
        self, attempts: Sequence[tuple[str, str]], notes: Sequence[str], *, retryable: bool
    ) -> RequestFailed:
        kind = "retryable" if retryable else "final"
        head = f"request failed ({kind}) after {len(attempts)} attempt(s)"
        budget = max(32, (self.max_error_chars - len(head) - 8) // max(1, len(notes)))
        body = "; ".join(bound_text(n, budget) for n in notes)
        return RequestFailed(
            bound_text(f"{head}: {body}", self.max_error_chars), attempts, retryable=retryable
        )

    # ------------------------------------------------------------------ inspection
    def stats(self) -> dict[str, Any]:
        """Served requests per group, failures, retries, sessions (JSON-friendly)."""
        with self._lock:
            return {
                "served_by_group": dict(self._served),
                "failures": self._failures,
                "retries": self._retries,
                "sessions": len(self._sessions),
                "sessions_moved": self._sessions_moved,
                "continuation": self.continuation.as_dict(),
            }
