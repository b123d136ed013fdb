"""One choice's answer, assembled from the fleet's token chunks (both dialects share it).

Owns :class:`ChoiceOutput`: it takes the :class:`~rollsafe.fleet.provenance.TokenChunk` s of
one :class:`~rollsafe.gateway.requests.GenRequest` in order and keeps what an answer needs:
the output token ids, their logprobs, the text (decoded by the gateway, stop strings trimmed),
the finish (``finish_reason``; vLLM's ``stop_reason``; SGLang's ``matched``) and the weights
versions that produced the tokens. :meth:`ChoiceOutput.add` returns a :class:`ChoiceDelta`
(what a stream sends for that chunk).

Rules, as the engines apply them (vLLM 0.33 ``vllm/v1/engine/detokenizer.py``, SGLang 0.5.23
``srt/managers/detokenizer_manager.py`` ``trim_matched_stop``):

* a stop token (a client ``stop_token_ids`` entry, or an EOS id unless ``ignore_eos``) that ends
  the choice stays in the token ids but not in the text (unless ``include_stop``); its text is
  held until the next token or the finish says whether it ended the choice;
* a stop string found in the text (after ``min_tokens`` tokens) ends the choice there, even
  before the engine says so (a continued request's stop string can straddle two engines): the
  text is cut before it (after it with ``include_stop``), tokens after the one that completed
  it are dropped and later chunks ignored; :attr:`ChoiceOutput.stopped_early` tells the caller
  to end the engine request;
* an engine's own stop-string match (SGLang's ``meta_info.finish_reason.matched``) trims the
  text at its first occurrence when the gateway had not matched it itself;
* tokens past ``max_tokens`` are dropped (``finish_reason`` ``length``).

Versions: the final chunk's ``segments`` are authoritative; until then (or when the gateway
ended the choice first) the chunks' own ``weight_version`` per token, and provenance runs of
(group, version, try) from the chunks, a run that gave way to another try marked
``"continued"``. Spans are vLLM 0.33's
``weight_versions`` shape (``{"version", "start", "end"}`` over output token indexes, merged
where the version repeats: ``vllm/outputs.py`` ``WeightVersionSpan``), clipped to the tokens
kept; SGLang 0.5.23 reports the same shape in ``meta_info.weight_versions``
(``srt/utils/weight_versions.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollsafe.fleet.provenance import Segment, TokenChunk
from rollsafe.gateway.requests import GenRequest
from rollsafe.gateway.tokenizer import Detokenizer, GatewayTokenizer, StopStrings
from rollsafe.runs import merge_runs

__all__ = ["ChoiceDelta", "ChoiceOutput", "merged"]


@dataclass(frozen=True)
class ChoiceDelta:
    """What one chunk added to a choice: ``text`` (stop strings held back), ``token_ids`` and
    their ``logprobs`` (kept tokens only), and whether the choice is now ``finished``."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    finished: bool


_NOTHING = ChoiceDelta("", (), (), False)


class ChoiceOutput:
    """One choice of a call (see the module docstring)."""

    def __init__(
        self, tokenizer: GatewayTokenizer, request: GenRequest, *, stream: bool = False
    ) -> None:
        spec = request.output
        self.request = request
        self.spec = spec
        self.stream = stream
        self.detok = Detokenizer(tokenizer, request.input_ids, spec.skip_special_tokens)
        self.stops = StopStrings(spec.stop, include=spec.include_stop)
        self.stop_ids = frozenset(spec.stop_token_ids) | (
            frozenset() if spec.ignore_eos else tokenizer.eos_token_ids
        )
        self.token_ids: list[int] = []
        self.logprobs: list[float | None] = []
        # the text is kept as pieces, joined when read whole (:attr:`text`): one join per
        # answer, not a copy of all the text so far per token (quadratic in a long rollout)
        self._folded = ""
        self._pieces: list[str] = []
        self._length = 0
        self.sent = 0  # characters of text already sent in a stream
        self.lp_offset = 0  # completions logprobs: text offset of the next token
        self.finished = False
        self.finish_reason: str | None = None
        #: vLLM's ``stop_reason``: the stop string or client stop token id that ended it
        self.stop_reason: str | int | None = None
        #: SGLang's ``matched``: the stop string or token id (EOS included)
        self.matched: str | int | None = None
        #: the gateway ended the choice on a stop string before the engine did
        self.stopped_early = False
        self.segments: tuple[Segment, ...] = ()
        self.meta: dict[str, Any] = {}
        self.group_id: str | None = None
        self.weight_version: str | None = None
        self._held: int | None = None  # a stop token whose text waits for the next chunk
        self._runs: list[list[Any]] = []  # [group, version, attempt, start, end] per run
        self._min_offset: int | None = 0 if spec.min_tokens <= 0 else None

    # -- text --------------------------------------------------------------------------------

    @property
    def text(self) -> str:
        """The choice's text so far (stop strings trimmed)."""
        if self._pieces:
            self._folded += "".join(self._pieces)
            self._pieces.clear()
        return self._folded

    @text.setter
    def text(self, value: str) -> None:
        self._pieces.clear()
        self._folded = value
        self._length = len(value)

    def _tail(self, chars: int) -> tuple[str, int]:
        """The text's last ``chars`` characters (or more) and where they start in the text."""
        if chars <= 0:
            return "", self._length
        pieces, took, i = self._pieces, 0, len(self._pieces)
        while i > 0 and took < chars:
            i -= 1
            took += len(pieces[i])
        if took < chars:  # the end of the folded text too (a slice: no fold, no copy of it all)
            head = self._folded[max(0, len(self._folded) - (chars - took)) :]
            return head + "".join(pieces), self._length - took - len(head)
        return "".join(pieces[i:]), self._length - took

    # -- chunks ----------------------------------------------------------------------------

    def add(self, chunk: TokenChunk) -> ChoiceDelta:
        """Take the next chunk; what it added (nothing once the choice is finished)."""
        if chunk.finished:  # the engine's end: its provenance counts even after ours
            self.segments = chunk.segments
            self.meta = dict(chunk.meta)
            self.stopped_early = False
        if self.finished:
            return _NOTHING
        self.group_id = chunk.group_id
        if chunk.weight_version is not None:
            self.weight_version = chunk.weight_version
        start_tokens = len(self.token_ids)
        if chunk.token_ids:
            self._tokens(chunk)
            if self.finished and chunk.finished:
                self.stopped_early = False
        if chunk.finished and not self.finished:
            self._finish(chunk)
        return self._delta(start_tokens)

    def add_all(self, chunks: Sequence[TokenChunk]) -> None:
        """Take a whole answer's chunks: runs of one try under one version are merged first
        (:func:`merged`), so the tokens are taken together, not one chunk at a time."""
        for chunk in merged(chunks):
            self.add(chunk)

    def _tokens(self, chunk: TokenChunk) -> None:
        spec = self.spec
        lps = chunk.logprobs
        ids = chunk.token_ids
        room = spec.max_tokens - len(self.token_ids)
        if len(ids) > 1 and room > 0 and not self.stops:
            # no stop string to look for after each token: the chunk's tokens at once, up to
            # the first stop token (held as one at a time would hold it) and max_tokens
            take = ids[:room] if len(ids) > room else ids
            if self.stop_ids.isdisjoint(take):
                self._release_held()
                n = len(self.token_ids)
                self.token_ids.extend(take)
                if spec.logprobs:
                    got = lps[: len(take)]
                    self.logprobs.extend(got)
                    self.logprobs.extend([None] * (len(take) - len(got)))
                self._run(chunk, n)
                self._text(self.detok.add(take))
                if self._min_offset is None and len(self.token_ids) >= spec.min_tokens:
                    self._min_offset = self._length
                if len(take) < len(ids):
                    self._end("length")
                return
        for i, token in enumerate(ids):
            if len(self.token_ids) >= spec.max_tokens:
                self._end("length")
                return
            self._release_held()
            self.token_ids.append(token)
            if spec.logprobs:
                self.logprobs.append(lps[i] if i < len(lps) else None)
            self._run(chunk)
            if token in self.stop_ids and not spec.include_stop:
                self._held = token  # ends the choice if the engine says so next
            else:
                self._text(self.detok.add((token,)))
            if self._min_offset is None and len(self.token_ids) >= spec.min_tokens:
                self._min_offset = self._length
            if self.finished:
                return

    def _run(self, chunk: TokenChunk, start: int | None = None) -> None:
        """The tokens ``[start, now)`` (the last one when not given) came from ``chunk``."""
        n = len(self.token_ids)
        runs = self._runs
        key = (chunk.group_id, chunk.weight_version, chunk.attempt)
        if runs and (runs[-1][0], runs[-1][1], runs[-1][2]) == key:
            runs[-1][4] = n
        else:
            first = n - 1 if start is None else start
            runs.append([chunk.group_id, chunk.weight_version, chunk.attempt, first, n])

    def _release_held(self) -> None:
        if self._held is not None:
            token, self._held = self._held, None
            self._text(self.detok.add((token,)))

    def _text(self, new: str) -> None:
        if not new:
            return
        self._pieces.append(new)
        self._length += len(new)
        if self.stops and self._min_offset is not None:
            # a stop string completed by the new text starts within its last max_len - 1
            # characters before it
            tail, offset = self._tail(len(new) + self.stops.max_len)
            found = self.stops.find(tail, len(new), max(0, self._min_offset - offset))
            if found is not None:
                stop, cut = found
                self.text = self.text[: offset + cut]
                self.stop_reason = self.matched = stop
                self.stopped_early = True
                self._end("stop")

    def _finish(self, chunk: TokenChunk) -> None:
        reason = chunk.finish_reason
        if reason is None or reason in ("abort", "error"):
            reason = "length" if len(self.token_ids) >= self.spec.max_tokens else "stop"
        held = self._held
        if held is not None:
            self._held = None
            if reason == "stop":
                self.matched = held
                self.stop_reason = held if held in self.spec.stop_token_ids else None
            else:
                self._text(self.detok.add((held,)))
        if not self.finished:
            self._text(self.detok.flush())
        if not self.finished and reason == "stop" and self.matched is None:
            self._engine_match()
        self._end(reason)
        self.stopped_early = False

    def _engine_match(self) -> None:
        info = self.meta.get("finish_reason")
        matched = info.get("matched") if isinstance(info, dict) else None
        if isinstance(matched, str) and matched:
            at = self.text.find(matched)
            if at != -1:
                self.text = self.text[: at + len(matched) if self.spec.include_stop else at]
                self.stop_reason = self.matched = matched
        elif isinstance(matched, int) and not isinstance(matched, bool):
            self.matched = matched

    def _end(self, reason: str) -> None:
        if not self.finished:
            self.finished = True
            self.finish_reason = reason

    def _delta(self, start_tokens: int) -> ChoiceDelta:
        length = self._length
        if self.finished or not self.stops:
            visible = length
        else:
            visible = length - self.stops.holdback(self._tail(self.stops.max_len)[0])
        text = ""
        if visible > self.sent:
            tail, offset = self._tail(length - self.sent)
            text = tail[self.sent - offset : visible - offset]
        self.sent = max(self.sent, visible)
        ids = tuple(self.token_ids[start_tokens:])
        lps = tuple(self.logprobs[start_tokens:]) if self.spec.logprobs else ()
        if not text and not ids and not self.finished:
            return _NOTHING
        return ChoiceDelta(text, ids, lps, self.finished)

    # -- what the answer reports -----------------------------------------------------------

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    def spans(self) -> list[dict[str, Any]]:
        """vLLM 0.33's ``weight_versions`` of the kept tokens (see the module docstring)."""
        kept = len(self.token_ids)
        pieces: list[tuple[str | None, int, int]]
        if self.segments:
            pieces = [(s.weights_version, s.start, s.end) for s in self.segments]
        else:
            pieces = [(r[1], r[3], r[4]) for r in self._runs]
        out: list[dict[str, Any]] = []
        for version, start, end in pieces:
            end = min(end, kept)
            if end <= start:
                continue
            if out and out[-1]["version"] == version and out[-1]["end"] == start:
                out[-1]["end"] = end
            else:
                out.append({"version": version, "start": start, "end": end})
        return out

    def provenance(self) -> list[dict[str, Any]]:
        """The rollsafe extension: which group, version and try produced which tokens (the
        fleet's segments, clipped to the kept tokens; from the chunks when none came)."""
        kept = len(self.token_ids)
        if self.segments:
            out = []
            for seg in self.segments:
                item = seg.as_dict()
                start, end = seg.token_range
                if start >= kept and seg.tokens:
                    continue
                item["token_range"] = [start, min(end, kept)]
                out.append(item)
            return out
        return [
            {
                "group": r[0],
                "weights_version": r[1],
                "token_range": [r[3], min(r[4], kept)],
                "attempt": r[2],
                "ended": _run_end(self._runs, i),
            }
            for i, r in enumerate(self._runs)
            if r[3] < kept
        ]


def merged(chunks: Sequence[TokenChunk]) -> list[TokenChunk]:
    """``chunks`` with each run of neighbours from one try under one version (contiguous, a
    logprob per token in all or in none) merged into one chunk: tokens, text and logprobs
    joined, the last one's finish, segments and meta kept. What a :class:`ChoiceOutput` makes
    of them is the same; it takes the tokens of a merged chunk together."""

    def joins(prev: TokenChunk, chunk: TokenChunk) -> bool:
        kind = _logprobs_kind(chunk)
        return (
            not prev.finished
            and bool(chunk.token_ids)
            and chunk.group_id == prev.group_id
            and chunk.weight_version == prev.weight_version
            and chunk.attempt == prev.attempt
            and chunk.start == prev.start + len(prev.token_ids)
            and kind == _logprobs_kind(prev)
            and kind != "some"
        )

    def merge(run: Sequence[TokenChunk]) -> TokenChunk:
        last = run[-1]
        return TokenChunk(
            tuple(t for c in run for t in c.token_ids),
            last.group_id,
            last.weight_version,
            attempt=last.attempt,
            start=run[0].start,
            text="".join(c.text for c in run),
            logprobs=tuple(lp for c in run for lp in c.logprobs),
            finished=last.finished,
            finish_reason=last.finish_reason,
            segments=last.segments,
            meta=last.meta,
        )

    return merge_runs(chunks, joins, merge)


def _logprobs_kind(chunk: TokenChunk) -> str:
    if not chunk.logprobs:
        return "none"
    return "all" if len(chunk.logprobs) == len(chunk.token_ids) else "some"


def _run_end(runs: list[list[Any]], i: int) -> str:
    """How observed run ``i`` ended: ``finished`` (the last), ``version_change`` (the same try
    went on under new weights), else ``continued`` (the request went on in another try; only
    the fleet's final segments say whether the try failed or was aborted)."""
    if i + 1 == len(runs):
        return "finished"
    return "version_change" if runs[i + 1][2] == runs[i][2] else "continued"
