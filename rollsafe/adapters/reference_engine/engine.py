"""The reference engine's scheduler: one driver thread owns the ranks.

Owns request scheduling and the engine-level state machine of a serving process: generation
sessions (prefill, then one decode step at a time, round-robin across sessions), pause modes
(``abort`` / ``retract`` / ``in_place``), memory release, the tracked weight version, and
all-or-nothing weight updates (stage on every rank, then commit on every rank; any failure
discards every rank's staging and keeps the previous weights and version). Every operation that
touches the ranks runs on the driver thread, so collectives never interleave; HTTP handlers get
``concurrent.futures.Future`` objects. A rank failure fails every pending future at once.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from rollsafe.adapters.reference_engine.errors import (
    BadRequest,
    EngineError,
    EngineUnavailable,
    RankFailure,
    WeightUpdateError,
)
from rollsafe.adapters.reference_engine.model import LM_HEAD
from rollsafe.adapters.reference_engine.ranks import RankSet
from rollsafe.adapters.reference_engine.weights import UpdateMeta, check_model_path, packed_layout
from rollsafe.checksum import WeightsChecksum, algorithm_for, weights_checksum

__all__ = ["GenerationResult", "ReferenceEngine", "SamplingParams"]

T = TypeVar("T")
PAUSE_MODES = ("abort", "retract", "in_place")


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


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: dict[str, Any]
    output_logprobs: list[float]
    weight_version: str
    latency_s: float


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
    t0: float = field(default_factory=time.monotonic)


def sample_token(
    logits: torch.Tensor, params: SamplingParams, gen: torch.Generator
) -> tuple[int, float]:
    """Greedy when ``temperature == 0``; else temperature / top-k / top-p sampling."""
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    if params.temperature <= 0.0:
        tok = int(torch.argmax(logits))
        return tok, float(logp[tok])
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
    return tok, float(logp[tok])


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
        self.vocab_size = ranks.local.model.vocab_size
        self.device = ranks.local.device
        self._cv = threading.Condition()
        self._ops: collections.deque[tuple[Callable[[], Any], Future[Any]]] = collections.deque()
        self._sessions: dict[str, _Session] = {}
        self._order: collections.deque[str] = collections.deque()
        self._ids = itertools.count()
        self._paused: str | None = None
        self._released: set[str] = set()
        self._failure: str | None = None
        self._stopping = False
        self._update_in_progress = False  # vLLM start/finish_weight_update bracket
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
        return len(self._sessions)

    def fail(self, reason: str) -> None:
        """Mark the engine unhealthy; every pending request and operation gets an error now."""
        with self._cv:
            if self._failure is None:
                self._failure = reason
            err = RankFailure(f"engine failed: {reason}")
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
                fut.set_exception(RankFailure(f"engine failed: {self._failure}"))
                return fut
            self._ops.append((fn, fut))
            self._cv.notify_all()
        return fut

    def submit_generate(
        self, prompt: list[int], params: SamplingParams, rid: str | None = None
    ) -> Future[GenerationResult]:
        if not prompt:
            raise BadRequest("prompt is empty: give at least one input id")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise BadRequest(f"input id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if len(prompt) + params.max_new_tokens > self.max_context:
            raise BadRequest(
                f"prompt ({len(prompt)}) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                f"context length {self.max_context}"
            )
        if self._released:
            raise EngineUnavailable(
                f"memory released ({', '.join(sorted(self._released))}): call "
                "/resume_memory_occupation before generating"
            )
        sid = f"{rid or 'req'}#{next(self._ids)}"
        gen = torch.Generator()
        gen.manual_seed(
            params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()))
        )
        fut: Future[GenerationResult] = Future()
        sess = _Session(sid, list(prompt), params, fut, gen)
        with self._cv:
            if self._failure is not None:
                raise RankFailure(f"engine failed: {self._failure}")
            if params.max_new_tokens == 0:
                fut.set_result(self._result(sess, {"type": "length", "length": 0}))
                return fut
            self._sessions[sid] = sess
            self._order.append(sid)
            self._cv.notify_all()
        return fut

    # ---- driver ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            job: tuple[Callable[[], Any], Future[Any]] | None = None
            sess: _Session | None = None
            with self._cv:
                while not self._stopping and not self._ops and not self._runnable():
                    self._cv.wait()
                if self._stopping:
                    return
                if self._ops:
                    job = self._ops.popleft()
                else:
                    sid = self._order[0]
                    self._order.rotate(-1)
                    sess = self._sessions[sid]
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

    def _maybe_fail(self, exc: BaseException) -> None:
        if isinstance(exc, RankFailure) and self.ranks.world_size > 1:
            self.fail(str(exc))

    def _runnable(self) -> bool:
        return bool(self._order) and self._paused is None and self._failure is None

    def _step(self, sess: _Session) -> None:
        if sess.future.done():  # failed/aborted elsewhere
            self._finish(sess, None)
            return
        feed = sess.prompt + sess.out if not sess.started else [sess.out[-1]]
        logits = self.ranks.call("forward", {"sid": sess.sid, "token_ids": feed})  # on the CPU
        sess.started = True
        tok, lp = sample_token(logits, sess.params, sess.generator)
        sess.out.append(tok)
        sess.logprobs.append(lp)
        p = sess.params
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
        if tok in stops and len(sess.out) >= p.min_new_tokens:
            self._finish(sess, {"type": "stop", "matched": tok})
        elif len(sess.out) >= p.max_new_tokens:
            self._finish(sess, {"type": "length", "length": len(sess.out)})

    def _result(self, sess: _Session, reason: dict[str, Any]) -> GenerationResult:
        return GenerationResult(
            sess.prompt,
            list(sess.out),
            reason,
            list(sess.logprobs),
            self.weight_version,
            time.monotonic() - sess.t0,
        )

    def _finish(
        self, sess: _Session, reason: dict[str, Any] | None, exc: BaseException | None = None
    ) -> None:
        with self._cv:
            self._sessions.pop(sess.sid, None)
            if sess.sid in self._order:
                self._order.remove(sess.sid)
        if sess.started and self.ranks.failure is None and not isinstance(exc, RankFailure):
            try:
                self.ranks.call("end", {"sid": sess.sid})
            except EngineError:
                pass
        if sess.future.done():
            return
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

        return self.submit(run)

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
    def _two_phase(
        self,
        op: str,
        args: dict[str, Any] | None,
        per_rank: list[dict[str, Any]] | None,
        weight_version: str | None,
    ) -> list[str]:
        if "weights" in self._released:
            raise WeightUpdateError(
                "weights are released: call /resume_memory_occupation before updating them"
            )
        try:
            self.ranks.call(op, args, per_rank)
        except BaseException:
            if self.ranks.failure is None:
                self.ranks.call("discard")
            raise
        # an nccl call that is not an update's last (no version) is answered once its copies
        # are queued, so the next call's receive overlaps them (SGLang answers these calls
        # without a device sync too); every other call waits for its copies
        sync = not (op == "stage_distributed" and weight_version is None)
        names: list[str] = self.ranks.call("commit", {"sync": sync})
        # the version moves only with the call that carries it, once that call committed on
        # every rank: buckets sent without it (or failing) leave the previous version served
        if weight_version is not None:
            self.weight_version = weight_version
        return names

    def update_from_disk(
        self, model_path: str, weight_version: str | None, abort_all: bool = False
    ) -> Future[list[str]]:
        """Reload every weight from an HF directory; a bad path raises before anything is queued."""
        check_model_path(model_path)

        def run() -> list[str]:
            if abort_all:
                self._abort_all("aborted for a weight update")
            return self._two_phase("stage_disk", {"model_path": model_path}, None, weight_version)

        return self.submit(run)

    def update_from_tensor(
        self, entries: list[Any], weight_version: str | None
    ) -> Future[list[str]]:
        if len(entries) != self.ranks.world_size:
            raise WeightUpdateError(
                f"serialized_named_tensors has {len(entries)} entries; this engine has "
                f"{self.ranks.world_size} ranks (one entry per rank)"
            )
        per_rank = [{"entry": e} for e in entries]
        return self.submit(lambda: self._two_phase("stage_tensor", None, per_rank, weight_version))

    def validate_meta(self, meta: UpdateMeta) -> None:
        self.ranks.local.model.validate(meta)

    def update_from_distributed(
        self,
        group_name: str,
        meta: UpdateMeta,
        flattened: bool,
        weight_version: str | None,
        *,
        chunk_bytes: int | None = None,
    ) -> Future[list[str]]:
        """Receive one call's broadcast: per tensor, or ``flattened`` (one uint8 buffer, SGLang)
        cut into chunks of ``chunk_bytes`` (vLLM's packed transfer); see ``receive_broadcast``."""
        self.validate_meta(meta)
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
        return self.submit(lambda: self._two_phase("stage_distributed", args, None, weight_version))

    def update_from_ipc(self, zmq_handles: Any, weight_version: str | None) -> Future[list[str]]:
        if self.device.type != "cuda":
            from rollsafe.adapters.reference_engine.errors import Unsupported

            raise Unsupported(
                "update_weights_from_ipc needs CUDA (checkpoint-engine hands weights over as "
                "CUDA IPC buffers); this engine runs on cpu"
            )
        args = {"zmq_handles": zmq_handles}
        return self.submit(lambda: self._two_phase("stage_ipc", args, None, weight_version))

    def init_group(self, **kwargs: Any) -> Future[None]:
        name = kwargs["group_name"]
        if name in self.ranks.local.weight_groups:
            raise WeightUpdateError(f"weight update group {name!r} already exists")
        return self.submit(lambda: self.ranks.call("init_group", kwargs))

    def destroy_group(self, group_name: str) -> Future[None]:
        if group_name not in self.ranks.local.weight_groups:
            raise WeightUpdateError(f"no weight update group {group_name!r}")
        return self.submit(lambda: self.ranks.call("destroy_group", {"group_name": group_name}))

    def full_named_tensors(self) -> dict[str, torch.Tensor]:
        """Driver thread only: the full unsharded parameters (lm_head gathered from ranks)."""
        if "weights" in self._released:
            raise EngineUnavailable("weights are released")
        head = self.ranks.call("gather_lm_head")
        out = dict(self.ranks.local.local_tensors())
        if head is not None:
            out[LM_HEAD] = head
        return out

    #: SGLang ``/weights_checker`` ``snapshot`` (host copies), cleared by a passing ``compare``.
    _checker_snapshot: dict[str, torch.Tensor] | None = None

    def checksum(
        self, algorithm: str | None = None, skip: tuple[str, ...] = ()
    ) -> Future[WeightsChecksum]:
        """Digests of the full parameters on the driver thread, on rank 0's device.

        ``algorithm`` (see :mod:`rollsafe.checksum`) defaults to SGLang's choice for this
        engine's device. ``"sglang"`` is resolved by the *engine's* device, not per tensor: the
        gathered ``lm_head`` may sit on the host (gloo rank group) while upstream hashes every
        tensor on the GPU. Names containing a ``skip`` substring are left out.
        """
        algo = algorithm or "sglang"
        if algo == "sglang":
            algo = algorithm_for("sglang", self.device)

        def run() -> WeightsChecksum:
            named = self.full_named_tensors()
            return weights_checksum(
                {n: t for n, t in named.items() if not any(p in n for p in skip)}, algo
            )

        return self.submit(run)

    def checker_snapshot(self) -> Future[None]:
        """SGLang ``/weights_checker`` ``snapshot``: keep a host copy of the full parameters."""

        def run() -> None:
            named = self.full_named_tensors()
            self._checker_snapshot = {n: t.detach().to("cpu", copy=True) for n, t in named.items()}

        return self.submit(run)

    def checker_compare(self, skip: tuple[str, ...] = ()) -> Future[None]:
        """SGLang ``compare``: raise ``BadRequest`` naming every tensor that differs from the
        snapshot (bitwise, as upstream's raw compare); the snapshot is dropped on success."""

        def run() -> None:
            snap = self._checker_snapshot
            if snap is None:
                raise BadRequest("compare: no snapshot (call action='snapshot' first)")
            bad = []
            for name, now in self.full_named_tensors().items():
                if any(p in name for p in skip) or name not in snap:
                    continue
                want = snap[name]
                diff = (now.detach().float().cpu() - want.float()).abs()
                if want.shape != now.shape or bool((diff != 0).any()):
                    err = float(diff.max()) if want.shape == now.shape else float("nan")
                    mean = float(diff.mean()) if want.shape == now.shape else float("nan")
                    bad.append(
                        f"name={name} max_abs_err={err} mean_abs_err={mean} "
                        f"num_exceed={int((diff != 0).sum()) if want.shape == now.shape else -1} "
                        f"expect=raw(shape={tuple(want.shape)} dtype={want.dtype}) "
                        f"actual=raw(shape={tuple(now.shape)} dtype={now.dtype}) "
                    )
            if bad:
                raise BadRequest("check tensor equality failed:\n" + "\n".join(bad))
            self._checker_snapshot = None

        return self.submit(run)

    def checker_reset(self, mode: str, skip: tuple[str, ...] = ()) -> Future[None]:
        """Overwrite every live weight on every rank: ``"random"`` (SGLang ``reset_tensors``)
        or ``"zero"`` (vLLM ``reset``); names containing a ``skip`` substring are kept."""
        if "weights" in self._released:
            raise EngineUnavailable("weights are released")
        return self.submit(lambda: self.ranks.call("checker_reset", {"mode": mode, "skip": skip}))

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
    def begin_update(self) -> None:
        self._update_in_progress = True

    def end_update(self) -> bool:
        was = self._update_in_progress
        self._update_in_progress = False
        return was

    @property
    def update_in_progress(self) -> bool:
        return self._update_in_progress
