"""No token from an engine not at the version it reports: every served token replayed on the
trainer's weights of that version.

The soak's traffic is greedy (temperature 0), and every answer says which weights made which of
its tokens (``rollsafe.segments``: group, ``weights_version``, ``token_range``, ``attempt``).
For each attempt, :class:`TokenCheck` runs the trainer's model with that version's tensors
(``torch.func.functional_call`` on a model of its own, never the trainer's) over the prompt and
the output so far, teacher-forced, and requires every token to be the argmax there: its logit at
most :data:`TIE` below the best one (float32 kernels of two engines may break a near tie
differently; a wrong version's token is not near the best). An attempt whose version changed
while it ran (a sync without a pause: the reference engine's SGLang dialect, as SGLang, keeps the
request's KV cache across the update) is replayed as the engine decoded it: the prefill with
the first token's version, then each token fed with the weights of the token it makes, onto the
KV cache computed so far. A token that is not the argmax is a violation naming the fleet, the
group, the version it claimed, the position, and the kept versions that would have made it.

Answers arrive on a queue (:meth:`TokenCheck.submit`) from the traffic threads and are checked
on the checker's thread; when it falls behind by more than :data:`MAX_BACKLOG` answers the
oldest are counted as ``skipped`` (never silently). A version older than the trainer keeps
(:data:`rig.KEEP_VERSIONS`) is counted ``unchecked``.
"""

from __future__ import annotations

import collections
import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["Answer", "TokenCheck"]

#: how far below the best logit a served token may be (float32, the tiny Llama's logits)
TIE = 2e-3
MAX_BACKLOG = 400


@dataclass(frozen=True)
class Answer:
    """One served answer: its fleet, the prompt and output ids, and its segments."""

    fleet: str
    kind: str  # plain / session
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    segments: tuple[Mapping[str, Any], ...]


@dataclass
class TokenStats:
    answers: int = 0
    segments: int = 0
    tokens: int = 0
    skipped: int = 0
    unchecked: int = 0
    worst_gap: float = 0.0
    by_version: collections.Counter[str] = field(default_factory=collections.Counter)

    def as_dict(self) -> dict[str, Any]:
        return {
            "answers_checked": self.answers,
            "segments_checked": self.segments,
            "tokens_checked": self.tokens,
            "answers_skipped_backlog": self.skipped,
            "segments_unchecked_old_version": self.unchecked,
            "worst_gap_below_best_logit": round(self.worst_gap, 6),
        }


class TokenCheck:
    """Replays answers on the trainer's versions (see the module); ``violation(msg)`` is called
    for a token that its claimed version would not have produced."""

    def __init__(
        self,
        model_dir: Path,
        weights_at: Callable[[int], Mapping[str, torch.Tensor] | None],
        violation: Callable[[str], None],
        kept: Callable[[], list[int]] = list,
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model.eval()  # type: ignore[no-untyped-call]
        # the KV cache's keyword: ``cache`` in newer transformers, ``past_key_values`` before
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.weights_at = weights_at
        self.kept = kept
        self.violation = violation
        self.stats = TokenStats()
        self._queue: collections.deque[Answer] = collections.deque()
        self._cond = threading.Condition()
        self._model_lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="soak-token-check", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, answer: Answer) -> None:
        with self._cond:
            self._queue.append(answer)
            while len(self._queue) > MAX_BACKLOG:
                self._queue.popleft()
                self.stats.skipped += 1
            self._cond.notify()

    def stop(self, drain_s: float = 30.0) -> None:
        """Check what is queued (up to ``drain_s``), then stop."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(drain_s)
        with self._cond:
            self.stats.skipped += len(self._queue)
            self._queue.clear()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait(1.0)
                if not self._queue:
                    return
                answer = self._queue.popleft()
            try:
                self.check(answer)
            except Exception as exc:  # a bug of the check: said, never a silent pass
                self.violation(f"token check failed to run: {type(exc).__name__}: {exc}")

    def check_now(self, answer: Answer, violation: Callable[[str], None]) -> None:
        """Check ``answer`` on the caller's thread, reporting to ``violation`` (the weight
        check's probe answers)."""
        self.check(answer, violation)

    def check(self, answer: Answer, violation: Callable[[str], None] | None = None) -> None:
        with self._model_lock:
            self._check(answer, violation or self.violation)

    def _check(self, answer: Answer, violation: Callable[[str], None]) -> None:
        self.stats.answers += 1
        ids = [*answer.prompt, *answer.output]
        n_prompt = len(answer.prompt)
        attempts: dict[Any, list[Mapping[str, Any]]] = {}
        for seg in answer.segments:
            start, end = (int(x) for x in seg["token_range"])
            if end > start:
                attempts.setdefault(seg.get("attempt"), []).append(seg)
        for segs in attempts.values():
            versions = [seg.get("weights_version") for seg in segs]
            weights = {v: self.weights_at(int(v)) for v in versions if v is not None}
            if None in versions or any(w is None for w in weights.values()):
                self.stats.unchecked += len(segs)
                continue
            self.stats.segments += len(segs)
            for v in versions:
                self.stats.by_version[str(v)] += 1
            if len(set(versions)) == 1:
                for seg in segs:
                    if not self._check_segment(answer, seg, ids, n_prompt, weights, violation):
                        return
            elif not self._replay(answer, segs, ids, n_prompt, weights, violation):
                return

    def _check_segment(
        self,
        answer: Answer,
        seg: Mapping[str, Any],
        ids: Sequence[int],
        n_prompt: int,
        weights: Mapping[Any, Mapping[str, torch.Tensor] | None],
        violation: Callable[[str], None],
    ) -> bool:
        """One version: one teacher-forced forward over the prompt and the output so far."""
        start, end = (int(x) for x in seg["token_range"])
        w = weights[seg.get("weights_version")]
        assert w is not None
        context = torch.tensor([list(ids[: n_prompt + end - 1])])
        with torch.no_grad():
            logits = torch.func.functional_call(self.model, dict(w), (context,)).logits[0]
        return all(
            self._judge(answer, seg, i, ids, n_prompt, logits[n_prompt + i - 1], violation)
            for i in range(start, end)
        )

    def _replay(
        self,
        answer: Answer,
        segs: Sequence[Mapping[str, Any]],
        ids: Sequence[int],
        n_prompt: int,
        weights: Mapping[Any, Mapping[str, torch.Tensor] | None],
        violation: Callable[[str], None],
    ) -> bool:
        """One attempt whose versions changed while it ran (an update without a pause: the
        engine keeps the request's KV cache): replayed as the engine decoded it, the prefill with
        its first token's version, then each token fed with the weights of the token it makes,
        onto the KV cache so far."""
        from transformers import DynamicCache

        label: dict[int, Mapping[str, Any]] = {}
        for seg in segs:
            start, end = (int(x) for x in seg["token_range"])
            for i in range(start, end):
                label[i] = seg
        first, last = min(label), max(label)

        def step(i: int, feed: Sequence[int], cache: Any) -> torch.Tensor:
            w = weights[label[i].get("weights_version")]
            assert w is not None
            kwargs = {self._cache_kw: cache, "use_cache": True}
            with torch.no_grad():
                out = torch.func.functional_call(
                    self.model, dict(w), (torch.tensor([list(feed)]),), kwargs
                )
            logits: torch.Tensor = out.logits[0, -1]
            return logits

        cache = DynamicCache()
        row = step(first, ids[: n_prompt + first], cache)
        for i in range(first, last + 1):
            if not self._judge(answer, label[i], i, ids, n_prompt, row, violation):
                return False
            if i < last:
                row = step(i + 1, [ids[n_prompt + i]], cache)
        return True

    def _judge(
        self,
        answer: Answer,
        seg: Mapping[str, Any],
        i: int,
        ids: Sequence[int],
        n_prompt: int,
        row: torch.Tensor,
        violation: Callable[[str], None],
    ) -> bool:
        """Token ``i`` against the logits ``row`` its version gives; a violation if it is not
        the argmax there (within :data:`TIE`)."""
        token = ids[n_prompt + i]
        gap = float(row.max() - row[token])
        self.stats.tokens += 1
        if gap <= TIE and bool(torch.isfinite(row).all()):
            self.stats.worst_gap = max(self.stats.worst_gap, gap)
            return True
        matches = self._versions_matching(ids[: n_prompt + i], token)
        violation(
            f"token {i} of a {answer.kind} answer of fleet {answer.fleet} (group "
            f"{seg.get('group')}, claimed weights v{seg.get('weights_version')}) is "
            f"{token}, {gap:.4g} below the best logit ({int(row.argmax())}) of that "
            "version: served by an engine not at the version it reports; the kept "
            f"versions whose argmax it is (teacher-forced): {matches or 'none'}; prompt "
            f"{len(answer.prompt)} ids, segments {list(answer.segments)}"
        )
        return False

    def _versions_matching(self, context: Sequence[int], token: int) -> list[int]:
        """The kept versions under which ``token`` is the argmax after ``context`` (for the
        violation's message: which weights did make it)."""
        found: list[int] = []
        x = torch.tensor([list(context)])
        for version in self.kept():
            weights = self.weights_at(version)
            if weights is None:
                continue
            with torch.no_grad():
                row = torch.func.functional_call(self.model, dict(weights), (x,)).logits[0, -1]
            if float(row.max() - row[token]) <= TIE:
                found.append(version)
        return found
