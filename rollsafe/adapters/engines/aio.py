"""Asyncio engine clients: pooled keep-alive HTTP/1.1 on one event loop (httptools' parser in a
bare asyncio protocol, :mod:`~rollsafe.adapters.engines.pool`), with the blocking clients'
dialect rules and error mapping.

Owns the async side of the engine clients, for the fleet's asyncio data plane:

* :class:`AsyncHttp`: one per event loop, one :class:`ConnectionPool` (connections per engine,
  no total limit by default, keep-alive), shared by every async engine on that loop;
  ``await http.close()`` when done. Made outside a running loop, or used from another loop, it
  raises :class:`EventLoopError`. It replaced aiohttp's pooled client (issue #35; docs/gateway.md,
  "The gateway's CPU work", item 4): the gateway's CPU a request 0.73x to 0.85x on the stubs
  (16 tokens), 0.84x to 0.87x with a token every 2 ms; the engine client alone 68 against 175
  µs a whole 16-token answer, 307 to 325 against 448 to 462 µs a stream.
* :class:`AsyncEngine`: what the data plane calls: ``url``, ``await generate(...)`` ->
  :class:`GenerateResult`, ``generate_stream(...)`` -> an async iterator of
  :class:`StreamDelta`.
* :func:`async_engine`: the asyncio companion of a blocking client, not a second client. For
  :class:`SGLangClient` and :class:`VLLMClient` it speaks the same dialect with the same state
  (their ``server_dialect()``, vLLM's pause ledger, 0.26 label, ``model``, API key, timeout and
  retry policy) through the same rule functions (``generate_body``,
  ``refuse_unknown_sampling``, ``completion_body``, ``version_before``/``version_after``, the
  answer parsers, :class:`SSEEventReader`, :class:`SGLangDeltas` / :class:`VLLMDeltas`). Any
  other client (a test fake with a blocking ``generate`` / ``generate_stream``) gets a
  :class:`ThreadedEngine`, which runs those calls in threads.

Errors are the blocking :class:`~rollsafe.adapters.engines.http.HttpTransport`'s:

=========================================  =============================================
failure                                    raised (resent?)
=========================================  =============================================
no connection opened (refused, connect     :class:`EngineUnavailable` /
timeout, DNS)                              :class:`EngineTimeout`, ``request_sent=False``
                                           (generate resent per the client's retry policy)
connection broke after sending             :class:`EngineUnavailable` (never resent)
no byte within the timeout                 :class:`EngineTimeout` (never resent)
HTTP status >= 400                         :class:`EngineRequestError` with the bounded
                                           error body (:class:`BoundedBody`); after a 5xx
                                           the connection is closed, not pooled
stream ends before ``data: [DONE]``        :class:`EngineUnavailable`, after the deltas
                                           already yielded
=========================================  =============================================

A pooled connection the server closed while it was idle is never written to: the request goes
out on another one (nothing was sent on the closed one, so this is no resend).

A stream's body goes straight from the protocol's buffer into the :class:`SSEEventReader`: one
wake-up of the reader per read from the socket, however many events it carried
(:meth:`EventStream.batch` hands them over together). A stream the consumer stops early
(``break``, ``aclose()``, its task cancelled: a gateway's client went away) closes its
connection, so the engine sees the disconnect and aborts the request; the exception
(``CancelledError``, ``GeneratorExit``) goes on. A stream read to its end, or left right after
its finished delta, keeps its connection pooled. Use
``contextlib.aclosing(engine.generate_stream(...))`` to close at a known point.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any, Protocol, TypeVar, runtime_checkable

from rollsafe import json_codec
from rollsafe.adapters.engines.base import HttpEngineClient, parse_weight_version
from rollsafe.adapters.engines.errors import (
    EngineRequestError,
    EngineTimeout,
    EngineUnavailable,
    EventLoopError,
)
from rollsafe.adapters.engines.http import (
    NO_RETRY,
    RETRY_MIN_STATUS,
    BoundedBody,
    RetryPolicy,
    decode_body,
    retryable,
)
from rollsafe.adapters.engines.pool import (
    Connect,
    ConnectionPool,
    HttpFailure,
    HttpTimeout,
    Response,
)
from rollsafe.adapters.engines.sglang import (
    GENERATE_PATH,
    SGLangClient,
    generate_body,
    generate_result,
    refuse_unknown_sampling,
)
from rollsafe.adapters.engines.sglang_dialect import SGLangDialect
from rollsafe.adapters.engines.streaming import (
    SGLangDeltas,
    SSEEventReader,
    StreamDelta,
    VLLMDeltas,
    coalesce_deltas,
)
from rollsafe.adapters.engines.vllm import (
    COMPLETIONS_PATH,
    VLLMClient,
    completion_result,
    with_read_version,
    with_read_version_delta,
)
from rollsafe.adapters.engines.vllm_dialect import Mark, Start, VersionSteps, VLLMDialect
from rollsafe.errors import InvalidArgumentType
from rollsafe.ports import GenerateResult

__all__ = [
    "ENGINE_KEEPALIVE_S",
    "AsyncEngine",
    "AsyncHttp",
    "AsyncSGLangEngine",
    "AsyncVLLMEngine",
    "EventStream",
    "ThreadedEngine",
    "async_engine",
]

_T = TypeVar("_T")
_D = TypeVar("_D", SGLangDialect, VLLMDialect)

#: after a stream's finished event, how long and how many bytes the rest (``[DONE]``, the end
#: of the body) may take to arrive before the connection is dropped instead of pooled
DRAIN_S = 1.0
DRAIN_BYTES = 64 << 10


#: Seconds an idle pooled engine connection is kept (:class:`AsyncHttp`'s default): below the
#: 5 s after which SGLang 0.5.x and vLLM close one (uvicorn's ``timeout_keep_alive``:
#: ``SGLANG_TIMEOUT_KEEP_ALIVE``, ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``), so that the client closes
#: first and never writes a request into a connection the engine is closing (which loses it:
#: "the server closed the connection before answering").
ENGINE_KEEPALIVE_S = 4.0


def encode_json(body: Mapping[str, Any]) -> bytes:
    """A request body as the blocking clients send it (httpx's encoding: UTF-8, compact, no
    NaN or infinity: those are a ``ValueError`` before anything is sent;
    :func:`rollsafe.json_codec.dumps_strict`)."""
    return json_codec.dumps_strict(body)


def _engine_error(
    exc: HttpFailure, url: str, path: str, timed_out: str, broke: str = ""
) -> EngineUnavailable:
    """The engine error of a pool failure: ``request_sent=False`` when nothing was sent (no
    connection), else ``timed_out`` (what did not come in time) or ``broke`` + the reason."""
    if not exc.sent:
        kind = EngineTimeout if isinstance(exc, HttpTimeout) else EngineUnavailable
        return kind(url, path, exc.reason, request_sent=False)
    if isinstance(exc, HttpTimeout):
        return EngineTimeout(url, path, timed_out)
    return EngineUnavailable(url, path, broke + exc.reason)


class AsyncHttp:
    """The pooled HTTP client of one event loop (see the module). ``limit`` (0: none) bounds
    the connections open at once, ``limit_per_host`` those to one engine; with a bound, a
    request waits for a free connection up to its timeout (then :class:`EngineTimeout`,
    ``request_sent=False``). An idle connection is closed after ``keepalive_timeout`` s
    (default :data:`ENGINE_KEEPALIVE_S`, below the engines' own 5 s).
    ``connect``: an async ``(host, port) -> socket`` that opens each connection instead of the
    pool's own TCP connect (:func:`~rollsafe.adapters.engines.pool.connect_tcp` is that one)."""

    def __init__(
        self,
        *,
        limit: int = 0,
        limit_per_host: int = 0,
        keepalive_timeout: float = ENGINE_KEEPALIVE_S,
        connect: Connect | None = None,
    ) -> None:
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            raise EventLoopError(
                "AsyncHttp needs a running event loop: create it inside a coroutine (one per "
                "loop, e.g. in the function asyncio.run runs)"
            ) from None
        self._pool = ConnectionPool(
            self._loop,
            limit=limit,
            limit_per_host=limit_per_host,
            keepalive_timeout=keepalive_timeout,
            connect=connect,
            close_after_status=RETRY_MIN_STATUS,  # a real vLLM drops keep-alive after a 500
        )
        self._closed = False

    # ------------------------------------------------------------------ lifecycle
    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop this client belongs to."""
        return self._loop

    @property
    def pool(self) -> ConnectionPool:
        """The connections (open and idle counts, for tests and metrics)."""
        return self._pool

    @property
    def closed(self) -> bool:
        return self._closed

    async def close(self) -> None:
        """Close every pooled connection; later calls raise :class:`EngineUnavailable`
        (``request_sent=False``)."""
        if not self._closed:
            self._closed = True
            await self._pool.close()

    async def __aenter__(self) -> AsyncHttp:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # ------------------------------------------------------------------ calls
    async def request(
        self,
        method: str,
        url: str,
        path: str,
        *,
        json_body: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float,
        idempotent: bool = False,
        retry: RetryPolicy = NO_RETRY,
    ) -> Any:
        """Send one request to ``url + path`` and return the decoded body (JSON, else text,
        ``None`` when empty). Tries again per ``retry`` exactly when the blocking transport
        does (:func:`~rollsafe.adapters.engines.http.retryable`)."""
        data = None if json_body is None else encode_json(json_body)
        last: EngineRequestError | EngineUnavailable | None = None
        for attempt in range(retry.attempts):
            if attempt:
                await asyncio.sleep(retry.delay(attempt - 1))
            try:
                return await self._once(method, url, path, data, headers, timeout)
            except (EngineRequestError, EngineUnavailable) as exc:
                if self._closed or not retryable(exc, idempotent=idempotent):
                    raise
                last = exc
        assert last is not None
        raise last

    def events(
        self,
        url: str,
        path: str,
        body: Mapping[str, Any],
        *,
        headers: Mapping[str, str] | None = None,
        timeout: float,
        retry: RetryPolicy = NO_RETRY,
        decode: Callable[[str], dict[str, Any]] | None = None,
    ) -> EventStream:
        """POST ``body`` and read the answer's server-sent events: ``async with`` it, then
        iterate it (:class:`EventStream`; ``decode``: :class:`SSEEventReader`'s)."""
        return EventStream(self, url, path, encode_json(body), headers, timeout, retry, decode)

    # ------------------------------------------------------------------ internals
    async def _send(
        self,
        method: str,
        url: str,
        path: str,
        data: bytes | None,
        headers: Mapping[str, str] | None,
        timeout: float,
    ) -> Response:
        """One try: the response with its head read and its body unread (``timeout``: for the
        connection and for each wait for a byte, as the blocking clients' httpx timeout; no
        bound on the whole call: a stream may run long)."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:  # pragma: no cover - only a coroutine calls this
            running = None
        if running is not self._loop:
            raise EventLoopError(
                "this AsyncHttp belongs to another event loop: make one AsyncHttp per loop"
            )
        if self._closed:
            raise EngineUnavailable(url, path, "AsyncHttp is closed", request_sent=False)
        try:
            response = await self._pool.send(
                method,
                url,
                path,
                headers=headers,
                body=data,
                content_type=None if data is None else "application/json",
                timeout=timeout,
            )
        except HttpFailure as exc:
            raise _engine_error(exc, url, path, f"no answer within {timeout}s") from exc
        return response

    async def open(
        self,
        method: str,
        url: str,
        path: str,
        data: bytes | None,
        headers: Mapping[str, str] | None,
        timeout: float,
        retry: RetryPolicy,
    ) -> Response:
        """Send ``data`` (JSON bytes) to ``url + path`` and return the response with its body
        unread (the caller releases or closes it): sent once, resent per ``retry`` only while
        it provably never reached the engine; an error status is raised as
        :class:`EngineRequestError`."""
        last: EngineUnavailable | None = None
        for attempt in range(retry.attempts):
            if attempt:
                await asyncio.sleep(retry.delay(attempt - 1))
            try:
                response = await self._send(method, url, path, data, headers, timeout)
            except EngineUnavailable as exc:
                if self._closed or not retryable(exc, idempotent=False):
                    raise
                last = exc
                continue
            if response.status >= 400:
                raise await self._error_of(url, path, response)
            return response
        assert last is not None
        raise last

    async def _once(
        self,
        method: str,
        url: str,
        path: str,
        data: bytes | None,
        headers: Mapping[str, str] | None,
        timeout: float,
    ) -> Any:
        response = await self._send(method, url, path, data, headers, timeout)
        if response.status >= 400:
            raise await self._error_of(url, path, response)
        try:
            body = await response.read()
        except HttpFailure as exc:
            raise _engine_error(exc, url, path, f"body not read within {timeout}s") from exc
        finally:
            response.release()  # pooled when the body was read whole, else closed
        return decode_body(body)

    async def _error_of(self, url: str, path: str, response: Response) -> EngineRequestError:
        """The :class:`EngineRequestError` of an error answer (its body read, bounded, by the
        blocking clients' :class:`BoundedBody`); the response is released: after a 5xx, or with
        its body not read to the end, its connection is closed, not pooled."""
        body = BoundedBody()
        try:
            try:
                while chunk := await response.chunk():
                    if body.add(chunk):
                        break
            except HttpFailure as exc:
                body.unreadable(exc)
            return EngineRequestError(url, path, response.status, body.message(response.reason))
        finally:
            response.release()


class EventStream:
    """The JSON events of one streamed answer (``async with`` it, then ``async for``), read
    by the blocking clients' :class:`SSEEventReader` (same framing, limits, ``[DONE]`` and
    ``{"error": ...}`` rules), fed every body byte received at once. On the way out the
    connection is closed (the engine aborts the request), unless the stream ended at
    ``[DONE]`` or :attr:`complete` was set (the finished event was read): then the rest is
    read, bounded (:data:`DRAIN_S`, :data:`DRAIN_BYTES`), and the connection pooled."""

    def __init__(
        self,
        http: AsyncHttp,
        url: str,
        path: str,
        data: bytes,
        headers: Mapping[str, str] | None,
        timeout: float,
        retry: RetryPolicy,
        decode: Callable[[str], dict[str, Any]] | None = None,
    ) -> None:
        self._http = http
        self.url, self.path = url, path
        self._data, self._headers = data, headers
        self._timeout, self._retry = timeout, retry
        self._reader = SSEEventReader(url, path, decode)
        self._response: Response | None = None
        self._pending: Iterator[dict[str, Any]] | None = None
        self._ended = False
        #: the consumer has the finished event: what follows is only the end of the stream
        self.complete = False

    async def __aenter__(self) -> EventStream:
        self._response = await self._http.open(
            "POST", self.url, self.path, self._data, self._headers, self._timeout, self._retry
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        response, self._response = self._response, None
        if response is None:
            return
        clean = exc_type is None and self._reader.done
        if clean or (exc_type is GeneratorExit and self.complete):
            await self._drain(response)
        else:
            response.close()  # the connection goes: the engine sees the disconnect

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        response = self._response
        if response is None:
            raise StopAsyncIteration
        while True:
            if self._pending is not None:
                event = next(self._pending, None)  # raises on an error event, after the others
                if event is not None:
                    return event
                self._pending = None
            if self._reader.done or self._ended:
                raise StopAsyncIteration
            try:
                chunk = await response.chunk()
            except HttpFailure as exc:
                raise _engine_error(
                    exc, self.url, self.path, f"no event within {self._timeout}s", "stream broke: "
                ) from exc
            if chunk:
                self._pending = self._reader.feed(chunk)
            else:
                self._ended = True
                self._pending = self._reader.end()  # EngineUnavailable unless [DONE] came

    async def batch(self) -> list[dict[str, Any]]:
        """The next event and every other one already read with it (no wait for more); empty
        at the end. An error event is raised on the call after the events before it."""
        try:
            out = [await self.__anext__()]
        except StopAsyncIteration:
            return []
        pending = self._pending
        while pending is not None:
            try:
                event = next(pending, None)
            except Exception as exc:  # an error event: after the events before it
                self._pending = _raising(exc)
                break
            if event is None:
                self._pending = None
                break
            out.append(event)
        return out

    async def _drain(self, response: Response) -> None:
        """Read what is left after the finished event ([DONE], the end of the body), bounded,
        so the connection can be pooled; close it otherwise."""
        reader = self._reader
        if reader.done and response.at_eof:  # all here already (the usual end): no wait
            response.release()
            return
        watchdog = asyncio.get_running_loop().call_later(DRAIN_S, response.close)
        size = 0
        try:
            while not (reader.done and response.at_eof) and size <= DRAIN_BYTES:
                chunk = await response.chunk(DRAIN_S)
                if not chunk:
                    break
                size += len(chunk)
                if not reader.done:
                    for _ in reader.feed(chunk):
                        pass  # events after the finished one (vLLM's usage) are not wanted
        except Exception:
            response.close()
            return
        except BaseException:
            response.close()
            raise
        finally:
            watchdog.cancel()
        if reader.done and response.at_eof:
            response.release()
        else:
            response.close()


def _raising(exc: Exception) -> Iterator[dict[str, Any]]:
    raise exc
    yield  # a generator: raises on its first next()


def _read(
    batch: list[dict[str, Any]],
    read: Callable[[dict[str, Any]], StreamDelta],
    into_finished: bool = True,
) -> tuple[list[StreamDelta], Exception | None]:
    """The deltas of a batch of events read together, merged (:func:`coalesce_deltas`), and
    the error of an event the reader refused (to raise after the deltas before it)."""
    deltas: list[StreamDelta] = []
    error: Exception | None = None
    try:
        for event in batch:
            deltas.append(read(event))
    except Exception as exc:
        error = exc
    if len(deltas) > 1:
        deltas = coalesce_deltas(deltas, into_finished=into_finished)
    return deltas, error


@runtime_checkable
class AsyncEngine(Protocol):
    """An engine as the asyncio data plane calls it."""

    @property
    def url(self) -> str: ...

    async def generate(
        self,
        input_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> GenerateResult:
        """One generation, its result whole."""
        ...

    def generate_stream(
        self,
        input_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """One generation as it is produced (new tokens per delta); ``timeout`` bounds each
        wait for an event."""
        ...


class _HttpEngine:
    """What both dialects' async engines share: the blocking client's transport settings and
    its dialect, asked once."""

    def __init__(self, client: HttpEngineClient, http: AsyncHttp) -> None:
        self._client = client
        self._http = http
        transport = client.http
        self._url = transport.url
        self._retry = transport.retry
        self._auth = transport.headers
        self._dialect_lock = asyncio.Lock()

    @property
    def url(self) -> str:
        return self._url

    @property
    def http(self) -> AsyncHttp:
        """The pooled HTTP client of this engine's event loop."""
        return self._http

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._url!r})"

    def _timeout(self, timeout: float | None) -> float:
        return self._client.http.timeout if timeout is None else timeout

    def _ready(self, path: str) -> None:
        """A closed blocking client closes its companion too."""
        if self._client.http.closed:
            raise EngineUnavailable(self._url, path, "client is closed", request_sent=False)

    async def health(self, timeout: float | None = None) -> None:
        """``GET /health`` once, never sent again (the blocking client's ``health(retry=False)``:
        a health manager's failure threshold is its retry); raises unless it answers 2xx."""
        self._ready("/health")
        limit = self._client.health_timeout if timeout is None else timeout
        await self._http.request("GET", self._url, "/health", headers=self._auth, timeout=limit)

    async def _dialect(self, known: Callable[[], _D | None], ask: Callable[[], _D]) -> _D:
        """The server's dialect, not known yet: the blocking client's ``server_dialect()`` in a
        thread, one caller at a time (the others find it known)."""
        async with self._dialect_lock:
            dialect = known()
            if dialect is None:
                dialect = await asyncio.to_thread(ask)
        return dialect

    async def _post(self, path: str, body: Mapping[str, Any], timeout: float | None) -> Any:
        return await self._http.request(
            "POST",
            self._url,
            path,
            json_body=body,
            headers=self._auth,
            timeout=self._timeout(timeout),
            retry=self._retry,
        )

    def _events(
        self,
        path: str,
        body: Mapping[str, Any],
        timeout: float | None,
        decode: Callable[[str], dict[str, Any]] | None = None,
    ) -> EventStream:
        return self._http.events(
            self._url,
            path,
            body,
            headers=self._auth,
            timeout=self._timeout(timeout),
            retry=self._retry,
            decode=decode,
        )


class AsyncSGLangEngine(_HttpEngine):
    """The asyncio companion of an :class:`SGLangClient` (``POST /generate``)."""

    def __init__(self, client: SGLangClient, http: AsyncHttp) -> None:
        super().__init__(client, http)
        self._sglang = client

    @property
    def client(self) -> SGLangClient:
        """The blocking client whose dialect and settings this engine shares."""
        return self._sglang

    async def _body(
        self,
        input_ids: Sequence[int] | None,
        text: str | None,
        sampling_params: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        body = generate_body(input_ids, text, sampling_params)
        self._ready(GENERATE_PATH)
        dialect = self._sglang.known_dialect
        if dialect is None:
            known = lambda: self._sglang.known_dialect  # noqa: E731
            dialect = await self._dialect(known, self._sglang.server_dialect)
        refuse_unknown_sampling(self._url, dialect, body)
        return body

    async def generate(
        self,
        input_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> GenerateResult:
        """``POST /generate`` once (resent only while it never reached the engine), as
        :meth:`SGLangClient.generate`."""
        body = await self._body(input_ids, text, sampling_params)
        return generate_result(self._url, await self._post(GENERATE_PATH, body, timeout))

    async def generate_stream(
        self,
        input_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """``POST /generate`` with ``stream: true``, as :meth:`SGLangClient.generate_stream`."""
        body = await self._body(input_ids, text, sampling_params)
        body["stream"] = True
        reader = SGLangDeltas(self._url, GENERATE_PATH)
        async with self._events(GENERATE_PATH, body, timeout, reader.decode) as events:
            while batch := await events.batch():
                deltas, error = _read(batch, reader)
                for delta in deltas:
                    events.complete = events.complete or delta.finished
                    yield delta
                if error is not None:
                    raise error


class AsyncVLLMEngine(_HttpEngine):
    """The asyncio companion of a :class:`VLLMClient` (``POST /v1/completions``): on 0.32 the
    version is an awaited ``GET /weight_info`` sent beside the request (not before it: one
    round trip less) and checked against the client's pause ledger
    (:mod:`~rollsafe.adapters.engines.vllm_dialect`), on 0.26 the client's label."""

    def __init__(self, client: VLLMClient, http: AsyncHttp) -> None:
        super().__init__(client, http)
        self._vllm = client

    @property
    def client(self) -> VLLMClient:
        """The blocking client whose dialect, pause ledger and settings this engine shares."""
        return self._vllm

    async def _server_dialect(self) -> VLLMDialect:
        self._ready(COMPLETIONS_PATH)
        dialect = self._vllm.known_dialect
        if dialect is None:
            known = lambda: self._vllm.known_dialect  # noqa: E731
            dialect = await self._dialect(known, self._vllm.server_dialect)
        return dialect

    async def _read_version(self, dialect: VLLMDialect) -> str | None:
        if not dialect.weight_version_routes:
            return self._vllm.weight_version()  # 0.26: the label this client keeps, no I/O
        path = self._vllm.version_route
        answer = await self._http.request(
            "GET",
            self._url,
            path,
            headers=self._auth,
            timeout=self._timeout(None),
            idempotent=True,
            retry=self._retry,
        )
        return parse_weight_version(self._url, path, answer)

    async def _run(self, steps: VersionSteps[_T], dialect: VLLMDialect) -> _T:
        """Run the client's version steps, each read awaited."""
        try:
            next(steps)
            while True:
                steps.send(await self._read_version(dialect))
        except StopIteration as stop:
            result: _T = stop.value
            return result

    async def generate(
        self,
        input_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> GenerateResult:
        """``POST /v1/completions`` once, as :meth:`VLLMClient.generate` (versions, refusal
        while this client has a 0.32 server paused)."""
        path = COMPLETIONS_PATH
        client = self._vllm
        dialect = await self._server_dialect()
        body = client.completion_body(input_ids, text, sampling_params, dialect)
        if dialect.completion_weight_versions:
            return completion_result(self._url, await self._post(path, body, timeout))
        start = client.mark_beside(path, dialect)
        before = start.mark
        if start.known:  # remembered for the ledger's steady stretch: no read
            answer = await self._post(path, body, timeout)
            read, holds = start.version, True
        else:
            beside = asyncio.ensure_future(self._read_beside(dialect, start))
            try:
                answer = await self._post(path, body, timeout)
            except BaseException:
                await _dropped(beside)
                raise
            read, holds = await beside
        result = completion_result(self._url, answer)
        if "weight_versions" in result.meta_info:
            return result
        if not holds:  # the ledger moved while the version was read: no version to trust
            return with_read_version(result, None, False, dialect)
        steps = client.version_after(before, read, result.finish_reason)
        version, exact = await self._run(steps, dialect)
        return with_read_version(result, version, exact, dialect)

    async def generate_stream(
        self,
        input_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """``POST /v1/completions`` with ``stream: true``, as :meth:`VLLMClient.generate_stream`
        (on 0.32 the version read beside the stream's request, awaited before its first
        delta is labelled)."""
        path = COMPLETIONS_PATH
        client = self._vllm
        dialect = await self._server_dialect()
        body = client.completion_body(input_ids, text, sampling_params, dialect)
        body["stream"] = True
        before: Mark | None = None
        beside: asyncio.Future[tuple[str | None, bool]] | None = None
        read: str | None = None
        holds = True
        if not dialect.completion_weight_versions:
            start = client.mark_beside(path, dialect)
            before = start.mark
            if start.known:  # remembered for the ledger's steady stretch: no read
                read = start.version
            else:
                beside = asyncio.ensure_future(self._read_beside(dialect, start))
        reader = VLLMDeltas(self._url, path)
        produced = 0
        try:
            async with self._events(path, body, timeout) as events:
                while batch := await events.batch():
                    if beside is not None:  # the read, sent with the request, is in first
                        read, holds = await beside
                        beside = None
                    # 0.32: the last delta's version is read after it, for its tokens alone
                    deltas, error = _read(batch, reader, into_finished=before is None)
                    for delta in deltas:
                        produced += len(delta.token_ids)
                        if before is not None and not holds:  # the read met a ledger move
                            delta = _untrusted(delta, produced, dialect)
                        elif before is not None and delta.finished and delta.weight_version is None:
                            steps = client.version_after(before, read, delta.finish_reason)
                            version, exact = await self._run(steps, dialect)
                            delta = with_read_version_delta(
                                delta, produced, version, exact, dialect
                            )
                        elif before is not None:
                            delta = client.read_delta(delta, before, read)
                        events.complete = events.complete or delta.finished
                        yield delta
                    if error is not None:
                        raise error
        finally:
            if beside is not None:
                await _dropped(beside)

    async def _read_beside(self, dialect: VLLMDialect, start: Start) -> tuple[str | None, bool]:
        """The version, read beside a request that started at ``start``, and whether it
        stands for the one before it (:meth:`VLLMClient.read_beside_holds`)."""
        version = await self._read_version(dialect)
        return version, self._vllm.read_beside_holds(start, version)


def _untrusted(delta: StreamDelta, produced: int, dialect: VLLMDialect) -> StreamDelta:
    """A delta whose weights cannot be told (the version read beside its request overlapped
    a pause, resume or weight change of this client): no version, ``weight_version_exact:
    False`` (the fleet's continuation keeps none of its tokens)."""
    if delta.finished:
        return with_read_version_delta(delta, produced, None, False, dialect)
    if not delta.token_ids:
        return delta
    return replace(delta, weight_version=None, meta={**delta.meta, "weight_version_exact": False})


async def _dropped(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` (a read beside a request that failed or was left) and wait for it, its
    outcome dropped: the request's own error or exit is what the caller sees."""
    task.cancel()
    await asyncio.wait((task,))  # raises only if the caller itself is cancelled meanwhile
    if not task.cancelled():
        task.exception()  # retrieved: a read that failed as it was dropped is not logged


class ThreadedEngine:
    """Any other client (a fake with a blocking ``generate`` and, to stream,
    ``generate_stream``) as an :class:`AsyncEngine`: each call runs in a thread
    (``asyncio.to_thread``), a stream pulls each item in one. A stream stopped early closes
    the client's iterator (in a thread, once the pull in flight is done)."""

    def __init__(self, client: Any) -> None:
        if not callable(getattr(client, "generate", None)):
            raise InvalidArgumentType(
                "client", f"an engine client needs a generate method, got {type(client).__name__}"
            )
        self._client = client

    @property
    def client(self) -> Any:
        return self._client

    @property
    def url(self) -> str:
        return str(getattr(self._client, "url", ""))

    def __repr__(self) -> str:
        return f"ThreadedEngine({self._client!r})"

    async def generate(
        self,
        input_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> GenerateResult:
        result: GenerateResult = await asyncio.to_thread(
            self._client.generate,
            input_ids,
            text=text,
            sampling_params=sampling_params,
            timeout=timeout,
        )
        return result

    async def generate_stream(
        self,
        input_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[StreamDelta]:
        start = getattr(self._client, "generate_stream", None)
        if not callable(start):
            raise InvalidArgumentType(
                "client", f"{type(self._client).__name__} has no generate_stream to stream with"
            )
        items: Iterator[StreamDelta] = iter(
            await asyncio.to_thread(
                start, input_ids, text=text, sampling_params=sampling_params, timeout=timeout
            )
        )
        lock = threading.Lock()  # one pull or the close at a time (a generator runs once)
        end = object()

        def pull() -> Any:
            with lock:
                return next(items, end)

        def close() -> None:
            with lock, contextlib.suppress(Exception):
                closer = getattr(items, "close", None)
                if callable(closer):
                    closer()

        finished = False
        try:
            while True:
                item = await asyncio.to_thread(pull)
                if item is end:
                    finished = True
                    return
                yield item
        finally:
            if not finished:  # stopped early: close it once the pull in flight is done
                with contextlib.suppress(RuntimeError):  # no loop left to run it on
                    asyncio.get_running_loop().run_in_executor(None, close)


def async_engine(client: Any, http: AsyncHttp) -> AsyncEngine:
    """The asyncio companion of a blocking engine client on ``http``'s loop: an
    :class:`AsyncSGLangEngine` / :class:`AsyncVLLMEngine` sharing an :class:`SGLangClient` /
    :class:`VLLMClient`'s dialect and state, else a :class:`ThreadedEngine`."""
    if not isinstance(http, AsyncHttp):
        raise InvalidArgumentType("http", f"http must be an AsyncHttp, got {type(http).__name__}")
    if isinstance(client, VLLMClient):
        return AsyncVLLMEngine(client, http)
    if isinstance(client, SGLangClient):
        return AsyncSGLangEngine(client, http)
    return ThreadedEngine(client)
