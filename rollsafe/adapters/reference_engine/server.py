"""HTTP plumbing shared by both dialects of the reference engine.

Owns the aiohttp application around a :class:`ReferenceEngine`: JSON body parsing checked
against the imitated release's contract, unknown keys treated as that release treats them
(:func:`contract_middleware`, :func:`read_json`; hostile JSON -- NaN, 1e400, lone surrogates,
deep nesting -- is a named 400; :func:`parse_json` is :mod:`rollsafe.wire.strict_json` with the
real engines' options), the
request limits (:class:`ServerLimits`: body size checked against ``Content-Length`` before
reading (413), bytes of bodies in flight across connections (503), body read and idle timeouts
(408), prompts and new tokens per request (400), concurrent generations (503), connections,
header timeout), cancelling a generation whose client went
away, bearer-token authentication (401), mapping of named engine errors to HTTP statuses (a
vLLM route's escaped exception: a 500 whose connection is then reset, as uvicorn does), the
routes common to both dialects (``/health``, ``/get_server_info``), fault-injection wiring, and
the text codec. :func:`start_server` serves an app under those limits. The SGLang and vLLM
endpoint sets live in :mod:`.sglang_api` and :mod:`.vllm_api`, their weight checkers in
:mod:`.checker_api`. docs/security.md lists the limits and their flags.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import hmac
import itertools
import json
import logging
import math
import os
import sys
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

from aiohttp import web

from rollsafe.adapters.reference_engine.codec import TextCodec
from rollsafe.adapters.reference_engine.dialects import VLLMRelease
from rollsafe.adapters.reference_engine.engine import (
    SEED_RANGE,
    GenerationResult,
    ReferenceEngine,
    SamplingParams,
    TokenListener,
)
from rollsafe.adapters.reference_engine.errors import (
    BadRequest,
    BodyBudgetExceeded,
    EngineDead,
    LimitExceeded,
    RequestTimeout,
    ServerError,
    WeightUpdateError,
    WorkerFailed,
)
from rollsafe.adapters.reference_engine.faults import FaultInjector
from rollsafe.adapters.reference_engine.profiling import PROFILE, profile_line
from rollsafe.adapters.reference_engine.stops import StopRules
from rollsafe.wire.strict_json import BadJSON, loads_bounded

if TYPE_CHECKING:
    from rollsafe.adapters.engines.contract import EngineContract

_log = logging.getLogger("rollsafe.reference_engine")

__all__ = [
    "ServerContext",
    "ServerLimits",
    "await_future",
    "build_app",
    "check_disk_path",
    "disk_update",
    "parse_json",
    "read_body",
    "read_json",
    "run_generate",
    "start_server",
    "submit_checked",
]

T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
CTX_KEY: web.AppKey[ServerContext] = web.AppKey("rollsafe_ctx")
LIMITS_KEY: web.AppKey[ServerLimits] = web.AppKey("rollsafe_limits")
MAX_BODY_KEY: web.AppKey[int] = web.AppKey("rollsafe_max_body_bytes")
BUDGET_KEY: web.AppKey[BodyBudget] = web.AppKey("rollsafe_body_budget")


@dataclass(frozen=True)
class ServerLimits:
    """What one request, and the server as a whole, may use; the flag of each in brackets.

    Defaults are documented in docs/security.md ("Limits"); the command line checks the
    values (``__main__.LIMIT_FLAGS``).
    """

    #: request body bytes; a larger ``Content-Length`` is a 413 before reading [--max-body-bytes]
    max_body_bytes: int = 64 << 20
    #: prompts in one generation request [--max-prompts-per-request]
    max_prompts: int = 1024
    #: sum over a request's prompts of ``max_new_tokens`` [--max-total-new-tokens]
    max_total_new_tokens: int = 1 << 18
    #: prompts queued or running in the engine; past it a request is a 503, not queued
    #: [--max-concurrent-requests]
    max_concurrent_requests: int = 1024
    #: open HTTP connections; one more is answered 503 and closed [--max-connections]
    max_connections: int = 512
    #: seconds for a request's headers (from connect, or from the previous response on a
    #: kept-alive connection) [--header-timeout]
    header_timeout_s: float = 30.0
    #: seconds a kept-alive connection stays open after a response with no new request
    #: (SGLang's and vLLM's uvicorn ``timeout_keep_alive``: ``$SGLANG_TIMEOUT_KEEP_ALIVE``,
    #: ``$VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 by default; see ``KEEPALIVE_ENV`` in ``__main__``)
    keepalive_timeout_s: float = 5.0
    #: seconds for a request's body, from the start of its handling [--body-timeout]
    body_timeout_s: float = 60.0
    #: longest pause, in seconds, between two pieces of a request's body (a slow-loris client
    #: trickling a few bytes now and then is a 408 after this, not after --body-timeout)
    #: [--body-idle-timeout]
    body_idle_timeout_s: float = 5.0
    #: bytes of request bodies being read or held by their handlers, all connections together
    #: (declared ``Content-Length``, else the bytes read so far); a body that would take the
    #: sum past it is a 503 before it is read [--max-inflight-body-bytes]
    max_inflight_body_bytes: int = 256 << 20


@dataclass
class ServerContext:
    engine: ReferenceEngine
    codec: TextCodec
    model_name: str
    dialect: str
    device: str
    rank_pids: list[int]
    extra: dict[str, Any] = field(default_factory=dict)
    limits: ServerLimits = field(default_factory=ServerLimits)
    #: the vLLM release the vLLM dialect imitates (``--vllm-version``)
    vllm: VLLMRelease = field(default_factory=VLLMRelease)


def ctx_of(request: web.Request) -> ServerContext:
    return request.app[CTX_KEY]


async def await_future(fut: Future[T]) -> T:
    return await asyncio.wrap_future(fut)


# ---- request bodies ------------------------------------------------------------------------
def parse_json(raw: bytes) -> Any:
    """A JSON document from ``raw``, or a :class:`BadRequest` naming what is wrong.

    The shared strict parser (:func:`rollsafe.wire.strict_json.loads_bounded`) with what the
    real servers accept (Python's json behind SGLang's and vLLM's FastAPI): a duplicate key is
    allowed and the last one wins; integers of up to 4300 digits (Python's limit); nesting up to
    the interpreter's recursion limit (a 100k-deep array is refused, not a 500). Stricter than
    them, so that nothing hostile reaches a handler: UTF-8 only; no ``NaN`` / ``Infinity`` and
    no number that overflows a float (``1e400``); no lone UTF-16 surrogate in any string or key.
    """
    try:
        return loads_bounded(
            raw, max_depth=None, duplicate_keys=True, max_int_digits=None, lone_surrogates=False
        )
    except BadJSON as exc:
        raise BadRequest(f"malformed JSON body: {exc}") from exc


_BODY_BYTES = "rollsafe.body_bytes"
_RAW_BODY = "rollsafe.raw_body"
_BUDGET_TAKEN = "rollsafe.budget_taken"
#: bodies at least this large give their memory back to the OS once answered
_TRIM_AFTER_BYTES = 1 << 20


class BodyBudget:
    """The bytes of request bodies in flight (``--max-inflight-body-bytes``), all connections
    together; touched only on the event loop."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, nbytes: int) -> bool:
        """Count ``nbytes`` more; False (nothing counted) if that would pass the limit."""
        if self.used + nbytes > self.limit:
            return False
        self.used += nbytes
        return True

    def give(self, nbytes: int) -> None:
        self.used = max(0, self.used - nbytes)

    def refusal(self, nbytes: int) -> str:
        return (
            f"request bodies in flight would take {self.used + nbytes} bytes; the limit is "
            f"{self.limit} (--max-inflight-body-bytes); retry later"
        )


async def read_body(request: web.Request) -> bytes:
    """The request body (read once; later calls get the same bytes), each piece within
    ``--body-idle-timeout`` of the previous one and the whole within ``--body-timeout`` (else
    :class:`RequestTimeout`, 408), at most ``--max-body-bytes`` (else 413; a larger
    ``Content-Length`` was refused before reading). A body without a ``Content-Length`` counts
    against ``--max-inflight-body-bytes`` as it arrives (:class:`BodyBudgetExceeded`, 503)."""
    cached: bytes | None = request.get(_RAW_BODY)
    if cached is not None:
        return cached
    limits = request.app[LIMITS_KEY]
    declared = request.content_length
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limits.body_timeout_s
    pieces: list[bytes] = []
    try:
        raw = await _read_pieces(request, pieces, limits, deadline, declared is None)
    finally:
        pieces.clear()  # at once, also when the client went away or was refused: not at a GC
    request[_BODY_BYTES] = len(raw)
    request[_RAW_BODY] = raw
    return raw


async def _read_pieces(
    request: web.Request,
    pieces: list[bytes],
    limits: ServerLimits,
    deadline: float,
    counted: bool,
) -> bytes:
    """The body of :func:`read_body`, its pieces kept in ``pieces`` and joined once (one
    allocation of the body's size, not a growing copy)."""
    budget = request.app[BUDGET_KEY]
    loop = asyncio.get_running_loop()
    size = 0
    while True:
        left = deadline - loop.time()
        idle = limits.body_idle_timeout_s < left
        try:
            chunk = await asyncio.wait_for(
                request.content.readany(), min(limits.body_idle_timeout_s, max(left, 0.0))
            )
        except (TimeoutError, asyncio.TimeoutError) as exc:
            raise RequestTimeout(
                f"request body stalled: nothing received for {limits.body_idle_timeout_s:g} s "
                f"after {size} bytes (--body-idle-timeout)"
                if idle
                else f"request body not received within {limits.body_timeout_s:g} s "
                f"(--body-timeout); {size} bytes arrived"
            ) from exc
        if not chunk:
            break
        if size + len(chunk) > limits.max_body_bytes:
            raise web.HTTPRequestEntityTooLarge(
                max_size=limits.max_body_bytes,
                actual_size=size + len(chunk),
                text=f"more than {size + len(chunk) - 1} bytes sent",
            )
        if counted:  # no Content-Length: counted as it arrives; given back when the request is done
            if not budget.take(len(chunk)):
                raise BodyBudgetExceeded(budget.refusal(len(chunk)))
            request[_BUDGET_TAKEN] = request.get(_BUDGET_TAKEN, 0) + len(chunk)
        pieces.append(chunk)
        size += len(chunk)
    return b"".join(pieces)


async def read_json(
    request: web.Request, *, allowed: Iterable[str], required: Iterable[str] = ()
) -> dict[str, Any]:
    """Parse a JSON object body: the keys the handler implements (``allowed``), every required
    one present (else a 400 naming it).

    On a route of the imitated release's contract (checked by :func:`contract_middleware`),
    the other keys are what that release does with them: one its request model does not
    declare is dropped (logged at debug level where the release logs it, as vLLM's
    ``/v1/completions`` does); one it declares but the reference engine does not implement is
    dropped at the release's default value (it has no effect there) and refused otherwise, a
    400 naming the key. Elsewhere (the engine's own routes) any other key is a 400."""
    body = await request_body(request)
    allowed_set = set(allowed)
    contract = request.get(_CONTRACT)
    unknown = sorted(set(body) - allowed_set)
    if unknown and contract is not None:
        body = {k: v for k, v in body.items() if k in allowed_set or not _no_effect(request, k, v)}
        unknown = sorted(set(body) - allowed_set)
        if unknown:
            key = unknown[0]
            has, default = contract.body_default(request.path, key)
            only = f"; only its default {default!r} is accepted" if has else ""
            raise BadRequest(
                f"key {key!r} for {request.path}: {contract.label} knows it but the reference "
                f"engine does not implement it{only}; implemented: {sorted(allowed_set)}"
            )
    elif unknown:
        raise BadRequest(
            f"unknown key {unknown[0]!r} for {request.path}; allowed: {sorted(allowed_set)}"
        )
    for key in required:
        if key not in body or body[key] is None:
            raise BadRequest(f"missing required key {key!r} for {request.path}")
    return body


async def request_body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object body (``{}`` when empty; a 400 when not an object), without
    the top-level keys the imitated release does not declare for this route: it drops them
    (``ignore``) or keeps them unread (``allow``, ``allow_and_log``: logged here at debug level
    as vLLM logs them), so no handler sees them. On a route outside the contract the body is
    returned as sent."""
    body: Any = request.get(_PARSED_BODY)  # parsed once already by the contract check
    if body is None:
        raw = await read_body(request)
        body = {} if not raw.strip() else parse_json(raw)
    if not isinstance(body, dict):
        raise BadRequest(f"JSON body must be an object, got {type(body).__name__}")
    contract: EngineContract | None = request.get(_CONTRACT)
    if contract is None:
        return body
    known = contract.body_fields(request.path)
    dropped = sorted(k for k in body if k not in known)
    if not dropped:
        return body
    if contract.unknown_key_policy(request.path) == "allow_and_log":
        _log.debug("The following fields were present in the request but ignored: %s", set(dropped))
    return {k: v for k, v in body.items() if k in known}


def _no_effect(request: web.Request, key: str, value: Any) -> bool:
    """Whether ``value`` of the body key ``key`` is what the imitated release assumes when the
    key is left out (null, or the request model's default): then a handler that does not
    implement the key serves the request as that release would."""
    if value is None:
        return True
    contract: EngineContract = request[_CONTRACT]
    has, default = contract.body_default(request.path, key)
    if not has:
        return False
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    return bool(value == default)


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


#: the dialect's rules for how a request's generation ends, from its sampling parameters (the
#: SGLang-style dict :func:`parse_sampling` read) and what was parsed of them so far; raises
#: :class:`BadRequest` for what the imitated release refuses (too many stop strings...)
StopFactory = Callable[[dict[str, Any], SamplingParams], StopRules]


def parse_sampling(
    sp: dict[str, Any], *, defaults: SamplingParams, stops: StopFactory
) -> SamplingParams:
    """SGLang-style ``sampling_params`` (also used for mapped vLLM fields); ``stops`` reads the
    stop strings and whether a matched stop stays in the text, as the dialect's release does."""
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
    max_new = want(sp, "max_new_tokens", int, defaults.max_new_tokens)
    min_new = want(sp, "min_new_tokens", int, defaults.min_new_tokens)
    temp = _finite(want(sp, "temperature", (int, float), defaults.temperature), "temperature")
    top_p = _finite(want(sp, "top_p", (int, float), defaults.top_p), "top_p")
    top_k = want(sp, "top_k", int, defaults.top_k)
    stop_ids = want(sp, "stop_token_ids", list, [])
    seed = want(sp, "sampling_seed", int, None)
    seed = want(sp, "seed", int, seed)
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise BadRequest(f"seed must be within the int64 range [-2^63, 2^63 - 1], got {_int(seed)}")
    if max_new < 0 or min_new < 0:
        raise BadRequest("max_new_tokens and min_new_tokens must be >= 0")
    if temp < 0:
        raise BadRequest(f"temperature must be >= 0, got {temp}")
    if 0 < temp < sys.float_info.min:
        raise BadRequest(f"temperature {temp!r} is subnormal: give 0 (greedy) or a normal number")
    if not 0 < top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise BadRequest("stop_token_ids must be a list of ints")
    params = SamplingParams(
        max_new_tokens=max_new,
        min_new_tokens=min_new,
        temperature=temp,
        top_p=top_p,
        top_k=top_k,
        stop_token_ids=tuple(stop_ids),
        ignore_eos=bool(want(sp, "ignore_eos", bool, defaults.ignore_eos)),
        seed=seed,
    )
    return dataclasses.replace(params, stops=stops(sp, params))


def stop_strings(sp: dict[str, Any]) -> tuple[str, ...]:
    """``sp["stop"]`` (a string, a list of strings, or null) as a tuple."""
    value = want(sp, "stop", (list, str), None)
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not all(isinstance(v, str) for v in value):
        raise BadRequest("key 'stop' must be a string or a list of strings")
    return tuple(value)


def _finite(value: int | float, key: str) -> float:
    try:
        number = float(value)
    except OverflowError as exc:  # an int too large for a float
        raise BadRequest(f"{key} is too large: {_int(int(value))}") from exc
    if not math.isfinite(number):
        raise BadRequest(f"{key} must be a finite number, got {number}")
    return number


def _int(value: int) -> str:
    """An int for an error message, bounded (a hostile one can have thousands of digits)."""
    return str(value) if abs(value) < 2**128 else f"<an integer of {value.bit_length()} bits>"


def check_prompt_count(ctx: ServerContext, count: int) -> None:
    """:class:`LimitExceeded` if a request carries more prompts than ``--max-prompts-per-request``
    (checked before any prompt is tokenized)."""
    if count > ctx.limits.max_prompts:
        raise LimitExceeded(
            f"request has {count} prompts; the limit is {ctx.limits.max_prompts} "
            "(--max-prompts-per-request)"
        )


def parse_prompts(ctx: ServerContext, text: Any, input_ids: Any) -> tuple[list[list[int]], bool]:
    """``(prompts, is_batch)`` from SGLang's ``text`` / ``input_ids`` (exactly one given)."""
    if (text is None) == (input_ids is None):
        raise BadRequest("give exactly one of 'text' and 'input_ids'")
    if isinstance(text if text is not None else input_ids, list):
        batch = text if text is not None else input_ids
        if batch and not _is_int(batch[0]):
            check_prompt_count(ctx, len(batch))
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


#: the files a directory needs for a disk update to read it
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def check_disk_path(value: Any, key: str) -> str:
    """``value`` if it names a model directory this engine can read, else one
    :class:`WeightUpdateError` (400) whatever the reason: a path that does not exist, is not a
    directory, cannot be read by the engine or holds no weights all get the same message, which
    quotes only what the client sent. A disk update thus tells a client nothing about the
    engine host's files beyond "loadable or not" (``/update_weights_from_disk``, vLLM
    ``reload_weights``)."""
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{key} must be a non-empty path string")
    shown = repr(_clip(value, 120))
    encoded = value.encode("utf-8", "surrogateescape")
    if len(encoded) >= 4096 or any(len(part) > 255 for part in encoded.split(b"/")):
        # judged from the string alone (PATH_MAX, NAME_MAX): says nothing about the host
        raise WeightUpdateError(f"{key} {shown} cannot be used: File name too long")
    unusable = WeightUpdateError(
        f"{key} {shown} is not a directory this engine can load weights from: it does not "
        "exist, is not a directory, cannot be read by the engine, or has neither "
        f"{' nor '.join(_WEIGHT_FILES)}"
    )
    try:
        path = Path(value)
        usable = (
            path.is_dir()
            and os.access(path, os.R_OK | os.X_OK)
            and any(
                (path / name).is_file() and os.access(path / name, os.R_OK)
                for name in _WEIGHT_FILES
            )
        )
    except (OSError, ValueError):  # ENAMETOOLONG, ELOOP, embedded NUL...
        usable = False
    if not usable:
        raise unusable
    return value


async def disk_update(
    ctx: ServerContext, path: str, key: str, weight_version: str | None, abort: bool = False
) -> list[str]:
    """A disk update of ``path`` (checked by :func:`check_disk_path` first); an error message
    from the load names the path as the client sent it, never its absolute form."""
    check_disk_path(path, key)
    try:
        return await await_future(ctx.engine.update_from_disk(path, weight_version, abort))
    except ServerError as exc:
        absolute = os.path.abspath(path)
        message = str(exc)
        if absolute != path and absolute in message:
            raise type(exc)(message.replace(absolute, path)) from None
        raise


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def submit_checked(
    ctx: ServerContext,
    prompts: list[list[int]],
    params: list[SamplingParams],
    rids: list[str | None],
    listeners: list[TokenListener | None] | None = None,
) -> list[Future[GenerationResult]]:
    """Check the request limits (see :func:`run_generate`), then queue every prompt."""
    limits = ctx.limits
    check_prompt_count(ctx, len(prompts))
    total = sum(sp.max_new_tokens for sp in params)
    if total > limits.max_total_new_tokens:
        raise LimitExceeded(
            f"request asks for {_int(total)} new tokens in all (max_new_tokens summed over its "
            f"{len(prompts)} prompts); the limit is {limits.max_total_new_tokens} "
            "(--max-total-new-tokens)"
        )
    return ctx.engine.submit_batch(
        prompts, params, rids, max_running=limits.max_concurrent_requests, listeners=listeners
    )


async def run_generate(
    ctx: ServerContext,
    prompts: list[list[int]],
    params: list[SamplingParams],
    rids: list[str | None],
) -> list[GenerationResult]:
    """Generate every prompt of one request, or refuse all of it before any is queued.

    The request limits are checked first (``--max-prompts-per-request``,
    ``--max-total-new-tokens``: 400; ``--max-concurrent-requests``: 503), then the engine
    checks every prompt before queueing any. If the handler is cancelled (its client
    disconnected) or one prompt fails, the engine aborts the others at once.
    """
    futs = submit_checked(ctx, prompts, params, rids)
    try:
        return list(await asyncio.gather(*(await_future(f) for f in futs)))
    except BaseException:
        ctx.engine.cancel(futs)  # client gone (CancelledError) or one prompt failed
        raise


# ---- middlewares ---------------------------------------------------------------------------
def keepalive_middleware(idle_s: float) -> Any:
    """Close a kept-alive connection that starts no new request within ``idle_s`` after its
    last one was answered, as SGLang's and vLLM's uvicorn does (``timeout_keep_alive``, armed
    when a response completes). A client that reuses such a connection after that meets a
    closed one, as it would on the real engines (docs/security.md, "Limits")."""
    last: weakref.WeakKeyDictionary[asyncio.BaseTransport, int] = weakref.WeakKeyDictionary()
    serial = itertools.count(1)

    def close_if_idle(transport: asyncio.BaseTransport, protocol: object, n: int) -> None:
        # a request parsed but not yet handled (its bytes arrived in time, the loop ran late)
        # keeps the connection, as uvicorn's data_received cancels its timer
        idle = last.get(transport) == n and not getattr(protocol, "_messages", None)
        if idle and not transport.is_closing():
            transport.close()

    @web.middleware
    async def keepalive(request: web.Request, handler: Handler) -> web.StreamResponse:
        transport, n = request.transport, next(serial)
        if transport is not None:
            try:
                last[transport] = -n  # a request in progress: no idle close counts it
            except TypeError:  # a transport that takes no weak reference: never closed idle
                transport = None
        try:
            return await handler(request)
        finally:
            if transport is not None and last.get(transport) == -n:
                last[transport] = n
                asyncio.get_running_loop().call_later(
                    idle_s, close_if_idle, transport, request.protocol, n
                )

    return keepalive


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
    except ServerError as exc:
        if isinstance(exc, (WorkerFailed, EngineDead)):  # vLLM's own error body
            resp = web.json_response(_vllm_error(str(exc), exc.status), status=exc.status)
        else:
            resp = web.json_response(
                {"success": False, "message": str(exc), "error": type(exc).__name__},
                status=exc.status,
            )
        if isinstance(exc, RequestTimeout):
            resp.force_close()  # the rest of the body is not waited for
        if exc.drops_connection:
            return await _answer_then_drop(request, resp)
        return resp
    except web.HTTPRequestEntityTooLarge as exc:
        return _too_large(request, exc.text or "")
    except web.HTTPException:
        raise
    except asyncio.CancelledError:
        raise
    except RecursionError:  # a deeply nested value that parsed but cannot be walked
        return web.json_response(
            {"success": False, "message": "request nested too deeply", "error": "BadRequest"},
            status=400,
        )
    except Exception as exc:
        if request.app[CTX_KEY].dialect == "vllm":  # an exception escaping a vLLM route
            resp = web.json_response(_vllm_error(f"{type(exc).__name__}: {exc}", 500), status=500)
            return await _answer_then_drop(request, resp)
        return web.json_response(
            {"success": False, "message": f"{type(exc).__name__}: {exc}", "error": "InternalError"},
            status=500,
        )


def _vllm_error(message: str, status: int) -> dict[str, Any]:
    """vLLM's error body (``ErrorResponse``): ``{"error": {message, type, param, code}}``."""
    kind = "InternalServerError" if status >= 500 else "BadRequestError"
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


#: seconds between a dropped connection's answer and its reset (uvicorn logs the exception's
#: traceback in between; a client's next request on the connection arrives in that window)
DROP_AFTER_S = 0.2


async def _answer_then_drop(request: web.Request, resp: web.Response) -> web.Response:
    """Write ``resp`` as a kept-alive answer (no ``Connection: close``), read nothing more from
    the connection and reset it shortly after: what uvicorn does once an exception escaped a
    vLLM route and its 500 was sent. A client that reuses the pooled connection at once gets
    ECONNRESET before its request was read (docs/engines.md, "The reference engine's vLLM
    dialect")."""
    await resp.prepare(request)
    await resp.write_eof()
    transport = request.transport
    if transport is not None:
        transport.pause_reading()
        asyncio.get_running_loop().call_later(DROP_AFTER_S, transport.abort)
    return resp


def _too_large(request: web.Request, detail: str) -> web.Response:
    resp = web.json_response(
        {
            "success": False,
            "message": f"request body too large: {detail} (limit "
            f"{request.app[MAX_BODY_KEY]} bytes, --max-body-bytes)",
            "error": "PayloadTooLarge",
        },
        status=413,
    )
    resp.force_close()  # the body is never read: the connection cannot be reused
    return resp


def _over_budget(budget: BodyBudget, nbytes: int) -> web.Response:
    resp = web.json_response(
        {"success": False, "message": budget.refusal(nbytes), "error": "BodyBudgetExceeded"},
        status=503,
    )
    resp.force_close()  # the body is never read: the connection cannot be reused
    return resp


def body_limit_middleware(trimmer: _MemoryTrimmer) -> Callable[..., Any]:
    """A ``Content-Length`` above ``--max-body-bytes`` is a 413, and one that would take the
    bodies in flight past ``--max-inflight-body-bytes`` a 503, before any of the body is read;
    the declared bytes count until the request is answered. Once the last request with a large
    body is gone, its memory goes back to the OS (:class:`_MemoryTrimmer`)."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        declared = request.content_length
        limit = request.app[MAX_BODY_KEY]
        budget = request.app[BUDGET_KEY]
        if declared is not None and declared > limit:
            return _too_large(request, f"Content-Length {declared}")
        if declared and not budget.take(declared):
            return _over_budget(budget, declared)
        request[_BUDGET_TAKEN] = declared or 0
        try:
            return await handler(request)
        finally:
            budget.give(request.get(_BUDGET_TAKEN, 0))
            request.pop(_RAW_BODY, None)  # the body's bytes are not kept with the request
            if max(declared or 0, request.get(_BODY_BYTES, 0)) >= _TRIM_AFTER_BYTES:
                trimmer.track(request)

    return check


class _MemoryTrimmer:
    """Gives the heap's free memory back to the OS (glibc ``malloc_trim``) ``delay_s`` after a
    request with a large body is answered and again ``delay_s`` after it is gone (each time
    put off by the next such event: one trim for a burst): glibc keeps freed blocks of large
    bodies in its arenas otherwise, so concurrent large bodies would ratchet the RSS up.

    The first frees what the handlers let go of (a cut body's pieces), the second what lives as
    long as the request object: the raw bytes, the parsed body and a refusal's traceback (whose
    frames hold both), freed after the answer was written or, in a reference cycle, at a garbage
    collection. A trim timed from the answers alone ran, on a loaded machine, before the last
    bodies were freed and left them resident for good (CI: 12 MiB kept after a burst)."""

    def __init__(self, delay_s: float = 0.2, trim: Callable[[int], int] | None = None) -> None:
        self.delay_s = delay_s
        #: large-body requests tracked and not yet freed
        self.alive = 0
        #: trims run so far
        self.runs = 0
        self._handle: asyncio.TimerHandle | None = None
        self._trim: Callable[[int], int] | None = trim
        if trim is None:
            with contextlib.suppress(OSError, AttributeError):
                self._trim = ctypes.CDLL("libc.so.6").malloc_trim

    def track(self, request: object) -> None:
        """Trim ``delay_s`` from now and ``delay_s`` after ``request`` is freed."""
        if self._trim is None:
            return
        loop = asyncio.get_running_loop()
        self.alive += 1
        done = weakref.finalize(request, self._gone, loop)
        done.atexit = False
        self._soon(loop)

    def _gone(self, loop: asyncio.AbstractEventLoop) -> None:
        self.alive -= 1
        if not loop.is_closed():
            self._soon(loop)

    def _soon(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle = loop.call_later(self.delay_s, self._run)

    def _run(self) -> None:
        self._handle = None
        if self._trim is not None:
            self._trim(0)
            self.runs += 1


_PARSED_BODY = "rollsafe.json_body"
_CONTRACT = "rollsafe.contract"  # the contract the request was checked against
#: routes the reference engine serves on top of its dialect (fault injection, its own info)
_OWN_ROUTES = ("/get_server_info", "/server_info", "/fault/")
#: the SGLang release the ``sglang`` dialect imitates (reported as ``"version"``)
SGLANG_VERSION = "0.5.23"


def contract_middleware(dialect: str, version: str | None = None) -> Callable[..., Any]:
    """Refuse, with a 400 naming every offending key, what the imitated release refuses
    (``rollsafe/adapters/engines/contracts``): unknown routes and methods, missing keys, wrong
    types, values outside a literal domain, and unknown keys where the release rejects them
    (SGLang's ``sampling_params``, vLLM's ``init_info``); unknown keys it ignores or only logs
    pass, and :func:`read_json` drops them before a handler sees the body (docs/engines.md,
    "Unknown keys"). ``version`` picks that release's committed contract, the pinned one when
    none is committed for it."""
    from rollsafe.adapters.engines.contract import load_contract

    engine: Literal["sglang", "vllm"] = "sglang" if dialect == "sglang" else "vllm"
    try:
        contract = load_contract(engine, version)
    except ValueError:  # no committed contract for this release: the pinned one
        contract = load_contract(engine)

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if path.startswith(_OWN_ROUTES) or path not in contract.routes():
            return await handler(request)
        body: Any = None
        if contract.route(path)["body"] is None:
            # the release's handler declares no body: it never reads one, whatever it holds
            request[_PARSED_BODY] = {}
        else:
            raw = await read_body(request)
            body = parse_json(raw) if raw.strip() else None
        query: dict[str, Any] = {}
        for key in request.query:
            values = request.query.getall(key)
            query[key] = values if len(values) > 1 else values[0]
        if body is not None:
            request[_PARSED_BODY] = body
        request[_CONTRACT] = contract
        try:
            problems = contract.check_request(
                request.method, path, query=query, body=body, unknown_keys="upstream"
            )
        except RecursionError as exc:
            raise BadRequest("malformed JSON body: nested too deeply") from exc
        problems = [p for p in problems if not _worker_checked(dialect, path, p.where)]
        if problems:
            raise BadRequest(
                f"{request.method} {path} does not match {contract.label}: "
                + "; ".join(_violation_text(p.where, p.problem) for p in problems[:8])
            )
        return await handler(request)

    return check


#: (dialect, route) -> body keys whose content the upstream server does not check at its HTTP
#: layer but in the worker, mid-update: vLLM's ``update_info`` is a free dict there, parsed by
#: the weight-transfer engine inside the update, where a bad one poisons the weights; the
#: handler fails it that way (:mod:`.vllm_api`) instead of a 400 up front
_WORKER_CHECKED = {("vllm", "/update_weights"): ("update_info.", "update_info[")}


def _worker_checked(dialect: str, path: str, where: str) -> bool:
    prefixes = _WORKER_CHECKED.get((dialect, path))
    return prefixes is not None and where.startswith(prefixes)


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
            "tokens_generated": e.tokens_generated,
            "limits": dataclasses.asdict(ctx.limits),
            "healthy": e.health() is None,
            "poisoned": e.poisoned,
            "vllm_version": ctx.vllm.version if ctx.dialect == "vllm" else None,
            # SGLang's /server_info reports its release as "version": the one imitated here
            "version": SGLANG_VERSION if ctx.dialect == "sglang" else ctx.vllm.version,
            "pid": os.getpid(),
        }
    )


def build_app(
    ctx: ServerContext,
    *,
    api_key: str | None,
    max_body_bytes: int | None = None,
    faults: FaultInjector,
) -> web.Application:
    """The aiohttp application for ``ctx.dialect`` (``"sglang"`` or ``"vllm"``).

    Middlewares, outermost first: the idle keep-alive close, the ``Content-Length`` check
    (413 before anything is read), errors to JSON, authentication, fault injection (so an
    unauthenticated client cannot trigger or observe a fault), the upstream contract.
    ``max_body_bytes`` overrides ``ctx.limits.max_body_bytes``.
    """
    if max_body_bytes is not None and max_body_bytes != ctx.limits.max_body_bytes:
        ctx.limits = dataclasses.replace(ctx.limits, max_body_bytes=max_body_bytes)
    limits = ctx.limits
    app = web.Application(
        client_max_size=limits.max_body_bytes,
        middlewares=[
            *([profile_middleware] if PROFILE else []),
            keepalive_middleware(limits.keepalive_timeout_s),
            body_limit_middleware(_MemoryTrimmer()),
            error_middleware,
            auth_middleware(api_key),
            faults.middleware,
            contract_middleware(ctx.dialect, ctx.vllm.version if ctx.dialect == "vllm" else None),
        ],
    )
    app[CTX_KEY] = ctx
    app[MAX_BODY_KEY] = limits.max_body_bytes
    app[LIMITS_KEY] = limits
    app[BUDGET_KEY] = BodyBudget(limits.max_inflight_body_bytes)
    app.add_routes([web.get("/get_server_info", server_info), *faults.routes()])
    if ctx.dialect == "sglang":  # SGLang's newer name of the same route
        app.add_routes([web.get("/server_info", server_info)])
    if ctx.dialect == "vllm":
        app.add_routes([web.get("/health", health)])  # vLLM: pause does not affect it
    from rollsafe.adapters.reference_engine import checker_api

    if ctx.dialect == "sglang" or ctx.vllm.weight_checker:  # vLLM 0.26.0 has none
        app.add_routes(checker_api.routes(ctx.dialect))  # /weights_checker or /weight_checker
    if ctx.dialect == "sglang":
        from rollsafe.adapters.reference_engine import sglang_api

        app.add_routes(sglang_api.routes())
    elif ctx.dialect == "vllm":
        from rollsafe.adapters.reference_engine import vllm_api

        app.add_routes(vllm_api.routes(ctx.vllm))
    else:
        raise ValueError(f"dialect must be 'sglang' or 'vllm', got {ctx.dialect!r}")
    return app


# ---- serving -------------------------------------------------------------------------------
#: seconds a refused request's unread body is still drained so that the client reads the
#: answer (413, 408) before the connection closes (aiohttp's default is 10)
LINGERING_S = 2.0
_BUSY_ANSWER = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s"
)


class _RefuseConnection(asyncio.Protocol):
    """Answers one connection past ``--max-connections`` with a 503 and closes it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        body = json.dumps(
            {
                "success": False,
                "message": f"too many connections: the limit is {self.limit} (--max-connections)",
                "error": "TooManyConnections",
            }
        ).encode()
        assert isinstance(transport, asyncio.Transport)
        transport.write(_BUSY_ANSWER % (len(body), body))
        transport.close()


class _CappedTCPSite(web.TCPSite):
    """:class:`aiohttp.web.TCPSite` that refuses connections past ``max_connections``."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, max_connections: int) -> None:
        super().__init__(runner, host, port)
        self.max_connections = max_connections

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site; TCPSite.start would bind unwrapped
        server = self._runner.server
        assert server is not None
        cap = self.max_connections
        loop = asyncio.get_running_loop()
        # handlers made but not connected yet: asyncio accepts a burst of connections, calling
        # this factory for each, before any of them is connected (then counted by the server);
        # one that never connects is forgotten after a second
        pending: dict[int, float] = {}
        connection_made = server.connection_made

        def made(handler: Any, transport: asyncio.Transport) -> None:
            pending.pop(id(handler), None)
            connection_made(handler, transport)

        setattr(server, "connection_made", made)  # noqa: B010  (an instance attribute)

        def protocol() -> asyncio.Protocol:
            now = loop.time()
            for key in [k for k, t in pending.items() if now - t >= 1.0]:
                del pending[key]
            if len(server.connections) + len(pending) >= cap:
                return _RefuseConnection(cap)
            handler = server()
            pending[id(handler)] = now
            return handler

        self._server = await loop.create_server(
            protocol, self._host, self._port, backlog=self._backlog
        )


async def start_server(
    app: web.Application, host: str, port: int, limits: ServerLimits
) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port`` under ``limits``; ``(runner, bound port)``.

    The connection-level limits: a client that disconnects cancels its handler (a generation
    it was waiting for is aborted, see :func:`run_generate`); request headers must arrive within
    ``header_timeout_s`` (slow headers are closed; an idle kept-alive connection is closed
    ``keepalive_timeout_s`` after its last response, see :func:`keepalive_middleware`); at most
    ``max_connections`` are open (one more is answered 503 and closed); a refused body is
    drained for :data:`LINGERING_S` at most. Header lines are bounded by aiohttp (8190 bytes,
    128 headers).
    """
    runner = web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        handler_cancellation=True,
        keepalive_timeout=limits.header_timeout_s,
        lingering_time=LINGERING_S,
    )
    await runner.setup()
    site = _CappedTCPSite(runner, host, port, limits.max_connections)
    await site.start()
    server = site._server
    assert server is not None
    return runner, int(cast(Any, server).sockets[0].getsockname()[1])
