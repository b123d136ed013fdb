"""Streaming generation: read an engine's server-sent events as normalized token deltas.

Owns the client side of ``stream: true`` for both dialects (facts from the pinned wheels;
docs/engines.md, "Streaming", lists them with their source files):

=====================  ===========================================  ==========================
                       SGLang 0.5.23 ``POST /generate``             vLLM 0.33.0
                                                                    ``POST /v1/completions``
=====================  ===========================================  ==========================
framing                ``data: <json>\\n\\n`` per event, ``data: [DONE]\\n\\n`` last (both)
tokens per event       ``output_ids`` so far (cumulative: the        ``choices[0].token_ids``:
                       server default ``incremental_streaming_       this event's tokens only
                       output=False``)                              (with ``return_token_ids``)
serving version        ``meta_info.weight_version`` on every event  none until the end
spans of versions      ``meta_info.weight_versions`` on the last    ``weight_versions`` on the
                       event                                        last event (when asked)
finish                 ``meta_info.finish_reason`` (``{type}``)     ``finish_reason`` (string)
error after the start  ``data: {"error": {message, code, ...}}``    ``data: {"error": {...}}``
=====================  ===========================================  ==========================

:class:`SSELineDecoder` splits bytes into lines and :class:`SSEEventReader` lines into JSON
events (incrementally, chunk by chunk: the one implementation of the framing rules, used by the
blocking :func:`read_events` and by the asyncio reader of :mod:`~rollsafe.adapters.engines.aio`);
:class:`SGLangDeltas` and :class:`VLLMDeltas` (:func:`delta_reader`) turn events into
:class:`StreamDelta` (new tokens only, never a token twice:
a cumulative event that does not extend what was already received is a
:class:`StreamProtocolError`; SGLang's cumulative events are decoded only as far as they are
new, :meth:`SGLangDeltas.decode`, so a stream costs O(tokens), not O(tokens²)). A stream that
ends without a finished event (the engine died, the connection dropped) raises
:class:`EngineUnavailable` after the deltas already yielded, so the caller keeps every token it
saw.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollsafe import json_codec
from rollsafe.adapters.engines.errors import (
    EngineError,
    EngineRequestError,
    EngineTimeout,
    EngineUnavailable,
)
from rollsafe.runs import merge_runs

if TYPE_CHECKING:  # the blocking clients' transport (httpx); the readers below need none
    from rollsafe.adapters.engines.http import HttpTransport

__all__ = [
    "SGLangDeltas",
    "SSEEventReader",
    "SSELineDecoder",
    "StreamDelta",
    "StreamProtocolError",
    "VLLMDeltas",
    "WeightSpan",
    "coalesce_deltas",
    "delta_reader",
    "read_events",
    "sse_lines",
    "stream_deltas",
]

#: the data of the event that ends every stream
DONE = "[DONE]"
#: an event longer than this is refused (a stream is never a way to exhaust the router's memory)
MAX_EVENT_BYTES = 64 << 20


class StreamProtocolError(EngineError):
    """An engine's event stream broke the dialect's contract (bad JSON, a cumulative event that
    does not extend the tokens already received, an event past ``[DONE]``)."""

    def __init__(self, url: str, path: str, reason: str) -> None:
        self.url, self.path, self.reason = url, path, reason
        super().__init__(f"engine {url} sent a malformed stream on {path}: {reason}")


@dataclass(frozen=True)
class WeightSpan:
    """Output tokens ``[start, end)`` were produced by weights ``version`` (engine's string)."""

    version: str
    start: int
    end: int


@dataclass(frozen=True)
class StreamDelta:
    """What one event added: ``token_ids`` new since the previous event, their ``text``, the
    serving ``weight_version`` when the event says (SGLang: every event; vLLM: the last), and
    on the last event ``finished``, ``finish_reason`` and the ``spans`` over the whole output.
    ``logprobs``: the sampled tokens' log-probabilities, one per ``token_ids`` entry (None where
    the engine sent a null), when the request asked for them (``return_logprob``) and the
    engine sent them; else empty."""

    token_ids: tuple[int, ...]
    text: str = ""
    weight_version: str | None = None
    finished: bool = False
    finish_reason: str | None = None
    spans: tuple[WeightSpan, ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)
    logprobs: tuple[float | None, ...] = ()


def coalesce_deltas(
    deltas: Sequence[StreamDelta], *, into_finished: bool = True
) -> list[StreamDelta]:
    """``deltas`` (read together, in order) with each run of neighbours that share a
    ``weight_version`` merged into one: the tokens, text and logprobs joined, the last one's
    finish, spans and meta kept. Nothing merges past a finished delta, nor into one with
    ``into_finished=False`` (a vLLM 0.32 stream, whose last delta's version is read after it),
    and two deltas merge only when both carry a logprob per token or both none (so a merged
    delta still carries one per token or none). What an engine already sent arrives as one
    delta instead of one per event: fewer trips through the data plane when the gateway is
    behind, the same tokens, text and versions."""

    def joins(prev: StreamDelta, delta: StreamDelta) -> bool:
        return not (
            prev.finished
            or (delta.finished and not into_finished)
            or prev.weight_version != delta.weight_version
            or (len(prev.logprobs) == len(prev.token_ids))
            != (len(delta.logprobs) == len(delta.token_ids))
        )

    def merge(run: Sequence[StreamDelta]) -> StreamDelta:
        last = run[-1]
        return StreamDelta(
            tuple(t for d in run for t in d.token_ids),
            "".join(d.text for d in run),
            last.weight_version,
            finished=last.finished,
            finish_reason=last.finish_reason,
            spans=last.spans,
            meta=last.meta,
            logprobs=tuple(lp for d in run for lp in d.logprobs),
        )

    return merge_runs(deltas, joins, merge)


def _logprob(value: Any) -> float | None:
    return None if value is None else float(value)


def read_events(
    transport: HttpTransport,
    path: str,
    body: Mapping[str, Any],
    timeout: float | None,
    decode: Callable[[str], dict[str, Any]] | None = None,
) -> Iterator[dict[str, Any]]:
    """POST ``body`` and yield each JSON event of the answer until ``data: [DONE]`` (each
    event's text through ``decode``: :class:`SSEEventReader`).

    The request is resent only when it provably never reached the engine (no connection); a
    5xx answer's connection is not reused (:class:`HttpTransport`). An HTTP error status is
    :class:`EngineRequestError`; a connection that fails or ends before
    ``[DONE]`` is :class:`EngineUnavailable` (:class:`EngineTimeout` when no byte came within
    ``timeout``); an ``{"error": ...}`` event is :class:`EngineRequestError` with its code.
    """
    import httpx  # the blocking clients' extra; the dataclasses above need none

    url = transport.url
    call_timeout = transport.timeout if timeout is None else timeout
    response = transport.open("POST", path, json_body=dict(body), timeout=timeout)
    if response.status_code >= 400:
        raise transport.error_of(path, response)
    try:
        reader = SSEEventReader(url, path, decode)
        try:
            for chunk in response.iter_bytes():
                yield from reader.feed(chunk)
                if reader.done:
                    return
        except httpx.TimeoutException as exc:
            raise EngineTimeout(url, path, f"no event within {call_timeout}s") from exc
        except httpx.TransportError as exc:
            raise EngineUnavailable(
                url, path, f"stream broke: {type(exc).__name__}: {exc}"
            ) from exc
        yield from reader.end()
    finally:
        response.close()


#: Server-sent events end lines with CRLF, LF or CR only (the HTML spec). Not httpx's
#: ``iter_lines``: it splits like ``str.splitlines``, also on U+0085, U+2028, U+2029 and
#: \x0b-\x1e, which vLLM's JSON carries unescaped inside token text (a tiny model's random
#: tokens produced them; the event was cut and read as bad JSON).
_EOL = re.compile(rb"\r\n|\r|\n")


class SSELineDecoder:
    """The lines of a server-sent event stream fed chunk by chunk, split only at CRLF, LF or
    CR, decoded as UTF-8 (a CR at the end of a chunk waits for the next one: it may be half of a
    CRLF). A line growing past :data:`MAX_EVENT_BYTES` is a :class:`StreamProtocolError`."""

    def __init__(self, url: str = "", path: str = "") -> None:
        self.url, self.path = url, path
        #: the pieces of the line not ended yet (a long event's chunks are kept apart and
        #: joined once its line ends: joining at every chunk copied it over and over)
        self._held: list[bytes] = []
        self._held_bytes = 0

    def feed(self, chunk: bytes) -> list[str]:
        """The lines ``chunk`` completes."""
        held_cr = bool(self._held) and self._held[-1].endswith(b"\r")
        if not held_cr and b"\n" not in chunk and b"\r" not in chunk:
            if chunk:  # no line ends here: kept, not joined
                self._held.append(chunk)
                self._held_bytes += len(chunk)
                self._check()
            return []
        data = b"".join((*self._held, chunk)) if self._held else chunk
        if b"\r" in data:
            held = data.endswith(b"\r")
            parts = _EOL.split(data[:-1] if held else data)
        else:  # LF only (what the engines send): bytes.split, no regex
            held = False
            parts = data.split(b"\n")
        rest = parts.pop() + (b"\r" if held else b"")
        self._held = [rest] if rest else []
        self._held_bytes = len(rest)
        self._check()
        return [part.decode("utf-8", errors="replace") for part in parts]

    def _check(self) -> None:
        if self._held_bytes > MAX_EVENT_BYTES:
            raise StreamProtocolError(self.url, self.path, "event larger than 64 MiB")

    def flush(self) -> list[str]:
        """The stream ended: the non-empty lines still held."""
        pending = b"".join(self._held)
        self._held, self._held_bytes = [], 0
        return [p.decode("utf-8", errors="replace") for p in _EOL.split(pending) if p]


def sse_lines(chunks: Iterator[bytes], url: str = "", path: str = "") -> Iterator[str]:
    """The lines of a server-sent event stream (:class:`SSELineDecoder` over ``chunks``)."""
    decoder = SSELineDecoder(url, path)
    for chunk in chunks:
        yield from decoder.feed(chunk)
    yield from decoder.flush()


class SSEEventReader:
    """The JSON events of a server-sent event stream fed chunk by chunk: ``data:`` lines are
    joined until a blank line; comments, other fields and keep-alive blank lines are skipped;
    ``data: [DONE]`` ends it (:attr:`done`; whatever follows is ignored); an event's data past
    :data:`MAX_EVENT_BYTES` is a :class:`StreamProtocolError`; an ``{"error": ...}`` event is an
    :class:`EngineRequestError` (raised after the events before it were yielded). ``decode``
    turns an event's text into its object (default: JSON with those rules; SGLang's streams
    pass :meth:`SGLangDeltas.decode`)."""

    def __init__(
        self, url: str, path: str, decode: Callable[[str], dict[str, Any]] | None = None
    ) -> None:
        self.url, self.path = url, path
        self._decode = decode or functools.partial(_event, url, path)
        self.lines = SSELineDecoder(url, path)
        #: ``data: [DONE]`` was read
        self.done = False
        self._data: list[str] = []
        self._size = 0

    def feed(self, chunk: bytes) -> Iterator[dict[str, Any]]:
        """The events ``chunk`` completes, up to ``[DONE]``."""
        yield from self._events(self.lines.feed(chunk))

    def end(self) -> Iterator[dict[str, Any]]:
        """The stream ended: the events still held; :class:`EngineUnavailable` (after them)
        unless ``[DONE]`` came."""
        yield from self._events(self.lines.flush())
        if self.done:
            return
        if self._data and "\n".join(self._data) == DONE:
            self.done = True
            return
        raise EngineUnavailable(self.url, self.path, "stream ended before data: [DONE]")

    def _events(self, lines: list[str]) -> Iterator[dict[str, Any]]:
        for line in lines:
            if self.done:
                return
            if line.startswith("data:"):
                chunk = line[5:].lstrip(" ")
                self._size += len(chunk)
                if self._size > MAX_EVENT_BYTES:
                    raise StreamProtocolError(self.url, self.path, "event larger than 64 MiB")
                self._data.append(chunk)
                continue
            if line or not self._data:
                continue  # comments, other fields, keep-alive blank lines
            text = "\n".join(self._data)
            self._data, self._size = [], 0
            if text == DONE:
                self.done = True
                return
            yield self._decode(text)


def _event(url: str, path: str, text: str) -> dict[str, Any]:
    try:
        event = json_codec.loads(text)
    except ValueError as exc:
        raise StreamProtocolError(url, path, f"event is not JSON: {text[:80]!r}") from exc
    if not isinstance(event, dict):
        raise StreamProtocolError(url, path, f"event is not an object: {text[:80]!r}")
    error = event.get("error")
    if error is not None:
        message = error.get("message") if isinstance(error, Mapping) else error
        code = error.get("code") if isinstance(error, Mapping) else None
        status = code if isinstance(code, int) and 400 <= code < 600 else 500
        raise EngineRequestError(url, path, status, f"error in stream: {message}")
    return event


def _spans(raw: Any) -> tuple[WeightSpan, ...]:
    if not isinstance(raw, Sequence):
        return ()
    out: list[WeightSpan] = []
    for item in raw:
        if isinstance(item, Mapping):
            out.append(WeightSpan(str(item["version"]), int(item["start"]), int(item["end"])))
        elif isinstance(item, Sequence) and len(item) == 3:  # msgspec array_like form
            out.append(WeightSpan(str(item[0]), int(item[1]), int(item[2])))
    return tuple(out)


#: an SGLang event as its server writes it (``{"text": ..., "output_ids": [...], "meta_info":
#: {...}}``, compact or with spaces): the text's and the ids' JSON, and where ``meta_info``'s
#: value starts (the string's end is found by :func:`_string_end`)
_SGLANG_HEAD = re.compile(r'\{\s*"text"\s*:\s*"')
_SGLANG_IDS = re.compile(r'\s*,\s*"output_ids"\s*:\s*\[')
_SGLANG_META = re.compile(r'\]\s*,\s*"meta_info"\s*:\s*')
#: what the ids of the first event recorded may hold (checked once, on that event)
_ID_LIST = re.compile(r"[0-9,\s]*")
#: a JSON escape of a low surrogate: a text cut between the two halves of a pair is not the
#: concatenation of its two halves decoded apart
_LOW_SURROGATE = re.compile(r"\\u[dD][c-fC-F]")
#: events shorter than this (characters) are decoded whole (measured: the parts cost more than
#: a whole decode up to about 100 tokens, ~1,500 characters; ``bench_sglang_stream_decode.py``)
INCREMENTAL_FROM = 2048
#: the key of a :meth:`SGLangDeltas.decode` event that holds the new text, ids and logprobs only
INCREMENTAL = "rollsafe.incremental"
_LOGPROBS = "output_token_logprobs"
_LOGPROBS_KEY = re.compile(r'"output_token_logprobs"\s*:\s*\[')
_DECODER = json.JSONDecoder()


def _logprobs_at(meta_raw: str) -> int | None:
    """Where the content of ``meta_info``'s ``output_token_logprobs`` list starts, if it has
    one (found by str.find: the key cannot appear inside a string value as written, where its
    quotes would be escaped)."""
    key = meta_raw.find('"output_token_logprobs"')
    if key < 0:
        return None
    found = _LOGPROBS_KEY.match(meta_raw, key)
    return None if found is None else found.end()


def _logprobs_written(meta_raw: str) -> tuple[bool, str | None]:
    """The content of ``meta_info``'s ``output_token_logprobs`` list as written (None: no such
    key), and False when it could not be read (the next event is then decoded whole)."""
    at = _logprobs_at(meta_raw)
    if at is None:
        return True, None
    try:
        _items, end = _DECODER.raw_decode(meta_raw, at - 1)
    except ValueError:
        return False, None
    return True, meta_raw[at : end - 1]


def _string_end(text: str, start: int) -> int:
    """The index of the quote that ends the JSON string whose content starts at ``start``."""
    end = text.find('"', start)
    while end > 0:
        slashes = 0
        while text[end - 1 - slashes] == "\\":
            slashes += 1
        if slashes % 2 == 0:
            return end
        end = text.find('"', end + 1)
    return -1


class SGLangDeltas:
    """SGLang events (cumulative ``output_ids`` and ``text``) -> :class:`StreamDelta`.

    Every SGLang event carries everything generated so far, so decoding each whole costs
    O(tokens) per event and O(tokens²) per answer (4,096 tokens: about a second of CPU).
    :meth:`decode` decodes only what is new: when an event's text, ids and ``meta_info``'s
    ``output_token_logprobs`` (``return_logprob``), as the server wrote them, begin with the
    previous event's (a string comparison, in C), only the rest and ``meta_info``'s other keys
    are decoded; anything else (short events, the first long one, another layout, an error
    event, a text that changed, a surrogate pair cut in two) is decoded whole, by the same
    rules, and checked as before. A delta's ``meta`` does not repeat the logprobs so far (they
    are its ``logprobs``)."""

    def __init__(self, url: str, path: str) -> None:
        self.url, self.path = url, path
        self.ids: list[int] = []
        self._text = ""
        #: text of incremental events not yet joined to ``_text``
        self._text_tail: list[str] = []
        self.logprobs_seen = 0
        #: the previous event's text and ids as written (JSON), when it had SGLang's layout
        self._written: tuple[str, str] | None = None
        #: the previous event's ``output_token_logprobs`` list as written (None: it had none)
        self._lps: str | None = None

    def decode(self, raw: str) -> dict[str, Any]:
        """The event ``raw`` (one event's JSON text): whole, or only what is new (from the
        event after the first of :data:`INCREMENTAL_FROM` characters or more: below that a
        whole decode costs less than finding the parts)."""
        if len(raw) < INCREMENTAL_FROM:
            self._written = None
            return _event(self.url, self.path, raw)
        written = meta_raw = None
        head = _SGLANG_HEAD.match(raw)
        if head is not None:  # the spans by str.find and short matches: no scan in Python
            start = head.end()
            # the text as far as the previous event's is known to hold no closing quote
            known = self._written[0] if self._written is not None else ""
            end = _string_end(raw, start + len(known) if raw.startswith(known, start) else start)
            ids = _SGLANG_IDS.match(raw, end + 1) if end > 0 else None
            close = raw.find("]", ids.end()) if ids is not None else -1
            meta = _SGLANG_META.match(raw, close) if ids is not None and close > 0 else None
            tail = len(raw.rstrip()) - 1  # the object's closing brace
            if ids is not None and meta is not None and raw[tail] == "}" and tail > meta.end():
                written = (raw[start:end], raw[ids.end() : close].strip())
                meta_raw = raw[meta.end() : tail]
        if written is not None and meta_raw is not None:
            fresh = self._fresh(written, meta_raw)
            if fresh is not None:
                self._written = written
                return fresh
        event = _event(self.url, self.path, raw)  # whole, checked as always
        self._written = self._lps = None
        if written is not None and meta_raw is not None and _ID_LIST.fullmatch(written[1]):
            readable, self._lps = _logprobs_written(meta_raw)
            self._written = written if readable else None
        return event

    def _fresh(self, written: tuple[str, str], meta_raw: str) -> dict[str, Any] | None:
        """The event with only its new text, ids and logprobs, when it extends the previous
        one as written; None: decode it whole."""
        before = self._written
        if before is None:
            return None
        text, ids = written
        old_text, old_ids = before
        if not text.startswith(old_text) or _LOW_SURROGATE.match(text, len(old_text)):
            return None
        if not old_ids:
            new_ids = ids
        elif ids == old_ids:
            new_ids = ""
        elif ids.startswith(old_ids) and ids[len(old_ids) :].lstrip().startswith(","):
            new_ids = ids[len(old_ids) :].lstrip()[1:]
        else:
            return None
        lps = self._fresh_logprobs(meta_raw)
        if lps is None:
            return None
        meta_small, new_lps, lps_written = lps
        try:
            meta = json_codec.loads(meta_small)
            new_text = json_codec.loads(f'"{text[len(old_text) :]}"')
            fresh_ids = json_codec.loads(f"[{new_ids}]")
        except ValueError:
            return None  # decoded whole: the same error as ever
        if not isinstance(meta, dict) or any(type(t) is not int for t in fresh_ids):
            return None
        if new_lps is not None:
            meta[_LOGPROBS] = new_lps
        self._lps = lps_written
        return {"text": new_text, "output_ids": fresh_ids, "meta_info": meta, INCREMENTAL: True}

    def _fresh_logprobs(self, meta_raw: str) -> tuple[str, list[Any] | None, str | None] | None:
        """``meta_info``'s JSON with its ``output_token_logprobs`` list emptied, the list's new
        items, and the list as written; ``(meta_raw, None, None)`` when it has none; None
        when it does not extend the previous event's list (decode it whole)."""
        at = _logprobs_at(meta_raw)
        if at is None:
            return (meta_raw, None, None) if self._lps is None else None
        old = self._lps
        if old is None or not meta_raw.startswith(old, at):
            return None
        pos = at + len(old)
        if old:  # the next is "]" (nothing new) or "," and the new items
            rest = meta_raw[pos:].lstrip()
            pos = len(meta_raw) - len(rest) + 1
            if rest.startswith("]"):
                return meta_raw[:at] + meta_raw[pos - 1 :], [], old
            if not rest.startswith(","):
                return None
        try:
            items, used = _DECODER.raw_decode("[" + meta_raw[pos:])
        except ValueError:
            return None
        close = pos + used - 1  # just past the list's "]" in meta_raw
        if not isinstance(items, list):
            return None
        return meta_raw[:at] + meta_raw[close - 1 :], items, meta_raw[at : close - 1]

    def __call__(self, event: Mapping[str, Any]) -> StreamDelta:
        if event.get(INCREMENTAL):
            return self._incremental(event)
        raw = event.get("output_ids") or []
        n = len(self.ids)
        if type(raw) is list and len(raw) >= n and raw[:n] == self.ids:  # new ids only
            new = [int(t) for t in raw[n:]]
            self.ids.extend(new)
        else:
            ids = [int(t) for t in raw]
            if len(ids) < n or ids[:n] != self.ids:
                raise StreamProtocolError(
                    self.url,
                    self.path,
                    f"cumulative output_ids ({len(ids)}) do not extend the {n} already received",
                )
            new = ids[n:]
            self.ids = ids
        text = event.get("text")
        delta_text = ""
        if isinstance(text, str):
            if self._text_tail:
                self._join_text()
            before = self._text
            delta_text = text[len(before) :] if text.startswith(before) else text
            self._text = text
        return self._delta(new, delta_text, event.get("meta_info") or {})

    def _incremental(self, event: Mapping[str, Any]) -> StreamDelta:
        """A :meth:`decode` event: its text, ids and logprobs are the new ones already."""
        new = [int(t) for t in event["output_ids"]]
        self.ids.extend(new)
        delta_text: str = event["text"]
        self._text_tail.append(delta_text)  # joined when a whole event needs the text
        return self._delta(new, delta_text, event["meta_info"], True)

    def _join_text(self) -> None:
        self._text = "".join((self._text, *self._text_tail))
        self._text_tail.clear()

    @property
    def text(self) -> str:
        """The text so far."""
        if self._text_tail:
            self._join_text()
        return self._text

    def _delta(
        self,
        new: list[int],
        delta_text: str,
        meta: Mapping[str, Any],
        incremental: bool = False,
    ) -> StreamDelta:
        reason = meta.get("finish_reason")
        # (None checked first: an ABC isinstance costs a microsecond, on every event)
        kind = reason.get("type") if reason is not None and isinstance(reason, Mapping) else reason
        version = meta.get("weight_version")
        logprobs: tuple[float | None, ...] = ()
        # [logprob, token id, text] each: so far (cumulative), or the new ones (incremental)
        raw_lps = meta.get(_LOGPROBS)
        if raw_lps is not None and isinstance(raw_lps, Sequence):
            fresh = raw_lps if incremental else raw_lps[self.logprobs_seen :]
            self.logprobs_seen += len(fresh)
            logprobs = tuple(
                _logprob(item[0] if isinstance(item, Sequence) else item) for item in fresh
            )
            # read into ``logprobs``: a delta does not carry the list so far again
            meta = {k: v for k, v in meta.items() if k != _LOGPROBS}
        return StreamDelta(
            tuple(new),
            delta_text,
            None if version is None else str(version),
            finished=reason is not None,
            finish_reason=None if kind is None else str(kind),
            spans=_spans(spans) if (spans := meta.get("weight_versions")) is not None else (),
            meta=dict(meta),
            logprobs=logprobs,
        )


class VLLMDeltas:
    """vLLM completion events (``token_ids`` per event) -> :class:`StreamDelta`."""

    def __init__(self, url: str, path: str) -> None:
        self.url, self.path = url, path

    def __call__(self, event: Mapping[str, Any]) -> StreamDelta:
        choices = event.get("choices") or []
        if not choices:  # the usage-only event (stream_options.include_usage)
            return StreamDelta((), meta={k: v for k, v in event.items() if k != "choices"})
        choice = choices[0]
        if not isinstance(choice, Mapping):
            raise StreamProtocolError(self.url, self.path, "choice is not an object")
        raw = choice.get("token_ids")
        if raw is None and choice.get("text"):
            raise StreamProtocolError(
                self.url, self.path, "event has text but no token_ids (return_token_ids unset?)"
            )
        reason = choice.get("finish_reason")
        spans = _spans(choice.get("weight_versions"))
        lp = choice.get("logprobs")
        token_lps = lp.get("token_logprobs") if isinstance(lp, Mapping) else None
        return StreamDelta(
            tuple(int(t) for t in raw or []),
            str(choice.get("text") or ""),
            spans[-1].version if spans else None,
            finished=reason is not None,
            finish_reason=None if reason is None else str(reason),
            spans=spans,
            logprobs=tuple(_logprob(v) for v in token_lps or ()),
        )


def delta_reader(dialect: str, url: str, path: str) -> SGLangDeltas | VLLMDeltas:
    """The delta reader of ``dialect`` (``"sglang"`` or ``"vllm"``) for one stream."""
    return (SGLangDeltas if dialect == "sglang" else VLLMDeltas)(url, path)


def stream_deltas(
    transport: HttpTransport,
    path: str,
    body: Mapping[str, Any],
    timeout: float | None,
    dialect: str,
) -> Iterator[StreamDelta]:
    """:func:`read_events` through the dialect's delta reader."""
    reader = delta_reader(dialect, transport.url, path)
    decode = reader.decode if isinstance(reader, SGLangDeltas) else None
    for event in read_events(transport, path, body, timeout, decode):
        yield reader(event)
