"""Server-sent-event streaming of one generation, shared by both dialects of the reference engine.

Owns the event-stream mechanics behind SGLang's ``/generate`` and vLLM's ``/v1/completions``
with ``stream: true`` (the dialect modules render each event's JSON, :class:`StreamRenderer`):

* the request limits and the prompt are checked before the response starts, so a bad request
  is an ordinary JSON 4xx, as upstream validates before it opens its ``StreamingResponse``;
* then one ``data: <json>\\n\\n`` event per sampled token, the newest held back so that the
  final event carries it with the finish reason and the spans of weights versions; an error
  event instead if the generation fails after the stream began; ``data: [DONE]\\n\\n`` last,
  as both upstream servers frame it;
* a client that goes away cancels the generation in the engine at once.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Protocol

from aiohttp import web

from rollsafe.adapters.reference_engine.engine import GenerationResult, SamplingParams
from rollsafe.adapters.reference_engine.server import ServerContext, submit_checked

__all__ = ["DONE_EVENT", "StreamRenderer", "sse_event", "stream_generation"]

#: the last event of every stream (SGLang's and vLLM's)
DONE_EVENT = b"data: [DONE]\n\n"


class StreamRenderer(Protocol):
    """Renders one dialect's stream events (JSON objects) for one generation."""

    def token(self, token: int, version: str, logprob: float) -> dict[str, Any] | None:
        """The event after ``token`` was sampled by weights ``version`` with log-probability
        ``logprob`` (None: send nothing)."""

    def final(self, result: GenerationResult) -> dict[str, Any]:
        """The event that ends a generation that finished (stop, length or abort); it carries
        the newest token too (never passed to :meth:`token`), as upstream's last event does."""

    def error(self, exc: BaseException) -> dict[str, Any]:
        """The event sent when the generation failed after the stream began."""


def sse_event(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def stream_generation(
    request: web.Request,
    ctx: ServerContext,
    prompt: list[int],
    params: SamplingParams,
    rid: str | None,
    renderer: StreamRenderer,
) -> web.StreamResponse:
    """Queue ``prompt`` and stream its tokens as ``renderer`` renders them (see the module)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[int, str, float]] = asyncio.Queue()

    def listener(token: int, version: str, logprob: float) -> None:  # engine driver thread
        loop.call_soon_threadsafe(queue.put_nowait, (token, version, logprob))

    futs = submit_checked(ctx, [prompt], [params], [rid], [listener])
    done = asyncio.wrap_future(futs[0])
    resp = web.StreamResponse(
        status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    pending: tuple[int, str, float] | None = None  # the newest token: the final event has it

    async def send(item: tuple[int, str, float]) -> None:
        nonlocal pending
        if pending is not None:
            event = renderer.token(*pending)
            if event is not None:
                await resp.write(sse_event(event))
        pending = item

    try:
        await resp.prepare(request)
        while True:
            while not queue.empty():
                await send(queue.get_nowait())
            if done.done():
                break
            getter: asyncio.Future[tuple[int, str, float]] = asyncio.ensure_future(queue.get())
            waiting: set[asyncio.Future[Any]] = {getter, done}
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                await send(getter.result())
            else:
                getter.cancel()
        exc = done.exception()
        if exc is not None:
            if pending is not None:
                event = renderer.token(*pending)
                if event is not None:
                    await resp.write(sse_event(event))
            await resp.write(sse_event(renderer.error(exc)))
        else:
            await resp.write(sse_event(renderer.final(done.result())))
        await resp.write(DONE_EVENT)
        await resp.write_eof()
    except BaseException:
        ctx.engine.cancel(futs)  # client gone (reset, CancelledError): stop generating for it
        raise
    return resp
