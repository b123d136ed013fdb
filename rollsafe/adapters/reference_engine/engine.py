"""The reference engine's scheduler: one driver thread owns the ranks.

Owns request scheduling and the engine-level state machine of a serving process: generation
sessions (prefill, then one decode step at a time, round-robin across sessions; when one ends,
and the text it reports, is the imitated release's decision, :mod:`.stops`), pause modes
(``abort`` / ``retract`` / ``in_place``), memory release, the tracked weight version, and
all-or-nothing weight updates (stage on every rank, then commit on every rank; any failure
discards every rank's staging and keeps the previous weights and version), delta updates
included (:mod:`.deltas`: held across their calls, applied onto the weights served now at the
update's versioned call, refused with a named 400 when the base, format or a result digest is
wrong). Every operation that
touches the ranks runs on the driver thread, so collectives never interleave; HTTP handlers get
``concurrent.futures.Future`` objects. A rank failure fails every pending future at once.
The vLLM dialect adds vLLM's failure state: poisoned weights (a failed reload or update) and
the weight-update bracket, in which a forward pass kills the engine (:meth:`_die`).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from rollsafe.adapters.reference_engine.deltas import check_delta_meta
from rollsafe.adapters.reference_engine.errors import (
    BadRequest,
    EngineBusy,
    EngineDead,
    RankFailure,
    ServerError,
    ServerUnavailable,
    WeightUpdateError,
)
from rollsafe.adapters.reference_engine.group_args import check_group_args
from rollsafe.adapters.reference_engine.model import LM_HEAD
from rollsafe.adapters.reference_engine.ranks import RankSet
from rollsafe.adapters.reference_engine.stops import SGLangStops, StopRules, StopScan
from rollsafe.adapters.reference_engine.weights import UpdateMeta, check_model_path, packed_layout
from rollsafe.checksum import algorithm_for, weights_checksum
from rollsafe.engine_layout import EngineLayout, engine_name, iter_rank_tensors
from rollsafe.wire.delta import is_delta_name

__all__ = ["GenerationResult", "ReferenceEngine", "SamplingParams", "TokenListener"]

T = TypeVar("T")
PAUSE_MODES = ("abort", "retract", "in_place")
#: below this temperature sampling is greedy (vLLM's ``_SAMPLING_EPS``; SGLang's is 1e-6): a
#: smaller divisor would overflow the logits to inf and the probabilities to NaN
GREEDY_BELOW_TEMPERATURE = 1e-5
#: ``seed`` / ``sampling_seed`` must fit in an int64, as vLLM's request model requires
SEED_RANGE = (-(2**63), 2**63 - 1)


#: called on the engine's driver thread after each sampled token with (token, weights version,
#: the token's log-probability as :func:`sample_token` reports it); it must be quick
TokenListener = Callable[[int, str, float], None]


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling parameters of one request."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    #: how the generation ends as the imitated release decides (stop strings, stop token ids,
    #: EOS, the minimum of new tokens) and the text it reports (:mod:`.stops`)
    stops: StopRules = field(default_factory=SGLangStops)


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: dict[str, Any]
    output_logprobs: list[float]
    weight_version: str
    latency_s: float
    #: ``[{version, start, end}]`` over ``output_ids``: which weights produced which tokens (a
    #: request retracted across a weight update spans two versions), as SGLang 0.5.23 reports
    weight_spans: list[dict[str, Any]] = field(default_factory=list)
    #: the output text as the imitated release reports it (a matched stop trimmed or kept);
    #: None when the engine decoded nothing (no tokenizer): the dialect decodes
    text: str | None = None


@dataclass
class _Session:
    sid: str
    prompt: list[int]
    params: SamplingParams
    future: Future[GenerationResult]
    generator: torch.Generator
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    started: bool = False
    ended: bool = False  # the ranks' state of this session was dropped (driver thread only)
    t0: float = field(default_factory=time.monotonic)
    #: (version, first output index) each time the serving weights changed under this session
    spans: list[tuple[str, int]] = field(default_factory=list)
    #: called on the driver thread with (token, weights version, logprob) after each token
    listener: TokenListener | None = None
    #: when the generation ends, as the imitated release decides (:mod:`.stops`)
    scan: StopScan | None = None


def sample_token(
    logits: torch.Tensor, params: SamplingParams, gen: torch.Generator
) -> tuple[int, float]:
    """Greedy when ``temperature == 0``; else temperature / top-k / top-p sampling.

    Returns the token and its log-probability under the distribution it was drawn from: after
    temperature, top-k and top-p (vLLM's ``--logprobs-mode processed_logprobs``, what TRL's
    importance-sampling correction needs); greedy: the log-softmax of the logits."""
    logits = logits.float()
    if params.temperature < GREEDY_BELOW_TEMPERATURE:
        tok = int(torch.argmax(logits))
        return tok, float(torch.log_softmax(logits, dim=-1)[tok])
    scaled = logits / params.temperature
    if 0 < params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < params.top_p
        keep[0] = True
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[idx[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    tok = int(torch.multinomial(probs, 1, generator=gen))
    return tok, float(torch.log(probs[tok]))


class ReferenceEngine:
    """Serving state of one engine process (rank 0); thread-safe entry points."""

    def __init__(
        self,
        ranks: RankSet,
        *,
        eos_token_ids: tuple[int, ...] = (),
        max_context: int = 4096,
        weight_version: str = "default",
    ) -> None:
        self.ranks = ranks
        self.eos_token_ids = eos_token_ids
        self.max_context = max_context
        self.weight_version = weight_version
        #: apply updates holding NaN/inf (``--allow-non-finite``); refused (400) by default.
        #: An engine-wide opt-in: neither SGLang nor vLLM has a request field for it.
        self.allow_non_finite = False
        self.vocab_size = ranks.local.model.vocab_size
        self.device = ranks.local.device
        self._cv = threading.Condition()
        self._ops: collections.deque[tuple[Callable[[], Any], Future[Any]]] = collections.deque()
        self._sessions: dict[str, _Session] = {}
        self._order: collections.deque[str] = collections.deque()
        self._ids = itertools.count()
        #: sessions removed by :meth:`cancel` whose rank state the driver still has to drop
        self._dropped: list[_Session] = []
        #: tokens sampled since start (every session; ``/get_server_info`` reports it)
        self.tokens_generated = 0
        #: ``time.monotonic()`` of the last token sampled (any session; None: none yet): the
        #: scheduler's heartbeat that SGLang's ``/health`` reads (``last_receive_tstamp``)
        self.last_output_at: float | None = None
        self._paused: str | None = None
        #: fault injection (:meth:`stall_next`): the output length at which the next generation
        #: to reach it stops being scheduled (None: none armed)
        self._stall_at: int | None = None
        #: how many generations the stall took off the schedule so far
        self.stalled = 0
        self._released: set[str] = set()
        self._failure: str | None = None
        self._stopping = False
        self._update_in_progress = False  # vLLM start/finish_weight_update bracket
        #: vLLM dialect: why the weights cannot be trusted (a failed reload or update left
        #: them half loaded); the next forward pass kills the engine (:meth:`_die`)
        self._poison: str | None = None
        #: called once, on the driver thread, when the engine died (the server then exits)
        self.on_death: Callable[[str], None] | None = None
        self._dead = False
        self._driver = threading.Thread(target=self._loop, name="engine-driver", daemon=True)
        self._driver.start()

    # ---- status ----------------------------------------------------------------------------
    def health(self) -> str | None:
        """``None`` when healthy, else the reason."""
        reason = self._failure or self.ranks.failure
        if reason is None and not self._driver.is_alive():
            reason = "engine driver thread is not running"
        return reason

    @property
    def paused(self) -> str | None:
        return self._paused

    @property
    def released_tags(self) -> list[str]:
        return sorted(self._released)

    @property
    def num_running(self) -> int:
        """Generation requests (one per prompt) queued or running in the engine."""
        return len(self._sessions)

    @property
    def dead(self) -> bool:
        """The engine died (vLLM dialect, :meth:`_die`); the server is exiting."""
        return self._dead

    def fail(self, reason: str, error: ServerError | None = None) -> None:
        """Mark the engine unhealthy; every pending request and operation gets ``error`` (a
        :class:`RankFailure` by default) now."""
        with self._cv:
            if self._failure is None:
                self._failure = reason
            err = error or RankFailure(f"engine failed: {reason}")
            for s in self._sessions.values():
                if not s.future.done():
                    s.future.set_exception(err)
            self._sessions.clear()
            self._order.clear()
            while self._ops:
                _, fut = self._ops.popleft()
                if not fut.done():
                    fut.set_exception(err)
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self.ranks.close()

    # ---- submission ------------------------------------------------------------------------
    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the driver thread (exclusive use of the ranks)."""
        fut: Future[T] = Future()
        with self._cv:
            if self._failure is not None:
                fut.set_exception(self._failure_error())
                return fut
            self._ops.append((fn, fut))
            self._cv.notify_all()
        return fut

    def check_generate(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise :class:`BadRequest` if ``prompt`` / ``params`` cannot be generated; no effect."""
        if not prompt:
            raise BadRequest("prompt is empty: give at least one input id")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise BadRequest(
                f"input id {_short_int(bad)} is outside the vocabulary [0, {self.vocab_size})"
            )
        if len(prompt) + params.max_new_tokens > self.max_context:
            raise BadRequest(
                f"prompt ({len(prompt)}) + max_new_tokens ({_short_int(params.max_new_tokens)}) "
                f"exceeds the context length {self.max_context}"
            )
        if params.seed is not None and not SEED_RANGE[0] <= params.seed <= SEED_RANGE[1]:
            raise BadRequest(f"seed {_short_int(params.seed)} is outside the int64 range")

    def submit_generate(
        self, prompt: list[int], params: SamplingParams, rid: str | None = None
    ) -> Future[GenerationResult]:
        """Queue one generation (not counted against any concurrency limit: health probes)."""
        return self.submit_batch([prompt], [params], [rid])[0]

    def submit_batch(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        rids: list[str | None],
        *,
        max_running: int | None = None,
        listeners: list[TokenListener | None] | None = None,
    ) -> list[Future[GenerationResult]]:
        """Queue every prompt of a request, or none of them.

        ``listeners`` (one per prompt, or None) are called on the driver thread with each
        sampled token and the weights version that produced it (streaming); they must be quick.

        Every prompt is checked (:meth:`check_generate`) before any is queued, so one bad
        prompt is a :class:`BadRequest` and nothing of the batch runs. ``max_running`` caps
        :attr:`num_running` (queued or running prompts) after admission: past it the whole
        batch is refused with :class:`EngineBusy` (503), nothing queued.
        """
        if not len(prompts) == len(params) == len(rids):
            raise BadRequest("one sampling_params and rid per prompt")
        if listeners is not None and len(listeners) != len(prompts):
            raise BadRequest("one listener per prompt")
        for prompt, sp in zip(prompts, params, strict=True):
            self.check_generate(prompt, sp)
        if self._released:
            raise ServerUnavailable(
                f"memory released ({', '.join(sorted(self._released))}): call "
                "/resume_memory_occupation before generating"
            )
        sessions: list[_Session] = []
        futs: list[Future[GenerationResult]] = []
        for i, (prompt, sp, rid) in enumerate(zip(prompts, params, rids, strict=True)):
            gen = torch.Generator()
            gen.manual_seed(sp.seed if sp.seed is not None else int(torch.randint(0, 2**62, ())))
            fut: Future[GenerationResult] = Future()
            sid = f"{rid or 'req'}#{next(self._ids)}"
            sess = _Session(sid, list(prompt), sp, fut, gen)
            sess.listener = listeners[i] if listeners is not None else None
            sess.scan = sp.stops.scan(sess.prompt, sp, self.eos_token_ids)
            sessions.append(sess)
            futs.append(fut)
        with self._cv:
            if self._failure is not None:
                raise self._failure_error()
            queued = [s for s in sessions if s.params.max_new_tokens > 0]
            if max_running is not None and len(self._sessions) + len(queued) > max_running:
                raise EngineBusy(
                    f"engine busy: {len(self._sessions)} generation requests are running and "
                    f"this one adds {len(queued)}; the limit is {max_running} "
                    "(--max-concurrent-requests); not queued, retry later"
                )
            for sess in sessions:
                if sess.params.max_new_tokens == 0:
                    sess.future.set_result(self._result(sess, {"type": "length", "length": 0}))
                    continue
                self._sessions[sess.sid] = sess
                self._order.append(sess.sid)
            self._cv.notify_all()
        return futs

    def cancel(self, futures: list[Future[GenerationResult]]) -> int:
        """Abort the generations behind ``futures`` (their client went away); thread-safe.

        Each unfinished one leaves the running set at once and its future is cancelled; the
        driver drops its state on the ranks before its next step. Returns how many were aborted.
        """
        wanted = {id(f) for f in futures}
        with self._cv:
            gone = [s for s in self._sessions.values() if id(s.future) in wanted]
            for sess in gone:
                del self._sessions[sess.sid]
                with contextlib.suppress(ValueError):
                    self._order.remove(sess.sid)
                sess.future.cancel()
            self._dropped.extend(gone)
            if gone:
                self._cv.notify_all()
        return len(gone)

    def _drop_rank_state(self, sess: _Session) -> None:
        """Driver thread only: free ``sess``'s KV state on the ranks, once."""
        if sess.started and not sess.ended and self.ranks.failure is None:
            with contextlib.suppress(ServerError):
                self.ranks.call("end", {"sid": sess.sid})
        sess.ended = True

    # ---- driver ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            job: tuple[Callable[[], Any], Future[Any]] | None = None
            sess: _Session | None = None
            with self._cv:
                while (
                    not self._stopping
                    and not self._ops
                    and not self._runnable()
                    and not self._dropped
                ):
                    self._cv.wait()
                if self._stopping:
                    return
                dropped, self._dropped = self._dropped, []
                if dropped:
                    pass  # cancelled sessions first: their KV state is freed before anything
                elif self._ops:
                    job = self._ops.popleft()
                else:
                    sid = self._order[0]
                    self._order.rotate(-1)
                    sess = self._sessions[sid]
            for gone in dropped:
                self._drop_rank_state(gone)
            if job is not None:
                fn, fut = job
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(fn())
                except BaseException as exc:
                    if not fut.done():
                        fut.set_exception(exc)
                    self._maybe_fail(exc)
            elif sess is not None:
                try:
                    self._step(sess)
                except BaseException as exc:
                    self._finish(sess, None, exc)
                    self._maybe_fail(exc)

    def _failure_error(self) -> ServerError:
        if self._dead:
            return EngineDead(str(self._failure))
        return RankFailure(f"engine failed: {self._failure}")

    # ---- vLLM dialect: poisoned weights and death -------------------------------------------
    @property
    def poisoned(self) -> str | None:
        """Why the weights cannot be used (vLLM dialect), or None."""
        return self._poison

    def poison(self, reason: str) -> None:
        """vLLM: a reload or weight update failed after it began replacing the weights (vLLM
        moves every layer to the meta device first and restores it only when the layer's new
        weights all arrived). ``/health`` stays 200; the next forward pass kills the engine.
        A later successful full reload or finished update clears it (:meth:`heal`)."""
        with self._cv:
            if self._poison is None:
                self._poison = reason

    def heal(self) -> None:
        with self._cv:
            self._poison = None

    def _fatal_forward(self) -> str | None:
        """Why a forward pass now would kill the engine (vLLM dialect), or None."""
        if self._poison is not None:
            return f"a forward pass over weights left unusable by a failed update ({self._poison})"
        if self._update_in_progress:
            return (
                "a forward pass in the middle of a weight update (between /start_weight_update "
                "and /finish_weight_update the weights are on the meta device)"
            )
        return None

    def _die(self, reason: str) -> None:
        """Driver thread: the engine core died. Everything in flight gets :class:`EngineDead`
        (500), later requests too, and :attr:`on_death` tells the server to exit."""
        with self._cv:
            if self._dead:
                return
            self._dead = True
        self.fail(f"engine core died: {reason}", EngineDead(reason))
        if self.on_death is not None:
            self.on_death(reason)

    def _maybe_fail(self, exc: BaseException) -> None:
        if isinstance(exc, RankFailure) and self.ranks.world_size > 1:
            self.fail(str(exc))

    def _runnable(self) -> bool:
        return bool(self._order) and self._paused is None and self._failure is None

    def _step(self, sess: _Session) -> None:
        if sess.future.done():  # failed/aborted elsewhere
            self._finish(sess, None)
            return
        fatal = self._fatal_forward()
        if fatal is not None:
            self._die(fatal)
            return
        feed = sess.prompt + sess.out if not sess.started else [sess.out[-1]]
        logits = self.ranks.call("forward", {"sid": sess.sid, "token_ids": feed})  # on the CPU
        sess.started = True
        with self._cv:
            if sess.sid not in self._sessions:
                return  # cancelled while its step ran: the token is dropped with the session
            self.tokens_generated += 1
            self.last_output_at = time.monotonic()
        scan = sess.scan
        assert scan is not None
        banned = [t for t in scan.banned(len(sess.out)) if 0 <= t < logits.numel()]
        if banned:  # the minimum of new tokens: EOS and stop token ids cannot be sampled yet
            logits = logits.clone()
            logits[banned] = float("-inf")
        tok, lp = sample_token(logits, sess.params, sess.generator)
        version = self.weight_version
        if not sess.spans or sess.spans[-1][0] != version:
            sess.spans.append((version, len(sess.out)))
        sess.out.append(tok)
        sess.logprobs.append(lp)
        if sess.listener is not None:
            sess.listener(tok, version, lp)
        reason = scan.after(sess.out)
        if reason is not None:
            self._finish(sess, reason)
        elif self._stall_at is not None and len(sess.out) >= self._stall_at:
            with self._cv:  # stalled (fault injection): off the schedule, still running
                self._stall_at = None
                self.stalled += 1
                if sess.sid in self._order:
                    self._order.remove(sess.sid)

    def _result(self, sess: _Session, reason: dict[str, Any]) -> GenerationResult:
        return GenerationResult(
            sess.prompt,
            list(sess.out),
            reason,
            list(sess.logprobs),
            self.weight_version,
            time.monotonic() - sess.t0,
            weight_spans(sess.spans, self.weight_version, len(sess.out)),
            sess.scan.text(sess.out, reason) if sess.scan is not None else None,
        )

    def _finish(
        self, sess: _Session, reason: dict[str, Any] | None, exc: BaseException | None = None
    ) -> None:
        with self._cv:
            self._sessions.pop(sess.sid, None)
            if sess.sid in self._order:
                self._order.remove(sess.sid)
        if isinstance(exc, RankFailure):
            sess.ended = True  # the ranks are gone or failed: nothing to free
        self._drop_rank_state(sess)
        if sess.future.done():
            return
        with contextlib.suppress(InvalidStateError):  # its client cancelled it just now
            if exc is not None:
                sess.future.set_exception(exc)
            elif reason is not None:
                sess.future.set_result(self._result(sess, reason))

    def _abort_all(self, message: str) -> int:
        """Driver thread only: finish every session with ``finish_reason.type == "abort"``."""
        with self._cv:
            sessions = list(self._sessions.values())
        for s in sessions:
            self._finish(s, {"type": "abort", "message": message})
        return len(sessions)

    # ---- control (called from HTTP handlers; return futures) -------------------------------
    def pause(self, mode: str) -> Future[None]:
        if mode not in PAUSE_MODES:
            raise BadRequest(f"pause mode must be one of {list(PAUSE_MODES)}, got {mode!r}")

        def run() -> None:
            with self._cv:
                self._paused = mode
            if mode == "abort":
                self._abort_all("aborted by pause_generation")
            elif mode == "retract":
                with self._cv:
                    sessions = [s for s in self._sessions.values() if s.started]
                for s in sessions:  # free KV; re-prefill prompt + output on continue
                    self.ranks.call("end", {"sid": s.sid})
                    s.started = False
                    with self._cv:  # a stalled one is queued again, as every retracted one
                        if s.sid in self._sessions and s.sid not in self._order:
                            self._order.append(s.sid)

        return self.submit(run)

    def stall_next(self, tokens: int | None) -> None:
        """Fault injection (``POST /fault/stall``): the next generation to reach ``tokens``
        output tokens (without finishing there) is taken off the schedule: it makes no more
        tokens, and keeps its state, until it is aborted (a pause in ``abort`` mode, an
        abort, its client gone), retracted (a pause in ``retract`` mode queues it again, as
        every retracted request) or the engine fails. One generation, once; ``None`` disarms
        (a generation already stalled stays so)."""
        if tokens is not None and (isinstance(tokens, bool) or tokens < 1):
            raise BadRequest(f"'after_tokens' must be an int >= 1 or null, got {tokens!r}")
        with self._cv:
            self._stall_at = tokens

    def stall_state(self) -> dict[str, int | None]:
        """``{"armed": tokens or None, "stalled": generations stalled so far}``
        (``GET /fault/stall``: a test waits for its generation to be held)."""
        with self._cv:
            return {"armed": self._stall_at, "stalled": self.stalled}

    def resume_generation(self) -> None:
        with self._cv:
            self._paused = None
            self._cv.notify_all()

    def abort_all(self) -> Future[int]:
        return self.submit(lambda: self._abort_all("aborted by request"))

    def flush_cache(self) -> Future[bool]:
        def run() -> bool:
            if self._sessions:
                raise BadRequest(f"cache not flushed: {len(self._sessions)} requests are running")
            self.ranks.call("drop_sessions")
            return True

        return self.submit(run)

    # ---- weights ---------------------------------------------------------------------------
    #: seconds a weight-update group setup (``/init_weights_update_group``, vLLM
    #: ``/init_weight_transfer_engine``) may take when the request names no deadline, capped by
    #: ``--weight-group-timeout``; settable per engine
    group_init_timeout_s: float = 60.0
    #: after a failed or late setup, how long its answer waits for the ranks to be cleaned up
    _GROUP_CLEANUP_WAIT_S = 2.0

    def _two_phase(
        self,
        op: str,
        args: dict[str, Any] | None,
        per_rank: list[dict[str, Any]] | None,
        weight_version: str | None,
        allow_non_finite: bool = False,
    ) -> list[str]:
        """One call of a weight update, all-or-nothing on every rank (driver thread).

        Phase 1 (``op``): every rank stages and checks the whole call -- names, shapes, dtypes,
        every tensor materialized (not ``meta``, dense, its storage holding its data) on the
        rank's device or the host, finite unless ``allow_non_finite``; nothing live changes.
        Any refusal on any rank makes every rank discard, and its named error (a 4xx) is raised
        with the previous weights and version everywhere. Phase 2 (``commit``): every rank
        copies its checked staging into its weights, a pure copy that cannot fail for data
        reasons; should it fail anyway (a device fault), the engine marks itself failed rather
        than serve weights that are half one version and half the other.

        A call of a delta update (:mod:`.deltas`) is held by every rank instead of staged, and
        the versioned call then applies the whole delta (:meth:`_apply_delta`), all or nothing.
        """
        if "weights" in self._released:
            raise WeightUpdateError(
                "weights are released: call /resume_memory_occupation before updating them"
            )
        allow = bool(allow_non_finite or self.allow_non_finite)
        stage_args = {**(args or {}), "allow_non_finite": allow}
        try:
            self.ranks.call(op, stage_args, per_rank)
        except BaseException:
            if self.ranks.failure is None:
                with contextlib.suppress(ServerError):
                    self.ranks.call("discard")
            raise
        # an nccl call that is not an update's last (no version) is answered once its copies
        # are queued, so the next call's receive overlaps them (SGLang answers these calls
        # without a device sync too); every other call waits for its copies
        sync = not (op == "stage_distributed" and weight_version is None)
        names = self._commit(sync)
        if weight_version is not None and self.ranks.local.delta.pending:
            # the versioned call of a delta update: apply the held delta now (rank 0's
            # holding mirrors every rank's: they all received the same calls)
            names = self._apply_delta(weight_version, allow)
        # the version moves only with the call that carries it, once that call committed on
        # every rank: buckets sent without it (or failing) leave the previous version served
        if weight_version is not None:
            self.weight_version = weight_version
        return names

    def _commit(self, sync: bool = True) -> list[str]:
        """Phase 2 on every rank; a failure here marks the engine failed (see _two_phase)."""
        try:
            names: list[str] = self.ranks.call("commit", {"sync": sync})
        except BaseException as exc:
            reason = (
                f"a weight commit failed after every rank validated it ({exc}); the weights "
                "may mix two versions"
            )
            self.fail(reason)
            raise RankFailure(f"engine failed: {reason}") from exc
        return names

    def _apply_delta(self, weight_version: str | None, allow_non_finite: bool) -> list[str]:
        """Driver thread: apply the delta every rank holds onto the weights served now, all or
        nothing. Phase 1 (``stage_delta``): every rank builds and checks the new tensors (base
        version, format, result digests, finite) and stages them; any refusal on any rank
        (:class:`~.errors.DeltaRefused`, 400) makes every rank discard its staging and its held
        delta, weights and version unchanged. Phase 2: the usual commit. The caller sets the
        version; ``weight_version`` None (vLLM's finish without one): the delta's own."""
        header = self.ranks.local.delta.header
        assert header is not None
        model = self.ranks.local.model
        args = {
            "current_version": self.weight_version,
            "weight_version": weight_version,
            "gather_lm_head": LM_HEAD in header.touched and not model.tied,
            "allow_non_finite": allow_non_finite,
        }
        try:
            self.ranks.call("stage_delta", args)
        except BaseException:
            if self.ranks.failure is None:
                with contextlib.suppress(ServerError):
                    self.ranks.call("discard")
            raise
        names = self._commit()
        if weight_version is None:
            self.weight_version = header.version
        return names

    def apply_pending_delta(
        self, weight_version: str | None, *, allow_non_finite: bool = False
    ) -> Future[list[str] | None]:
        """vLLM dialect (``/finish_weight_update``): apply the delta the update's calls left
        held, if any (None: there was none), and move the version with it."""

        def run() -> list[str] | None:
            if not self.ranks.local.delta.pending:
                return None
            if "weights" in self._released:
                with contextlib.suppress(ServerError):
                    self.ranks.call("discard")
                raise WeightUpdateError(
                    "weights are released: call /resume_memory_occupation before updating them"
                )
            allow = bool(allow_non_finite or self.allow_non_finite)
            names = self._apply_delta(weight_version, allow)
            if weight_version is not None:
                self.weight_version = weight_version
            return names

        return self.submit(run)

    def drop_delta(self) -> Future[None]:
        """Drop a delta held by the ranks (its update was abandoned)."""

        def run() -> None:
            if self.ranks.local.delta.pending and self.ranks.failure is None:
                self.ranks.call("discard")

        return self.submit(run)

    def update_from_disk(
        self,
        model_path: str,
        weight_version: str | None,
        abort_all: bool = False,
        *,
        allow_non_finite: bool = False,
    ) -> Future[list[str]]:
        """Reload every weight from an HF directory; a bad path raises before anything is queued."""
        check_model_path(model_path)

        def run() -> list[str]:
            if abort_all:
                self._abort_all("aborted for a weight update")
            return self._two_phase(
                "stage_disk", {"model_path": model_path}, None, weight_version, allow_non_finite
            )

        return self.submit(run)

    def update_from_tensor(
        self, entries: list[Any], weight_version: str | None, *, allow_non_finite: bool = False
    ) -> Future[list[str]]:
        if len(entries) != self.ranks.world_size:
            raise WeightUpdateError(
                f"serialized_named_tensors has {len(entries)} entries; this engine has "
                f"{self.ranks.world_size} ranks (one entry per rank)"
            )
        per_rank = [{"entry": e} for e in entries]
        return self.submit(
            lambda: self._two_phase(
                "stage_tensor", None, per_rank, weight_version, allow_non_finite
            )
        )

    def validate_meta(self, meta: UpdateMeta) -> None:
        if any(is_delta_name(n) for n, _, _ in meta):
            specs = self.ranks.local.model.specs
            check_delta_meta(meta, specs)
            plain = [m for m in meta if not is_delta_name(m[0])]
            self.ranks.local.model.validate(plain)
            return
        self.ranks.local.model.validate(meta)

    def update_from_distributed(
        self,
        group_name: str,
        meta: UpdateMeta,
        flattened: bool,
        weight_version: str | None,
        *,
        chunk_bytes: int | None = None,
        allow_non_finite: bool = False,
    ) -> Future[list[str]]:
        """Receive one call's broadcast: per tensor, or ``flattened`` (one uint8 buffer, SGLang)
        cut into chunks of ``chunk_bytes`` (vLLM's packed transfer); see ``receive_broadcast``."""
        try:
            self.validate_meta(meta)
        except BadRequest:
            self.drop_delta()  # a delta this call belonged to is over: its parts go too
            raise
        if flattened:
            packed_layout(meta, chunk_bytes)  # an unaligned layout is a 400 before any receive
        if group_name not in self.ranks.local.weight_groups:
            raise WeightUpdateError(f"no weight update group {group_name!r}; call init first")
        args = {
            "group_name": group_name,
            "meta": meta,
            "flattened": flattened,
            "chunk_bytes": chunk_bytes,
        }
        return self.submit(
            lambda: self._two_phase(
                "stage_distributed", args, None, weight_version, allow_non_finite
            )
        )

    def update_from_ipc(
        self, zmq_handles: Any, weight_version: str | None, *, allow_non_finite: bool = False
    ) -> Future[list[str]]:
        if self.device.type != "cuda":
            from rollsafe.adapters.reference_engine.errors import Unsupported

            raise Unsupported(
                "update_weights_from_ipc needs CUDA (checkpoint-engine hands weights over as "
                "CUDA IPC buffers); this engine runs on cpu"
            )
        args = {"zmq_handles": zmq_handles}
        return self.submit(
            lambda: self._two_phase("stage_ipc", args, None, weight_version, allow_non_finite)
        )

    # Weight-update group setup. Joining a trainer's group is a rendezvous that lasts as long
    # as the trainer (or a dead address: a silent peer holds the store connect for minutes,
    # whatever its timeout) makes it, so it never runs on the driver thread: every rank joins
    # on a thread of its own (``ranks.GroupJoin``), the driver only starts, polls (between
    # generation steps) and installs or cancels the joins, each a pipe round trip, and a
    # waiter thread answers the request. The deadline is honoured here, not by the store: at
    # the deadline the request fails with a WeightUpdateError (400) whatever the ranks'
    # threads are doing; every rank then gives its join up, and a rendezvous that completes
    # later closes the group it made. Nothing is installed after the deadline.
    _group_inits_: dict[str, str] | None = None

    @property
    def _group_inits(self) -> dict[str, str]:
        """Setups in flight: group name -> token of the join (reserved until cleaned up)."""
        with self._cv:  # re-entrant
            if self._group_inits_ is None:
                self._group_inits_ = {}
            return self._group_inits_

    def init_group(self, *, timeout_s: float | None = None, **kwargs: Any) -> Future[None]:
        """Join the trainer's weight-update group ``kwargs["group_name"]`` on every rank.

        ``kwargs`` are ``master_address``, ``master_port``, ``rank_offset``, ``world_size``,
        ``group_name`` and ``backend``. ``timeout_s`` is the deadline of the whole setup
        (default :attr:`group_init_timeout_s`, at most ``--weight-group-timeout``); the
        returned future fails with :class:`WeightUpdateError` once it passes, and generation
        runs meanwhile. A name that exists or is being set up is refused at once.
        """
        check_group_args(kwargs, self.ranks.world_size)  # before any rank is asked
        name = kwargs["group_name"]
        if timeout_s is None:
            timeout_s = min(self.group_init_timeout_s, self.ranks.opts.weight_group_timeout_s)
        if (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, (int, float))
            or not math.isfinite(timeout_s)
            or timeout_s <= 0
        ):
            raise BadRequest(f"the setup timeout must be a positive number, got {timeout_s!r}")
        token = uuid.uuid4().hex
        with self._cv:
            if name in self.ranks.local.weight_groups:
                raise WeightUpdateError(f"weight update group {name!r} already exists")
            if name in self._group_inits:
                raise WeightUpdateError(f"weight update group {name!r} is already being set up")
            self._group_inits[name] = token
        timeout = float(timeout_s)
        deadline = time.monotonic() + timeout
        fut: Future[None] = Future()
        args = {**kwargs, "token": token, "timeout_s": timeout}
        start = self.submit(lambda: self.ranks.call("init_group_start", args))
        waiter = threading.Thread(
            target=self._await_group,
            args=(name, token, timeout, deadline, start, fut, kwargs),
            name=f"group-init-{name}",
            daemon=True,
        )
        waiter.start()
        return fut

    def _await_group(
        self,
        name: str,
        token: str,
        timeout: float,
        deadline: float,
        start: Future[Any],
        fut: Future[None],
        kwargs: dict[str, Any],
    ) -> None:
        """Waiter thread of one setup: poll the ranks' joins until done, failed or late."""
        late = WeightUpdateError(
            f"weight update group {name!r}: the rendezvous with "
            f"{kwargs.get('master_address')}:{kwargs.get('master_port')} did not complete "
            f"within {timeout:g}s; the group was not created (every rank gave its join up)"
        )
        error: BaseException | None = None
        try:
            self._wait_op(start, deadline, late)
            pause = 0.01
            while not self._wait_op(
                self.submit(lambda: self._group_step(name, token, deadline, late)), deadline, late
            ):
                if self._stopping:
                    raise ServerUnavailable("the engine is stopping")
                time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
                pause = min(2 * pause, 0.1)
        except BaseException as exc:
            error = exc
        if error is None:
            with self._cv:
                self._group_inits.pop(name, None)
            fut.set_result(None)
            return
        cleanup = self.submit(lambda: self._cancel_group(name, token))
        try:
            cleanup.result(timeout=self._GROUP_CLEANUP_WAIT_S)
        except BaseException:
            if cleanup.done():  # the driver is gone (engine failed): nothing left to clean
                with self._cv:
                    if self._group_inits.get(name) == token:
                        del self._group_inits[name]
        fut.set_exception(error)

    @staticmethod
    def _wait_op(op: Future[Any], deadline: float, late: BaseException) -> Any:
        """``op``'s result, or ``late`` once ``deadline`` passes (``op`` cancelled if queued)."""
        try:
            return op.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            op.cancel()
            raise late from None

    def _group_step(self, name: str, token: str, deadline: float, late: BaseException) -> bool:
        """Driver thread: ``True`` once every rank joined and the group is installed."""
        if time.monotonic() >= deadline:
            raise late
        done = self.ranks.call_all("init_group_poll", {"group_name": name, "token": token})
        if not all(done):
            return False
        self.ranks.call("init_group_finish", {"group_name": name, "token": token})
        return True

    def _cancel_group(self, name: str, token: str) -> None:
        """Driver thread: give setup ``token`` up on every rank, then free its name."""
        try:
            if self.ranks.failure is None:
                self.ranks.call("init_group_cancel", {"group_name": name, "token": token})
        finally:
            with self._cv:
                if self._group_inits.get(name) == token:
                    del self._group_inits[name]

    def destroy_group(self, group_name: str) -> Future[None]:
        if group_name in self._group_inits:
            raise WeightUpdateError(f"weight update group {group_name!r} is being set up")
        if group_name not in self.ranks.local.weight_groups:
            raise WeightUpdateError(f"no weight update group {group_name!r}")
        return self.submit(lambda: self.ranks.call("destroy_group", {"group_name": group_name}))

    def full_named_tensors(self) -> dict[str, torch.Tensor]:
        """Driver thread only: the full unsharded parameters (lm_head gathered from ranks)."""
        if "weights" in self._released:
            raise ServerUnavailable("weights are released")
        head = self.ranks.call("gather_lm_head")
        out = dict(self.ranks.local.local_tensors())
        if head is not None:
            out[LM_HEAD] = head
        return out

    # ---- SGLang /weights_checker: each TP rank's own parameters in SGLang's layout ----
    #: ``snapshot``: host copies of the full HF-named weights (each rank's parameters follow
    #: from them), and the ranks still holding it (a rank's passing ``compare`` drops its own).
    _checker_snapshot: dict[str, torch.Tensor] | None = None
    _checker_holders: frozenset[int] = frozenset()

    def sglang_layout(self) -> EngineLayout:
        """How a real SGLang with this engine's ranks as its TP ranks holds this model
        (:mod:`rollsafe.engine_layout`): fused ``qkv_proj`` / ``gate_up_proj``, each rank's
        shard, the vocabulary padded (``LayoutError`` for an architecture it has no rule for)."""
        return EngineLayout.from_config(
            self.ranks.local.model.config, tp_size=self.ranks.world_size, engine="sglang"
        )

    def checker_checksums(self, skip: tuple[str, ...] = ()) -> Future[list[dict[str, str]]]:
        """SGLang ``checksum``: per TP rank, ``{name: digest}`` of that rank's own parameters
        (:meth:`sglang_layout`) in SGLang's algorithm for this engine's device, leaving out the
        names that contain a ``skip`` substring (matched on SGLang's names, as upstream) and
        the non-persistent buffers SGLang never hashes.

        The reference engine's own ranks hold a replicated trunk and its own ``lm_head`` rows,
        so the parameters are laid out on the driver from the full weights, one at a time, on
        the engine's device (``"sglang"`` resolves by the engine's device, as upstream hashes
        every tensor where it lives: on the GPU, SGLang's GPU hash)."""
        algo = algorithm_for("sglang", self.device)

        def run() -> list[dict[str, str]]:
            layout = self.sglang_layout()
            named = self.full_named_tensors()
            out: list[dict[str, str]] = []
            for rank in range(layout.tp_size):
                digests: dict[str, str] = {}
                for part in iter_rank_tensors(named, layout, rank, device=self.device):
                    kept = {n: t for n, t in part.items() if not any(p in n for p in skip)}
                    digests.update(weights_checksum(kept, algo)["tensors"])
                out.append(digests)
            return out

        return self.submit(run)

    def checker_snapshot(self) -> Future[None]:
        """SGLang ``snapshot``: every rank keeps a copy of its parameters (here: one host copy
        of the full weights, from which each rank's follow)."""

        def run() -> None:
            layout = self.sglang_layout()
            named = self.full_named_tensors()
            self._checker_snapshot = {n: t.detach().to("cpu", copy=True) for n, t in named.items()}
            self._checker_holders = frozenset(range(layout.tp_size))

        return self.submit(run)

    def checker_compare(self, skip: tuple[str, ...] = ()) -> Future[None]:
        """SGLang ``compare``: every rank that holds a snapshot compares its parameters with it
        bitwise (a ``skip`` substring of SGLang's name leaves a parameter out) and drops it when
        all are equal. As upstream, only TP rank 0's outcome is the answer (the other ranks'
        are logged there): ``BadRequest`` naming every parameter of rank 0 that differs, or
        rank 0 holding no snapshot."""

        def run() -> None:
            snap = self._checker_snapshot
            holders = set(self._checker_holders)
            answer: list[str] = []
            if snap is not None and holders:
                layout = self.sglang_layout()
                now = self.full_named_tensors()
                for rank in sorted(holders):
                    bad = _compare_rank(snap, now, layout, rank, skip)
                    if not bad:
                        holders.discard(rank)
                    if rank == 0:
                        answer = bad
            had_one = 0 in self._checker_holders
            self._checker_holders = frozenset(holders)
            if not holders:
                self._checker_snapshot = None
            if not had_one:
                raise BadRequest("compare: no snapshot (call action='snapshot' first)")
            if answer:
                raise BadRequest("check tensor equality failed:\n" + "\n".join(answer))

        return self.submit(run)

    def checker_reset(self, mode: str, skip: tuple[str, ...] = ()) -> Future[None]:
        """Overwrite every live weight on every rank: ``"random"`` (SGLang ``reset_tensors``)
        or ``"zero"`` (vLLM ``reset``). A ``skip`` substring keeps the weights of every SGLang
        parameter whose name contains it (``"v_proj"`` keeps ``qkv_proj``: q, k and v)."""
        if "weights" in self._released:
            raise ServerUnavailable("weights are released")

        def run() -> None:
            keep: tuple[str, ...] = ()
            if skip:
                packed = self.sglang_layout().packed
                names = self.ranks.local.model.specs
                keep = tuple(n for n in names if any(p in engine_name(n, packed) for p in skip))
            self.ranks.call("checker_reset", {"mode": mode, "keep": keep})

        return self.submit(run)

    def get_weight(self, name: str) -> Future[torch.Tensor]:
        if name not in self.ranks.local.model.specs:
            raise BadRequest(f"unknown parameter {name!r}")
        return self.submit(lambda: self.full_named_tensors()[name])

    def release(self, tags: list[str], *, backup: bool = False) -> Future[None]:
        def run() -> None:
            if self._sessions:
                raise BadRequest(
                    f"{len(self._sessions)} requests are running: pause_generation first"
                )
            if "weights" in tags and "weights" not in self._released:
                self.ranks.call("release", {"backup": backup})
            if "kv_cache" in tags:
                self.ranks.call("drop_sessions")
            self._released.update(tags)

        return self.submit(run)

    def resume_memory(self, tags: list[str]) -> Future[None]:
        def run() -> None:
            if "weights" in tags and "weights" in self._released:
                self.ranks.call("resume")
            self._released.difference_update(tags)

        return self.submit(run)

    # vLLM native weight-transfer bracket
    def begin_update(self) -> bool:
        """Open the bracket; False if one is open already (vLLM refuses a second start)."""
        with self._cv:
            if self._update_in_progress:
                return False
            self._update_in_progress = True
            return True

    def end_update(self) -> bool:
        """Close the bracket; False if none was open."""
        with self._cv:
            was = self._update_in_progress
            self._update_in_progress = False
            return was

    @property
    def update_in_progress(self) -> bool:
        return self._update_in_progress


def weight_spans(changes: list[tuple[str, int]], current: str, n_out: int) -> list[dict[str, Any]]:
    """``[{version, start, end}]`` over ``n_out`` output tokens from the (version, start) points
    where the serving weights changed; no tokens yet: one empty span of ``current``."""
    if not changes:
        return [{"version": current, "start": 0, "end": n_out}]
    ends = [start for _, start in changes[1:]] + [n_out]
    return [
        {"version": v, "start": start, "end": end}
        for (v, start), end in zip(changes, ends, strict=True)
    ]


def _short_int(value: int) -> str:
    """``value`` for an error message, bounded (a hostile int can have thousands of digits)."""
    return str(value) if abs(value) < 2**128 else f"<an integer of {value.bit_length()} bits>"


def _compare_rank(
    snap: dict[str, torch.Tensor],
    now: dict[str, torch.Tensor],
    layout: EngineLayout,
    rank: int,
    skip: tuple[str, ...],
) -> list[str]:
    """SGLang ``compare`` on TP rank ``rank``: one line per parameter of that rank (its SGLang
    name) whose bytes differ from the snapshot's, in upstream's wording; a parameter whose
    name contains a ``skip`` substring is left out."""
    bad = []
    pairs = zip(
        iter_rank_tensors(snap, layout, rank), iter_rank_tensors(now, layout, rank), strict=True
    )
    for before, after in pairs:
        for (name, want), (now_name, got) in zip(before.items(), after.items(), strict=True):
            if name != now_name:
                raise BadRequest(f"compare: snapshot parameter {name!r} against {now_name!r}")
            if any(p in name for p in skip):
                continue
            same_shape = want.shape == got.shape
            diff = (got.float() - want.float()).abs() if same_shape else None
            if diff is not None and not bool((diff != 0).any()):
                continue
            bad.append(
                f"name={name} "
                f"max_abs_err={float(diff.max()) if diff is not None else float('nan')} "
                f"mean_abs_err={float(diff.mean()) if diff is not None else float('nan')} "
                f"num_exceed={int((diff != 0).sum()) if diff is not None else -1} "
                f"expect=raw(shape={tuple(want.shape)} dtype={want.dtype}) "
                f"actual=raw(shape={tuple(got.shape)} dtype={got.dtype}) "
            )
    return bad
