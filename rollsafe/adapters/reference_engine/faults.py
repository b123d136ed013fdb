"""Fault injection for the reference engine (enabled only by ``ROLLSAFE_FAULT_INJECTION=1``).

Owns the ``/fault/*`` endpoints and the middleware that applies injected faults:

* ``POST /fault/crash``: the process SIGKILLs itself; its other ranks die with it (PDEATHSIG);
* ``POST /fault/hang``: every later request (this one included) never gets an answer;
* ``POST /fault/slow`` ``{"seconds": s}``: every later response is delayed by ``s`` seconds
  (``0`` clears it);
* ``POST /fault/fail_next`` ``{"endpoint": "/generate"}``: the next call of that endpoint
  answers HTTP 500;
* ``POST /fault/stall`` ``{"after_tokens": n}``: the next generation to reach ``n`` output
  tokens makes no more until it is aborted (a pause in ``abort`` mode), retracted (a pause
  in ``retract`` mode queues it again) or the engine dies, so
  a test's sync or SIGKILL lands mid-generation however far its client lags behind the
  engine; once (``null`` disarms it). ``GET /fault/stall``: ``{"armed": n or null,
  "stalled": generations stalled so far}``, so a test can wait until its generation is held.

Without the environment variable the endpoints answer 404 and change nothing. Start-up faults
of individual ranks (a delay, or a failure) are injected with ``ROLLSAFE_FAULT_RANK_START``; see
:mod:`.bootstrap`.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

__all__ = ["ENV_VAR", "FaultInjector", "fault_injection_enabled"]

ENV_VAR = "ROLLSAFE_FAULT_INJECTION"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def fault_injection_enabled(environ: dict[str, str] | None = None) -> bool:
    return (environ if environ is not None else os.environ).get(ENV_VAR) == "1"


class FaultInjector:
    """Fault state plus its aiohttp routes and middleware."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.hanging = False
        self.slow_s = 0.0
        self.fail_next: dict[str, int] = {}

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if not self.enabled:
            return await handler(request)
        if self.hanging:
            await asyncio.Event().wait()  # never set: the request hangs until the client gives up
        if self.slow_s > 0:
            await asyncio.sleep(self.slow_s)
        if self.fail_next.get(request.path, 0) > 0 and not request.path.startswith("/fault/"):
            self.fail_next[request.path] -= 1
            return web.json_response(
                {"success": False, "message": f"injected failure of {request.path}"}, status=500
            )
        return await handler(request)

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/fault/crash", self._crash),
            web.post("/fault/hang", self._hang),
            web.post("/fault/slow", self._slow),
            web.post("/fault/fail_next", self._fail_next),
            web.post("/fault/stall", self._stall),
            web.get("/fault/stall", self._stall_state),
        ]

    def _disabled(self) -> web.Response:
        return web.json_response(
            {"success": False, "message": f"fault injection is disabled (set {ENV_VAR}=1)"},
            status=404,
        )

    async def _json(self, request: web.Request) -> dict[str, Any]:
        from rollsafe.adapters.reference_engine.server import read_json

        return await read_json(request, allowed={"seconds", "endpoint", "after_tokens"})

    async def _crash(self, request: web.Request) -> web.Response:
        if not self.enabled:
            return self._disabled()
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _hang(self, request: web.Request) -> web.Response:
        if not self.enabled:
            return self._disabled()
        self.hanging = True
        await asyncio.Event().wait()
        raise AssertionError("unreachable")  # pragma: no cover

    async def _slow(self, request: web.Request) -> web.Response:
        if not self.enabled:
            return self._disabled()
        body = await self._json(request)
        seconds = body.get("seconds")
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds < 0:
            return web.json_response(
                {"success": False, "message": "'seconds' must be a number >= 0"}, status=400
            )
        self.slow_s = float(seconds)
        return web.json_response({"success": True, "message": f"responses delayed by {seconds}s"})

    async def _fail_next(self, request: web.Request) -> web.Response:
        if not self.enabled:
            return self._disabled()
        body = await self._json(request)
        endpoint = body.get("endpoint")
        if not isinstance(endpoint, str) or not endpoint:
            return web.json_response(
                {"success": False, "message": "'endpoint' must be a path like '/generate'"},
                status=400,
            )
        path = endpoint if endpoint.startswith("/") else f"/{endpoint}"
        self.fail_next[path] = self.fail_next.get(path, 0) + 1
        return web.json_response({"success": True, "message": f"next {path} answers 500"})

    async def _stall(self, request: web.Request) -> web.Response:
        from rollsafe.adapters.reference_engine.server import ctx_of

        if not self.enabled:
            return self._disabled()
        body = await self._json(request)
        tokens = body.get("after_tokens")
        if tokens is not None and (
            not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1
        ):
            return web.json_response(
                {"success": False, "message": "'after_tokens' must be an int >= 1 or null"},
                status=400,
            )
        ctx_of(request).engine.stall_next(tokens)
        said = "disarmed" if tokens is None else f"the next generation stalls at {tokens} tokens"
        return web.json_response({"success": True, "message": f"stall {said}"})

    async def _stall_state(self, request: web.Request) -> web.Response:
        from rollsafe.adapters.reference_engine.server import ctx_of

        if not self.enabled:
            return self._disabled()
        return web.json_response(ctx_of(request).engine.stall_state())
