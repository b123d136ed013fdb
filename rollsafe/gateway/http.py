"""The gateway's HTTP/1.1 server: httptools' parser in a bare asyncio protocol, on the loop the
caller runs (uvloop's or plain asyncio's; nothing here changes the global loop policy).

Owns :class:`HttpServer` (listen, answer, close with a grace), what a handler receives and
returns (:class:`Request`, :class:`Response`, :class:`StreamResponse`), the limits that keep a
hostile or broken client from hurting the process (:class:`ServerLimits`) and the counters
behind ``/metrics`` (:class:`ServerStats`). The routes are the handler's: one
``async (Request) -> Response | StreamResponse`` callable. Chosen by
``benchmarks/bench_gateway.py`` (benchmarks/README.md, "Gateway"): the least CPU per request
and memory per open stream of the Python stacks measured. Imports nothing from rollsafe but
``rollsafe.errors`` and ``rollsafe.text``.

Protocol
--------
* HTTP/1.1 keep-alive; HTTP/1.0 with ``Connection: keep-alive`` (answered with the same
  header) and without (closed after the answer); a request with ``Connection: close`` is
  answered with it and the connection closed.
* Pipelined requests are answered in order, one at a time per connection; past
  ``max_pipelined`` waiting, the connection stops being read until half have been answered
  (the rest of the read that passed it, at most 256 KiB, is still parsed and queued).
* Request bodies by ``Content-Length`` or chunked; ``Expect: 100-continue`` (HTTP/1.1) gets
  ``100 Continue`` when the request is next to be answered, never when its size is refused.
* ``HEAD``: the handler sees ``HEAD``; the server sends the head (with the ``content-length``
  the body would have) and no body; a stream's iterator is closed unread.
* :class:`Request`: headers are decoded to ``str`` when first read (most routes read few); one
  built by hand (``Request("POST", "/generate", {...}, body)``) tests a route without a server.
* :class:`Response`: ``content-length``; 204 and 304 carry no body. :class:`StreamResponse`:
  chunked transfer encoding (to an HTTP/1.0 client: the raw bytes, then the connection is
  closed); ``text/event-stream`` adds ``cache-control: no-cache`` and ``x-accel-buffering: no``.
  Empty chunks are skipped (an empty chunk would end the body). The head goes out with the
  first chunk, and a :class:`LastChunk` with the body's end, in one write each: a short stream
  is one or two writes to the socket, not one per piece (head, events, ``[DONE]``, end).
* Every answer has a ``date`` header; error bodies are OpenAI-shaped JSON:
  ``{"error": {"message", "type", "param", "code"}}``, ``param`` naming the limit.
* An upgrade request (``Upgrade: h2c``, ``websocket``) is answered as plain HTTP/1.1 and the
  connection closed after it; no protocol switch is supported.

Limits (:class:`ServerLimits`, defaults)
----------------------------------------
======================  ===========  ========================================================
field                   default      past it
======================  ===========  ========================================================
max_body_bytes          64 MiB       413, before reading past it (a ``Content-Length`` over
                                     it: at once, no ``100 Continue``; chunked: when the sum
                                     passes it), then close
max_header_bytes        64 KiB       431, then close (the request line and headers as read;
                                     a head in the same read as the body before it may pass
                                     it by up to that read, at most 256 KiB)
max_headers             100          431, then close
max_url_bytes           16 KiB       414, then close
header_timeout_s        30 s         408, then close (a head begun and not ended in time)
idle_body_timeout_s     30 s         408, then close (no byte of a begun body for this long)
keepalive_timeout_s     75 s         closed quietly (no byte of a next request for this long;
                                     above the clients' pool expiry: httpx 5 s, aiohttp 15 s)
max_in_flight           10,000       503 with ``retry-after`` and a JSON body (requests being
                                     answered, all connections together; the connection stays)
retry_after_s           1            the ``retry-after`` value of every 503
max_connections         12,000       503 with ``retry-after`` on the new connection, then close
max_pipelined           64           the connection is not read until the queue halves
write_buffer_bytes      64 KiB       a stream's producer is not read (backpressure: the
                                     transport's ``pause_writing``) until it drains to 1/4
write_stall_timeout_s   300 s        a reader that takes nothing for this long is cut (its
                                     request cancelled, like a disconnect)
======================  ===========  ========================================================

Each in-flight request may also hold an engine connection, and a process may open 20,000
files on this machine: raise ``max_connections`` / ``max_in_flight`` with that in mind.

Bad input and failures
----------------------
=====================================  ====================================================
what                                   what happens
=====================================  ====================================================
malformed request (method, URL,        400 ``malformed HTTP: <parser's reason>``, then close
header syntax, chunk framing, both
``Content-Length`` and chunked)
the handler raises                     500 ``<ExceptionType>: <message>`` (cut to 500
                                       characters), logged with its traceback on
                                       ``rollsafe.gateway.http``; the connection and the
                                       server go on
the handler returns something else,    500, logged the same way
or raises ``CancelledError`` itself
a stream's iterator raises (the head   logged; the connection is closed without the last
is sent before the first chunk is      chunk, so the client sees a cut body, not a whole
asked for: what can fail before the    one; counted in ``handler_errors``
stream starts belongs before the
handler returns)
the client disconnects (or half-       the handler's task is cancelled (it sees
closes) while its request is answered  ``CancelledError``), a stream's iterator is
                                       ``aclose()``-d; counted in ``disconnects``
``close(grace_s)``                     stops accepting, closes idle connections, lets
                                       answers in progress end (each with
                                       ``connection: close``) up to the grace, then cuts the
                                       rest (their handlers cancelled)
=====================================  ====================================================

After an error that closes the connection the server half-closes (its FIN after the answer)
and reads and drops what the client still sends for up to 5 s, so a client that is still
sending its body gets the answer instead of a reset.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from email.utils import formatdate
from http import HTTPStatus
from types import MappingProxyType
from typing import Any
from urllib.parse import parse_qsl, unquote

import httptools

from rollsafe import json_codec
from rollsafe.errors import InvalidArgument
from rollsafe.text import bound_text

__all__ = [
    "Handler",
    "HttpServer",
    "LastChunk",
    "Request",
    "Response",
    "ServerLimits",
    "ServerStats",
    "StreamResponse",
]

log = logging.getLogger(__name__)

#: after an error that closes the connection: how long what the client still sends is dropped
LINGER_S = 5.0
#: characters of a handler's exception kept in its 500 answer
ERROR_MESSAGE_CHARS = 500

_MiB = 1024 * 1024


@dataclass(frozen=True)
class ServerLimits:
    """What one client may cost the server; each field is named in the error it causes (the
    module docstring has the table of defaults and answers)."""

    max_body_bytes: int = 64 * _MiB
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    max_url_bytes: int = 16 * 1024
    header_timeout_s: float = 30.0
    idle_body_timeout_s: float = 30.0
    keepalive_timeout_s: float = 75.0
    max_in_flight: int = 10_000
    retry_after_s: int = 1
    max_connections: int = 12_000
    max_pipelined: int = 64
    write_buffer_bytes: int = 64 * 1024
    write_stall_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int":
                ok = isinstance(value, int) and not isinstance(value, bool)
                low = 0 if f.name in ("max_body_bytes", "retry_after_s") else 1
                if not ok or value < low:
                    raise InvalidArgument(
                        f.name, f"{f.name} must be an int >= {low}, got {value!r}"
                    )
            else:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
                if not ok or not (value > 0 and math.isfinite(value)):
                    raise InvalidArgument(
                        f.name, f"{f.name} must be a finite number of seconds > 0, got {value!r}"
                    )


@dataclass
class ServerStats:
    """The server's counters (read them on the server's loop, or take :meth:`snapshot`)."""

    #: answers sent, by status (handlers' answers and the server's own errors)
    requests: dict[int, int] = field(default_factory=dict)
    #: requests being answered now (handler running or stream being sent)
    in_flight: int = 0
    open_connections: int = 0
    #: connections accepted since start
    connections: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    #: clients gone (closed, reset or half-closed) while their request was being answered
    disconnects: int = 0
    #: handlers that raised or returned no response (each answered 500), and streams that broke
    handler_errors: int = 0
    #: refusals by the limit that caused them (a :class:`ServerLimits` field, or ``malformed``)
    rejected: dict[str, int] = field(default_factory=dict)
    #: answers still in progress when ``close(grace_s)``'s grace ran out
    cut_at_close: int = 0

    def snapshot(self) -> dict[str, Any]:
        """A copy, safe to hand to another thread."""
        return {
            "requests": dict(self.requests),
            "in_flight": self.in_flight,
            "open_connections": self.open_connections,
            "connections": self.connections,
            "bytes_received": self.bytes_received,
            "bytes_sent": self.bytes_sent,
            "disconnects": self.disconnects,
            "handler_errors": self.handler_errors,
            "rejected": dict(self.rejected),
            "cut_at_close": self.cut_at_close,
        }


class Request:
    """One parsed request. ``headers``: lowercase names (repeated ones joined with ``", "``;
    decoded when first read); ``path``: percent-decoded, without the query; ``query``: the
    query string's fields (a repeated name keeps its last value; ``query_string`` has them all);
    ``client``: the peer's ``(host, port)``; ``target``: the request line's target as sent."""

    __slots__ = (
        "_headers",
        "_keep",
        "_query",
        "_raw",
        "body",
        "client",
        "http_version",
        "method",
        "path",
        "query_string",
        "target",
    )

    def __init__(
        self,
        method: str,
        target: str,
        headers: Mapping[str, str] | None = None,
        body: bytes = b"",
        *,
        client: tuple[str, int] | None = None,
        http_version: str = "1.1",
    ) -> None:
        self.method = method
        self.target = target
        self.path, self.query_string = _split_target(target)
        self._headers: Mapping[str, str] | None = {k.lower(): v for k, v in (headers or {}).items()}
        self._raw: list[bytes] | None = None
        self._keep = True
        self.body = body
        self.client = client
        self.http_version = http_version
        self._query: Mapping[str, str] | None = None

    @classmethod
    def _parsed(
        cls,
        method: str,
        target: str,
        raw: list[bytes],
        body: bytes,
        client: tuple[str, int] | None,
        http_version: str,
        keep_alive: bool,
    ) -> Request:
        """From the wire: the headers stay bytes until read (``raw``: name, value, name, ...);
        ``keep_alive``: the client's wish (the server's business)."""
        self = cls.__new__(cls)
        self.method = method
        self.target = target
        self._keep = keep_alive
        self.path, self.query_string = _split_target(target)
        self._headers = None
        self._raw = raw
        self.body = body
        self.client = client
        self.http_version = http_version
        self._query = None
        return self

    @property
    def headers(self) -> Mapping[str, str]:
        headers = self._headers
        if headers is None:
            raw = self._raw or []
            headers = self._headers = _header_dict(zip(raw[0::2], raw[1::2], strict=True))
        return headers

    @property
    def query(self) -> Mapping[str, str]:
        if self._query is None:
            self._query = dict(parse_qsl(self.query_string, keep_blank_values=True))
        return self._query

    def __repr__(self) -> str:
        return f"Request({self.method} {bound_text(self.target, 200)!r}, {len(self.body)} bytes)"


def _split_target(target: str) -> tuple[str, str]:
    """(percent-decoded path, query string) of a request target."""
    path, _, query = target.partition("?")
    if not path.startswith("/") and "://" in path:  # absolute form: keep the path
        path = "/" + path.split("://", 1)[1].partition("/")[2]
    return (unquote(path) if "%" in path else path), query


def _header_dict(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """Lowercase names; a repeated name's values joined with ``", "``, in order."""
    headers: dict[str, str] = {}
    for name, value in raw:
        key, text = name.decode("latin-1").lower(), value.decode("latin-1")
        old = headers.get(key)
        headers[key] = text if old is None else f"{old}, {text}"
    return headers


#: response headers only the server writes
_SERVER_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "content-type"})


def _header_block(headers: Mapping[str, str] | None) -> bytes:
    if not headers:
        return b""
    lines = []
    for name, value in headers.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise InvalidArgument("headers", f"header {name!r}: names and values are str")
        if name.lower() in _SERVER_HEADERS:
            raise InvalidArgument("headers", f"header {name!r} is the server's to write")
        if not name or any(c in name for c in ":\r\n \t") or "\r" in value or "\n" in value:
            raise InvalidArgument("headers", f"header {name!r}: bad name, or CR/LF in the value")
        lines.append(f"{name}: {value}\r\n")
    try:
        return "".join(lines).encode("latin-1")
    except UnicodeEncodeError as exc:
        raise InvalidArgument("headers", f"headers must be latin-1: {exc}") from exc


def _content_type_line(content_type: str) -> bytes:
    if not isinstance(content_type, str) or "\r" in content_type or "\n" in content_type:
        raise InvalidArgument("content_type", f"bad content type {content_type!r}")
    return b"content-type: " + content_type.encode("latin-1") + b"\r\n"


def _check_status(status: int) -> int:
    if not isinstance(status, int) or isinstance(status, bool) or not 200 <= status <= 599:
        raise InvalidArgument("status", f"status must be an int in 200..599, got {status!r}")
    return status


_JSON_LINE = _content_type_line("application/json")
_NO_HEADERS: Mapping[str, str] = MappingProxyType({})


class Response:
    """A whole answer: ``status``, ``body`` (sent with ``content-length``), ``headers`` (not
    ``content-length``, ``transfer-encoding``, ``connection``, ``content-type``: the server
    writes those) and ``content_type``. Checked when built (:class:`InvalidArgument`)."""

    __slots__ = ("_ctype", "_extra", "body", "content_type", "headers", "status")

    def __init__(
        self,
        status: int = 200,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> None:
        self.status = (
            status if status.__class__ is int and 200 <= status <= 599 else _check_status(status)
        )
        if body.__class__ is not bytes:
            if not isinstance(body, (bytes, bytearray, memoryview)):
                raise InvalidArgument("body", f"body must be bytes, got {type(body).__name__}")
            body = bytes(body)
        self.body = body
        self.content_type = content_type
        if headers:
            self.headers: Mapping[str, str] = dict(headers)
            self._extra = _header_block(self.headers)
        else:
            self.headers, self._extra = _NO_HEADERS, b""
        self._ctype = (
            _JSON_LINE if content_type == "application/json" else _content_type_line(content_type)
        )

    @classmethod
    def json(
        cls, value: Any, status: int = 200, headers: Mapping[str, str] | None = None
    ) -> Response:
        """``value`` as compact JSON in UTF-8, as SGLang and vLLM write it
        (:func:`rollsafe.json_codec.dumps`)."""
        return cls(status, json_codec.dumps(value), headers)

    def __repr__(self) -> str:
        return f"Response({self.status}, {len(self.body)} bytes, {self.content_type!r})"


class LastChunk(bytes):
    """The last bytes of a :class:`StreamResponse`: sent with the body's end in one write;
    the server reads no further and closes the iterator (its ``finally`` runs)."""

    __slots__ = ()


class StreamResponse:
    """An answer sent as it is produced: each non-empty bytes of ``chunks`` as one chunk of a
    chunked body, the producer read only as fast as the client takes them. The head is sent
    with the first chunk (a producer that has none yet delays it); a :class:`LastChunk` ends
    the body. The server ``aclose()``-s the iterator when it ends, fails or the client goes
    away."""

    __slots__ = ("_ctype", "_extra", "chunks", "content_type", "headers", "status")

    def __init__(
        self,
        chunks: AsyncIterator[bytes] | AsyncIterable[bytes],
        headers: Mapping[str, str] | None = None,
        content_type: str = "text/event-stream",
        status: int = 200,
    ) -> None:
        if not hasattr(chunks, "__aiter__"):
            raise InvalidArgument("chunks", "chunks must be an async iterator of bytes")
        self.status = _check_status(status)
        self.chunks = chunks
        self.content_type = content_type
        merged = {k.lower(): v for k, v in (headers or {}).items()} if headers else {}
        if content_type.startswith("text/event-stream"):
            merged = {"cache-control": "no-cache", "x-accel-buffering": "no", **merged}
        self.headers: Mapping[str, str] = merged
        self._extra = _header_block(merged)
        self._ctype = _content_type_line(content_type)

    def __repr__(self) -> str:
        return f"StreamResponse({self.status}, {self.content_type!r})"


#: ``async (Request) -> Response | StreamResponse``
Handler = Callable[[Request], Awaitable["Response | StreamResponse"]]


_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in HTTPStatus}
_ERROR_TYPES = {
    400: "invalid_request_error",
    408: "request_timeout",
    413: "request_too_large",
    414: "uri_too_long",
    431: "headers_too_large",
    500: "internal_error",
    503: "overloaded",
}
_NO_BODY = frozenset({204, 304})
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
#: lengths of the request headers the server reads itself (expect, connection, content-length,
#: proxy-connection, transfer-encoding)
_SPECIAL_LENGTHS = frozenset({6, 10, 14, 16, 17})
_METHODS = {m.encode(): m for m in ("GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH")}
#: (keep alive, HTTP/1.0) -> the connection header of an answer
_CONNECTION = {
    (True, False): b"",
    (True, True): b"connection: keep-alive\r\n",
    (False, False): b"connection: close\r\n",
    (False, True): b"connection: close\r\n",
}


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d Unknown\r\n" % status


def _error_body(status: int, message: str, param: str | None) -> bytes:
    error = {
        "message": message,
        "type": _ERROR_TYPES.get(status, "error"),
        "param": param,
        "code": status,
    }
    return json.dumps({"error": error}, separators=(",", ":")).encode()


class _Reject(Exception):
    """A request refused by the server itself (a limit, malformed HTTP); answered in order."""

    def __init__(
        self, status: int, limit: str | None, message: str, close: bool = True, retry: int = 0
    ) -> None:
        super().__init__(message)
        self.status = status
        self.limit = limit
        self.message = message
        self.close = close
        self.retry = retry


class _ClientGone(Exception):
    """The client stopped taking the answer (write stall) or the transport closed."""


class HttpServer:
    """An HTTP/1.1 server calling ``handler`` for every request (module docstring: protocol,
    limits, errors). ``port=0`` picks a free port (read :attr:`port` after :meth:`start`).
    Start and close it on the loop it serves on."""

    def __init__(
        self,
        handler: Handler,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: ServerLimits | None = None,
        backlog: int = 4096,
    ) -> None:
        if not callable(handler):
            raise InvalidArgument("handler", "handler must be an async callable")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise InvalidArgument("port", f"port must be an int in 0..65535, got {port!r}")
        if not isinstance(host, str) or not host:
            raise InvalidArgument("host", f"host must be a non-empty str, got {host!r}")
        if limits is not None and not isinstance(limits, ServerLimits):
            raise InvalidArgument("limits", "limits must be a ServerLimits")
        self.handler = handler
        self.host = host
        self.limits = limits or ServerLimits()
        self.stats = ServerStats()
        self._port = port
        self._backlog = backlog
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[_Connection] = set()
        self._closing = False
        self._all_closed: asyncio.Event | None = None
        self._date_at = -1
        self._date = b""
        self._date_timer: asyncio.TimerHandle | None = None

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self._port}"

    async def start(self) -> None:
        """Listen on ``host:port`` on the running loop."""
        if self._server is not None:
            raise InvalidArgument("start", "the server is already started")
        self._loop = asyncio.get_running_loop()
        self._all_closed = asyncio.Event()
        self._server = await self._loop.create_server(
            lambda: _Connection(self), self.host, self._port, backlog=self._backlog
        )
        self._port = self._server.sockets[0].getsockname()[1]
        self._refresh_date()

    async def close(self, grace_s: float = 5.0) -> None:
        """Stop accepting, close idle connections, let answers in progress end for up to
        ``grace_s`` seconds, then cut what is left (its handlers are cancelled)."""
        if self._server is None or self._closing:
            return
        self._closing = True
        self._server.close()
        if self._date_timer is not None:
            self._date_timer.cancel()
        for conn in list(self._conns):
            conn.shutdown()
        assert self._all_closed is not None
        if self._conns:
            self._all_closed.clear()
            try:
                await asyncio.wait_for(self._all_closed.wait(), max(grace_s, 0.0))
            except asyncio.TimeoutError:
                pass
        runners = []
        for conn in list(self._conns):
            if conn.runner is not None:
                runners.append(conn.runner)
                if conn.active:
                    self.stats.cut_at_close += 1
            conn.cut_by_server = True  # not a client's disconnect
            conn.abort()
        if runners:  # let the cancelled handlers run their cleanup (engine requests cancelled)
            await asyncio.wait(runners, timeout=max(grace_s, 1.0))
        await self._server.wait_closed()

    async def __aenter__(self) -> HttpServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # used by the connections
    def date_line(self) -> bytes:
        """The ``date`` header line, made once a second (not per answer)."""
        now = time.time()
        if int(now) != self._date_at:
            self._date_at = int(now)
            self._date = b"date: " + formatdate(self._date_at, usegmt=True).encode() + b"\r\n"
        return self._date

    def _refresh_date(self) -> None:
        self.date_line()
        assert self._loop is not None
        self._date_timer = self._loop.call_later(1.0 - time.time() % 1.0, self._refresh_date)

    def forget(self, conn: _Connection) -> None:
        self._conns.discard(conn)
        if self._closing and not self._conns and self._all_closed is not None:
            self._all_closed.set()


class _Connection(asyncio.Protocol):
    """One client connection: the parser's callbacks build requests, one runner task answers
    them in order."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.limits = server.limits
        self.stats = server.stats
        loop = server._loop
        assert loop is not None
        self.loop = loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.client: tuple[str, int] | None = None
        # the message being parsed
        self.url = b""
        #: name, value, name, value, ...: one list per request, not a tuple per header (fewer
        #: objects for the garbage collector)
        self.raw_headers: list[bytes] = []
        self.content_length = 0
        self.has_te = False
        self.expect = False
        self.says_connection = False
        self.header_timeout = server.limits.header_timeout_s
        self.max_head = server.limits.max_header_bytes
        self.max_headers = server.limits.max_headers
        #: the body's first piece, then (only when there are more) all its pieces
        self.body: bytes = b""
        self.body_parts: list[bytes] | None = None
        self.body_size = 0
        self.in_message = False
        self.head_done = False
        self.head_raw = 0
        self.begun_at = 0.0
        self.rejected: _Reject | None = None
        # answering
        self.pending: collections.deque[Request | _Reject] = collections.deque()
        self.runner: asyncio.Task[None] | None = None
        self.active = False
        self.reading = True
        self.read_paused = False
        self.write_paused = False
        self.drain_waiter: asyncio.Future[None] | None = None
        self.continue_owed = False
        self.closing = False
        self.lingering = False
        # timers
        self.last_data = 0.0
        self.idle_since = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = math.inf
        #: the timer's longest sleep while idle: a head that begins later is checked in time
        #: without re-arming the timer per request
        self.tick = min(self.limits.keepalive_timeout_s, self.limits.header_timeout_s)
        #: the runner was cancelled by the server (client gone, close), not by the handler
        self.cut = False
        #: the server cut the connection (close's grace ran out): no disconnect to count
        self.cut_by_server = False
        #: the request being answered was counted in ``disconnects`` already
        self.gone_counted = False

    # ---- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        server, stats = self.server, self.stats
        stats.connections += 1
        stats.open_connections += 1
        server._conns.add(self)
        peer = transport.get_extra_info("peername")
        self.client = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else None
        transport.set_write_buffer_limits(high=self.limits.write_buffer_bytes)  # type: ignore[attr-defined]
        self.last_data = self.idle_since = self.loop.time()
        if server._closing:
            self.abort()
            return
        if stats.open_connections > self.limits.max_connections:
            limit = self.limits.max_connections
            self.fail(
                _Reject(
                    503,
                    "max_connections",
                    f"too many open connections (max_connections={limit})",
                    retry=self.limits.retry_after_s,
                )
            )
            return
        self.arm(self.idle_since + self.tick)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is None:
            return
        self.transport = None
        self.stats.open_connections -= 1
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.drain_waiter is not None and not self.drain_waiter.done():
            self.drain_waiter.set_exception(_ClientGone())
        if self.runner is not None:
            if not self.cut_by_server:
                self.client_gone()
            self.cut = True
            self.runner.cancel()
        self.server.forget(self)

    def client_gone(self) -> None:
        """Count the request being answered (if one is) in ``disconnects``, once."""
        if self.active and not self.gone_counted:
            self.gone_counted = True
            self.stats.disconnects += 1

    def eof_received(self) -> bool | None:
        return None  # a half-close is a client gone: close (connection_lost cancels its work)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        waiter = self.drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.stats.bytes_received += len(data)
        self.last_data = self.loop.time()
        if not self.reading:
            return  # after an error or the last request: dropped
        try:
            if self.head_done:
                self.parser.feed_data(data)
            elif self.head_raw + len(data) <= self.max_head:
                self.head_raw += len(data)
                self.parser.feed_data(data)
            else:
                self.feed(data)
        except httptools.HttpParserUpgrade:
            self.reading = False  # the message is queued; answer it and close
            if self.pending and isinstance(self.pending[-1], Request):
                self.pending[-1]._keep = False
        except _Reject as budget:  # the head's byte budget (feed)
            self.rejected = None
            self.fail(budget)
        except httptools.HttpParserError as exc:
            reject, self.rejected = self.rejected, None
            if reject is None:
                if isinstance(exc, httptools.HttpParserCallbackError):
                    log.error("HTTP parser callback failed", exc_info=exc.__context__)
                    reject = _Reject(500, None, "internal error while reading the request")
                else:
                    reason = bound_text(str(exc) or type(exc).__name__, 200)
                    reject = _Reject(400, "malformed", f"malformed HTTP: {reason}")
            self.fail(reject)

    def feed(self, data: bytes) -> None:
        """Feed the parser; while a head is being read, no more than ``max_header_bytes``."""
        view: memoryview | bytes = data
        limit = self.limits.max_header_bytes
        while view:
            if not self.reading:
                return
            if self.head_done:
                self.parser.feed_data(view)
                return
            budget = limit - self.head_raw
            if budget <= 0:
                raise self.reject(
                    431, "max_header_bytes", f"request head over max_header_bytes={limit}"
                )
            if len(view) <= budget:
                self.head_raw += len(view)
                self.parser.feed_data(view)
                return
            if isinstance(view, bytes):
                view = memoryview(view)
            self.head_raw += budget
            self.parser.feed_data(view[:budget])
            view = view[budget:]

    # ---- httptools callbacks
    def reject(self, status: int, limit: str, message: str) -> _Reject:
        self.rejected = _Reject(status, limit, message)
        return self.rejected

    def on_message_begin(self) -> None:
        self.in_message = True
        self.url = b""
        self.raw_headers = []
        self.content_length = 0
        self.has_te = self.expect = self.says_connection = False
        self.body = b""
        self.body_parts = None
        self.body_size = 0
        self.begun_at = self.last_data
        deadline = self.begun_at + self.header_timeout
        if deadline < self.timer_at:
            self.arm(deadline)

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > self.limits.max_url_bytes:
            limit = self.limits.max_url_bytes
            raise self.reject(414, "max_url_bytes", f"request target over max_url_bytes={limit}")

    def on_header(self, name: bytes, value: bytes) -> None:
        # counted when the head ends: until then max_header_bytes bounds the list
        raw = self.raw_headers
        raw.append(name)
        raw.append(value)
        if len(name) in _SPECIAL_LENGTHS:  # cheap filter before lowering the name
            special = name.lower()
            if special == b"content-length":
                try:
                    self.content_length = int(value)
                except ValueError:  # the parser refuses these first; never trust it alone
                    raise self.reject(
                        400, "malformed", "malformed HTTP: bad content-length"
                    ) from None
            elif special == b"transfer-encoding":
                self.has_te = True
            elif special == b"expect":
                self.expect = value.lower() == b"100-continue"
            elif special in (b"connection", b"proxy-connection"):
                self.says_connection = True

    def on_headers_complete(self) -> None:
        self.head_done = True
        self.head_raw = 0
        if len(self.raw_headers) > 2 * self.max_headers:
            limit = self.max_headers
            raise self.reject(431, "max_headers", f"more than max_headers={limit} headers")
        length = self.content_length
        limit = self.limits.max_body_bytes
        if length > limit:
            raise self.reject(
                413, "max_body_bytes", f"request body of {length} bytes over max_body_bytes={limit}"
            )
        if length > 0 or self.has_te:
            deadline = self.last_data + self.limits.idle_body_timeout_s
            if deadline < self.timer_at:
                self.arm(deadline)
            if self.expect and self.parser.get_http_version() == "1.1":
                transport = self.transport
                if self.runner is not None or self.pending:
                    self.continue_owed = True  # sent when the answers before it are
                elif transport is not None and not transport.is_closing():
                    self.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        self.body_size += len(body)
        if self.body_size > self.limits.max_body_bytes:
            limit = self.limits.max_body_bytes
            raise self.reject(
                413, "max_body_bytes", f"request body over max_body_bytes={limit} (chunked)"
            )
        if not self.body:  # the first piece
            self.body = body
        elif self.body_parts is None:
            self.body_parts = [self.body, body]
        else:
            self.body_parts.append(body)

    def on_message_complete(self) -> None:
        parser = self.parser
        self.in_message = False
        self.head_done = False
        self.continue_owed = False
        body = self.body if self.body_parts is None else b"".join(self.body_parts)
        keep_alive = parser.should_keep_alive()
        method = parser.get_method()
        # HTTP/1.0 keeps a connection only when a connection header says so: without one, a
        # kept connection is HTTP/1.1 (and get_http_version, which formats a string, is skipped)
        version = "1.1" if keep_alive and not self.says_connection else parser.get_http_version()
        request = Request._parsed(
            _METHODS.get(method) or method.decode("ascii"),
            self.url.decode("latin-1"),
            self.raw_headers,
            body,
            self.client,
            version,
            keep_alive,
        )
        if not keep_alive or self.closing:
            self.reading = False
        self.pending.append(request)
        if self.runner is None:
            self.runner = self.loop.create_task(self.run())
        elif len(self.pending) >= self.limits.max_pipelined and not self.read_paused:
            self.read_paused = True
            assert self.transport is not None
            self.transport.pause_reading()

    # ---- answering
    def fail(self, reject: _Reject) -> None:
        """Answer ``reject`` after what is queued, then close; read no more requests."""
        self.reading = False
        self.in_message = False
        self.pending.append(reject)
        if self.runner is None:
            self.runner = self.loop.create_task(self.run())

    def write(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise _ClientGone()
        self.stats.bytes_sent += len(data)
        transport.write(data)

    def count(self, status: int) -> None:
        requests = self.stats.requests
        requests[status] = requests.get(status, 0) + 1

    def head(
        self,
        status: int,
        ctype: bytes,
        extra: bytes,
        length: int | None,
        keep_alive: bool,
        http10: bool,
        chunked: bool = False,
    ) -> bytes:
        parts = [_status_line(status), self.server._date, ctype]
        if length is not None:
            parts.append(b"content-length: %d\r\n" % length)
        if chunked:
            parts.append(b"transfer-encoding: chunked\r\n")
        parts.append(_CONNECTION[keep_alive, http10])
        parts.append(extra)
        parts.append(b"\r\n")
        return b"".join(parts)

    def send_error(
        self, status: int, message: str, param: str | None, keep_alive: bool, retry: int = 0
    ) -> None:
        body = _error_body(status, message, param)
        extra = b"retry-after: %d\r\n" % retry if status == 503 else b""
        self.count(status)
        self.write(self.head(status, _JSON_LINE, extra, len(body), keep_alive, False) + body)

    async def run(self) -> None:
        """Answer the queued requests in order; the connection's one task at a time."""
        try:
            while self.pending and self.transport is not None:
                item = self.pending.popleft()
                if self.read_paused and len(self.pending) <= self.limits.max_pipelined // 2:
                    self.read_paused = False
                    if self.reading:
                        self.transport.resume_reading()
                if isinstance(item, _Reject):
                    self.refuse(item)
                    return
                keep_alive = await self.answer(item)
                if not keep_alive or self.transport is None:
                    self.close_transport()
                    return
                if self.write_paused:
                    await self.drain()
            if self.transport is None:
                return
            if self.closing and not self.in_message:
                self.close_transport()
                return
            if self.continue_owed and self.in_message:
                self.continue_owed = False
                self.write(_CONTINUE)
        except _ClientGone:
            self.abort()
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug of this module: the connection goes, the server stays
            log.exception("gateway connection failed")
            self.abort()
        finally:
            self.runner = None
            if self.transport is not None and not self.pending:
                self.idle_since = now = self.loop.time()
                if now + self.tick < self.timer_at:
                    self.arm(now + self.tick)

    def refuse(self, reject: _Reject) -> None:
        key = reject.limit or "internal"
        self.stats.rejected[key] = self.stats.rejected.get(key, 0) + 1
        self.send_error(reject.status, reject.message, reject.limit, False, reject.retry)
        self.linger()

    async def answer(self, request: Request) -> bool:
        """Call the handler for one request and send its answer; whether the connection stays
        open for the next."""
        http10 = request.http_version != "1.1"
        server, stats = self.server, self.stats
        if stats.in_flight >= self.limits.max_in_flight:
            keep_alive = self.keeps(request)
            stats.rejected["max_in_flight"] = stats.rejected.get("max_in_flight", 0) + 1
            limit = self.limits.max_in_flight
            message = f"too many requests in flight (max_in_flight={limit}); retry later"
            self.send_error(503, message, "max_in_flight", keep_alive, self.limits.retry_after_s)
            return keep_alive
        stats.in_flight += 1
        self.active = True
        self.gone_counted = False
        try:
            try:
                response = await server.handler(request)
            except asyncio.CancelledError:
                if self.cut or self.transport is None:
                    raise  # the client went away or the server closes
                raise RuntimeError("the handler raised CancelledError") from None
            keep_alive = self.keeps(request)  # the server may have begun closing meanwhile
            if isinstance(response, Response):
                self.send(response, request, keep_alive, http10)
                return keep_alive
            if isinstance(response, StreamResponse):
                return await self.stream(response, request, keep_alive, http10)
            raise TypeError(
                f"the handler returned {type(response).__name__}, not a Response or a "
                "StreamResponse"
            )
        except asyncio.CancelledError:
            raise
        except _ClientGone:
            self.client_gone()
            raise
        except Exception as exc:
            stats.handler_errors += 1
            log.error("gateway handler failed on %r", request, exc_info=exc)
            message = bound_text(f"{type(exc).__name__}: {exc}", ERROR_MESSAGE_CHARS)
            keep_alive = self.keeps(request)
            self.send_error(500, message, None, keep_alive)
            return keep_alive
        finally:
            stats.in_flight -= 1
            self.active = False

    def keeps(self, request: Request) -> bool:
        """Whether the connection stays open after answering ``request``: the client's wish,
        unless the server closes and nothing else is queued or being received."""
        return request._keep and not (self.closing and not self.pending and not self.in_message)

    def send(self, response: Response, request: Request, keep_alive: bool, http10: bool) -> None:
        status = response.status
        requests = self.stats.requests
        requests[status] = requests.get(status, 0) + 1
        if status in _NO_BODY:
            self.write(
                self.head(status, response._ctype, response._extra, None, keep_alive, http10)
            )
            return
        body = response.body
        head = (
            _STATUS_LINES.get(status) or _status_line(status),
            self.server._date,
            response._ctype,
            b"content-length: %d\r\n" % len(body),
            _CONNECTION[keep_alive, http10],
            response._extra,
            b"\r\n",
        )
        if request.method == "HEAD" or not body:
            self.write(b"".join(head))
        elif len(body) < 65536:
            data = b"".join((*head, body))
            transport = self.transport  # write(), inlined: the path of every short answer
            if transport is None or transport.is_closing():
                raise _ClientGone()
            self.stats.bytes_sent += len(data)
            transport.write(data)
        else:
            self.write(b"".join(head))
            self.write(body)

    async def stream(
        self, response: StreamResponse, request: Request, keep_alive: bool, http10: bool
    ) -> bool:
        chunked = not http10
        keep_alive = keep_alive and chunked
        iterator = response.chunks.__aiter__()
        try:
            head = self.head(
                response.status,
                response._ctype,
                response._extra,
                None,
                keep_alive,
                http10,
                chunked=chunked,
            )
            self.count(response.status)
            if request.method == "HEAD":
                self.write(head)
                return keep_alive
            pending = head  # sent with the first chunk
            try:
                async for chunk in iterator:
                    last = type(chunk) is LastChunk
                    if not chunk and not last:
                        continue
                    if chunked:
                        data = b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunk else b""
                        if last:
                            data += b"0\r\n\r\n"
                    else:
                        data = chunk
                    if pending:
                        data, pending = pending + data, b""
                    self.write(data)
                    if last:
                        return keep_alive
                    if self.write_paused:
                        await self.drain()
            except (asyncio.CancelledError, _ClientGone):
                raise
            except Exception as exc:
                self.stats.handler_errors += 1
                log.error("gateway stream of %r broke after its head", request, exc_info=exc)
                if pending:
                    self.write(pending)
                self.close_transport()  # no last chunk: the client sees a cut body
                return False
            if chunked or pending:
                self.write(pending + b"0\r\n\r\n" if chunked else pending)
            return keep_alive
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:
                    log.exception("closing a gateway stream's iterator failed")

    async def drain(self) -> None:
        """Wait until the transport's buffer is below its low mark; a client that takes nothing
        for ``write_stall_timeout_s`` is cut."""
        waiter = self.loop.create_future()
        self.drain_waiter = waiter
        try:
            await asyncio.wait_for(waiter, self.limits.write_stall_timeout_s)
        except asyncio.TimeoutError:  # not the builtin before Python 3.11
            self.stats.rejected["write_stall_timeout_s"] = (
                self.stats.rejected.get("write_stall_timeout_s", 0) + 1
            )
            self.client_gone()
            self.abort()
            raise _ClientGone() from None
        finally:
            self.drain_waiter = None

    # ---- closing and timers
    def shutdown(self) -> None:
        """The server closes: close now when idle, else after what is being answered."""
        self.closing = True
        if not self.in_message:
            self.reading = False  # a request being received is read to its end and answered
            if self.runner is None and not self.pending:
                self.close_transport()

    def close_transport(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def linger(self) -> None:
        """After an error answer: send FIN, drop what the client still sends, close on its EOF
        or after :data:`LINGER_S`."""
        transport = self.transport
        if transport is None:
            return
        self.lingering = True
        self.reading = False
        if transport.can_write_eof():
            transport.write_eof()
        if self.read_paused:
            self.read_paused = False
            transport.resume_reading()
        self.timer_at = math.inf
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.loop.call_later(LINGER_S, self.close_transport)

    def arm(self, deadline: float) -> None:
        if self.lingering or deadline >= self.timer_at:
            return
        if self.timer is not None:
            self.timer.cancel()
        self.timer_at = deadline
        self.timer = self.loop.call_at(deadline, self.on_timer)

    def on_timer(self) -> None:
        self.timer = None
        self.timer_at = math.inf
        if self.transport is None or self.lingering:
            return
        now = self.loop.time()
        limits = self.limits
        if self.in_message and self.reading:
            if not self.head_done:
                deadline = self.begun_at + limits.header_timeout_s
                limit, what = "header_timeout_s", "request head not complete within"
            else:
                deadline = self.last_data + limits.idle_body_timeout_s
                limit, what = "idle_body_timeout_s", "no byte of the request body for"
            if now >= deadline:
                self.fail(_Reject(408, limit, f"{what} {limit}={getattr(limits, limit)}"))
            else:
                self.arm(deadline)
            return
        if self.runner is not None or self.pending:
            return  # answering: re-armed when idle
        deadline = self.idle_since + limits.keepalive_timeout_s
        if now >= deadline:
            self.close_transport()
        else:
            self.arm(min(deadline, now + self.tick))
