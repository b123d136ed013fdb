"""HTTP plumbing shared by both dialects of the reference engine.

Owns the aiohttp application around a :class:`ReferenceEngine`: JSON body parsing with unknown
key rejection, the body-size limit (413), bearer-token authentication (401), mapping of named
engine errors to HTTP statuses, the routes common to both dialects (``/health``,
``/get_server_info``), fault-injection wiring, and the text codec. The SGLang and vLLM endpoint
sets live in :mod:`.sglang_api` and :mod:`.vllm_api`, their weight checkers in
:mod:`.checker_api`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

from rollsafe.adapters.reference_engine.codec import TextCodec
from rollsafe.adapters.reference_engine.engine import (
    GenerationResult,
    ReferenceEngine,
    SamplingParams,
)
from rollsafe.adapters.reference_engine.errors import BadRequest, EngineError
from rollsafe.adapters.reference_engine.faults import FaultInjector
from rollsafe.adapters.reference_engine.profiling import PROFILE, profile_line

__all__ = [
    "ServerContext",
    "TextCodec",
    "await_future",
    "build_app",
    "read_json",
    "run_generate",
]

T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
CTX_KEY: web.AppKey[ServerContext] = web.AppKey("rollsafe_ctx")
MAX_BODY_KEY: web.AppKey[int] = web.AppKey("rollsafe_max_body_bytes")


@dataclass
class ServerContext:
    engine: ReferenceEngine
    codec: TextCodec
    model_name: str
    dialect: str
    device: str
    rank_pids: list[int]
    extra: dict[str, Any] = field(default_factory=dict)


def ctx_of(request: web.Request) -> ServerContext:
    return request.app[CTX_KEY]


async def await_future(fut: Future[T]) -> T:
    return await asyncio.wrap_future(fut)


async def read_json(
    request: web.Request, *, allowed: Iterable[str], required: Iterable[str] = ()
) -> dict[str, Any]:
    """Parse a JSON object body; reject unknown keys and missing required keys (HTTP 400)."""
    body: Any = request.get(_PARSED_BODY)  # parsed once already by the contract check
    if body is None:
        raw = await request.read()
        if not raw.strip():
            body = {}
        else:
            try:
                body = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise BadRequest(f"malformed JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest(f"JSON body must be an object, got {type(body).__name__}")
    allowed_set = set(allowed)
    unknown = sorted(set(body) - allowed_set)
    if unknown:
        raise BadRequest(
            f"unknown key {unknown[0]!r} for {request.path}; allowed: {sorted(allowed_set)}"
        )
    for key in required:
        if key not in body or body[key] is None:
            raise BadRequest(f"missing required key {key!r} for {request.path}")
    return body


def ok(message: str, **extra: Any) -> web.Response:
    return web.json_response({"success": True, "message": message, **extra})


def want(
    body: dict[str, Any], key: str, types: type | tuple[type, ...], default: Any = None
) -> Any:
    """``body[key]`` checked against ``types`` (bools are not ints); ``default`` when absent."""
    value = body.get(key, default)
    if value is None:
        return default
    bad_bool = isinstance(value, bool) and bool not in (
        types if isinstance(types, tuple) else (types,)
    )
    if bad_bool or not isinstance(value, types):
        names = types.__name__ if isinstance(types, type) else "/".join(t.__name__ for t in types)
        raise BadRequest(f"key {key!r} must be {names}, got {type(value).__name__}")
    return value


def parse_sampling(sp: dict[str, Any], *, defaults: SamplingParams) -> SamplingParams:
    """SGLang-style ``sampling_params`` (also used for mapped vLLM fields)."""
    allowed = {
        "max_new_tokens",
        "min_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop_token_ids",
        "ignore_eos",
        "sampling_seed",
        "seed",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "n",
        "stop",
    }
    unknown = sorted(set(sp) - allowed)
    if unknown:
        raise BadRequest(f"unknown sampling parameter {unknown[0]!r}; allowed: {sorted(allowed)}")
    if want(sp, "n", int, 1) != 1:
        raise BadRequest("sampling parameter 'n' must be 1 (send a batch instead)")
    if want(sp, "stop", (list, str), None):
        raise BadRequest(
            "stop strings are not supported by the reference engine; use stop_token_ids"
        )
    max_new = want(sp, "max_new_tokens", int, defaults.max_new_tokens)
    min_new = want(sp, "min_new_tokens", int, defaults.min_new_tokens)
    temp = float(want(sp, "temperature", (int, float), defaults.temperature))
    top_p = float(want(sp, "top_p", (int, float), defaults.top_p))
    top_k = want(sp, "top_k", int, defaults.top_k)
    stop_ids = want(sp, "stop_token_ids", list, [])
    seed = want(sp, "sampling_seed", int, None)
    seed = want(sp, "seed", int, seed)
    if max_new < 0 or min_new < 0:
        raise BadRequest("max_new_tokens and min_new_tokens must be >= 0")
    if temp < 0:
        raise BadRequest(f"temperature must be >= 0, got {temp}")
    if not 0 < top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise BadRequest("stop_token_ids must be a list of ints")
    return SamplingParams(
        max_new_tokens=max_new,
        min_new_tokens=min_new,
        temperature=temp,
        top_p=top_p,
        top_k=top_k,
        stop_token_ids=tuple(stop_ids),
        ignore_eos=bool(want(sp, "ignore_eos", bool, defaults.ignore_eos)),
        seed=seed,
    )


def parse_prompts(ctx: ServerContext, text: Any, input_ids: Any) -> tuple[list[list[int]], bool]:
    """``(prompts, is_batch)`` from SGLang's ``text`` / ``input_ids`` (exactly one given)."""
    if (text is None) == (input_ids is None):
        raise BadRequest("give exactly one of 'text' and 'input_ids'")
    if text is not None:
        if isinstance(text, str):
            return [ctx.codec.encode(text)], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [ctx.codec.encode(t) for t in text], True
        raise BadRequest("'text' must be a string or a non-empty list of strings")
    if isinstance(input_ids, list) and input_ids and all(_is_int(t) for t in input_ids):
        return [list(input_ids)], False
    if (
        isinstance(input_ids, list)
        and input_ids
        and all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in input_ids)
    ):
        return [list(p) for p in input_ids], True
    raise BadRequest("'input_ids' must be a non-empty list of ints or a list of such lists")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


async def run_generate(
    ctx: ServerContext,
    prompts: list[list[int]],
    params: list[SamplingParams],
    rids: list[str | None],
) -> list[GenerationResult]:
    futs = [
        ctx.engine.submit_generate(p, sp, rid)
        for p, sp, rid in zip(prompts, params, rids, strict=False)
    ]
    return list(await asyncio.gather(*(await_future(f) for f in futs)))


# ---- middlewares ---------------------------------------------------------------------------
@web.middleware
async def profile_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """``ROLLSAFE_ENGINE_PROFILE=1``: one ``rollsafe-profile op=http/<path>`` line per request."""
    t0 = time.perf_counter()
    try:
        return await handler(request)
    finally:
        profile_line(f"http{request.path}", 0, time.perf_counter() - t0)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except EngineError as exc:
        return web.json_response(
            {"success": False, "message": str(exc), "error": type(exc).__name__},
            status=exc.status,
        )
    except web.HTTPRequestEntityTooLarge as exc:
        return web.json_response(
            {
                "success": False,
                "message": f"request body too large: {exc.text or ''} (limit "
                f"{request.app[MAX_BODY_KEY]} bytes, --max-body-bytes)",
                "error": "PayloadTooLarge",
            },
            status=413,
        )
    except web.HTTPException:
        raise
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        return web.json_response(
            {"success": False, "message": f"{type(exc).__name__}: {exc}", "error": "InternalError"},
            status=500,
        )


_PARSED_BODY = "rollsafe.json_body"
#: routes the reference engine serves on top of its dialect (fault injection, its own info)
_OWN_ROUTES = ("/get_server_info", "/fault/")


def contract_middleware(dialect: str) -> Callable[..., Any]:
    """Refuse, with a 400 naming every offending key, what the pinned upstream release would not
    understand (``rollsafe/adapters/engines/contracts``): unknown routes, methods, body keys,
    query parameters, missing keys, wrong types, values outside a literal domain. Stricter than
    upstream where upstream silently ignores a key (docs/engines.md lists where)."""
    from rollsafe.adapters.engines.contract import load_contract

    contract = load_contract("sglang" if dialect == "sglang" else "vllm")

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if path.startswith(_OWN_ROUTES) or path not in contract.routes():
            return await handler(request)
        raw = await request.read()
        body: Any = None
        if raw.strip():
            try:
                body = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError):
                return await handler(request)  # read_json names the JSON error
        query: dict[str, Any] = {}
        for key in request.query:
            values = request.query.getall(key)
            query[key] = values if len(values) > 1 else values[0]
        if body is not None:
            request[_PARSED_BODY] = body
        problems = contract.check_request(request.method, path, query=query, body=body)
        if problems:
            raise BadRequest(
                f"{request.method} {path} does not match {contract.label}: "
                + "; ".join(_violation_text(p.where, p.problem) for p in problems[:8])
            )
        return await handler(request)

    return check


def _violation_text(where: str, problem: str) -> str:
    """``key 'temprature' in sampling_params: unknown key ...`` (the key quoted, then where)."""
    parent, _, leaf = where.rpartition(".")
    return f"key {_clip(leaf)!r}" + (f" in {_clip(parent)}" if parent else "") + f": {problem}"


def _clip(text: str, limit: int = 64) -> str:
    """A key as a client sent it, bounded (a hostile key can be megabytes long)."""
    return text if len(text) <= limit else f"{text[: limit // 2]}...{text[-limit // 4 :]}"


def auth_middleware(api_key: str | None) -> Callable[..., Any]:
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if api_key is not None:
            header = request.headers.get("Authorization", "")
            token = header[7:] if header.startswith("Bearer ") else ""
            if not hmac.compare_digest(token.encode(), api_key.encode()):
                return web.json_response(
                    {
                        "success": False,
                        "message": "missing or wrong 'Authorization: Bearer' key",
                        "error": "Unauthorized",
                    },
                    status=401,
                )
        return await handler(request)

    return check


# ---- common routes -------------------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
    reason = ctx_of(request).engine.health()
    if reason is not None:
        return web.json_response({"success": False, "message": f"unhealthy: {reason}"}, status=503)
    return web.Response(status=200)


async def server_info(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    e = ctx.engine
    return web.json_response(
        {
            "model_path": ctx.model_name,
            "dialect": ctx.dialect,
            "device": ctx.device,
            "ranks": e.ranks.world_size,
            "rank_pids": ctx.rank_pids,
            "weight_version": e.weight_version,
            "tokenizer_path": str(ctx.codec.path) if ctx.codec.tokenizer is not None else None,
            "paused": e.paused,
            "released": e.released_tags,
            "running_requests": e.num_running,
            "healthy": e.health() is None,
            "pid": os.getpid(),
        }
    )


def build_app(
    ctx: ServerContext,
    *,
    api_key: str | None,
    max_body_bytes: int,
    faults: FaultInjector,
) -> web.Application:
    """The aiohttp application for ``ctx.dialect`` (``"sglang"`` or ``"vllm"``)."""
    app = web.Application(
        client_max_size=max_body_bytes,
        middlewares=[
            *([profile_middleware] if PROFILE else []),
            faults.middleware,
            error_middleware,
            auth_middleware(api_key),
            contract_middleware(ctx.dialect),
        ],
    )
    app[CTX_KEY] = ctx
    app[MAX_BODY_KEY] = max_body_bytes
    app.add_routes([web.get("/get_server_info", server_info), *faults.routes()])
    if ctx.dialect == "vllm":
        app.add_routes([web.get("/health", health)])  # vLLM: pause does not affect it
    from rollsafe.adapters.reference_engine import checker_api

    app.add_routes(checker_api.routes(ctx.dialect))  # /weights_checker or /weight_checker
    if ctx.dialect == "sglang":
        from rollsafe.adapters.reference_engine import sglang_api

        app.add_routes(sglang_api.routes())
    elif ctx.dialect == "vllm":
        from rollsafe.adapters.reference_engine import vllm_api

        app.add_routes(vllm_api.routes())
    else:
        raise ValueError(f"dialect must be 'sglang' or 'vllm', got {ctx.dialect!r}")
    return app
