"""Connection handling of the engine clients' HTTP transport, against a real local socket server.

The server (:class:`DroppingServer`) speaks just enough HTTP/1.1 over real sockets to reproduce
what a real vLLM does after a 500: it answers with a complete keep-alive response (no
``Connection: close``), then drops the connection as soon as the next request arrives on it,
without answering (a reset). A pooled connection reused after that 500 fails the next request,
so rollsafe reported a healthy engine unavailable. The transport must recycle the connection
after any 5xx, and resend a request only when it provably never reached the server.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from collections.abc import Iterator

import httpx
import pytest

from rollsafe.adapters.engines import (
    NO_RETRY,
    EngineRequestError,
    EngineUnavailable,
    RetryPolicy,
)
from rollsafe.adapters.engines.http import HttpTransport
from rollsafe.adapters.engines.streaming import read_events, sse_lines


def _read_request(conn: socket.socket, buffer: bytearray) -> tuple[str, str, bytes] | None:
    """One request (method, path, body) from ``conn``; None when the peer closed first."""
    while b"\r\n\r\n" not in buffer:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        buffer.extend(chunk)
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    body = bytearray(rest)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        body.extend(chunk)
    buffer[:] = body[length:]
    return method, path, bytes(body[:length])


def _reset(conn: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0), as a server that drops the connection does."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


#: vLLM writes token text into its JSON unescaped: text with characters str.splitlines (and
#: so httpx's iter_lines) treats as line ends, and lines ended by CRLF, CR or LF
UNICODE_TEXTS = ("a\u2028b", "c\x85d", "e\x1cf\u2029g")
UNICODE_EVENTS = (
    b"".join(
        b"data: " + json.dumps({"text": t}, ensure_ascii=False).encode() + end
        for t, end in zip(UNICODE_TEXTS, (b"\r\n\r\n", b"\r\r", b"\n\n"), strict=True)
    )
    + b"data: [DONE]\n\n"
)


class DroppingServer:
    """HTTP/1.1 on a real socket: ``/fail`` answers 500 (keep-alive), and the connection that
    carried a 500 is reset when its next request arrives; ``/hang-up`` closes without an
    answer; ``/stream`` answers one SSE event and ``[DONE]``; anything else answers 200."""

    def __init__(self, port: int = 0, *, listen: bool = True) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.port = int(self.sock.getsockname()[1])
        self.connections = 0
        self.requests: list[tuple[str, str]] = []
        self.dropped = 0
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        if listen:
            self.listen()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def listen(self) -> None:
        self.sock.listen(16)
        accept = threading.Thread(target=self._accept, daemon=True)
        accept.start()
        self._threads.append(accept)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
            worker = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            worker.start()

    def _serve(self, conn: socket.socket) -> None:
        buffer = bytearray()
        failed = False
        try:
            while True:
                request = _read_request(conn, buffer)
                if request is None:
                    conn.close()
                    return
                method, path, _ = request
                with self._lock:
                    self.requests.append((method, path))
                if failed:  # the request after a 500 on this connection: drop it, no answer
                    with self._lock:
                        self.dropped += 1
                    _reset(conn)
                    return
                if path == "/hang-up":
                    _reset(conn)
                    return
                if path == "/fail":
                    failed = True
                    self._answer(conn, 500, {"error": "reload failed"})
                elif path == "/stream":
                    events = b'data: {"n": 1}\n\ndata: [DONE]\n\n'
                    self._answer(conn, 200, events, "text/event-stream")
                elif path == "/unicode-stream":
                    self._answer(conn, 200, UNICODE_EVENTS, "text/event-stream")
                else:
                    self._answer(conn, 200, {"ok": path})
        except OSError:
            conn.close()

    @staticmethod
    def _answer(
        conn: socket.socket, status: int, body: object, ctype: str = "application/json"
    ) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        reason = {200: "OK", 500: "Internal Server Error"}[status]
        head = (
            f"HTTP/1.1 {status} {reason}\r\ncontent-type: {ctype}\r\n"
            f"content-length: {len(data)}\r\n\r\n"
        )
        conn.sendall(head.encode() + data)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def server() -> Iterator[DroppingServer]:
    srv = DroppingServer()
    yield srv
    srv.close()


def test_the_server_reproduces_the_drop_for_a_plain_pooled_client(
    server: DroppingServer,
) -> None:
    """Without recycling, the request after a 500 fails on the reused connection: the
    failure the transport must avoid is real."""
    with httpx.Client(base_url=server.url) as plain:
        assert plain.post("/fail").status_code == 500
        with pytest.raises(httpx.TransportError):
            plain.get("/health")
    assert server.connections == 1 and server.dropped == 1


@pytest.mark.parametrize("idempotent", [False, True])
def test_the_request_after_a_500_uses_a_fresh_connection(
    server: DroppingServer, idempotent: bool
) -> None:
    transport = HttpTransport(server.url, retry=NO_RETRY)
    try:
        with pytest.raises(EngineRequestError) as info:
            transport.request("POST", "/fail", json_body={}, idempotent=idempotent)
        assert info.value.status_code == 500 and "reload failed" in info.value.message
        assert transport.request("GET", "/health", idempotent=idempotent) == {"ok": "/health"}
        assert transport.request("POST", "/generate", json_body={}) == {"ok": "/generate"}
    finally:
        transport.close()
    assert server.dropped == 0
    assert server.connections == 2  # one for the 500, one fresh after it (then reused)
    assert server.requests == [("POST", "/fail"), ("GET", "/health"), ("POST", "/generate")]


def test_a_2xx_keeps_its_pooled_connection(server: DroppingServer) -> None:
    transport = HttpTransport(server.url, retry=NO_RETRY)
    try:
        for _ in range(3):
            transport.request("GET", "/health")
    finally:
        transport.close()
    assert server.connections == 1


def test_a_stream_answered_500_does_not_poison_the_next_stream(server: DroppingServer) -> None:
    transport = HttpTransport(server.url, retry=NO_RETRY)
    try:
        with pytest.raises(EngineRequestError) as info:
            list(read_events(transport, "/fail", {}, None))
        assert info.value.status_code == 500
        assert list(read_events(transport, "/stream", {}, None)) == [{"n": 1}]
    finally:
        transport.close()
    assert server.dropped == 0 and server.connections == 2


def test_a_request_that_may_have_reached_the_server_is_sent_once(server: DroppingServer) -> None:
    """The server read the request, then hung up: it may have acted on it, so a generate or a
    weight update is not resent, whatever the retry policy."""
    transport = HttpTransport(server.url, retry=RetryPolicy(attempts=3, backoff_s=0.0))
    try:
        with pytest.raises(EngineUnavailable) as info:
            transport.request("POST", "/hang-up", json_body={"text": "x"})
        assert info.value.request_sent is None
        with pytest.raises(EngineUnavailable):
            list(read_events(transport, "/hang-up", {}, None))
    finally:
        transport.close()
    assert server.requests == [("POST", "/hang-up")] * 2


class _ListenOnFirstRefusal(httpx.HTTPTransport):
    """The real httpx transport; after its first connection is refused, the server starts
    listening, so the retry that follows reaches it (no sleeps, no mocks)."""

    def __init__(self, server: DroppingServer) -> None:
        super().__init__()
        self.server = server
        self.refused = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return super().handle_request(request)
        except httpx.ConnectError:
            self.refused += 1
            if self.refused == 1:
                self.server.listen()
            raise


@pytest.mark.parametrize("streamed", [False, True])
def test_a_request_that_never_reached_the_server_is_resent(streamed: bool) -> None:
    server = DroppingServer(listen=False)  # bound, not listening: connections are refused
    net = _ListenOnFirstRefusal(server)
    transport = HttpTransport(
        server.url, retry=RetryPolicy(attempts=2, backoff_s=0.0), transport=net
    )
    try:
        if streamed:
            assert list(read_events(transport, "/stream", {}, None)) == [{"n": 1}]
        else:
            assert transport.request("POST", "/generate", json_body={}) == {"ok": "/generate"}
    finally:
        transport.close()
        server.close()
    assert net.refused == 1
    assert len(server.requests) == 1  # sent once: the refused try never reached it


def test_connection_refused_everywhere_is_unavailable_and_not_sent() -> None:
    server = DroppingServer(listen=False)
    transport = HttpTransport(server.url, retry=RetryPolicy(attempts=2, backoff_s=0.0))
    try:
        with pytest.raises(EngineUnavailable) as info:
            transport.request("POST", "/generate", json_body={})
        assert info.value.request_sent is False
    finally:
        transport.close()
        server.close()


def test_a_health_probe_without_retry_sends_exactly_one_request() -> None:
    """The health manager's probe (``retry=False``) must fail fast, even on a refused
    connection that a generate would retry."""
    from rollsafe.adapters.engines import VLLMClient

    server = DroppingServer(listen=False)
    net = _ListenOnFirstRefusal(server)
    client = VLLMClient(server.url, retry=RetryPolicy(attempts=3, backoff_s=0.0), transport=net)
    try:
        with pytest.raises(EngineUnavailable) as info:
            client.health(retry=False)
        assert info.value.request_sent is False and net.refused == 1
        client.health()  # the server listens now: one more try reaches it
    finally:
        client.close()
        server.close()
    assert net.refused == 1 and server.requests == [("GET", "/health")]


def test_events_carrying_unicode_line_separators_are_read_whole(server: DroppingServer) -> None:
    """Server-sent events end lines at CRLF, LF or CR only: a U+2028 or U+0085 inside an event's
    JSON (vLLM does not escape token text) does not cut the event."""
    transport = HttpTransport(server.url, timeout=10.0)
    try:
        events = list(read_events(transport, "/unicode-stream", {}, None))
    finally:
        transport.close()
    assert [e["text"] for e in events] == list(UNICODE_TEXTS)


def test_sse_lines_split_only_at_line_ends_even_across_chunks() -> None:
    raw = b"data: a\xe2\x80\xa8b\r\n\r\ndata: c\r\rdata: d\n\n"
    for size in (1, 2, 3, 7, len(raw)):
        chunks = [raw[i : i + size] for i in range(0, len(raw), size)]
        lines = list(sse_lines(iter(chunks)))
        assert lines == ["data: a\u2028b", "", "data: c", "", "data: d", ""], (size, lines)
