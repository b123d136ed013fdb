"""Router: sends rollout requests to routable worker groups only.

Owns the request path of the fleet:

* choice: among the groups in ``active``, the one with the fewest outstanding requests (ties
  rotate); a request is admitted only by :meth:`WorkerGroup.begin_request`, which re-checks the
  state under the lock every transition of that group takes, so no request is ever dispatched
  to a group that is not ``active`` at dispatch time;
* sticky sessions: a session id keeps going to the group that served it while that group stays
  routable; when the group leaves routing (a registry listener) or fails a request, its
  sessions are unpinned and move to another group on their next request;
* streaming and continuation: a token-id request on streaming clients is streamed and, when
  its group fails or a sync aborts it, continued elsewhere from its tokens so far
  (:mod:`rollsafe.fleet.continuation`); its result carries ``segments`` (provenance,
  :mod:`rollsafe.fleet.provenance`). Text prompts keep the path below;
* failures: retryable ones (:class:`EngineUnavailable`, :class:`EngineTimeout`, and 5xx
  answers) are retried on ANOTHER routable group, at most ``max_attempts`` tries in all; final
  ones (4xx :class:`EngineRequestError`) are not retried. The error text a caller gets is
  bounded (``max_error_chars``, a few KB), however many attempts failed and however large the
  engines' error bodies were.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
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
    a weight sync; empty for a text prompt served without streaming)."""

    result: GenerateResult
    group_id: str
    attempts: int
    segments: tuple[Segment, ...] = ()

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
    """Least-outstanding, session-sticky request router over a :class:`FleetRegistry`.

    ``max_attempts`` bounds the tries per request (each on a different group);
    ``max_error_chars`` bounds a failed request's error text; ``max_sessions`` bounds the sticky
    table (least recently used sessions are forgotten first); ``wait_for_routable_s`` lets a
    request wait that long for a group to become active before :class:`NoRoutableGroup`;
    ``on_group_error(group_id, exc)`` is called (quickly: enqueue or wake a health manager) when
    a request fails retryably on a group.

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
        #: called on the request's thread after each streamed event with (group id, tokens of
        #: the request so far); keep it quick (tests and benchmarks hook crashes in here)
        self.on_progress: Callable[[str, int], None] | None = None
        self.max_aborts = max_aborts
        #: False: a streamed request whose group failed starts over on another group, its
        #: tokens counted as regenerated (the behaviour before #17; benchmarks compare both)
        self.keep_tokens = True
        #: set unless a sync holds continuations (:meth:`hold`): aborted requests wait on it
        self._released = threading.Event()
        self._released.set()
        from rollsafe.fleet.continuation import ContinuationStats

        self.continuation = ContinuationStats()
        self._lock = threading.Lock()
        self._routable_changed = threading.Condition(self._lock)
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._by_group: dict[str, set[str]] = {}
        self._rotor = itertools.count()
        self._served: Counter[str] = Counter()
        self._retries = 0
        self._failures = 0
        self._sessions_moved = 0
        self._closed = False
        registry.add_listener(self)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop listening to the registry (in-flight requests finish normally)."""
        self.registry.remove_listener(self)
        with self._lock:
            self._closed = True
            self._routable_changed.notify_all()

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ listener hooks
    def on_transition(self, group: WorkerGroup, record: GroupTransition) -> None:
        if record.left_routing:
            self._unpin_group(group.group_id)

    def on_group_active(self, group: WorkerGroup) -> None:
        with self._lock:
            self._routable_changed.notify_all()

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
    def acquire(self, session_id: str | None = None, exclude: Iterable[str] = ()) -> WorkerGroup:
        """Admit one request on a routable group and return it; the caller must call
        ``group.end_request(...)`` when done. Raises :class:`NoRoutableGroup`."""
        excluded = frozenset(exclude)
        deadline = time.monotonic() + self.wait_for_routable_s
        while True:
            group = self._try_acquire(session_id, excluded)
            if group is not None:
                return group
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._closed:
                states = {g.group_id: g.state for g in self.registry.groups()}
                raise NoRoutableGroup(states, sorted(excluded))
            with self._lock:
                self._routable_changed.wait(min(remaining, 0.05))

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

    # ------------------------------------------------------------------ requests
    def generate(
        self,
        input_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        session_id: str | None = None,
        timeout: float | None = None,
    ) -> RoutedResult:
        """Generate on a routable group; retry retryable failures on other groups.

        Raises :class:`NoRoutableGroup` when no group can take the request at all, and
        :class:`RequestFailed` (bounded message) when it failed finally or on every try.
        Non-engine errors (a bad argument) propagate unchanged.
        """
        call_timeout = self.request_timeout_s if timeout is None else timeout
        streamed = self.continue_on_failure and input_ids is not None and text is None
        if streamed and input_ids is not None and self._all_stream():
            from rollsafe.fleet.continuation import generate_continued

            return generate_continued(
                self,
                input_ids,
                sampling_params=sampling_params,
                session_id=session_id,
                timeout=call_timeout,
                max_aborts=self.max_aborts,
            )
        tried: list[str] = []
        attempts: list[tuple[str, str]] = []
        notes: list[str] = []
        last_exc: EngineError | None = None
        for attempt in range(1, self.max_attempts + 1):
            try:
                group = self.acquire(session_id, exclude=tried)
            except NoRoutableGroup as exc:
                if last_exc is None:
                    raise
                notes.append(f"no other routable group to retry on ({bound_text(str(exc), 256)})")
                break
            tried.append(group.group_id)
            client = group.client
            if client is None:
                group.end_request(ok=False, error="group has no engine client")
                raise RouterError(f"worker group {group.group_id!r} has no engine client")
            try:
                result = client.generate(
                    input_ids, text=text, sampling_params=sampling_params, timeout=call_timeout
                )
            except EngineError as exc:
                retryable = is_retryable(exc)
                group.end_request(ok=False, error=f"{type(exc).__name__}: {exc}")
                attempts.append((group.group_id, type(exc).__name__))
                notes.append(f"{group.group_id}: {type(exc).__name__}: {exc}")
                last_exc = exc
                self.request_failed(group.group_id, exc, notify=retryable)
                if not retryable:
                    raise self.failure(attempts, notes, retryable=False) from exc
                if session_id is not None and self.session_group(session_id) == group.group_id:
                    self.end_session(session_id)
                if attempt < self.max_attempts:
                    self.count_retry()
                continue
            except BaseException:
                group.end_request(ok=False, error="request interrupted")
                raise
            group.end_request(ok=True)
            self.request_ok(group.group_id)
            if session_id is not None:
                self.pin(session_id, group.group_id)
            self.count_served(group.group_id)
            return RoutedResult(result, group.group_id, attempt)
        assert last_exc is not None
        raise self.failure(attempts, notes, retryable=True) from last_exc

    # ------------------------------------------------------------------ partial rollouts
    def hold(self) -> None:
        """Hold continuations of aborted requests until :meth:`release` (a sync that pauses
        generation in ``abort`` mode holds them while it pushes the new weights)."""
        self._released.clear()

    def release(self) -> None:
        """Let held continuations go (to the groups' new weights)."""
        self._released.set()

    def wait_released(self, timeout: float | None = None) -> bool:
        """Block while continuations are held; return False if still held after ``timeout``."""
        return self._released.wait(timeout)

    # ------------------------------------------------------------------ bookkeeping
    def _all_stream(self) -> bool:
        from rollsafe.fleet.continuation import StreamingClient

        clients = [g.client for g in self.registry.groups()]
        return bool(clients) and all(isinstance(c, StreamingClient) for c in clients)

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
