"""When a generation ends, and what its text keeps, as each release the reference engine imitates.

Owns stop strings (``stop``), stop token ids, ``ignore_eos``, the minimum of new tokens (SGLang
``min_new_tokens``, vLLM ``min_tokens``) and the trimming of a matched stop (SGLang
``no_stop_trim``, vLLM ``include_stop_str_in_output``). A dialect gives each request its
:class:`StopRules` (:class:`SGLangStops` or :class:`VLLMStops`); the engine's driver thread asks
the generation's :class:`StopScan` which tokens may not be sampled yet
(:meth:`StopScan.banned`), after each token whether the generation is over
(:meth:`StopScan.after`), and at the end the text the release reports (:meth:`StopScan.text`).
The dialects' stream renderers use :meth:`SGLangStops.holds` and :class:`VLLMText` to send what
the releases send while a stop string may be forming.

The rules, read off the wheels (each contract's ``"stops"`` section and ``checked_facts``;
docs/engines.md, "Stop strings and stop tokens"), SGLang 0.5.23 first, then vLLM 0.26.0 /
0.32.0 / 0.33.0:

* a stop string is looked for in the last *n* + 1 output tokens decoded (*n*: the tokens of the
  longest stop string), from the first token on / in the text decoded token by token, ending
  in the newest token's text, once ``min_tokens`` tokens are out;
* several matched at once: the first of the list / the first of the list (0.26), the one
  ending first (0.32+);
* finish: ``{"type": "stop", "matched": "<string>"}``, a stop token id or EOS ``matched`` by
  its id / ``"stop"`` with ``stop_reason`` the string, the stop token id, or null for EOS;
* ``ignore_eos``: no token ends the generation, stop token ids neither / EOS does not end it,
  stop token ids still do;
* the minimum of new tokens: EOS and stop token ids cannot be sampled before it, stop strings
  count at once / the same, and stop strings wait for it;
* output ids: every token, those of the stop string and the stop token included (both);
* text: cut before the first occurrence of the matched string (after it with
  ``no_stop_trim``), a stop token's text left out (kept with ``no_stop_trim``) / cut before the
  string (after it with ``include_stop_str_in_output``), a stop token's text left out (kept
  with ``include_stop_str_in_output``);
* stream: an event is held back while the decoded tail ends with the start of a stop string /
  the text is held back by the longest stop string but one character until the end.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollsafe.adapters.reference_engine.engine import SamplingParams

__all__ = ["SGLangStops", "StopRules", "StopScan", "VLLMStops", "VLLMText"]

#: ``(ids, skip_special_tokens) -> text`` (:meth:`~.codec.TextCodec.decode`)
Decode = Callable[[list[int], bool], str]
#: ``(prompt, skip_special_tokens) -> step``, each step the text one more token adds
#: (:meth:`~.codec.TextCodec.decode_stream`)
StreamDecode = Callable[[list[int], bool], Callable[[int], str]]
#: a finish reason as the engine reports it (SGLang's ``finish_reason``): ``{"type": "stop",
#: "matched": str | int | None}``, ``{"type": "length", "length": n}``, ``{"type": "abort", ...}``
Finish = dict[str, Any]


class StopScan(ABC):
    """The stop state of one generation (touched by the engine's driver thread only)."""

    @abstractmethod
    def banned(self, generated: int) -> Sequence[int]:
        """Token ids that may not be sampled after ``generated`` output tokens."""

    @abstractmethod
    def after(self, out: list[int]) -> Finish | None:
        """Whether the generation is over now that ``out[-1]`` was sampled, and why."""

    @abstractmethod
    def text(self, out: list[int], finish: Finish) -> str | None:
        """The text the release reports for output ``out`` ended by ``finish`` (None: the
        engine decodes nothing, the dialect does)."""


class StopRules(ABC):
    """How one request's generation ends; one :class:`StopScan` per generation."""

    strings: tuple[str, ...]

    @abstractmethod
    def scan(
        self, prompt: list[int], params: SamplingParams, eos_token_ids: Sequence[int]
    ) -> StopScan:
        """The state of one generation of ``prompt`` under ``params``."""


def _stop_tokens(params: SamplingParams, eos_token_ids: Sequence[int]) -> tuple[int, ...]:
    """EOS and the stop token ids: what the minimum of new tokens keeps from being sampled
    (both releases, ``ignore_eos`` or not)."""
    return tuple(sorted(set(params.stop_token_ids) | set(eos_token_ids)))


# ---- SGLang --------------------------------------------------------------------------------
@dataclass(frozen=True)
class SGLangStops(StopRules):
    """SGLang 0.5.23's rules (see the module); ``decode`` None: no tokenizer, so no stop
    strings (the dialect refuses them) and the dialect decodes the text itself."""

    strings: tuple[str, ...] = ()
    #: keep the matched stop string / stop token's text in the text
    no_stop_trim: bool = False
    #: tokens of the longest stop string (SGLang's ``stop_str_max_len``)
    longest: int = 0
    skip_special_tokens: bool = True
    decode: Decode | None = None

    def scan(
        self, prompt: list[int], params: SamplingParams, eos_token_ids: Sequence[int]
    ) -> StopScan:
        return _SGLangScan(self, params, eos_token_ids)

    def _tail(self, out: list[int]) -> str:
        """The decoded tail stop strings are looked for in (special tokens kept, as the
        scheduler's ``tokenizer.decode`` does)."""
        assert self.decode is not None
        return self.decode(out[-(self.longest + 1) :], False)

    def matched(self, out: list[int]) -> str | None:
        """The stop string in the tail of ``out`` (the first of the list), if any."""
        if not self.strings or self.decode is None or not out:
            return None
        tail = self._tail(out)
        return next((s for s in self.strings if s in tail), None)

    def holds(self, out: list[int]) -> bool:
        """Whether SGLang keeps back the stream event after ``out``: the tail holds a stop
        string or ends with the start of one (the event is sent with a later one)."""
        if not self.strings or self.decode is None or not out:
            return False
        tail = self._tail(out)
        if not tail:
            return False
        for stop in self.strings:
            if stop and (stop in tail or any(tail.endswith(stop[:i]) for i in range(1, len(stop)))):
                return True
        return False

    def final_text(self, out: list[int], finish: Finish) -> str | None:
        if self.decode is None:
            return None
        matched = finish.get("matched") if finish.get("type") == "stop" else None
        ids = out
        if isinstance(matched, int) and not isinstance(matched, bool) and not self.no_stop_trim:
            ids = out[:-1]  # the stop token: always the last one
        text = self.decode(ids, self.skip_special_tokens)
        if isinstance(matched, str):
            at = text.find(matched)
            if at != -1:
                text = text[: at + len(matched)] if self.no_stop_trim else text[:at]
        return text


class _SGLangScan(StopScan):
    def __init__(
        self, rules: SGLangStops, params: SamplingParams, eos_token_ids: Sequence[int]
    ) -> None:
        self.rules = rules
        self.params = params
        self.forbidden = _stop_tokens(params, eos_token_ids)
        # with ignore_eos no token ends the generation, stop token ids neither
        self.ends = frozenset(() if params.ignore_eos else self.forbidden)

    def banned(self, generated: int) -> Sequence[int]:
        return self.forbidden if generated < self.params.min_new_tokens else ()

    def after(self, out: list[int]) -> Finish | None:
        matched = self.rules.matched(out)  # strings first, whatever the minimum
        if matched is not None:
            return {"type": "stop", "matched": matched}
        if out[-1] in self.ends:
            return {"type": "stop", "matched": out[-1]}
        if len(out) >= self.params.max_new_tokens:
            return {"type": "length", "length": self.params.max_new_tokens}
        return None

    def text(self, out: list[int], finish: Finish) -> str | None:
        return self.rules.final_text(out, finish)


# ---- vLLM ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class VLLMStops(StopRules):
    """vLLM's rules (see the module); ``stream`` None: no tokenizer, so no stop strings and
    no text (vLLM without detokenization)."""

    strings: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    #: several stop strings matched at once: the one ending first wins (0.32+), else the
    #: first of the list (0.26)
    earliest_wins: bool = True
    skip_special_tokens: bool = True
    stream: StreamDecode | None = None

    @property
    def hold_back(self) -> int:
        """Characters a stream keeps back until the end (the longest stop string but one)."""
        if not self.strings or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.strings) - 1

    def scan(
        self, prompt: list[int], params: SamplingParams, eos_token_ids: Sequence[int]
    ) -> StopScan:
        return _VLLMScan(self, prompt, params, eos_token_ids)

    def find(self, text: str, new_chars: int) -> tuple[str, int] | None:
        """The stop string that ends in the last ``new_chars`` characters of ``text`` and the
        length the text is cut to, or None."""
        if not new_chars:
            return None
        hits = []
        for order, stop in enumerate(self.strings):
            at = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
            if at != -1:
                hits.append((at + len(stop), order, stop, at))
        if not hits:
            return None
        end, _, stop, at = min(hits) if self.earliest_wins else min(hits, key=lambda h: h[1])
        return stop, end if self.include_stop_str_in_output else at


class VLLMText:
    """One request's text as vLLM's detokenizer builds it: token by token after the prompt; a
    token that ended the generation as EOS or a stop token id adds nothing (unless
    ``include_stop_str_in_output``); a stop string, looked for once ``min_tokens`` tokens are
    out, cuts it."""

    def __init__(self, rules: VLLMStops, prompt: list[int], min_tokens: int) -> None:
        self.rules = rules
        self.min_tokens = min_tokens
        self.step = (
            rules.stream(prompt, rules.skip_special_tokens) if rules.stream is not None else None
        )
        self.text = ""
        self.count = 0

    def add(self, token: int, stop_token: bool = False) -> str | None:
        """Take the next token (``stop_token``: it ended the generation as EOS or a stop token
        id); the stop string it completed, if any."""
        self.count += 1
        if self.step is None:
            return None
        before = len(self.text)
        if not stop_token or self.rules.include_stop_str_in_output:
            self.text += self.step(token)
        if not self.rules.strings or self.count <= self.min_tokens:
            return None
        found = self.rules.find(self.text, len(self.text) - before)
        if found is None:
            return None
        stop, cut = found
        self.text = self.text[:cut]
        return stop

    def shown(self) -> str:
        """The text a stream may show so far (the hold-back kept back)."""
        hold = self.rules.hold_back
        return self.text[: len(self.text) - hold] if hold else self.text


class _VLLMScan(StopScan):
    def __init__(
        self,
        rules: VLLMStops,
        prompt: list[int],
        params: SamplingParams,
        eos_token_ids: Sequence[int],
    ) -> None:
        self.params = params
        self.forbidden = _stop_tokens(params, eos_token_ids)
        self.eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self.stop_ids = frozenset(params.stop_token_ids)
        self.detok = VLLMText(rules, prompt, params.min_new_tokens)

    def banned(self, generated: int) -> Sequence[int]:
        return self.forbidden if generated < self.params.min_new_tokens else ()

    def after(self, out: list[int]) -> Finish | None:
        token = out[-1]
        finish: Finish | None = None
        if token in self.eos:  # the engine core's checks first
            finish = {"type": "stop", "matched": None}
        elif token in self.stop_ids:
            finish = {"type": "stop", "matched": token}
        elif len(out) >= self.params.max_new_tokens:
            finish = {"type": "length", "length": len(out)}
        stop = self.detok.add(token, finish is not None and finish["type"] == "stop")
        if stop is not None:  # then the detokenizer's: a stop string wins
            finish = {"type": "stop", "matched": stop}
        return finish

    def text(self, out: list[int], finish: Finish) -> str | None:
        return self.detok.text if self.detok.step is not None else None
