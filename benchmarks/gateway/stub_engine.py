"""A zero-work inference server for the gateway benchmark: every route a router probes or
forwards, fixed tokens, no model, so what a front (router, proxy, gateway) costs is isolated.

``python benchmarks/gateway/stub_engine.py [--port 0] [--token-interval-ms 0] [--counters PATH]``
prints ``STUB_READY {"url": ..., "pid": ...}`` once it listens. It speaks HTTP/1.1 with
keep-alive on a bare :mod:`asyncio` protocol (no third-party server: the stub's own cost is
the same under every front and as small as Python allows). Routes:

* ``POST /generate`` (SGLang): ``sampling_params.max_new_tokens`` fixed tokens (default 16);
  ``stream: true`` sends one ``data:`` event per token with the cumulative ``text`` and
  ``output_ids``, the last one with ``meta_info.finish_reason``, then ``data: [DONE]``.
* ``POST /v1/completions`` and ``/v1/chat/completions`` (OpenAI): ``max_tokens`` (or
  ``max_completion_tokens``) tokens, non-stream or server-sent events, ``data: [DONE]`` last.
* ``GET /health``, ``/health_generate``, ``/v1/models``, ``/get_model_info``,
  ``/get_server_info``, ``/version``, ``/get_loads``, ``/metrics``: fixed answers.
* ``GET /stub/stats``: the counters below plus every body key seen (so a benchmark can show
  which keys a router added).

Unknown body keys are accepted (as SGLang 0.5.23 ignores them and vLLM allows them); a body
that is not a JSON object, or a token count that is not a non-negative int, is a 400 naming
the key. With ``--token-interval-ms`` each token after the first waits that long (a stream that
stays open; a non-streamed answer waits as long in all). With ``--counters PATH`` the counters
live in that file through ``mmap`` (eight bytes each, in :data:`COUNTERS` order): they survive
a SIGKILL, so a benchmark reads what a killed stub had received and generated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import sys
import time
from pathlib import Path
from typing import Any

#: the counters, in their order in the ``--counters`` file (uint64 each, native byte order)
COUNTERS = (
    "connections",
    "requests",
    "generate",
    "completions",
    "chat",
    "probes",
    "not_found",
    "bad_request",
    "streams_started",
    "streams_finished",
    "streams_cut",
    "tokens_generated",
    "tokens_in_finished",
)
READY_PREFIX = "STUB_READY "
MODEL = "stub-model"
DEFAULT_TOKENS = 16
MAX_BODY = 64 << 20


def read_counters(path: str | Path) -> dict[str, int]:
    """The counters a stub (alive or killed) wrote to ``path``."""
    raw = Path(path).read_bytes()
    view = memoryview(raw[: 8 * len(COUNTERS)]).cast("Q")
    return {name: int(view[i]) for i, name in enumerate(COUNTERS)}


class Counters:
    """Integer counters in a memory-mapped file (or in memory without one)."""

    def __init__(self, path: str | None) -> None:
        size = 8 * len(COUNTERS)
        if path:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.ftruncate(fd, size)
            self._map: mmap.mmap | bytearray = mmap.mmap(fd, size)
            os.close(fd)
        else:
            self._map = bytearray(size)
        self._view = memoryview(self._map).cast("Q")
        self._index = {name: i for i, name in enumerate(COUNTERS)}

    def add(self, name: str, n: int = 1) -> None:
        self._view[self._index[name]] += n

    def snapshot(self) -> dict[str, int]:
        return {name: int(self._view[i]) for name, i in self._index.items()}


class BadRequest(Exception):
    def __init__(self, key: str, msg: str) -> None:
        super().__init__(f"{key}: {msg}")
        self.key = key


def _token_count(body: dict[str, Any], *path: str) -> int | None:
    node: Any = body
    for key in path[:-1]:
        node = node.get(key) if isinstance(node, dict) else None
    if not isinstance(node, dict) or node.get(path[-1]) is None:
        return None
    value = node[path[-1]]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequest(".".join(path), f"must be a non-negative int, got {value!r}")
    return value


def _event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


TOKEN_TEXT = " tok"
DONE = b"data: [DONE]\n\n"


class Stub:
    """The routes' answers and the shared state of one stub process."""

    def __init__(self, counters: Counters, token_interval_s: float) -> None:
        self.counters = counters
        self.interval = token_interval_s
        self.keys_seen: dict[str, list[str]] = {}
        self.not_found: list[str] = []
        self.probe_paths: dict[str, int] = {}
        self.started = time.time()

    def note_keys(self, route: str, body: dict[str, Any]) -> None:
        seen = self.keys_seen.setdefault(route, [])
        for key in body:
            if key not in seen:
                seen.append(key)
        sp = body.get("sampling_params")
        if isinstance(sp, dict):
            for key in sp:
                if f"sampling_params.{key}" not in seen:
                    seen.append(f"sampling_params.{key}")

    def get(self, path: str) -> tuple[int, Any]:
        self.counters.add("probes")
        if path != "/stub/stats":
            self.probe_paths[path] = self.probe_paths.get(path, 0) + 1
        if path in ("/health", "/health_generate", "/liveness", "/readiness"):
            return 200, None
        if path == "/v1/models":
            return 200, {
                "object": "list",
                "data": [{"id": MODEL, "object": "model", "owned_by": "stub", "root": MODEL}],
            }
        if path == "/get_model_info":
            return 200, {
                "model_path": MODEL,
                "tokenizer_path": MODEL,
                "is_generation": True,
                "weight_version": "default",
            }
        if path == "/get_server_info":
            return 200, {"model_path": MODEL, "version": "0.5.23", "weight_version": "default"}
        if path == "/version":
            return 200, {"version": "0.32.0"}
        if path == "/get_loads":
            return 200, [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0}]
        if path == "/metrics":
            return 200, b""
        if path == "/stub/stats":
            return 200, {
                "counters": self.counters.snapshot(),
                "keys_seen": self.keys_seen,
                "not_found": self.not_found,
                "probe_paths": self.probe_paths,
                "pid": os.getpid(),
            }
        self.counters.add("probes", -1)
        self.counters.add("not_found")
        if f"GET {path}" not in self.not_found:
            self.not_found.append(f"GET {path}")
        return 404, {"error": f"no route GET {path}"}


class Connection(asyncio.Protocol):
    """One client connection: parses requests (Content-Length or chunked bodies) in order."""

    def __init__(self, stub: Stub) -> None:
        self.stub = stub
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.busy = False
        self.closed = False
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        self.stub.counters.add("connections")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._next()

    def _next(self) -> None:
        while not self.busy and not self.closed:
            try:
                req = self._parse()
            except ValueError:  # not HTTP/1.x (e.g. a router's HTTP/2 or gRPC probe)
                self.stub.counters.add("bad_request")
                self.closed = True
                assert self.transport is not None
                self.transport.close()
                return
            if req is None:
                return
            method, path, keep_alive, body = req
            self.stub.counters.add("requests")
            if method == "GET":
                status, payload = self.stub.get(path)
                self._respond(status, payload, keep_alive)
            elif method == "POST" and path in (
                "/generate",
                "/v1/completions",
                "/v1/chat/completions",
            ):
                self.busy = True
                self.task = asyncio.ensure_future(self._post(path, body, keep_alive))
            else:
                self.stub.counters.add("not_found")
                if f"{method} {path}" not in self.stub.not_found:
                    self.stub.not_found.append(f"{method} {path}")
                self._respond(404, {"error": f"no route {method} {path}"}, keep_alive)

    def _parse(self) -> tuple[str, str, bool, bytes] | None:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return None
        head = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        method, target, version = head[0].split(" ", 2)
        if not version.startswith("HTTP/1."):
            raise ValueError(f"not HTTP/1.x: {head[0]!r}")
        headers = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        pos = end + 4
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = bytearray()
            while True:
                line_end = self.buf.find(b"\r\n", pos)
                if line_end < 0:
                    return None
                size = int(bytes(self.buf[pos:line_end]).split(b";")[0], 16)
                if len(self.buf) < line_end + 2 + size + 2:
                    return None
                body += self.buf[line_end + 2 : line_end + 2 + size]
                pos = line_end + 2 + size + 2
                if size == 0:
                    break
        else:
            length = int(headers.get("content-length", "0"))
            if length > MAX_BODY:
                self.closed = True
                assert self.transport is not None
                self.transport.close()
                return None
            if len(self.buf) < pos + length:
                return None
            body = self.buf[pos : pos + length]
            pos += length
        del self.buf[:pos]
        conn = headers.get("connection", "").lower()
        keep_alive = conn != "close" if version == "HTTP/1.1" else conn == "keep-alive"
        return method, target.split("?", 1)[0], keep_alive, bytes(body)

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def _respond(self, status: int, payload: Any, keep_alive: bool) -> None:
        if isinstance(payload, bytes) or payload is None:
            data, ctype = payload or b"", "text/plain"
        else:
            data, ctype = json.dumps(payload, separators=(",", ":")).encode(), "application/json"
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}.get(status, "Error")
        self._write(
            (
                f"HTTP/1.1 {status} {reason}\r\ncontent-type: {ctype}\r\n"
                f"content-length: {len(data)}\r\n"
                + ("" if keep_alive else "connection: close\r\n")
                + "\r\n"
            ).encode()
            + data
        )
        if not keep_alive and self.transport is not None:
            self.transport.close()

    async def _post(self, path: str, raw: bytes, keep_alive: bool) -> None:
        try:
            await self._generate(path, raw, keep_alive)
        finally:
            self.busy = False
        if self.closed:
            return
        if keep_alive:
            self._next()
        elif self.transport is not None:
            self.transport.close()

    async def _generate(self, path: str, raw: bytes, keep_alive: bool) -> None:
        c = self.stub.counters
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise BadRequest("body", "must be a JSON object")
            if path == "/generate":
                n = _token_count(body, "sampling_params", "max_new_tokens")
            else:
                n = _token_count(body, "max_tokens")
                if n is None:
                    n = _token_count(body, "max_completion_tokens")
            n = DEFAULT_TOKENS if n is None else n
        except (ValueError, BadRequest) as exc:
            c.add("bad_request")
            key = exc.key if isinstance(exc, BadRequest) else "body"
            self._respond(400, {"error": {"message": str(exc), "param": key}}, keep_alive)
            return
        name = {"/generate": "generate", "/v1/completions": "completions"}.get(path, "chat")
        c.add(name)
        self.stub.note_keys(path, body)
        render = _RENDER[path]
        interval = self.stub.interval
        if not body.get("stream"):
            if interval:
                c.add("tokens_generated")
                for _ in range(n - 1):
                    await asyncio.sleep(interval)
                    if self.closed:
                        return
                    c.add("tokens_generated")
            else:
                c.add("tokens_generated", n)
            c.add("tokens_in_finished", n)
            self._respond(200, render(n, n, True), keep_alive)
            return
        c.add("streams_started")
        self._write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\n"
            + (b"" if keep_alive else b"connection: close\r\n")
            + b"\r\n"
        )
        for i in range(1, n + 1):
            if self.closed:
                c.add("streams_cut")
                return
            # counted before it is sent: a client that reads it may SIGKILL the stub at once
            # (a loaded machine preempted it between the two: the count was one short)
            c.add("tokens_generated")
            self._write(_chunk(_event(render(i, n, False))))
            if i < n:
                await asyncio.sleep(interval)
        self._write(_chunk(DONE) + b"0\r\n\r\n")
        c.add("streams_finished")
        c.add("tokens_in_finished", n)


def _sglang(i: int, n: int, whole: bool) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": "stub",
        "prompt_tokens": 4,
        "completion_tokens": i,
        "weight_version": "default",
        "finish_reason": {"type": "length", "length": n} if i == n else None,
    }
    return {"text": TOKEN_TEXT * i, "output_ids": [7] * i, "meta_info": meta}


def _completion(i: int, n: int, whole: bool) -> dict[str, Any]:
    done = i == n
    return {
        "id": "cmpl-stub",
        "object": "text_completion",
        "created": 0,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "text": TOKEN_TEXT * (n if whole else 1),
                "logprobs": None,
                "finish_reason": "length" if done else None,
            }
        ],
        **(
            {"usage": {"prompt_tokens": 4, "completion_tokens": n, "total_tokens": n + 4}}
            if whole
            else {}
        ),
    }


def _chat(i: int, n: int, whole: bool) -> dict[str, Any]:
    done = i == n
    text = TOKEN_TEXT * (n if whole else 1)
    if whole:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
    else:
        choice = {"index": 0, "delta": {"content": text}}
    choice["finish_reason"] = "length" if done else None
    return {
        "id": "chatcmpl-stub",
        "object": "chat.completion" if whole else "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [choice],
    }


_RENDER = {"/generate": _sglang, "/v1/completions": _completion, "/v1/chat/completions": _chat}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--token-interval-ms", type=float, default=0.0)
    p.add_argument("--counters", default=None, help="mmap the counters into this file")
    args = p.parse_args(argv)
    if args.token_interval_ms < 0:
        p.error("--token-interval-ms must be >= 0")
    return args


async def serve(args: argparse.Namespace) -> None:
    stub = Stub(Counters(args.counters), args.token_interval_ms / 1000.0)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: Connection(stub), args.host, args.port, backlog=4096, reuse_address=True
    )
    port = server.sockets[0].getsockname()[1]
    ready = {"url": f"http://{args.host}:{port}", "pid": os.getpid(), "port": port}
    print(READY_PREFIX + json.dumps(ready), flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
