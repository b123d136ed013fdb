"""Pooled keep-alive HTTP/1.1 client connections on a bare asyncio protocol: what the asyncio
engine clients (:mod:`~rollsafe.adapters.engines.aio`) send requests and read answers with.

Owns the connections to the engines of one event loop: opening them (a resolved address cached
for :data:`DNS_TTL_S`; ``https`` with the default TLS context), pooling them per origin (scheme,
host, port: no limit unless asked), parsing answers with httptools' ``HttpResponseParser`` in an
``asyncio.Protocol`` (no stream reader, no task per connection), and the timeouts. The mapping
of its failures onto the engine errors is :mod:`~rollsafe.adapters.engines.aio`'s.

* :class:`ConnectionPool`: ``await pool.send(method, url, path, ...)`` -> a :class:`Response`
  whose head (status, reason, headers) has arrived and whose body is read with
  ``await response.chunk()`` (every body byte received so far, waiting for some when there are
  none; ``b""`` at the end) or ``await response.read()`` (all of it); ``response.release()``
  hands the connection back to the pool when the body was read to its end and the server keeps
  it alive, else closes it; ``response.close()`` closes it (the server sees the disconnect).
* The protocol buffers what the parser gives and wakes the one waiting reader once per read
  from the socket, however many body chunks (server-sent events) that read carried; past
  :data:`HIGH_WATER` bytes buffered and not taken the socket is not read until the reader takes
  them.
* Bodies framed by ``Content-Length``, chunked, or by the end of the connection; 1xx answers
  are skipped; an answer to ``HEAD`` has no body (its connection is not reused).

Failures are :class:`HttpFailure` (``sent``: whether any of the request may have reached the
server; ``False`` only when no connection was opened or it was never written to) and its
subclass :class:`HttpTimeout`:

========================================  ==============================================
what                                      raised
========================================  ==============================================
refused, DNS, TLS, the connect hook       :class:`HttpFailure`, ``sent=False``
raised
no connection (or, with a limit, no      :class:`HttpTimeout`, ``sent=False``
free one) within the timeout
the pool is closed                        :class:`HttpFailure`, ``sent=False`` (before
                                          sending), ``sent=True`` (an answer being read)
the connection broke or closed before     :class:`HttpFailure`, ``sent=True``
the answer's end; a malformed answer
no byte within the timeout while a        :class:`HttpTimeout`, ``sent=True``
reader waits (head or body)
========================================  ==============================================

A pooled connection the server closed while it was idle is seen closed (its ``connection_lost``
ran, or its socket is readable: the close arrived while the loop did not run) and never written
to: the request takes another one, or a fresh one. A connection idle
for ``keepalive_timeout`` is closed. Bytes arriving on an idle connection, or after a complete
answer, close it. Requests are not pipelined: one exchange per connection at a time. Usable
only on the loop it was made on (its caller, :class:`~rollsafe.adapters.engines.aio.AsyncHttp`,
checks).
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import select
import socket
import ssl
from collections.abc import Awaitable, Callable, Mapping
from typing import cast
from urllib.parse import urlsplit

import httptools

from rollsafe.adapters.engines.errors import EngineError
from rollsafe.errors import InvalidArgument, InvalidArgumentType

__all__ = [
    "DNS_TTL_S",
    "HIGH_WATER",
    "Connect",
    "ConnectionPool",
    "HttpFailure",
    "HttpTimeout",
    "Response",
    "connect_tcp",
]

#: body bytes buffered and not taken by the reader past which the socket is not read
HIGH_WATER = 256 << 10
#: how long a host name's resolved addresses are reused for new connections
DNS_TTL_S = 10.0
#: host names (and URLs) whose resolution (parse) is cached at most, per pool
_CACHE_ENTRIES = 1024

#: opens a connection to ``(host, port)`` instead of the pool's own TCP connect: a connected
#: socket, which the pool wraps in its protocol (and in TLS for an ``https`` URL)
Connect = Callable[[str, int], Awaitable[socket.socket]]

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
_BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_BAD_TARGET = re.compile(r"[\x00-\x20\x7f]")


class HttpFailure(EngineError):
    """A request that failed below the HTTP status: no connection, a connection that broke or
    closed before the answer's end, a malformed answer. ``sent`` is ``False`` only when none of
    the request can have reached the server (no connection was opened, or it was never written
    to). The pool's own error: :mod:`~rollsafe.adapters.engines.aio` raises the engine errors
    it maps to (:class:`EngineUnavailable`, :class:`EngineTimeout`), never this."""

    def __init__(self, reason: str, *, sent: bool) -> None:
        self.reason = reason
        self.sent = sent
        super().__init__(reason)

    def again(self) -> HttpFailure:
        """A fresh exception with the same reason (one raised per reader that sees it)."""
        return type(self)(self.reason, sent=self.sent)


class HttpTimeout(HttpFailure):
    """No connection within the timeout (``sent=False``), or no byte while a reader waited
    (``sent=True``)."""


class _Origin:
    """Where a base URL's requests go: the pool key, the ``Host`` header, the path prefix."""

    __slots__ = ("host", "host_header", "key", "port", "prefix", "tls")

    def __init__(self, url: str) -> None:
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise InvalidArgument("url", f"bad engine URL {url!r}: {exc}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidArgument(
                "url", f"engine URL must be http://host[:port] or https://..., got {url!r}"
            )
        if parts.query or parts.fragment or parts.username or parts.password:
            raise InvalidArgument(
                "url", f"engine URL takes no query, fragment or credentials: {url!r}"
            )
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = port if port is not None else (443 if self.tls else 80)
        name = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = name if port is None else f"{name}:{port}"
        self.prefix = parts.path.rstrip("/")
        self.key = (parts.scheme, self.host, self.port)


def _request_head(
    method: str,
    origin: _Origin,
    path: str,
    headers: Mapping[str, str] | None,
    content_type: str | None,
    length: int | None,
) -> bytes:
    """The request line and headers, checked (no line breaks smuggled into them)."""
    target = origin.prefix + path
    if not _TOKEN.match(method) or not target.startswith("/") or _BAD_TARGET.search(target):
        raise InvalidArgument("path", f"bad request line: {method!r} {target!r}")
    lines = [f"{method} {target} HTTP/1.1\r\nHost: {origin.host_header}\r\n"]
    if headers:
        for name, value in headers.items():
            if not _TOKEN.match(name) or _BAD_VALUE.search(value):
                raise InvalidArgument("headers", f"bad header {name!r}: {value!r}")
            lines.append(f"{name}: {value}\r\n")
    if content_type is not None:
        if _BAD_VALUE.search(content_type):
            raise InvalidArgument("content_type", f"bad content type {content_type!r}")
        lines.append(f"Content-Type: {content_type}\r\n")
    if length is not None:
        lines.append(f"Content-Length: {length}\r\n")
    lines.append("\r\n")
    try:
        return "".join(lines).encode("latin-1")
    except UnicodeEncodeError as exc:
        raise InvalidArgument("headers", f"request head is not latin-1: {exc}") from None


def _describe(exc: BaseException | None) -> str:
    if exc is None:
        return "the server closed the connection"
    return f"{type(exc).__name__}: {exc}"


class _Connection(asyncio.Protocol):
    """One keep-alive connection and the exchange on it: httptools' callbacks fill the answer's
    state, :meth:`data_received` wakes the waiting reader once per read."""

    def __init__(self, pool: ConnectionPool, key: tuple[str, str, int]) -> None:
        self.pool = pool
        self.key = key
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        #: closed, or lost: never written to again
        self.closed = False
        #: in the pool's idle list, since ``idle_since`` (the loop's clock)
        self.idle = False
        self.idle_since = 0.0
        #: counted in the pool's open connections
        self.counted = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._paused = False
        self._begin(False)

    def _begin(self, no_body: bool) -> None:
        """A new exchange: the answer's state, empty."""
        self.expecting = False  # a request is out and its answer is not whole yet
        self.sent = False
        self.no_body = no_body
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.informational = False
        self.keep = True
        self.eof_framed = False
        self.chunks: list[bytes] = []
        self.size = 0
        self.done = False
        self.failure: HttpFailure | None = None
        self.progress = False
        self.waiter: asyncio.Future[bool] | None = None
        self.deadline = 0.0
        self.wait_s = 0.0
        #: the caller's handle on this answer, once :meth:`ConnectionPool.send` returned it
        self.response: Response | None = None

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is no subclass)
        if self.closed:  # closed while it connected (the pool's close)
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if not self.expecting:  # idle, or past a whole answer: nothing of ours to follow
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if not self.done:  # bytes after a whole answer: the answer stands, the connection goes
                self._fail(HttpFailure(f"malformed HTTP answer: {exc}", sent=True))
            self.close()
        if self.progress:
            self.progress = False
            waiter = self.waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(False)
        elif self.waiter is not None:  # a byte came: the wait starts again
            self.deadline = self.loop.time() + self.wait_s
        if self.done and self.response is not None:
            self.response._detach()  # the answer is whole: the connection is free again
            return
        if self.size > HIGH_WATER and not self._paused and not self.closed:
            assert self.transport is not None
            self._paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool | None:
        return None  # the transport closes; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        if self.expecting:
            if self.head_done and self.eof_framed and exc is None:
                self.done = True  # a body framed by the end of the connection
                self.expecting = False
                self.progress = True
            else:
                where = "" if self.head_done else " before answering"
                self._fail(HttpFailure(_describe(exc) + where, sent=self.sent))
        self._wake()
        self.pool._forget(self)

    # ------------------------------------------------------------------ httptools callbacks
    def on_message_begin(self) -> None:
        if self.done:  # a second answer to one request
            raise HttpFailure("an answer nobody asked for", sent=True)

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # 100 Continue, 103 Early Hints: the answer follows
            self.informational = True
            return
        self.status = status
        self.head_done = True
        self.progress = True
        if status >= self.pool.close_after_status:
            self.keep = False
        if not self.parser.should_keep_alive():
            self.keep = False
            framed = (b"content-length", b"transfer-encoding")
            self.eof_framed = not any(name.lower() in framed for name, _ in self.headers)
        if self.no_body:  # HEAD: no body follows, whatever the headers say
            self.keep = False
            self.done = True
            self.expecting = False

    def on_body(self, body: bytes) -> None:
        if self.no_body:
            return
        self.chunks.append(body)
        self.size += len(body)
        self.progress = True

    def on_message_complete(self) -> None:
        if self.informational:
            self.informational = False
            self.reason = b""
            self.headers = []
            return
        self.done = True
        self.expecting = False
        self.progress = True

    # ------------------------------------------------------------------ the exchange
    def send(self, data: bytes, no_body: bool) -> None:
        """Write a request (the previous answer is whole and taken)."""
        self._begin(no_body)
        transport = self.transport
        if self.closed or transport is None or transport.is_closing():
            # the server closed it as it came out of the pool or right after it opened
            self.failure = HttpFailure("the server closed the connection", sent=False)
            return
        self.expecting = True
        self.sent = True
        transport.write(data)

    def take(self) -> bytes:
        """Every body byte received and not taken yet."""
        chunks = self.chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self.chunks = []
        self.size = 0
        if self._paused:
            self._resume()
        return data

    def _resume(self) -> None:
        self._paused = False
        if not self.closed and self.transport is not None:
            self.transport.resume_reading()

    async def wait(self, timeout: float) -> None:
        """Until the parser makes progress (the head, body bytes, the end) or the connection
        fails; :class:`HttpTimeout` when no byte comes within ``timeout``."""
        loop = self.loop
        waiter: asyncio.Future[bool] = loop.create_future()
        self.waiter = waiter
        self.wait_s = timeout
        deadline = self.deadline = loop.time() + timeout
        if self._timer is None or self._timer_at > deadline:
            self._cancel_timer()
            self._timer_at = deadline
            self._timer = loop.call_at(deadline, self._on_timer)
        try:
            timed_out = await waiter
        finally:
            if self.waiter is waiter:  # (the connection may serve another exchange by now)
                self.waiter = None
        if timed_out:
            raise HttpTimeout(f"no byte within {timeout}s", sent=True)

    def _on_timer(self) -> None:
        """One timer per connection, moved only when it fires: a wait that ended (or a byte
        that came) before it costs nothing."""
        self._timer = None
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        if self.loop.time() < self.deadline:
            self._timer_at = self.deadline
            self._timer = self.loop.call_at(self.deadline, self._on_timer)
            return
        waiter.set_result(True)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fail(self, failure: HttpFailure) -> None:
        if self.failure is None:
            self.failure = failure
        self.expecting = False
        self.progress = True

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(False)

    def close(self, reason: str = "the connection was closed") -> None:
        """Close the connection (a reader waiting on it gets :class:`HttpFailure`)."""
        self.keep = False
        if self.expecting:
            self._fail(HttpFailure(reason, sent=self.sent))
            self._wake()
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.close()
        if not self.closed:
            self.closed = True
            self._cancel_timer()
            self.pool._forget(self)

    @property
    def reusable(self) -> bool:
        return self.keep and self.done and not self.chunks and not self.closed


class Response:
    """An answer whose head has arrived: ``status``, ``reason``, ``headers`` (raw name/value
    bytes, in order); the body read with :meth:`chunk` / :meth:`read`, then :meth:`release`
    (pooled if read to its end) or :meth:`close`. Once the body has arrived whole the
    connection goes back to the pool at once (when the server keeps it alive and reuse was not
    forbidden) and the response keeps what the reader has not taken yet: a consumer that stops
    reading after the end costs no connection."""

    __slots__ = ("_conn", "_rest", "_timeout", "headers", "reason", "status")

    def __init__(self, conn: _Connection, timeout: float) -> None:
        self._conn: _Connection | None = conn
        self._rest: list[bytes] = []  # the body bytes not taken when the connection left
        self._timeout = timeout
        self.status = conn.status
        self.reason = conn.reason.decode("latin-1")
        self.headers = conn.headers
        conn.response = self
        if conn.done:
            self._detach()

    def __repr__(self) -> str:
        return f"<Response {self.status} {self.reason}>"

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (any case), or None."""
        wanted = name.lower().encode("latin-1")
        for key, value in self.headers:
            if key.lower() == wanted:
                return value.decode("latin-1")
        return None

    @property
    def at_eof(self) -> bool:
        """The whole body was received and taken (or the response was released or closed)."""
        conn = self._conn
        if conn is None:
            return not self._rest
        return conn.done and not conn.chunks

    def take(self) -> bytes:
        """The body bytes received and not taken yet, without waiting (``b""``: none)."""
        conn = self._conn
        if conn is not None:
            return conn.take()
        rest, self._rest = self._rest, []
        return rest[0] if len(rest) == 1 else b"".join(rest)

    async def chunk(self, timeout: float | None = None) -> bytes:
        """Every body byte received and not taken yet, waiting (each wait up to ``timeout``,
        the request's by default) when there is none; ``b""`` at the end of the body. Bytes that
        came before a failure are returned first, the failure is raised on the next call."""
        while True:
            conn = self._conn
            if conn is None or conn.chunks:
                return self.take()
            if conn.done:
                return b""
            if conn.failure is not None:
                raise conn.failure.again()
            await conn.wait(self._timeout if timeout is None else timeout)

    async def read(self) -> bytes:
        """The rest of the body, whole."""
        parts = []
        while chunk := await self.chunk():
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _detach(self) -> None:
        """The body arrived whole: keep what was not taken, free the connection (pooled, or
        closed when the server or the caller said so)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        conn.response = None
        self._rest = conn.chunks
        conn.chunks = []
        conn.size = 0
        if conn._paused:
            conn._resume()
        if conn.reusable:
            conn.pool._put(conn)
        else:
            conn.close()

    def release(self) -> None:
        """Done with the answer: its connection back to the pool when the body was read to its
        end and the server keeps it alive, else closed."""
        conn, self._conn = self._conn, None
        self._rest = []
        if conn is None:
            return
        conn.response = None
        if conn.reusable:
            conn.pool._put(conn)
        else:
            conn.close()

    def close(self) -> None:
        """Close the connection now (the server sees the disconnect), unless the answer had
        already arrived whole and the connection left."""
        conn, self._conn = self._conn, None
        self._rest = []
        if conn is not None:
            conn.response = None
            conn.close()


async def connect_tcp(host: str, port: int) -> socket.socket:
    """A connected non-blocking TCP socket to ``(host, port)`` (each resolved address in turn):
    what a :data:`Connect` hook can wrap."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    last: OSError | None = None
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, address)
        except OSError as exc:
            sock.close()
            last = exc
            continue
        except BaseException:
            sock.close()
            raise
        return sock
    raise last if last is not None else OSError(f"no address for {host!r}")


def _readable(transport: asyncio.BaseTransport) -> bool:
    """Whether an idle connection's socket has something to read: the server's close (a FIN
    that arrived while the loop did not run, so ``connection_lost`` has not run yet) or bytes
    nobody asked for. Either way it is not reused. A zero-timeout ``poll`` of its descriptor."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN | select.POLLPRI)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


class ConnectionPool:
    """The keep-alive connections of one event loop, per origin (see the module). ``limit``
    (0: none) bounds the connections open at once, ``limit_per_host`` those to one origin; with
    a bound, a request waits for a free connection up to its timeout (then :class:`HttpTimeout`,
    ``sent=False``; an idle connection to another origin is closed to make room). An idle
    connection is closed after ``keepalive_timeout`` s. ``connect``: a :data:`Connect` hook
    instead of the pool's own TCP connect. A connection whose answer's status is
    ``close_after_status`` or more is closed after it, never reused (a real vLLM drops its
    keep-alive connection after a 500 without saying so)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        limit: int = 0,
        limit_per_host: int = 0,
        keepalive_timeout: float = 60.0,
        connect: Connect | None = None,
        close_after_status: int = 1000,
    ) -> None:
        for key, value in (("limit", limit), ("limit_per_host", limit_per_host)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(
                    key, f"{key} must be an int >= 0 (0: no limit), got {value!r}"
                )
        if isinstance(keepalive_timeout, bool) or not (
            isinstance(keepalive_timeout, (int, float)) and keepalive_timeout > 0
        ):
            raise InvalidArgument(
                "keepalive_timeout", f"keepalive_timeout must be > 0, got {keepalive_timeout!r}"
            )
        if connect is not None and not callable(connect):
            raise InvalidArgumentType(
                "connect",
                "connect must be an async callable (host, port) -> socket, got "
                f"{type(connect).__name__}",
            )
        self.loop = loop
        self.close_after_status = close_after_status
        self._limit = limit
        self._limit_per_host = limit_per_host
        self._keepalive = float(keepalive_timeout)
        self._connect = connect
        self._closed = False
        self._origins: dict[str, _Origin] = {}
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._per_key: dict[tuple[str, str, int], int] = {}
        self._total = 0
        self._room_waiters: list[asyncio.Future[None]] = []
        self._sweeper: asyncio.TimerHandle | None = None
        self._dns: dict[tuple[str, int], tuple[float, list[tuple[int, str]]]] = {}
        self._dns_pending: dict[tuple[str, int], asyncio.Task[list[tuple[int, str]]]] = {}
        self._tls: ssl.SSLContext | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def open_connections(self) -> int:
        """Connections open now (idle, in use, being opened)."""
        return self._total

    @property
    def idle_connections(self) -> int:
        """Connections in the pool, waiting for a request."""
        return sum(1 for conns in self._idle.values() for c in conns if not c.closed)

    async def close(self) -> None:
        """Close every connection: idle ones, and those in use (their readers get
        :class:`HttpFailure`); later requests fail with ``sent=False``."""
        if self._closed:
            return
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self._idle.clear()
        for conn in list(self._open):
            conn.close("the connection pool was closed")
        self._wake_room()
        await asyncio.sleep(0)  # the transports' connection_lost callbacks

    # ------------------------------------------------------------------ requests
    async def send(
        self,
        method: str,
        url: str,
        path: str,
        *,
        headers: Mapping[str, str] | None = None,
        body: bytes | None = None,
        content_type: str | None = None,
        timeout: float,
    ) -> Response:
        """Send one request to ``url + path`` on a pooled (or fresh) connection and wait for the
        answer's head (``timeout``: for the connection, and for each wait for a byte). The
        caller reads the body and releases or closes the :class:`Response`."""
        origin = self._origins.get(url)
        if origin is None:
            origin = _Origin(url)
            if len(self._origins) >= _CACHE_ENTRIES:
                self._origins.clear()
            self._origins[url] = origin
        if body is None and method in ("POST", "PUT", "PATCH"):
            body = b""
        length = None if body is None else len(body)
        head = _request_head(method, origin, path, headers, content_type, length)
        if self._closed:
            raise HttpFailure("the connection pool is closed", sent=False)
        data = head + body if body else head
        while True:
            conn = self._pop_idle(origin.key)
            reused = conn is not None
            if conn is None:
                conn = await self._acquire(origin, timeout)
            conn.send(data, method == "HEAD")
            if conn.expecting or not reused:
                break
            conn.close()  # gone as it left the pool, nothing written: another connection
        try:
            while not conn.head_done:
                if conn.failure is not None:
                    raise conn.failure.again()
                await conn.wait(timeout)
        except BaseException:
            conn.close()
            raise
        return Response(conn, timeout)

    # ------------------------------------------------------------------ connections
    async def _acquire(self, origin: _Origin, timeout: float) -> _Connection:
        """A fresh connection to ``origin`` (with a limit: once there is room for it, or an
        idle one that came back meanwhile)."""
        if self._limit or self._limit_per_host:
            conn = await self._room(origin.key, timeout)
            if conn is not None:
                return conn
        return await self._open_new(origin, timeout)

    def _pop_idle(self, key: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = self.loop.time()
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to have gone
            conn.idle = False
            if conn.closed:
                continue
            transport = conn.transport
            if transport is None or transport.is_closing():
                conn.close()
                continue
            if now - conn.idle_since >= self._keepalive or _readable(transport):
                conn.close()
                continue
            return conn
        return None

    def _count(self, conn: _Connection) -> None:
        conn.counted = True
        self._open.add(conn)
        self._per_key[conn.key] = self._per_key.get(conn.key, 0) + 1
        self._total += 1

    def _forget(self, conn: _Connection) -> None:
        """A connection closed or lost: no longer counted (its idle entry goes lazily)."""
        if not conn.counted:
            return
        conn.counted = False
        self._open.discard(conn)
        self._total -= 1
        left = self._per_key[conn.key] - 1
        if left:
            self._per_key[conn.key] = left
        else:
            del self._per_key[conn.key]
        if self._room_waiters:
            self._wake_room()

    def _put(self, conn: _Connection) -> None:
        """A connection whose answer was read whole: idle in the pool."""
        if self._closed or conn.closed:
            conn.close()
            return
        conn.idle = True
        conn.idle_since = self.loop.time()
        self._idle.setdefault(conn.key, []).append(conn)
        if self._sweeper is None:
            self._sweeper = self.loop.call_at(conn.idle_since + self._keepalive, self._sweep)
        if self._room_waiters:
            self._wake_room()

    def _sweep(self) -> None:
        """Close the connections idle for ``keepalive_timeout``; again at the next expiry."""
        self._sweeper = None
        now = self.loop.time()
        first: float | None = None
        for key, conns in list(self._idle.items()):
            kept = []
            for conn in conns:
                if conn.closed:
                    continue
                if now - conn.idle_since >= self._keepalive:
                    conn.idle = False
                    conn.close()
                    continue
                kept.append(conn)
                first = conn.idle_since if first is None else min(first, conn.idle_since)
            if kept:
                self._idle[key] = kept
            else:
                del self._idle[key]
        if first is not None:
            self._sweeper = self.loop.call_at(first + self._keepalive, self._sweep)

    async def _room(self, key: tuple[str, str, int], timeout: float) -> _Connection | None:
        """With a limit: wait until a connection to ``key`` may be opened (then None, the slot
        is the caller's to fill) or an idle one comes back (then that one)."""
        deadline = self.loop.time() + timeout
        while True:
            if self._closed:
                raise HttpFailure("the connection pool is closed", sent=False)
            conn = self._pop_idle(key)
            if conn is not None:
                return conn
            per_host = self._per_key.get(key, 0)
            host_full = bool(self._limit_per_host) and per_host >= self._limit_per_host
            total_full = bool(self._limit) and self._total >= self._limit
            if total_full and not host_full and self._close_other_idle(key):
                continue
            if not host_full and not total_full:
                return None
            left = deadline - self.loop.time()
            if left <= 0:
                raise HttpTimeout(
                    f"no free connection within {timeout}s (limit {self._limit}, per host "
                    f"{self._limit_per_host})",
                    sent=False,
                )
            waiter: asyncio.Future[None] = self.loop.create_future()
            self._room_waiters.append(waiter)
            handle = self.loop.call_later(left, self._timeout_waiter, waiter)
            try:
                await waiter
            finally:
                handle.cancel()
                if waiter in self._room_waiters:
                    self._room_waiters.remove(waiter)

    def _close_other_idle(self, key: tuple[str, str, int]) -> bool:
        """Close the longest idle connection to another origin; False if there is none."""
        oldest: _Connection | None = None
        for other, conns in self._idle.items():
            if other == key:
                continue
            for conn in conns:
                if not conn.closed and (oldest is None or conn.idle_since < oldest.idle_since):
                    oldest = conn
        if oldest is None:
            return False
        self._idle[oldest.key].remove(oldest)
        oldest.idle = False
        oldest.close()
        return True

    @staticmethod
    def _timeout_waiter(waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            waiter.set_result(None)

    def _wake_room(self) -> None:
        waiters, self._room_waiters = self._room_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def _open_new(self, origin: _Origin, timeout: float) -> _Connection:
        conn = _Connection(self, origin.key)
        self._count(conn)  # the slot is taken while it connects
        try:
            await asyncio.wait_for(self._connect_to(conn, origin), timeout)
        except asyncio.TimeoutError:
            conn.close()
            raise HttpTimeout(
                f"no connection within {timeout}s (connect timeout)", sent=False
            ) from None
        except (OSError, ssl.SSLError, ValueError) as exc:  # gaierror, refused, TLS; bad host
            conn.close()
            raise HttpFailure(f"{type(exc).__name__}: {exc}", sent=False) from exc
        except BaseException:
            conn.close()
            raise
        if self._closed:
            conn.close()
            raise HttpFailure("the connection pool is closed", sent=False)
        return conn

    async def _connect_to(self, conn: _Connection, origin: _Origin) -> None:
        loop = self.loop
        tls = self._tls_context() if origin.tls else None
        hostname = origin.host if origin.tls else None
        if self._connect is not None:
            sock = await self._connect(origin.host, origin.port)
            try:
                await loop.create_connection(
                    lambda: conn, sock=sock, ssl=tls, server_hostname=hostname
                )
            except BaseException:
                sock.close()
                raise
            return
        last: OSError | None = None
        for family, address in await self._addresses(origin.host, origin.port):
            try:
                await loop.create_connection(
                    lambda: conn,
                    address,
                    origin.port,
                    family=family,
                    ssl=tls,
                    server_hostname=hostname,
                )
                return
            except OSError as exc:
                last = exc
        raise last if last is not None else OSError(f"no address for {origin.host!r}")

    async def _addresses(self, host: str, port: int) -> list[tuple[int, str]]:
        """``host``'s addresses: an IP literal as it is, a name resolved once per
        :data:`DNS_TTL_S` (one lookup at a time per name, which the others share; a caller
        cancelled does not cancel it)."""
        key = (host, port)
        cached = self._dns.get(key)
        if cached is not None and cached[0] > self.loop.time():
            return cached[1]
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            pass
        else:
            family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
            addresses = [(int(family), host)]
            self._cache_dns(key, float("inf"), addresses)
            return addresses
        lookup = self._dns_pending.get(key)
        if lookup is None:
            lookup = self._dns_pending[key] = self.loop.create_task(self._lookup(host, port))
            lookup.add_done_callback(lambda done: self._looked_up(key, done))
        return await asyncio.shield(lookup)

    async def _lookup(self, host: str, port: int) -> list[tuple[int, str]]:
        infos = await self.loop.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
        )
        addresses: list[tuple[int, str]] = []
        for family, _, _, _, sockaddr in infos:
            entry = (int(family), str(sockaddr[0]))
            if entry not in addresses:
                addresses.append(entry)
        if addresses:
            self._cache_dns((host, port), self.loop.time() + DNS_TTL_S, addresses)
        return addresses

    def _looked_up(self, key: tuple[str, int], done: asyncio.Task[list[tuple[int, str]]]) -> None:
        self._dns_pending.pop(key, None)
        if not done.cancelled():
            done.exception()  # retrieved: each caller that waited has it already

    def _cache_dns(self, key: tuple[str, int], until: float, value: list[tuple[int, str]]) -> None:
        if len(self._dns) >= _CACHE_ENTRIES:
            self._dns.clear()
        self._dns[key] = (until, value)

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls
