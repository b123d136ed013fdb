"""Continuation: a streamed rollout request that survives its group, keeping every token.

Owns :func:`stream_continued`, the data plane's path (:mod:`rollsafe.fleet.dataplane`) for
token-id prompts on streaming engines, a coroutine generator of
:class:`~rollsafe.fleet.provenance.TokenChunk`:

* the request is streamed (:meth:`AsyncEngine.generate_stream`) and every new token is
  yielded as it comes, with the group and weights version that produced it;
* when its group fails mid-generation (connection drop, engine death, a 5xx), the request is
  resubmitted to another ``active`` group as ``prompt + tokens so far`` with
  ``max_new_tokens`` / ``min_new_tokens`` reduced by what was generated and the seed, where
  given, advanced deterministically (:func:`continued_params`); the failed group is not tried
  again for this request. A final (4xx) error is not retried;
* when the engine ends the request with ``finish_reason`` ``abort`` (``pause_generation`` in
  ``abort`` mode, as a sync with continuation does), it is continued the same way on any
  ``active`` group, the same one included, at most ``max_aborts`` times, once the router
  releases held continuations (the new weights are in);
* tokens whose weights cannot be told (``weight_version_exact: False`` on a delta: a vLLM that
  reports no version, read after a sync paused and resumed the engine, so they may have
  waited in a buffer since before the pause or come from the new weights) are not kept: the
  piece ends before them as ``aborted`` and the request goes on the same way (counted as
  ``unattributed``). No token is ever credited to weights that may not have produced it;
* the last chunk is ``finished`` and carries ``segments`` (which group and weights version
  produced each token range, :mod:`rollsafe.fleet.provenance`) and the engine's last
  ``meta_info``: the consumer sees one stream, no duplicate, no gap;
* a request its caller reads whole (``whole=True``: the data plane passes it for a request
  asking at most ``Router.whole_up_to`` new tokens) is read from each engine as one answer
  (:meth:`AsyncEngine.generate`), the same path with one delta per try (:func:`whole_delta`):
  an aborted answer carries the tokens made before the abort and is continued from them; a
  crash loses the tokens the dead engine had made (at most ``whole_up_to``, counted as
  ``whole_lost``) and the request is sent again elsewhere; an answer during which the fleet
  recorded a new version for its group, with no per-token versions and no abort (an SGLang
  sync in ``retract`` mode ran under it), cannot tell which tokens the old weights made, so
  none is kept and the request goes on as after an abort (``unattributed``);
* after ``max_attempts`` failed tries, or when no group is left, :class:`ContinuationFailed`
  (a :class:`~rollsafe.fleet.router.RequestFailed`) lists the segments generated so far,
  raised after the chunks already yielded.

Streamed tokens are never regenerated here: a continued request re-prefills its tokens, it
does not sample them again. Greedy decoding on the same weights therefore gives the
uninterrupted run's tokens (tests/test_continuation.py checks it with real engines). A
consumer that stops (a gateway client disconnected: the task is cancelled) ends the engine
request with it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rollsafe.adapters.engines.errors import EngineError
from rollsafe.adapters.engines.streaming import StreamDelta, WeightSpan
from rollsafe.fleet.provenance import Segment, TokenChunk, group_version
from rollsafe.fleet.router import (
    ContinuationFailed,
    NoRoutableGroup,
    RequestFailed,
    RouterError,
    is_retryable,
)
from rollsafe.ports import GenerateResult
from rollsafe.text import bound_text

if TYPE_CHECKING:
    from rollsafe.adapters.engines.aio import AsyncEngine
    from rollsafe.fleet.router import Router
    from rollsafe.registry import WorkerGroup

__all__ = [
    "ContinuationStats",
    "StreamingClient",
    "advance_seed",
    "continued_params",
    "stream_continued",
    "whole_delta",
]

log = logging.getLogger(__name__)

_SEED_KEYS = ("seed", "sampling_seed")
_INT63 = (1 << 63) - 1


@runtime_checkable
class StreamingClient(Protocol):
    """An engine client that can stream a generation (both HTTP clients can; the data plane
    streams through its async companion, :func:`rollsafe.adapters.engines.aio.async_engine`)."""

    def generate_stream(
        self,
        input_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Any: ...


def advance_seed(seed: int, generated: int) -> int:
    """The seed of a piece that starts after ``generated`` tokens: ``seed`` itself for the first
    piece, else a fixed mix of both (same inputs, same seed; stays in the int64 range)."""
    if generated == 0:
        return seed
    return (seed * 6364136223846793005 + generated * 1442695040888963407) & _INT63


def continued_params(sampling_params: Mapping[str, Any] | None, generated: int) -> dict[str, Any]:
    """``sampling_params`` for the piece after ``generated`` tokens: budgets reduced, seed
    advanced (:func:`advance_seed`), everything else kept."""
    out = dict(sampling_params or {})
    if generated == 0:
        return out
    for key in ("max_new_tokens", "max_tokens"):
        if isinstance(out.get(key), int):
            out[key] = max(0, out[key] - generated)
    for key in ("min_new_tokens", "min_tokens"):
        if isinstance(out.get(key), int):
            out[key] = max(0, out[key] - generated)
    for key in _SEED_KEYS:
        if isinstance(out.get(key), int) and not isinstance(out.get(key), bool):
            out[key] = advance_seed(out[key], generated)
    return out


def _budget(sampling_params: Mapping[str, Any] | None) -> int | None:
    for key in ("max_new_tokens", "max_tokens"):
        value = (sampling_params or {}).get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


@dataclass
class ContinuationStats:
    """Counters of the continuation path (thread-safe; :meth:`as_dict` for ``Router.stats``)."""

    streamed: int = 0
    continued: int = 0  #: requests that needed more than one piece and finished
    after_failure: int = 0  #: pieces started because a group failed
    after_abort: int = 0  #: pieces started because the engine aborted (a sync's pause)
    #: pieces cut at tokens whose weights cannot be told (read after a sync on a vLLM that
    #: reports no version); their requests went on as after an abort
    unattributed: int = 0
    tokens_kept: int = 0  #: tokens carried into a continuation instead of being regenerated
    tokens_regenerated: int = 0  #: tokens generated again after a failure (0 by design)
    whole: int = 0  #: requests read from their engines as whole answers (``whole_up_to``)
    #: whole reads lost to a failure: the tokens their engine had made (at most
    #: ``whole_up_to`` each, not known) were generated again elsewhere
    whole_lost: int = 0
    failed: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for key, n in counts.items():
                setattr(self, key, getattr(self, key) + n)

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {
                "streamed": self.streamed,
                "continued": self.continued,
                "after_failure": self.after_failure,
                "after_abort": self.after_abort,
                "unattributed": self.unattributed,
                "tokens_kept": self.tokens_kept,
                "tokens_regenerated": self.tokens_regenerated,
                "whole": self.whole,
                "whole_lost": self.whole_lost,
                "failed": self.failed,
            }


class _Piece:
    """The tokens one try added, with the version marks needed to split it into segments."""

    def __init__(self, group: WorkerGroup, base: int, attempt: int) -> None:
        self.group = group
        self.base = base
        self.attempt = attempt
        self.marks: list[tuple[int, str | None]] = []  # (output index, version) per event
        self.spans: tuple[WeightSpan, ...] = ()
        #: the group's recorded version when the piece was dispatched: a vLLM stream names
        #: its versions only on the final event, and a group that failed may record none
        self.dispatched_version = group_version(group)

    def segments(self, end: int, ended: str) -> list[Segment]:
        gid = self.group.group_id
        fallback = group_version(self.group) or self.dispatched_version
        if end <= self.base:
            return []
        if self.spans:
            spans = [s for s in self.spans if s.end > s.start]
            out: list[Segment] = []
            for i, span in enumerate(spans):
                last = i == len(spans) - 1
                rng = (self.base + span.start, min(end, self.base + span.end))
                if rng[1] > rng[0]:
                    state = ended if last else "version_change"
                    out.append(Segment(gid, span.version, rng, self.attempt, state))
            if out and out[-1].end == end:
                return out
        pieces: list[tuple[int, str | None]] = []
        for index, version in self.marks:
            version = version if version is not None else fallback
            if not pieces or pieces[-1][1] != version:
                pieces.append((index, version))
        if not pieces:
            pieces = [(self.base, fallback)]
        segs: list[Segment] = []
        for i, (start, version) in enumerate(pieces):
            stop = pieces[i + 1][0] if i + 1 < len(pieces) else end
            state = ended if i + 1 == len(pieces) else "version_change"
            segs.append(Segment(gid, version, (start, stop), self.attempt, state))
        return segs


def _chunk(
    piece: _Piece, start: int, delta: StreamDelta, logprobs: tuple[float | None, ...]
) -> TokenChunk:
    return TokenChunk(
        token_ids=delta.token_ids,
        group_id=piece.group.group_id,
        weight_version=delta.weight_version or piece.dispatched_version,
        attempt=piece.attempt,
        start=start,
        text=delta.text,
        logprobs=logprobs,
    )


def whole_delta(result: GenerateResult, *, synced: bool = False) -> StreamDelta:
    """One finished delta holding a whole answer, as the last event of its stream would
    (vLLM 0.33's ``weight_versions`` spans kept as spans). ``synced``: the fleet recorded a
    new version for the answer's group while the answer was made (a sync that paused the
    engine without aborting the request, SGLang's ``retract``): an answer without spans that
    is no abort is then marked ``weight_version_exact: False``, since which of its tokens the
    old weights made cannot be told."""
    meta = dict(result.meta_info)
    spans: tuple[WeightSpan, ...] = ()
    raw = meta.get("weight_versions")
    if isinstance(raw, list):
        try:
            spans = tuple(
                WeightSpan(str(s["version"]), int(s["start"]), int(s["end"])) for s in raw
            )
        except (KeyError, TypeError, ValueError):
            spans = ()
    if synced and not spans and result.finish_reason != "abort":
        meta["weight_version_exact"] = False
    lps = result.output_logprobs
    return StreamDelta(
        tuple(result.output_ids),
        text=result.text,
        weight_version=result.weight_version,
        finished=True,
        finish_reason=result.finish_reason,
        spans=spans,
        meta=meta,
        logprobs=tuple(lps) if lps is not None and len(lps) == len(result.output_ids) else (),
    )


async def _read_whole(
    engine: AsyncEngine,
    group: WorkerGroup,
    input_ids: list[int],
    params: Mapping[str, Any],
    timeout: float | None,
) -> AsyncIterator[StreamDelta]:
    """A whole answer as a stream of one delta (:func:`whole_delta`); the group's recorded
    version is read before it is sent and once it is in (a sync records it before it resumes
    generation, so an answer made partly on new weights always sees it changed)."""
    before = group_version(group)
    result = await engine.generate(input_ids, sampling_params=params, timeout=timeout)
    yield whole_delta(result, synced=group_version(group) != before)


async def stream_continued(
    router: Router,
    engine_for: Callable[[WorkerGroup], AsyncEngine],
    input_ids: Sequence[int],
    *,
    sampling_params: Mapping[str, Any] | None,
    session_id: str | None,
    timeout: float | None,
    wait_s: float | None = None,
    whole: bool = False,
) -> AsyncIterator[TokenChunk]:
    """Stream ``input_ids`` through ``router``'s groups, continuing on failure (see the module).

    ``engine_for(group)`` gives the async engine of a group's client on the running loop;
    ``wait_s`` how long a try waits for a routable group (default the router's); ``whole``:
    read each try as one answer (``timeout`` then bounds the whole answer, not each event)."""
    prompt = [int(t) for t in input_ids]
    budget = _budget(sampling_params)
    asked_logprobs = bool((sampling_params or {}).get("return_logprob"))
    stats = router.continuation
    stats.add(streamed=1, whole=1 if whole else 0)
    generated = 0  # tokens of the request so far (kept across tries)
    tokens: list[int] = []
    segments: list[Segment] = []
    attempts: list[tuple[str, str]] = []
    notes: list[str] = []
    excluded: list[str] = []
    aborts = 0
    tries = 0
    last_exc: EngineError | None = None
    finish: StreamDelta | None = None

    def fail(message: str, *, retryable: bool, cause: BaseException | None) -> RequestFailed:
        stats.add(failed=1)
        err = router.failure(attempts, [*notes, message] if message else notes, retryable=retryable)
        shown = "; ".join(f"{s.group_id}@{s.weights_version}[{s.start}:{s.end})" for s in segments)
        failed = ContinuationFailed(
            bound_text(f"{err} | segments: {shown or 'none'}", router.max_error_chars),
            attempts,
            retryable=retryable,
            segments=segments,
            output_ids=tokens,
        )
        failed.__cause__ = cause
        return failed

    while True:
        if budget is not None and generated >= budget:
            finish = StreamDelta((), finished=True, finish_reason="length")
            break
        try:
            group = await router.acquire(session_id, exclude=excluded, wait_s=wait_s)
        except NoRoutableGroup as exc:
            if last_exc is None and not segments:
                raise
            raise fail(
                f"no other routable group to continue on ({bound_text(str(exc), 256)})",
                retryable=True,
                cause=last_exc,
            ) from last_exc
        if group.client is None:
            group.end_request(ok=False, error="group has no engine client")
            raise RouterError(f"worker group {group.group_id!r} has no engine client")
        tries += 1
        piece = _Piece(group, generated, tries)
        params = continued_params(sampling_params, generated)
        delta: StreamDelta | None = None
        unknown = False  # tokens came whose weights cannot be told: the piece ends before them
        engine = engine_for(group)
        if whole:
            stream = _read_whole(engine, group, prompt + tokens, params, timeout)
        else:
            stream = engine.generate_stream(
                prompt + tokens, sampling_params=params, timeout=timeout
            )
        try:
            try:
                async for delta in stream:
                    if delta.token_ids and delta.meta.get("weight_version_exact") is False:
                        unknown = True
                        break
                    if delta.token_ids:
                        piece.marks.append((generated, delta.weight_version))
                        n = len(delta.token_ids)
                        if len(delta.logprobs) == n:
                            logprobs = delta.logprobs
                        else:
                            logprobs = (None,) * n if asked_logprobs else ()
                        tokens.extend(delta.token_ids)
                        generated += n
                        yield _chunk(piece, generated - n, delta, logprobs)
                    if delta.finished:
                        piece.spans = delta.spans
                        break
                    if router.on_progress is not None and delta.token_ids:
                        router.on_progress(group.group_id, generated)
                else:
                    delta = None
            finally:
                if isinstance(stream, AsyncGenerator):
                    await stream.aclose()  # a stream left early ends its engine request
        except EngineError as exc:
            retryable = is_retryable(exc)
            group.end_request(ok=False, error=f"{type(exc).__name__}: {exc}")
            router.request_failed(group.group_id, exc, notify=retryable)
            attempts.append((group.group_id, type(exc).__name__))
            notes.append(f"{group.group_id}: {type(exc).__name__}: {exc}")
            segments.extend(piece.segments(generated, "failed"))
            last_exc = exc
            if not retryable:
                raise fail("", retryable=False, cause=exc) from exc
            excluded.append(group.group_id)
            if session_id is not None and router.session_group(session_id) == group.group_id:
                router.end_session(session_id)
            if whole:
                stats.add(whole_lost=1)
            if len(attempts) >= router.max_attempts:
                raise fail("", retryable=True, cause=exc) from exc
            router.count_retry()
            if not router.keep_tokens:  # the baseline: start over, regenerating every token
                stats.add(after_failure=1, tokens_regenerated=generated)
                tokens.clear()
                segments.clear()
                generated = 0  # the next chunk starts at 0 again (TokenChunk.start)
                continue
            stats.add(after_failure=1, tokens_kept=generated)
            log.info(
                "request continues after %s failed: %d token(s) kept", group.group_id, generated
            )
            continue
        except BaseException:
            group.end_request(ok=False, error="request interrupted")
            raise
        group.end_request(ok=True)
        router.request_ok(group.group_id)
        if unknown:
            # read after this client's engine was paused and resumed (a sync) on a vLLM that
            # reports no version: they may have waited in a buffer since before the pause or
            # come from the new weights. None is kept; the request goes on as after an abort.
            stats.add(unattributed=1)
            log.info(
                "request on %s: tokens after %d of unknown weights (read across a sync) "
                "dropped; it continues after the sync",
                group.group_id,
                generated,
            )
            delta = StreamDelta((), finished=True, finish_reason="abort")
        if delta is None or not delta.finished:  # [DONE] without a finish: treat as ended
            delta = StreamDelta((), finished=True, finish_reason=None)
        if delta.finish_reason == "abort" and (budget is None or generated < budget):
            segments.extend(piece.segments(generated, "aborted"))
            aborts += 1
            if aborts > router.max_aborts:
                raise fail(
                    f"aborted by the engine {aborts} times (max_aborts={router.max_aborts})",
                    retryable=True,
                    cause=None,
                )
            stats.add(after_abort=1, tokens_kept=generated)
            await router.wait_released(timeout)  # a sync in abort mode: its new weights first
            continue
        segments.extend(piece.segments(generated, "finished"))
        finish = delta
        break

    if session_id is not None and segments:
        router.pin(session_id, segments[-1].group_id)
    last_gid = segments[-1].group_id if segments else excluded[-1] if excluded else ""
    if len({(s.group_id, s.attempt) for s in segments}) > 1:
        stats.add(continued=1)
    router.count_served(last_gid)
    meta: dict[str, Any] = dict(finish.meta) if finish is not None else {}
    meta["segments"] = [s.as_dict() for s in segments]
    yield TokenChunk(
        token_ids=(),
        group_id=last_gid,
        weight_version=segments[-1].weights_version if segments else None,
        attempt=tries,
        finished=True,
        finish_reason=finish.finish_reason if finish is not None else None,
        segments=tuple(segments),
        meta=meta,
    )
