"""The gateway's routes over the fleet's data plane: what each request becomes, and its answer.

Owns :class:`Gateway`: the HTTP server (:mod:`rollsafe.gateway.http`) on the data plane's event
loop, authentication, the routes, sessions (:mod:`rollsafe.gateway.sessions`) and the gateway's
counters. The protocol layer (:mod:`rollsafe.gateway.openai_api`,
:mod:`rollsafe.gateway.sglang_api`) turns a body into token-id requests and token chunks into
answers; the data plane (:class:`~rollsafe.fleet.dataplane.DataPlane`) routes them to ``active``
groups only and continues a stream cut by a crash or a sync on another group.

=========================  ======================================================================
``GET /health``            200 while some group is routable, else 503 (never needs the key)
``GET /metrics``           Prometheus text: the fleet's metrics and the gateway's
``GET /v1/models``         the served model
``POST /v1/completions``   OpenAI completions (text or token-id prompts, ``stream``, ``n``...)
``POST /v1/chat/completions``  OpenAI chat (the model's chat template; sessions reuse tokens)
``POST /generate``         SGLang-native, as slime and AReaL post it
=========================  ======================================================================

Every answer that generated carries ``x-rollsafe-group`` (the group that served its first
token). A request no group can take within ``wait_for_routable_s`` is a 503 with
``Retry-After``; a stream that fails past every try ends with an error event. A failure here is
this request's, never the fleet's.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rollsafe import json_codec
from rollsafe.adapters.engines.errors import EngineRequestError
from rollsafe.fleet.dataplane import DataPlane
from rollsafe.fleet.provenance import TokenChunk
from rollsafe.fleet.router import NoRoutableGroup, RequestFailed
from rollsafe.gateway import openai_api, sglang_api
from rollsafe.gateway.http import (
    HttpServer,
    LastChunk,
    Request,
    Response,
    ServerLimits,
    StreamResponse,
)
from rollsafe.gateway.output import ChoiceOutput
from rollsafe.gateway.requests import GenRequest, InvalidRequest, ProtocolLimits
from rollsafe.gateway.sessions import SessionStore
from rollsafe.gateway.settings import GatewaySettings
from rollsafe.gateway.tokenizer import GatewayTokenizer
from rollsafe.registry import FleetRegistry
from rollsafe.text import bound_text

if TYPE_CHECKING:
    from rollsafe.observe.metrics import FleetMetrics

__all__ = ["Gateway", "GatewayFleet"]

log = logging.getLogger(__name__)

#: how long a client should wait before retrying a 503 (no routable group, too many requests)
RETRY_AFTER_S = 1
#: chunks of one choice buffered ahead of a slow client (then the engine stream waits)
_STREAM_BUFFER = 64


class GatewayFleet(Protocol):
    """What the gateway needs of a fleet (``RolloutFleet`` has it)."""

    @property
    def data_plane(self) -> DataPlane: ...

    @property
    def registry(self) -> FleetRegistry: ...

    @property
    def metrics(self) -> FleetMetrics | None: ...


@dataclass
class GatewayCounters:
    """What the gateway served (``/metrics``; JSON-friendly with :meth:`as_dict`)."""

    requests: Counter[tuple[str, int]] = field(default_factory=Counter)
    in_flight: int = 0
    streams_continued: int = 0
    tokens_out: int = 0
    session_reused: int = 0
    session_retokenized: int = 0
    seconds_total: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": {f"{route} {status}": n for (route, status), n in self.requests.items()},
            "in_flight": self.in_flight,
            "streams_continued": self.streams_continued,
            "tokens_out": self.tokens_out,
            "session_reused": self.session_reused,
            "session_retokenized": self.session_retokenized,
        }

    def prometheus(self) -> str:
        lines = [
            "# HELP rollsafe_gateway_requests_total Requests the gateway answered.",
            "# TYPE rollsafe_gateway_requests_total counter",
        ]
        for (route, status), n in sorted(self.requests.items()):
            lines.append(
                f'rollsafe_gateway_requests_total{{route="{route}",status="{status}"}} {n}'
            )
        for name, kind, value, text in (
            ("in_flight", "gauge", self.in_flight, "Requests being served now."),
            (
                "streams_continued_total",
                "counter",
                self.streams_continued,
                "Requests continued on another group or try.",
            ),
            ("tokens_out_total", "counter", self.tokens_out, "Tokens sent to clients."),
            (
                "session_reused_total",
                "counter",
                self.session_reused,
                "Session turns whose earlier tokens were reused as served.",
            ),
            (
                "session_retokenized_total",
                "counter",
                self.session_retokenized,
                "Session turns tokenized from scratch (the history differed).",
            ),
        ):
            lines += [
                f"# HELP rollsafe_gateway_{name} {text}",
                f"# TYPE rollsafe_gateway_{name} {kind}",
                f"rollsafe_gateway_{name} {value}",
            ]
        lines.append("# HELP rollsafe_gateway_request_seconds_total Seconds spent per route.")
        lines.append("# TYPE rollsafe_gateway_request_seconds_total counter")
        for route, seconds in sorted(self.seconds_total.items()):
            lines.append(f'rollsafe_gateway_request_seconds_total{{route="{route}"}} {seconds:.6f}')
        return "\n".join(lines) + "\n"


def _error(
    status: int, message: str, *, kind: str, headers: Mapping[str, str] | None = None
) -> Response:
    body = {
        "error": {"message": bound_text(message, 2048), "type": kind, "param": None, "code": status}
    }
    return Response.json(body, status=status, headers=dict(headers or {}))


class Gateway:
    """The rollout gateway of one fleet (see the module); built and started by the fleet."""

    def __init__(
        self, fleet: GatewayFleet, settings: GatewaySettings, *, model_path: str | Path
    ) -> None:
        path = Path(model_path)
        self.fleet = fleet
        self.settings = settings
        self.model_name = settings.model_name or path.name
        self.tokenizer = GatewayTokenizer.from_pretrained(path)
        self.limits = ProtocolLimits.from_model(path, max_n=settings.max_n)
        self.sessions = SessionStore(
            settings.max_sessions, settings.session_ttl_s, self.limits.max_model_len
        )
        self.counters = GatewayCounters()
        self._server: HttpServer | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> str:
        """Listen (on the running loop: the data plane's); return the URL."""
        s = self.settings
        limits = ServerLimits(
            max_body_bytes=s.max_body_bytes,
            idle_body_timeout_s=s.idle_body_timeout_s,
            keepalive_timeout_s=s.keepalive_timeout_s,
            max_in_flight=s.max_in_flight,
        )
        self._server = HttpServer(self.handle, host=s.host, port=s.port, limits=limits)
        await self._server.start()
        if s.gc_freeze:
            gc.freeze()  # GatewaySettings.gc_freeze
        return self.url

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the gateway is not started")
        return str(self._server.url)

    async def close(self, grace_s: float = 5.0) -> None:
        """Stop accepting, let requests in flight end (at most ``grace_s``), then cut them."""
        if self._server is not None:
            await self._server.close(grace_s)

    # ------------------------------------------------------------------ routing
    async def handle(self, request: Request) -> Response | StreamResponse:
        """One HTTP request (the server's handler)."""
        route = request.path
        started = time.perf_counter()
        self.counters.in_flight += 1
        try:
            answer = await self._dispatch(request)
        except InvalidRequest as exc:
            answer = Response.json(
                exc.as_sglang() if route == "/generate" else exc.as_openai(), status=exc.status
            )
        except NoRoutableGroup as exc:
            answer = _error(
                503,
                str(exc),
                kind="no_routable_group",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        except RequestFailed as exc:
            answer = self._failed(exc)
        finally:
            self.counters.in_flight -= 1
        self.counters.requests[(route if route in _ROUTES else "other", answer.status)] += 1
        key = route if route in _ROUTES else "other"
        self.counters.seconds_total[key] = self.counters.seconds_total.get(key, 0.0) + (
            time.perf_counter() - started
        )
        return answer

    def _failed(self, exc: RequestFailed) -> Response:
        cause = exc.__cause__
        if not exc.retryable and isinstance(cause, EngineRequestError) and cause.status_code < 500:
            return _error(cause.status_code, str(exc), kind="engine_refused")
        return _error(
            503, str(exc), kind="request_failed", headers={"Retry-After": str(RETRY_AFTER_S)}
        )

    async def _dispatch(self, request: Request) -> Response | StreamResponse:
        method, path = request.method, request.path
        if path not in _ROUTES:
            return _error(404, f"no route {path!r}", kind="not_found")
        allowed = _ROUTES[path]
        if method not in allowed and not (method == "HEAD" and "GET" in allowed):
            return _error(
                405,
                f"{path} takes {'/'.join(allowed)}, not {method}",
                kind="method_not_allowed",
                headers={"Allow": ", ".join(allowed)},
            )
        if path == "/health":
            return self._health()
        if not self._authorized(request):
            return _error(
                401,
                "missing or wrong bearer token (Authorization: Bearer <api_key>)",
                kind="unauthorized",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if path == "/metrics":
            return Response(
                200, self._metrics_text().encode(), content_type="text/plain; version=0.0.4"
            )
        if path == "/v1/models":
            return Response.json(openai_api.models_list(self.model_name, self.limits.max_model_len))
        body = _json_body(request, path)
        headers, tokenizer, limits = request.headers, self.tokenizer, self.limits
        if path == "/generate":
            call: Any = sglang_api.parse_generate(body, headers, tokenizer, limits)
        elif path == "/v1/completions":
            call = openai_api.parse_completion(
                body, headers, tokenizer, limits, model_name=self.model_name
            )
        else:
            call = openai_api.parse_chat(
                body, headers, tokenizer, limits, model_name=self.model_name
            )
            call = self._with_session(call)
        requests: Sequence[GenRequest] = call.requests
        if requests and requests[0].stream:
            return await self._stream(call, requests)
        return await self._whole(call, requests)

    def _authorized(self, request: Request) -> bool:
        key = self.settings.api_key
        if key is None:
            return True
        given = str(request.headers.get("authorization", ""))
        scheme, _, token = given.partition(" ")
        return scheme.lower() == "bearer" and token.strip() == key

    def _health(self) -> Response:
        routable = [g.group_id for g in self.fleet.registry.routable()]
        status = 200 if routable else 503
        return Response.json(
            {"status": "ok" if routable else "no routable group", "routable": routable},
            status=status,
        )

    def _metrics_text(self) -> str:
        """The fleet's Prometheus metrics (the fleet makes them when it starts a gateway) and
        the gateway's own counters."""
        text = ""
        metrics = self.fleet.metrics
        if metrics is not None:
            from prometheus_client import generate_latest

            text = generate_latest(metrics.registry).decode()
        return text + self.counters.prometheus()

    # ------------------------------------------------------------------ generation
    def _stream_of(self, req: GenRequest, *, collected: bool = False) -> AsyncIterator[TokenChunk]:
        s = self.settings
        return self.fleet.data_plane.astream(
            req.input_ids,
            sampling_params=req.sampling_params,
            session_id=req.session_id,
            timeout=s.request_timeout_s,
            wait_for_routable_s=s.wait_for_routable_s,
            collected=collected,
        )

    async def _collect(self, req: GenRequest) -> list[TokenChunk]:
        """One choice's chunks, whole. A choice the gateway ends on a stop string before its
        engine does has its engine request closed; a request restarted from scratch
        (``Router.keep_tokens`` off) drops the chunks it replaces."""
        chunks: list[TokenChunk] = []
        count = 0  # tokens in ``chunks``
        # only a stop string ends a choice before its engine does: without one, the text is
        # decoded once, when the answer is rendered
        out = ChoiceOutput(self.tokenizer, req) if req.output.stop else None
        stream = self._stream_of(req, collected=True)
        try:
            async for chunk in stream:
                if chunk.token_ids and chunk.start < count:
                    while chunks and chunks[-1].start >= chunk.start:
                        count -= len(chunks.pop().token_ids)
                    if out is not None:
                        out = ChoiceOutput(self.tokenizer, req)
                        for kept in chunks:
                            out.add(kept)
                chunks.append(chunk)
                count += len(chunk.token_ids)
                if out is not None:
                    out.add(chunk)
                    if out.stopped_early:
                        break  # ends the engine request (the stream is closed below)
        finally:
            await _aclose(stream)
        return chunks

    async def _whole(self, call: Any, requests: Sequence[GenRequest]) -> Response:
        if len(requests) == 1:  # most requests: no task of its own, as gather would make
            results = [await self._collect(requests[0])]
        else:
            results = list(await asyncio.gather(*(self._collect(r) for r in requests)))
        first = (
            next((c.group_id for c in results[0] if c.token_ids or c.finished), "")
            if results
            else ""
        )
        for chunks in results:
            self._count(chunks)
        answer = call.render(list(results))
        self._remember(call, results)
        return Response.json(answer, headers={"x-rollsafe-group": first})

    def _count(self, chunks: Sequence[TokenChunk]) -> None:
        self.counters.tokens_out += sum(len(c.token_ids) for c in chunks)
        last = chunks[-1] if chunks else None
        if last is not None and len({(s.group_id, s.attempt) for s in last.segments}) > 1:
            self.counters.streams_continued += 1

    async def _stream(self, call: Any, requests: Sequence[GenRequest]) -> StreamResponse:
        """Stream every choice's events as its tokens come. The answer's headers wait for the
        first chunk (its group names ``x-rollsafe-group``; a request no group could take is
        still a 503, not a stream). A choice the gateway ends on a stop string before its
        engine does has its engine request closed."""
        streamer = call.streamer()
        sglang = isinstance(call, sglang_api.GenerateCall)
        choices = _Choices([self._stream_of(r) for r in requests])
        try:
            first = await choices.next()
        except BaseException:
            await choices.aclose()
            raise
        if first is not None and isinstance(first[1], (NoRoutableGroup, RequestFailed)):
            await choices.aclose()
            raise first[1]
        group = first[1].group_id if first is not None and isinstance(first[1], TokenChunk) else ""

        async def body() -> AsyncIterator[bytes]:
            self.counters.in_flight += 1  # a stream is in flight until its last event
            sent: dict[int, list[TokenChunk]] = {}
            ends: dict[int, int] = {}  # tokens sent per choice
            item = first
            try:
                while item is not None:
                    index, chunk = item
                    if isinstance(chunk, TokenChunk):
                        kept = sent.setdefault(index, [])
                        if chunk.token_ids and chunk.start < ends.get(index, 0):
                            chunk = RequestFailed(
                                "the request restarted from scratch (Router.keep_tokens off):"
                                " a stream cannot take its tokens back",
                                (),
                                retryable=True,
                            )
                    if isinstance(chunk, BaseException):
                        yield _error_event(chunk, sglang=sglang)
                        await choices.close(index)
                    else:
                        kept.append(chunk)
                        ends[index] = ends.get(index, 0) + len(chunk.token_ids)
                        data = streamer.chunk(index, chunk)
                        if streamer.stopped_early(index):
                            await choices.close(index)  # ends its engine request
                        if streamer.all_finished:  # the end goes with the last event
                            yield LastChunk(data + streamer.end())
                            return
                        if data:
                            yield data
                    item = await choices.next()
                yield LastChunk(streamer.end())
            finally:
                self.counters.in_flight -= 1
                await choices.aclose()
                for chunks in sent.values():
                    self._count(chunks)
                self._remember(call, [sent.get(i, []) for i in range(len(requests))])

        return StreamResponse(body(), headers={"x-rollsafe-group": group})

    # ------------------------------------------------------------------ sessions
    def _with_session(self, call: Any) -> Any:
        return self.sessions.reuse(call, self.tokenizer, self.counters)

    def _remember(self, call: Any, results: Sequence[Sequence[TokenChunk]]) -> None:
        self.sessions.remember(call, results, self.tokenizer)


_ROUTES: dict[str, tuple[str, ...]] = {
    "/health": ("GET",),
    "/metrics": ("GET",),
    "/v1/models": ("GET",),
    "/v1/completions": ("POST",),
    "/v1/chat/completions": ("POST",),
    "/generate": ("POST",),
}


def _json_body(request: Request, path: str) -> Any:
    content_type = request.headers.get("content-type", "application/json")
    if "json" not in content_type:
        raise InvalidRequest(
            "body",
            f"{path} takes a JSON body (Content-Type: application/json), got {content_type!r}",
        )
    try:
        return json_codec.loads(request.body or b"null")
    except ValueError as exc:
        raise InvalidRequest("body", f"the body is not JSON: {exc}") from None


def _error_event(exc: BaseException, *, sglang: bool) -> bytes:
    message = bound_text(f"{type(exc).__name__}: {exc}", 2048)
    if sglang:
        return sglang_api.stream_error(message, 503)
    payload = {"error": {"message": message, "type": "request_failed", "param": None, "code": 503}}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


Item = tuple[int, TokenChunk | BaseException]


class _Choices:
    """The chunks of a call's choices as they come, each tagged with its index; a choice's
    error comes as its item (the others go on), and a choice can be closed alone (its engine
    request ends). One choice: no task, no queue."""

    def __init__(self, streams: Sequence[AsyncIterator[TokenChunk]]) -> None:
        self.streams = list(streams)
        self.single = len(self.streams) == 1
        self.closed: set[int] = set()
        self.queue: asyncio.Queue[Item | None] = asyncio.Queue(_STREAM_BUFFER)
        self.tasks: list[asyncio.Task[None]] = []
        self.running = 0
        if not self.single:
            self.tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(self.streams)]
            self.running = len(self.tasks)

    async def _pump(self, index: int, stream: AsyncIterator[TokenChunk]) -> None:
        try:
            async for chunk in stream:
                await self.queue.put((index, chunk))
        except (RequestFailed, NoRoutableGroup) as exc:
            await self.queue.put((index, exc))
        finally:
            await self.queue.put(None)

    async def next(self) -> Item | None:
        """The next item of any open choice; None once every choice ended."""
        if self.single:
            if 0 in self.closed:
                return None
            try:
                return 0, await self.streams[0].__anext__()
            except StopAsyncIteration:
                self.closed.add(0)
                return None
            except (RequestFailed, NoRoutableGroup) as exc:
                self.closed.add(0)
                return 0, exc
        while self.running:
            item = await self.queue.get()
            if item is None:
                self.running -= 1
                continue
            if item[0] not in self.closed:
                return item
        return None

    async def close(self, index: int) -> None:
        """End choice ``index`` (its engine request too)."""
        if index in self.closed:
            return
        self.closed.add(index)
        if self.single:
            await _aclose(self.streams[0])
        else:
            self.tasks[index].cancel()

    async def aclose(self) -> None:
        for task in self.tasks:
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        for stream in self.streams:
            await _aclose(stream)


async def _aclose(stream: AsyncIterator[TokenChunk]) -> None:
    if isinstance(stream, AsyncGenerator):
        await stream.aclose()
