"""The fleet's data plane: every rollout request, asyncio end to end.

Owns the execution of a request once the router (:mod:`rollsafe.fleet.router`) has the
decisions:

* :meth:`DataPlane.astream` (token ids in, :class:`~rollsafe.fleet.provenance.TokenChunk` out,
  continued on another group after a crash or a sync's abort:
  :func:`rollsafe.fleet.continuation.stream_continued`);
* :meth:`DataPlane.agenerate` (one :class:`~rollsafe.fleet.router.RoutedResult`): a token-id
  prompt on streaming engines is :meth:`astream` collected (``collected=True``: one asking
  at most ``Router.whole_up_to`` new tokens is read from its engine as one answer, with the
  same continuation); a text prompt (or an engine that cannot stream) is sent whole and
  retried on ANOTHER group after a retryable failure, at most ``max_attempts`` tries;
* :meth:`DataPlane.generate`, the blocking call: :meth:`agenerate` run on the plane's own event
  loop thread (:class:`~rollsafe.event_loop.LoopThread`), so there is one implementation
  of routing and continuation, not two;
* the engines' async companions (:func:`rollsafe.adapters.engines.aio.async_engine`), one per
  client and event loop, on one pooled keep-alive HTTP session per loop
  (:class:`~rollsafe.adapters.engines.aio.AsyncHttp`): any loop may call :meth:`agenerate`
  (the trainer's, the gateway's, the plane's own), no thread is held per request.

Every request ends its admission (``group.end_request``) however it ends, a cancelled one
included (a gateway client that disconnected), and a cancelled request's engine request is
closed with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from rollsafe.adapters.engines.errors import EngineError
from rollsafe.errors import InvalidArgument
from rollsafe.event_loop import LoopThread
from rollsafe.fleet.continuation import StreamingClient, stream_continued
from rollsafe.fleet.provenance import TokenChunk
from rollsafe.fleet.router import (
    NoRoutableGroup,
    RoutedResult,
    Router,
    RouterError,
    is_retryable,
)
from rollsafe.ports import EngineClient, GenerateResult
from rollsafe.registry import WorkerGroup
from rollsafe.text import bound_text

if TYPE_CHECKING:
    from rollsafe.adapters.engines.aio import AsyncEngine, AsyncHttp

__all__ = ["DataPlane", "RequestLog", "collect"]

log = logging.getLogger(__name__)


class RequestLog(Protocol):
    """Who hears how each request ended (the fleet's observer: retried / continued counts)."""

    def request_served(self, group_id: str, failed_on: Sequence[str]) -> None:
        """Served by ``group_id`` after failing on ``failed_on`` (in order; usually none)."""

    def request_gave_up(self, error: BaseException) -> None:
        """Ended by ``error`` (its ``attempts``, when a ``RequestFailed``, name the groups)."""


class _LoopEngines:
    """The async engines of one event loop: one HTTP session, one companion per client."""

    def __init__(self) -> None:
        from rollsafe.adapters.engines.aio import AsyncHttp  # httptools: on first request only

        self.http: AsyncHttp = AsyncHttp()
        self.engines: weakref.WeakKeyDictionary[EngineClient, AsyncEngine] = (
            weakref.WeakKeyDictionary()
        )

    def engine(self, client: EngineClient) -> AsyncEngine:
        engine = self.engines.get(client)
        if engine is None:
            from rollsafe.adapters.engines.aio import async_engine

            engine = self.engines[client] = async_engine(client, self.http)
        return engine


async def collect(chunks: AsyncIterator[TokenChunk]) -> tuple[list[TokenChunk], TokenChunk]:
    """Every chunk of a stream, and its last (finished) one. A chunk that starts before the
    tokens collected so far (a request restarted from scratch) drops what it replaces."""
    kept: list[TokenChunk] = []
    last: TokenChunk | None = None
    count = 0
    async for chunk in chunks:
        if chunk.finished:
            last = chunk
        if chunk.token_ids:
            if chunk.start < count:  # restarted: forget the tokens it replaces
                while kept and kept[-1].start >= chunk.start:
                    count -= len(kept.pop().token_ids)
            kept.append(chunk)
            count += len(chunk.token_ids)
    if last is None:
        raise RouterError("the stream ended without a finished chunk")
    return kept, last


def _result(chunks: Sequence[TokenChunk], last: TokenChunk) -> RoutedResult:
    """One :class:`RoutedResult` from a stream's chunks."""
    ids = [t for c in chunks for t in c.token_ids]
    asked = any(c.logprobs for c in chunks)
    logprobs = tuple(lp for c in chunks for lp in (c.logprobs or (None,) * len(c.token_ids)))
    result = GenerateResult(
        text="".join(c.text for c in chunks),
        output_ids=ids,
        weight_version=last.weight_version,
        finish_reason=last.finish_reason,
        meta_info=dict(last.meta),
        output_logprobs=logprobs if asked else None,
    )
    failed_on = tuple(s.group_id for s in last.segments if s.ended == "failed")
    return RoutedResult(result, last.group_id, last.attempt, last.segments, failed_on)


class DataPlane:
    """Routed requests over ``router``'s groups, asyncio end to end (see the module)."""

    def __init__(self, router: Router, *, log_to: RequestLog | None = None) -> None:
        self.router = router
        self.log_to = log_to
        self._loop_thread = LoopThread("rollsafe-dataplane")
        self._engines: dict[asyncio.AbstractEventLoop, _LoopEngines] = {}
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ engines per loop
    def engine_for(self, group: WorkerGroup) -> AsyncEngine:
        """The async engine of ``group``'s client on the running loop."""
        client = group.client
        if client is None:
            raise RouterError(f"worker group {group.group_id!r} has no engine client")
        loop = asyncio.get_running_loop()
        with self._lock:
            engines = self._engines.get(loop)
            if engines is None:
                if self._closed:
                    raise RouterError("the fleet's data plane is closed")
                engines = self._engines[loop] = _LoopEngines()
        return engines.engine(client)

    def _streams(self) -> bool:
        """Whether every group's client can stream (then token-id prompts are continued)."""
        clients = [g.client for g in self.router.registry.groups()]
        return bool(clients) and all(isinstance(c, StreamingClient) for c in clients)

    # ------------------------------------------------------------------ async API
    def astream(
        self,
        input_ids: Sequence[int],
        *,
        sampling_params: Mapping[str, Any] | None = None,
        session_id: str | None = None,
        timeout: float | None = None,
        wait_for_routable_s: float | None = None,
        collected: bool = False,
    ) -> AsyncIterator[TokenChunk]:
        """Stream one request's tokens as they come, continued after a crash or a sync's abort
        (:mod:`rollsafe.fleet.continuation`); the last chunk is ``finished``. Stopping early
        (``aclose()``, a cancelled task) ends the engine request. ``wait_for_routable_s``: how
        long to wait for a routable group (default the router's). ``collected``: the caller
        uses the tokens only once they are all in, so a request asking at most
        ``Router.whole_up_to`` new tokens is read from each engine as one answer (its chunks
        come per try, not per event; ``timeout`` bounds each whole answer)."""
        if isinstance(input_ids, str) or not isinstance(input_ids, Sequence):
            raise InvalidArgument(
                "input_ids", "astream needs a sequence of token ids (tokenize text first)"
            )
        return self._logged_stream(
            stream_continued(
                self.router,
                self.engine_for,
                input_ids,
                sampling_params=sampling_params,
                session_id=session_id,
                timeout=self._timeout(timeout),
                wait_s=wait_for_routable_s,
                whole=collected and self.reads_whole(sampling_params),
            )
        )

    def reads_whole(self, sampling_params: Mapping[str, Any] | None) -> bool:
        """Whether a collected request with ``sampling_params`` is read as whole answers: its
        ``max_new_tokens`` (or ``max_tokens``) is given, >= 1 and at most
        ``Router.whole_up_to``."""
        limit = self.router.whole_up_to
        if limit <= 0:
            return False
        for key in ("max_new_tokens", "max_tokens"):
            value = (sampling_params or {}).get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return 1 <= value <= limit
        return False

    async def _logged_stream(self, chunks: AsyncIterator[TokenChunk]) -> AsyncIterator[TokenChunk]:
        try:
            async for chunk in chunks:
                if chunk.finished and self.log_to is not None:
                    failed = [s.group_id for s in chunk.segments if s.ended == "failed"]
                    self.log_to.request_served(chunk.group_id, failed)
                yield chunk
        except (RouterError, EngineError) as exc:
            if self.log_to is not None:
                self.log_to.request_gave_up(exc)
            raise

    async def agenerate(
        self,
        input_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        session_id: str | None = None,
        timeout: float | None = None,
        wait_for_routable_s: float | None = None,
    ) -> RoutedResult:
        """One request's whole result (see the module). Raises :class:`NoRoutableGroup` when no
        group can take it at all and :class:`~rollsafe.fleet.router.RequestFailed` (bounded
        message) when it failed finally or on every try."""
        if (input_ids is None) == (text is None):
            raise InvalidArgument("input_ids", "generate needs exactly one of input_ids or text")
        router = self.router
        if input_ids is not None and router.continue_on_failure and self._streams():
            chunks, last = await collect(
                self.astream(
                    input_ids,
                    sampling_params=sampling_params,
                    session_id=session_id,
                    timeout=timeout,
                    wait_for_routable_s=wait_for_routable_s,
                    collected=True,
                )
            )
            return _result(chunks, last)
        try:
            result = await self._generate_whole(
                input_ids,
                text,
                sampling_params,
                session_id,
                self._timeout(timeout),
                wait_for_routable_s,
            )
        except (RouterError, EngineError) as exc:
            if self.log_to is not None:
                self.log_to.request_gave_up(exc)
            raise
        if self.log_to is not None:
            self.log_to.request_served(result.group_id, result.failed_on)
        return result

    def _timeout(self, timeout: float | None) -> float | None:
        return self.router.request_timeout_s if timeout is None else timeout

    async def _generate_whole(
        self,
        input_ids: Sequence[int] | None,
        text: str | None,
        sampling_params: Mapping[str, Any] | None,
        session_id: str | None,
        timeout: float | None,
        wait_s: float | None,
    ) -> RoutedResult:
        """Send the request whole; retry retryable failures on other groups. An answer whose
        weights cannot be told (``weight_version_exact: False`` from a vLLM that reports no
        version, answered across a sync that paused and resumed its engine) is not returned:
        the request is sent again once the router releases held requests (the new weights are
        in), at most ``max_aborts`` times, as a streamed request is continued after an abort."""
        router = self.router
        tried: list[str] = []
        attempts: list[tuple[str, str]] = []
        notes: list[str] = []
        last_exc: EngineError | None = None
        unknown = 0
        attempt = 0
        while attempt < router.max_attempts:
            attempt += 1
            try:
                group = await router.acquire(session_id, exclude=tried, wait_s=wait_s)
            except NoRoutableGroup as exc:
                if last_exc is None:
                    raise
                notes.append(f"no other routable group to retry on ({bound_text(str(exc), 256)})")
                break
            tried.append(group.group_id)
            try:
                engine = self.engine_for(group)
                result = await engine.generate(
                    input_ids, text=text, sampling_params=sampling_params, timeout=timeout
                )
            except EngineError as exc:
                retryable = is_retryable(exc)
                group.end_request(ok=False, error=f"{type(exc).__name__}: {exc}")
                attempts.append((group.group_id, type(exc).__name__))
                notes.append(f"{group.group_id}: {type(exc).__name__}: {exc}")
                last_exc = exc
                router.request_failed(group.group_id, exc, notify=retryable)
                if not retryable:
                    raise router.failure(attempts, notes, retryable=False) from exc
                if session_id is not None and router.session_group(session_id) == group.group_id:
                    router.end_session(session_id)
                if attempt < router.max_attempts:
                    router.count_retry()
                continue
            except BaseException:
                group.end_request(ok=False, error="request interrupted")
                raise
            group.end_request(ok=True)
            router.request_ok(group.group_id)
            if unattributed(result):
                unknown += 1
                router.continuation.add(unattributed=1)
                if unknown > router.max_aborts:
                    notes.append(
                        f"{group.group_id}: the weights that produced the answer could not be "
                        f"told {unknown} times (answered across a sync)"
                    )
                    raise router.failure(attempts, notes, retryable=True)
                log.info(
                    "answer of %s from unknown weights (across a sync): sent again", group.group_id
                )
                tried.remove(group.group_id)  # the group did not fail: it may serve it again
                attempt -= 1
                await router.wait_released(timeout)
                continue
            if session_id is not None:
                router.pin(session_id, group.group_id)
            router.count_served(group.group_id)
            failed_on = tuple(g for g, _ in attempts)
            return RoutedResult(result, group.group_id, attempt, (), failed_on)
        assert last_exc is not None
        raise router.failure(attempts, notes, retryable=True) from last_exc

    # ------------------------------------------------------------------ blocking API
    def generate(
        self,
        input_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        session_id: str | None = None,
        timeout: float | None = None,
    ) -> RoutedResult:
        """:meth:`agenerate`, blocking: run on the plane's own event loop thread."""
        return self._loop_thread.run(
            self.agenerate(
                input_ids,
                text=text,
                sampling_params=sampling_params,
                session_id=session_id,
                timeout=timeout,
            )
        )

    @property
    def loop_thread(self) -> LoopThread:
        """The plane's own event loop thread (the gateway serves on it too)."""
        return self._loop_thread

    # ------------------------------------------------------------------ lifecycle
    async def aclose_loop(self) -> None:
        """Close the engines' HTTP session of the running loop (call it on a loop of yours
        before you close that loop; the plane's own loop is closed by :meth:`close`)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            engines = self._engines.pop(loop, None)
        if engines is not None:
            await engines.http.close()

    def close(self, timeout: float = 5.0) -> None:
        """Close every loop's HTTP session (another loop's on that loop, when it still runs)
        and stop the plane's own loop thread. In-flight requests on the plane's loop are
        cancelled. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            others = {
                loop: engines
                for loop, engines in self._engines.items()
                if not self._loop_thread.started or loop is not self._loop_thread.loop
            }
        for loop, engines in others.items():
            if loop.is_closed() or not loop.is_running():
                continue
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(engines.http.close(), loop).result(timeout)
        self._loop_thread.close(self.aclose_loop, timeout)


def unattributed(result: GenerateResult) -> bool:
    """Whether ``result`` is an answer whose weights cannot be told (a vLLM that reports no
    version, answered across a sync that paused and resumed the engine, not aborted by it)."""
    return result.meta_info.get("weight_version_exact") is False and result.finish_reason != "abort"
