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
:class:`StreamProtocolError`). A stream that ends without a finished event (the engine died, the
connection dropped) raises :class:`EngineUnavailable` after the deltas already yielded, so the
caller keeps every token it saw.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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
    transport: HttpTransport, path: str, body: Mapping[str, Any], timeout: float | None
) -> Iterator[dict[str, Any]]:
    """POST ``body`` and yield each JSON event of the answer until ``data: [DONE]``.

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
        reader = SSEEventReader(url, path)
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
        self._pending = b""

    def feed(self, chunk: bytes) -> list[str]:
        """The lines ``chunk`` completes."""
        data = self._pending + chunk if self._pending else chunk
        if b"\r" in data:
            held = data.endswith(b"\r")
            parts = _EOL.split(data[:-1] if held else data)
        else:  # LF only (what the engines send): bytes.split, no regex
            held = False
            parts = data.split(b"\n")
        self._pending = parts.pop() + (b"\r" if held else b"")
        if len(self._pending) > MAX_EVENT_BYTES:
            raise StreamProtocolError(self.url, self.path, "event larger than 64 MiB")
        return [part.decode("utf-8", errors="replace") for part in parts]

    def flush(self) -> list[str]:
        """The stream ended: the non-empty lines still held."""
        pending, self._pending = self._pending, b""
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
    :class:`EngineRequestError` (raised after the events before it were yielded)."""

    def __init__(self, url: str, path: str) -> None:
        self.url, self.path = url, path
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
            yield _event(self.url, self.path, text)


def _event(url: str, path: str, text: str) -> dict[str, Any]:
    try:
        event = json.loads(text)
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


class SGLangDeltas:
    """SGLang events (cumulative ``output_ids`` and ``text``) -> :class:`StreamDelta`."""

    def __init__(self, url: str, path: str) -> None:
        self.url, self.path = url, path
        self.ids: list[int] = []
        self.text = ""
        self.logprobs_seen = 0

    def __call__(self, event: Mapping[str, Any]) -> StreamDelta:
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
            delta_text = text[len(self.text) :] if text.startswith(self.text) else text
            self.text = text
        meta = event.get("meta_info") or {}
        reason = meta.get("finish_reason")
        # (None checked first: an ABC isinstance costs a microsecond, on every event)
        kind = reason.get("type") if reason is not None and isinstance(reason, Mapping) else reason
        version = meta.get("weight_version")
        logprobs: tuple[float | None, ...] = ()
        raw_lps = meta.get("output_token_logprobs")  # cumulative [logprob, token id, text]
        if (
            raw_lps is not None
            and isinstance(raw_lps, Sequence)
            and len(raw_lps) > self.logprobs_seen
        ):
            fresh = raw_lps[self.logprobs_seen :]
            self.logprobs_seen = len(raw_lps)
            logprobs = tuple(
                _logprob(item[0] if isinstance(item, Sequence) else item) for item in fresh
            )
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
    for event in read_events(transport, path, body, timeout):
        yield reader(event)
