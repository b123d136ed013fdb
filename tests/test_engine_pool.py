"""The asyncio engine clients' connection pool (``rollsafe.adapters.engines.pool``) on real
sockets: an HTTP/1.1 server in the test's own event loop (:class:`RawServer`) writes each answer
as raw bytes, so a test picks the framing (chunked, ``Content-Length``, the end of the
connection) and where the client's reads split (inside a server-sent event, inside a chunk's
``\\r\\n``), and counts connections, requests, and connections the client closed.

Checked through :class:`AsyncHttp` (the error mapping of ``rollsafe.adapters.engines.aio``) and
the pool itself: keep-alive reuse, a connection the server closed while idle is not written to,
a stream cut mid-body, read timeouts, an early ``aclose()`` and a cancel close the connection,
a 5xx's connection is not reused, limits, keep-alive expiry, ``close()``, a name resolved once.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest

from rollsafe.adapters.engines import (
    NO_RETRY,
    AsyncHttp,
    EngineRequestError,
    EngineTimeout,
    EngineUnavailable,
    SGLangClient,
    async_engine,
)
from rollsafe.adapters.engines.pool import ConnectionPool, HttpFailure, HttpTimeout
from rollsafe.errors import InvalidArgument

_T = TypeVar("_T")


def run(coro: Coroutine[Any, Any, _T], loop: str = "asyncio") -> _T:
    """Run ``coro`` on a fresh event loop (``"uvloop"``: uvloop's)."""
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        event_loop = uvloop.new_event_loop()
        try:
            result: _T = event_loop.run_until_complete(coro)
            return result
        finally:
            event_loop.close()
    return asyncio.run(coro)


LOOPS = ["asyncio", "uvloop"]


# ---- the server ------------------------------------------------------------------------------
@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    port: int  # the client's port: one port, one connection


@dataclass
class Exchange:
    """What an answer function gets: the request, the connection's writer and reader (to see
    the client go: :meth:`client_gone`)."""

    request: Request
    writer: asyncio.StreamWriter
    reader: asyncio.StreamReader

    def client_gone(self) -> bool:
        """Whether the client closed the connection: its FIN read (``at_eof``), or its reset.
        A client that closes with bytes of ours still unread resets the connection instead
        (the kernel's rule), which a loaded client, reading late, does: asyncio then sets the
        reader's exception and never its EOF (found under ``--stress``)."""
        reader = self.reader
        return reader.at_eof() or reader.exception() is not None or self.writer.is_closing()

    async def until_the_client_goes(self) -> None:
        """Answer nothing more until the client closes the connection (then, as a server
        writing to it would: ``ConnectionResetError``)."""
        while not self.client_gone():
            await asyncio.sleep(0.01)
        raise ConnectionResetError("the client went away")

    async def write(self, *parts: bytes, pause: float = 0.005) -> None:
        """Write ``parts`` one at a time, each in its own read on the client's side (a pause
        after each: the client's loop reads it before the next is written)."""
        for part in parts:
            self.writer.write(part)
            await self.writer.drain()
            await asyncio.sleep(pause)


#: writes the answer; returns False to close the connection after it
Answer = Callable[[Exchange], Awaitable[bool]]


@dataclass
class RawServer:
    """HTTP/1.1 requests read on a real socket in this loop, answered by ``answer``."""

    answer: Answer
    connections: int = 0
    requests: list[Request] = field(default_factory=list)
    #: connections whose client closed them (EOF seen by the server)
    client_closed: int = 0
    server: asyncio.Server | None = None
    url: str = ""
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        port = writer.get_extra_info("peername")[1]
        task = asyncio.current_task()
        assert task is not None
        self.tasks.append(task)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    self.client_closed += 1
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if line:
                        name, _, value = line.partition(":")
                        headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                request = Request(method, path, headers, body, port)
                self.requests.append(request)
                if not await self.answer(Exchange(request, writer, reader)):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            self.client_closed += 1
        except asyncio.CancelledError:
            pass  # the test is over
        finally:
            writer.close()

    async def wait_client_closed(self, count: int = 1, within: float = 5.0) -> None:
        deadline = asyncio.get_running_loop().time() + within
        while self.client_closed < count:
            assert asyncio.get_running_loop().time() < deadline, "the client kept it open"
            await asyncio.sleep(0.01)


def head(status: int = 200, *headers: str, reason: str = "") -> bytes:
    lines = [
        f"HTTP/1.1 {status} {reason or {200: 'OK', 500: 'Internal Server Error'}.get(status, 'X')}"
    ]
    return ("\r\n".join([*lines, *headers]) + "\r\n\r\n").encode()


def json_answer(value: Any, status: int = 200) -> bytes:
    body = json.dumps(value).encode()
    return head(status, "content-type: application/json", f"content-length: {len(body)}") + body


def sse(events: Sequence[dict[str, Any]]) -> bytes:
    out = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return out + b"data: [DONE]\n\n"


def chunked(body: bytes, sizes: Sequence[int]) -> bytes:
    """``body`` in HTTP chunks of ``sizes`` (cycled), then the last chunk."""
    out, i, k = [], 0, 0
    while i < len(body):
        n = min(sizes[k % len(sizes)], len(body) - i)
        out.append(f"{n:x}\r\n".encode() + body[i : i + n] + b"\r\n")
        i, k = i + n, k + 1
    return b"".join(out) + b"0\r\n\r\n"


SSE_HEAD = head(200, "content-type: text/event-stream", "transfer-encoding: chunked")
EVENTS = [{"n": i, "text": "tok\u00e9n " * (i + 1)} for i in range(6)]


async def ok(x: Exchange) -> bool:
    x.writer.write(json_answer({"ok": x.request.path}))
    return True


async def read_events(http: AsyncHttp, url: str, path: str = "/s", **kw: Any) -> list[Any]:
    async with http.events(url, path, {}, timeout=kw.pop("timeout", 5), **kw) as ev:
        return [e async for e in ev]


# ---- keep-alive ------------------------------------------------------------------------------
@pytest.mark.parametrize("loop", LOOPS)
def test_sequential_requests_reuse_one_connection(loop: str) -> None:
    async def answer(x: Exchange) -> bool:
        if x.request.path == "/s":
            x.writer.write(SSE_HEAD + chunked(sse(EVENTS), [40]))
        else:
            await ok(x)
        return True

    async def main() -> RawServer:
        async with RawServer(answer) as server, AsyncHttp() as http:
            for i in range(5):
                got = await http.request(
                    "POST", server.url, f"/r{i}", json_body={"i": i}, timeout=5
                )
                assert got == {"ok": f"/r{i}"}
            assert await read_events(http, server.url) == EVENTS
            assert await http.request("GET", server.url, "/health", timeout=5) == {"ok": "/health"}
            assert http.pool.open_connections == 1 and http.pool.idle_connections == 1
        return server

    server = run(main(), loop)
    assert server.connections == 1 and len({r.port for r in server.requests}) == 1
    assert [r.method for r in server.requests] == ["POST"] * 6 + ["GET"]
    assert json.loads(server.requests[0].body) == {"i": 0}
    assert server.requests[0].headers["content-type"] == "application/json"
    assert server.requests[0].headers["host"] == server.url.removeprefix("http://")


@pytest.mark.parametrize("loop", LOOPS)
def test_a_connection_the_server_closed_while_idle_is_not_used_again(loop: str) -> None:
    """The server answers keep-alive, then closes the idle connection: the next generate (sent
    once, no retries) goes out on a fresh connection, and reaches the server once."""

    async def answer(x: Exchange) -> bool:
        await ok(x)
        await x.writer.drain()
        return False  # closed after the answer, which said nothing about it

    async def main() -> RawServer:
        async with RawServer(answer) as server, AsyncHttp() as http:
            for _ in range(3):
                got = await http.request(
                    "POST", server.url, "/generate", json_body={}, timeout=5, retry=NO_RETRY
                )
                assert got == {"ok": "/generate"}
                for _ in range(500):  # the client sees the close
                    if http.pool.open_connections == 0:
                        break
                    await asyncio.sleep(0.01)
                assert http.pool.open_connections == 0
        return server

    server = run(main(), loop)
    assert server.connections == 3 and len(server.requests) == 3  # nothing resent


def test_a_connection_closed_as_it_leaves_the_pool_is_never_written_to() -> None:
    """The window the loop has not run in yet: the pooled connection's transport is closing when
    the request takes it. The request goes out once, on a fresh connection."""

    async def main() -> RawServer:
        async with RawServer(ok) as server, AsyncHttp() as http:
            await http.request("GET", server.url, "/a", timeout=5)
            (conn,) = [c for conns in http.pool._idle.values() for c in conns]
            assert conn.transport is not None
            conn.transport.close()  # closing now, its connection_lost not run yet
            got = await http.request("POST", server.url, "/b", json_body={}, timeout=5)
            assert got == {"ok": "/b"}
        return server

    server = run(main())
    assert server.connections == 2 and [r.path for r in server.requests] == ["/a", "/b"]


def _keepalive_server_closing_on(
    close_now: threading.Event, closed: threading.Event
) -> tuple[socket.socket, list[str]]:
    """A blocking HTTP/1.1 server on its own thread: each connection answers its requests
    keep-alive; once ``close_now`` is set it closes the connection it holds idle (as uvicorn
    does after its keep-alive time, 5 s in SGLang and vLLM) and sets ``closed``. Returns the
    listening socket and the paths it answered."""
    listener = socket.create_server(("127.0.0.1", 0))
    answered: list[str] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(0.05)
                buf = b""
                while True:
                    try:
                        data = conn.recv(65536)
                    except TimeoutError:
                        if close_now.is_set() and not buf:
                            closed.set()
                            break  # idle: closed, as a keep-alive time does
                        continue
                    if not data:
                        break
                    buf += data
                    while b"\r\n\r\n" in buf:
                        head, _, rest = buf.partition(b"\r\n\r\n")
                        length = 0
                        for line in head.split(b"\r\n")[1:]:
                            name, _, value = line.partition(b":")
                            if name.strip().lower() == b"content-length":
                                length = int(value)
                        if len(rest) < length:
                            break
                        path = head.split(b" ")[1].decode()
                        buf = rest[length:]
                        answered.append(path)
                        body = json.dumps({"ok": path}).encode()
                        conn.sendall(
                            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                            + f"content-length: {len(body)}\r\n\r\n".encode()
                            + body
                        )

    threading.Thread(target=serve, daemon=True).start()
    return listener, answered


@pytest.mark.parametrize("loop", LOOPS)
def test_a_connection_closed_while_the_loop_did_not_run_is_not_written_to(loop: str) -> None:
    """The race a real engine's 5 s keep-alive time opens: the server closes an idle pooled
    connection and its FIN is in this host's socket, but the loop has not run since, so the
    connection is not known closed when the next request takes it. Written to, the request is
    lost ("the server closed the connection before answering": seen under load in the TRL test
    against real vLLM, whose training steps leave the pool idle about 5 s). The pool looks at
    the socket before it reuses a connection: the request goes out once, on a fresh one."""
    close_now, closed = threading.Event(), threading.Event()
    listener, answered = _keepalive_server_closing_on(close_now, closed)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"

    async def main() -> None:
        async with AsyncHttp() as http:
            assert await http.request("GET", url, "/a", timeout=5) == {"ok": "/a"}
            assert http.pool.open_connections == 1
            close_now.set()
            assert closed.wait(5.0)
            time.sleep(0.2)  # the FIN arrives; this loop does not run meanwhile
            got = await http.request("POST", url, "/b", json_body={}, timeout=5, retry=NO_RETRY)
            assert got == {"ok": "/b"}

    try:
        run(main(), loop)
    finally:
        listener.close()
    assert answered == ["/a", "/b"]


def test_engine_clients_close_idle_connections_before_the_engines_do() -> None:
    """SGLang 0.5.x and vLLM (uvicorn's ``timeout_keep_alive``: ``SGLANG_TIMEOUT_KEEP_ALIVE``,
    ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s) close an idle keep-alive connection after 5 s: the
    engine clients' pool closes its own sooner, so it never reuses one the engine is closing."""
    from rollsafe.adapters.engines.aio import ENGINE_KEEPALIVE_S

    assert 0 < ENGINE_KEEPALIVE_S < 5.0

    async def main() -> float:
        async with AsyncHttp() as http:
            return http.pool._keepalive

    assert run(main()) == ENGINE_KEEPALIVE_S


# ---- framing ---------------------------------------------------------------------------------
CHUNK_SIZES = [7, 40, 1, 13]


def _cuts(wire: bytes) -> list[int]:
    """Where to split the wire bytes of a chunked SSE answer (chunks of :data:`CHUNK_SIZES`):
    between the first chunk's trailing ``\\r`` and ``\\n``, inside the second chunk's size line
    (``28``), inside an event's JSON, between an event's two ``\\n``, inside ``data: [DONE]``,
    and inside the last chunk."""
    first = len(SSE_HEAD)
    trailer = first + len(b"7\r\n") + 7
    assert wire[trailer : trailer + 2] == b"\r\n"
    second = trailer + 2
    assert wire[second : second + 4] == b"28\r\n"
    cuts = {
        trailer + 1,  # "\r" | "\n"
        second + 1,  # "2" | "8\r\n"
        wire.index(b'"text"') + 3,  # inside an event's JSON
        wire.index(b"}\n\n") + 2,  # between an event's two \n
        wire.index(b"[DONE]") + 2,
        len(wire) - 3,  # inside "0\r\n\r\n"
    }
    return sorted(cuts)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("split", ["cuts", "every-byte", "sizes"])
def test_a_chunked_stream_split_anywhere_reads_the_same_events(loop: str, split: str) -> None:
    wire = SSE_HEAD + chunked(sse(EVENTS), CHUNK_SIZES)
    if split == "cuts":
        cuts = _cuts(wire)
        parts = [wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True)]
    elif split == "every-byte":
        parts = [wire[i : i + 1] for i in range(len(wire))]
    else:
        parts, i, sizes = [], 0, [3, 1, 17, 2, 29]
        while i < len(wire):
            n = sizes[len(parts) % len(sizes)]
            parts.append(wire[i : i + n])
            i += n

    async def answer(x: Exchange) -> bool:
        if x.request.path == "/s":
            await x.write(*parts, pause=0.0005 if split == "every-byte" else 0.005)
        else:
            await ok(x)
        return True

    async def main() -> RawServer:
        async with RawServer(answer) as server, AsyncHttp() as http:
            assert await read_events(http, server.url) == EVENTS
            assert await http.request("GET", server.url, "/after", timeout=5) == {"ok": "/after"}
        return server

    server = run(main(), loop)
    assert server.connections == 1  # read to its end: pooled, reused


@pytest.mark.parametrize("loop", LOOPS)
def test_content_length_and_end_of_connection_bodies(loop: str) -> None:
    body = sse(EVENTS)

    async def answer(x: Exchange) -> bool:
        if x.request.path == "/length":  # an SSE body by content-length, cut mid-event
            framed = head(200, f"content-length: {len(body)}") + body
            await x.write(framed[: len(framed) - 40], framed[len(framed) - 40 :])
            return True
        if x.request.path == "/eof":  # no length, not chunked: the body ends with the connection
            await x.write(head(200, "connection: close"), b'{"whole": ', b"true}")
            return False
        await ok(x)
        return True

    async def main() -> RawServer:
        async with RawServer(answer) as server, AsyncHttp() as http:
            assert await read_events(http, server.url, "/length") == EVENTS
            assert await http.request("GET", server.url, "/eof", timeout=5) == {"whole": True}
            assert await http.request("GET", server.url, "/x", timeout=5) == {"ok": "/x"}
        return server

    server = run(main(), loop)
    assert server.connections == 2  # the body read to the close took its connection with it


def test_a_stream_wakes_its_reader_once_per_read_not_once_per_event() -> None:
    """Fifty events that arrive in one read are one batch (one wake-up of the reader)."""
    events = [{"n": i} for i in range(50)]

    async def answer(x: Exchange) -> bool:
        await x.write(SSE_HEAD, chunked(sse(events), [30]))
        return True

    async def main() -> list[int]:
        async with RawServer(answer) as server, AsyncHttp() as http:
            async with http.events(server.url, "/s", {}, timeout=5) as ev:
                sizes = []
                while batch := await ev.batch():
                    sizes.append(len(batch))
            return sizes

    assert run(main()) == [50]


def test_informational_answers_head_and_bytes_nobody_asked_for() -> None:
    """A 103 before the answer is skipped; an answer to ``HEAD`` has no body (whatever its
    ``content-length``) and its connection is not reused; bytes after a whole answer close the
    connection (the answer stands)."""

    async def answer(x: Exchange) -> bool:
        if x.request.path == "/early-hints":
            await x.write(head(103, "link: </a>; rel=preload", reason="Early Hints"), b"")
            x.writer.write(json_answer({"after": 103}))
        elif x.request.method == "HEAD":
            x.writer.write(head(200, "content-length: 1000"))
        elif x.request.path == "/extra":
            x.writer.write(json_answer({"whole": True}) + b"HTTP/1.1 200 OK\r\n\r\n")
        else:
            await ok(x)
        return True

    async def main() -> RawServer:
        async with RawServer(answer) as server, AsyncHttp() as http:
            url = server.url
            assert await http.request("GET", url, "/early-hints", timeout=5) == {"after": 103}
            response = await http.pool.send("HEAD", url, "/h", timeout=5)
            assert response.status == 200 and response.header("Content-Length") == "1000"
            assert await response.read() == b"" and response.at_eof
            response.release()
            assert await http.request("GET", url, "/extra", timeout=5) == {"whole": True}
            assert await http.request("GET", url, "/last", timeout=5) == {"ok": "/last"}
        return server

    server = run(main())
    ports = [r.port for r in server.requests]
    # /early-hints and HEAD share one; /extra a fresh one (HEAD's closed); /last a fresh one
    assert server.connections == 3 and ports[0] == ports[1] != ports[2] != ports[3]


# ---- failures --------------------------------------------------------------------------------
@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("framing", ["chunked", "length"])
def test_a_stream_cut_mid_body_is_unavailable_after_the_earlier_events(
    loop: str, framing: str
) -> None:
    body = sse(EVENTS)
    cut = body.index(b"data:", body.index(b'"n": 2'))  # events 0..2 whole, then half of 3
    cut += 12

    async def answer(x: Exchange) -> bool:
        if framing == "chunked":
            await x.write(SSE_HEAD, chunked(body[:cut], [25])[: -len(b"0\r\n\r\n")])
        else:
            await x.write(head(200, f"content-length: {len(body)}"), body[:cut])
        return False  # the engine died: the connection closes mid-body

    async def main() -> tuple[list[Any], EngineUnavailable]:
        got: list[Any] = []
        async with RawServer(answer) as server, AsyncHttp() as http:
            with pytest.raises(EngineUnavailable) as info:
                async with http.events(server.url, "/s", {}, timeout=5) as ev:
                    async for event in ev:
                        got.append(event)
            assert http.pool.open_connections == 0
        return got, info.value

    got, exc = run(main(), loop)
    assert got == EVENTS[:3]  # every event before the cut, in order
    assert not isinstance(exc, EngineTimeout) and exc.request_sent is None
    assert "stream broke" in exc.reason or "before data: [DONE]" in exc.reason


def test_a_whole_answer_cut_mid_body_is_unavailable_and_not_resent() -> None:
    async def answer(x: Exchange) -> bool:
        await x.write(head(200, "content-length: 100"), b'{"partial": ')
        return False

    async def main() -> RawServer:
        async with RawServer(answer) as server, AsyncHttp() as http:
            with pytest.raises(EngineUnavailable) as info:
                await http.request("POST", server.url, "/generate", json_body={}, timeout=5)
            assert info.value.request_sent is None and not isinstance(info.value, EngineTimeout)
        return server

    server = run(main())
    assert len(server.requests) == 1


@pytest.mark.parametrize("loop", LOOPS)
def test_no_byte_within_the_timeout_is_engine_timeout(loop: str) -> None:
    async def answer(x: Exchange) -> bool:
        path = x.request.path
        if path == "/no-head":
            await x.until_the_client_goes()
        elif path == "/stalled-body":
            await x.write(head(200, "content-length: 100"), b"{")
            await x.until_the_client_goes()
        elif path == "/stalled-stream":
            await x.write(
                SSE_HEAD, chunked(sse(EVENTS[:2])[: -len(b"data: [DONE]\n\n")], [64])[:-5]
            )
            await x.until_the_client_goes()
        elif path == "/slow-stream":  # a byte every 0.1 s, the timeout 0.3 s: never timed out
            wire = chunked(sse(EVENTS), [16])
            await x.write(SSE_HEAD, *[wire[i : i + 16] for i in range(0, len(wire), 16)], pause=0.1)
        return True

    async def main() -> RawServer:
        async with RawServer(answer) as server, AsyncHttp() as http:
            url = server.url
            with pytest.raises(EngineTimeout, match=r"no answer within 0\.2s") as info:
                await http.request("POST", url, "/no-head", json_body={}, timeout=0.2)
            assert info.value.request_sent is None
            with pytest.raises(EngineTimeout, match=r"body not read within 0\.2s"):
                await http.request("GET", url, "/stalled-body", timeout=0.2)
            got: list[Any] = []
            with pytest.raises(EngineTimeout, match=r"no event within 0\.2s"):
                async with http.events(url, "/stalled-stream", {}, timeout=0.2) as ev:
                    async for event in ev:
                        got.append(event)
            assert got == EVENTS[:2]
            assert await read_events(http, url, "/slow-stream", timeout=0.3) == EVENTS
            await server.wait_client_closed(3)  # each timed-out connection closed, not pooled
        return server

    server = run(main(), loop)
    assert server.connections == 4


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("how", ["aclose", "cancel", "break"])
def test_a_stream_stopped_early_closes_its_connection(loop: str, how: str) -> None:
    """The engine sees the disconnect (here: the server reads the end of the connection) while
    it is still streaming; the next request opens a fresh connection."""

    async def answer(x: Exchange) -> bool:
        if x.request.path == "/generate" and b"stream" in x.request.body:
            x.writer.write(SSE_HEAD)
            for i in range(1, 2000):
                event = {"output_ids": list(range(i)), "meta_info": {"finish_reason": None}}
                data = b"data: " + json.dumps(event).encode() + b"\n\n"
                x.writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                await asyncio.sleep(0.01)
                if x.client_gone():
                    raise ConnectionResetError("the client went away")
            raise AssertionError("the client never closed the stream")
        await ok(x)
        return True

    async def main() -> RawServer:
        async with RawServer(answer) as server, AsyncHttp() as http:
            engine = async_engine(SGLangClient(server.url, server_version="0.5.23"), http)
            started = asyncio.Event()

            async def consume() -> None:
                stream = engine.generate_stream([1])
                async for delta in stream:
                    assert delta.token_ids
                    started.set()
                    if how == "aclose":
                        await stream.aclose()  # type: ignore[attr-defined]
                        return
                    if how == "break":
                        break
                del stream

            task = asyncio.create_task(consume())
            await started.wait()
            if how == "cancel":
                task.cancel()
            with pytest.raises(asyncio.CancelledError) if how == "cancel" else _nothing():
                await task
            await server.wait_client_closed(1)
            assert http.pool.open_connections == 0
            assert await http.request("GET", server.url, "/health", timeout=5) == {"ok": "/health"}
        return server

    server = run(main(), loop)
    assert server.connections == 2


def test_the_raw_server_sees_a_client_that_closes_with_bytes_unread() -> None:
    """The harness itself: a client that closes while bytes of the server's are still unread
    resets the connection (no FIN), as a loaded client reading late does; the server still
    sees it go (seen under ``--stress``: the stream tests above waited for an EOF that never
    came, and failed with "the client kept it open")."""

    async def answer(x: Exchange) -> bool:
        for _ in range(1000):
            x.writer.write(b"x" * 512)
            await asyncio.sleep(0.01)
            if x.client_gone():
                raise ConnectionResetError("the client went away")
        raise AssertionError("the client never closed")

    async def main() -> None:
        async with RawServer(answer) as server:
            port = int(server.url.rsplit(":", 1)[1])
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(b"GET /stream HTTP/1.1\r\nhost: t\r\n\r\n")
            await asyncio.sleep(0.2)  # the server's bytes arrive; nothing reads them
            sock.close()  # unread bytes: the kernel resets the connection
            await server.wait_client_closed(1)

    run(main(), "asyncio")


class _nothing:
    """A context manager that expects nothing."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("loop", LOOPS)
def test_a_5xx_connection_is_not_reused_a_4xx_one_is(loop: str) -> None:
    async def answer(x: Exchange) -> bool:
        path = x.request.path
        if path.startswith("/fail"):
            x.writer.write(json_answer({"error": "reload failed"}, 500))
        elif path.startswith("/bad"):
            x.writer.write(json_answer({"message": "no such key"}, 400))
        elif path == "/s":
            x.writer.write(SSE_HEAD + chunked(sse(EVENTS), [50]))
        else:
            await ok(x)
        return True

    async def main() -> RawServer:
        async with RawServer(answer) as server, AsyncHttp() as http:
            url = server.url
            with pytest.raises(EngineRequestError) as info:
                await http.request("POST", url, "/fail", json_body={}, timeout=5)
            assert info.value.status_code == 500 and info.value.message == "reload failed"
            assert await http.request("GET", url, "/a", timeout=5) == {"ok": "/a"}
            with pytest.raises(EngineRequestError) as info:
                await http.request("POST", url, "/bad", json_body={}, timeout=5)
            assert info.value.status_code == 400 and info.value.message == "no such key"
            assert await http.request("GET", url, "/b", timeout=5) == {"ok": "/b"}
            with pytest.raises(EngineRequestError, match="reload failed"):
                await read_events(http, url, "/fail-stream")
            assert await read_events(http, url) == EVENTS
        return server

    server = run(main(), loop)
    ports = [r.port for r in server.requests]
    # /fail | /a /bad /b /fail-stream | /s: a fresh connection after each 500, none after the 400
    assert server.connections == 3
    assert ports[1] == ports[2] == ports[3] == ports[4] != ports[0] and ports[5] != ports[4]


def test_a_connection_refused_is_unavailable_and_not_sent() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: refused

        async def main() -> None:
            async with AsyncHttp() as http:
                with pytest.raises(EngineUnavailable) as info:
                    await http.request("POST", url, "/generate", json_body={}, timeout=5)
                assert info.value.request_sent is False
                assert "ConnectionRefusedError" in info.value.reason

        run(main())


def test_bad_request_heads_are_refused_before_anything_is_sent() -> None:
    async def main() -> RawServer:
        async with RawServer(ok) as server, AsyncHttp() as http:
            bad: list[tuple[str, dict[str, str] | None]] = [
                ("/a", {"X-Key": "a\r\nX-Smuggled: 1"}),  # a header smuggled into a value
                ("/a", {"Bad Name": "v"}),
                ("/a b", None),
            ]
            for path, headers in bad:
                with pytest.raises(InvalidArgument):
                    await http.request("GET", server.url, path, headers=headers, timeout=5)
            for url in ("ftp://127.0.0.1:1", "http://127.0.0.1:1?q=1", "http://:80"):
                with pytest.raises(InvalidArgument) as info:
                    await http.request("GET", url, "/a", timeout=5)
                assert info.value.key == "url"
        return server

    server = run(main())
    assert server.requests == []


# ---- the pool --------------------------------------------------------------------------------
def test_limit_per_host_waits_for_a_free_connection_up_to_the_timeout() -> None:
    release = asyncio.Event()

    async def answer(x: Exchange) -> bool:
        if x.request.path == "/slow":
            await release.wait()
        await ok(x)
        return True

    async def main() -> RawServer:
        async with RawServer(answer) as server, AsyncHttp(limit_per_host=1) as http:
            url = server.url
            slow = asyncio.create_task(http.request("GET", url, "/slow", timeout=5))
            await asyncio.sleep(0.05)
            with pytest.raises(EngineTimeout, match="no free connection") as info:
                await http.request("POST", url, "/generate", json_body={}, timeout=0.1)
            assert info.value.request_sent is False
            waiting = asyncio.create_task(http.request("GET", url, "/next", timeout=5))
            await asyncio.sleep(0.05)
            release.set()
            assert await slow == {"ok": "/slow"} and await waiting == {"ok": "/next"}
        return server

    server = run(main())
    assert server.connections == 1 and [r.path for r in server.requests] == ["/slow", "/next"]


def test_a_total_limit_closes_an_idle_connection_to_another_engine() -> None:
    async def main() -> tuple[RawServer, RawServer]:
        async with RawServer(ok) as a, RawServer(ok) as b, AsyncHttp(limit=1) as http:
            await http.request("GET", a.url, "/1", timeout=5)
            await http.request("GET", b.url, "/2", timeout=5)  # room made: a's idle one closed
            await a.wait_client_closed(1)
            assert http.pool.open_connections == 1
        return a, b

    a, b = run(main())
    assert a.connections == b.connections == 1


def test_an_idle_connection_is_closed_after_the_keepalive_timeout() -> None:
    async def main() -> RawServer:
        async with RawServer(ok) as server, AsyncHttp(keepalive_timeout=0.1) as http:
            await http.request("GET", server.url, "/a", timeout=5)
            assert http.pool.idle_connections == 1
            await server.wait_client_closed(1)
            assert http.pool.open_connections == 0
            await http.request("GET", server.url, "/b", timeout=5)
        return server

    assert run(main()).connections == 2


@pytest.mark.parametrize("loop", LOOPS)
def test_close_ends_every_connection_and_the_streams_on_them(loop: str) -> None:
    async def answer(x: Exchange) -> bool:
        if x.request.path == "/s":
            await x.write(SSE_HEAD, chunked(sse(EVENTS[:1])[:-14], [100])[:-5])
            await x.until_the_client_goes()
        await ok(x)
        return True

    async def main() -> RawServer:
        async with RawServer(answer) as server:
            http = AsyncHttp()
            await asyncio.gather(  # two connections: one stays idle while the other streams
                *(http.request("GET", server.url, f"/idle{i}", timeout=5) for i in range(2))
            )
            got: list[Any] = []

            async def stream() -> None:
                async with http.events(server.url, "/s", {}, timeout=5) as ev:
                    async for event in ev:
                        got.append(event)

            task = asyncio.create_task(stream())
            while not got:
                await asyncio.sleep(0.01)
            await http.close()
            with pytest.raises(EngineUnavailable, match="stream broke") as info:
                await task
            assert info.value.request_sent is None
            await server.wait_client_closed(2)  # the idle one and the stream's
            assert http.pool.open_connections == 0
            with pytest.raises(EngineUnavailable) as info:
                await http.request("GET", server.url, "/late", timeout=5)
            assert info.value.request_sent is False
        return server

    server = run(main(), loop)
    assert sorted(r.path for r in server.requests) == ["/idle0", "/idle1", "/s"]


def test_a_host_name_is_resolved_once_for_many_connections() -> None:
    async def main() -> tuple[RawServer, int]:
        loop = asyncio.get_running_loop()
        lookups = 0
        real = loop.getaddrinfo

        async def counting(*args: Any, **kw: Any) -> Any:
            nonlocal lookups
            lookups += 1
            return await real(*args, **kw)

        loop.getaddrinfo = counting  # type: ignore[method-assign]
        async with RawServer(ok) as server, AsyncHttp() as http:
            url = server.url.replace("127.0.0.1", "localhost")
            got = await asyncio.gather(
                *(http.request("GET", url, f"/{i}", timeout=5) for i in range(8))
            )
            assert got == [{"ok": f"/{i}"} for i in range(8)]
        return server, lookups

    server, lookups = run(main())
    assert server.connections == 8 and lookups == 1


def test_the_pool_alone_reports_what_was_sent() -> None:
    """The pool's own failures: ``sent`` says whether the request may have reached the
    server (no connection: False; a read timeout after writing it: True)."""

    async def silent(x: Exchange) -> bool:
        await asyncio.sleep(1)
        return False

    async def main() -> None:
        pool = ConnectionPool(asyncio.get_running_loop())
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            with pytest.raises(HttpFailure) as info:
                await pool.send("GET", f"http://127.0.0.1:{s.getsockname()[1]}", "/", timeout=1)
            assert info.value.sent is False and not isinstance(info.value, HttpTimeout)
        async with RawServer(silent) as server:
            with pytest.raises(HttpTimeout) as timed:
                await pool.send("GET", server.url, "/", timeout=0.1)
            assert timed.value.sent is True
        await pool.close()
        assert pool.open_connections == 0
        with pytest.raises(HttpFailure, match="closed") as info:
            await pool.send("GET", "http://127.0.0.1:1", "/", timeout=1)
        assert info.value.sent is False

    run(main())
