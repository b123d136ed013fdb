"""The gateway's HTTP/1.1 server (``rollsafe.gateway.http``) against real clients: httpx (sync
and async), requests, aiohttp, rollsafe's own SSE reader, and raw sockets for what no client
library sends (pipelining, torn bodies, malformed heads, HTTP/1.0, slow readers).

The server runs as the fleet will run it: on its own event loop thread (uvloop's, and plain
asyncio's for the protocol tests), the clients on the test's thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httptools
import httpx
import openai
import pytest
import requests
import uvloop

from rollsafe.adapters.engines.http import HttpTransport
from rollsafe.adapters.engines.streaming import read_events
from rollsafe.errors import InvalidArgument
from rollsafe.event_loop import new_event_loop
from rollsafe.gateway.http import (
    HttpServer,
    LastChunk,
    Request,
    Response,
    ServerLimits,
    StreamResponse,
)

CHUNK = 16 * 1024
ROOT = Path(__file__).resolve().parents[1]


class App:
    """The test handler: one route per behaviour, and what the routes saw."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.cancelled = threading.Event()
        self.stream_closed = threading.Event()
        self.stream_exit: str | None = None
        self.produced = 0
        self.gate: asyncio.Event | None = None
        self.at_gate = 0
        self.barrier_n = 0
        self.arrived = 0
        self.barrier: asyncio.Event | None = None
        self.requests: list[Request] = []

    async def __call__(self, req: Request) -> Response | StreamResponse:
        self.requests.append(req)
        route = getattr(self, "r_" + req.path.strip("/").replace("-", "_").split("/")[0], None)
        if route is None:
            return Response.json({"error": "no route"}, status=404)
        result: Response | StreamResponse = await route(req)
        return result

    async def r_echo(self, req: Request) -> Response:
        return Response.json(
            {
                "method": req.method,
                "path": req.path,
                "target": req.target,
                "query": dict(req.query),
                "headers": dict(req.headers),
                "body": req.body.decode("latin-1"),
                "version": req.http_version,
                "client": list(req.client) if req.client else None,
            },
            headers={"X-Route": "echo"},
        )

    async def r_sse(self, req: Request) -> StreamResponse:
        n = int(req.query.get("n", "3"))

        async def events() -> AsyncIterator[bytes]:
            yield b": a comment, ignored by readers\n\n"
            for i in range(n):
                text = "line\u2028sep" if i == 1 else f"token {i}"
                event = json.dumps({"i": i, "text": text}, ensure_ascii=False)
                yield f"data: {event}\n\n".encode()
                yield b""  # an empty chunk must not end the body
            yield b"data: [DONE]\n\n"

        return StreamResponse(events(), headers={"X-Group": "g0"})

    async def r_v1(self, req: Request) -> Response | StreamResponse:
        """``POST /v1/completions`` in OpenAI's shape: one choice, a token per event."""
        body = json.loads(req.body)
        words = ["Hello", ",", " wor\u2028ld", "\n\ndata: not an event"]

        def chunk(i: int) -> dict[str, Any]:
            finish = "length" if i == len(words) - 1 else None
            choice = {"index": 0, "text": words[i], "logprobs": None, "finish_reason": finish}
            return {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": 1,
                "model": body["model"],
                "choices": [choice],
            }

        if not body.get("stream"):
            whole = chunk(len(words) - 1)
            whole["choices"][0]["text"] = "".join(words)
            return Response.json(whole)

        async def events() -> AsyncIterator[bytes]:
            for i in range(len(words)):
                yield b"data: " + json.dumps(chunk(i)).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamResponse(events())

    async def r_boom(self, req: Request) -> Response:
        raise ValueError("x" * 5000)

    async def r_bad_return(self, req: Request) -> Response:
        return "not a response"  # type: ignore[return-value]

    async def r_bad_header(self, req: Request) -> Response:
        return Response(200, b"", {"x-bad": "a\r\nb"})

    async def r_self_cancel(self, req: Request) -> Response:
        raise asyncio.CancelledError()  # a handler's own cancellation, not the client's

    async def r_nobody(self, req: Request) -> Response:
        return Response(204, b"ignored")

    async def r_wait(self, req: Request) -> Response:
        self.started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return Response.json({})

    async def r_sleep(self, req: Request) -> Response:
        await asyncio.sleep(float(req.query["s"]))
        return Response.json({"slept": req.query["s"]})

    async def r_gate(self, req: Request) -> Response:
        if self.gate is None:
            self.gate = asyncio.Event()
        self.at_gate += 1
        await self.gate.wait()
        return Response.json({"through": True})

    async def r_barrier(self, req: Request) -> Response:
        if self.barrier is None:
            self.barrier = asyncio.Event()
        self.arrived += 1
        if self.arrived >= self.barrier_n:
            self.barrier.set()
        await self.barrier.wait()
        return Response.json({"arrived": self.arrived})

    async def r_stream_wait(self, req: Request) -> StreamResponse:
        async def events() -> AsyncIterator[bytes]:
            try:
                yield b"data: first\n\n"
                self.started.set()
                await asyncio.sleep(3600)
                yield b"data: never\n\n"
            except BaseException as exc:
                self.stream_exit = type(exc).__name__
                raise
            finally:
                self.stream_closed.set()

        return StreamResponse(events())

    async def r_flood(self, req: Request) -> StreamResponse:
        n = int(req.query["n"])

        async def chunks() -> AsyncIterator[bytes]:
            try:
                for _ in range(n):
                    self.produced += 1
                    yield b"z" * CHUNK
            finally:
                self.stream_closed.set()

        return StreamResponse(chunks(), content_type="application/octet-stream")

    async def r_last(self, req: Request) -> StreamResponse:
        """Two events, the second a :class:`LastChunk` with ``[DONE]``; never read past it."""

        async def events() -> AsyncIterator[bytes]:
            try:
                yield b"data: one\n\n"
                yield LastChunk(b"data: two\n\ndata: [DONE]\n\n")
                self.produced += 1  # never: the server stops at the last chunk
                yield b"data: never\n\n"
            finally:
                self.stream_closed.set()

        return StreamResponse(events())

    async def r_break_first(self, req: Request) -> StreamResponse:
        async def events() -> AsyncIterator[bytes]:
            raise RuntimeError("the producer broke before its first chunk")
            yield b""  # pragma: no cover - makes this an async generator

        return StreamResponse(events())

    async def r_stream_break(self, req: Request) -> StreamResponse:
        async def events() -> AsyncIterator[bytes]:
            yield b"data: one\n\n"
            raise RuntimeError("the producer broke")

        return StreamResponse(events())


class Served:
    """An :class:`HttpServer` on its own loop thread (as the fleet runs it)."""

    def __init__(self, app: App, limits: ServerLimits | None, loop_kind: str) -> None:
        self.app = app
        self.loop = uvloop.new_event_loop() if loop_kind == "uvloop" else asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = HttpServer(app, limits=limits)
        self.call(self.server.start())
        self.url = self.server.url
        self.port = self.server.port
        self.closed = False

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def on_loop(self, fn: Callable[[], Any]) -> Any:
        async def run() -> Any:
            return fn()

        return self.call(run())

    def stats(self) -> dict[str, Any]:
        return self.on_loop(self.server.stats.snapshot)  # type: ignore[no-any-return]

    def wait_for(self, what: Callable[[], bool], timeout: float = 10.0) -> None:
        end = time.monotonic() + timeout
        while not what():
            assert time.monotonic() < end, "condition not reached"
            time.sleep(0.01)

    def close(self, grace_s: float = 2.0) -> None:
        if not self.closed:
            self.closed = True
            self.call(self.server.close(grace_s))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(params=["uvloop", "asyncio"])
def loop_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def serve(loop_kind: str) -> Iterator[Callable[..., Served]]:
    made: list[Served] = []

    def start(limits: ServerLimits | None = None, app: App | None = None) -> Served:
        s = Served(app or App(), limits, loop_kind)
        made.append(s)
        return s

    yield start
    for s in made:
        s.close()


@pytest.fixture
def serve_uv() -> Iterator[Callable[..., Served]]:
    made: list[Served] = []

    def start(limits: ServerLimits | None = None, app: App | None = None) -> Served:
        s = Served(app or App(), limits, "uvloop")
        made.append(s)
        return s

    yield start
    for s in made:
        s.close()


# ---- raw sockets and a real response parser (httptools')


class Answer:
    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.parts: list[bytes] = []

    @property
    def body(self) -> bytes:
        return b"".join(self.parts)


class RawClient:
    """A socket and httptools' response parser: what arrives, answer by answer."""

    def __init__(self, port: int, rcvbuf: int | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(10)
        self.sock.connect(("127.0.0.1", port))
        self.parser = httptools.HttpResponseParser(self)
        self.done: list[Answer] = []
        self.current = Answer()
        self.eof = False

    def on_message_begin(self) -> None:
        self.current = Answer()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.current.headers[name.decode().lower()] = value.decode()

    def on_headers_complete(self) -> None:
        self.current.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.current.parts.append(body)

    def on_message_complete(self) -> None:
        self.done.append(self.current)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def answers(self, n: int) -> list[Answer]:
        while len(self.done) < n:
            data = self.sock.recv(65536)
            if not data:
                self.eof = True
                break
            self.parser.feed_data(data)
        got, self.done = self.done[:n], self.done[n:]
        assert len(got) == n, f"{len(got)} answers of {n}, then EOF"
        return got

    def answer(self) -> Answer:
        return self.answers(1)[0]

    def closed_by_server(self) -> bool:
        """True when the server closed the connection (EOF; nothing more arrives)."""
        try:
            rest = self.sock.recv(65536)
        except ConnectionResetError:
            return True
        assert rest == b"", f"unexpected bytes: {rest[:80]!r}"
        return True

    def read_until_eof(self) -> bytes:
        out = b""
        while True:
            data = self.sock.recv(65536)
            if not data:
                return out
            out += data

    def close(self) -> None:
        self.sock.close()


def get(path: str, extra: str = "", version: str = "1.1") -> bytes:
    return f"GET {path} HTTP/{version}\r\nHost: t\r\n{extra}\r\n".encode()


def post(path: str, body: bytes, extra: str = "") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


def error_of(answer: Answer) -> dict[str, Any]:
    assert answer.headers["content-type"] == "application/json"
    error: dict[str, Any] = json.loads(answer.body)["error"]
    assert error["code"] == answer.status
    return error


# ---- real clients


def test_httpx_sync_reuses_one_connection(serve: Callable[..., Served]) -> None:
    s = serve()
    with httpx.Client(base_url=s.url) as client:
        for i in range(5):
            r = client.post(f"/echo/a%20b?x={i}&y=&x2=v", content=b"body-%d" % i)
            assert r.status_code == 200
            got = r.json()
            assert got["method"] == "POST"
            assert got["path"] == "/echo/a b"
            assert got["query"] == {"x": str(i), "y": "", "x2": "v"}
            assert got["body"] == f"body-{i}"
            assert got["headers"]["content-length"] == str(len(f"body-{i}"))
            assert got["headers"]["host"] == f"127.0.0.1:{s.port}"
            assert got["client"][0] == "127.0.0.1"
            assert r.headers["x-route"] == "echo"
            assert "date" in r.headers
    stats = s.stats()
    assert stats["connections"] == 1
    assert stats["requests"] == {200: 5}
    assert stats["in_flight"] == 0


def test_requests_aiohttp_and_httpx_async(serve: Callable[..., Served]) -> None:
    s = serve()
    with requests.Session() as session:
        for _ in range(3):
            r = session.post(s.url + "/echo", json={"input_ids": [1, 2, 3]})
            assert r.status_code == 200
            assert json.loads(r.json()["body"]) == {"input_ids": [1, 2, 3]}
            assert r.json()["headers"]["content-type"] == "application/json"

    async def with_async_clients() -> None:
        async with aiohttp.ClientSession() as session:
            for _ in range(3):
                async with session.post(s.url + "/echo", json={"a": 1}) as answer:
                    assert answer.status == 200
                    assert json.loads((await answer.json())["body"]) == {"a": 1}
        async with httpx.AsyncClient(base_url=s.url) as client:
            for _ in range(3):
                r = await client.get("/echo?q=1")
                assert r.status_code == 200
                assert r.json()["query"] == {"q": "1"}

    asyncio.run(with_async_clients())
    stats = s.stats()
    assert stats["connections"] == 3  # one per client: keep-alive reused by each
    assert stats["requests"] == {200: 9}


def test_repeated_headers_are_joined_and_names_lowercased(serve: Callable[..., Served]) -> None:
    s = serve()
    raw = RawClient(s.port)
    raw.send(get("/echo", "X-Tag: a\r\nx-TAG: b\r\nX-Session-Id: s1\r\n"))
    got = json.loads(raw.answer().body)
    assert got["headers"]["x-tag"] == "a, b"
    assert got["headers"]["x-session-id"] == "s1"
    raw.close()


def test_pipelined_requests_are_answered_in_order(serve: Callable[..., Served]) -> None:
    s = serve()
    raw = RawClient(s.port)
    # the first sleeps longest: answers still come in request order
    raw.send(get("/sleep?s=0.2") + get("/sleep?s=0.05") + post("/echo", b"third") + get("/sse?n=2"))
    a, b, c, d = raw.answers(4)
    assert json.loads(a.body) == {"slept": "0.2"}
    assert json.loads(b.body) == {"slept": "0.05"}
    assert json.loads(c.body)["body"] == "third"
    assert d.headers["transfer-encoding"] == "chunked"
    assert d.body.count(b"data: ") == 3
    raw.send(get("/echo?after=1"))  # the connection is still good
    assert json.loads(raw.answer().body)["query"] == {"after": "1"}
    raw.close()
    assert s.stats()["connections"] == 1


def test_chunked_request_bodies(serve: Callable[..., Served]) -> None:
    s = serve()
    raw = RawClient(s.port)
    head = b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
    raw.send(head + b"5\r\nhello\r\n")
    raw.send(b"7;ext=1\r\n, world\r\n0\r\nX-Trailer: t\r\n\r\n")
    assert json.loads(raw.answer().body)["body"] == "hello, world"
    raw.close()

    def parts() -> Iterator[bytes]:
        yield b'{"input_ids": '
        yield b"[1, 2]}"

    with httpx.Client(base_url=s.url) as client:  # an iterator body: httpx sends it chunked
        r = client.post("/echo", content=parts())
        assert r.status_code == 200
        assert r.json()["headers"]["transfer-encoding"] == "chunked"
        assert json.loads(r.json()["body"]) == {"input_ids": [1, 2]}


def test_expect_100_continue(serve: Callable[..., Served]) -> None:
    s = serve(ServerLimits(max_body_bytes=1000))
    raw = RawClient(s.port)
    raw.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
    interim = raw.answer()
    assert interim.status == 100
    raw.send(b"hello")
    assert json.loads(raw.answer().body)["body"] == "hello"
    # too large: refused at once, no 100 Continue, the body never read
    raw.send(
        b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n"
    )
    refused = raw.answer()
    assert refused.status == 413
    assert error_of(refused)["param"] == "max_body_bytes"
    assert refused.headers["connection"] == "close"
    assert raw.closed_by_server()
    raw.close()


def test_expect_100_continue_waits_for_the_answer_before_it(serve: Callable[..., Served]) -> None:
    s = serve()
    raw = RawClient(s.port)
    raw.send(get("/sleep?s=0.2"))
    raw.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
    first, interim = raw.answers(2)  # the 100 never lands inside the first answer
    assert json.loads(first.body) == {"slept": "0.2"}
    assert interim.status == 100
    raw.send(b"ok")
    assert json.loads(raw.answer().body)["body"] == "ok"
    raw.close()


def test_http10_with_and_without_keepalive(serve: Callable[..., Served]) -> None:
    s = serve()
    raw = RawClient(s.port)
    raw.send(get("/echo", version="1.0"))
    a = raw.answer()
    assert json.loads(a.body)["version"] == "1.0"
    assert a.headers["connection"] == "close"
    assert raw.closed_by_server()
    raw.close()

    raw = RawClient(s.port)
    raw.send(get("/echo", "Connection: keep-alive\r\n", version="1.0"))
    a = raw.answer()
    assert a.headers["connection"] == "keep-alive"
    assert json.loads(a.body)["version"] == "1.0"
    raw.send(get("/echo", "Proxy-Connection: keep-alive\r\n", version="1.0"))
    a = raw.answer()  # llhttp reads proxy-connection as connection
    assert a.headers["connection"] == "keep-alive"
    assert json.loads(a.body)["version"] == "1.0"
    raw.send(get("/echo?two=1", "Connection: keep-alive\r\n", version="1.0"))
    assert json.loads(raw.answer().body)["query"] == {"two": "1"}
    # a stream to HTTP/1.0: no chunked encoding; the body ends with the connection
    raw.send(get("/sse?n=2", "Connection: keep-alive\r\n", version="1.0"))
    data = raw.read_until_eof()
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head.lower()
    assert b"connection: close" in head.lower()
    assert body.endswith(b"data: [DONE]\n\n")
    raw.close()


def test_connection_close_is_honoured(serve: Callable[..., Served]) -> None:
    s = serve()
    raw = RawClient(s.port)
    raw.send(get("/echo", "Connection: close\r\n") + get("/echo?ignored=1"))
    a = raw.answer()
    assert a.status == 200
    assert a.headers["connection"] == "close"
    assert raw.closed_by_server()  # the request after it is not answered
    raw.close()
    assert s.stats()["requests"] == {200: 1}


def test_head_sends_no_body(serve: Callable[..., Served]) -> None:
    s = serve()
    raw = RawClient(s.port)
    raw.send(b"HEAD /echo HTTP/1.1\r\nHost: t\r\n\r\n" + get("/echo?next=1"))
    data = b""
    while data.count(b"HTTP/1.1 200") < 2 or not data.endswith(b"}"):
        data += raw.sock.recv(65536)
    first, _, rest = data.partition(b"\r\n\r\n")
    assert b"content-length: " in first  # the length the body would have
    assert rest.startswith(b"HTTP/1.1 200 OK\r\n")  # no body bytes between the two heads
    raw.close()
    with httpx.Client(base_url=s.url) as client:
        r = client.head("/sse?n=5")
        assert r.status_code == 200 and r.content == b""
        assert r.headers["content-type"] == "text/event-stream"
        r = client.get("/echo")
        assert r.status_code == 200


def test_204_has_no_body(serve: Callable[..., Served]) -> None:
    s = serve()
    with httpx.Client(base_url=s.url) as client:
        r = client.get("/nobody")
        assert r.status_code == 204 and r.content == b""
        assert "content-length" not in r.headers
        assert client.get("/echo").status_code == 200


# ---- streams


def test_sse_read_by_rollsafe_engine_client(serve: Callable[..., Served]) -> None:
    s = serve()
    transport = HttpTransport(s.url)
    try:
        events = list(read_events(transport, "/sse?n=4", {"stream": True}, timeout=10))
    finally:
        transport.close()
    assert [e["i"] for e in events] == [0, 1, 2, 3]
    assert events[1]["text"] == "line\u2028sep"  # U+2028 inside an event does not split it


def test_openai_sdk_reads_answers_and_streams(serve: Callable[..., Served]) -> None:
    s = serve()
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
    whole = client.completions.create(model="m", prompt="p", max_tokens=4)
    assert whole.choices[0].text == "Hello, wor\u2028ld\n\ndata: not an event"
    stream = client.completions.create(model="m", prompt="p", max_tokens=4, stream=True)
    texts = [c.choices[0].text for c in stream]
    assert texts == ["Hello", ",", " wor\u2028ld", "\n\ndata: not an event"]
    client.close()

    async def with_async_client() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        stream = await aclient.completions.create(model="m", prompt="p", stream=True)
        got = [c.choices[0].text async for c in stream]
        await aclient.close()
        return got

    assert asyncio.run(with_async_client()) == texts


def test_sse_headers_and_framing_with_aiohttp(serve: Callable[..., Served]) -> None:
    s = serve()

    async def read() -> tuple[dict[str, str], list[str]]:
        async with aiohttp.ClientSession() as session, session.get(s.url + "/sse?n=3") as r:
            headers = {k.lower(): v for k, v in r.headers.items()}
            lines = [line.decode().rstrip("\n") async for line in r.content]
            return headers, lines

    headers, lines = asyncio.run(read())
    assert headers["content-type"] == "text/event-stream"
    assert headers["cache-control"] == "no-cache"
    assert headers["x-accel-buffering"] == "no"
    assert headers["transfer-encoding"] == "chunked"
    assert headers["x-group"] == "g0"
    data = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert [json.loads(d)["i"] for d in data[:-1]] == [0, 1, 2]


def test_stream_that_breaks_is_cut_not_ended(serve: Callable[..., Served]) -> None:
    s = serve()
    with httpx.Client(base_url=s.url) as client:
        with pytest.raises(httpx.RemoteProtocolError), client.stream("GET", "/stream-break") as r:
            assert r.status_code == 200
            for _ in r.iter_bytes():
                pass
        assert client.get("/echo").status_code == 200  # the server goes on
    s.wait_for(lambda: s.stats()["handler_errors"] == 1)


def _count_writes(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every write the server's connections make, in order."""
    import rollsafe.gateway.http as http_module

    writes: list[bytes] = []
    write = http_module._Connection.write

    def counted(self: Any, data: bytes) -> None:
        writes.append(bytes(data))
        write(self, data)

    monkeypatch.setattr(http_module._Connection, "write", counted)
    return writes


def test_a_stream_is_written_head_with_first_chunk_and_end_with_last(
    serve: Callable[..., Served], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The head goes out with the first chunk and a LastChunk with the body's end, one write
    each; nothing is read from the producer after its last chunk, its ``finally`` runs, and
    the connection stays open."""
    app = App()
    s = serve(app=app)
    writes = _count_writes(monkeypatch)
    raw = RawClient(s.port)
    raw.send(get("/last"))
    answer = raw.answer()
    assert answer.status == 200 and answer.body == b"data: one\n\ndata: two\n\ndata: [DONE]\n\n"
    assert len(writes) == 2
    assert writes[0].startswith(b"HTTP/1.1 200 OK\r\n") and writes[0].endswith(b"data: one\n\n\r\n")
    assert writes[1].endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    assert app.stream_closed.wait(10) and app.produced == 0
    raw.send(get("/sse?n=2"))  # the same connection; a stream without a LastChunk
    assert raw.answer().body.endswith(b"data: [DONE]\n\n")
    assert writes[2].startswith(b"HTTP/1.1 200 OK\r\n") and b": a comment" in writes[2]
    assert writes[-1] == b"0\r\n\r\n" and len(writes) == 2 + 5  # head+comment, 2, DONE, end
    raw.close()


def test_a_stream_that_breaks_before_its_first_chunk_sends_its_head_then_cuts(
    serve: Callable[..., Served],
) -> None:
    s = serve()
    raw = RawClient(s.port)
    raw.send(get("/break-first"))
    data = raw.read_until_eof()
    assert data.startswith(b"HTTP/1.1 200 OK\r\n") and b"transfer-encoding: chunked" in data
    assert not data.endswith(b"0\r\n\r\n")  # no end of body: the client sees it cut
    raw.close()
    s.wait_for(lambda: s.stats()["handler_errors"] == 1)


def test_slow_reader_pauses_the_producer(serve_uv: Callable[..., Served]) -> None:
    s = serve_uv(ServerLimits(write_buffer_bytes=64 * 1024))
    total = 2048  # 32 MiB offered
    raw = RawClient(s.port, rcvbuf=32 * 1024)
    raw.send(get(f"/flood?n={total}"))
    # the client reads nothing: the producer stops once the buffers are full
    last, steady = -1, 0
    while steady < 5:
        time.sleep(0.1)
        now = s.on_loop(lambda: s.app.produced)
        steady = steady + 1 if now == last else 0
        last = now
    # a 64 KiB transport buffer, the kernel's send buffer (4 MiB at most here) and the
    # client's receive buffer: far below what was offered
    assert last * CHUNK < 8 * 1024 * 1024, last
    assert last < total
    assert not s.app.stream_closed.is_set()
    # reading now: everything arrives, in order, and the producer ends
    got = raw.answer()
    assert len(got.body) == total * CHUNK
    assert s.app.produced == total
    assert s.app.stream_closed.wait(5)
    raw.close()


def test_a_reader_that_takes_nothing_is_cut(serve_uv: Callable[..., Served]) -> None:
    s = serve_uv(ServerLimits(write_stall_timeout_s=0.3))
    raw = RawClient(s.port, rcvbuf=32 * 1024)
    raw.send(get("/flood?n=2048"))
    assert s.app.stream_closed.wait(10)  # the producer was closed, not run to its end
    assert s.app.produced < 2048
    s.wait_for(lambda: s.stats()["open_connections"] == 0)
    stats = s.stats()
    assert stats["rejected"] == {"write_stall_timeout_s": 1}
    assert stats["disconnects"] == 1
    assert stats["in_flight"] == 0
    raw.close()


def test_deep_pipelines_are_read_in_turn(serve: Callable[..., Served]) -> None:
    s = serve(ServerLimits(max_pipelined=4))
    raw = RawClient(s.port)
    for i in range(40):  # separate sends: the server stops and resumes reading between them
        raw.send(get(f"/sleep?s=0.001&i={i}"))
    answers = raw.answers(40)
    assert [a.status for a in answers] == [200] * 40
    assert [r.query["i"] for r in s.app.requests] == [str(i) for i in range(40)]
    raw.close()


# ---- failures


def test_handler_exception_is_500_and_the_server_goes_on(
    serve: Callable[..., Served], caplog: pytest.LogCaptureFixture
) -> None:
    s = serve()
    with (
        caplog.at_level(logging.ERROR, logger="rollsafe.gateway.http"),
        httpx.Client(base_url=s.url) as client,
    ):
        r = client.get("/boom")
        assert r.status_code == 500
        error = r.json()["error"]
        assert error["message"].startswith("ValueError: xxx")
        assert len(error["message"]) <= 500
        assert error["type"] == "internal_error"
        r = client.get("/bad-return")
        assert r.status_code == 500
        assert "TypeError" in r.json()["error"]["message"]
        r = client.get("/bad-header")
        assert r.status_code == 500
        assert "InvalidArgument" in r.json()["error"]["message"]
        r = client.get("/self-cancel")
        assert r.status_code == 500
        assert "CancelledError" in r.json()["error"]["message"]
        r = client.get("/echo")  # same connection, next request
        assert r.status_code == 200
    assert s.stats()["connections"] == 1
    assert s.stats()["handler_errors"] == 4
    assert sum("gateway handler failed" in rec.getMessage() for rec in caplog.records) == 4
    assert any(rec.exc_info and rec.exc_info[0] is ValueError for rec in caplog.records)


def test_disconnect_cancels_the_handler(serve: Callable[..., Served]) -> None:
    s = serve()
    raw = RawClient(s.port)
    raw.send(get("/wait"))
    assert s.app.started.wait(5)
    assert s.stats()["in_flight"] == 1
    raw.close()
    assert s.app.cancelled.wait(5)  # the handler saw CancelledError
    s.wait_for(lambda: s.stats()["in_flight"] == 0)
    stats = s.stats()
    assert stats["disconnects"] == 1
    assert stats["open_connections"] == 0
    assert stats["requests"] == {}


def test_disconnect_closes_a_streams_iterator(serve: Callable[..., Served]) -> None:
    s = serve()

    async def read_first_then_leave() -> bytes:
        async with aiohttp.ClientSession() as session:
            r = await session.get(s.url + "/stream-wait")
            line = await r.content.readline()
            r.close()  # drops the connection mid-stream
            return line

    assert asyncio.run(read_first_then_leave()) == b"data: first\n"
    assert s.app.stream_closed.wait(5)
    assert s.app.stream_exit in ("CancelledError", "GeneratorExit")
    s.wait_for(lambda: s.stats()["disconnects"] == 1 and s.stats()["in_flight"] == 0)


# ---- limits


def test_body_over_max_body_bytes_is_413(serve: Callable[..., Served]) -> None:
    s = serve(ServerLimits(max_body_bytes=1024))
    # requests sends the whole body without Expect: it still gets the 413, not a reset
    r = requests.post(s.url + "/echo", data=b"x" * 200_000)
    assert r.status_code == 413
    assert r.json()["error"]["param"] == "max_body_bytes"
    assert "max_body_bytes=1024" in r.json()["error"]["message"]
    assert r.headers["connection"] == "close"
    # chunked: refused when the sum passes the limit
    raw = RawClient(s.port)
    raw.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
    raw.send(b"400\r\n" + b"y" * 1024 + b"\r\n" + b"1\r\ny\r\n")
    a = raw.answer()
    assert a.status == 413
    assert error_of(a)["param"] == "max_body_bytes"
    assert raw.closed_by_server()
    raw.close()
    assert requests.post(s.url + "/echo", data=b"x" * 1024).status_code == 200
    stats = s.stats()
    assert stats["rejected"] == {"max_body_bytes": 2}
    assert stats["requests"] == {413: 2, 200: 1}
    assert stats["handler_errors"] == 0


def test_heads_over_the_limits_are_431(serve: Callable[..., Served]) -> None:
    s = serve(ServerLimits(max_headers=20, max_header_bytes=8192))
    with httpx.Client(base_url=s.url) as client:
        r = client.get("/echo", headers={f"x-h{i}": "v" for i in range(30)})
        assert r.status_code == 431
        assert r.json()["error"]["param"] == "max_headers"
    big = requests.get(s.url + "/echo", headers={"x-big": "v" * 10_000})
    assert big.status_code == 431
    assert big.json()["error"]["param"] == "max_header_bytes"
    # a header that never ends: refused once past the limit, whatever follows
    raw = RawClient(s.port)
    raw.send(b"GET /echo HTTP/1.1\r\nHost: t\r\nX-Endless: " + b"a" * 20_000)
    a = raw.answer()
    assert a.status == 431
    assert error_of(a)["param"] == "max_header_bytes"
    raw.close()
    assert requests.get(s.url + "/echo", headers={"x-ok": "v" * 1000}).status_code == 200


def test_long_url_is_414(serve: Callable[..., Served]) -> None:
    s = serve(ServerLimits(max_url_bytes=1024))
    r = requests.get(s.url + "/echo?q=" + "a" * 2000)
    assert r.status_code == 414
    assert r.json()["error"]["param"] == "max_url_bytes"


def test_idle_body_and_slow_head_are_408(serve: Callable[..., Served]) -> None:
    s = serve(ServerLimits(idle_body_timeout_s=0.3, header_timeout_s=0.3))
    raw = RawClient(s.port)
    raw.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
    a = raw.answer()  # the client stopped sending mid-body
    assert a.status == 408
    assert error_of(a)["param"] == "idle_body_timeout_s"
    assert a.headers["connection"] == "close"
    assert raw.closed_by_server()
    raw.close()
    raw = RawClient(s.port)
    raw.send(b"GET /echo HTTP/1.1\r\nHost: t\r\n")  # a head that never ends
    a = raw.answer()
    assert a.status == 408
    assert error_of(a)["param"] == "header_timeout_s"
    raw.close()
    stats = s.stats()
    assert stats["rejected"] == {"idle_body_timeout_s": 1, "header_timeout_s": 1}


def test_keepalive_timeout_closes_quietly(serve: Callable[..., Served]) -> None:
    s = serve(ServerLimits(keepalive_timeout_s=0.3))
    raw = RawClient(s.port)
    raw.send(get("/echo"))
    assert raw.answer().status == 200
    assert raw.sock.recv(100) == b""  # closed with no answer
    raw.close()
    s.wait_for(lambda: s.stats()["open_connections"] == 0)
    assert s.stats()["requests"] == {200: 1}


def test_requests_past_max_in_flight_get_503_with_retry_after(
    serve: Callable[..., Served],
) -> None:
    s = serve(ServerLimits(max_in_flight=2, retry_after_s=3))
    held = [RawClient(s.port) for _ in range(2)]
    for raw in held:
        raw.send(get("/gate"))
    s.wait_for(lambda: s.on_loop(lambda: s.app.at_gate) == 2)
    with httpx.Client(base_url=s.url) as client:
        r = client.get("/echo")
        assert r.status_code == 503
        assert r.headers["retry-after"] == "3"
        error = r.json()["error"]
        assert error["param"] == "max_in_flight"
        assert "max_in_flight=2" in error["message"]
        s.on_loop(lambda: s.app.gate.set())  # type: ignore[union-attr]
        for raw in held:
            assert json.loads(raw.answer().body) == {"through": True}
            raw.close()
        assert client.get("/echo").status_code == 200  # the same connection, now served
    stats = s.stats()
    assert stats["requests"] == {503: 1, 200: 3}
    assert stats["rejected"] == {"max_in_flight": 1}


def test_connections_past_max_connections_get_503(serve: Callable[..., Served]) -> None:
    s = serve(ServerLimits(max_connections=2))
    kept = [RawClient(s.port) for _ in range(2)]
    for raw in kept:
        raw.send(get("/echo"))
        assert raw.answer().status == 200
    extra = RawClient(s.port)
    a = extra.answer()
    assert a.status == 503
    assert error_of(a)["param"] == "max_connections"
    assert "retry-after" in a.headers
    extra.close()
    kept[0].close()
    s.wait_for(lambda: s.stats()["open_connections"] == 1)
    again = RawClient(s.port)
    again.send(get("/echo"))
    assert again.answer().status == 200
    again.close()
    kept[1].close()


@pytest.mark.parametrize(
    "data",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /echo HTTP/9.9\r\nHost: t\r\n\r\n",
        b"GET /echo HTTP/1.1\r\nBad Header\r\n\r\n",
        b"GET /ec ho HTTP/1.1\r\nHost: t\r\n\r\n",
        b"POST /echo HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n",
        b"POST /echo HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
    ],
)
def test_malformed_requests_are_400_and_closed(
    serve_uv: Callable[..., Served], data: bytes
) -> None:
    s = serve_uv()
    raw = RawClient(s.port)
    raw.send(get("/echo?first=1") + data)
    first, bad = raw.answers(2)  # what came before is still answered, in order
    assert first.status == 200
    assert bad.status == 400
    error = error_of(bad)
    assert error["param"] == "malformed"
    assert error["message"].startswith("malformed HTTP: ")
    assert bad.headers["connection"] == "close"
    assert raw.closed_by_server()
    raw.close()
    assert requests.get(s.url + "/echo").status_code == 200


def test_upgrade_requests_are_answered_as_http11(serve_uv: Callable[..., Served]) -> None:
    s = serve_uv()
    raw = RawClient(s.port)
    raw.send(get("/echo", "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"))
    a = raw.answer()
    assert a.status == 200
    assert a.headers["connection"] == "close"
    assert raw.closed_by_server()
    raw.close()


# ---- close


def test_close_lets_answers_in_progress_finish(serve: Callable[..., Served]) -> None:
    s = serve()
    idle = RawClient(s.port)
    idle.send(get("/echo"))
    assert idle.answer().status == 200
    busy = RawClient(s.port)
    busy.send(get("/sleep?s=0.3"))
    s.wait_for(lambda: s.stats()["in_flight"] == 1)
    s.closed = True
    s.call(s.server.close(grace_s=10))
    a = busy.answer()
    assert json.loads(a.body) == {"slept": "0.3"}
    assert a.headers["connection"] == "close"
    assert busy.closed_by_server()
    assert idle.closed_by_server()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", s.port), timeout=2)
    assert s.stats()["cut_at_close"] == 0
    busy.close()
    idle.close()


def test_close_cuts_what_outlives_the_grace(serve: Callable[..., Served]) -> None:
    s = serve()
    raw = RawClient(s.port)
    raw.send(get("/wait"))
    assert s.app.started.wait(5)
    s.closed = True
    s.call(s.server.close(grace_s=0.2))
    assert s.app.cancelled.is_set()  # cancelled, and its cleanup ran before close returned
    assert raw.closed_by_server()
    stats = s.stats()
    assert stats["cut_at_close"] == 1
    assert stats["disconnects"] == 0  # the server cut it, not the client
    assert stats["in_flight"] == 0 and stats["open_connections"] == 0
    raw.close()


# ---- scale


def test_1000_concurrent_keepalive_clients(serve_uv: Callable[..., Served]) -> None:
    app = App()
    clients = 1000
    app.barrier_n = clients
    s = serve_uv(app=app)

    async def run() -> list[int]:
        connector = aiohttp.TCPConnector(limit=clients, force_close=False)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def client(i: int) -> list[int]:
                out = []
                # the first request of each waits until all 1,000 are in the server at once
                for path in ("/barrier", f"/echo?i={i}", f"/sse?n=2&i={i}"):
                    async with session.get(s.url + path) as r:
                        await r.read()
                        out.append(r.status)
                return out

            results = await asyncio.gather(*(client(i) for i in range(clients)))
        return [status for statuses in results for status in statuses]

    statuses = asyncio.run(run())
    assert statuses == [200] * (3 * clients)
    stats = s.stats()
    assert stats["connections"] == clients  # each client kept its connection
    assert stats["requests"] == {200: 3 * clients}
    assert s.on_loop(lambda: app.arrived) == clients


# ---- construction


def test_bad_settings_are_named() -> None:
    bad: list[tuple[str, Any]] = [
        ("max_body_bytes", -1),
        ("max_headers", 0),
        ("idle_body_timeout_s", 0),
        ("keepalive_timeout_s", float("inf")),
        ("max_in_flight", True),
    ]
    for key, value in bad:
        with pytest.raises(InvalidArgument) as info:
            ServerLimits(**{key: value})
        assert info.value.key == key
        assert key in str(info.value)
    with pytest.raises(InvalidArgument) as info:
        HttpServer(App(), port=70000)
    assert info.value.key == "port"
    with pytest.raises(InvalidArgument) as info:
        Response(99)
    assert info.value.key == "status"
    with pytest.raises(InvalidArgument) as info:
        Response(200, b"", {"Content-Length": "3"})
    assert info.value.key == "headers"
    with pytest.raises(InvalidArgument) as info:
        StreamResponse([b"not async"])  # type: ignore[arg-type]
    assert info.value.key == "chunks"


def test_a_request_built_by_hand_reads_like_a_parsed_one() -> None:
    """Routes can be tested without a server."""
    req = Request("POST", "/v1/a%2Fb?n=1&n=2&x=", {"Authorization": "Bearer k"}, b"{}")
    assert req.path == "/v1/a/b"
    assert req.query == {"n": "2", "x": ""}
    assert req.query_string == "n=1&n=2&x="
    assert req.headers == {"authorization": "Bearer k"}
    assert req.body == b"{}" and req.http_version == "1.1" and req.client is None
    assert Request("GET", "http://h:1/p?q=1", None).path == "/p"  # absolute form


def test_new_event_loop_sets_no_policy() -> None:
    policy = asyncio.get_event_loop_policy()
    loop = new_event_loop()
    try:
        assert isinstance(loop, uvloop.Loop)
        assert asyncio.get_event_loop_policy() is policy
    finally:
        loop.close()


# ---- the micro-benchmark's own checks


def test_http_server_bench_smoke(tmp_path: Path) -> None:
    """``benchmarks/gateway/http_server_bench.py --smoke``: both servers answer every request
    whole and rollsafe's counters match what the client sent (the CPU ratio is checked by a
    full run only: timing belongs to the benchmark)."""
    out = tmp_path / "bench.json"
    script = ROOT / "benchmarks" / "gateway" / "http_server_bench.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["results"]) == {
        "raw generate",
        "raw generate-stream",
        "rollsafe generate",
        "rollsafe generate-stream",
    }
    assert result["checks"] and all(result["checks"].values())
    assert result["rollsafe_server_stats"]["requests"]["200"] > 0
