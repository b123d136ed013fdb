"""Gateway server-stack candidate: starlette on uvicorn (uvloop event loop, httptools parser),
forwarding to the engines with one pooled httpx.AsyncClient (keep-alive), streams passed
through as they arrive.

``python benchmarks/gateway/proxy_starlette.py --upstream URL [--upstream URL ...]`` prints
``PROXY_READY {"url": ...}``. Each request goes to one upstream, round-robin. Used by
``benchmarks/bench_gateway.py`` only.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import socket
import sys
from collections.abc import AsyncIterator

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route


def build_app(upstreams: list[str]) -> Starlette:
    rr = itertools.cycle(upstreams)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=60)
    client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None))

    async def forward(request: Request) -> Response:
        body = await request.body()
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        url = next(rr) + request.url.path
        if request.url.query:
            url += "?" + request.url.query
        up = await client.send(
            client.build_request(request.method, url, content=body, headers=headers), stream=True
        )
        ctype = up.headers.get("content-type", "")
        if not ctype.startswith("text/event-stream"):
            data = await up.aread()
            await up.aclose()
            return Response(data, status_code=up.status_code, media_type=ctype or None)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in up.aiter_raw():
                    yield chunk
            finally:
                await up.aclose()

        return StreamingResponse(chunks(), status_code=up.status_code, media_type=ctype)

    methods = ["GET", "POST", "PUT", "DELETE"]
    return Starlette(routes=[Route("/{tail:path}", forward, methods=methods)])


async def serve(args: argparse.Namespace) -> None:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    sock.listen(4096)
    config = uvicorn.Config(
        build_app(args.upstream),
        loop="none",
        http="httptools",
        log_level="warning",
        access_log=False,
        backlog=4096,
    )
    server = uvicorn.Server(config)
    port = sock.getsockname()[1]
    print("PROXY_READY " + json.dumps({"url": f"http://127.0.0.1:{port}"}), flush=True)
    await server.serve(sockets=[sock])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", action="append", required=True)
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    import uvloop

    uvloop.install()
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
