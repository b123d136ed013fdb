"""What a gateway request becomes before it reaches the fleet, and how a bad one is refused.

Owns :class:`GenRequest` (one engine request: the token ids, the fleet's sampling parameters,
the session, and the :class:`OutputSpec` the formatters need to turn its tokens into an
answer), :class:`ProtocolLimits` (the bounds every request is checked against) and
:class:`InvalidRequest` (a 400 naming the field, with the error body each dialect answers), plus
:class:`Fields`, the plain-dict reader both dialects parse with (no pydantic on the hot path).

The fleet's sampling vocabulary is SGLang's ``sampling_params`` names
(``rollsafe.adapters.engines.vllm.to_vllm_sampling`` converts them for vLLM): a parser puts in
only what the client asked for, leaving the engine's defaults otherwise, except
``max_new_tokens``, which is always explicit (the context left after the prompt when the
client gave none), and values at their neutral default (``frequency_penalty`` 0,
``repetition_penalty`` 1, ``min_p`` 0, ``min_new_tokens`` 0, empty ``stop``...), which are
left out so engines that do not know them (the reference engine) still serve the request.

Error bodies (read from the pinned wheels):

* vLLM 0.33.0 answers a bad request with 400 and ``{"error": {"message", "type":
  "BadRequestError", "param", "code": 400}}`` (``vllm/entrypoints/serve/engine/protocol.py``
  ``ErrorResponse``/``ErrorInfo``, ``serve/exception_handling/error_response.py``
  ``create_error_response`` for a ``VLLMValidationError``). A prompt longer than the model's
  context is such a 400 too (``renderers/params.py`` ``_token_len_check``: "This model's maximum
  context length is N tokens. However, your prompt contains M input tokens..."), not a 413, so
  the gateway answers 400 for it.
* SGLang 0.5.23 answers a ``ValueError`` raised while admitting a ``/generate`` request with
  400 and ``{"error": {"message": str(e)}}`` (``srt/entrypoints/http_server.py``
  ``_create_error_response``); its context checks are such ``ValueError`` s
  (``srt/managers/tokenizer_manager.py`` ``_validate_one_request``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from random import getrandbits
from types import MappingProxyType
from typing import Any

from rollsafe.errors import InvalidArgument

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "Fields",
    "GenRequest",
    "InvalidRequest",
    "OutputSpec",
    "ProtocolLimits",
    "check_ids",
    "choice_seed",
    "clean_params",
    "common_sampling",
    "freeze",
    "header",
    "prompt_fits",
    "session_of",
]

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


class InvalidRequest(InvalidArgument):
    """A request refused before anything reached an engine: ``field`` is its dotted path in
    the body (``messages[2].content``, ``sampling_params.top_p``), ``status`` the HTTP status
    (400: what vLLM 0.33 and SGLang 0.5.23 answer for every such refusal, a too long prompt
    included)."""

    def __init__(self, field: str, message: str, *, status: int = 400) -> None:
        self.field = field
        self.status = status
        if field and field not in message:
            message = f"{field}: {message}"
        super().__init__(field, message)

    @property
    def message(self) -> str:
        return str(self)

    def as_openai(self) -> dict[str, Any]:
        """vLLM 0.33's error body (``ErrorResponse``): the field is ``param``."""
        return {
            "error": {
                "message": self.message,
                "type": "BadRequestError",
                "param": self.field or None,
                "code": self.status,
            }
        }

    def as_sglang(self) -> dict[str, Any]:
        """SGLang 0.5.23's ``/generate`` error body for a refused request."""
        return {"error": {"message": self.message}}


def new_request_id() -> str:
    """A request id as ``uuid.uuid4().hex`` looks (32 hex digits), without its system call for
    random bytes each request: ids name requests in answers and logs, nothing secret."""
    return f"{getrandbits(128):032x}"


def header(headers: Mapping[str, str] | None, name: str) -> str | None:
    """``name`` (lower case) from ``headers``, whatever case the mapping keeps its keys in."""
    if not headers:
        return None
    value = headers.get(name)
    if value is None:
        for key, item in headers.items():
            if key.lower() == name:
                return item
    return value


def session_of(body: Mapping[str, Any], headers: Mapping[str, str] | None) -> str | None:
    """The session: the body's ``session_id`` (a string), else the ``x-session-id`` header."""
    value = body.get("session_id")
    if value is not None:
        if not isinstance(value, str) or not value:
            raise InvalidRequest("session_id", "session_id must be a non-empty string")
        if len(value) > 256:
            raise InvalidRequest("session_id", "session_id must be at most 256 characters")
        return value
    value = header(headers, "x-session-id")
    if value:
        return value[:256]
    return None


@dataclass(frozen=True)
class ProtocolLimits:
    """The bounds a request is checked against; each violation is a :class:`InvalidRequest`
    naming the field.

    ``max_model_len``: the context (prompt and output tokens), from the model's
    ``max_position_embeddings`` (:meth:`from_model`); ``vocab_size``: token ids must be below
    it. The others bound the work one request can ask for: choices (``n``) and choices in all
    (``n`` times prompts), prompts in one completion (vLLM's ``VLLM_MAX_COMPLETION_PROMPTS``
    default, 1024), stop strings (vLLM's ``VLLM_MAX_STOP_STRINGS`` default is 4, SGLang's
    ``MAX_STOP_COUNT`` 32: one limit here, 32) and their length, stop token ids, chat messages
    and their text, tools."""

    max_model_len: int
    vocab_size: int | None = None
    max_tokens: int | None = None
    max_n: int = 64
    max_choices: int = 1024
    max_prompts: int = 1024
    max_stop: int = 32
    max_stop_chars: int = 256
    max_stop_token_ids: int = 1024
    max_messages: int = 4096
    max_tools: int = 256
    max_text_chars: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_n", "max_choices", "max_prompts", "max_stop"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgument(name, f"{name} must be a positive int, got {value!r}")

    @property
    def output_cap(self) -> int:
        """The most output tokens one choice may ask for."""
        cap = self.max_model_len
        return cap if self.max_tokens is None else min(cap, self.max_tokens)

    @property
    def text_chars(self) -> int:
        """The longest prompt text tokenized at all (a longer one cannot fit the context)."""
        return self.max_text_chars or self.max_model_len * 64

    @classmethod
    def from_model(cls, model_path: str | Path, **overrides: Any) -> ProtocolLimits:
        """Limits for the model at ``model_path``: its ``config.json`` gives the context
        (``max_position_embeddings``; ``text_config``'s for a multimodal config) and the
        vocabulary size; ``overrides`` set any other field."""
        path = Path(model_path) / "config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise InvalidArgument("model_path", f"model_path: cannot read {path}: {exc}") from None
        if not isinstance(config, dict):
            raise InvalidArgument("model_path", f"model_path: {path} is not a JSON object")
        inner = config.get("text_config")
        text: dict[str, Any] = inner if isinstance(inner, dict) else {}
        values: dict[str, Any] = {}
        for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
            found = config.get(key, text.get(key))
            if isinstance(found, int) and found > 0:
                values["max_model_len"] = found
                break
        vocab = config.get("vocab_size", text.get("vocab_size"))
        if isinstance(vocab, int) and vocab > 0:
            values["vocab_size"] = vocab
        values.update(overrides)
        if "max_model_len" not in values:
            raise InvalidArgument(
                "model_path",
                f"model_path: {path} names no context length (max_position_embeddings)",
            )
        return cls(**values)


@dataclass(frozen=True)
class OutputSpec:
    """How a choice's tokens become its answer (the formatters' part of a request).

    ``stop``: stop strings (the gateway trims them from the text, and ends the choice itself
    when it sees one first); ``stop_token_ids``: the client's stop token ids; ``ignore_eos``:
    the EOS ends nothing; ``include_stop``: keep the matched stop string or token in the text
    (vLLM ``include_stop_str_in_output``, SGLang ``no_stop_trim``); ``skip_special_tokens``;
    ``min_tokens``: stop strings count only after this many tokens; ``max_tokens``: the
    choice's budget; ``logprobs``: the sampled tokens' logprobs were asked for."""

    max_tokens: int
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    include_stop: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0
    logprobs: bool = False


@dataclass(frozen=True)
class GenRequest:
    """One engine request of a call: a prompt's token ids and one choice's sampling.

    ``sampling_params`` is in the fleet's vocabulary (SGLang's names, ``return_logprob``
    included when asked), ready for ``RolloutFleet.astream``; ``session_id`` pins a
    conversation to a group; ``index`` is the choice's index in the answer, ``prompt_index``
    the prompt it belongs to; ``rid`` the client's request id where it gave one (SGLang
    ``rid``); ``output`` what the formatters need."""

    input_ids: tuple[int, ...]
    sampling_params: Mapping[str, Any]
    stream: bool
    session_id: str | None
    output: OutputSpec
    index: int = 0
    prompt_index: int = 0
    rid: str | None = None


class Fields:
    """Typed reads of one JSON object, each refusal a :class:`InvalidRequest` naming the dotted
    path; ``prefix`` is the object's own path (``sampling_params``). Plain ``dict`` checks: a
    bool is never an int, a float must be finite."""

    __slots__ = ("body", "prefix")

    def __init__(self, body: Any, prefix: str = "") -> None:
        if not isinstance(body, Mapping):
            name = prefix or "body"
            raise InvalidRequest(name, f"{name} must be a JSON object, got {_kind(body)}")
        self.body: Mapping[str, Any] = body
        self.prefix = prefix

    def path(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def has(self, key: str) -> bool:
        return self.body.get(key) is not None

    def get_int(
        self, key: str, default: Any = None, *, lo: int | None = None, hi: int | None = None
    ) -> Any:
        value = self.body.get(key)
        if value is None:
            return default
        if isinstance(value, float) and value.is_integer() and not isinstance(value, bool):
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidRequest(self.path(key), f"{key} must be an integer, got {_kind(value)}")
        _bounds(self.path(key), key, value, lo, hi)
        return value

    def get_float(
        self, key: str, default: Any = None, *, lo: float | None = None, hi: float | None = None
    ) -> Any:
        value = self.body.get(key)
        if value is None:
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise InvalidRequest(self.path(key), f"{key} must be a number, got {_kind(value)}")
        if not math.isfinite(value):
            raise InvalidRequest(self.path(key), f"{key} must be a finite number, got {value}")
        _bounds(self.path(key), key, value, lo, hi)
        return value

    def get_bool(self, key: str, default: Any = None) -> Any:
        value = self.body.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise InvalidRequest(self.path(key), f"{key} must be a boolean, got {_kind(value)}")
        return value

    def get_str(self, key: str, default: Any = None, *, max_chars: int | None = None) -> Any:
        value = self.body.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise InvalidRequest(self.path(key), f"{key} must be a string, got {_kind(value)}")
        if max_chars is not None and len(value) > max_chars:
            raise InvalidRequest(self.path(key), f"{key} must be at most {max_chars} characters")
        return value

    def object(self, key: str) -> Fields | None:
        value = self.body.get(key)
        return None if value is None else Fields(value, self.path(key))

    def refuse(self, key: str, reason: str, *, allowed: Iterable[Any] = ()) -> None:
        """Refuse ``key`` unless it is absent, null or one of the ``allowed`` values (the
        neutral ones: ``false``, ``0``, ``[]``...): a feature the gateway does not serve."""
        value = self.body.get(key)
        if value is None or any(value == a and type(value) is type(a) for a in allowed):
            return
        raise InvalidRequest(
            self.path(key), f"{key} is not supported by the rollsafe gateway: {reason}"
        )

    def stop_strings(self, key: str, limits: ProtocolLimits) -> tuple[str, ...]:
        """``stop``: a string or a list of strings, none empty (vLLM: "stop cannot contain an
        empty string."), at most ``limits.max_stop`` of at most ``max_stop_chars`` each."""
        value = self.body.get(key)
        if value is None:
            return ()
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list):
            raise InvalidRequest(
                self.path(key), f"{key} must be a string or a list of strings, got {_kind(value)}"
            )
        if len(items) > limits.max_stop:
            raise InvalidRequest(
                self.path(key), f"{key} takes at most {limits.max_stop} strings, got {len(items)}"
            )
        for i, item in enumerate(items):
            where = f"{self.path(key)}[{i}]" if not isinstance(value, str) else self.path(key)
            if not isinstance(item, str):
                raise InvalidRequest(where, f"{key} entries must be strings, got {_kind(item)}")
            if not item:
                raise InvalidRequest(where, "stop cannot contain an empty string.")
            if len(item) > limits.max_stop_chars:
                raise InvalidRequest(
                    where, f"a stop string must be at most {limits.max_stop_chars} characters"
                )
        return tuple(dict.fromkeys(items))

    def token_ids(self, key: str, limits: ProtocolLimits, *, max_len: int) -> tuple[int, ...]:
        """A list of token ids, each in ``[0, vocab_size)``, at most ``max_len`` of them."""
        value = self.body.get(key)
        if value is None:
            return ()
        return check_ids(value, self.path(key), limits, max_len=max_len)


def check_ids(
    value: Any, where: str, limits: ProtocolLimits, *, max_len: int, empty_ok: bool = True
) -> tuple[int, ...]:
    """``value`` as token ids: a list of ints in ``[0, vocab_size)``, at most ``max_len``."""
    if not isinstance(value, list):
        raise InvalidRequest(where, f"{where} must be a list of token ids, got {_kind(value)}")
    if len(value) > max_len:
        raise InvalidRequest(where, f"{where} has {len(value)} token ids, more than {max_len}")
    if not value and not empty_ok:
        raise InvalidRequest(where, f"{where} must not be empty")
    vocab = limits.vocab_size
    for i, tok in enumerate(value):
        if not isinstance(tok, int) or isinstance(tok, bool):
            raise InvalidRequest(f"{where}[{i}]", f"token ids must be integers, got {_kind(tok)}")
        if tok < 0 or (vocab is not None and tok >= vocab):
            bound = f"[0, {vocab})" if vocab is not None else ">= 0"
            raise InvalidRequest(
                f"{where}[{i}]", f"token id {tok} is out of the vocabulary {bound}"
            )
    return tuple(value)


def prompt_fits(where: str, n_prompt: int, limits: ProtocolLimits) -> int:
    """The output tokens left after a prompt of ``n_prompt`` tokens; a prompt that leaves none
    is vLLM's 400 ("This model's maximum context length is ...")."""
    if n_prompt >= limits.max_model_len:
        raise InvalidRequest(
            where,
            f"This model's maximum context length is {limits.max_model_len} tokens. However, "
            f"your prompt ({where}) contains {n_prompt} input tokens, which leaves no room for "
            "output tokens. Please reduce the length of the input prompt.",
        )
    return limits.max_model_len - n_prompt


def freeze(params: Mapping[str, Any]) -> Mapping[str, Any]:
    """A read-only view of ``params`` (a :class:`GenRequest`'s sampling parameters)."""
    return MappingProxyType(dict(params))


def clean_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` less the entries at their neutral default (see the module docstring)."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if value is None or _NEUTRAL.get(key, _MISSING) == value:
            continue
        if isinstance(value, (list, tuple)) and not value:
            continue
        out[key] = value
    return out


_MISSING = object()
_NEUTRAL: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "min_new_tokens": 0,
}


def _bounds(where: str, key: str, value: float, lo: float | None, hi: float | None) -> None:
    if lo is not None and value < lo:
        raise InvalidRequest(where, f"{key} must be at least {lo}, got {value}")
    if hi is not None and value > hi:
        raise InvalidRequest(where, f"{key} must be at most {hi}, got {value}")


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"[:64]
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, Sequence):
        return "a list"
    return type(value).__name__


def common_sampling(f: Fields, limits: ProtocolLimits) -> dict[str, Any]:
    """The sampling fields both dialects name alike, checked and in the fleet's vocabulary.

    Bounds are what both pinned engines accept (so a request valid here is valid on either):
    ``temperature`` in [0, 2] (vLLM's bound; SGLang takes any finite value >= 0), ``top_p`` in
    (0, 1], ``top_k`` -1 or 0 (off: sent as -1, SGLang refuses 0) or >= 1, ``min_p`` in [0, 1],
    ``frequency_penalty`` and ``presence_penalty`` in [-2, 2], ``repetition_penalty`` in
    (0, 2] (SGLang's bound; vLLM takes any value > 0)."""
    out: dict[str, Any] = {}
    temperature = f.get_float("temperature", None, lo=0.0, hi=2.0)
    if temperature is not None:
        out["temperature"] = temperature
    top_p = f.get_float("top_p", None, hi=1.0)
    if top_p is not None:
        if top_p <= 0.0:
            raise InvalidRequest(f.path("top_p"), f"top_p must be in (0, 1], got {top_p}.")
        out["top_p"] = top_p
    top_k = f.get_int("top_k", None, lo=-1, hi=1 << 30)
    if top_k is not None:
        out["top_k"] = -1 if top_k in (0, -1) else top_k
    for key, lo, hi in (
        ("min_p", 0.0, 1.0),
        ("frequency_penalty", -2.0, 2.0),
        ("presence_penalty", -2.0, 2.0),
    ):
        value = f.get_float(key, None, lo=lo, hi=hi)
        if value is not None:
            out[key] = value
    rep = f.get_float("repetition_penalty", None, hi=2.0)
    if rep is not None:
        if rep <= 0.0:
            raise InvalidRequest(
                f.path("repetition_penalty"),
                f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {rep}.",
            )
        out["repetition_penalty"] = rep
    stop = f.stop_strings("stop", limits)
    if stop:
        out["stop"] = list(stop)
    stop_ids = f.token_ids("stop_token_ids", limits, max_len=limits.max_stop_token_ids)
    if stop_ids:
        out["stop_token_ids"] = list(dict.fromkeys(stop_ids))
    if f.get_bool("ignore_eos", False):
        out["ignore_eos"] = True
    for key in ("skip_special_tokens", "spaces_between_special_tokens"):
        value = f.get_bool(key, None)
        if value is not None:
            out[key] = value
    return out


def choice_seed(seed: int, index: int) -> int:
    """Choice ``index``'s seed: ``seed + index`` (vLLM 0.33's ``ParentRequest`` gives each of
    ``n`` children that seed), wrapped into the int64 range."""
    return ((seed + index - INT64_MIN) % (1 << 64)) + INT64_MIN
