"""SGLang's cumulative stream events decoded incrementally (``SGLangDeltas.decode``, issue #35).

Every SGLang event carries all the text and ``output_ids`` so far, so decoding each whole costs
O(tokens²) an answer. ``decode`` decodes only what is new when the event extends the previous
one as written. These tests hold it to the whole decode: the same deltas for any text (quotes,
backslashes, control characters, non-ASCII, surrogate pairs, ``ensure_ascii`` or not, compact
or spaced JSON), the same refusals, and the new path taken for every event after the first.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollsafe.adapters.engines import streaming
from rollsafe.adapters.engines.errors import EngineRequestError
from rollsafe.adapters.engines.streaming import (
    INCREMENTAL,
    SGLangDeltas,
    SSEEventReader,
    StreamDelta,
    StreamProtocolError,
)
from rollsafe.adapters.reference_engine.streaming import sse_event

URL, PATH = "http://e", "/generate"

#: text pieces a detokenizer may produce, the awkward ones many times over
PIECES = st.text(
    alphabet=st.sampled_from(
        ['"', "\\", "\n", "\t", "\x00", "\x1f", "é", "😀", "中", "a", " ", "/"]
    ),
    max_size=4,
)


def _events(
    pieces: list[tuple[list[int], str]],
    *,
    meta: dict[str, Any],
    finish: bool,
    logprobs: bool = False,
) -> list[dict[str, Any]]:
    """The cumulative events of a stream whose events add ``pieces`` (ids, text) in turn; with
    ``logprobs``, ``meta_info`` carries ``output_token_logprobs`` so far, between other keys
    (``[logprob, id, text]``, the text sometimes ``None``, sometimes holding brackets)."""
    out: list[dict[str, Any]] = []
    ids: list[int] = []
    text = ""
    lps: list[list[Any]] = []
    for n, (new_ids, new_text) in enumerate(pieces):
        ids = ids + new_ids
        text += new_text
        for t in new_ids:
            lps.append([-(t % 97) / 7.0, t, None if t % 3 else f'[{new_text}]"'])
        last = finish and n == len(pieces) - 1
        info = {**meta, "completion_tokens": len(ids), "finish_reason": None}
        if logprobs:
            info["output_token_logprobs"] = [list(x) for x in lps]
            info["output_token_logprobs_length"] = len(lps)
        if last:
            info["finish_reason"] = {"type": "length", "length": len(ids)}
            info["weight_versions"] = [{"version": "3", "start": 0, "end": len(ids)}]
        out.append({"text": text, "output_ids": list(ids), "meta_info": info})
    return out


def _wire(events: list[dict[str, Any]], style: str) -> bytes:
    if style == "compact":  # the reference engine's (and orjson's) layout
        return b"".join(sse_event(e) for e in events) + b"data: [DONE]\n\n"
    kw: dict[str, Any] = {"ensure_ascii": style == "ascii"}
    return b"".join(b"data: " + json.dumps(e, **kw).encode() + b"\n\n" for e in events) + (
        b"data: [DONE]\n\n"
    )


def _read(
    wire: bytes, *, incremental: bool, split: int = 0, from_chars: int | None = 0
) -> tuple[list[StreamDelta], int]:
    """The deltas of ``wire`` fed in pieces of ``split`` bytes (0: whole), and how many events
    came through the incremental path, with events of ``from_chars`` characters or more read
    incrementally (None: the module's own :data:`INCREMENTAL_FROM`)."""
    deltas = SGLangDeltas(URL, PATH)
    reader = SSEEventReader(URL, PATH, deltas.decode if incremental else None)
    chunks = [wire] if not split else [wire[i : i + split] for i in range(0, len(wire), split)]
    out: list[StreamDelta] = []
    fresh = 0
    default = streaming.INCREMENTAL_FROM
    streaming.INCREMENTAL_FROM = default if from_chars is None else from_chars
    try:
        for chunk in chunks:
            for event in reader.feed(chunk):
                fresh += bool(event.get(INCREMENTAL))
                out.append(deltas(event))
    finally:
        streaming.INCREMENTAL_FROM = default
    assert reader.done
    return out, fresh


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    pieces=st.lists(
        st.tuples(st.lists(st.integers(0, 200_000), min_size=0, max_size=3), PIECES),
        min_size=1,
        max_size=12,
    ),
    style=st.sampled_from(["compact", "ascii", "utf8"]),
    finish=st.booleans(),
    split=st.sampled_from([0, 1, 7, 64]),
    logprobs=st.booleans(),
)
def test_incremental_decode_equals_the_whole_decode(
    pieces: list[tuple[list[int], str]], style: str, finish: bool, split: int, logprobs: bool
) -> None:
    meta = {"id": "r1", "weight_version": "3", "prompt_tokens": 4}
    wire = _wire(_events(pieces, meta=meta, finish=finish, logprobs=logprobs), style)
    whole, none = _read(wire, incremental=False)
    fast, fresh = _read(wire, incremental=True, split=split)
    assert none == 0
    assert fast == whole
    # every event after the first extends the one before it: none decoded whole again
    assert fresh == len(pieces) - 1


def test_a_long_answer_is_decoded_incrementally_whatever_its_text() -> None:
    """1,024 tokens of quotes and backslashes: the same deltas, every event but the first new."""
    pieces = [([1000 + i], 'x"\\é😀 ') for i in range(1024)]
    for style, logprobs in (("compact", True), ("ascii", False)):
        events = _events(pieces, meta={"weight_version": "7"}, finish=True, logprobs=logprobs)
        wire = _wire(events, style)
        whole, _ = _read(wire, incremental=False)
        fast, fresh = _read(wire, incremental=True, from_chars=None)
        # from the event after the first one long enough (shorter ones are decoded whole)
        sizes = [len(line) - 6 for line in wire.decode().split("\n\n") if line[6:7] == "{"]
        assert fast == whole
        assert fresh == sum(n >= streaming.INCREMENTAL_FROM for n in sizes) - 1 > 900
        if logprobs:
            assert [lp for d in fast for lp in d.logprobs] == [
                -(t % 97) / 7.0 for t in range(1000, 2024)
            ]
        assert "".join(d.text for d in fast) == 'x"\\é😀 ' * 1024
        assert [t for d in fast for t in d.token_ids] == [1000 + i for i in range(1024)]


def test_an_event_that_does_not_extend_the_ids_is_refused_as_before() -> None:
    events = [
        {"text": "ab", "output_ids": [1, 2], "meta_info": {}},
        {"text": "abc", "output_ids": [1, 9, 3], "meta_info": {}},
    ]
    for incremental in (False, True):
        with pytest.raises(StreamProtocolError, match="do not extend"):
            _read(_wire(events, "compact"), incremental=incremental)


def test_a_text_that_changed_is_decoded_whole_and_sent_whole_as_before() -> None:
    events = [
        {"text": "ab\ufffd", "output_ids": [1, 2], "meta_info": {}},
        {"text": "abé", "output_ids": [1, 2, 3], "meta_info": {}},  # a character completed
    ]
    whole, _ = _read(_wire(events, "ascii"), incremental=False)
    fast, fresh = _read(_wire(events, "ascii"), incremental=True)
    assert fast == whole and fresh == 0
    assert [d.text for d in fast] == ["ab\ufffd", "abé"]


def test_a_surrogate_pair_cut_between_two_events_is_decoded_whole() -> None:
    """A text ending in half a pair (as JSON escapes) and the next completing it: decoded
    apart the halves would stay two lone surrogates; decoded whole they are one character."""
    wire = (
        b'data: {"text":"a\\ud83d","output_ids":[1],"meta_info":{}}\n\n'
        b'data: {"text":"a\\ud83d\\ude00","output_ids":[1,2],"meta_info":{}}\n\n'
        b"data: [DONE]\n\n"
    )
    whole, _ = _read(wire, incremental=False)
    fast, fresh = _read(wire, incremental=True)
    assert fast == whole and fresh == 0
    assert fast[1].text == "a😀"


def test_an_error_event_and_other_layouts_are_decoded_whole() -> None:
    first = {"text": "a", "output_ids": [1], "meta_info": {}}
    error = {"error": {"message": "boom", "code": 503}}
    with pytest.raises(EngineRequestError, match="boom"):
        _read(_wire([first, error], "compact"), incremental=True)
    # keys in another order, or one more: the whole decode, the same deltas
    other = [
        {"output_ids": [1], "text": "a", "meta_info": {}},
        {"output_ids": [1, 2], "text": "ab", "meta_info": {}},
        {"text": "abc", "output_ids": [1, 2, 3], "meta_info": {}, "index": 0},
    ]
    whole, _ = _read(_wire(other, "compact"), incremental=False)
    fast, fresh = _read(_wire(other, "compact"), incremental=True)
    assert fast == whole and fresh == 0
    # ids that are not integers in the new part: decoded whole, refused as before
    floats = b'data: {"text":"a","output_ids":[1],"meta_info":{}}\n\n' + (
        b'data: {"text":"ab","output_ids":[1,2.5],"meta_info":{}}\n\ndata: [DONE]\n\n'
    )
    assert _read(floats, incremental=True) == _read(floats, incremental=False)
