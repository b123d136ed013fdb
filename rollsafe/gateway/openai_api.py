"""The OpenAI dialect: ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``.

Owns the parsing of both request bodies into a :class:`Call` (its
:class:`~rollsafe.gateway.requests.GenRequest` s, one per prompt and choice) and the rendering
of the fleet's token chunks into the answers vLLM 0.33.0 gives, field for field (read from the
wheel: ``vllm/entrypoints/openai/completion/protocol.py`` and ``serving.py``,
``chat_completion/protocol.py`` and ``serving.py``, ``serve/engine/protocol.py``):

* non-streaming answers are ``model_dump()`` of vLLM's response models: every field present,
  null where unset (``CompletionResponse``, ``ChatCompletionResponse``);
* streams are ``data: <json>\\n\\n`` events, ``model_dump_json(exclude_unset=True)`` of vLLM's
  chunks: a completions chunk per engine output per choice (``text``, ``logprobs``,
  ``finish_reason``, ``stop_reason``, ``prompt_token_ids`` on a choice's first chunk,
  ``token_ids``, ``weight_versions`` on its last, each null when not asked); a chat stream
  starts with one chunk per choice carrying ``delta: {"role": "assistant", "content": ""}`` and
  the top-level ``prompt_token_ids``; with ``stream_options.include_usage`` a last chunk with
  ``choices: []`` and ``usage``; then ``data: [DONE]\\n\\n``;
* ``return_token_ids``: ``prompt_token_ids`` and ``token_ids`` per choice (chat: the prompt's
  at the top level); ``return_weight_versions``: ``weight_versions`` spans per choice
  (streaming: on its last chunk); ``n`` choices with a seed get ``seed + index`` each
  (``vllm/v1/engine/parallel_sampling.py``); ``logprobs`` report the sampled token only
  (completions ``logprobs: 0``, chat ``logprobs: true`` with ``top_logprobs: 0``).

rollsafe adds one key per choice, ``"rollsafe": {"segments": [...]}`` (which group, weights
version and try produced which output tokens), on the non-streaming choice and on a choice's
last stream chunk; no standard field changes meaning. Unknown body keys are ignored, as vLLM's
``OpenAIBaseModel`` (``extra="allow"``) ignores them; known features the gateway does not serve
(beam search, structured outputs, top-N alternatives, multimodal content, a client-supplied
chat template, a tool-call parser...) are a 400 naming the field. The chat answer carries the
model's raw text in ``content``: there is no tool-call or reasoning parser.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollsafe import json_codec
from rollsafe.fleet.provenance import TokenChunk
from rollsafe.gateway.output import ChoiceDelta, ChoiceOutput
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
    prompt_fits,
    session_of,
)
from rollsafe.gateway.tokenizer import GatewayTokenizer

__all__ = [
    "DONE",
    "Call",
    "ChatCall",
    "ChatPrompt",
    "CompletionCall",
    "Streamer",
    "models_list",
    "parse_chat",
    "parse_completion",
]

DONE = b"data: [DONE]\n\n"
#: vLLM clamps -inf logprobs to this (the JSON-serializable floor OpenAI uses)
LOGPROB_FLOOR = -9999.0
#: chat roles the gateway renders (the model's template decides how)
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
#: template keywords a client's chat_template_kwargs may not set
_RESERVED_TEMPLATE_KEYS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "chat_template",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
    }
)

# (field, reason, accepted neutral values): known vLLM 0.33 fields the gateway does not serve
_REFUSED_BOTH: tuple[tuple[str, str, tuple[Any, ...]], ...] = (
    ("use_beam_search", "beam search is not served", (False,)),
    ("logit_bias", "logit bias is not served", ({},)),
    ("prompt_logprobs", "prompt logprobs are not served", ()),
    ("logprob_token_ids", "logprobs of chosen token ids are not served", ([],)),
    ("allowed_token_ids", "allowed_token_ids is not served", ([],)),
    ("bad_words", "bad_words is not served", ([],)),
    ("truncate_prompt_tokens", "prompts are never truncated: send a shorter one", ()),
    ("prompt_embeds", "prompt embeddings are not served", ()),
    ("response_format", "structured outputs are not served", ({"type": "text"},)),
    ("structured_outputs", "structured outputs are not served", ()),
    ("priority", "priority scheduling is not served", (0,)),
    ("cache_salt", "prefix-cache salting is not served", ()),
    ("kv_transfer_params", "disaggregated serving is not served", ()),
    ("ec_transfer_params", "disaggregated serving is not served", ()),
    ("vllm_xargs", "vLLM extension arguments are not served", ({},)),
    ("repetition_detection", "repetition detection is not served", ()),
    ("thinking_token_budget", "thinking budgets are not served", (-1,)),
    ("watermarking", "watermarking is not served", (False,)),
)
_REFUSED_COMPLETION = (("suffix", "fill-in-the-middle is not served", ("",)),)
_REFUSED_CHAT: tuple[tuple[str, str, tuple[Any, ...]], ...] = (
    ("echo", "chat echo is not served", (False,)),
    ("chat_template", "a chat template sent with the request is not trusted", ()),
    ("reasoning_effort", "reasoning effort needs a reasoning parser", ()),
    ("mm_processor_kwargs", "multimodal input is not served", ({},)),
    ("media_io_kwargs", "multimodal input is not served", ({},)),
)


# -- parsing --------------------------------------------------------------------------------


class _Common:
    """What both endpoints read alike."""

    def __init__(
        self,
        f: Fields,
        headers: Mapping[str, str] | None,
        limits: ProtocolLimits,
        refused: Sequence[tuple[str, str, tuple[Any, ...]]],
    ) -> None:
        for key, reason, allowed in (*_REFUSED_BOTH, *refused):
            if key in f.body:  # absent: nothing to refuse
                f.refuse(key, reason, allowed=allowed)
        f.get_str("model")
        f.get_str("user")
        f.get_int("stream_interval", None, lo=1)
        self.n = f.get_int("n", 1, lo=1, hi=limits.max_n)
        self.stream = f.get_bool("stream", False)
        options = f.object("stream_options")
        self.include_usage = self.continuous_usage = False
        if options is not None and options.body:
            if not self.stream:
                raise InvalidRequest(
                    "stream_options", "Stream options can only be defined when `stream=True`."
                )
            self.include_usage = options.get_bool("include_usage", False)
            self.continuous_usage = options.get_bool("continuous_usage_stats", False)
        self.seed = f.get_int("seed", None, lo=-(2**63), hi=2**63 - 1)
        self.sampling = common_sampling(f, limits)
        if self.n > 1 and self.sampling.get("temperature", 1.0) < 1e-5:
            raise InvalidRequest("n", f"n must be 1 when using greedy sampling, got {self.n}.")
        self.include_stop = f.get_bool("include_stop_str_in_output", False)
        self.return_token_ids = bool(f.get_bool("return_token_ids", False))
        self.return_weight_versions = f.get_bool("return_weight_versions", False)
        self.as_token_ids = bool(f.get_bool("return_tokens_as_token_ids", False))
        self.min_tokens = f.get_int("min_tokens", 0, lo=0)
        self.session_id = session_of(f.body, headers)
        request_id = header(headers, "x-request-id") or f.get_str("request_id", max_chars=256)
        self.request_id = request_id or new_request_id()

    def max_tokens(self, f: Fields, key: str, default: int | None, limits: ProtocolLimits) -> Any:
        value = f.get_int(key, None)
        if value is None:
            return default
        if value < 1:
            raise InvalidRequest(key, f"{key} must be at least 1, got {value}.")
        if value > limits.max_model_len:
            raise InvalidRequest(
                key,
                f"{key}={value} cannot be greater than max_model_len={limits.max_model_len}. "
                "Please request fewer output tokens.",
            )
        if value > limits.output_cap:
            raise InvalidRequest(
                key, f"{key}={value} is above the gateway's limit {limits.output_cap}"
            )
        if self.min_tokens > value:
            raise InvalidRequest(
                "min_tokens",
                f"min_tokens must be less than or equal to {key}={value}, got {self.min_tokens}.",
            )
        return value

    def requests(
        self,
        prompts: Sequence[tuple[int, ...]],
        max_tokens: int | None,
        where: str,
        limits: ProtocolLimits,
        logprobs: bool,
    ) -> tuple[GenRequest, ...]:
        out: list[GenRequest] = []
        if len(prompts) * self.n > limits.max_choices:
            raise InvalidRequest(
                "n", f"{len(prompts)} prompts x n={self.n} is above {limits.max_choices}"
            )
        base = dict(self.sampling)
        if self.min_tokens:
            base["min_new_tokens"] = self.min_tokens
        if self.include_stop:
            base["no_stop_trim"] = True
        if logprobs:
            base["return_logprob"] = True
        stop = tuple(base.get("stop", ()))
        stop_ids = frozenset(base.get("stop_token_ids", ()))
        for p, ids in enumerate(prompts):
            left = prompt_fits(where if len(prompts) == 1 else f"{where}[{p}]", len(ids), limits)
            budget = left if max_tokens is None else min(max_tokens, left)
            spec = OutputSpec(
                max_tokens=budget,
                stop=stop,
                stop_token_ids=stop_ids,
                ignore_eos=bool(base.get("ignore_eos", False)),
                include_stop=self.include_stop,
                skip_special_tokens=bool(base.get("skip_special_tokens", True)),
                min_tokens=self.min_tokens,
                logprobs=logprobs,
            )
            for c in range(self.n):
                params = dict(base, max_new_tokens=budget)
                if self.seed is not None:
                    params["sampling_seed"] = choice_seed(self.seed, c)
                out.append(
                    GenRequest(
                        input_ids=ids,
                        sampling_params=freeze(clean_params(params)),
                        stream=bool(self.stream),
                        session_id=self.session_id,
                        output=spec,
                        index=p * self.n + c,
                        prompt_index=p,
                        rid=self.request_id,
                    )
                )
        return tuple(out)


def _text_prompt(
    text: str, where: str, tokenizer: GatewayTokenizer, limits: ProtocolLimits, add: bool
) -> tuple[int, ...]:
    if not text:
        raise InvalidRequest(
            where, "Either prompt or prompt_embeds must be provided and non-empty."
        )
    if len(text) > limits.text_chars:
        raise InvalidRequest(
            where,
            f"This model's maximum context length is {limits.max_model_len} tokens. However, "
            f"your prompt contains {len(text)} characters.",
        )
    ids = tokenizer.encode(text, add_special_tokens=add)
    if not ids:
        raise InvalidRequest(where, f"{where} encodes to no tokens")
    return tuple(ids)


def _prompts(
    value: Any, tokenizer: GatewayTokenizer, limits: ProtocolLimits, add: bool
) -> tuple[list[tuple[int, ...]], list[str | None]]:
    """vLLM's prompt forms: a string, a list of strings, a list of token ids, a list of
    token-id lists. Returns the token ids and the text of each prompt (None for ids)."""
    max_ids = limits.max_model_len
    if value is None or value == "":
        raise InvalidRequest(
            "prompt", "Either prompt or prompt_embeds must be provided and non-empty."
        )
    if isinstance(value, str):
        return [_text_prompt(value, "prompt", tokenizer, limits, add)], [value]
    if not isinstance(value, list) or not value:
        raise InvalidRequest(
            "prompt",
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists",
        )
    first = value[0]
    if isinstance(first, int) and not isinstance(first, bool):
        return [check_ids(value, "prompt", limits, max_len=max_ids, empty_ok=False)], [None]
    if len(value) > limits.max_prompts:
        raise InvalidRequest(
            "prompt",
            f"prompt list length {len(value)} exceeds the maximum allowed count of "
            f"{limits.max_prompts}.",
        )
    ids_out: list[tuple[int, ...]] = []
    texts: list[str | None] = []
    for i, item in enumerate(value):
        where = f"prompt[{i}]"
        if isinstance(item, str):
            ids_out.append(_text_prompt(item, where, tokenizer, limits, add))
            texts.append(item)
        elif isinstance(item, list):
            ids_out.append(check_ids(item, where, limits, max_len=max_ids, empty_ok=False))
            texts.append(None)
        else:
            raise InvalidRequest(where, f"{where} must be a string or a list of token ids")
    return ids_out, texts


def parse_completion(
    body: Any,
    headers: Mapping[str, str] | None,
    tokenizer: GatewayTokenizer,
    limits: ProtocolLimits,
    *,
    model_name: str | None = None,
) -> CompletionCall:
    """``POST /v1/completions``: the body checked, its prompts tokenized (see the module)."""
    f = Fields(body)
    common = _Common(f, headers, limits, _REFUSED_COMPLETION)
    logprobs = f.body.get("logprobs")
    if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool)):
        raise InvalidRequest("logprobs", "`logprobs` must be an integer.")
    if logprobs is not None and logprobs < 0 and logprobs != -1:
        raise InvalidRequest("logprobs", "`logprobs` must be a positive value or -1.")
    if logprobs not in (None, 0):
        raise InvalidRequest(
            "logprobs",
            f"logprobs={logprobs} asks for alternatives to the sampled token, which the rollsafe "
            "gateway does not return: use logprobs=0 (the sampled token's logprob)",
        )
    echo = bool(f.get_bool("echo", False))
    if echo and logprobs is not None:
        raise InvalidRequest(
            "echo", "echo with logprobs needs prompt logprobs, which are not served"
        )
    add_special = f.get_bool("add_special_tokens", True)
    prompts, texts = _prompts(f.body.get("prompt"), tokenizer, limits, add_special)
    max_tokens = common.max_tokens(f, "max_tokens", 16, limits)
    requests = common.requests(prompts, max_tokens, "prompt", limits, logprobs is not None)
    return CompletionCall(
        tokenizer=tokenizer,
        requests=requests,
        common=common,
        model=model_name or f.get_str("model") or tokenizer.name or "rollsafe",
        prompts=prompts,
        logprobs=logprobs is not None,
        echo_texts=[
            (t if t is not None else tokenizer.decode(ids)) if echo else None
            for ids, t in zip(prompts, texts, strict=True)
        ],
    )


def _content(value: Any, where: str, role: str) -> str | None:
    if isinstance(value, str):
        return value
    if value is None:
        if role == "assistant":
            return None
        raise InvalidRequest(where, f"{where} must be a string or a list of text parts")
    if not isinstance(value, list):
        raise InvalidRequest(where, f"{where} must be a string or a list of text parts")
    texts: list[str] = []
    for j, part in enumerate(value):
        here = f"{where}[{j}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, Mapping):
            raise InvalidRequest(here, f"{here} must be a content part object")
        kind = part.get("type", "text")
        if kind not in ("text", "input_text", "refusal"):
            raise InvalidRequest(
                f"{here}.type", f"content parts of type {kind!r} are not served (text only)"
            )
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise InvalidRequest(f"{here}.text", f"{here}.text must be a string")
        texts.append(text)
    return "\n".join(texts)  # vLLM's "string" content format joins text parts with newlines


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise InvalidRequest(where, f"{where} must be a list")
    out: list[dict[str, Any]] = []
    for j, call in enumerate(value):
        here = f"{where}[{j}]"
        if not isinstance(call, Mapping):
            raise InvalidRequest(here, f"{here} must be an object")
        fn = call.get("function")
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise InvalidRequest(f"{here}.function", f"{here}.function must name the function")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            # as vLLM does for HF templates: the JSON string becomes an object
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as exc:
                raise InvalidRequest(
                    f"{here}.function.arguments", f"arguments are not valid JSON: {exc}"
                ) from None
        item: dict[str, Any] = {
            "type": call.get("type", "function"),
            "function": {"name": fn["name"], "arguments": args},
        }
        if isinstance(call.get("id"), str):
            item["id"] = call["id"]
        out.append(item)
    return out


def _messages(value: Any, limits: ProtocolLimits) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise InvalidRequest("messages", "messages must be a non-empty list of message objects")
    if len(value) > limits.max_messages:
        raise InvalidRequest(
            "messages", f"messages has {len(value)} entries, more than {limits.max_messages}"
        )
    out: list[dict[str, Any]] = []
    chars = 0
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise InvalidRequest(where, f"{where} must be an object")
        role = msg.get("role")
        if role not in ROLES:
            raise InvalidRequest(
                f"{where}.role", f"{where}.role must be one of {sorted(ROLES)}, got {role!r}"
            )
        content = _content(msg.get("content"), f"{where}.content", role)
        chars += len(content or "")
        item: dict[str, Any] = {"role": role, "content": content}
        name = msg.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise InvalidRequest(f"{where}.name", f"{where}.name must be a string")
            item["name"] = name
        if msg.get("tool_calls") is not None:
            if role != "assistant":
                raise InvalidRequest(
                    f"{where}.tool_calls", "only assistant messages have tool_calls"
                )
            item["tool_calls"] = _tool_calls(msg["tool_calls"], f"{where}.tool_calls")
        elif content is None:
            item["content"] = ""
        if msg.get("tool_call_id") is not None:
            if not isinstance(msg["tool_call_id"], str):
                raise InvalidRequest(
                    f"{where}.tool_call_id", f"{where}.tool_call_id must be a string"
                )
            item["tool_call_id"] = msg["tool_call_id"]
        reasoning = msg.get("reasoning", msg.get("reasoning_content"))
        if isinstance(reasoning, str):
            item["reasoning"] = reasoning
            chars += len(reasoning)
        out.append(item)
    if chars > limits.text_chars:
        raise InvalidRequest(
            "messages",
            f"This model's maximum context length is {limits.max_model_len} tokens. However, "
            f"your messages contain {chars} characters.",
        )
    return out


def _tools(f: Fields, limits: ProtocolLimits) -> list[dict[str, Any]] | None:
    value = f.body.get("tools")
    if value is None:
        return None
    if value == []:
        raise InvalidRequest(
            "tools",
            "`tools` must not be an empty array. Either provide at least one tool or omit the "
            "field entirely.",
        )
    if not isinstance(value, list) or len(value) > limits.max_tools:
        raise InvalidRequest("tools", f"tools must be a list of at most {limits.max_tools} tools")
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise InvalidRequest(where, f"{where} must be a function tool")
        fn = tool.get("function")
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequest(
                f"{where}.function.name", f"{where}.function.name must be a string"
            )
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise InvalidRequest(f"{where}.function.parameters", "parameters must be an object")
    return [dict(t) for t in value]


def parse_chat(
    body: Any,
    headers: Mapping[str, str] | None,
    tokenizer: GatewayTokenizer,
    limits: ProtocolLimits,
    *,
    model_name: str | None = None,
) -> ChatCall:
    """``POST /v1/chat/completions``: messages rendered with the model's chat template."""
    f = Fields(body)
    common = _Common(f, headers, limits, _REFUSED_CHAT)
    logprobs = bool(f.get_bool("logprobs", False))
    top = f.body.get("top_logprobs")
    if top is not None:
        if not isinstance(top, int) or isinstance(top, bool):
            raise InvalidRequest("top_logprobs", "`top_logprobs` must be an integer.")
        if top < 0 and top != -1:
            raise InvalidRequest("top_logprobs", "`top_logprobs` must be a positive value or -1.")
        if top != 0 and not logprobs:
            raise InvalidRequest(
                "top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true."
            )
        if top != 0:
            raise InvalidRequest(
                "top_logprobs",
                f"top_logprobs={top} asks for alternatives to the sampled token, which the "
                "rollsafe gateway does not return: use top_logprobs=0",
            )
    tools = _tools(f, limits)
    choice = f.body.get("tool_choice")
    if choice is not None and choice != "none":
        if tools is None:
            raise InvalidRequest("tool_choice", "When using `tool_choice`, `tools` must be set.")
        if choice != "auto":
            shown = (
                f"function {choice.get('function', {}).get('name')!r}"
                if isinstance(choice, Mapping)
                else repr(choice)
            )
            raise InvalidRequest(
                "tool_choice",
                f"tool_choice={shown} needs a tool-call parser, which the rollsafe gateway does "
                "not have: use tool_choice 'auto' or 'none' (tool calls come back as text)",
            )
    f.get_bool("parallel_tool_calls", None)
    f.get_bool("include_reasoning", None)
    add_generation_prompt = f.get_bool("add_generation_prompt", True)
    continue_final = f.get_bool("continue_final_message", False)
    if add_generation_prompt and continue_final:
        raise InvalidRequest(
            "continue_final_message",
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
        )
    messages = _messages(f.body.get("messages"), limits)
    kwargs: dict[str, Any] = {}
    extra = f.object("chat_template_kwargs")
    if extra is not None:
        for key in extra.body:
            if not isinstance(key, str) or key in _RESERVED_TEMPLATE_KEYS:
                raise InvalidRequest(
                    f"chat_template_kwargs.{key}", f"chat_template_kwargs may not set {key!r}"
                )
        kwargs.update(extra.body)
    documents = f.body.get("documents")
    if documents is not None:
        if not isinstance(documents, list) or not all(isinstance(d, Mapping) for d in documents):
            raise InvalidRequest("documents", "documents must be a list of objects")
        kwargs["documents"] = documents
    if continue_final:
        kwargs["continue_final_message"] = True
    text = tokenizer.chat_text(
        messages, tools, add_generation_prompt=bool(add_generation_prompt), **kwargs
    )
    add_special = bool(f.get_bool("add_special_tokens", False))
    ids = tuple(tokenizer.encode(text, add_special_tokens=add_special))
    if not ids:
        raise InvalidRequest("messages", "the messages render to no tokens")
    max_tokens = common.max_tokens(f, "max_completion_tokens", None, limits)
    if max_tokens is None:
        max_tokens = common.max_tokens(f, "max_tokens", None, limits)
    requests = common.requests([ids], max_tokens, "messages", limits, logprobs)
    role = "assistant" if add_generation_prompt else messages[-1]["role"]
    return ChatCall(
        tokenizer=tokenizer,
        requests=requests,
        common=common,
        model=model_name or f.get_str("model") or tokenizer.name or "rollsafe",
        prompts=[ids],
        logprobs=logprobs,
        role=role,
        prompt_text=text if f.get_bool("return_prompt_text", False) else None,
        chat=ChatPrompt(
            tuple(messages),
            tuple(tools) if tools else None,
            dict(kwargs),
            bool(add_generation_prompt),
        ),
    )


def models_list(
    model_name: str, max_model_len: int, *, root: str | None = None, created: int | None = None
) -> dict[str, Any]:
    """``GET /v1/models``: vLLM 0.33's ``ModelList`` with one ``ModelCard``."""
    now = int(time.time()) if created is None else created
    return {
        "object": "list",
        "data": [
            {
                "id": model_name,
                "object": "model",
                "created": now,
                "owned_by": "rollsafe",
                "root": root or model_name,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{uuid.uuid4().hex}",
                        "object": "model_permission",
                        "created": now,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
        ],
    }


# -- rendering ------------------------------------------------------------------------------


def _dumps(obj: Any) -> bytes:
    return json_codec.dumps(obj)


def _event(obj: Any) -> bytes:
    return b"data: " + _dumps(obj) + b"\n\n"


def _logprob(value: float | None) -> float | None:
    if value is None or value != value:  # None or NaN
        return None
    return max(float(value), LOGPROB_FLOOR)


class Call:
    """A parsed request: :attr:`requests` (one per prompt and choice, in choice order) and
    how to answer them, whole (:meth:`render`) or streamed (:meth:`streamer`)."""

    object_name = ""
    chunk_name = ""
    id_prefix = ""

    def __init__(
        self,
        *,
        tokenizer: GatewayTokenizer,
        requests: tuple[GenRequest, ...],
        common: _Common,
        model: str,
        prompts: Sequence[tuple[int, ...]],
        logprobs: bool,
    ) -> None:
        self.tokenizer = tokenizer
        self.requests = requests
        self.model = model
        self.prompts = list(prompts)
        self.logprobs = logprobs
        self.stream = bool(common.stream)
        self.n = common.n
        self.include_usage = bool(common.include_usage)
        self.continuous_usage = bool(common.continuous_usage)
        self.return_token_ids = common.return_token_ids
        self.return_weight_versions = bool(common.return_weight_versions)
        self.as_token_ids = common.as_token_ids
        self.session_id = common.session_id
        self.id = f"{self.id_prefix}{common.request_id}"
        self.created = int(time.time())

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of the call (each prompt once, whatever ``n``), as vLLM counts."""
        return sum(len(p) for p in self.prompts)

    def outputs(self) -> list[ChoiceOutput]:
        """A fresh :class:`ChoiceOutput` per request."""
        return [ChoiceOutput(self.tokenizer, r, stream=self.stream) for r in self.requests]

    def _token(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_token_ids else self.tokenizer.token_text(token_id)

    def usage(self, completion_tokens: int, prompt_tokens: int | None = None) -> dict[str, Any]:
        prompt = self.prompt_tokens if prompt_tokens is None else prompt_tokens
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion_tokens,
            "completion_tokens": completion_tokens,
        }

    def render(self, results: Sequence[Sequence[TokenChunk]]) -> dict[str, Any]:
        """The whole answer from each choice's chunks (``results[i]``: ``requests[i]``'s)."""
        if len(results) != len(self.requests):
            raise ValueError(f"{len(results)} results for {len(self.requests)} requests")
        outs = self.outputs()
        for out, chunks in zip(outs, results, strict=True):
            out.add_all(chunks)
        return self._answer(outs)

    def streamer(self) -> Streamer:
        return Streamer(self)

    def _answer(self, outs: list[ChoiceOutput]) -> dict[str, Any]:
        raise NotImplementedError

    def _stream_choice(self, out: ChoiceOutput, delta: ChoiceDelta, first: bool) -> dict[str, Any]:
        raise NotImplementedError

    def _start(self) -> list[dict[str, Any]]:
        return []

    def _extension(self, out: ChoiceOutput) -> dict[str, Any]:
        return {"segments": out.provenance()}


class CompletionCall(Call):
    """A ``/v1/completions`` call."""

    object_name = "text_completion"
    chunk_name = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, *, echo_texts: Sequence[str | None], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.echo_texts = list(echo_texts)

    def _logprobs(
        self, ids: Sequence[int], lps: Sequence[float | None], offset: int
    ) -> dict[str, Any]:
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token_id, lp in zip(ids, lps, strict=False):
            token = self._token(token_id)
            value = _logprob(lp)
            offsets.append(offset)
            offset += len(token)
            tokens.append(token)
            values.append(value)
            tops.append(None if value is None else {token: value})
        return {
            "text_offset": offsets,
            "token_logprobs": values,
            "tokens": tokens,
            "top_logprobs": tops,
        }

    def _echo(self, out: ChoiceOutput) -> str:
        text = self.echo_texts[out.request.prompt_index]
        if text is None:
            return ""
        return "" if self.return_token_ids else text

    def _answer(self, outs: list[ChoiceOutput]) -> dict[str, Any]:
        choices = []
        for out in outs:
            req = out.request
            echoing = self.echo_texts[req.prompt_index] is not None
            choices.append(
                {
                    "index": req.index,
                    "text": (self._echo(out) if echoing else "") + out.text,
                    "logprobs": self._logprobs(out.token_ids, out.logprobs, 0)
                    if self.logprobs
                    else None,
                    "finish_reason": out.finish_reason,
                    "stop_reason": out.stop_reason,
                    "token_ids": list(out.token_ids) if self.return_token_ids else None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": list(req.input_ids) if self.return_token_ids else None,
                    "routed_experts": None,
                    "weight_versions": out.spans() if self.return_weight_versions else None,
                    "rollsafe": self._extension(out),
                }
            )
        usage = self.usage(sum(o.completion_tokens for o in outs))
        usage["prompt_tokens_details"] = None
        usage["completion_tokens_details"] = None
        return {
            "id": self.id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    def _stream_choice(self, out: ChoiceOutput, delta: ChoiceDelta, first: bool) -> dict[str, Any]:
        req = out.request
        text = delta.text
        ids: Sequence[int] = delta.token_ids
        if first and self.echo_texts[req.prompt_index] is not None:
            text = self._echo(out) + text
            ids = (*req.input_ids, *ids)
        logprobs = None
        if self.logprobs:
            logprobs = self._logprobs(delta.token_ids, delta.logprobs, out.lp_offset)
            if logprobs["tokens"]:
                out.lp_offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        done = delta.finished
        choice: dict[str, Any] = {
            "index": req.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": out.finish_reason if done else None,
            "stop_reason": out.stop_reason if done else None,
            "prompt_token_ids": list(req.input_ids) if first and self.return_token_ids else None,
            "token_ids": list(ids) if self.return_token_ids else None,
            "weight_versions": out.spans() if done and self.return_weight_versions else None,
        }
        if done:
            choice["rollsafe"] = self._extension(out)
        return choice


@dataclass(frozen=True)
class ChatPrompt:
    """What a chat prompt is rendered from: the checked ``messages``, ``tools`` and template
    keyword arguments, and whether a generation prompt was added."""

    messages: tuple[Mapping[str, Any], ...]
    tools: tuple[Mapping[str, Any], ...] | None
    template_kwargs: Mapping[str, Any]
    add_generation_prompt: bool


class ChatCall(Call):
    """A ``/v1/chat/completions`` call."""

    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(
        self,
        *,
        role: str,
        prompt_text: str | None,
        chat: ChatPrompt | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.role = role
        self.prompt_text = prompt_text
        #: what the prompt was rendered from (sessions reuse earlier turns' tokens with it)
        self.chat = chat

    def _logprobs(self, ids: Sequence[int], lps: Sequence[float | None]) -> dict[str, Any]:
        content = []
        for token_id, lp in zip(ids, lps, strict=False):
            token = self._token(token_id)
            value = _logprob(lp)
            content.append(
                {
                    "token": token,
                    "logprob": LOGPROB_FLOOR if value is None else value,
                    "bytes": list(token.encode("utf-8", errors="replace")),
                    "top_logprobs": [],
                }
            )
        return {"content": content}

    def _answer(self, outs: list[ChoiceOutput]) -> dict[str, Any]:
        choices = []
        for out in outs:
            choices.append(
                {
                    "index": out.request.index,
                    "message": {
                        "role": self.role,
                        "content": out.text,
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "reasoning": None,
                    },
                    "logprobs": self._logprobs(out.token_ids, out.logprobs)
                    if self.logprobs
                    else None,
                    "finish_reason": out.finish_reason,
                    "stop_reason": out.stop_reason,
                    "token_ids": list(out.token_ids) if self.return_token_ids else None,
                    "routed_experts": None,
                    "weight_versions": out.spans() if self.return_weight_versions else None,
                    "rollsafe": self._extension(out),
                }
            )
        usage = self.usage(sum(o.completion_tokens for o in outs))
        usage["prompt_tokens_details"] = None
        usage["completion_tokens_details"] = None
        return {
            "id": self.id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage,
            "prompt_logprobs": None,
            "prompt_token_ids": list(self.prompts[0]) if self.return_token_ids else None,
            "prompt_text": self.prompt_text,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    def _start(self) -> list[dict[str, Any]]:
        chunks = []
        for req in self.requests:
            chunk: dict[str, Any] = {
                "id": self.id,
                "object": self.chunk_name,
                "created": self.created,
                "model": self.model,
                "choices": [
                    {
                        "index": req.index,
                        "delta": {"role": self.role, "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            if self.continuous_usage:
                chunk["usage"] = dict(self.usage(0), completion_tokens_details=None)
            chunk["prompt_token_ids"] = list(self.prompts[0]) if self.return_token_ids else None
            chunk["prompt_text"] = self.prompt_text
            chunks.append(chunk)
        return chunks

    def _stream_choice(self, out: ChoiceOutput, delta: ChoiceDelta, first: bool) -> dict[str, Any]:
        done = delta.finished
        if not delta.text and not delta.token_ids and not out.token_ids:
            message: dict[str, Any] = {}  # finished without output
        else:
            message = {"content": delta.text}
        choice: dict[str, Any] = {
            "index": out.request.index,
            "delta": message,
            "logprobs": self._logprobs(delta.token_ids, delta.logprobs) if self.logprobs else None,
            "finish_reason": out.finish_reason if done else None,
        }
        if done:
            choice["stop_reason"] = out.stop_reason
        choice["token_ids"] = list(delta.token_ids) if self.return_token_ids else None
        if done:
            choice["weight_versions"] = out.spans() if self.return_weight_versions else None
            choice["rollsafe"] = self._extension(out)
        return choice


class Streamer:
    """The server-sent events of one streamed call.

    :meth:`start` gives the opening events (chat: one role chunk per choice; taken by the
    first :meth:`chunk` when not asked for earlier), :meth:`chunk` the events of one fleet
    chunk of choice ``index`` (empty while a choice holds text back or after it finished),
    :meth:`end` the usage chunk when asked and ``data: [DONE]``. :attr:`all_finished` says every
    choice is over (the gateway sends the end with the last event). :meth:`finished` and
    :meth:`stopped_early` say, per choice, whether it is over and whether the gateway ended it
    on a stop string before its engine did (end that engine request)."""

    def __init__(self, call: Call) -> None:
        self.call = call
        self.outs = call.outputs()
        self._first = [True] * len(self.outs)
        self._started = False

    def start(self) -> bytes:
        if self._started:
            return b""
        self._started = True
        return b"".join(_event(c) for c in self.call._start())

    def chunk(self, index: int, chunk: TokenChunk) -> bytes:
        head = self.start()
        out = self.outs[index]
        delta = out.add(chunk)
        if not delta.text and not delta.token_ids and not delta.finished:
            return head
        call = self.call
        first = self._first[index]
        self._first[index] = False
        body: dict[str, Any] = {
            "id": call.id,
            "object": call.chunk_name,
            "created": call.created,
            "model": call.model,
            "choices": [call._stream_choice(out, delta, first)],
        }
        if call.continuous_usage:
            usage = call.usage(out.completion_tokens, len(out.request.input_ids))
            if isinstance(call, ChatCall):
                usage["completion_tokens_details"] = None
            body["usage"] = usage
        body["kv_transfer_params"] = None
        return head + _event(body)

    def finished(self, index: int) -> bool:
        return self.outs[index].finished

    def stopped_early(self, index: int) -> bool:
        return self.outs[index].stopped_early

    @property
    def all_finished(self) -> bool:
        return all(o.finished for o in self.outs)

    def end(self) -> bytes:
        call = self.call
        tail = b""
        if call.include_usage:
            tail = _event(
                {
                    "id": call.id,
                    "object": call.chunk_name,
                    "created": call.created,
                    "model": call.model,
                    "choices": [],
                    "usage": call.usage(sum(o.completion_tokens for o in self.outs)),
                }
            )
        return self.start() + tail + DONE
