"""The SGLang-native dialect: ``POST /generate`` as slime and AReaL post it, answered as SGLang
0.5.23 answers it.

Owns :func:`parse_generate` (the body checked into a :class:`GenerateCall` of
:class:`~rollsafe.gateway.requests.GenRequest` s) and the answer's rendering. Facts read from
the 0.5.23 wheel:

* the body is ``GenerateReqInput`` (``srt/managers/io_struct.py``): ``text`` or ``input_ids``
  (one prompt, or a batch: a list of strings / of id lists), ``sampling_params`` (an object,
  or one per prompt), ``return_logprob``, ``stream``, ``rid`` (a string is expanded to
  ``f"{rid}_{i}"`` over a batch), ``session_id``; unknown top-level keys are ignored (the
  contract ``sglang.api.v1.GenerateRequest``: "unknown keys ignored"), so sglang-router's added
  ``model`` passes; a key of ``sampling_params`` that ``SamplingParams``
  (``srt/sampling/sampling_params.py``) does not have is refused;
* the answer (``srt/managers/tokenizer_manager.py`` ``_handle_batch_output``) is
  ``{"text", "output_ids", "meta_info"}`` (a list of them for a batch or ``n`` > 1):
  ``meta_info`` = ``id``, ``finish_reason`` (``{"type": "stop", "matched": str|int}`` or
  ``{"type": "length", "length": max_new_tokens}``: ``srt/managers/schedule_batch.py``
  ``FINISH_*.to_json``; null while streaming), ``prompt_tokens``, ``weight_version``,
  ``num_retractions``, with ``return_logprob`` ``input_token_logprobs`` (empty: the prompt's
  are not computed with the default ``logprob_start_len`` -1), ``output_token_logprobs``
  (``[logprob, token_id, None]`` per token, the text instead of None with
  ``return_text_in_logprobs``) and ``output_token_logprobs_length``, then
  ``reasoning_tokens``, ``completion_tokens``, ``cached_tokens``, and on the finished answer
  ``weight_versions`` (``[{"version", "start", "end"}]``, ``srt/utils/weight_versions.py``),
  ``e2e_latency`` and ``response_sent_to_client_ts``;
* ``output_ids`` keep the stop token or the tokens of a stop string; ``text`` is trimmed of the
  matched stop unless ``no_stop_trim`` (``srt/managers/detokenizer_manager.py``
  ``trim_matched_stop``);
* streaming (``srt/entrypoints/http_server.py`` ``generate_request``): ``data: <json>\\n\\n``
  per output, then ``data: [DONE]\\n\\n``; with the server default
  ``incremental_streaming_output=False`` every event carries the text, ``output_ids`` and
  ``output_token_logprobs`` so far (cumulative);
* errors: 400 ``{"error": {"message"}}`` (a refused request, ``_create_error_response``); an
  error after a stream started is the event ``{"error": {"message", "type":
  "invalid_request_error", "code", "retryable": false}}`` (:func:`stream_error`).

The gateway refuses (400 naming the field) what it cannot serve faithfully: ``input_embeds`` and
multimodal data, LoRA, constrained decoding (``json_schema``, ``regex``, ``ebnf``,
``structural_tag``, ``stop_regex``), beam search, top-N and input logprobs, hidden states,
routed experts, custom logit processors, SGLang's own ``session_params``, and ``stream`` with
a batch or ``n`` > 1. ``custom_params`` are accepted and not forwarded (without a custom logit
processor SGLang ignores them too). A session comes from ``session_id`` or the
``x-session-id`` header, or slime's ``X-SMG-Routing-Key`` (its consistent-hashing key).
rollsafe adds ``meta_info.rollsafe`` (``{"segments": [...]}``) to a finished answer.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rollsafe import json_codec
from rollsafe.fleet.provenance import TokenChunk
from rollsafe.gateway.output import ChoiceOutput
from rollsafe.gateway.requests import (
    Fields,
    GenRequest,
    InvalidRequest,
    OutputSpec,
    ProtocolLimits,
    check_ids,
    choice_seed,
    clean_params,
    common_sampling,
    freeze,
    header,
    new_request_id,
    session_of,
)
from rollsafe.gateway.tokenizer import GatewayTokenizer

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "DONE",
    "SAMPLING_KEYS",
    "GenerateCall",
    "GenerateStreamer",
    "parse_generate",
    "stream_error",
]

DONE = b"data: [DONE]\n\n"
#: SGLang's ``SamplingParams.max_new_tokens`` default
DEFAULT_MAX_NEW_TOKENS = 128
#: SGLang 0.5.23 ``SamplingParams`` fields a client may send (srt/sampling/sampling_params.py)
SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "n",
        "beam_width",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "stream_interval",
        "logit_bias",
        "sampling_seed",
        "custom_params",
        "watermark",
    }
)
_SAMPLING_REFUSED: tuple[tuple[str, str, tuple[Any, ...]], ...] = (
    ("stop_regex", "regex stops are not served", ([],)),
    ("beam_width", "beam search is not served", (1,)),
    ("json_schema", "constrained decoding is not served", ("",)),
    ("regex", "constrained decoding is not served", ("",)),
    ("ebnf", "constrained decoding is not served", ("",)),
    ("structural_tag", "constrained decoding is not served", ("",)),
    ("logit_bias", "logit bias is not served", ({},)),
    ("watermark", "watermarking is not served", ()),
)
_BODY_REFUSED: tuple[tuple[str, str, tuple[Any, ...]], ...] = (
    ("input_embeds", "input embeddings are not served", ()),
    ("image_data", "multimodal input is not served", ([],)),
    ("video_data", "multimodal input is not served", ([],)),
    ("audio_data", "multimodal input is not served", ([],)),
    ("mm_hashes", "multimodal input is not served", ([],)),
    ("modalities", "multimodal input is not served", ([],)),
    ("top_logprobs_num", "top-N logprobs are not served", (0,)),
    ("token_ids_logprob", "logprobs of chosen token ids are not served", ([],)),
    ("return_hidden_states", "hidden states are not served", (False,)),
    ("return_routed_experts", "routed experts are not served", (False,)),
    ("return_indexer_topk", "indexer top-k is not served", (False,)),
    ("return_entropy", "entropy is not served", (False,)),
    ("return_sampling_mask", "sampling masks are not served", (False,)),
    ("lora_path", "LoRA adapters are not served", ()),
    ("custom_logit_processor", "custom logit processors are not served", ()),
    ("session_params", "SGLang sessions are not served: use session_id", ()),
    ("cache_salt", "prefix-cache salting is not served", ("",)),
    ("extra_key", "prefix-cache keys are not served", ("",)),
    ("bootstrap_host", "disaggregated serving is not served", ()),
    ("bootstrap_port", "disaggregated serving is not served", ()),
    ("bootstrap_room", "disaggregated serving is not served", ()),
    ("positional_embed_overrides", "embedding overrides are not served", ()),
)


def _sampling(
    raw: Any, where: str, limits: ProtocolLimits
) -> tuple[dict[str, Any], int | None, bool, int, int]:
    """One ``sampling_params`` object: the fleet params (no budget yet), the asked
    ``max_new_tokens`` (None: not given), ``no_stop_trim``, ``n`` and ``min_new_tokens``."""
    f = Fields({} if raw is None else raw, where)
    for key in f.body:
        if key not in SAMPLING_KEYS:
            raise InvalidRequest(
                f.path(str(key)),
                f"unknown sampling parameter {key!r}: SGLang 0.5.23's SamplingParams has no "
                "such field",
            )
    for key, reason, allowed in _SAMPLING_REFUSED:
        if key in f.body:  # absent: nothing to refuse
            f.refuse(key, reason, allowed=allowed)
    custom = f.body.get("custom_params")
    if custom is not None and not isinstance(custom, Mapping):
        raise InvalidRequest(f.path("custom_params"), "custom_params must be an object")
    f.get_int("stream_interval", None, lo=1)
    params = common_sampling(f, limits)
    max_new = f.get_int("max_new_tokens", None, lo=0)
    min_new = f.get_int("min_new_tokens", 0, lo=0)
    if max_new is not None and min_new > max_new:
        raise InvalidRequest(
            f.path("min_new_tokens"),
            f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}.",
        )
    if min_new:
        params["min_new_tokens"] = min_new
    no_trim = bool(f.get_bool("no_stop_trim", False))
    if no_trim:
        params["no_stop_trim"] = True
    n = f.get_int("n", 1, lo=1, hi=limits.max_n)
    seed = f.get_int("sampling_seed", None, lo=-(2**63), hi=2**63 - 1)
    if seed is not None:
        params["sampling_seed"] = seed
    return params, max_new, no_trim, n, min_new


def _flags(value: Any, count: int, where: str) -> list[bool]:
    """A boolean, or one per prompt."""
    items = value if isinstance(value, list) else [value] * count
    if isinstance(value, list) and len(value) != count:
        raise InvalidRequest(where, f"{where} must have one entry per prompt ({count})")
    for i, item in enumerate(items):
        if item is not None and not isinstance(item, bool):
            raise InvalidRequest(
                f"{where}[{i}]" if isinstance(value, list) else where, f"{where} must be a boolean"
            )
    return [bool(item) for item in items]


def parse_generate(
    body: Any,
    headers: Mapping[str, str] | None,
    tokenizer: GatewayTokenizer,
    limits: ProtocolLimits,
) -> GenerateCall:
    """``POST /generate``: the body checked, its prompts as token ids (see the module)."""
    f = Fields(body)
    for key, reason, allowed in _BODY_REFUSED:
        if key in f.body:  # absent: nothing to refuse
            f.refuse(key, reason, allowed=allowed)
    start = f.get_int("logprob_start_len", None)
    if start not in (None, -1):
        raise InvalidRequest(
            "logprob_start_len", "input logprobs are not served: use -1 (the default)"
        )
    stream = bool(f.get_bool("stream", False))
    text, ids = f.body.get("text"), f.body.get("input_ids")
    if text is None and ids is None:
        raise InvalidRequest("text", "Either text, input_ids or input_embeds should be provided.")
    if text is not None and ids is not None:
        raise InvalidRequest("input_ids", "give text or input_ids, not both")
    prompts: list[tuple[int, ...]]
    batch: bool
    where = "input_ids" if ids is not None else "text"
    if ids is not None:
        if not isinstance(ids, list):
            raise InvalidRequest(
                "input_ids", f"input_ids must be list or null; got {type(ids).__name__}"
            )
        if not ids:
            raise InvalidRequest("input_ids", "input_ids cannot be empty.")
        batch = isinstance(ids[0], list)
        rows = ids if batch else [ids]
        if len(rows) > limits.max_prompts:
            raise InvalidRequest(
                "input_ids", f"a batch of {len(rows)} is above {limits.max_prompts}"
            )
        prompts = [
            check_ids(
                row,
                f"input_ids[{i}]" if batch else "input_ids",
                limits,
                max_len=limits.max_model_len,
                empty_ok=False,
            )
            for i, row in enumerate(rows)
        ]
    else:
        batch = isinstance(text, list)
        rows = list(text) if isinstance(text, list) else [text]
        if batch and not rows:
            raise InvalidRequest("text", "text cannot be an empty list")
        if len(rows) > limits.max_prompts:
            raise InvalidRequest("text", f"a batch of {len(rows)} is above {limits.max_prompts}")
        prompts = []
        for i, item in enumerate(rows):
            here = f"text[{i}]" if batch else "text"
            if not isinstance(item, str):
                raise InvalidRequest(here, f"{here} must be a string")
            if len(item) > limits.text_chars:
                raise InvalidRequest(here, f"{here} is longer than the context can hold")
            encoded = tuple(tokenizer.encode(item))
            if not encoded:
                raise InvalidRequest(here, f"{here} encodes to no tokens")
            prompts.append(encoded)
    count = len(prompts)
    raw_sp = f.body.get("sampling_params")
    sps = raw_sp if isinstance(raw_sp, list) else [raw_sp] * count
    if isinstance(raw_sp, list) and len(raw_sp) != count:
        raise InvalidRequest(
            "sampling_params", f"sampling_params must have one object per prompt ({count})"
        )
    logprob_flags = _flags(f.body.get("return_logprob"), count, "return_logprob")
    text_lps = bool(f.get_bool("return_text_in_logprobs", False))
    rid = f.body.get("rid")
    if rid is not None and not isinstance(rid, (str, list)):
        raise InvalidRequest("rid", "The rid should be a string or a list of strings.")
    if isinstance(rid, list) and (len(rid) != count or not all(isinstance(r, str) for r in rid)):
        raise InvalidRequest(
            "rid", "The specified rids length mismatch with the batch_size for batch processing."
        )
    session = session_of(f.body, headers) or header(headers, "x-smg-routing-key")
    requests: list[GenRequest] = []
    n_first: int | None = None
    for p, prompt in enumerate(prompts):
        sp_where = f"sampling_params[{p}]" if isinstance(raw_sp, list) else "sampling_params"
        params, max_new, no_trim, n, min_new = _sampling(sps[p], sp_where, limits)
        if n_first is None:
            n_first = n
        elif n != n_first:
            raise InvalidRequest(
                f"{sp_where}.n",
                "The parallel_sample_num should be the same for all samples in sample params.",
            )
        n_prompt = len(prompt)
        if n_prompt >= limits.max_model_len:
            raise InvalidRequest(
                where,
                f"The input ({n_prompt} tokens) is longer than the model's context length "
                f"({limits.max_model_len} tokens).",
            )
        room = limits.max_model_len - n_prompt
        if max_new is None:
            budget = (
                min(DEFAULT_MAX_NEW_TOKENS, room)
                if "max_new_tokens" not in (sps[p] or {})
                else room
            )
        elif max_new > room:
            raise InvalidRequest(
                f"{sp_where}.max_new_tokens",
                "Requested token count exceeds the model's maximum context length of "
                f"{limits.max_model_len} tokens. You requested a total of {n_prompt + max_new} "
                f"tokens: {n_prompt} tokens from the input messages and {max_new} tokens for the "
                "completion. Please reduce the number of tokens in the input messages or the "
                "completion to fit within the limit.",
            )
        elif max_new > limits.output_cap:
            raise InvalidRequest(
                f"{sp_where}.max_new_tokens",
                f"max_new_tokens={max_new} is above the gateway's limit {limits.output_cap}",
            )
        else:
            budget = max_new
        logprobs = bool(logprob_flags[p])
        if logprobs:
            params["return_logprob"] = True
        spec = OutputSpec(
            max_tokens=budget,
            stop=tuple(params.get("stop", ())),
            stop_token_ids=frozenset(params.get("stop_token_ids", ())),
            ignore_eos=bool(params.get("ignore_eos", False)),
            include_stop=no_trim,
            skip_special_tokens=bool(params.get("skip_special_tokens", True)),
            min_tokens=min_new,
            logprobs=logprobs,
        )
        seed = params.pop("sampling_seed", None)
        for c in range(n):
            item = dict(params, max_new_tokens=budget)
            if seed is not None:
                item["sampling_seed"] = choice_seed(seed, c) if n > 1 else seed
            if isinstance(rid, list):
                rid_c = rid[p] if n == 1 else f"{rid[p]}_{c}"
            elif isinstance(rid, str):
                rid_c = rid if not batch and n == 1 else f"{rid}_{p * n + c}"
            else:
                rid_c = new_request_id()
            requests.append(
                GenRequest(
                    input_ids=prompt,
                    sampling_params=freeze(clean_params(item)),
                    stream=stream,
                    session_id=session,
                    output=spec,
                    index=p * n + c,
                    prompt_index=p,
                    rid=rid_c,
                )
            )
    if len(requests) > limits.max_choices:
        raise InvalidRequest(
            "sampling_params.n", f"{len(requests)} requests is above {limits.max_choices}"
        )
    listed = batch or (n_first or 1) > 1
    if stream and listed:
        raise InvalidRequest(
            "stream",
            "stream=true takes one prompt and n=1 in the rollsafe gateway (not a batch)",
        )
    return GenerateCall(
        tokenizer,
        tuple(requests),
        listed,
        text_lps,
        bool(f.get_bool("return_prompt_token_ids", False)),
    )


def stream_error(message: str, code: int = 400) -> bytes:
    """The event SGLang 0.5.23 sends when a stream fails after it started."""
    body = {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "code": code,
            "retryable": False,
        }
    }
    return (
        b"data: " + json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
    )


class GenerateCall:
    """A parsed ``/generate``: :attr:`requests` in answer order, :attr:`listed` (the answer is
    a list: a batch or ``n`` > 1), rendered whole (:meth:`render`) or streamed
    (:meth:`streamer`, one prompt only)."""

    def __init__(
        self,
        tokenizer: GatewayTokenizer,
        requests: tuple[GenRequest, ...],
        listed: bool,
        text_in_logprobs: bool = False,
        return_prompt_ids: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.requests = requests
        self.listed = listed
        self.stream = bool(requests and requests[0].stream)
        self.text_in_logprobs = text_in_logprobs
        self.return_prompt_ids = return_prompt_ids
        self.started = time.perf_counter()

    def render(
        self, results: Sequence[Sequence[TokenChunk]]
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """The answer from each request's chunks (``results[i]``: ``requests[i]``'s)."""
        if len(results) != len(self.requests):
            raise ValueError(f"{len(results)} results for {len(self.requests)} requests")
        items = []
        for req, chunks in zip(self.requests, results, strict=True):
            out = ChoiceOutput(self.tokenizer, req)
            out.add_all(chunks)
            items.append(self.item(out))
        return items if self.listed else items[0]

    def streamer(self) -> GenerateStreamer:
        return GenerateStreamer(self)

    def item(self, out: ChoiceOutput) -> dict[str, Any]:
        """One answer (cumulative so far while streaming, whole once finished)."""
        req = out.request
        done = out.finished
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": _finish(out) if done else None,
            "prompt_tokens": len(req.input_ids),
            "weight_version": out.weight_version,
            "num_retractions": 0,
        }
        if req.output.logprobs:
            token_text = self.tokenizer.token_text if self.text_in_logprobs else None
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [
                [lp, t, token_text(t) if token_text else None]
                for lp, t in zip(out.logprobs, out.token_ids, strict=True)
            ]
            meta["output_token_logprobs_length"] = len(out.token_ids)
        meta["reasoning_tokens"] = 0
        meta["completion_tokens"] = out.completion_tokens
        cached = out.meta.get("cached_tokens")
        meta["cached_tokens"] = cached if isinstance(cached, int) else 0
        if done:
            spans = out.spans()
            meta["weight_versions"] = spans
            if spans:
                meta["weight_version"] = spans[-1]["version"]
            meta["e2e_latency"] = time.perf_counter() - self.started
            meta["response_sent_to_client_ts"] = time.time()
            meta["rollsafe"] = {"segments": out.provenance()}
        visible = out.text if done else out.text[: out.sent]
        answer: dict[str, Any] = {
            "text": visible,
            "output_ids": list(out.token_ids),
            "meta_info": meta,
        }
        if self.return_prompt_ids:
            answer["prompt_token_ids"] = list(req.input_ids)
        return answer


def _finish(out: ChoiceOutput) -> dict[str, Any]:
    if out.finish_reason == "length":
        return {"type": "length", "length": out.spec.max_tokens}
    if out.matched is not None:
        return {"type": "stop", "matched": out.matched}
    return {"type": "stop", "matched": out.token_ids[-1] if out.token_ids else None}


class GenerateStreamer:
    """The events of a streamed ``/generate`` (one prompt): :meth:`chunk` gives the cumulative
    event of each fleet chunk that added something (stop-string text held back), :meth:`end`
    ``data: [DONE]``; :attr:`all_finished` says the request is over; :meth:`stopped_early`
    says the gateway ended the request on a stop string before its engine did (end that
    engine request)."""

    def __init__(self, call: GenerateCall) -> None:
        self.call = call
        self.out = ChoiceOutput(call.tokenizer, call.requests[0], stream=True)

    def chunk(self, index: int, chunk: TokenChunk) -> bytes:
        if index != 0:
            raise IndexError(f"a streamed /generate has one request, not {index + 1}")
        delta = self.out.add(chunk)
        if not delta.text and not delta.token_ids and not delta.finished:
            return b""
        return b"data: " + json_codec.dumps(self.call.item(self.out)) + b"\n\n"

    def finished(self, index: int = 0) -> bool:
        return self.out.finished

    def stopped_early(self, index: int = 0) -> bool:
        return self.out.stopped_early

    @property
    def all_finished(self) -> bool:
        return self.out.finished

    def end(self) -> bytes:
        return DONE
