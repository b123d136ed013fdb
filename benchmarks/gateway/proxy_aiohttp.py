"""Gateway server-stack candidate: an aiohttp server forwarding to the engines with one pooled
aiohttp client session (keep-alive), streams passed through chunk by chunk.

``python benchmarks/gateway/proxy_aiohttp.py --upstream URL [--upstream URL ...] [--uvloop]``
prints ``PROXY_READY {"url": ...}``. Each request goes to one upstream, round-robin. Used by
``benchmarks/bench_gateway.py`` only.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys

import aiohttp
from aiohttp import web

HOP = {"content-type"}


def build_app(upstreams: list[str]) -> web.Application:
    rr = itertools.cycle(upstreams)
    app = web.Application(client_max_size=64 << 20)

    async def on_startup(app: web.Application) -> None:
        conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        app["client"] = aiohttp.ClientSession(
            connector=conn, timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False
        )

    async def on_cleanup(app: web.Application) -> None:
        await app["client"].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() in HOP}
        client: aiohttp.ClientSession = request.app["client"]
        async with client.request(
            request.method, next(rr) + request.path_qs, data=body, headers=headers
        ) as up:
            ctype = up.headers.get("content-type", "")
            if not ctype.startswith("text/event-stream"):
                data = await up.read()
                return web.Response(
                    status=up.status, body=data, content_type=ctype.split(";")[0] or None
                )
            resp = web.StreamResponse(status=up.status, headers={"content-type": ctype})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


async def serve(args: argparse.Namespace) -> None:
    runner = web.AppRunner(build_app(args.upstream), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port, backlog=4096)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print("PROXY_READY " + json.dumps({"url": f"http://127.0.0.1:{port}"}), flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", action="append", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--uvloop", action="store_true", help="run on uvloop's event loop")
    args = p.parse_args(argv)
    if args.uvloop:
        import uvloop

        uvloop.install()
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
