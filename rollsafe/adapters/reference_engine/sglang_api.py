"""SGLang-dialect endpoints of the reference engine (payloads as SGLang's HTTP server).

Owns request/response shapes of ``/generate`` (stop strings, stop token ids, ``ignore_eos``,
``min_new_tokens`` and ``no_stop_trim`` as SGLang 0.5.23 applies them: :mod:`.stops`),
``/health_generate``, the weight endpoints
(``/update_weights_from_disk``, ``/update_weights_from_tensor``, ``/init_weights_update_group``,
``/update_weights_from_distributed``, ``/destroy_weights_update_group``,
``/update_weights_from_ipc``, ``/get_weights_by_name``), memory occupation, pause/continue and
``/flush_cache``. Weight endpoints answer ``{"success": bool, "message": str}``.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from typing import Any

from aiohttp import web

from rollsafe.adapters.engines.sglang_dialect import SGLangDialect
from rollsafe.adapters.reference_engine.engine import GenerationResult, SamplingParams
from rollsafe.adapters.reference_engine.errors import BadRequest, ServerUnavailable
from rollsafe.adapters.reference_engine.group_args import check_group_args
from rollsafe.adapters.reference_engine.server import (
    SGLANG_VERSION,
    ServerContext,
    await_future,
    ctx_of,
    disk_update,
    ok,
    parse_prompts,
    parse_sampling,
    read_json,
    run_generate,
    stop_strings,
    want,
)
from rollsafe.adapters.reference_engine.stops import SGLangStops
from rollsafe.adapters.reference_engine.streaming import stream_generation
from rollsafe.adapters.reference_engine.weights import parse_update_meta
from rollsafe.wire.finite import FINITE_CHECKED_HEADER

__all__ = ["routes"]

SGLANG_DEFAULTS = SamplingParams(max_new_tokens=128, temperature=1.0)
MEMORY_TAGS = ("weights", "kv_cache")


@functools.cache
def _max_stop_strings() -> int | None:
    """SGLang 0.5.23's ``MAX_STOP_COUNT`` (its contract's ``"stops"`` section)."""
    return SGLangDialect.of(SGLANG_VERSION).max_stop_strings


def sglang_stops(ctx: ServerContext, sp: dict[str, Any], params: SamplingParams) -> SGLangStops:
    """How SGLang 0.5.23 ends this request's generation (:class:`SGLangStops`), refusing what
    its ``SamplingParams.verify`` / ``normalize`` refuse, with their messages."""
    strings = stop_strings(sp)
    if params.min_new_tokens > params.max_new_tokens:
        raise BadRequest(
            f"min_new_tokens must be in [0, max_new_tokens({params.max_new_tokens})], got "
            f"{params.min_new_tokens}."
        )
    limit = _max_stop_strings()
    if limit is not None and len(strings) > limit:
        raise BadRequest(f"at most {limit} stop strings are allowed, got {len(strings)}")
    codec = ctx.codec
    if codec.tokenizer is None:  # SGLang with skip_tokenizer_init
        if strings:
            raise BadRequest(
                f"stop={list(strings)!r} is unavailable when skip_tokenizer_init=True "
                "(requires tokenizer to decode tokens to text for matching)."
            )
        if params.min_new_tokens > 0:
            raise BadRequest(
                f"min_new_tokens={params.min_new_tokens} is unavailable when "
                "skip_tokenizer_init=True (requires tokenizer for eos_token_id)."
            )
    return SGLangStops(
        strings=strings,
        no_stop_trim=bool(want(sp, "no_stop_trim", bool, False)),
        longest=max((codec.token_count(s) for s in strings), default=0),
        skip_special_tokens=bool(want(sp, "skip_special_tokens", bool, True)),
        decode=codec.decode if codec.tokenizer is not None else None,
    )


def _response(
    ctx: ServerContext, res: GenerationResult, rid: str | None, logprobs: bool
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": rid,
        "prompt_tokens": len(res.prompt_ids),
        "completion_tokens": len(res.output_ids),
        "finish_reason": res.finish_reason,
        "weight_version": res.weight_version,
        # SGLang 0.5.23: spans of the generated tokens per weights version that produced them
        "weight_versions": res.weight_spans,
        "e2e_latency": res.latency_s,
    }
    if logprobs:
        meta["output_token_logprobs"] = [
            [lp, tok, None] for lp, tok in zip(res.output_logprobs, res.output_ids, strict=False)
        ]
    return {
        "text": res.text if res.text is not None else ctx.codec.decode(res.output_ids),
        "output_ids": res.output_ids,
        "meta_info": meta,
    }


class _StreamChunks:
    """SGLang 0.5.23's ``/generate`` stream events with ``incremental_streaming_output`` off (its
    default): every event carries the text and ``output_ids`` so far (cumulative), and
    ``meta_info`` with the weights version serving now; ``weight_versions`` spans and the finish
    reason come with the last event only. With ``return_logprob`` every event's ``meta_info``
    carries ``output_token_logprobs`` so far (``[logprob, token_id, None]`` per token, cumulative
    like ``output_ids``, as SGLang's tokenizer manager accumulates them). While the decoded tail
    ends with the start of a stop string no event is sent (SGLang's scheduler holds the output
    back until the string is complete or broken); the last event's text is trimmed of the
    matched stop as SGLang's detokenizer trims it."""

    def __init__(
        self,
        ctx: ServerContext,
        rid: str | None,
        prompt_tokens: int,
        logprobs: bool = False,
        stops: SGLangStops | None = None,
    ) -> None:
        self.ctx = ctx
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.logprobs = logprobs
        self.stops = stops or SGLangStops()
        self.out: list[int] = []
        self.lps: list[float] = []

    def _meta(self, version: str, finish: Any) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": finish,
            "prompt_tokens": self.prompt_tokens,
            "weight_version": version,
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": len(self.out),
            "cached_tokens": 0,
        }
        if self.logprobs:
            meta["output_token_logprobs"] = [
                [lp, tok, None] for lp, tok in zip(self.lps, self.out, strict=True)
            ]
            meta["output_token_logprobs_length"] = len(self.lps)
        return meta

    def token(self, token: int, version: str, logprob: float) -> dict[str, Any] | None:
        self.out.append(token)
        self.lps.append(logprob)
        if self.stops.holds(self.out):
            return None  # sent with a later event (cumulative)
        return {
            "text": self.ctx.codec.decode(self.out),
            "output_ids": list(self.out),
            "meta_info": self._meta(version, None),
        }

    def final(self, result: GenerationResult) -> dict[str, Any]:
        self.out = list(result.output_ids)
        self.lps = list(result.output_logprobs)
        meta = self._meta(result.weight_version, result.finish_reason)
        meta["weight_versions"] = result.weight_spans
        meta["e2e_latency"] = result.latency_s
        return {
            "text": result.text if result.text is not None else self.ctx.codec.decode(self.out),
            "output_ids": list(self.out),
            "meta_info": meta,
        }

    def error(self, exc: BaseException) -> dict[str, Any]:
        return {
            "error": {
                "message": str(exc),
                "type": "invalid_request_error",
                "code": getattr(exc, "status", 400),
                "retryable": False,
            }
        }


async def generate(request: web.Request) -> web.StreamResponse:
    ctx = ctx_of(request)
    body = await read_json(
        request,
        allowed={
            "text",
            "input_ids",
            "sampling_params",
            "rid",
            "stream",
            "return_logprob",
            "logprob_start_len",
            "top_logprobs_num",
            "return_text_in_logprobs",
        },
    )
    stream = bool(want(body, "stream", bool, False))
    prompts, batch = parse_prompts(ctx, body.get("text"), body.get("input_ids"))
    if stream and batch:
        raise BadRequest("stream=true takes one prompt in the reference engine (not a batch)")
    sp_raw = body.get("sampling_params") or {}
    if isinstance(sp_raw, dict):
        sp_list = [sp_raw] * len(prompts)
    elif (
        isinstance(sp_raw, list)
        and len(sp_raw) == len(prompts)
        and all(isinstance(s, dict) for s in sp_raw)
    ):
        sp_list = sp_raw
    else:
        raise BadRequest("'sampling_params' must be an object or one object per prompt")
    stops = functools.partial(sglang_stops, ctx)
    params = [parse_sampling(s, defaults=SGLANG_DEFAULTS, stops=stops) for s in sp_list]
    rid = body.get("rid")
    rids: list[str | None]
    if isinstance(rid, list):
        if len(rid) != len(prompts) or not all(isinstance(r, str) for r in rid):
            raise BadRequest("'rid' must be a string or one string per prompt")
        rids = list(rid)
    elif rid is None or isinstance(rid, str):
        rids = [rid if not batch or rid is None else f"{rid}-{i}" for i in range(len(prompts))]
    else:
        raise BadRequest("'rid' must be a string or a list of strings")
    logprobs = bool(want(body, "return_logprob", bool, False))
    if stream:
        rules = params[0].stops
        assert isinstance(rules, SGLangStops)
        renderer = _StreamChunks(ctx, rids[0], len(prompts[0]), logprobs, rules)
        return await stream_generation(request, ctx, prompts[0], params[0], rids[0], renderer)
    results = await run_generate(ctx, prompts, params, rids)
    out = [_response(ctx, r, i, logprobs) for r, i in zip(results, rids, strict=False)]
    return web.json_response(out if batch else out[0])


def health_check_timeout() -> float:
    """SGLang's ``SGLANG_HEALTH_CHECK_TIMEOUT`` (seconds, default 20)."""
    try:
        return max(0.1, float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20")))
    except ValueError:
        return 20.0


async def health_generate(request: web.Request) -> web.Response:
    """``/health`` and ``/health_generate``, as SGLang 0.5.23 serves both: a one-token
    generation that waits behind a pause like any request, so while generation is paused the
    probe blocks and answers 503 after ``SGLANG_HEALTH_CHECK_TIMEOUT`` (a fleet pauses its
    health checks before it pauses generation). As upstream, any token the engine samples
    after the check began (its own or any request's: ``last_receive_tstamp`` there,
    :attr:`Engine.last_output_at` here) answers 200 at once, the check's generation dropped:
    a busy engine is healthy without its check waiting its turn behind the batch. Upstream
    looks once a second (so it answers after 1 s at the earliest); this engine every 50 ms."""
    ctx = ctx_of(request)
    engine = ctx.engine
    reason = engine.health()
    if reason is not None:
        return web.json_response({"success": False, "message": f"unhealthy: {reason}"}, status=503)
    limit = health_check_timeout()
    tic = time.monotonic()
    deadline = tic + limit

    def produced() -> bool:
        last = engine.last_output_at
        return last is not None and last > tic

    while engine.paused is not None:
        if time.monotonic() >= deadline:
            return web.Response(status=503)  # upstream: the generate never ran
        await asyncio.sleep(0.05)
    fut = engine.submit_generate([0], SamplingParams(max_new_tokens=1, temperature=0.0))
    waiter = asyncio.ensure_future(await_future(fut))
    try:
        while not waiter.done() and not produced():
            if time.monotonic() >= deadline:
                return web.Response(status=503)
            await asyncio.wait({waiter}, timeout=0.05)
        if waiter.done():
            waiter.result()  # the check's own generation failed: as any request would
    finally:
        if not waiter.done():  # answered by another request's token: drop the check's own
            waiter.cancel()
            fut.cancel()
    reason = ctx.engine.health()
    if reason is not None:
        return web.json_response({"success": False, "message": f"unhealthy: {reason}"}, status=503)
    return web.Response(status=200)


def _version(body: dict[str, Any]) -> str | None:
    return want(body, "weight_version", str, None)  # type: ignore[no-any-return]


def _updated(names: list[str], version: str | None) -> web.Response:
    suffix = f"; weight_version={version}" if version is not None else ""
    return ok(f"Succeeded to update model weights ({len(names)} tensors){suffix}.")


async def update_weights_from_disk(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    body = await read_json(
        request,
        allowed={
            "model_path",
            "load_format",
            "abort_all_requests",
            "weight_version",
            "flush_cache",
            "is_async",
            "torch_empty_cache",
            "keep_pause",
        },
        required=("model_path",),
    )
    path = want(body, "model_path", str)
    fmt = want(body, "load_format", str, "auto")
    if fmt not in ("auto", "safetensors"):
        raise BadRequest(f"load_format {fmt!r} is not supported for disk loads (auto, safetensors)")
    abort = bool(want(body, "abort_all_requests", bool, False))
    names = await disk_update(ctx, path, "model_path", _version(body), abort)
    return _updated(names, _version(body))


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    body = await read_json(
        request,
        allowed={
            "serialized_named_tensors",
            "load_format",
            "flush_cache",
            "abort_all_requests",
            "weight_version",
        },
        required=("serialized_named_tensors",),
    )
    entries = want(body, "serialized_named_tensors", list)
    fmt = want(body, "load_format", str, None)
    if fmt not in (None, "flattened_bucket", "direct"):
        raise BadRequest(f"load_format {fmt!r} is not supported (flattened_bucket or null)")
    if want(body, "abort_all_requests", bool, False):
        await await_future(ctx.engine.abort_all())
    # the sender checked every tensor of this call finite (rollsafe's ipc transport, once per
    # version): skip the engine's own pass; every other check of the staging still runs
    checked = request.headers.get(FINITE_CHECKED_HEADER) == "1"
    names = await await_future(
        ctx.engine.update_from_tensor(entries, _version(body), allow_non_finite=checked)
    )
    return _updated(names, _version(body))


async def init_weights_update_group(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    body = await read_json(
        request,
        allowed={
            "master_address",
            "master_port",
            "rank_offset",
            "world_size",
            "group_name",
            "backend",
        },
        required=("master_address", "master_port", "rank_offset", "world_size"),
    )
    backend = want(body, "backend", str, "nccl" if ctx.device == "cuda" else "gloo")
    if ctx.device != "cuda" and backend == "nccl":
        backend = "gloo"  # CPU engine: the trainer's nccl request maps to gloo
    if backend not in ("gloo", "nccl"):
        raise BadRequest(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    group = check_group_args(body, ctx.engine.ranks.world_size)
    name = want(body, "group_name", str, "weight_update_group")
    await await_future(
        ctx.engine.init_group(
            master_address=group.master_address,
            master_port=group.master_port,
            rank_offset=group.rank_offset,
            world_size=group.world_size,
            group_name=name,
            backend=backend,
        )
    )
    return ok("Succeeded to initialize custom process group.")


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    body = await read_json(
        request,
        allowed={
            "names",
            "dtypes",
            "shapes",
            "group_name",
            "load_format",
            "flush_cache",
            "abort_all_requests",
            "weight_version",
        },
        required=("names", "dtypes", "shapes"),
    )
    meta = parse_update_meta(body.get("names"), body.get("dtypes"), body.get("shapes"))
    fmt = want(body, "load_format", str, None)
    if fmt not in (None, "flattened_bucket", "direct"):
        raise BadRequest(f"load_format {fmt!r} is not supported (flattened_bucket or null)")
    group = want(body, "group_name", str, "weight_update_group")
    if want(body, "abort_all_requests", bool, False):
        await await_future(ctx.engine.abort_all())
    fut = ctx.engine.update_from_distributed(group, meta, fmt == "flattened_bucket", _version(body))
    names = await await_future(fut)
    return _updated(names, _version(body))


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    body = await read_json(request, allowed={"group_name"})
    group = want(body, "group_name", str, "weight_update_group")
    await await_future(ctx.engine.destroy_group(group))
    return ok(f"Succeeded to destroy custom process group {group!r}.")


async def update_weights_from_ipc(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    body = await read_json(
        request, allowed={"zmq_handles", "flush_cache", "weight_version"}, required=("zmq_handles",)
    )
    names = await await_future(ctx.engine.update_from_ipc(body["zmq_handles"], _version(body)))
    return _updated(names, _version(body))


def _tags(body: dict[str, Any]) -> list[str]:
    tags = want(body, "tags", list, list(MEMORY_TAGS))
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        raise BadRequest(f"unknown memory tag {bad[0]!r}; allowed: {list(MEMORY_TAGS)}")
    return list(tags)


async def release_memory_occupation(request: web.Request) -> web.Response:
    body = await read_json(request, allowed={"tags"})
    tags = _tags(body)
    await await_future(ctx_of(request).engine.release(tags))
    return ok(f"released {tags}")


async def resume_memory_occupation(request: web.Request) -> web.Response:
    body = await read_json(request, allowed={"tags"})
    tags = _tags(body)
    await await_future(ctx_of(request).engine.resume_memory(tags))
    return ok(f"resumed {tags}")


async def pause_generation(request: web.Request) -> web.Response:
    body = await read_json(request, allowed={"mode"})
    mode = want(body, "mode", str, "abort")
    await await_future(ctx_of(request).engine.pause(mode))
    return ok(f"generation paused (mode={mode})")


async def continue_generation(request: web.Request) -> web.Response:
    await read_json(request, allowed={"torch_empty_cache"})
    ctx_of(request).engine.resume_generation()
    return ok("generation continued")


async def flush_cache(request: web.Request) -> web.Response:
    await await_future(ctx_of(request).engine.flush_cache())
    return ok("Cache flushed.")


async def get_weights_by_name(request: web.Request) -> web.Response:
    body = await read_json(request, allowed={"name", "truncate_size"}, required=("name",))
    name = want(body, "name", str)
    truncate = want(body, "truncate_size", int, 100)
    engine = ctx_of(request).engine
    if "weights" in engine.released_tags:
        raise ServerUnavailable("weights are released")
    tensor = await await_future(engine.get_weight(name))
    return web.json_response(tensor[:truncate].float().tolist())


async def model_info(request: web.Request) -> web.Response:
    """SGLang 0.5.23's ``/model_info`` keys (the served ``weight_version`` among them)."""
    ctx = ctx_of(request)
    return web.json_response(
        {
            "model_path": ctx.model_name,
            "tokenizer_path": str(ctx.codec.path) if ctx.codec.tokenizer is not None else None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": ctx.engine.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": None,
            "architectures": None,
            "load_format": None,
            "served_model_name": ctx.model_name,
            "disaggregation_mode": "null",
            "reasoning_parser": None,
            "tool_call_parser": None,
        }
    )


async def update_weight_version(request: web.Request) -> web.Response:
    """SGLang 0.5.23: ``{new_version, abort_all_requests}`` (upstream aborts by default)."""
    ctx = ctx_of(request)
    body = await read_json(
        request, allowed={"new_version", "abort_all_requests", "rid"}, required=("new_version",)
    )
    version = want(body, "new_version", str)
    if want(body, "abort_all_requests", bool, True):
        await await_future(ctx.engine.abort_all())
    ctx.engine.weight_version = version
    return web.json_response(
        {"success": True, "message": f"weight version set to {version}", "new_version": version}
    )


def routes() -> list[web.RouteDef]:
    return [
        web.post("/generate", generate),
        web.get("/model_info", model_info),
        web.get("/get_model_info", model_info),
        web.post("/update_weight_version", update_weight_version),
        web.get("/health", health_generate),
        web.get("/health_generate", health_generate),
        web.post("/update_weights_from_disk", update_weights_from_disk),
        web.post("/update_weights_from_tensor", update_weights_from_tensor),
        web.post("/init_weights_update_group", init_weights_update_group),
        web.post("/update_weights_from_distributed", update_weights_from_distributed),
        web.post("/destroy_weights_update_group", destroy_weights_update_group),
        web.post("/update_weights_from_ipc", update_weights_from_ipc),
        web.post("/release_memory_occupation", release_memory_occupation),
        web.post("/resume_memory_occupation", resume_memory_occupation),
        web.post("/pause_generation", pause_generation),
        web.post("/continue_generation", continue_generation),
        web.post("/flush_cache", flush_cache),
        web.get("/flush_cache", flush_cache),
        web.post("/get_weights_by_name", get_weights_by_name),
        web.get("/get_weights_by_name", get_weights_by_name),
    ]
