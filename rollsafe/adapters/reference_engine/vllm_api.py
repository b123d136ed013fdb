"""vLLM-dialect endpoints of the reference engine, mapped onto the same engine.

Imitates vLLM 0.32.0 (default), 0.33.0 or 0.26.0 (``--vllm-version``; what differs:
:mod:`.dialects`), failures included: a reload or an update that fails inside
``/start_weight_update`` .. ``/finish_weight_update`` answers vLLM's worker 500
(:class:`~.errors.WorkerFailed`, the connection dropped) and poisons the engine, whose next
forward pass kills it (:meth:`~.engine.ReferenceEngine.poison`); docs/engines.md, "The
reference engine's vLLM dialect". ``GET /version`` names the imitated release.

Owns vLLM's endpoint names and payloads: ``/v1/completions`` (OpenAI style; stop strings, stop
token ids, ``ignore_eos``, ``min_tokens`` and ``include_stop_str_in_output`` as the imitated
release applies them: :mod:`.stops`),
``/v1/models``, dev-mode ``/sleep`` (``?level=``), ``/wake_up`` (``?tags=``), ``/is_sleeping``,
``/collective_rpc`` ``{method, args, kwargs, timeout}``, ``/reset_prefix_cache``, ``/pause``
(``?mode=abort|wait|keep``), ``/resume``, ``/is_paused``, ``/get_world_size``, and the native
NCCL weight transfer, one lifecycle per version:

* ``/init_weight_transfer_engine`` ``{init_info: {master_address, master_port, rank_offset,
  world_size, packed, packed_buffer_size_bytes, packed_num_buffers}}`` (packing is fixed here);
* ``/start_weight_update`` (no body) -> ``/update_weights`` ``{update_info: {names,
  dtype_names, shapes}}`` any number of times (empty lists reuse the previous call's metadata)
  -> ``/finish_weight_update`` ``{weight_version?}``; ``/update_weight_version``
  ``{new_version}`` and ``/weight_info`` set and read the version.

A delta update (``rollsafe.wire.delta``: named tensors recognised by their header) is held
across the ``/update_weights`` calls and applied, all or nothing, by ``/finish_weight_update``
(the version it carries, or the delta's own); a refused delta (wrong base, format, digest) is a
400 naming the error and the key or base, the weights and version unchanged, and unlike a
failed vLLM update it does not poison the engine (nothing of the weights was replaced). Real
vLLM applies one only through rollsafe's ``rollsafe_gloo`` plugin (vLLM on CPU, checking the
base by content: ``rollsafe.policy.EngineTraits``); vLLM's own backends do not.

Packed transfers are received as vLLM's ``packed_nccl_broadcast_consumer`` cuts them: uint8
chunks of whole tensors, a chunk closed once it exceeds ``packed_buffer_size_bytes``
(:func:`~rollsafe.adapters.reference_engine.weights.packed_chunks`); unpacked ones as one
broadcast per tensor. Unknown keys are what vLLM does with them (the contract records it per
route): ignored on the RL and dev routes (a body sent to ``/start_weight_update`` too), kept and
logged on ``/v1/completions``, refused inside ``init_info`` and ``update_info``.

The rendezvous is rollsafe's ``TCPStore`` + ``torch.distributed`` stand-in for vLLM's
``StatelessProcessGroup`` + PyNccl (a documented gap); its keys are prefixed with a group name,
which vLLM's requests do not carry, so every rank joins under the fixed
:data:`~rollsafe.wire.group_names.VLLM_WEIGHT_TRANSFER_GROUP` and so must the trainer. Its
blocking matches vLLM's: ``/init_weight_transfer_engine`` answers once the whole group formed
(the trainer joins concurrently), ``/update_weights`` once its broadcasts were received.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from aiohttp import web

from rollsafe.adapters.reference_engine.engine import GenerationResult, SamplingParams
from rollsafe.adapters.reference_engine.errors import (
    BadRequest,
    DeltaRefused,
    EnginePaused,
    WeightUpdateError,
    WorkerFailed,
)
from rollsafe.adapters.reference_engine.group_args import check_group_args
from rollsafe.adapters.reference_engine.server import (
    ServerContext,
    await_future,
    check_prompt_count,
    ctx_of,
    disk_update,
    ok,
    parse_sampling,
    read_json,
    run_generate,
    stop_strings,
    want,
)
from rollsafe.adapters.reference_engine.stops import VLLMStops, VLLMText
from rollsafe.adapters.reference_engine.streaming import stream_generation
from rollsafe.adapters.reference_engine.weights import parse_update_meta
from rollsafe.wire.group_names import VLLM_WEIGHT_TRANSFER_GROUP

__all__ = ["WEIGHT_TRANSFER_GROUP", "routes"]

#: the name every rank joins the weight-transfer group under: vLLM's group has no name (none in
#: ``init_info``), so the trainer must join under this fixed one (``rollsafe.wire.group_names``)
WEIGHT_TRANSFER_GROUP = VLLM_WEIGHT_TRANSFER_GROUP
VLLM_DEFAULTS = SamplingParams(max_new_tokens=16, temperature=1.0)
_PAUSE_MAP = {"abort": "abort", "keep": "in_place", "wait": "in_place"}
_PAUSE_MODE = "vllm_pause_mode"  # key of ServerContext.extra: the mode of the current pause


def _prompts(ctx: Any, prompt: Any) -> tuple[list[list[int]], bool]:
    def ints(v: Any) -> bool:
        return (
            isinstance(v, list)
            and bool(v)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
        )

    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        check_prompt_count(ctx, len(prompt))  # before any prompt is tokenized
    if isinstance(prompt, str):
        return [ctx.codec.encode(prompt)], False
    if ints(prompt):
        return [list(prompt)], False
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [ctx.codec.encode(p) for p in prompt], True
    if isinstance(prompt, list) and prompt and all(ints(p) for p in prompt):
        return [list(p) for p in prompt], True
    raise BadRequest("'prompt' must be a string, a list of token ids, or a list of either")


_FINISH = {"stop": "stop", "length": "length"}


def vllm_stops(
    ctx: ServerContext, body: dict[str, Any], sp: dict[str, Any], params: SamplingParams
) -> VLLMStops:
    """How the imitated vLLM release ends this completion (:class:`VLLMStops`), refusing what
    its request model and ``SamplingParams`` refuse, with their messages."""
    strings = stop_strings(sp)
    facts = ctx.vllm.facts
    limit = facts.max_stop_strings
    if limit is not None and len(strings) > limit:  # pydantic: Field(max_length=...)
        raise BadRequest(
            f"key 'stop': List should have at most {limit} items after validation, not "
            f"{len(strings)}"
        )
    if any(not s for s in strings):
        raise BadRequest("stop cannot contain an empty string.")
    if params.min_new_tokens > params.max_new_tokens:
        raise BadRequest(
            "min_tokens must be less than or equal to "
            f"max_tokens={params.max_new_tokens}, got {params.min_new_tokens}."
        )
    if strings and ctx.codec.tokenizer is None:
        raise BadRequest(
            "stop strings are only supported when detokenize is True. "
            "Set detokenize=True to use stop."
        )
    vocab = ctx.engine.vocab_size
    outside = [t for t in params.stop_token_ids if not 0 <= t < vocab]
    if outside and facts.stop_token_ids_checked:
        raise BadRequest(
            f"token_id(s) {outside} in stop_token_ids contain out-of-vocab token ids. "
            f"Vocabulary size: {vocab}"
        )
    return VLLMStops(
        strings=strings,
        include_stop_str_in_output=bool(want(body, "include_stop_str_in_output", bool, False)),
        earliest_wins=facts.earliest_stop_wins,
        skip_special_tokens=bool(want(body, "skip_special_tokens", bool, True)),
        stream=ctx.codec.decode_stream if ctx.codec.tokenizer is not None else None,
    )


class _StreamChunks:
    """vLLM 0.33.0's ``/v1/completions`` stream events (``CompletionStreamResponse`` dumped with
    ``exclude_unset``): one per token with the text and ``token_ids`` of that token only (deltas;
    ``token_ids`` and, on the first event, ``prompt_token_ids`` only with ``return_token_ids``);
    ``weight_versions`` (with ``return_weight_versions``) on the final event only; with
    ``logprobs: 0`` each event's ``logprobs`` (``CompletionLogProbs``: ``tokens``,
    ``token_logprobs``, ``top_logprobs``, ``text_offset``) covers that event's tokens. An
    event's text is what the request's text gained (decoded token by token, as vLLM's
    detokenizer); with stop strings the last ``len(longest) - 1`` characters are held back
    until the final event, whose text is the rest, trimmed of a matched stop."""

    def __init__(
        self,
        model: str,
        ctx: ServerContext,
        prompt: list[int],
        *,
        token_ids: bool,
        spans: bool,
        logprobs: bool = False,
        stops: VLLMStops | None = None,
        min_tokens: int = 0,
    ) -> None:
        self.model = model
        self.ctx = ctx
        self.prompt = prompt
        self.text = VLLMText(stops or VLLMStops(), prompt, min_tokens)
        self.shown = 0  # characters of the text sent so far
        self.token_ids = token_ids
        self.spans = spans
        self.versioned = ctx.vllm.reports_weight_versions  # 0.32.0's choices have no such key
        self.logprobs = logprobs
        self.text_offset = 0  # where the next token's text starts (vLLM's ``text_offset``)
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sent_prompt = False
        self.sent = 0  # output tokens sent so far

    def _logprobs(self, ids: list[int], lps: list[float]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        tokens = [self.ctx.codec.decode([t], False) for t in ids]
        offsets = []
        for tok in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(tok)
        return {
            "text_offset": offsets,
            "token_logprobs": [max(lp, -9999.0) for lp in lps],
            "tokens": tokens,
            "top_logprobs": [{t: max(lp, -9999.0)} for t, lp in zip(tokens, lps, strict=True)],
        }

    def _chunk(
        self, text: str, ids: list[int], finish: str | None, stop: Any, lps: list[float]
    ) -> dict[str, Any]:
        prompt_ids = None
        if self.token_ids and not self.sent_prompt:
            prompt_ids, self.sent_prompt = self.prompt, True
        choice = {
            "index": 0,
            "text": text,
            "logprobs": self._logprobs(ids, lps),
            "finish_reason": finish,
            "stop_reason": stop,
            "prompt_token_ids": prompt_ids,
            "token_ids": ids if self.token_ids else None,
        }
        if self.versioned:
            choice["weight_versions"] = None
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "kv_transfer_params": None,
        }

    def token(self, token: int, version: str, logprob: float) -> dict[str, Any]:
        self.sent += 1
        self.text.add(token)
        shown = self.text.shown()
        delta = shown[self.shown :]
        self.shown = max(self.shown, len(shown))
        return self._chunk(delta, [token], None, None, [logprob])

    def final(self, result: GenerationResult) -> dict[str, Any]:
        kind = result.finish_reason["type"]
        rest = result.output_ids[self.sent :]
        rest_lps = result.output_logprobs[self.sent :]
        self.sent += len(rest)
        text = (result.text or "")[self.shown :]
        chunk = self._chunk(
            text, rest, _FINISH.get(kind, "abort"), result.finish_reason.get("matched"), rest_lps
        )
        if self.spans:
            chunk["choices"][0]["weight_versions"] = result.weight_spans
        return chunk

    def error(self, exc: BaseException) -> dict[str, Any]:
        status = getattr(exc, "status", 500)
        return {
            "error": {
                "message": str(exc),
                "type": "BadRequestError" if status < 500 else "InternalServerError",
                "param": None,
                "code": status,
            }
        }


async def completions(request: web.Request) -> web.StreamResponse:
    ctx = ctx_of(request)
    if ctx.vllm.refuses_while_paused:  # 0.33.0; 0.32.0 queues the request until /resume
        _refuse_while_paused(ctx)
    body = await read_json(
        request,
        allowed={
            "model",
            "prompt",
            "max_tokens",
            "temperature",
            "top_p",
            "top_k",
            "seed",
            "n",
            "stream",
            "stop",
            "stop_token_ids",
            "include_stop_str_in_output",
            "ignore_eos",
            "logprobs",
            "echo",
            "min_tokens",
            "skip_special_tokens",
            "return_token_ids",
            "return_weight_versions",
            "user",
        },
        required=("prompt",),
    )
    stream = bool(want(body, "stream", bool, False))
    if want(body, "echo", bool, False):
        raise BadRequest("echo=true is not supported by the reference engine")
    prompts, _ = _prompts(ctx, body["prompt"])
    sp: dict[str, Any] = {
        k2: body[k1]
        for k1, k2 in (
            ("max_tokens", "max_new_tokens"),
            ("min_tokens", "min_new_tokens"),
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("top_k", "top_k"),
            ("seed", "seed"),
            ("n", "n"),
            ("stop", "stop"),
            ("stop_token_ids", "stop_token_ids"),
            ("ignore_eos", "ignore_eos"),
        )
        if body.get(k1) is not None
    }
    params = parse_sampling(
        sp, defaults=VLLM_DEFAULTS, stops=lambda sp, p: vllm_stops(ctx, body, sp, p)
    )
    rules = params.stops
    assert isinstance(rules, VLLMStops)
    logprobs = want(body, "logprobs", int, None)
    # 0.32.0 has no weight_versions: the key is ignored there, as vLLM ignores unknown fields
    spans = want(body, "return_weight_versions", bool, False) and ctx.vllm.reports_weight_versions
    token_ids = bool(want(body, "return_token_ids", bool, False))
    skip_special = bool(want(body, "skip_special_tokens", bool, True))
    if stream:
        if len(prompts) != 1 or body.get("n") not in (None, 1):
            raise BadRequest("stream=true takes one prompt and n=1 in the reference engine")
        if logprobs not in (None, 0):
            raise BadRequest(
                "stream=true reports only the sampled token's logprob in the reference engine: "
                f"'logprobs' must be 0, got {logprobs}"
            )
        renderer = _StreamChunks(
            body.get("model") or ctx.model_name,
            ctx,
            prompts[0],
            token_ids=token_ids,
            spans=spans,
            logprobs=logprobs is not None,
            stops=rules,
            min_tokens=params.min_new_tokens,
        )
        return await stream_generation(request, ctx, prompts[0], params, None, renderer)
    results = await run_generate(ctx, prompts, [params] * len(prompts), [None] * len(prompts))
    choices = []
    for i, r in enumerate(results):
        kind = r.finish_reason["type"]
        choice: dict[str, Any] = {
            "index": i,
            "text": r.text if r.text is not None else ctx.codec.decode(r.output_ids, skip_special),
            "finish_reason": _FINISH.get(kind, "abort"),
            "stop_reason": r.finish_reason.get("matched"),
            # vLLM: the ids only with return_token_ids
            "token_ids": r.output_ids if token_ids else None,
            "prompt_token_ids": r.prompt_ids if token_ids else None,
            "logprobs": None,
        }
        if spans:  # vLLM: [{version, start, end}] over the generated tokens
            choice["weight_versions"] = r.weight_spans
        if logprobs is not None:
            choice["logprobs"] = {
                "tokens": [ctx.codec.decode([t], False) for t in r.output_ids],
                "token_logprobs": r.output_logprobs,
                "top_logprobs": None,
                "text_offset": None,
            }
        choices.append(choice)
    n_prompt = sum(len(r.prompt_ids) for r in results)
    n_out = sum(len(r.output_ids) for r in results)
    return web.json_response(
        {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or ctx.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": n_prompt,
                "completion_tokens": n_out,
                "total_tokens": n_prompt + n_out,
            },
        }
    )


async def models(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    return web.json_response(
        {
            "object": "list",
            "data": [{"id": ctx.model_name, "object": "model", "owned_by": "rollsafe"}],
        }
    )


_SLEEP0 = "vllm_sleep_level0"  # key of ServerContext.extra: scheduling paused by /sleep?level=0


async def sleep(request: web.Request) -> web.Response:
    """``/sleep?level=`` (vLLM: 0 pauses scheduling only, 1 offloads the weights to host
    memory and drops the KV cache, 2 discards both). The level is read from the query only,
    as vLLM does (a body is never read)."""
    ctx = ctx_of(request)
    await read_json(request, allowed=set())
    raw = request.query.get("level", "1")
    try:
        level = int(raw)
    except ValueError:
        raise BadRequest(f"sleep level must be an integer, got {raw!r}") from None
    if level not in (0, 1, 2):
        raise BadRequest(f"sleep level must be 0, 1 or 2, got {level}")
    if level == 0:
        mode = request.query.get("mode", "abort")
        if mode not in _PAUSE_MAP:
            raise BadRequest(f"sleep mode must be one of {sorted(_PAUSE_MAP)}, got {mode!r}")
        await await_future(ctx.engine.pause(_PAUSE_MAP[mode]))
        ctx.extra[_SLEEP0] = True
        return ok("sleeping (level 0: scheduling paused)")
    # level 1 keeps a host copy of the weights (restored by wake_up); level 2 discards them
    await await_future(ctx.engine.release(["weights", "kv_cache"], backup=level == 1))
    return ok(f"sleeping (level {level})")


async def wake_up(request: web.Request) -> web.Response:
    """``/wake_up?tags=`` (all when none; vLLM's ``scheduling`` tag ends a level-0 sleep)."""
    ctx = ctx_of(request)
    await read_json(request, allowed=set())
    asked = request.query.getall("tags", [])
    bad = [t for t in asked if t not in ("weights", "kv_cache", "scheduling")]
    if bad:
        raise BadRequest(
            f"unknown wake_up tag {bad[0]!r}; allowed: ['weights', 'kv_cache', 'scheduling']"
        )
    tags = [t for t in asked if t != "scheduling"] if asked else ["weights", "kv_cache"]
    if tags:
        await await_future(ctx.engine.resume_memory(list(tags)))
    if ctx.extra.get(_SLEEP0) and not ctx.engine.released_tags:
        ctx.extra.pop(_SLEEP0, None)
        ctx.engine.resume_generation()  # vLLM resumes scheduling once all memory is back
    return ok(f"awake ({', '.join(asked or tags)})")


async def is_sleeping(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    asleep = bool(ctx.engine.released_tags) or bool(ctx.extra.get(_SLEEP0))
    return web.json_response({"is_sleeping": asleep})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    await await_future(ctx_of(request).engine.flush_cache())
    return ok("prefix cache reset")


async def pause(request: web.Request) -> web.Response:
    engine = ctx_of(request).engine
    mode = request.query.get("mode", "abort")
    if mode not in _PAUSE_MAP:
        raise BadRequest(f"pause mode must be one of {sorted(_PAUSE_MAP)}, got {mode!r}")
    if mode == "wait":
        while engine.num_running:
            await asyncio.sleep(0.01)
    await await_future(engine.pause(_PAUSE_MAP[mode]))
    ctx_of(request).extra[_PAUSE_MODE] = mode
    return web.json_response({"status": "paused"})


async def resume(request: web.Request) -> web.Response:
    ctx_of(request).engine.resume_generation()
    ctx_of(request).extra.pop(_PAUSE_MODE, None)
    return web.json_response({"status": "resumed"})


def _refuse_while_paused(ctx: Any) -> None:
    """vLLM 0.33.0: in ``abort`` and ``wait`` mode new requests are rejected (503) until
    /resume; ``keep`` queues them."""
    if ctx.engine.paused is not None and ctx.extra.get(_PAUSE_MODE, "keep") != "keep":
        raise EnginePaused(
            f"generation is paused (mode={ctx.extra[_PAUSE_MODE]}); retry after /resume"
        )


async def is_paused(request: web.Request) -> web.Response:
    return web.json_response({"is_paused": ctx_of(request).engine.paused is not None})


async def get_world_size(request: web.Request) -> web.Response:
    return web.json_response({"world_size": ctx_of(request).engine.ranks.world_size})


#: worker methods served through ``/collective_rpc`` and the keyword arguments each takes:
#: vLLM 0.33.0's ``Worker.reload_weights`` (``gpu_model_runner.reload_weights``) and
#: checkpoint-engine's vLLM worker extension ``update_weights_from_ipc(zmq_handles)``
RPC_METHODS: dict[str, frozenset[str]] = {
    "reload_weights": frozenset({"weights_path", "is_checkpoint_format"}),
    "update_weights_from_ipc": frozenset({"zmq_handles"}),
}
#: the worker-side callable each method lands in (named in vLLM's TypeError)
_RPC_OWNER = {
    "reload_weights": "GPUModelRunner.reload_weights",
    "update_weights_from_ipc": "update_weights_from_ipc",
}


async def collective_rpc(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    body = await read_json(
        request, allowed={"method", "args", "kwargs", "timeout"}, required=("method",)
    )
    method = want(body, "method", str)
    args = want(body, "args", list, [])
    kwargs = want(body, "kwargs", dict, {})
    if method not in RPC_METHODS:
        raise BadRequest(
            f"collective_rpc method {method!r} is not supported; supported: {sorted(RPC_METHODS)}"
        )
    if args:
        raise BadRequest(f"collective_rpc {method!r}: pass keyword arguments (kwargs), not args")
    unknown = sorted(set(kwargs) - RPC_METHODS[method])
    if unknown:  # vLLM: the worker method's TypeError, before it touched anything
        raise WorkerFailed(
            f"{_RPC_OWNER[method]}() got an unexpected keyword argument {unknown[0]!r} "
            f"(accepted: {', '.join(sorted(RPC_METHODS[method]))})"
        )
    n = ctx.engine.ranks.world_size
    if method == "update_weights_from_ipc":
        if "zmq_handles" not in kwargs:
            raise BadRequest("collective_rpc update_weights_from_ipc: missing kwarg 'zmq_handles'")
        await await_future(ctx.engine.update_from_ipc(kwargs["zmq_handles"], None))
        return web.json_response({"results": [None] * n})
    path = want(kwargs, "weights_path", str, ctx.model_name)
    try:
        await disk_update(ctx, path, "weights_path", None)
    except BadRequest as exc:
        # vLLM moved every layer to the meta device before reading the checkpoint: the old
        # weights are gone, /health stays 200 and the next forward pass kills the engine
        ctx.engine.poison(f"reload_weights failed: {exc}")
        raise WorkerFailed(str(exc)) from exc
    ctx.engine.heal()  # a complete reload restores every layer
    return web.json_response({"results": [None] * n})


#: vLLM 0.33.0's ``NCCLWeightTransferInitInfo`` fields and defaults (``nccl_common.py``,
#: ``packed_tensor.py``); ``nccl_unique_id_b64`` (rendezvous without a TCPStore) is refused here
INIT_INFO_DEFAULTS: dict[str, Any] = {
    "packed": False,
    "packed_buffer_size_bytes": 1 << 30,
    "packed_num_buffers": 2,
}
_CHUNK = "packed_buffer_size_bytes"
_INIT_KEYS = {"master_address", "master_port", "rank_offset", "world_size", *INIT_INFO_DEFAULTS}
_TRANSFER = "vllm_weight_transfer"  # key of ServerContext.extra: init info, last metadata


def _packing(info: dict[str, Any], where: str) -> tuple[bool, int]:
    """``(packed, chunk bytes)`` of an ``init_info`` (0.32+) or ``update_info`` (0.26)."""
    packed = want(info, "packed", bool, INIT_INFO_DEFAULTS["packed"])
    chunk = want(info, "packed_buffer_size_bytes", int, INIT_INFO_DEFAULTS[_CHUNK])
    buffers = want(info, "packed_num_buffers", int, INIT_INFO_DEFAULTS["packed_num_buffers"])
    if chunk < 1 or buffers < 1:
        raise BadRequest(f"{where}packed_buffer_size_bytes and packed_num_buffers must be >= 1")
    return packed, chunk


async def init_weight_transfer_engine(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    body = await read_json(request, allowed={"init_info"}, required=("init_info",))
    info = want(body, "init_info", dict)
    if "nccl_unique_id_b64" in info:
        raise BadRequest(
            "init_info.nccl_unique_id_b64: the reference engine joins by TCPStore rendezvous "
            "only (master_address + master_port)"
        )
    keys = _INIT_KEYS - set(INIT_INFO_DEFAULTS) if ctx.vllm.packed_per_update else _INIT_KEYS
    unknown = sorted(set(info) - keys)
    if unknown:
        raise BadRequest(f"unknown init_info key {unknown[0]!r}; allowed: {sorted(keys)}")
    for key in ("master_address", "master_port", "rank_offset", "world_size"):
        if key not in info:
            raise BadRequest(f"missing init_info key {key!r}")
    group = check_group_args(info, ctx.engine.ranks.world_size, where="init_info.")
    packed, chunk = _packing(info, "init_info.")
    if WEIGHT_TRANSFER_GROUP in ctx.engine.ranks.local.weight_groups:
        await await_future(ctx.engine.destroy_group(WEIGHT_TRANSFER_GROUP))
    ctx.extra[_TRANSFER] = {}
    await await_future(
        ctx.engine.init_group(
            master_address=group.master_address,
            master_port=group.master_port,
            rank_offset=group.rank_offset,
            world_size=group.world_size,
            group_name=WEIGHT_TRANSFER_GROUP,
            backend="nccl" if ctx.device == "cuda" else "gloo",
        )
    )
    ctx.extra[_TRANSFER] = {"packed": packed, "chunk": chunk}
    return web.json_response({"message": "Weight transfer initialized"})


async def _no_body(request: web.Request) -> None:
    """Routes that take no body: vLLM never reads one, so any body is ignored (it is still
    read and parsed: malformed JSON is a 400, as the contract check reads every body)."""
    await read_json(request, allowed=set())


async def start_weight_update(request: web.Request) -> web.Response:
    """vLLM moves every layer to the meta device here (``initialize_layerwise_reload``): until
    ``/finish_weight_update`` a forward pass kills the engine. No group is needed yet (vLLM
    checks it in ``/update_weights``)."""
    await _no_body(request)
    engine = ctx_of(request).engine
    if not engine.begin_update():
        raise WorkerFailed(
            "start_weight_update called while a weight update is already active. "
            "Call finish_weight_update first."
        )
    await await_future(engine.drop_delta())  # one left by an update that never finished
    return web.json_response({"message": "Weight update started"})


_UPDATE_KEYS = ("names", "dtype_names", "shapes")


def _update_meta(ctx: ServerContext, info: dict[str, Any]) -> Any:
    """The call's ``(name, shape, dtype)`` list, or None for a call that receives nothing;
    a :class:`BadRequest` where vLLM's ``parse_update_info`` / ``load_weights`` would fail."""
    keys = set(_UPDATE_KEYS) | (set(INIT_INFO_DEFAULTS) if ctx.vllm.packed_per_update else set())
    unknown = sorted(set(info) - keys)
    if unknown:
        where = (
            "packing comes with each update_info, and 0.26.0 keeps no weight version"
            if ctx.vllm.packed_per_update
            else "packing is set by /init_weight_transfer_engine, the version by "
            "/finish_weight_update or /update_weight_version"
        )
        raise WeightUpdateError(
            f"Invalid update_info for NCCLWeightTransferEngine: unexpected keyword argument "
            f"{unknown[0]!r} (the nccl update_info has only {sorted(keys)}; {where})"
        )
    state = ctx.extra.setdefault(_TRANSFER, {})
    if ctx.vllm.packed_per_update:  # 0.26.0: this call's packing
        state["packed"], state["chunk"] = _packing(info, "update_info.")
    if ctx.vllm.update_lists_required:
        missing = [k for k in _UPDATE_KEYS if k not in info]
        if missing:
            raise WeightUpdateError(
                f"Invalid update_info for NCCLWeightTransferEngine: missing required "
                f"argument(s) {', '.join(map(repr, missing))} (vLLM {ctx.vllm.version} requires "
                f"{list(_UPDATE_KEYS)})"
            )
    names = info.get("names", [])
    if names == [] and info.get("dtype_names", []) == [] and info.get("shapes", []) == []:
        if ctx.vllm.update_lists_required:
            return None  # 0.32.0: nothing to receive
        return state.get("meta")  # 0.33.0: reuse the previous call's metadata, if any
    return parse_update_meta(
        names, info.get("dtype_names"), info.get("shapes"), dtype_key="dtype_names"
    )


async def update_weights(request: web.Request) -> web.Response:
    """One call of an update. Before ``/start_weight_update`` it is refused (500, nothing
    changed); after it any failure ends the update with the weights poisoned, as in vLLM, whose
    worker drops the session and leaves the layers not yet complete on the meta device."""
    ctx = ctx_of(request)
    engine = ctx.engine
    body = await read_json(request, allowed={"update_info"}, required=("update_info",))
    info = want(body, "update_info", dict)
    if not engine.update_in_progress:
        raise WorkerFailed("start_weight_update must be called before update_weights.")
    state = ctx.extra.setdefault(_TRANSFER, {})
    try:
        meta = _update_meta(ctx, info)
        if WEIGHT_TRANSFER_GROUP not in engine.ranks.local.weight_groups:
            raise WeightUpdateError(
                "NCCL weight transfer not initialized. Call init_transfer_engine() first."
            )
        if meta is not None:
            packed = bool(state.get("packed", False))
            fut = engine.update_from_distributed(
                WEIGHT_TRANSFER_GROUP,
                meta,
                packed,
                None,
                chunk_bytes=int(state["chunk"]) if packed else None,
            )
            state["meta"] = meta
            await await_future(fut)
    except DeltaRefused:
        # a delta's calls are only held until /finish_weight_update applies them: nothing of
        # the weights was replaced, so the engine is not poisoned (a 400, the update over)
        engine.end_update()
        raise
    except BadRequest as exc:
        engine.end_update()
        engine.poison(f"/update_weights failed: {exc}")
        raise WorkerFailed(str(exc)) from exc
    return web.json_response({"message": "Weights updated"})


async def finish_weight_update(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    body = await read_json(request, allowed={"weight_version"})
    # 0.26.0 declares no body here: read_json left none, the version never changes
    version = want(body, "weight_version", str, None)
    engine = ctx.engine
    if not engine.update_in_progress:
        raise WorkerFailed("finish_weight_update called without a matching start_weight_update.")
    try:
        # a delta update's calls were held: it is applied here, all or nothing, and sets the
        # version (``weight_version``, or the delta's own when none is given)
        await await_future(engine.apply_pending_delta(version))
    except BadRequest:
        # refused (DeltaRefused: base, format, digest; or a non-finite result): nothing was
        # applied, the version is unchanged, the engine is not poisoned
        engine.end_update()
        raise
    engine.end_update()
    engine.heal()  # every layer is complete again (vLLM's finalize_layerwise_reload)
    if version is not None:
        engine.weight_version = version
    return web.json_response({"message": "Weight update finished"})


async def shutdown_weight_transfer_engine(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    await _no_body(request)
    if ctx.engine.update_in_progress:
        raise WorkerFailed("Cannot release a trainer connection during a weight update")
    if WEIGHT_TRANSFER_GROUP in ctx.engine.ranks.local.weight_groups:
        await await_future(ctx.engine.destroy_group(WEIGHT_TRANSFER_GROUP))
    ctx.extra[_TRANSFER] = {}
    return web.json_response({"message": "Weight transfer shut down"})


async def update_weight_version(request: web.Request) -> web.Response:
    body = await read_json(request, allowed={"new_version"}, required=("new_version",))
    version = want(body, "new_version", str)
    ctx_of(request).engine.weight_version = version
    return web.json_response({"success": True, "new_version": version})


async def weight_info(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": ctx_of(request).engine.weight_version})


async def version(request: web.Request) -> web.Response:
    """``GET /version``: the imitated release, as vLLM reports its own (``{"version": ...}``)."""
    return web.json_response({"version": ctx_of(request).vllm.version})


#: routes vLLM 0.26.0 does not have (:attr:`~.dialects.VLLMRelease.weight_version_routes`,
#: ``shutdown_route``)
_VERSION_ROUTES = ("/update_weight_version", "/weight_info")
_SHUTDOWN_ROUTE = "/shutdown_weight_transfer_engine"


def routes(release: Any = None) -> list[web.RouteDef]:
    """The routes of the imitated vLLM ``release`` (a :class:`~.dialects.VLLMRelease`; every
    route when None)."""
    absent: set[str] = set()
    if release is not None and not release.weight_version_routes:
        absent.update(_VERSION_ROUTES)
    if release is not None and not release.shutdown_route:
        absent.add(_SHUTDOWN_ROUTE)
    return [r for r in _all_routes() if getattr(r, "path", None) not in absent]


def _all_routes() -> list[web.RouteDef]:
    return [
        web.post("/v1/completions", completions),
        web.get("/v1/models", models),
        web.post("/sleep", sleep),
        web.post("/wake_up", wake_up),
        web.get("/is_sleeping", is_sleeping),
        web.post("/collective_rpc", collective_rpc),
        web.post("/reset_prefix_cache", reset_prefix_cache),
        web.post("/pause", pause),
        web.post("/resume", resume),
        web.get("/is_paused", is_paused),
        web.get("/get_world_size", get_world_size),
        web.post("/init_weight_transfer_engine", init_weight_transfer_engine),
        web.post("/start_weight_update", start_weight_update),
        web.post("/update_weights", update_weights),
        web.post("/finish_weight_update", finish_weight_update),
        web.post("/shutdown_weight_transfer_engine", shutdown_weight_transfer_engine),
        web.post("/update_weight_version", update_weight_version),
        web.get("/weight_info", weight_info),
        web.get("/version", version),
    ]
