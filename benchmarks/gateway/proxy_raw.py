"""Gateway server-stack candidate: a bare asyncio protocol on uvloop with httptools' HTTP/1.1
parser (no web framework), forwarding to the engines with one pooled aiohttp client session
(keep-alive); streams passed through as chunked transfer encoding.

``python benchmarks/gateway/proxy_raw.py --upstream URL [--upstream URL ...]`` prints
``PROXY_READY {"url": ...}``. Each request goes to one upstream, round-robin; requests on one
connection are answered in order; a client that goes away cancels its upstream request. Used by
``benchmarks/bench_gateway.py`` only.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import sys
from typing import Any

import aiohttp
import httptools

REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 500: "Internal Server Error"}


class Proxy:
    def __init__(self, upstreams: list[str]) -> None:
        self.rr = itertools.cycle(upstreams)
        self.client: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self.client is None:
            conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
            self.client = aiohttp.ClientSession(
                connector=conn, timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False
            )
        return self.client


class Conn(asyncio.Protocol):
    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.ctype = "application/json"
        self.body: list[bytes] = []
        self.pending: collections.deque[tuple[str, str, str, bytes, bool]] = collections.deque()
        self.task: asyncio.Task[None] | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.task is not None:
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url, self.body, self.ctype = b"", [], "application/json"

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self.ctype = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method().decode()
        self.pending.append(
            (
                method,
                self.url.decode("latin-1"),
                self.ctype,
                b"".join(self.body),
                self.parser.should_keep_alive(),
            )
        )
        if self.task is None:
            self.task = asyncio.ensure_future(self.run())

    async def run(self) -> None:
        try:
            while self.pending and self.transport is not None:
                await self.forward(*self.pending.popleft())
        finally:
            self.task = None

    def write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    async def forward(
        self, method: str, url: str, ctype: str, body: bytes, keep_alive: bool
    ) -> None:
        conn = b"" if keep_alive else b"connection: close\r\n"
        async with self.proxy.session().request(
            method, next(self.proxy.rr) + url, data=body, headers={"content-type": ctype}
        ) as up:
            status = b"HTTP/1.1 %d %s\r\n" % (up.status, REASONS.get(up.status, "Status").encode())
            up_ctype = up.headers.get("content-type", "application/json").encode("latin-1")
            if not up_ctype.startswith(b"text/event-stream"):
                data = await up.read()
                self.write(
                    status
                    + b"content-type: "
                    + up_ctype
                    + b"\r\ncontent-length: %d\r\n" % len(data)
                    + conn
                    + b"\r\n"
                    + data
                )
            else:
                self.write(
                    status
                    + b"content-type: "
                    + up_ctype
                    + b"\r\ntransfer-encoding: chunked\r\n"
                    + conn
                    + b"\r\n"
                )
                async for chunk in up.content.iter_any():
                    self.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.write(b"0\r\n\r\n")
        if not keep_alive and self.transport is not None:
            self.transport.close()


async def serve(args: argparse.Namespace) -> None:
    proxy = Proxy(args.upstream)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Conn(proxy), "127.0.0.1", args.port, backlog=4096)
    port = server.sockets[0].getsockname()[1]
    print("PROXY_READY " + json.dumps({"url": f"http://127.0.0.1:{port}"}), flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", action="append", required=True)
    p.add_argument("--port", type=int, default=0)
    args: Any = p.parse_args(argv)
    import uvloop

    uvloop.install()
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
