"""The gateway's own tokenizer: prompts in (text and chat template), text out (incremental).

The gateway always sends token ids to the engines and decodes their output ids itself, so a
stream continued on another engine after a crash reads as one uninterrupted stream. Owns:

* :class:`GatewayTokenizer`: a model's tokenizer loaded from local files
  (``transformers.AutoTokenizer``, ``local_files_only``): :meth:`~GatewayTokenizer.encode`,
  :meth:`~GatewayTokenizer.chat_prompt` (the model's chat template with tools and
  ``add_generation_prompt``, rendered to text then encoded without special tokens, as vLLM
  0.33's chat renderer does: ``ChatCompletionRequest.add_special_tokens`` defaults to false),
  the EOS ids (the tokenizer's, ``config.json``'s and ``generation_config.json``'s, as the
  engines stop on all of them) and per-token strings for logprobs (vLLM's
  ``convert_ids_list_to_tokens``: each id decoded alone).
* :class:`Detokenizer`: output ids to text deltas, correct across multi-byte UTF-8 characters
  split over tokens and BPE merges: the prefix/read-offset window of vLLM's incremental
  detokenization (``vllm/tokenizers/detokenizer_utils.py`` ``detokenize_incrementally``, the
  same scheme as SGLang's detokenizer manager), primed with the prompt's last 5 ids
  (``INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET``); a window whose text ends in U+FFFD waits for
  more ids; :meth:`~Detokenizer.flush` gives what is left. The deltas joined equal
  ``decode(all ids)`` (tests/test_gateway_protocol.py checks it on random splits). Decoding is
  the ``tokenizers`` backend's (Rust, no ``clean_up_tokenization_spaces``), as vLLM's fast path.
  A tokenizer whose decoder is byte-level alone (GPT-2's byte-to-unicode alphabet: Llama 3,
  Qwen, the tiny model) decodes ids to text as the UTF-8 of their bytes joined, so there the
  detokenizer joins each id's bytes (a table built at load) into an incremental UTF-8 decoder
  instead of decoding a window twice a token; :meth:`GatewayTokenizer.token_bytes` is checked
  against the backend's decode of each id at load (any difference: the window). The deltas are
  the same text, sooner where the window waited on an invalid byte.
* :class:`StopStrings`: stop strings found in decoded text as vLLM's ``check_stop_strings``
  finds them (``vllm/v1/engine/detokenizer.py``: only new text is searched, the stop string
  that completes first wins, the text is cut before it, or after it with
  ``include_stop_str_in_output``), and the hold-back of a stream: the longest end of the text
  that is the start of a stop string is not sent yet, so a client never sees the first
  characters of a stop string that is then trimmed. (vLLM holds back a fixed
  ``max(len(stop)) - 1`` characters; holding back only a real prefix sends the same text,
  sooner.)
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rollsafe.errors import InvalidArgument
from rollsafe.gateway.requests import InvalidRequest

__all__ = ["INITIAL_OFFSET", "Detokenizer", "GatewayTokenizer", "StopStrings"]

#: prompt ids that prime a detokenizer (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)
INITIAL_OFFSET = 5
_REPLACEMENT = "\ufffd"


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves,
    the other 68 for the characters from U+0100 up, in byte order."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in kept}
    extra = 0
    for b in range(256):
        if b not in table.values():
            table[chr(0x100 + extra)] = b
            extra += 1
    return table


_BYTE_OF = _byte_alphabet()
#: a vocabulary at most this large is checked id by id at load (larger: its first and last 4096)
_CHECK_ALL = 1 << 17


class GatewayTokenizer:
    """A model's tokenizer as the gateway uses it (see the module docstring)."""

    def __init__(
        self, hf_tokenizer: Any, *, eos_token_ids: Iterable[int] = (), name: str = ""
    ) -> None:
        self.hf = hf_tokenizer
        backend = getattr(hf_tokenizer, "_tokenizer", None)
        # the Rust tokenizer of a fast tokenizer: decode without Python overhead
        self._backend = backend if hasattr(backend, "decode") else None
        eos = set(int(t) for t in eos_token_ids)
        own = getattr(hf_tokenizer, "eos_token_id", None)
        if isinstance(own, int):
            eos.add(own)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.vocab_size: int = len(hf_tokenizer)
        self.name = name
        self._token_text: dict[int, str] = {}
        #: each id's bytes, special tokens kept [False] and skipped [True] (byte-level only)
        self._tables: dict[bool, list[bytes]] = {}
        #: ids decode as their bytes joined (see the module docstring); set by the check
        self.byte_level = self._check_byte_level()

    @classmethod
    def from_pretrained(cls, model_path: str | Path, **kwargs: Any) -> GatewayTokenizer:
        """Load the tokenizer of the model directory ``model_path`` from its files only."""
        from transformers import AutoTokenizer

        path = Path(model_path)
        if not path.is_dir():
            raise InvalidArgument("model_path", f"model_path {path} is not a model directory")
        try:
            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True, **kwargs)
        except (OSError, ValueError) as exc:
            raise InvalidArgument(
                "model_path", f"model_path: cannot load a tokenizer from {path}: {exc}"
            ) from None
        eos: set[int] = set()
        for name in ("config.json", "generation_config.json"):
            try:
                config = json.loads((path / name).read_text())
            except (OSError, ValueError):
                continue
            found = config.get("eos_token_id") if isinstance(config, dict) else None
            if isinstance(found, int):
                eos.add(found)
            elif isinstance(found, list):
                eos.update(t for t in found if isinstance(t, int))
        return cls(hf, eos_token_ids=eos, name=path.name)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids (the tokenizer's special tokens added unless told not to)."""
        if self._backend is not None:
            return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (the backend's decode, no clean-up of spaces)."""
        if self._backend is not None:
            return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))
        return str(self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def _check_byte_level(self) -> bool:
        """Whether the backend's decoder is the byte-level one alone and every checked id's
        bytes decode as the backend decodes that id (both ways of skipping special tokens).
        Builds the tables :meth:`token_bytes` reads."""
        backend = self._backend
        if backend is None:
            return False
        try:
            decoder = json.loads(backend.to_str()).get("decoder") or {}
            added = backend.get_added_tokens_decoder()
            size = int(backend.get_vocab_size(with_added_tokens=True))
        except Exception:  # an older or a Python tokenizer: the window
            return False
        if decoder.get("type") != "ByteLevel":
            return False
        kept: list[bytes] = []
        for i in range(size):
            token = backend.id_to_token(i) or ""
            kept.append(
                b"".join(bytes((_BYTE_OF[c],)) if c in _BYTE_OF else c.encode() for c in token)
            )
        skipped = list(kept)
        for i, tok in added.items():
            if tok.special and 0 <= int(i) < size:
                skipped[int(i)] = b""
        tables = {False: kept, True: skipped}
        ids = range(size) if size <= _CHECK_ALL else [*range(4096), *range(size - 4096, size)]
        for skip, table in tables.items():
            for i in ids:
                if table[i].decode("utf-8", "replace") != backend.decode(
                    [i], skip_special_tokens=skip
                ):
                    return False
        self._tables = tables
        return True

    def token_bytes(self, token_id: int, *, skip_special_tokens: bool = True) -> bytes:
        """The bytes the byte-level decoder turns ``token_id`` into: none for a special token
        skipped, or an id outside the vocabulary (the backend skips those too). Only for a
        :attr:`byte_level` tokenizer."""
        table = self._tables[skip_special_tokens]
        return table[token_id] if 0 <= token_id < len(table) else b""

    def bytes_table(self, skip_special_tokens: bool = True) -> list[bytes]:
        """Every id's bytes (see :meth:`token_bytes`), indexed by id."""
        return self._tables[skip_special_tokens]

    def token_text(self, token_id: int) -> str:
        """One token's own text, as logprobs show it (decoded alone, special tokens kept)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.decode([token_id], skip_special_tokens=False)
            if len(self._token_text) < 1 << 17:
                self._token_text[token_id] = text
        return text

    def chat_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """``messages`` rendered with the model's chat template (a :class:`InvalidRequest` naming
        ``messages`` when the model has none or the template refuses them)."""
        if not self.has_chat_template:
            raise InvalidRequest(
                "messages",
                f"the model {self.name or ''} has no chat template (tokenizer_config.json "
                "chat_template or chat_template.jinja): send a text prompt to /v1/completions",
            )
        try:
            text = self.hf.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **template_kwargs,
            )
        except Exception as exc:  # jinja2's TemplateError and what a template raises
            if type(exc).__name__ in ("TemplateError", "TemplateSyntaxError", "UndefinedError"):
                raise InvalidRequest(
                    "messages", f"the chat template refused the messages: {exc}"
                ) from None
            if isinstance(exc, (ValueError, TypeError, KeyError)):
                raise InvalidRequest(
                    "messages", f"the chat template refused the messages: {exc}"
                ) from None
            raise
        if not isinstance(text, str):
            raise InvalidRequest("messages", "the chat template did not render to text")
        return text

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """The token ids of ``messages`` under the chat template (see :meth:`chat_text`)."""
        text = self.chat_text(
            messages, tools, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        return self.encode(text, add_special_tokens=False)


class Detokenizer:
    """Output ids in, text deltas out (see the module docstring). ``prompt_ids`` prime the
    window (a tokenizer whose first output token's text depends on what precedes it);
    ``add(ids)`` returns the new text, ``flush()`` the text still waiting at the end."""

    __slots__ = ("_bytes", "_decode", "_prefix_len", "_read", "_skip", "_utf8", "_window")

    def __init__(
        self,
        tokenizer: GatewayTokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._decode = tokenizer.decode
        self._skip = skip_special_tokens
        self._window: list[int] = list(prompt_ids[-INITIAL_OFFSET:]) if prompt_ids else []
        self._read = len(self._window)
        self._utf8: Any = None
        if tokenizer.byte_level:
            # the prompt's last bytes primed: a character it left incomplete ends in the output
            self._bytes = tokenizer.bytes_table(skip_special_tokens)
            self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
            self._utf8.decode(self._joined(self._window))
            self._prefix_len = 0
            return
        self._prefix_len = len(self._text(self._window)) if self._window else 0

    def _joined(self, ids: Iterable[int]) -> bytes:
        table = self._bytes
        try:
            return b"".join([table[i] for i in ids])
        except IndexError:  # an id past the tokenizer's vocabulary (a padded embedding)
            n = len(table)
            return b"".join([table[i] if 0 <= i < n else b"" for i in ids])

    def _text(self, ids: Sequence[int]) -> str:
        return self._decode(ids, skip_special_tokens=self._skip)

    def add(self, ids: Iterable[int]) -> str:
        """The text the new ``ids`` complete (may be empty while a character is incomplete).
        Several ids at once are decoded together when their text ends on a whole character
        (the window then keeps the last :data:`INITIAL_OFFSET` of them as the next prefix);
        otherwise one at a time."""
        if self._utf8 is not None:
            return str(self._utf8.decode(self._joined(ids)))
        ids = ids if isinstance(ids, (list, tuple)) else list(ids)
        window = self._window
        if len(ids) > 1:
            start = len(window)
            window.extend(ids)
            text = self._text(window)
            if len(text) > self._prefix_len and not text.endswith(_REPLACEMENT):
                out = text[self._prefix_len :]
                del window[: max(self._read, len(window) - INITIAL_OFFSET)]
                self._read = len(window)
                self._prefix_len = len(self._text(window))
                return out
            del window[start:]
        out = ""
        for token in ids:
            window.append(token)
            text = self._text(window)
            if len(text) > self._prefix_len and not text.endswith(_REPLACEMENT):
                out += text[self._prefix_len :]
                # the new prefix is what was just read; drop the ids before it
                del window[: self._read]
                self._read = len(window)
                self._prefix_len = len(self._text(window))
        return out

    def flush(self) -> str:
        """The text of ids still held back (an incomplete character ends as U+FFFD)."""
        if self._utf8 is not None:
            out = str(self._utf8.decode(b"", final=True))
            self._utf8.reset()
            return out
        text = self._text(self._window)
        out = text[self._prefix_len :] if len(text) > self._prefix_len else ""
        self._window = self._window[len(self._window) :]
        self._read = 0
        self._prefix_len = 0
        return out


class StopStrings:
    """Stop strings over decoded text (see the module docstring)."""

    __slots__ = ("include", "max_len", "stops")

    def __init__(self, stops: Sequence[str], *, include: bool = False) -> None:
        self.stops = tuple(s for s in stops if s)
        self.include = include
        self.max_len = max((len(s) for s in self.stops), default=0)

    def __bool__(self) -> bool:
        return bool(self.stops)

    def find(self, text: str, new_chars: int, start: int = 0) -> tuple[str, int] | None:
        """The stop string completed in the last ``new_chars`` characters of ``text`` (none
        starting before ``start``) that completes first, and where the text ends: before it,
        or after it when ``include``. None when none is there."""
        if not new_chars or not self.stops:
            return None
        best: tuple[str, int, int] | None = None
        n = len(text)
        for stop in self.stops:
            at = text.find(stop, max(start, n - new_chars - len(stop) + 1))
            if at == -1:
                continue
            end = at + len(stop)
            if best is None or end < best[2]:
                best = (stop, at, end)
        if best is None:
            return None
        stop, at, end = best
        return stop, end if self.include else at

    def holdback(self, text: str) -> int:
        """How many characters at the end of ``text`` could be the start of a stop string
        (held back from a stream until the next tokens say; 0 with ``include``)."""
        if self.include or not self.stops or not text:
            return 0
        n = len(text)
        best = 0
        for stop in self.stops:
            first = stop[0]
            i = text.find(first, max(n - len(stop) + 1, 0))
            while i != -1 and n - i > best:
                if stop.startswith(text[i:]):
                    best = n - i
                    break
                i = text.find(first, i + 1)
        return best
